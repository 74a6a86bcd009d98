"""The Redis store (stores/redis_store.py) against a real `redis-server` process.

The module fixture starts Debian's redis-server on a free loopback port in a
temporary folder (no persistence) and stops it at the end; each test works
under its own key prefix. A missing redis-server fails these tests, it does
not skip them: `.ci/run` installs it.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from typer.testing import CliRunner

from stores.build import build_store
from stores.errors import StoreError, StoreIntegrityError, StoreMismatchError
from stores.index import Row, RowsOnlyEmbedder, VectorIndex
from stores.location import LocalStore, open_store
from stores.manifest import DocumentEntry, Manifest, version_dir
from stores.redis_store import RedisChunkStore, RedisStore, StoreConnectionError, parse_redis_url
from tests.stores.conftest import FakeEmbedder, make_chunk, make_fingerprint
from tests.stores.test_build import HashEmbedder, doc, write_corpus
from tests.tiny import tiny_loaded, tiny_model

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


# ------------------------------------------------------------------ the server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """``redis://127.0.0.1:PORT`` of a redis-server started for this module."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed, and the Redis store is tested against a real one: "
                    "apt-get install -y redis-server (.ci/run does this)", pytrace=False)
    folder = tmp_path_factory.mktemp("redis")
    for _ in range(3):  # the free port may be taken between the probe and the start
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--logfile", str(folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            proc.kill()
            proc.wait()
            continue
        client.close()
        break
    else:
        log = (folder / "redis.log").read_text() if (folder / "redis.log").exists() else ""
        pytest.fail(f"redis-server did not start: {log[-2000:]}", pytrace=False)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def url(redis_server):
    """A store URL of its own for each test."""
    return f"{redis_server}/t-{uuid.uuid4().hex[:12]}"


def raw(url: str) -> redis.Redis:
    """A plain client, to look at or tamper with the keys behind the store's back."""
    return parse_redis_url(url).client()


# ------------------------------------------------------------------ versions


def version(n_docs: int, fp=None) -> tuple[Manifest, VectorIndex]:
    """A manifest of documents d0..d(n-1), one chunk each, and its index."""
    fp = fp or make_fingerprint("source")
    index = VectorIndex(FakeEmbedder())
    docs, rows = {}, []
    for i in range(n_docs):
        key = hashlib.sha256(f"chunk {i}".encode()).hexdigest()
        docs[f"d{i}"] = DocumentEntry(content_sha256=hashlib.sha256(f"doc {i}".encode()).hexdigest(),
                                      chunk_keys=[key], n_tokens=4, char_length=20)
        rows.append(Row(key, f"d{i}", f"document {i} talks about maps number {i}", 0, 20))
    index.add(rows)
    return Manifest(source_model=fp.to_dict(), chunker={"chunk_tokens": 16}, embedder_id=index.embedder_id,
                    documents=docs), index


def consistent(manifest: Manifest, index: VectorIndex) -> bool:
    """Whether an index is the one published with this manifest (not a mix of versions)."""
    return ({r.key for r in index.rows} == manifest.chunk_keys()
            and {r.doc_id for r in index.rows} == set(manifest.documents))


# ---------------------------------------------------------------- chunk bytes


def test_put_get_contains_delete_keys_stats(url):
    fp = make_fingerprint("source")
    frames = {f"k{i}": make_chunk(f"text number {i}", fp, seed=i).to_bytes() for i in range(5)}
    with RedisChunkStore.from_url(url) as store:
        assert store.get("k0") is None and not store.contains("k0") and list(store.keys()) == []
        for key, data in frames.items():
            assert store.put(key, data) is True
        assert {k: store.get(k) for k in frames} == frames
        assert store.contains("k3") and "k3" in store and not store.contains("nope")
        assert sorted(store.keys()) == sorted(frames) and len(store) == 5
        stats = store.stats()
        assert stats.entries == 5 and stats.bytes == sum(map(len, frames.values()))
        assert stats.path == url and "t-" in stats.path
        # keep-existing: a content address is written once; overwrite replaces
        assert store.put("k0", b"other bytes") is False and store.get("k0") == frames["k0"]
        assert store.put("k0", bytearray(b"other bytes"), overwrite=True) is True
        assert store.get("k0") == b"other bytes"
        assert store.delete("k0") is True and store.delete("k0") is False and store.get("k0") is None
        assert sorted(store.keys()) == ["k1", "k2", "k3", "k4"]
        report = store.verify(expect_model=fp)
        assert report.clean and report.checked == report.ok == 4
        assert store.verify(expect_model=make_fingerprint("other")).foreign
    # another prefix on the same server is another store
    with RedisChunkStore.from_url(url + "-2") as other:
        assert list(other.keys()) == [] and other.get("k1") is None


