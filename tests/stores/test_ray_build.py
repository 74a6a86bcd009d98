"""The build's prefill on a local Ray cluster (2 CPUs): equal to the single-process
build chunk for chunk, resumable, and surviving a worker killed mid-build.

Ray is an optional extra, but these tests need it: without it they fail with the
install line, they do not skip (`make setup` installs it with the dev extra).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.cli import app
from cag.models import registry
from stores.build import build_store
from stores.diskcache_store import DiskCacheChunkStore
from stores.manifest import chunks_dir
from stores.ray_build import RayBuildError, RayNotInstalledError, RayPrefill, connect
from tests.stores.test_build import HashEmbedder, doc, snapshot, write_corpus
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module: starting one takes 10-30 s here."""
    try:
        import ray
    except ImportError:
        pytest.fail('Ray is not installed; these tests need it: pip install "cag[ray]" (make setup does)')
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def save_tiny(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """A tiny model as a folder: what a Ray worker process can load by path."""
    model, tokenizer = tiny_model(family, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("ray-model") / "llama")


@pytest.fixture(scope="module")
def source(tiny_folder):
    return registry.load(str(tiny_folder), "float32")


def build(corpus, store, lm, **kw):
    kw.setdefault("chunk_tokens", 32)
    kw.setdefault("batch_size", 2)
    return build_store(corpus, store, lm, embedder=HashEmbedder(), **kw)


def chunk_bytes(store: Path) -> dict[str, bytes]:
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        return {key: chunks.get(key) for key in sorted(chunks.keys())}


def assert_same_store(got: Path, want: Path) -> None:
    assert snapshot(got) == snapshot(want)  # manifest, index rows and vectors, chunk keys
    assert chunk_bytes(got) == chunk_bytes(want)


def test_ray_build_equals_local_build(tmp_path, ray_cluster, tiny_folder, source):
    v1 = {f"d{i}.txt": doc(i) for i in range(5)}
    v2 = {**{k: v for k, v in v1.items() if k != "d4.txt"}, "d1.txt": doc(1) + "A new closing line.",
          "d7.txt": doc(7)}
    local1 = build(write_corpus(tmp_path / "c1", v1), tmp_path / "local", source)
    # kept workers: the second build skips their start-up (10-30 s of imports here)
    with RayPrefill(tiny_folder, keep_workers=True) as prefill:
        remote1 = build(tmp_path / "c1", tmp_path / "ray", source, prefill=prefill)
        assert len(prefill.batches_by_pid) == 2  # both workers of the 2-CPU cluster did work
        assert sum(prefill.batches_by_pid.values()) == -(-local1.chunks_prefilled // 2)
        assert_same_store(tmp_path / "ray", tmp_path / "local")
        assert (remote1.chunks_prefilled, remote1.tokens_prefilled, remote1.version) == \
               (local1.chunks_prefilled, local1.tokens_prefilled, local1.version)
        first_pids = list(prefill.worker_pids)

        # incremental: only the changed and new documents' chunks are prefilled, on Ray as locally
        local2 = build(write_corpus(tmp_path / "c2", v2), tmp_path / "local", source)
        remote2 = build(tmp_path / "c2", tmp_path / "ray", source, prefill=prefill)
        assert prefill.worker_pids == first_pids
    assert (remote2.new, remote2.changed, remote2.removed) == (local2.new, local2.changed, local2.removed) == (1, 1, 1)
    assert 0 < remote2.chunks_prefilled == local2.chunks_prefilled < local1.chunks_prefilled
    assert remote2.chunks_collected == local2.chunks_collected
    assert_same_store(tmp_path / "ray", tmp_path / "local")

    # nothing changed: no batch, so no worker is started at all
    idle = RayPrefill(tiny_folder)
    again = build(tmp_path / "c2", tmp_path / "ray", source, prefill=idle)
    assert (again.chunks_prefilled, again.published, idle.worker_pids) == (0, False, [])


def test_killed_worker_is_retried(tmp_path, ray_cluster, tiny_folder, source):
    corpus = write_corpus(tmp_path / "c", {f"d{i}.txt": doc(i, paragraphs=6) for i in range(6)})
    local = build(corpus, tmp_path / "local", source, batch_size=1)
    # One worker (the 2-worker spread is tested above; each start costs 10-30 s of
    # imports here) and one batch in flight: the driver sends the worker its next
    # batch just before it stores the previous one, so the worker killed below holds
    # a batch (queued or running) when it dies, and every later batch too.
    prefill = RayPrefill(tiny_folder, workers=1, batches_in_flight=1)
    killed = []

    def kill_worker(event):
        if event.kind == "chunk_stored" and not killed:
            (pid,) = prefill.worker_pids
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    remote = build(corpus, tmp_path / "ray", source, batch_size=1, prefill=prefill, on_event=kill_worker)
    assert killed and prefill.batches_by_pid[killed[0]] >= 1
    restarted = set(prefill.batches_by_pid) - set(killed)
    assert len(restarted) == 1, f"no restarted worker computed a batch: {dict(prefill.batches_by_pid)}"
    assert prefill.batches_by_pid[restarted.pop()] >= remote.chunks_prefilled - 2  # all but one or two
    assert remote.chunks_prefilled == local.chunks_prefilled > 20
    assert_same_store(tmp_path / "ray", tmp_path / "local")


def test_worker_with_another_model_is_refused(tmp_path, ray_cluster, source):
    other = save_tiny(tmp_path / "other", seed=1)  # same architecture and tokenizer, other weights
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    with pytest.raises(RayBuildError, match="same model"):
        build(corpus, tmp_path / "s", source, prefill=RayPrefill(other, workers=1))
    with DiskCacheChunkStore(chunks_dir(tmp_path / "s")) as chunks:
        assert len(chunks) == 0  # refused before anything was stored


def test_workers_that_cannot_start_fail_the_build_instead_of_waiting(tmp_path, ray_cluster, tiny_folder, source):
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    # a worker that needs 3 CPUs never starts on the 2-CPU cluster
    with pytest.raises(RayBuildError, match="did not finish loading the source model within 5 s"):
        build(corpus, tmp_path / "s", source, prefill=RayPrefill(tiny_folder, workers=1, cpus_per_worker=3,
                                                                 start_timeout_s=5))
    with DiskCacheChunkStore(chunks_dir(tmp_path / "s")) as chunks:
        assert len(chunks) == 0


def test_cli_build_on_ray_equals_cli_build(tmp_path, ray_cluster, tiny_folder):
    corpus = write_corpus(tmp_path / "c", {f"d{i}.txt": doc(i, paragraphs=2) for i in range(3)})
    runner = CliRunner()
    rows = {}
    for name, extra in (("local", []), ("ray", ["--ray", "local"])):  # Ray is up: `local` joins it
        # one batch, so one worker: this tests the command's wiring, the rest is tested above
        result = runner.invoke(app, ["build", str(corpus), "--store", str(tmp_path / name), "--source",
                                     str(tiny_folder), "--chunk-tokens", "32", "--batch", "64", *extra, "--json"])
        assert result.exit_code == 0, result.output
        rows[name] = json.loads(result.stdout.strip().splitlines()[-1])
    assert rows["ray"]["chunks_prefilled"] == rows["local"]["chunks_prefilled"] > 0
    assert chunk_bytes(tmp_path / "ray") == chunk_bytes(tmp_path / "local")


def test_without_ray_the_error_names_the_extra(tmp_path, monkeypatch, tiny_folder):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(RayNotInstalledError, match=r'pip install "cag\[ray\]"'):
        connect("local")
    corpus = write_corpus(tmp_path / "c", {"a.txt": doc(1)})
    result = CliRunner().invoke(app, ["build", str(corpus), "--store", str(tmp_path / "s"), "--source",
                                      str(tiny_folder), "--ray", "local"])
    assert result.exit_code == 1
    assert "cag[ray]" in result.output and not (tmp_path / "s").exists()


@pytest.mark.integration
def test_smollm2_ray_build_equals_local_build(tmp_path, ray_cluster):
    from eval.datasets import essays_dir

    # the three shortest essays of more than one paragraph: a few chunks each
    essays = sorted((p for p in essays_dir().glob("*.txt") if p.stat().st_size > 500),
                    key=lambda p: p.stat().st_size)[:3]
    corpus = write_corpus(tmp_path / "c", {p.name: p.read_text() for p in essays})
    lm = registry.load("smollm2-135m", "bfloat16")  # what `cag build` prefills with
    local = build(corpus, tmp_path / "local", lm, chunk_tokens=256)
    # One worker: the tiny tests cover the spreading; this one covers the real model
    # loaded by its short name in another process, in bf16, and its bytes (equal
    # only because the worker runs the driver's thread count: see RayPrefill).
    remote = build(corpus, tmp_path / "ray", lm, chunk_tokens=256, prefill=RayPrefill("smollm2-135m", workers=1))
    assert remote.chunks_prefilled == local.chunks_prefilled >= 4
    assert_same_store(tmp_path / "ray", tmp_path / "local")
