"""Rank key decay: the keys of the chunk ranked i-th by the retriever are multiplied by γ**i,
calibrated per target on the native path (cag.ape), applied after placement and recompute."""

from __future__ import annotations

import pytest
import torch

import cag.ape as ape
from cag.context import CachedContext
from tests.unit.test_ape_defaults import defaults  # noqa: F401  (the fixture)
from tests.unit.test_context import ctx_for, kb  # noqa: F401  (the fixture)

QUESTION = "tower of Velmora"


def test_scales_follow_the_retrieval_rank_not_the_placement_order():
    assert ape.rank_key_scales([0.9, 0.5, 0.7], 0.5) == [1.0, 0.25, 0.5]
    assert ape.rank_key_scales([0.2, 0.2, 0.1], 0.8) == [1.0, 1.0, pytest.approx(0.64)]  # ties share a rank
    assert ape.rank_key_scales([1.0] * 16, 0.95) == [1.0] * 16  # whole-document context: no ranking to follow
    assert ape.rank_key_scales([], 0.5) == []


def test_resolve_prefers_the_caller_then_the_native_calibration_then_one(defaults):  # noqa: F811
    defaults({"fp-a": {"temperature": 1.0, "scale": 1.0, "rank_key_decay": 0.85}})
    assert ape.resolve_rank_decay(None, fingerprint_id="fp-a", native=True) == 0.85
    assert ape.resolve_rank_decay(None, fingerprint_id="fp-a", native=False) == 1.0  # never calibrated there
    assert ape.resolve_rank_decay(0.7, fingerprint_id="fp-a", native=False) == 0.7
    assert ape.resolve_rank_decay(None, fingerprint_id="fp-b", native=True) == 1.0
    defaults({"fp-a": {"temperature": 0.9, "scale": 0.8}})  # an entry from before γ was calibrated
    assert ape.resolve_rank_decay(None, fingerprint_id="fp-a", native=True) == 1.0


def _keys(prepared):
    return torch.stack([layer.keys[0] for layer in prepared.cache.layers])


def test_each_chunk_keys_are_scaled_by_its_rank_and_nothing_else_changes(kb):  # noqa: F811
    plain = ctx_for(kb, mapper="identity", top_k=3, rank_key_decay=1.0)
    decayed = ctx_for(kb, mapper="identity", top_k=3, rank_key_decay=0.5)
    p1, p2 = plain.prepare(QUESTION), decayed.prepare(QUESTION)
    k1, k2 = _keys(p1), _keys(p2)
    start, end = p1.context_span
    torch.testing.assert_close(k2[:, :, :start], k1[:, :, :start])  # the head is never scaled
    at = start
    for i, hit in enumerate(p1.answer.sources):  # score order: the i-th placed chunk has rank i
        n = plain.target_model.tokenize(hit.text)[0].numel()
        torch.testing.assert_close(k2[:, :, at:at + n], 0.5 ** i * k1[:, :, at:at + n])
        at += n
    assert at == end
    for a, b in zip(p1.cache.layers, p2.cache.layers):  # values are untouched
        torch.testing.assert_close(a.values, b.values)


def test_the_native_path_serves_the_calibrated_decay(kb, defaults):  # noqa: F811
    ctx = ctx_for(kb, mapper="identity", top_k=3)
    defaults({ctx.target_model.fingerprint.id: {"temperature": 1.0, "scale": 1.0, "rank_key_decay": 0.5}})
    assert ctx.rank_decay() == 0.5 and ctx.rank_decay(native=False) == 1.0
    explicit = ctx_for(kb, mapper="identity", top_k=3, rank_key_decay=0.5)
    torch.testing.assert_close(_keys(ctx.prepare(QUESTION)), _keys(explicit.prepare(QUESTION)))


def test_the_decay_is_applied_after_the_recompute(kb):  # noqa: F811
    # A full recompute is direct context: its tokens were computed against the keys as stored,
    # so the decayed cache is the direct cache with each chunk's keys scaled.
    full = ctx_for(kb, mapper="identity", top_k=3, recompute_ratio=1.0, rank_key_decay=1.0)
    decayed = ctx_for(kb, mapper="identity", top_k=3, recompute_ratio=1.0, rank_key_decay=0.5)
    k1, k2 = _keys(full.prepare(QUESTION)), _keys(decayed.prepare(QUESTION))
    start, _ = full.prepare(QUESTION).context_span
    torch.testing.assert_close(k2[:, :, :start], k1[:, :, :start])
    assert not torch.allclose(k2[:, :, start:], k1[:, :, start:])


