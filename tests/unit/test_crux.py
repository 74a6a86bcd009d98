"""Translate the bulk, prefill the crux (#9) on tiny models: whole-chunk recompute, and the
translated neighbours' key scale that stops them outdrawing the recomputed crux."""

from __future__ import annotations

import pytest
import torch

from cag.context import CachedContext, Timings
from tests.stores.test_build import HashEmbedder
from tests.unit.test_router import kb  # noqa: F401  (the fixture, shared)

QUESTION = "Zorblat maps?"


def ctx(kb, **kw):
    root, _, target = kb  # test_router's fixture: a tiny qwen2 store, a tiny llama target, a ridge mapper
    return CachedContext(store=root / "store", target=str(target), mapper=str(root / "mapper"),
                         embedder=HashEmbedder(), dtype="float32", max_new_tokens=4, top_k=3,
                         min_retention=0.0, translation_cache_mb=64, **kw)


def placed_keys(c: CachedContext):
    p = c.prepare(QUESTION)
    start, end = p.context_span
    return torch.stack([layer.keys[0] for layer in p.cache.layers]), start, end, p


def test_retriever_chunk_recomputes_the_best_chunk_whole(kb):
    c = ctx(kb, recompute_select="retriever_chunk", recompute_ratio=0.01)  # below a chunk: still one
    _, start, end, p = placed_keys(c)
    first = c.retrieve(QUESTION)[0]
    assert p.answer.recomputed_tokens > 0 and p.answer.path == "translated+repair"
    assert p.answer.sources[0].key == first.key  # score order: the best chunk is placed first
    assert p.answer.recomputed_tokens < end - start


def test_translated_key_scale_scales_translated_keys_only(kb):
    plain = ctx(kb, recompute_select="retriever_chunk", recompute_ratio=0.01)
    scaled = ctx(kb, recompute_select="retriever_chunk", recompute_ratio=0.01, translated_key_scale=0.5)
    k1, start, end, p = placed_keys(plain)
    k2, *_ = placed_keys(scaled)
    crux = p.answer.recomputed_tokens
    # The recomputed crux (the first placed chunk) sees only the head: the same native keys either way.
    torch.testing.assert_close(k2[:, :, :start + crux], k1[:, :, :start + crux])
    torch.testing.assert_close(k2[:, :, start + crux:end], 0.5 * k1[:, :, start + crux:end])
    # The LRU keeps the mapper's own keys: a later unscaled query is unchanged.
    scaled.translated_key_scale = 1.0
    k3, *_ = placed_keys(scaled)
    torch.testing.assert_close(k3, k1)


def test_the_repair_path_serves_the_mappers_repair_keys_and_the_plain_path_does_not(kb):
    """A +repair path places `Mapper.repair_keys` of the translations (an artifact with a correction
    fitted on that path), then the key scale; the plain path and the LRU keep the plain translations."""
    plain = ctx(kb)
    repaired = ctx(kb, recompute_select="retriever_chunk", recompute_ratio=0.01, translated_key_scale=0.5)
    k1, start, end, _ = placed_keys(plain)
    _, mapper, _ = repaired._ready()
    mapper.repair_keys = lambda keys: 3.0 * keys
    k2, _, _, p = placed_keys(repaired)
    crux = p.answer.recomputed_tokens
    torch.testing.assert_close(k2[:, :, start + crux:end], 1.5 * k1[:, :, start + crux:end])
    repaired.recompute_ratio = 0.0   # the plain path of the same context: the translations as kept
    repaired.translated_key_scale = 1.0
    k3, *_ = placed_keys(repaired)
    torch.testing.assert_close(k3, k1)


def test_translated_key_scale_leaves_the_native_path_alone(kb):
    root, small, _ = kb
    native = CachedContext(store=root / "store", target=str(small), embedder=HashEmbedder(),
                           dtype="float32", max_new_tokens=4, top_k=3, min_retention=0.0)
    k1, *_ = placed_keys(native)
    native.translated_key_scale = 0.5
    k2, *_ = placed_keys(native)
    torch.testing.assert_close(k1, k2)


def test_translated_key_scale_is_validated():
    with pytest.raises(ValueError):
        CachedContext(store="x", translated_key_scale=0.0)


def test_the_gates_repair_setting_brings_its_own_key_scale(kb):
    # The gate serves a +repair record as measured: a context left at scale 1 places the crux
    # path with the record's scale, exactly as a context configured with it.
    configured = ctx(kb, recompute_select="retriever_chunk", recompute_ratio=0.01, translated_key_scale=0.5)
    k1, *_ = placed_keys(configured)
    plain = ctx(kb)
    p = plain.prepare(QUESTION, repair={"ratio": 0.01, "select": "retriever_chunk", "translated_key_scale": 0.5})
    torch.testing.assert_close(torch.stack([layer.keys[0] for layer in p.cache.layers]), k1)
    assert p.answer.path == "translated+repair"


