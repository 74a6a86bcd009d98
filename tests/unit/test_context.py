"""CachedContext end to end on tiny models saved to folders: retrieval, answers, timings, bad input."""

from __future__ import annotations


import pytest

from cag.context import CachedContext, EmptyStoreError
from cag.mapping import MapperNotFoundError
from stores.build import build_store
from stores.diskcache_store import DiskCacheChunkStore
from stores.manifest import chunks_dir
from tests.stores.test_build import HashEmbedder, doc
from tests.tiny import tiny_model

from cag.models import registry


def saved(root, family, seed=0):
    model, tok = tiny_model(family, seed)
    folder = root / f"{family}-{seed}"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def kb(tmp_path_factory):
    root = tmp_path_factory.mktemp("kb")
    source = saved(root, "qwen2")
    docs = [(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)]
    build_store(docs, root / "store", registry.load(str(source), "float32"), chunk_tokens=32,
                embedder=HashEmbedder())
    return root, source


def ctx_for(kb, **kw):
    root, source = kb
    kw.setdefault("target", str(source))
    kw.setdefault("min_retention", 0.0)  # tiny models have no measured fidelity: consent to the cached path
    return CachedContext(store=root / "store", embedder=HashEmbedder(), dtype="float32",
                         max_new_tokens=6, **kw)


def test_answer_from_cache_with_full_recompute_equals_direct(kb):
    ctx = ctx_for(kb, recompute_ratio=1.0, top_k=3)
    question = doc(2, paragraphs=1)[:60]
    hits = ctx.retrieve(question)
    assert len(hits) == 3
    cached = ctx.answer(question, hits)
    direct = ctx.answer_direct(question, hits)
    assert cached.text == direct.text
    assert cached.mapper == "identity" and cached.context_tokens == direct.context_tokens > 0
    t = cached.timings
    assert 0 < t.first_token <= t.total and t.question_prefill > 0
    assert [h.key for h in cached.sources] == [h.key for h in sorted(hits, key=lambda h: -h.score)]


def test_stream_yields_the_answer(kb):
    ctx = ctx_for(kb)
    pieces = list(ctx.stream("Zorblat maps?"))
    assert "".join(pieces) == ctx.last_answer.text
    assert ctx.last_answer.timings.retrieve > 0


def test_translated_chunks_are_kept_in_the_lru(kb):
    ctx = ctx_for(kb)
    hits = ctx.retrieve("tower of Velmora")
    ctx.answer("tower of Velmora", hits)
    second = ctx.answer("tower of Velmora", hits)
    assert second.timings.load == pytest.approx(0.0, abs=1e-3)


def test_corrupt_chunk_is_skipped_and_named(kb, tmp_path):
    import shutil
    root, source = kb
    shutil.copytree(root / "store", tmp_path / "store")
    ctx = CachedContext(store=tmp_path / "store", target=str(source), embedder=HashEmbedder(),
                        dtype="float32", max_new_tokens=4, min_retention=0.0)
    hits = ctx.retrieve("maps")
    with DiskCacheChunkStore(chunks_dir(tmp_path / "store")) as chunks:
        chunks.put(hits[0].key, chunks.get(hits[0].key)[:50], overwrite=True)
    with pytest.warns(UserWarning, match="skipped chunk"):
        answer = ctx.answer("maps", hits)
    assert hits[0].key not in [h.key for h in answer.sources] and len(answer.sources) == len(hits) - 1
    assert any(hits[0].key[:12] in w for w in answer.warnings)


def test_context_longer_than_the_budget_is_truncated_by_score(kb):
    ctx = ctx_for(kb, top_k=4, max_context_tokens=40)
    with pytest.warns(UserWarning, match="lowest-scoring"):
        answer = ctx.answer("archivist keeps maps")
    assert answer.context_tokens <= 40 and len(answer.sources) < 4


def test_no_mapper_for_the_pair(kb, tmp_path):
    other = saved(tmp_path, "llama")
    with pytest.raises(MapperNotFoundError, match="cag fit"):
        ctx_for(kb, target=str(other), fallback="raise").answer("maps")
    # The default falls back to direct context, and says so.
    with pytest.warns(UserWarning, match="no mapper"):
        answer = ctx_for(kb, target=str(other)).answer("maps")
    assert answer.path == "direct" and answer.condition == "direct" and "no mapper" in answer.warnings[0]


