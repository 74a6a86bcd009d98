"""Stored translations (#11) on tiny models: translated once, read at query time exactly as translated
then, resumed, garbage-collected with their chunks, verified, and refused (never fatal) when damaged."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from typer.testing import CliRunner

from cag.cli import app
from cag.context import CachedContext
from cag.kv import ChunkError, KVChunk
from cag.models import registry
from cag.store_translation import translate_store
from stores.build import build_store, collect_garbage
from stores.diskcache_store import verify_chunks
from stores.location import open_store
from stores.translations import base_key, is_translation_key, read_translation, translation_key
from tests.stores.test_build import HashEmbedder, doc
from tests.stores.test_redis_store import redis_server  # noqa: F401  (a real redis-server for this module)
from tests.unit.test_router import kb  # noqa: F401  (the fixture: tiny qwen2 store, tiny llama, ridge mapper)

QUESTION = "Zorblat maps?"
runner = CliRunner()


@pytest.fixture
def store(kb, tmp_path):
    """A copy of the fixture's store, so each test writes translations of its own."""
    root, small, large = kb
    shutil.copytree(root / "store", tmp_path / "store")
    return tmp_path / "store", str(root / "mapper"), large, small


def ctx(store, **kw):
    path, mapper, large, _ = store
    return CachedContext(store=path, target=str(large), mapper=mapper, embedder=HashEmbedder(), dtype="float32",
                         max_new_tokens=4, top_k=3, min_retention=0.0, translation_cache_mb=0, **kw)


def placed(c: CachedContext):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = c.prepare(QUESTION)
    return (torch.stack([layer.keys for layer in p.cache.layers]),
            torch.stack([layer.values for layer in p.cache.layers]), p.answer)


def translation_keys(path) -> list[str]:
    with open_store(path).chunks() as chunks:
        return sorted(k for k in chunks.keys() if is_translation_key(k))


def test_translation_keys_extend_their_chunk_key():
    key = translation_key("ab" * 32, "mapper1", "target1")
    assert is_translation_key(key) and base_key(key) == "ab" * 32 and base_key("ab" * 32) == "ab" * 32
    assert not is_translation_key("ab" * 32)
    others = {translation_key("ab" * 32, m, t) for m, t in (("mapper2", "target1"), ("mapper1", "target2"))}
    assert key not in others and len(others) == 2  # another mapper or target: another entry
    with pytest.raises(ValueError):
        translation_key(key, "mapper1", "target1")  # a translation of a translation


def test_stored_translations_place_exactly_what_translating_places(store, monkeypatch):
    path, _, large, _ = store
    summary = translate_store(path, str(large), mapper=store[1], dtype="float32", compute_dtype="float32")
    assert summary.translated == summary.chunks > 0 and summary.present == 0 and not summary.failed
    assert len(translation_keys(path)) == summary.chunks
    k_fly, v_fly, a_fly = placed(ctx(store, stored_translations=False))
    reader = ctx(store)
    mapper = reader.active_mapper

    def no_translation(*args, **kwargs):
        raise AssertionError("a stored translation was translated again")
    monkeypatch.setattr(mapper, "translate_batch", no_translation)
    k, v, a = placed(reader)
    assert torch.equal(k, k_fly) and torch.equal(v, v_fly)
    assert a.path == a_fly.path == "translated" and a.timings.translate < a_fly.timings.translate


def test_int8_translations_stay_within_int8_error(store):
    path, _, large, _ = store
    translate_store(path, str(large), mapper=store[1], dtype="int8", compute_dtype="float32")
    k_fly, v_fly, _ = placed(ctx(store, stored_translations=False))
    k, v, _ = placed(ctx(store))
    for got, want in ((k, k_fly), (v, v_fly)):
        err = (got - want).abs().amax() / want.abs().amax()
        assert 0 < err < 0.02  # 8-bit codes (rotated after decoding): about one step of 1/127


def test_a_rerun_translates_only_new_chunks(store):
    path, mapper, large, small = store
    first = translate_store(path, str(large), mapper=mapper, compute_dtype="float32")
    again = translate_store(path, str(large), mapper=mapper, compute_dtype="float32")
    assert again.translated == 0 and again.present == first.chunks
    # A nightly build adds a document: only its chunks are translated next.
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in (0, 1, 2, 3, 7)], path,
                registry.load(str(small), "float32"), chunk_tokens=32, embedder=HashEmbedder())
    third = translate_store(path, str(large), mapper=mapper, compute_dtype="float32")
    assert 0 < third.translated < third.chunks and third.present == first.chunks


def test_gc_keeps_a_translation_exactly_as_long_as_its_chunk(store):
    path, mapper, large, _ = store
    translate_store(path, str(large), mapper=mapper, compute_dtype="float32")
    kept = translation_keys(path)
    orphan = translation_key("f" * 64, "some-mapper", "some-target")  # its chunk is in no version
    with open_store(path).chunks() as chunks:
        chunks.put(orphan, chunks.get(kept[0]))
    assert collect_garbage(path) == 1
    assert translation_keys(path) == kept


