"""APE's context temperature and scale (#12): identity at T = S = 1, exact where it is defined."""

import pytest
import torch

from cag.assembler import Assembler
from cag.models.attention import context_temperature
from cag.prompt import layout_for

TEXTS = ["Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris.",
         "Cache-augmented generation reuses the keys and values of documents."]


def placed_logits(lm, asm, chunks, q, **kw):
    placed = asm.place(chunks)
    n = placed.context_ids.numel()
    with torch.inference_mode(), context_temperature(lm.model, placed.prefix_tokens, n, **kw):
        return lm.model(input_ids=q[None], past_key_values=placed.cache).logits[0]


def test_temperature_one_and_scale_one_leave_logits_unchanged(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(t) for t in TEXTS]
    q = asm.question_ids("How many maps?")
    torch.testing.assert_close(placed_logits(tiny, asm, chunks, q, temperature=1.0, scale=1.0),
                               placed_logits(tiny, asm, chunks, q), atol=0, rtol=0)


def test_adjustment_changes_logits_and_matches_scaled_keys(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(t) for t in TEXTS]
    q = asm.question_ids("How many maps?")
    base = placed_logits(tiny, asm, chunks, q)
    hot = placed_logits(tiny, asm, chunks, q, temperature=0.7)
    assert (hot - base).abs().max() > 1e-3
    # Temperature alone equals dividing the context's (rotated) keys by T in the cache, for every
    # query, in the full-attention layers (sliding layers are left as they are, by design).
    placed = asm.place(chunks)
    n, p = placed.context_ids.numel(), placed.prefix_tokens
    for kind, layer in zip(tiny.adapter.layer_types, placed.cache.layers):
        if kind == "full_attention":
            layer.keys[:, :, p:n] /= 0.7
    with torch.inference_mode():
        want = tiny.model(input_ids=q[None], past_key_values=placed.cache).logits[0]
    torch.testing.assert_close(hot, want, atol=2e-4, rtol=0)
    assert (placed_logits(tiny, asm, chunks, q, scale=0.5) - base).abs().max() > 1e-3


def test_bad_values_are_refused(tiny):
    with pytest.raises(ValueError):
        with context_temperature(tiny.model, 1, 2, temperature=0.0):
            pass


def test_per_head_offsets_equal_the_scale_when_uniform_and_act_per_head(tiny):
    """Offsets of log S in every layer and head are the scale S; an offset on one head moves only that head."""
    import math

    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(t) for t in TEXTS]
    q = asm.question_ids("How many maps?")
    config = tiny.model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    uniform = torch.full((layers, heads), math.log(0.5))
    torch.testing.assert_close(placed_logits(tiny, asm, chunks, q, offsets=uniform),
                               placed_logits(tiny, asm, chunks, q, scale=0.5), atol=1e-5, rtol=0)
    torch.testing.assert_close(placed_logits(tiny, asm, chunks, q, offsets=torch.zeros(layers, heads)),
                               placed_logits(tiny, asm, chunks, q), atol=1e-5, rtol=0)
    one = torch.zeros(layers, heads)
    one[list(tiny.adapter.layer_types).index("full_attention"), 0] = -3.0  # sliding layers are left alone
    assert (placed_logits(tiny, asm, chunks, q, offsets=one) - placed_logits(tiny, asm, chunks, q)).abs().max() > 1e-4