def test_values_are_bytes_only_and_never_unpickled(url, tmp_path):
    with RedisChunkStore.from_url(url) as store:
        for bad in ("a str", 7, {"a": 1}, None):
            with pytest.raises(TypeError):
                store.put("k", bad)
        with pytest.raises(TypeError):
            store.get("")
        assert list(store.keys()) == []
        # an entry that is not a plain string, written behind the store's back
        client = raw(url)
        client.hset(f"{parse_redis_url(url).prefix}:chunk:planted", mapping={"a": b"1"})
        with pytest.raises(StoreIntegrityError, match="planted") as err:
            store.get("planted")
        assert err.value.key == "planted" and "hash" in str(err.value)
        # a pickle that would create a file when unpickled: stored and returned as inert bytes
        sentinel = tmp_path / "unpickled"
        payload = pickle.dumps(_Boom(str(sentinel)))
        assert store.put("pickled", payload)
        assert store.get("pickled") == payload and not sentinel.exists()
        report = store.verify()
        kinds = {p.key: p.kind for p in report.problems}
        assert kinds["planted"] == "refused" and kinds["pickled"] in {"format", "truncated"}
        assert not sentinel.exists()
        client.close()


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_store_urls(redis_server):
    target = parse_redis_url("redis://user:secret@10.1.2.3:7000/kb.v1-x?db=2")
    assert target.prefix == "kb.v1-x" and "secret" not in target.where and "secret" in target.server_url
    assert target.where == "redis://10.1.2.3:7000/kb.v1-x?db=2"
    assert parse_redis_url("rediss://h/kb").where == "rediss://h:6379/kb"
    for bad in ("redis://host:6379", "redis://host:6379/", "redis://host/a/b", "redis://host/a*b",
                "redis://host:notaport/kb"):
        with pytest.raises(ValueError):
            open_store(bad)
    with pytest.raises(ValueError, match="unknown store URL scheme 's3'"):
        open_store("s3://bucket/kb")
    assert isinstance(open_store(f"{redis_server}/kb"), RedisStore)
    assert isinstance(open_store("some/folder"), LocalStore)
    # nobody listens on a fresh port: a typed, clear error naming the store, not a redis-py traceback
    dead = f"redis://:hunter2@127.0.0.1:{_free_port()}/kb"
    with pytest.raises(StoreConnectionError, match="cannot talk to the Redis server") as err:
        open_store(dead).current_version()
    assert "hunter2" not in str(err.value) and isinstance(err.value, StoreError)
    with pytest.raises(StoreConnectionError):
        RedisChunkStore.from_url(dead).put("k", b"v")


# ----------------------------------------------------------------- versions


def test_publish_keeps_two_versions_and_checks_them(url, tmp_path):
    location = open_store(url)
    assert not location.exists() and location.current_version() is None
    with pytest.raises(FileNotFoundError, match="no store version published"):
        location.open_current(FakeEmbedder())
    assert location.check_compatible(make_fingerprint("source"), {"chunk_tokens": 16}) is None
    numbers = [location.publish(*version(n)) for n in (1, 2, 3)]
    assert numbers == [1, 2, 3] and location.exists()
    assert location.current_version() == 3 and location.list_versions() == [2, 3]
    manifest, index = location.open_current(FakeEmbedder())
    assert manifest.version == 3 and len(manifest.documents) == 3 and consistent(manifest, index)
    assert index.search("maps number 2", k=1)[0].doc_id == "d2"
    assert location.load_manifest(2).version == 2
    assert location.index_info(3) == {"embedder_id": "fake-bow-64", "dim": 64, "rows": 3}
    with pytest.raises(FileNotFoundError):
        location.load_manifest(1)
    assert location.check_compatible(make_fingerprint("source"), {"chunk_tokens": 16}).version == 3
    with pytest.raises(StoreMismatchError, match="source model"):
        location.check_compatible(make_fingerprint("other"), {"chunk_tokens": 16})
    # the very bytes a local store writes, read back by the same code
    local = LocalStore(tmp_path / "local")
    local.publish(*version(3))
    client, prefix = raw(url), parse_redis_url(url).prefix
    blobs = client.hgetall(f"{prefix}:version:3")
    for name in ("index.faiss", "rows.json", "sentences.npy"):
        assert blobs[name.encode()] == (version_dir(local.path, 1) / name).read_bytes()
    # tampering is refused, naming the version (not the temporary folder it is read from)
    client.hset(f"{prefix}:version:3", "index.faiss", b"not a faiss index")
    with pytest.raises(StoreIntegrityError, match="sha256"):
        location.open_current(FakeEmbedder())
    digests = json.loads(blobs[b"sha256"])
    digests["index.faiss"] = hashlib.sha256(b"not a faiss index").hexdigest()
    client.hset(f"{prefix}:version:3", "sha256", json.dumps(digests))
    with pytest.raises(StoreIntegrityError, match="version 3") as err:
        location.open_current(FakeEmbedder())
    assert "cag-redis-version" not in str(err.value)
    client.set(f"{prefix}:CURRENT", b"three")
    with pytest.raises(StoreIntegrityError, match="version number"):
        location.open_current(FakeEmbedder())
    client.close()