def test_empty_store_and_no_hits(tmp_path, kb):
    with pytest.raises(EmptyStoreError, match="cag build"):
        CachedContext(store=tmp_path / "nothing", embedder=HashEmbedder()).answer("q")
    ctx = ctx_for(kb)
    with pytest.warns(UserWarning, match="without context"):
        answer = ctx.answer("q", hits=[])
    assert answer.context_tokens == 0 and not answer.sources


def test_new_version_is_picked_up(kb, tmp_path):
    import shutil
    root, source = kb
    shutil.copytree(root / "store", tmp_path / "store")
    ctx = CachedContext(store=tmp_path / "store", target=str(source), embedder=HashEmbedder(),
                        dtype="float32", max_new_tokens=2, min_retention=0.0)
    before = {h.doc_id for h in ctx.retrieve(doc(9, paragraphs=1), top_k=50)}
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)] + [("doc9", doc(9, paragraphs=1))],
                tmp_path / "store", registry.load(str(source), "float32"), chunk_tokens=32,
                embedder=HashEmbedder())
    after = {h.doc_id for h in ctx.retrieve(doc(9, paragraphs=1), top_k=50)}
    assert "doc9" not in before and "doc9" in after


def test_a_copy_prior_is_built_over_the_placed_chunks_text(kb):
    from cag.copy_prior import TextCopyPrior

    question = "tower of Velmora"
    assert ctx_for(kb).prepare(question).copy_prior is None          # off by default: the model alone
    ctx = ctx_for(kb, copy_prior=0.5)
    prepared = ctx.prepare(question)
    prior = prepared.copy_prior
    assert isinstance(prior, TextCopyPrior) and prior.weight == 0.5
    assert prior._texts == [h.text for h in prepared.answer.sources]
    assert prior.stop_ids                                             # a complete answer may still stop
    assert ctx.answer(question).text is not None