def test_the_retrievers_sentences_come_from_the_index_not_a_query_time_embedding(kb):
    """The store's build embedded every chunk's sentences; a query embeds only itself, and chooses
    exactly what embedding the sentences now would."""
    from cag import selection

    c = ctx(kb, recompute_select="retriever", recompute_ratio=0.2)
    p = c.prepare(QUESTION)
    _, index = c._current_view()
    assert all(index.sentence_vectors(h.key) is not None for h in p.answer.sources)
    calls = []
    embed = index._embedder

    class Counting:
        id, dim = embed.id, getattr(embed, "dim", None)

        def __call__(self, texts):
            calls.append(len(texts))
            return embed(texts)
    index._embedder = Counting()
    chunks, used = c._target_chunks(c._order(p.answer.sources), Timings(), [])
    spans = c._guided_spans(QUESTION, chunks, used, ratio=0.2, select="retriever")
    assert calls == []  # the query's search embedded the question: its vector is remembered
    index._recent.clear()
    assert c._guided_spans(QUESTION, chunks, used, ratio=0.2, select="retriever") == spans
    assert calls == [1]  # otherwise the question alone
    fresh = selection.retriever_spans(index.embed, chunks, [h.text for h in used], QUESTION,
                                      round(0.2 * sum(ch.num_tokens for ch in chunks)))
    assert spans == fresh and any(spans) and calls[-1] > 1


def test_source_retriever_fuses_the_two_choices_the_context_would_make(kb, monkeypatch):
    """`recompute_select="source_retriever"`: the source model's and the retriever's sentence rankings,
    rank-fused, from the same chunks and index vectors the two selectors read."""
    from cag import selection
    from cag.kv import KVChunk
    from cag.models import registry

    _, small, _ = kb
    load = registry.load  # the tiny source model is found by its folder, not by the name its chunks carry
    small_name = load(str(small), "float32").fingerprint.name
    monkeypatch.setattr(registry, "load", lambda name, dtype: load(str(small) if name == small_name else name, dtype))
    c = ctx(kb, recompute_select="source_retriever", recompute_ratio=0.2)
    p = c.prepare(QUESTION)
    assert p.answer.path == "translated+repair" and p.answer.recomputed_tokens > 0
    chunks, used = c._target_chunks(c._order(p.answer.sources), Timings(), [])
    texts = [h.text for h in used]
    budget = round(0.2 * sum(ch.num_tokens for ch in chunks))
    spans = c._guided_spans(QUESTION, chunks, used, ratio=0.2)
    manifest, index = c._current_view()
    source_chunks = [KVChunk.from_bytes(c._chunks.get(h.key), expect_model=manifest.source_fingerprint) for h in used]
    heads = selection.retrieval_heads(manifest.source_fingerprint.id)
    src = selection._source_sentence_scores(c._source_assembler(), source_chunks, texts, QUESTION, heads)
    ret = selection.retriever_sentence_scores(index.embed, texts, QUESTION,
                                              [index.sentence_vectors(h.key) for h in used])
    assert spans == selection._choose(chunks, texts, selection.fused_sentence_scores(src, ret), budget)
    assert any(spans)


@pytest.mark.parametrize("ape", [None, (0.5, 0.8)])
def test_a_streamed_answer_reads_the_question_in_the_recompute_only_under_the_models_own_attention(kb, ape,
                                                                                                    monkeypatch):
    """`stream` reads the question in the recompute's forward (`prepare(with_question=True)`) when the
    question's attention is the model's own; under APE it prefills the question, with APE applied. The
    answer is the one a separate question prefill gives, either way."""
    from cag.generate import generate, stop_token_ids
    from cag.models.attention import context_temperature

    extra = {} if ape is None else dict(context_temperature=ape[0], context_scale=ape[1])
    c = ctx(kb, recompute_select="retriever", recompute_ratio=0.3, rank_key_decay=0.8, **extra)
    lm = c.target_model
    calls = []
    original = CachedContext.prepare
    def spy(self, *a, **kw):  # whether the served answer's question was read in the recompute's forward
        prepared = original(self, *a, **kw)
        calls.append(prepared.first_logits is not None)
        return prepared
    monkeypatch.setattr(CachedContext, "prepare", spy)
    got = c.answer(QUESTION)
    monkeypatch.undo()
    prepare = c.prepare
    assert calls == [ape is None] and got.recomputed_tokens > 0
    apart = prepare(QUESTION)
    assert apart.first_logits is None
    with context_temperature(lm.model, *apart.context_span, temperature=c.ape_settings()[0],
                             scale=c.ape_settings()[1]):
        want = generate(lm.model, lm.tokenizer, apart.cache, apart.question_ids, max_new_tokens=4,
                        stop_ids=stop_token_ids(lm.tokenizer))
    assert got.text == want.text
    if ape is None:
        merged = prepare(QUESTION, with_question=True)
        assert merged.first_logits is not None
        assert merged.cache.get_seq_length() == merged.context_span[1] + merged.question_ids.numel()