def test_sentence_vectors_travel_with_a_version_and_an_older_version_loads_without(url):
    location = open_store(url)
    manifest, index = version(2)
    location.publish(manifest, index)
    _, back = location.open_current(FakeEmbedder())
    for r in index.rows:
        np.testing.assert_array_equal(back.sentence_vectors(r.key), index.sentence_vectors(r.key))
    # a version an older cag published: no sentences.npy, no table in rows.json, no digest for either
    client, key = raw(url), f"{parse_redis_url(url).prefix}:version:1"
    rows = json.loads(client.hget(key, "rows.json"))
    del rows["sentences"]
    old_rows = json.dumps(rows).encode()
    digests = json.loads(client.hget(key, "sha256"))
    del digests["sentences.npy"]
    digests["rows.json"] = hashlib.sha256(old_rows).hexdigest()
    client.hset(key, mapping={"rows.json": old_rows, "sha256": json.dumps(digests)})
    client.hdel(key, "sentences.npy")
    _, old = location.open_current(FakeEmbedder())
    assert len(old) == 2 and old.sentence_vectors(index.rows[0].key) is None
    # a version whose record names the file but lacks it is refused
    digests["sentences.npy"] = "0" * 64
    client.hset(key, "sha256", json.dumps(digests))
    with pytest.raises(StoreIntegrityError, match="lacks its sentences.npy"):
        location.open_current(FakeEmbedder())
    client.close()


def test_the_newest_publish_wins(url):
    """Two publishes racing: the one that started later (higher number) stays current."""
    location = open_store(url)
    location.publish(*version(1))
    real_flip = RedisStore._flip
    early = open_store(url)
    held = {}

    def hold(self, staging, number):  # the early writer stalls before its flip
        held["args"] = (staging, number)
        return False

    early._flip = hold.__get__(early)
    assert early.publish(*version(2)) == 2
    assert location.publish(*version(3)) == 3 and location.current_version() == 3
    assert real_flip(early, *held["args"]) is False  # late flip: kept, but not made current
    assert location.current_version() == 3 and location.list_versions()[-1] == 3
    assert len(location.open_current(FakeEmbedder())[0].documents) == 3


READER = """
import json, sys, time
sys.path.insert(0, {root!r})
from stores.location import open_store
from tests.stores.conftest import FakeEmbedder
location, last = open_store(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
seen, bad, reads = [], [], 0
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    manifest, index = location.open_current(FakeEmbedder())
    reads += 1
    if not seen or seen[-1] != manifest.version:
        seen.append(manifest.version)
    want = manifest.chunk_keys()
    if ({{r.key for r in index.rows}} != want or {{r.doc_id for r in index.rows}} != set(manifest.documents)
            or len(manifest.documents) != manifest.version):
        bad.append(manifest.version)
    if manifest.version >= last:
        break
print(json.dumps({{"seen": seen, "bad": bad, "reads": reads}}), flush=True)
"""


