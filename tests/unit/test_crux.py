"""Translate the bulk, prefill the crux (#9) on tiny models: whole-chunk recompute, and the
translated neighbours' key scale that stops them outdrawing the recomputed crux."""

from __future__ import annotations

import pytest
import torch

from cag.context import CachedContext
from cag.models import registry
from mappers.fit import fit_mapper
from stores.build import build_store
from tests.mappers.conftest import TEXTS
from tests.stores.test_build import HashEmbedder, doc
from tests.unit.test_context import saved

QUESTION = "Zorblat maps?"


@pytest.fixture(scope="module")
def kb(tmp_path_factory):
    """A tiny qwen2 store and a tiny llama target with a ridge mapper: a translated path."""
    root = tmp_path_factory.mktemp("crux")
    source, target = saved(root, "qwen2"), saved(root, "llama")
    source_lm, target_lm = registry.load(str(source), "float32"), registry.load(str(target), "float32")
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)], root / "store", source_lm,
                chunk_tokens=32, embedder=HashEmbedder())
    fit_mapper(source_lm, target_lm, "ridge", TEXTS, root / "mapper", progress=False, fidelity_texts=2,
               batch_size=4)
    return root, target


def ctx(kb, **kw):
    root, target = kb
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


def test_translated_key_scale_leaves_the_native_path_alone(kb):
    root, _ = kb
    native = CachedContext(store=root / "store", target=str(root / "qwen2-0"), embedder=HashEmbedder(),
                           dtype="float32", max_new_tokens=4, top_k=3, min_retention=0.0)
    k1, *_ = placed_keys(native)
    native.translated_key_scale = 0.5
    k2, *_ = placed_keys(native)
    torch.testing.assert_close(k1, k2)


def test_translated_key_scale_is_validated():
    with pytest.raises(ValueError):
        CachedContext(store="x", translated_key_scale=0.0)