def test_a_damaged_translation_is_refused_and_the_chunk_translated_instead(store):
    path, mapper, large, _ = store
    translate_store(path, str(large), mapper=mapper, dtype="float32", compute_dtype="float32")
    k_fly, _, _ = placed(ctx(store, stored_translations=False))
    hits = ctx(store).retrieve(QUESTION)
    location = open_store(path)
    with location.chunks() as chunks:
        key = next(k for k in translation_keys(path) if base_key(k) == hits[0].key)
        data = bytearray(chunks.get(key))
        data[-10] ^= 0xFF
        chunks.put(key, bytes(data), overwrite=True)
    k, _, answer = placed(ctx(store))
    assert torch.equal(k, k_fly)  # nothing lost: the source chunk was translated at query time
    assert any("stored translation" in w and "refused" in w for w in answer.warnings)


def test_a_translation_by_another_mapper_is_not_served(store):
    path, mapper, large, _ = store
    translate_store(path, str(large), mapper=mapper, dtype="float32", compute_dtype="float32")
    c = ctx(store)
    hit = c.retrieve(QUESTION)[0]
    lm = c.target_model
    location = open_store(path)
    with location.chunks() as chunks:
        own = c.active_mapper.artifact_id
        assert read_translation(chunks, hit.key, hit.text, "another-mapper", lm.fingerprint) is None
        data = chunks.get(translation_key(hit.key, own, lm.fingerprint.id))
        chunks.put(translation_key(hit.key, "another-mapper", lm.fingerprint.id), data)
        with pytest.raises(ChunkError, match="made by mapper"):  # filed under the wrong mapper
            read_translation(chunks, hit.key, hit.text, "another-mapper", lm.fingerprint)
        with pytest.raises(ChunkError, match="another text"):
            read_translation(chunks, hit.key, hit.text + " changed", own, lm.fingerprint)


def test_verify_checks_translations_against_the_stores_source(store):
    path, mapper, large, small = store
    translate_store(path, str(large), mapper=mapper, compute_dtype="float32")
    location = open_store(path)
    manifest = location.load_manifest(location.current_version())
    with location.chunks() as chunks:
        report = verify_chunks(chunks, manifest.source_fingerprint)
        assert report.clean and report.ok == report.checked > len(manifest.chunk_keys())
        # a chunk of the target filed as a translation, but not translated from this store's source
        key = translation_keys(path)[0]
        frame = KVChunk.from_bytes(chunks.get(key))
        frame.settings["translated"]["source"] = "someone-else"
        chunks.put(key, frame.to_bytes("float32"), overwrite=True)
        report = verify_chunks(chunks, manifest.source_fingerprint)
    assert [p.key for p in report.foreign] == [key]


def test_the_identity_mapper_has_nothing_to_translate(store):
    path, _, _, small = store
    with pytest.raises(ValueError, match="nothing to translate"):
        translate_store(path, str(small), compute_dtype="float32")


def test_cli_store_translate_and_stats(store):
    path, mapper, large, _ = store

    def cli(*args):
        result = runner.invoke(app, [*args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    row = cli("store", "translate", str(path), "--target", str(large), "--mapper", mapper)
    assert row["translated"] == row["chunks"] > 0 and row["bytes_per_token"] > 0
    assert cli("store", "translate", str(path), "--target", str(large), "--mapper", mapper)["translated"] == 0
    stats = cli("store", "stats", str(path))
    [group] = stats["translations"]
    assert group["chunks"] == row["chunks"] and group["method"] == "ridge" and group["mapper_id"] == row["mapper_id"]
    assert stats["entries_on_disk"] == stats["unique_chunks"] + row["chunks"]
    assert cli("store", "verify", str(path))["problems"] == []
    result = runner.invoke(app, ["store", "translate", str(path), "--target", str(large), "--mapper", "heterofold"])
    assert result.exit_code == 1 and "no heterofold mapper" in result.output


def test_translations_on_a_redis_store(kb, redis_server):
    """The same keys, reads, gc and verify against a real redis-server."""
    import uuid

    root, small, large = kb
    url = f"{redis_server}/tr-{uuid.uuid4().hex[:8]}"
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)], url, registry.load(str(small), "float32"),
                chunk_tokens=32, embedder=HashEmbedder())
    summary = translate_store(url, str(large), mapper=str(root / "mapper"), dtype="float32", compute_dtype="float32")
    assert summary.translated == summary.chunks > 0
    remote = (url, str(root / "mapper"), large, small)
    k_fly, v_fly, _ = placed(ctx(remote, stored_translations=False))
    k, v, _ = placed(ctx(remote))
    assert torch.equal(k, k_fly) and torch.equal(v, v_fly)
    assert collect_garbage(url) == 0 and len(translation_keys(url)) == summary.chunks
    location = open_store(url)
    with location.chunks() as chunks:
        assert verify_chunks(chunks, location.load_manifest(location.current_version()).source_fingerprint).clean