def test_a_reader_in_another_process_sees_whole_versions(url):
    location = open_store(url)
    location.publish(*version(1))  # version n holds n documents
    last = 12
    proc = subprocess.Popen([sys.executable, "-c", READER.format(root=str(ROOT)), url, str(last)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        for n in range(2, last + 1):
            assert location.publish(*version(n)) == n
            time.sleep(0.05)
        out, errs = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, errs[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert not result["bad"], result
    assert result["seen"] == sorted(result["seen"]) and len(result["seen"]) >= 2 and result["seen"][-1] == last
    assert result["reads"] >= len(result["seen"])


# ------------------------------------------------------------------- builds


def build(corpus, store, lm, **kw):
    return build_store(corpus, store, lm, embedder=HashEmbedder(), chunk_tokens=32, batch_size=2, **kw)


def snapshot(store) -> dict:
    """What must be identical between two stores: manifest (minus time), index rows and
    vectors, every chunk key and its bytes."""
    location = open_store(store)
    manifest, index = location.open_current(HashEmbedder())
    vectors = index._index.reconstruct_n(0, index._index.ntotal) if index._index is not None else np.zeros(0)
    with location.chunks() as chunks:
        frames = {k: chunks.get(k) for k in chunks.keys()}
    return {"manifest": manifest.model_dump(exclude={"published_at", "version"}),
            "rows": [r.__dict__ for r in index.rows], "vectors": vectors.tobytes(), "chunks": frames}


KILLED_PUBLISH = """
import os, signal, sys
sys.path.insert(0, {root!r})
from stores import redis_store
from stores.build import build_store
from tests.stores.test_build import HashEmbedder
from tests.tiny import tiny_loaded
def killed(self, staging, number):  # the writer dies after its upload, before the flip
    os.kill(os.getpid(), signal.SIGKILL)
redis_store.RedisStore._flip = killed
build_store(sys.argv[1], sys.argv[2], tiny_loaded("llama"), embedder=HashEmbedder(), chunk_tokens=32,
            batch_size=2)
"""


def test_a_killed_writer_leaves_the_previous_version_readable(url, tmp_path):
    llama = tiny_loaded("llama")
    v1 = {"a.txt": doc(1), "b.txt": doc(2)}
    v2 = {"a.txt": doc(1) + "Appendix.", "c.txt": doc(3)}
    build(write_corpus(tmp_path / "c1", v1), url, llama)
    location = open_store(url)
    before = location.open_current(HashEmbedder())[0]
    corpus2 = write_corpus(tmp_path / "c2", v2)
    proc = subprocess.run([sys.executable, "-c", KILLED_PUBLISH.format(root=str(ROOT)), str(corpus2), url],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # readers still get the previous version, whole
    manifest, index = location.open_current(HashEmbedder())
    assert location.current_version() == before.version == 1 and location.list_versions() == [1]
    assert manifest.model_dump() == before.model_dump() and consistent(manifest, index)
    client, prefix = raw(url), parse_redis_url(url).prefix
    staged = list(client.scan_iter(match=f"{prefix}:staging:*"))
    assert len(staged) == 1 and 0 < client.ttl(staged[0]) <= 24 * 3600  # the orphan expires by itself
    client.close()
    # the rerun publishes what an uninterrupted build would have
    resumed = build(corpus2, url, llama)
    assert resumed.published and resumed.chunks_prefilled == 0  # the killed build had stored them all
    build(write_corpus(tmp_path / "r1", v1), tmp_path / "ref", llama)
    build(write_corpus(tmp_path / "r2", v2), tmp_path / "ref", llama)
    assert snapshot(url) == snapshot(tmp_path / "ref")


def saved_model(root: Path, family: str = "qwen2") -> Path:
    model, tok = tiny_model(family)
    folder = root / f"{family}-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


GROWING_BUILD = """
import sys
sys.path.insert(0, {root!r})
from cag.models import registry
from stores.build import build_store
from tests.stores.test_build import HashEmbedder, doc
lm = registry.load(sys.argv[2], "float32")
docs = [(f"doc{{i}}", doc(i, paragraphs=2)) for i in range(3)]
for i in (3, 4):  # two more versions, each publishing while the reader answers
    docs.append((f"doc{{i}}", doc(i, paragraphs=2)))
    build_store(docs, sys.argv[1], lm, chunk_tokens=32, embedder=HashEmbedder())
"""


def test_a_reader_keeps_answering_while_a_build_publishes(url, tmp_path):
    from cag.context import CachedContext
    from cag.models import registry

    model = saved_model(tmp_path)
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(3)], url, registry.load(str(model), "float32"),
                chunk_tokens=32, embedder=HashEmbedder())
    ctx = CachedContext(store=url, target=str(model), embedder=HashEmbedder(), dtype="float32",
                        max_new_tokens=3, top_k=3, min_retention=0.0)
    assert ctx.store == url  # a URL stays a str (a Path would fold its "//")
    question = doc(1, paragraphs=1)[:60]
    assert ctx.answer(question).text is not None  # set-up (models, prefix) before the build starts
    proc = subprocess.Popen([sys.executable, "-c", GROWING_BUILD.format(root=str(ROOT)), url, str(model)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    answered: list[tuple[int, bool]] = []  # (store version answered from, build still running)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            running = proc.poll() is None
            answer = ctx.answer(question)
            manifest, _ = ctx._current_view()
            assert not any("skipped chunk" in w for w in answer.warnings), answer.warnings
            assert answer.sources and {h.key for h in answer.sources} <= manifest.chunk_keys()
            answered.append((manifest.version, running))
            if not running:
                break
            time.sleep(0.2)  # leave the build some of this machine's cores
        _, errs = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.close()
    assert proc.returncode == 0, errs[-2000:]
    during = {v for v, running in answered if running}
    assert 1 in during and len(during) >= 2, answered  # answered from v1 and from a version published meanwhile
    assert answered[-1][0] == 3


def test_redis_store_answers_exactly_as_the_local_store(redis_server, tmp_path):
    """`cag build`, `cag store`, `cag query` and `CachedContext` on redis:// and on a folder."""
    from cag.cli import app
    from cag.context import CachedContext

    model = saved_model(tmp_path)
    corpus = write_corpus(tmp_path / "corpus", {f"d{i}.txt": doc(i, paragraphs=3) for i in range(3)})
    url, folder = f"{redis_server}/kb-{uuid.uuid4().hex[:8]}", str(tmp_path / "store")

    def cli(*args):
        result = runner.invoke(app, [*args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    builds = {s: cli("build", str(corpus), "--store", s, "--source", str(model), "--chunk-tokens", "32")
              for s in (folder, url)}
    assert builds[url]["chunks_prefilled"] == builds[folder]["chunks_prefilled"] > 0
    # same keys, same bytes, same manifest and index
    stub = RowsOnlyEmbedder.for_store(open_store(folder))
    views = {}
    for s in (folder, url):
        location = open_store(s)
        manifest, index = location.open_current(stub)
        with location.chunks() as chunks:
            frames = {k: chunks.get(k) for k in chunks.keys()}
        views[s] = (manifest.model_dump(exclude={"published_at"}), [r.__dict__ for r in index.rows],
                    index._index.reconstruct_n(0, index._index.ntotal).tobytes(), frames)
    assert views[url] == views[folder] and len(views[url][3]) == builds[url]["chunks_prefilled"]
    stats = {s: cli("store", "stats", s) for s in (folder, url)}
    assert stats[url].pop("store") == url and stats[folder].pop("store") == folder
    # Redis counts the frames' bytes; a folder also its SQLite pages
    assert stats[url]["bytes_on_disk"] == sum(map(len, views[url][3].values()))
    on_disk = ("bytes_on_disk", "bytes_per_token")
    assert {k: v for k, v in stats[url].items() if k not in on_disk} == \
        {k: v for k, v in stats[folder].items() if k not in on_disk}
    report = cli("store", "verify", url)
    assert report["ok"] == report["checked"] == len(views[url][3]) and not report["problems"]
    assert cli("store", "gc", url)["chunks_collected"] == 0
    assert cli("build", str(corpus), "--store", url, "--source", str(model), "--chunk-tokens", "32")[
        "published"] is False  # nothing changed
    # the same answers, from the CLI and from the Python API
    question = doc(2, paragraphs=1)[:80]

    def query(s):
        row = cli("query", question, "--store", s, "--target", str(model), "--max-new-tokens", "6")
        row.pop("timings")
        return row

    assert query(url) == query(folder)
    answers = {}
    for s in (folder, url):
        ctx = CachedContext(store=s, target=str(model), dtype="float32", max_new_tokens=6, top_k=3,
                            min_retention=0.0)
        try:
            answer = ctx.answer(question)
        finally:
            ctx.close()
        assert answer.condition == "cached" and not any("skipped chunk" in w for w in answer.warnings)
        answers[s] = (answer.text, [(h.key, h.doc_id, h.start, h.end) for h in answer.sources],
                      answer.context_tokens)
    assert answers[url] == answers[folder]
    result = runner.invoke(app, ["store", "stats", f"{redis_server}/nothing-here"])
    assert result.exit_code == 1 and "no store" in result.output
