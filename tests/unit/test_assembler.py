"""The assembler on tiny models: placement, the shared prefix, selective recompute."""

import pytest
import torch

from cag.assembler import Assembler
from cag.generate import generate, stop_token_ids, stream_tokens
from cag.prompt import layout_for

TEXTS = ["Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris.",
         "Cache-augmented generation reuses the keys and values of documents.",
         "Paragraphs end with blank lines.\n\nNew paragraphs begin after them."]
QUESTION = "How many maps does Zorblat keep?"


@pytest.fixture
def parts(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(t) for t in TEXTS]
    return asm, chunks


def question_logits(lm, cache, q):
    with torch.inference_mode():
        return lm.model(input_ids=q[None], past_key_values=cache).logits[0]


def direct_logits(lm, asm, chunks, q):
    ids = torch.cat([asm.prefix_ids, *[c.token_ids for c in chunks], q])
    with torch.inference_mode():
        return lm.model(input_ids=ids[None]).logits[0, -q.numel():]


def test_full_recompute_equals_direct_context(tiny, parts):
    asm, chunks = parts
    q = asm.question_ids(QUESTION)
    placed = asm.place(chunks, recompute_ratio=1.0)
    assert placed.recomputed_tokens == sum(c.num_tokens for c in chunks)
    torch.testing.assert_close(question_logits(tiny, placed.cache, q), direct_logits(tiny, asm, chunks, q),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("select", ["deviation", "first_k"])
def test_blocked_recompute_is_the_dense_one(tiny, parts, select):
    """Queries in blocks, each over the keys it can see: the same cache as one dense masked forward."""
    asm, chunks = parts
    q = asm.question_ids(QUESTION)
    placed = {}
    for block in (3, 10**6):  # blocks of 3 queries; one block (the dense forward)
        asm.recompute_block = block
        placed[block] = asm.place(chunks, recompute_ratio=0.5, recompute_select=select, first_k=5)
    assert placed[3].recomputed_tokens == placed[10**6].recomputed_tokens > 6
    for blocked, dense in zip(placed[3].cache.layers, placed[10**6].cache.layers):
        torch.testing.assert_close(blocked.keys, dense.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(blocked.values, dense.values, atol=1e-5, rtol=0)
    asm.recompute_block = 3
    full = asm.place(chunks, recompute_ratio=1.0)
    torch.testing.assert_close(question_logits(tiny, full.cache, q), direct_logits(tiny, asm, chunks, q),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("key_scales", [None, (1.0, 0.9, 0.81)])
@pytest.mark.parametrize("block", [3, 10**6])
def test_the_question_read_in_the_recompute_forward_is_its_own_prefill(tiny, parts, key_scales, block):
    """`with_question`: the recompute's forward reads the question too. Its logits and the cache it
    leaves (question included) are what a separate question prefill over the finished cache gives,
    the rank key decay's scaled keys and a sliding window's kept tokens included; the generation
    that follows is the same."""
    asm, chunks = parts
    asm.recompute_block = block
    q = asm.question_ids(QUESTION)
    kw = dict(recompute_ratio=0.4, recompute_select="first_k", first_k=4, key_scales=key_scales)
    apart = asm.place(chunks, **kw)
    merged = asm.place(chunks, **kw, with_question=q)
    assert apart.question_logits is None and merged.recomputed_tokens == apart.recomputed_tokens > 6
    want = question_logits(tiny, apart.cache, q)[-1]  # extends apart.cache by the question
    torch.testing.assert_close(merged.question_logits, want, atol=1e-5, rtol=1e-5)  # Gemma-3: logits ~60
    for a, m in zip(apart.cache.layers, merged.cache.layers):
        assert a.get_seq_length() == m.get_seq_length()
        torch.testing.assert_close(m.keys, a.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(m.values, a.values, atol=1e-5, rtol=0)
    stops = stop_token_ids(tiny.tokenizer)
    again = asm.place(chunks, **kw)
    merged = asm.place(chunks, **kw, with_question=q)
    want = generate(tiny.model, tiny.tokenizer, again.cache, q, max_new_tokens=6, stop_ids=stops)
    got = "".join(step.text for step in stream_tokens(tiny.model, tiny.tokenizer, merged.cache, q, max_new_tokens=6,
                                                      stop_ids=stops, first_logits=merged.question_logits))
    assert got == want.text


def test_without_a_recompute_the_question_is_left_to_the_caller(tiny, parts):
    asm, chunks = parts
    q = asm.question_ids(QUESTION)
    placed = asm.place(chunks, with_question=q)
    assert placed.question_logits is None and placed.recomputed_tokens == 0
    assert placed.cache.get_seq_length() == placed.context_ids.numel()  # no room left behind for it


def test_no_recompute_keeps_each_chunk_as_stored(tiny, parts):
    asm, chunks = parts
    placed = asm.place(chunks, recompute_ratio=0.0)
    assert placed.recomputed_tokens == 0
    n_prefix = placed.prefix_tokens
    start = n_prefix + chunks[0].num_tokens
    second = chunks[1]
    positions = torch.arange(start, start + second.num_tokens)
    want_keys = tiny.adapter.rotate(second.keys, positions)
    for i, layer in enumerate(placed.cache.layers):
        total = placed.context_ids.numel()
        kept = layer.keys.shape[-2]
        lo = total - kept  # sliding layers keep only the tail of the sequence
        for j, pos in enumerate(positions.tolist()):
            if pos >= lo:
                torch.testing.assert_close(layer.keys[0, :, pos - lo], want_keys[i, :, j], atol=1e-5, rtol=0)
                torch.testing.assert_close(layer.values[0, :, pos - lo], second.values[i, :, j])


def test_partial_recompute_moves_toward_direct_context(tiny, parts):
    """The cache's distance to the target's joint prefill shrinks with r and vanishes at r = 1."""
    from transformers import DynamicCache
    asm, chunks = parts
    ids = asm.place(chunks).context_ids
    with torch.inference_mode():
        joint = tiny.model(input_ids=ids[None], past_key_values=DynamicCache(), use_cache=True).past_key_values

    def distance(ratio):
        cache = asm.place(chunks, recompute_ratio=ratio).cache
        total = 0.0
        for mine, ref in zip(cache.layers, joint.layers):
            n = mine.keys.shape[-2]  # a sliding layer keeps the tail only
            total += (mine.keys - ref.keys[..., -n:, :]).norm().item() + (mine.values - ref.values[..., -n:, :]).norm().item()
        return total

    d0, d_half, d1 = distance(0.0), distance(0.5), distance(1.0)
    assert d1 < 1e-3 < d0
    assert d_half < d0


def test_recompute_of_the_chunk_tokens_only_the_prefix_stays(tiny, parts):
    asm, chunks = parts
    placed = asm.place(chunks, recompute_ratio=0.3)
    n_ctx = sum(c.num_tokens for c in chunks)
    assert placed.recomputed_tokens == round(0.3 * n_ctx)
    assert placed.cache.get_seq_length() == placed.context_ids.numel()


def test_generation_from_assembled_cache_matches_direct(tiny, parts):
    asm, chunks = parts
    q = asm.question_ids(QUESTION)
    stops = stop_token_ids(tiny.tokenizer)
    got = generate(tiny.model, tiny.tokenizer, asm.place(chunks, recompute_ratio=1.0).cache, q,
                   max_new_tokens=8, stop_ids=stops)
    ids = torch.cat([asm.prefix_ids, *[c.token_ids for c in chunks], q])
    with torch.inference_mode():
        want = tiny.model.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   eos_token_id=sorted(stops))
    assert got.token_ids == want[0, ids.numel():].tolist()[: len(got.token_ids)]
    assert got.question_prefill_s > 0


def test_bad_ratio(parts):
    asm, chunks = parts
    with pytest.raises(ValueError):
        asm.place(chunks, recompute_ratio=1.5)


def test_question_guided_recompute_picks_where_the_question_looks(tiny, parts):
    """The chosen tokens are the top of the question's attention mass (smoothed over ±1),
    checked against the model's own attention weights from an eager forward."""
    asm, chunks = parts
    q = asm.question_ids(QUESTION)
    ids = asm.place(chunks).context_ids
    total, n_prefix = ids.numel(), asm.place(chunks).prefix_tokens
    n = round(0.2 * (total - n_prefix))
    # independent reference: eager attention probabilities of the joint sequence's question rows
    # over the assembled (chunk-independent) cache equal those of the placed cache + the question
    from transformers import DynamicCache
    cache = DynamicCache()  # every token in every layer; the model masks its sliding layers itself
    keys, values = _rotated(tiny, asm, chunks)
    for i in range(keys.shape[0]):
        cache.update(keys[i][None], values[i][None], i)
    impl = tiny.model.config._attn_implementation
    tiny.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = tiny.model(input_ids=q[None], past_key_values=cache, output_attentions=True)
    finally:
        tiny.model.set_attn_implementation(impl)
    mass = torch.stack([a[0, :, :, :total].float().mean(dim=(0, 1)) for a in out.attentions]).mean(0)
    mass[:n_prefix] = 0
    smooth = torch.nn.functional.max_pool1d(mass[None, None], 3, stride=1, padding=1)[0, 0] + 1e-3 * mass
    smooth[:n_prefix] = -1
    want = torch.sort(torch.topk(smooth, n).indices).values
    placed_q = asm.place(chunks, recompute_ratio=0.2, recompute_select="question", question_ids=q)
    assert placed_q.recomputed_tokens == n
    got = asm._question_guided(*_rotated(tiny, asm, chunks), ids, n_prefix, n, q)
    assert torch.equal(got, want)
    assert (got >= n_prefix).all()
    # and recomputing them moves the cache: the question's logits change
    assert not torch.allclose(question_logits(tiny, placed_q.cache, q), question_logits(tiny, asm.place(chunks).cache, q))


def _rotated(lm, asm, chunks):
    parts = [asm.prefix(), *chunks]
    keys = torch.cat([c.keys for c in parts], dim=2).to(lm.dtype)
    values = torch.cat([c.values for c in parts], dim=2).to(lm.dtype)
    return lm.adapter.rotate(keys, torch.arange(keys.shape[2])), values


def test_question_guided_recompute_needs_the_question(parts):
    asm, chunks = parts
    with pytest.raises(ValueError, match="question"):
        asm.place(chunks, recompute_ratio=0.2, recompute_select="question")
    with pytest.raises(ValueError, match="recompute_select"):
        asm.place(chunks, recompute_ratio=0.2, recompute_select="random")


def test_recompute_cache_writes_the_chosen_positions_in_place_once():
    """The recompute's cache is the placed buffer: a forward's K/V land at the chosen positions, the rest
    stay as placed, the length seen before the forward is the kept tokens', and a second write is refused."""
    from cag.models.attention import recompute_cache

    keys, values = torch.zeros(2, 3, 6, 4), torch.ones(2, 3, 6, 4)
    chosen = torch.tensor([1, 4])
    cache = recompute_cache(keys, values, chosen)
    assert cache.get_seq_length() == 4
    new = torch.full((1, 3, 2, 4), 7.0)
    k, v = cache.layers[0].update(new, new * 2)
    assert k.data_ptr() == keys[0].data_ptr() and cache.layers[0].get_seq_length() == 6
    assert torch.equal(keys[0, :, chosen], new[0]) and torch.equal(values[0, :, chosen], new[0] * 2)
    assert keys[0, :, [0, 2, 3, 5]].abs().sum() == 0 and keys[1].abs().sum() == 0  # nothing else written
    with pytest.raises(RuntimeError, match="one forward"):
        cache.layers[0].update(new, new)
    with pytest.raises(RuntimeError, match="one forward"):
        cache.layers[1].update(torch.zeros(1, 3, 3, 4), torch.zeros(1, 3, 3, 4))
