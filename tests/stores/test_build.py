"""The nightly build on a tiny random model: incremental rebuilds, bad input, crash safety."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from stores.build import EmptyCorpusError, SourceDocument, build_store
from stores.diskcache_store import DiskCacheChunkStore
from stores.errors import StoreMismatchError
from stores.manifest import chunks_dir, list_versions, open_current
from tests.tiny import tiny_loaded

ROOT = Path(__file__).resolve().parents[2]
PARAGRAPH = ("Zorblat the archivist keeps {n} maps in the tower of Velmora. The quick brown fox jumps "
             "over the lazy dog. A stitch in time saves nine.\n\n")


class HashEmbedder:
    """Deterministic fake embedder: a text's vector comes from its hash."""

    id = "test/hash-embedder"
    dim = 16

    def __call__(self, texts):
        return np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:16], dtype=np.uint8)
                         .astype(np.float32) + 1.0 for t in texts])


def write_corpus(folder: Path, docs: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text)
    return folder


WORDS = ("zorblat archivist maps tower velmora quick brown fox jumps lazy dog stitch time saves "
         "nine cache keys values documents numbers dates paragraphs").split()


def doc(n: int, paragraphs: int = 4) -> str:
    """A distinct, deterministic document: no two share a chunk unless meant to."""
    import random
    rng = random.Random(n)
    return "".join(PARAGRAPH.format(n=n * 100 + i) + " ".join(rng.choice(WORDS) for _ in range(30)) + ".\n\n"
                   for i in range(paragraphs))


@pytest.fixture(scope="module")
def llama():
    return tiny_loaded("llama")


def build(corpus, store, lm, **kw):
    kw.setdefault("chunk_tokens", 32)
    return build_store(corpus, store, lm, embedder=HashEmbedder(), **kw)


def snapshot(store: Path) -> dict:
    """What must be identical between two builds: manifest (minus time), index rows and vectors."""
    manifest, index = open_current(store, HashEmbedder())
    data = manifest.model_dump(exclude={"published_at"})
    raw = index._index
    vectors = raw.reconstruct_n(0, raw.ntotal) if raw is not None and raw.ntotal else np.zeros((0,))
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        keys = sorted(chunks.keys())
    return {"manifest": data, "rows": [r.__dict__ for r in index.rows], "vectors": vectors.tobytes(),
            "chunk_keys": keys}


def test_incremental_rebuild(tmp_path, llama):
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1), "b.txt": doc(2), "c.txt": doc(3)})
    first = build(corpus, tmp_path / "s", llama)
    assert (first.new, first.changed, first.unchanged, first.removed) == (3, 0, 0, 0)
    unique = {k for e in open_current(tmp_path / "s", HashEmbedder())[0].documents.values() for k in e.chunk_keys}
    # a repeated passage is one content address, prefilled once
    assert first.chunks_prefilled == len(unique) > 3 and first.published and first.version == 1

    again = build(corpus, tmp_path / "s", llama)
    assert (again.new, again.unchanged, again.chunks_prefilled, again.published) == (0, 3, 0, False)

    (corpus / "b.txt").write_text(doc(2) + "One more closing sentence about Velmora.")
    (corpus / "c.txt").unlink()
    (corpus / "d.txt").write_text(doc(1))  # same text as a.txt: its chunks exist already
    third = build(corpus, tmp_path / "s", llama)
    assert (third.new, third.changed, third.unchanged, third.removed) == (1, 1, 1, 1)
    assert 0 < third.chunks_prefilled < first.chunks_prefilled / 2
    manifest, index = open_current(tmp_path / "s", HashEmbedder())
    assert sorted(manifest.documents) == ["a.txt", "b.txt", "d.txt"]
    assert manifest.documents["a.txt"].chunk_keys == manifest.documents["d.txt"].chunk_keys
    assert {r.doc_id for r in index.rows} == {"a.txt", "b.txt", "d.txt"}
    hit = index.search(index.rows[0].text, 1)[0]
    assert hit.key == index.rows[0].key

    # c.txt's chunks are still referenced by the kept previous version; one more
    # publish drops that version and the gc collects them.
    (corpus / "a.txt").write_text(doc(4))
    fourth = build(corpus, tmp_path / "s", llama)
    assert fourth.chunks_collected > 0
    with DiskCacheChunkStore(chunks_dir(tmp_path / "s")) as chunks:
        stored = set(chunks.keys())
    referenced = set()
    for v in list_versions(tmp_path / "s"):
        manifest = json.loads((tmp_path / "s" / "versions" / str(v) / "manifest.json").read_text())
        referenced |= {k for e in manifest["documents"].values() for k in e["chunk_keys"]}
    assert stored == referenced