def test_the_served_path_decodes_with_the_copy_prior_it_was_measured_with(kb):
    from cag.gate import GateDecision, PathFidelity

    measured = GateDecision("translated", PathFidelity("translated", copy_prior=0.35), "", ())
    assert ctx_for(kb)._copy_prior(measured) == 0.35                    # None: the record's weight
    assert ctx_for(kb, copy_prior=0.0)._copy_prior(measured) == 0.0     # the caller's, said in a note
    assert ctx_for(kb)._copy_prior(GateDecision("direct", PathFidelity("direct"), "", ())) == 0.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A store built by a tiny Qwen2, a tiny Llama to answer, and a ridge mapper between them."""
    from mappers.fit import fit_mapper
    from tests.mappers.conftest import TEXTS

    root = tmp_path_factory.mktemp("pair")
    small, large = saved(root, "qwen2"), saved(root, "llama")
    small_lm, large_lm = registry.load(str(small), "float32"), registry.load(str(large), "float32")
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)], root / "store", small_lm,
                chunk_tokens=32, embedder=HashEmbedder())
    fit_mapper(small_lm, large_lm, "ridge", TEXTS, root / "mapper", progress=False, fidelity_texts=2,
               batch_size=4)
    return root, small, large


def test_a_pointer_head_starts_the_translated_paths_copy_prior(pair, monkeypatch):
    import cag.copy_prior

    tmp_path, small, large = pair

    def prepared(target, mapper):
        ctx = CachedContext(store=tmp_path / "store", target=str(target), mapper=mapper, embedder=HashEmbedder(),
                            dtype="float32", max_new_tokens=4, top_k=3, min_retention=0.0, copy_prior=0.5)
        return ctx.prepare("tower of Velmora")

    assert prepared(large, str(tmp_path / "mapper")).copy_prior._first == {}   # no head calibrated: the model's
    monkeypatch.setattr(cag.copy_prior, "pointer_head", lambda fingerprint_id: (1, 0, 0.4))
    translated = prepared(large, str(tmp_path / "mapper"))
    prior = translated.copy_prior
    assert prior._first and prior.first_weight == 0.4 and translated.answer.timings.point > 0
    assert 0 < sum(prior._first.values()) <= 1 + 1e-5          # a share of one head's attention
    native = prepared(small, "identity")                       # the target's own chunks start right: no pointer
    assert native.copy_prior._first == {} and native.answer.timings.point == 0

    # pointer_sentences=1: the pointer chooses among the words of the retriever's best sentence only
    from stores.chunker import sentence_spans

    ctx = CachedContext(store=tmp_path / "store", target=str(large), mapper=str(tmp_path / "mapper"),
                        embedder=HashEmbedder(), dtype="float32", max_new_tokens=4, top_k=3, min_retention=0.0,
                        copy_prior=0.5, pointer_sentences=1)
    hits = ctx.retrieve("tower of Velmora")
    within = ctx.prepare("tower of Velmora", hits).copy_prior
    used = [h for h in ctx._order(hits)]
    scores = ctx_scores(ctx, "tower of Velmora", used)
    c, i = max(((c, i) for c, row in enumerate(scores) for i in range(len(row))), key=lambda ci: scores[ci[0]][ci[1]])
    a, b = sentence_spans(used[c].text)[i]
    assert within._word_mass and set(within._word_mass) <= {w.rstrip(".,;:!?)\"'") for w in used[c].text[a:b].split()}
    assert set(within._word_mass) < set(prior._word_mass)     # fewer words than the pointer over everything
    assert not (within.anchor_pointer or within.end_stops or within.code_start)   # no rules calibrated

    # the target's calibrated rules reach the plain translated path's prior, and only it
    monkeypatch.setattr(cag.copy_prior, "pointer_rules", lambda fingerprint_id: cag.copy_prior.PointerRules(
        sentences=1, skip_question=True, code_start=True, anchor=True, end_stops=True, sentence_stops=True))
    ruled = prepared(large, str(tmp_path / "mapper")).copy_prior
    assert ruled.anchor_pointer and ruled.end_stops and ruled.code_start
    assert sum(map(len, ruled._sentence_ends)) == 1           # the best sentence's end, where its answer ends
    assert not any(within._sentence_ends)                     # the rule off: none
    assert set(ruled._word_mass) <= set(within._word_mass)    # the best sentence's words, the question's left out
    assert not {w.lower() for w in ruled._word_mass} & {"tower", "of", "velmora"}
    unruled = prepared(small, "identity").copy_prior
    assert not (unruled.anchor_pointer or unruled.end_stops or unruled.code_start or any(unruled._sentence_ends))


def test_the_plain_translated_path_reads_the_chunks_closest_to_the_question_within_its_budget(pair):
    root, small, large = pair

    def ctx(target, mapper, **kw):
        return CachedContext(store=root / "store", target=str(target), mapper=mapper, embedder=HashEmbedder(),
                             dtype="float32", max_new_tokens=4, top_k=4, min_retention=0.0, **kw)

    translated = ctx(large, str(root / "mapper"))
    question = "tower of Velmora"
    hits = translated.retrieve(question)
    sizes = [translated.target_model.tokenize(h.text)[0].numel() for h in hits]
    assert len(hits) == 4 and translated.focus_budget() == 0  # no budget calibrated for this target: every chunk
    whole = translated.prepare(question, hits)
    assert len(whole.answer.sources) == 4 and not any("read" in w for w in whole.answer.warnings)
    roomy = ctx(large, str(root / "mapper"), translated_focus_tokens=sum(sizes)).prepare(question, hits)
    assert len(roomy.answer.sources) == 4 and roomy.answer.warnings == whole.answer.warnings  # it fits: all read

    budget = max(sizes) + min(sizes) - 1                      # room for one chunk, or two small ones at most
    focused = ctx(large, str(root / "mapper"), translated_focus_tokens=budget).prepare(question, hits)
    kept = focused.answer.sources
    assert 1 <= len(kept) < 4 and sum(sizes[hits.index(h)] for h in kept) <= max(budget, max(sizes))
    assert focused.answer.context_tokens < whole.answer.context_tokens
    assert any(f"read {len(kept)} of 4 chunks" in w for w in focused.answer.warnings)
    best = max(range(4), key=lambda i: max(ctx_scores(translated, question, hits)[i]))
    assert hits[best].key in {h.key for h in kept}            # the chunk with the closest sentence is read

    off = ctx(large, str(root / "mapper"), translated_focus_tokens=0).prepare(question, hits)
    assert len(off.answer.sources) == 4                       # 0: every chunk
    crux = ctx(large, str(root / "mapper"), translated_focus_tokens=budget, recompute_ratio=0.2,
               recompute_select="retriever").prepare(question, hits)
    assert len(crux.answer.sources) == 4                      # a recompute reads every chunk: not the plain path
    native = ctx(small, "identity", translated_focus_tokens=budget).prepare(question, hits)
    assert len(native.answer.sources) == 4                    # the target's own chunks: never focused


def ctx_scores(ctx, question, hits):
    from cag import selection

    _, index = ctx._current_view()
    return selection.retriever_sentence_scores(index.embed, [h.text for h in hits], question)