def test_place_refuses_scales_that_do_not_fit(kb):  # noqa: F811
    ctx = ctx_for(kb, mapper="identity", top_k=2)
    asm, lm = ctx.assembler, ctx.target_model
    chunks = [lm.prefill("one chunk"), lm.prefill("another chunk")]
    with pytest.raises(ValueError, match="2 chunks"):
        asm.place(chunks, key_scales=[1.0])
    with pytest.raises(ValueError, match="> 0"):
        asm.place(chunks, key_scales=[1.0, 0.0])
    torch.testing.assert_close(_keys(asm.place(chunks, key_scales=[1.0, 1.0])), _keys(asm.place(chunks)))


def test_the_field_is_validated():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            CachedContext(store="x", rank_key_decay=bad)


def test_cag_query_passes_the_decay_it_is_given(kb, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    from cag import context
    from cag.cli import app
    from tests.stores.test_build import HashEmbedder

    root, source = kb
    made = []

    class WithTestEmbedder(context.CachedContext):  # the store was built with a test embedder the CLI can't name
        def __init__(self, **kw):
            super().__init__(embedder=HashEmbedder(), dtype="float32", **kw)
            made.append(self)

    monkeypatch.setattr(context, "CachedContext", WithTestEmbedder)
    result = CliRunner().invoke(app, ["query", QUESTION, "--store", str(root / "store"), "--target", str(source),
                                      "--mapper", "identity", "--min-retention", "0", "--max-new-tokens", "3",
                                      "--rank-key-decay", "0.6", "--json"])
    assert result.exit_code == 0, result.output
    assert made and made[0].rank_key_decay == 0.6
    refused = CliRunner().invoke(app, ["query", "q", "--store", str(root / "store"), "--rank-key-decay", "0"])
    assert refused.exit_code != 0


def test_a_translated_path_reads_its_decay_from_the_mapper_card(defaults):  # noqa: F811
    assert ape.resolve_rank_decay(None, fingerprint_id="fp", native=False,
                                  mapper_fidelity={"rank_key_decay": {"value": 0.8}}) == 0.8
    assert ape.resolve_rank_decay(None, fingerprint_id="fp", native=False, mapper_fidelity={}) == 1.0
    assert ape.resolve_rank_decay(0.9, fingerprint_id="fp", native=False,
                                  mapper_fidelity={"rank_key_decay": {"value": 0.8}}) == 0.9


def test_a_translated_context_serves_its_mapper_cards_decay(tmp_path):
    import shutil

    from cag.models import registry
    from mappers.base import Mapper, write_card
    from mappers.fit import fit_mapper
    from stores.build import build_store
    from tests.mappers.conftest import TEXTS
    from tests.stores.test_build import HashEmbedder, doc
    from tests.unit.test_context import saved

    root = tmp_path  # a tiny qwen2 store and a ridge mapper into a tiny llama, as tests/unit/test_router.py builds
    small, large = saved(root, "qwen2"), saved(root, "llama")
    small_lm, large_lm = registry.load(str(small), "float32"), registry.load(str(large), "float32")
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)], root / "store", small_lm,
                chunk_tokens=32, embedder=HashEmbedder())
    fit_mapper(small_lm, large_lm, "ridge", TEXTS, root / "mapper", progress=False, fidelity_texts=2, batch_size=4)

    def ctx(folder, **kw):
        return CachedContext(store=root / "store", target=str(large), mapper=str(folder), embedder=HashEmbedder(),
                             dtype="float32", max_new_tokens=4, top_k=3, min_retention=0.0, **kw)

    assert ctx(root / "mapper").rank_decay() == 1.0  # never calibrated: keys as translated
    shutil.copytree(root / "mapper", root / "calibrated")
    card = Mapper.read_card(root / "calibrated")
    card.setdefault("fidelity", {})["rank_key_decay"] = {"value": 0.5}
    write_card(root / "calibrated", card)
    served = ctx(root / "calibrated")
    assert served.rank_decay() == 0.5
    torch.testing.assert_close(_keys(served.prepare(QUESTION)),
                               _keys(ctx(root / "mapper", rank_key_decay=0.5).prepare(QUESTION)))


def test_the_harness_asks_for_the_native_decay_over_another_models_store(tmp_path):
    # eval.harness places the target's own chunks of a store another model built: its base context's
    # identity mapper cannot be resolved there, and the native default must not need it.
    from tests.stores.test_build import HashEmbedder, doc
    from tests.unit.test_context import saved

    from cag.models import registry
    from stores.build import build_store

    small, large = saved(tmp_path, "qwen2"), saved(tmp_path, "llama")
    build_store([("d0", doc(0, paragraphs=1))], tmp_path / "store", registry.load(str(small), "float32"),
                chunk_tokens=32, embedder=HashEmbedder())
    base = CachedContext(store=tmp_path / "store", target=str(large), mapper="identity", embedder=HashEmbedder(),
                         dtype="float32", min_retention=0.0)
    assert base.rank_decay(native=True) == 1.0
    with pytest.raises(Exception, match="identity mapper needs one model"):
        base.rank_decay()  # the path itself: this context cannot serve it