def test_bad_input_fails_alone(tmp_path, llama):
    corpus = write_corpus(tmp_path / "c", {"good.txt": doc(1), "empty.txt": "", "blank.txt": " \n\t\n"})
    (corpus / "binary.bin").write_bytes(b"\x7fELF\x00\x00\x01binary")
    (corpus / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (corpus / "huge.txt").write_text("word " * 300_000)  # 1.5 MB, over the limit set below
    from stores.build import corpus_documents
    docs = corpus_documents(corpus, max_bytes=1_000_000)
    (corpus / "good.txt").rename(corpus / "moved.txt")  # listed, then gone before it is read
    docs.append(SourceDocument("still-good", lambda: doc(2)))
    summary = build(docs, tmp_path / "s", llama)
    errors = {f["doc_id"]: f["error"] for f in summary.failed}
    assert set(errors) == {"empty.txt", "blank.txt", "binary.bin", "latin1.txt", "huge.txt", "good.txt"}
    assert "empty" in errors["empty.txt"] and "empty" in errors["blank.txt"]
    assert "binary" in errors["binary.bin"] and "UTF-8" in errors["latin1.txt"]
    assert "limit" in errors["huge.txt"] and "vanished" in errors["good.txt"]
    assert summary.new == 1 and summary.documents == 1


def test_failed_document_keeps_its_previous_version(tmp_path, llama):
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1), "b.txt": doc(2)})
    build(corpus, tmp_path / "s", llama)
    (corpus / "b.txt").write_bytes(b"\x00 corrupted overnight")
    summary = build(corpus, tmp_path / "s", llama)
    assert summary.failed and summary.removed == 0
    manifest, _ = open_current(tmp_path / "s", HashEmbedder())
    assert "b.txt" in manifest.documents


def test_empty_corpus(tmp_path, llama):
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    build(corpus, tmp_path / "s", llama)
    (corpus / "a.txt").unlink()
    with pytest.raises(EmptyCorpusError, match="no documents"):
        build(corpus, tmp_path / "s", llama)
    assert open_current(tmp_path / "s", HashEmbedder())[0].documents  # nothing lost
    summary = build(corpus, tmp_path / "s", llama, allow_empty=True)
    assert summary.removed == 1 and summary.documents == 0


def test_store_of_another_model_or_settings_is_refused(tmp_path, llama):
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    build(corpus, tmp_path / "s", llama)
    with pytest.raises(StoreMismatchError, match="new --store"):
        build(corpus, tmp_path / "s", tiny_loaded("qwen2"))
    with pytest.raises(StoreMismatchError, match="chunker settings"):
        build(corpus, tmp_path / "s", llama, chunk_tokens=64)
    with pytest.raises(StoreMismatchError):
        build(corpus, tmp_path / "s", llama, dtype="float16")


def test_llama_index_documents(tmp_path, llama):
    from llama_index.core import Document
    docs = [Document(text=doc(1), doc_id="one"), Document(text=doc(2), doc_id="two")]
    summary = build(docs, tmp_path / "s", llama)
    assert summary.new == 2
    assert sorted(open_current(tmp_path / "s", HashEmbedder())[0].documents) == ["one", "two"]


# ------------------------------------------------------------------ crash safety

KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.stores.test_build import HashEmbedder
from tests.tiny import tiny_loaded
from stores.build import build_store
kind, count = sys.argv[3], int(sys.argv[4])
seen = 0
def hook(event):
    global seen
    if event.kind == kind:
        seen += 1
        if seen == count:
            os.kill(os.getpid(), signal.SIGKILL)
