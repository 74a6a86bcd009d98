"""Family adapters on tiny random models: rotation, placement, caches for model() and generate()."""

import pytest
import torch
from transformers import DynamicCache

from cag.kv import ForeignModelError, KVChunk
from cag.models.adapters import Gemma3Adapter, UnsupportedModelError, adapter_for
from cag.models.loaded import EmptyChunkError
from cag.models.selfcheck import SelfCheckFailed, run_selfcheck
from tests.tiny import TINY_SLIDING_WINDOW, tiny_loaded, tiny_model

TEXT_A = "Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris."
TEXT_B = "Cache-augmented generation reuses the keys and values of documents."
QUESTION = " How many maps does Zorblat keep?"


def joint_logits(lm, ids):
    with torch.inference_mode():
        return lm.model(input_ids=ids[None]).logits[0]


def test_rotation_is_invertible_at_any_position(tiny):
    a = tiny.adapter
    keys = torch.randn(a.num_layers, a.num_kv_heads, 33, a.head_dim)
    pos = torch.randint(0, 4000, (33,))
    torch.testing.assert_close(a.rotate(a.derotate(keys, pos), pos), keys, atol=1e-5, rtol=0)
    # rotation is not the identity (otherwise this test would prove nothing)
    assert (a.rotate(keys, pos) - keys).abs().max() > 0.1


def test_rotating_the_first_layers_equals_those_layers_of_the_whole(tiny):
    """A forward cut after n layers needs only their keys: each layer keeps its own RoPE (Gemma-3's
    sliding and full layers differ), and more layers than the model has is refused."""
    a = tiny.adapter
    keys = torch.randn(a.num_layers, a.num_kv_heads, 9, a.head_dim)
    pos = torch.arange(9) * 5 + 3
    whole = a.rotate(keys, pos)
    for n in range(1, a.num_layers + 1):
        torch.testing.assert_close(a.rotate(keys[:n], pos), whole[:n], atol=0, rtol=0)
    with pytest.raises(ValueError, match="layers"):
        a.rotate(torch.randn(a.num_layers + 1, a.num_kv_heads, 9, a.head_dim), pos)


def test_rotation_composes_by_relative_shift(tiny):
    """Rotating by p then by q equals rotating by p+q: what re-rotation relies on."""
    a = tiny.adapter
    keys = torch.randn(a.num_layers, a.num_kv_heads, 7, a.head_dim)
    p, q = torch.arange(7) * 3, torch.full((7,), 250)
    torch.testing.assert_close(a.rotate(a.rotate(keys, p), q), a.rotate(keys, p + q), atol=1e-4, rtol=0)


def test_prefill_drops_sink_and_keeps_offsets(tiny):
    chunk = tiny.prefill(TEXT_A)
    ids, offsets = tiny.tokenize(TEXT_A)
    assert torch.equal(chunk.token_ids, ids) and torch.equal(chunk.offsets, offsets)
    assert chunk.keys.shape == (tiny.adapter.num_layers, tiny.adapter.num_kv_heads, len(ids), tiny.adapter.head_dim)
    assert chunk.settings["sink_ids"] == tiny.sink_ids
    assert "".join(TEXT_A[s:e] for s, e in offsets.tolist()) == TEXT_A


def test_empty_text_is_refused(tiny):
    with pytest.raises(EmptyChunkError):
        tiny.prefill("")


def test_prefix_plus_chunk_equals_joint_prefill(tiny):
    """Sink prefix + one chunk is exactly the joint prefill of the same tokens (incl. Gemma's window)."""
    prefix, chunk = tiny.prefix_chunk(), tiny.prefill(TEXT_A)
    ids = torch.cat([prefix.token_ids, chunk.token_ids])
    assert ids.numel() > TINY_SLIDING_WINDOW
    q, _ = tiny.tokenize(QUESTION)
    cache = tiny.build_cache([prefix, chunk])
    with torch.inference_mode():
        got = tiny.model(input_ids=q[None], past_key_values=cache).logits[0]
    want = joint_logits(tiny, torch.cat([ids, q]))[-q.numel():]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_serialised_chunks_place_the_same(tiny):
    prefix, chunk = tiny.prefix_chunk(), tiny.prefill(TEXT_A)
    decoded = [KVChunk.from_bytes(c.to_bytes("float32"), expect_model=tiny.fingerprint) for c in (prefix, chunk)]
    q, _ = tiny.tokenize(QUESTION)
    with torch.inference_mode():
        a = tiny.model(input_ids=q[None], past_key_values=tiny.build_cache([prefix, chunk])).logits
        b = tiny.model(input_ids=q[None], past_key_values=tiny.build_cache(decoded)).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_second_chunk_layer0_matches_joint_prefill(tiny):
    """A chunk placed after another equals the joint prefill where the maths says it must:
    layer 0's K/V depend only on the token and its position, never on the context."""
    prefix, a, b = tiny.prefix_chunk(), tiny.prefill(TEXT_A), tiny.prefill(TEXT_B)
    ids = torch.cat([prefix.token_ids, a.token_ids, b.token_ids])
    cache = tiny.build_cache([prefix, a, b])
    with torch.inference_mode():
        joint = tiny.model(input_ids=ids[None], past_key_values=DynamicCache(), use_cache=True).past_key_values
    placed = torch.cat([prefix.keys, a.keys, b.keys], dim=2)
    placed = tiny.adapter.rotate(placed, torch.arange(ids.numel()))
    jk, jv = tiny.adapter.cache_tensors(joint)
    torch.testing.assert_close(placed[0], jk[0], atol=1e-5, rtol=0)
    # deeper layers of the second chunk differ: it never saw the first chunk
    assert (placed[-1, :, -b.num_tokens:] - jk[-1, :, -b.num_tokens:]).abs().max() > 1e-3
    # the cache object holds what a sliding window can still see, and the true length
    for i, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == ids.numel()
        kept = layer.keys.shape[-2]
        if tiny.adapter.layer_types[i] == "sliding_attention":
            assert kept == TINY_SLIDING_WINDOW - 1
            torch.testing.assert_close(layer.keys[0], placed[i, :, -kept:])
        else:
            assert kept == ids.numel()


