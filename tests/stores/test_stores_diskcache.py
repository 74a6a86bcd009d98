from __future__ import annotations

import os
import pickle
import threading

import diskcache
import pytest

from cag.kv import ForeignModelError, KVChunk
from stores.base import ChunkStore, StoreStats, chunk_key
from stores.diskcache_store import DiskCacheChunkStore
from stores.errors import StoreIntegrityError



class Boom:
    """Unpickling this would create a marker file: proof that nothing is unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_chunk_key_is_a_content_address(fingerprint, fp_factory, chunk_factory):
    settings = {"chunk_tokens": 16, "tokenizer": "abc"}
    k = chunk_key(fingerprint, settings, "some text")
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == chunk_key(fingerprint, dict(reversed(list(settings.items()))), "some text")  # key order irrelevant
    assert k != chunk_key(fingerprint, settings, "some text ")
    assert k != chunk_key(fingerprint, {**settings, "chunk_tokens": 17}, "some text")
    assert k != chunk_key(fp_factory("other"), settings, "some text")
    with pytest.raises(TypeError):
        chunk_key("not a fingerprint", settings, "x")  # type: ignore[arg-type]


def test_round_trip_real_kvchunks(tmp_path, fingerprint, fp_factory, chunk_factory):
    with DiskCacheChunkStore(tmp_path / "chunks") as store:
        assert isinstance(store, ChunkStore)
        small = chunk_factory("a few words", fingerprint, seed=1)
        big = chunk_factory(" ".join(["w"] * 600), fingerprint, seed=2)  # > 32 KiB: a side file
        for i, chunk in enumerate((small, big)):
            data = chunk.to_bytes("float32")
            key = f"k{i}"
            assert not store.contains(key)
            assert store.put(key, data) is True
            assert store.put(key, b"other bytes") is False  # content address: kept
            assert store.contains(key) and key in store
            got = store.get(key)
            assert got == data
            back = KVChunk.from_bytes(got, expect_model=fingerprint)
            assert back.keys.equal(chunk.keys) and back.values.equal(chunk.values)
            with pytest.raises(ForeignModelError):
                KVChunk.from_bytes(got, expect_model=fp_factory("other"))
        assert sorted(store.keys()) == ["k0", "k1"]
        stats = store.stats()
        assert isinstance(stats, StoreStats) and stats.entries == 2 and stats.bytes > len(big.to_bytes("float32"))
        assert store.get("missing") is None
        assert store.put("k0", b"replaced", overwrite=True) and store.get("k0") == b"replaced"
        assert store.delete("k0") is True and store.delete("k0") is False
        assert len(store) == 1
    with DiskCacheChunkStore(tmp_path / "chunks") as again:  # persisted
        assert again.get("k1") == big.to_bytes("float32")


def test_put_refuses_non_bytes(tmp_path):
    with DiskCacheChunkStore(tmp_path) as store:
        for bad in ("text", 3, 1.5, {"a": 1}, [b"x"], None):
            with pytest.raises(TypeError):
                store.put("k", bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.put(b"bytes key", b"v")  # type: ignore[arg-type]
        assert len(store) == 0
        assert store.put("k", bytearray(b"ok")) and store.get("k") == b"ok"


@pytest.mark.parametrize("size", [10, 100_000])  # inline pickle row, and a pickle side file
def test_pickled_value_is_refused_never_unpickled(tmp_path, size):
    marker = tmp_path / "UNPICKLED"
    with diskcache.Cache(str(tmp_path / "chunks")) as plain:  # behind the store's back
        plain.set("evil", [Boom(str(marker)), "x" * size])
        plain.set("text", "a str value")
        plain.set("number", 42)
    assert pickle.dumps(Boom(str(marker)))  # the payload really is a live pickle
    with DiskCacheChunkStore(tmp_path / "chunks") as store:
        with pytest.raises(StoreIntegrityError) as err:
            store.get("evil")
        assert err.value.key == "evil" and "'evil'" in str(err.value) and "pickle" in str(err.value)
        for key in ("text", "number"):
            with pytest.raises(StoreIntegrityError, match=key):
                store.get(key)
        report = store.verify()
        assert {p.key for p in report.corrupt} == {"evil", "text", "number"}
        assert {p.kind for p in report.corrupt} == {"refused"}
    assert not marker.exists()
    with diskcache.Cache(str(tmp_path / "chunks")) as plain:  # control: a plain read would run it
        plain.get("evil")
    assert marker.exists()


def test_pickled_key_is_refused(tmp_path):
    marker = tmp_path / "UNPICKLED"
    with diskcache.Cache(str(tmp_path / "chunks")) as plain:
        plain.set(("tuple", Boom(str(marker))), b"v")
    with DiskCacheChunkStore(tmp_path / "chunks") as store:
        with pytest.raises(StoreIntegrityError):
            list(store.keys())
    assert not marker.exists()
    with diskcache.Cache(str(tmp_path / "chunks")) as plain:  # control
        list(plain.iterkeys())
    assert marker.exists()


def test_verify_reports_checksum_truncation_and_foreign(tmp_path, fingerprint, fp_factory, chunk_factory):
    foreign_fp = fp_factory("foreign")
    good = chunk_factory("good chunk text", fingerprint, seed=3).to_bytes()
    flipped = bytearray(chunk_factory("flipped", fingerprint, seed=4).to_bytes())
    flipped[-5] ^= 0xFF
    truncated = chunk_factory("truncated chunk", fingerprint, seed=5).to_bytes()[:-10]
    foreign = chunk_factory("foreign chunk", foreign_fp, seed=6).to_bytes()
    with DiskCacheChunkStore(tmp_path) as store:
        store.put("good", good)
        store.put("flipped", bytes(flipped))
        store.put("truncated", truncated)
        store.put("foreign", foreign)
        store.put("garbage", b"not a chunk at all, just some bytes......................")
        report = store.verify(expect_model=fingerprint)
        assert report.checked == 5 and report.ok == 1 and not report.clean
        kinds = {p.key: p.kind for p in report.corrupt}
        assert kinds == {"flipped": "checksum", "truncated": "truncated", "garbage": "format"}
        assert [(p.key, p.kind) for p in report.foreign] == [("foreign", "foreign")]
        assert "foreign" in report.foreign[0].message
        # without an expected model the foreign chunk is valid
        assert store.verify().ok == 2


def test_missing_side_file_is_reported(tmp_path, fingerprint, fp_factory, chunk_factory):
    big = chunk_factory(" ".join(["w"] * 600), fingerprint).to_bytes("float32")
    with DiskCacheChunkStore(tmp_path) as store:
        store.put("big", big)
    vals = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".val")]
    assert len(vals) == 1
    os.remove(vals[0])
    with DiskCacheChunkStore(tmp_path) as store:
        assert [(p.key, p.kind) for p in store.verify().corrupt] == [("big", "missing")]


def test_concurrent_writers_and_readers(tmp_path, fingerprint, fp_factory, chunk_factory):
    data = {f"k{i}": chunk_factory(f"text {i}", fingerprint, seed=i).to_bytes() for i in range(20)}
    errors: list[BaseException] = []

    def writer(keys):
        try:
            with DiskCacheChunkStore(tmp_path) as s:
                for k in keys:
                    s.put(k, data[k])
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def reader():
        try:
            with DiskCacheChunkStore(tmp_path) as s:
                for _ in range(50):
                    for k in data:
                        v = s.get(k)
                        assert v is None or v == data[k]
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    ks = list(data)
    threads = [threading.Thread(target=writer, args=(ks[::2],)), threading.Thread(target=writer, args=(ks[1::2],)),
               threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with DiskCacheChunkStore(tmp_path) as s:
        assert s.verify(expect_model=fingerprint).ok == 20