build_store(sys.argv[1], sys.argv[2], tiny_loaded("llama"), embedder=HashEmbedder(), chunk_tokens=32,
            batch_size=2, on_event=hook)
"""


@pytest.mark.parametrize("kind,count", [("chunk_stored", 1), ("chunk_stored", 7), ("indexed", 1),
                                        ("published", 1), ("collected", 1)])
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path, llama, kind, count):
    v1 = {"a.txt": doc(1), "b.txt": doc(2), "c.txt": doc(3)}
    v2 = {"a.txt": doc(1) + "Appendix.", "b.txt": doc(2), "e.txt": doc(5), "f.txt": doc(6)}
    # reference: v1 then v2, uninterrupted
    build(write_corpus(tmp_path / "ref_c1", v1), tmp_path / "ref", llama, batch_size=2)
    uninterrupted = build(write_corpus(tmp_path / "ref_c2", v2), tmp_path / "ref", llama, batch_size=2)
    # crashed: v1, then v2 killed at (kind, count), then v2 again
    build(write_corpus(tmp_path / "c1", v1), tmp_path / "s", llama, batch_size=2)
    with DiskCacheChunkStore(chunks_dir(tmp_path / "s")) as chunks:
        after_v1 = len(chunks)
    corpus2 = write_corpus(tmp_path / "c2", v2)
    script = KILL_SCRIPT.format(root=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, str(corpus2), str(tmp_path / "s"), kind, str(count)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with DiskCacheChunkStore(chunks_dir(tmp_path / "s")) as chunks:
        stored_before = len(chunks)
    resumed = build(corpus2, tmp_path / "s", llama, batch_size=2)
    ref_snapshot, got_snapshot = snapshot(tmp_path / "ref"), snapshot(tmp_path / "s")
    assert got_snapshot["manifest"]["documents"] == ref_snapshot["manifest"]["documents"]
    assert got_snapshot == ref_snapshot
    # nothing finished before the kill was prefilled again: the killed run and the
    # rerun together prefilled exactly what the uninterrupted build did
    if kind == "chunk_stored":
        assert stored_before - after_v1 == count
        assert count + resumed.chunks_prefilled == uninterrupted.chunks_prefilled


def test_readers_see_whole_versions_during_builds(tmp_path, llama):
    corpus = tmp_path / "c"
    write_corpus(corpus, {"a.txt": doc(1)})
    build(corpus, tmp_path / "s", llama)
    stop, problems, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            manifest, index = open_current(tmp_path / "s", HashEmbedder())
            want = {k for e in manifest.documents.values() for k in e.chunk_keys}
            if {r.key for r in index.rows} != want or {r.doc_id for r in index.rows} != set(manifest.documents):
                problems.append(manifest.version)
            reads[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(2, 6):
            (corpus / f"d{i}.txt").write_text(doc(i))
            build(corpus, tmp_path / "s", llama)
    finally:
        stop.set()
        thread.join()
    assert reads[0] > 5 and not problems


def test_new_stores_default_to_int8_and_an_existing_store_keeps_its_format(tmp_path, llama):
    from stores.build import DEFAULT_CHUNK_DTYPE
    from stores.errors import StoreMismatchError

    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    fresh = build(corpus, tmp_path / "new", llama)
    assert fresh.dtype == DEFAULT_CHUNK_DTYPE == "int8"
    assert open_current(tmp_path / "new", HashEmbedder())[0].chunker["dtype"] == "int8"
    # a store built in bf16 (before the default changed) keeps building in bf16 without --dtype
    build(corpus, tmp_path / "old", llama, dtype="bfloat16")
    (corpus / "b.txt").write_text(doc(2))
    again = build(corpus, tmp_path / "old", llama)
    assert again.dtype == "bfloat16" and again.new == 1 and again.published
    assert open_current(tmp_path / "old", HashEmbedder())[0].chunker["dtype"] == "bfloat16"
    with pytest.raises(StoreMismatchError):  # asking for another format is still refused
        build(corpus, tmp_path / "old", llama, dtype="int8")