def test_generate_from_built_cache_equals_generate_from_text(tiny):
    prefix, chunk = tiny.prefix_chunk(), tiny.prefill(TEXT_A)
    q, _ = tiny.tokenize(QUESTION)
    context = tiny.context_ids([prefix, chunk])
    full = torch.cat([context, q])[None]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = tiny.model.generate(full, **kwargs)
        got = tiny.model.generate(full, past_key_values=tiny.build_cache([prefix, chunk]), **kwargs)
    assert torch.equal(got, want)


def test_foreign_chunk_is_refused():
    llama, qwen = tiny_loaded("llama"), tiny_loaded("qwen2")
    with pytest.raises(ForeignModelError, match="translate"):
        qwen.build_cache([llama.prefill(TEXT_A)])
    other_seed = tiny_loaded("llama", seed=1)
    assert other_seed.fingerprint.id != llama.fingerprint.id
    with pytest.raises(ForeignModelError):
        other_seed.build_cache([llama.prefill(TEXT_A)])


def test_selfcheck_passes_on_every_family(tiny):
    report = run_selfcheck(tiny)
    assert report.passed, report.failures
    assert report.native_max_abs <= 1e-4 and report.roundtrip_max_abs <= 1e-3
    assert report.context_tokens > TINY_SLIDING_WINDOW


def test_selfcheck_catches_a_wrong_rope_base(monkeypatch):
    """Gemma's local layers use base 10k: rotating them with the global base must be refused."""
    lm = tiny_loaded("gemma3")
    monkeypatch.setattr(Gemma3Adapter, "_rope_key", lambda self, layer_type: "full_attention")
    broken = type(lm)(lm.name, lm.model, lm.tokenizer, Gemma3Adapter(lm.model), lm.fingerprint, lm.sink_ids)
    report = run_selfcheck(broken)
    assert not report.passed and any("offset" in f for f in report.failures)
    with pytest.raises(SelfCheckFailed, match="refuses"):
        raise SelfCheckFailed(report)


def test_unsupported_family():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="supported"):
        adapter_for(model)


def test_bf16_model_places_chunks_close_to_fp32():
    model, tok = tiny_model("qwen2")
    from cag.models.loaded import LoadedModel
    lm32 = LoadedModel.from_pretrained(model, tok, name="q")
    prefix, chunk = lm32.prefix_chunk(), lm32.prefill(TEXT_A)
    q, _ = lm32.tokenize(QUESTION)
    with torch.inference_mode():
        want = lm32.model(input_ids=q[None], past_key_values=lm32.build_cache([prefix, chunk])).logits
    # the registry passes the weight file's hash, so both precisions are one model
    lm16 = LoadedModel.from_pretrained(model.to(torch.bfloat16), tok, name="q",
                                       weights_hash=lm32.fingerprint.weights_hash)
    assert lm16.fingerprint.id == lm32.fingerprint.id
    stored = [KVChunk.from_bytes(c.to_bytes("bfloat16")) for c in (prefix, chunk)]
    with torch.inference_mode():
        got = lm16.model(input_ids=q[None], past_key_values=lm16.build_cache(stored)).logits
    assert got.dtype == torch.bfloat16
    assert (got.float().softmax(-1) - want.softmax(-1)).abs().max() < 0.05


def test_batched_prefill_equals_one_by_one(tiny):
    texts = [TEXT_A, TEXT_B, "Short one."]
    batched = tiny.prefill_batch(texts)
    for text, got in zip(texts, batched):
        want = tiny.prefill(text)
        assert torch.equal(got.token_ids, want.token_ids) and got.text_hash == want.text_hash
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=0)
        assert got.settings == want.settings


def test_the_cache_only_forward_leaves_the_whole_forwards_cache(tiny):
    """`forward_for_cache` skips the LM head and the last MLP; the cache it leaves is the full
    forward's, layer by layer, and it runs no further than the last layer's attention."""
    ids = tiny.tokenize(TEXT_A + TEXT_B)[0]
    whole, cut = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        tiny.model(input_ids=ids[None], past_key_values=whole, use_cache=True)
        calls = []
        handle = tiny.model.model.layers[-1].mlp.register_forward_hook(lambda *_: calls.append("mlp"))
        head = tiny.model.lm_head.register_forward_hook(lambda *_: calls.append("head"))
        try:
            tiny.forward_for_cache(cut, input_ids=ids[None])
        finally:
            handle.remove()
            head.remove()
    assert calls == []
    assert len(cut.layers) == len(whole.layers) == tiny.adapter.num_layers
    for a, b in zip(whole.layers, cut.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=0, rtol=0)
        torch.testing.assert_close(b.values, a.values, atol=0, rtol=0)
    # and the chunk prefill that uses it still stores the model's own states
    chunk = tiny.prefill(TEXT_A)
    assert chunk.keys.shape[2] == chunk.num_tokens == tiny.tokenize(TEXT_A)[0].numel()
