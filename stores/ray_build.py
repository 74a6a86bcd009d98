"""The nightly build's prefill spread over Ray workers (``pip install "cag[ray]"``).

Only step 2 of `stores.build` moves: `RayPrefill` is a `stores.build.PrefillStep`
that sends batches of chunk texts to Ray actors and yields the encoded chunk
bytes back to the driver. Everything else stays in the driver, as in a
single-process build: planning by document hash, the content-addressed `put` of
every chunk, the index, the atomic publish and the gc. So a Ray build resumes,
publishes and fails exactly like a local one, and equals it byte for byte
(the same batches go through the same code, `stores.build.prefill_locally`).

Each actor loads the source model once, by its registry name or folder path
(`cag.models.registry.load`), and reports its fingerprint; the driver refuses a
worker whose model differs from its own, and checks every returned frame (its
checksum, text hash, model and settings) before it is stored, so a misconfigured
node cannot put wrong bytes under a content address. Only bytes and token counts
cross the wire: never `KVChunk` objects.

A worker process that dies (SIGKILL, OOM, a lost node) is restarted by Ray and
its unfinished batches run again there (``max_restarts`` / ``max_task_retries``).
Past `max_retries` deaths of one worker the build raises `RayBuildError`; what was
stored until then is kept, so a rerun prefills only the rest.

Connect first: `connect("local")` starts a Ray instance on this machine with
`LOCAL_CPUS` CPUs; `connect("host:6379")` joins a cluster this machine is a node
of; `connect("ray://host:10001")` is a Ray Client connection to a remote head.
Every node needs ``cag[ray]`` installed and the source model reachable under the
same name (a short name is converted on each node the first time) or path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cag.kv import ChunkError, ModelFingerprint, read_metadata, text_sha256
from cag.models.loaded import LoadedModel

from .build import Encoded, prefill_locally
from .errors import StoreError

__all__ = ["RayPrefill", "RayBuildError", "RayNotInstalledError", "connect", "import_ray", "LOCAL_CPUS"]

# `--ray local`: a small local cluster; on a machine with more cores, start one with
# `ray start --head --num-cpus N` and pass its address instead.
LOCAL_CPUS = 2


class RayNotInstalledError(StoreError):
    """`--ray` was asked for, but the optional Ray dependency is not installed."""


class RayBuildError(StoreError):
    """The Ray prefill failed: a worker died too often, loaded another model, or
    returned a chunk that is not the one asked for."""


def import_ray():
    """The `ray` module, or `RayNotInstalledError` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RayNotInstalledError('building on Ray needs the optional dependency: '
                                   'pip install "cag[ray]"') from None
    return ray


def connect(address: str) -> bool:
    """Connect this process to Ray: ``"local"`` starts an instance here with
    `LOCAL_CPUS` CPUs, anything else is a cluster address (``host:port``, ``auto``,
    ``ray://host:10001``). Returns False when Ray was connected already (nothing done).

    Worker output stays in Ray's log folder (``/tmp/ray/session_latest/logs``)
    rather than interleaving with the build's progress; a worker's error still
    reaches the driver with its traceback.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if not address:
        raise ValueError("--ray needs 'local' or a cluster address (host:port or ray://host:10001)")
    try:
        if address == "local":
            ray.init(num_cpus=LOCAL_CPUS, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise RayBuildError(f"cannot start or reach Ray at {address!r}: {exc}") from exc
    return True


class _PrefillWorker:
    """One Ray actor: the source model, loaded once, prefilling batch after batch."""

    def __init__(self, model: str, dtype: str, sink_ids: list[int], prefill_prefix: str, threads: int) -> None:
        import torch

        from cag.models import registry

        # Ray sets OMP_NUM_THREADS to the actor's CPUs; `threads` overrides it (why: RayPrefill).
        torch.set_num_threads(threads)
        lm = registry.load(model, dtype)
        if (list(lm.sink_ids), lm.prefill_prefix) != (sink_ids, prefill_prefix):
            # the driver's source prefills after another prefix (e.g. `with_prefill_prefix`)
            lm = dataclasses.replace(lm, sink_ids=list(sink_ids), prefill_prefix=prefill_prefix)
        self.lm = lm

    def identity(self) -> dict[str, Any]:
        """What the driver checks before sending work, and the pid (for tests and logs)."""
        return {"pid": os.getpid(), "fingerprint": self.lm.fingerprint.to_dict(),
                "chunk_settings": self.lm.chunk_settings()}

    def prefill(self, texts: list[str], settings: dict[str, Any], dtype: str) -> tuple[int, list[Encoded]]:
        # The very code of the single-process build, so the bytes are the same.
        (_, encoded), = prefill_locally(self.lm, [texts], settings, dtype)
        return os.getpid(), encoded


class RayPrefill:
    """A `stores.build.PrefillStep` on Ray actors: ``build_store(..., prefill=RayPrefill(name))``.

    `model`: what the workers load, a registry short name, a folder (made absolute
    here; it must exist at that path on every node) or a Hugging Face id. It must
    be the model the driver passes to `build_store` as `source`; the workers load
    it in the driver's dtype. `workers`: how many actors (default: the cluster's
    CPUs divided by `cpus_per_worker`, at most one per batch). `batches_in_flight`:
    batches sent ahead to each worker, so it never waits for the driver's writes;
    it also bounds the results waiting in the driver's memory.

    Workers are stopped at the end of each build, since they hold their CPUs on the
    cluster. A driver that builds again and again (a scheduler, a test) can pass
    `keep_workers=True` to skip their start-up (model loading) the next time, and
    calls `close()` (or uses ``with``) when done; after a failed build they are
    stopped regardless.

    `threads`: torch threads per worker, by default the driver's own
    (``torch.get_num_threads()``), so a worker computes exactly what the driver
    would: on CPUs with native bf16 the result of a bf16 forward depends on the
    thread count. Chunks from workers on other hardware or thread counts differ in
    their last bits (their keys do not: those hash text, model and settings).
    `start_timeout_s`: how long the workers may take to start and load the model;
    past it (a cluster without free CPUs, a node that cannot load the model) the
    build fails with `RayBuildError` instead of waiting forever.

    After a call: `worker_pids` holds the workers' pids at its start and
    `batches_by_pid` counts the batches each process computed in it (a restarted
    worker has a new pid).
    """

    def __init__(self, model: str | os.PathLike[str], *, workers: int | None = None, cpus_per_worker: float = 1,
                 max_retries: int = 3, batches_in_flight: int = 2, keep_workers: bool = False,
                 threads: int | None = None, start_timeout_s: float = 600) -> None:
        model = os.fspath(model)
        path = Path(model).expanduser()
        self.model = str(path.resolve()) if path.is_dir() else model
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        if batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be at least 1, not {batches_in_flight}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self.workers, self.cpus_per_worker, self.threads = workers, cpus_per_worker, threads
        self.start_timeout_s = start_timeout_s
        self.max_retries, self.batches_in_flight, self.keep_workers = max_retries, batches_in_flight, keep_workers
        self.worker_pids: list[int] = []
        self.batches_by_pid: Counter[int] = Counter()
        self._actors: list[Any] = []
        self._spec: tuple | None = None  # what the running actors were started with

    def __enter__(self) -> "RayPrefill":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (a no-op when none runs)."""
        if self._actors:
            ray = import_ray()
            for actor in self._actors:
                ray.kill(actor)
        self._actors, self._spec = [], None

    def __call__(self, source: LoadedModel, batches: Sequence[list[str]], settings: dict[str, Any],
                 dtype: str) -> Iterator[tuple[int, list[Encoded]]]:
        if not batches:  # an unchanged corpus starts no worker
            return
        ray = import_ray()
        if not ray.is_initialized():
            raise RayBuildError("Ray is not connected: call stores.ray_build.connect('local' or an address) "
                                "or ray.init() first")
        finished = False
        try:
            actors = self._start(ray, source, min(self.workers or self._cluster_workers(ray), len(batches)))
            queue = deque(range(len(batches)))
            pending: dict[Any, tuple[int, Any]] = {}  # object ref -> (batch number, actor)

            def send(actor) -> None:
                if queue:
                    number = queue.popleft()
                    pending[actor.prefill.remote(batches[number], settings, dtype)] = (number, actor)

            for actor in actors:
                for _ in range(self.batches_in_flight):
                    send(actor)
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                number, actor = pending.pop(ref)
                pid, encoded = self._get(ray, ref, f"prefilling batch {number}")
                send(actor)  # before the driver's checks and writes: the worker keeps computing
                self._check_chunks(source, batches[number], encoded, settings, number)
                self.batches_by_pid[pid] += 1
                yield number, encoded
            finished = True
        finally:
            # also on an error or an abandoned build: the workers' queued batches are moot
            if not (finished and self.keep_workers):
                self.close()

    def _start(self, ray, source: LoadedModel, count: int) -> list[Any]:
        """At least `count` workers of `source`'s model, checked against it."""
        import torch

        spec = (self.model, str(source.dtype).removeprefix("torch."), list(source.sink_ids), source.prefill_prefix,
                self.threads or torch.get_num_threads())
        if self._spec != spec:  # kept workers of another model, prefix or thread count
            self.close()
        worker = ray.remote(_PrefillWorker).options(num_cpus=self.cpus_per_worker, max_restarts=self.max_retries,
                                                    max_task_retries=self.max_retries)
        while len(self._actors) < count:
            self._actors.append(worker.remote(*spec))
        self._spec = spec
        identities = self._get(ray, [a.identity.remote() for a in self._actors], "loading the source model",
                               timeout=self.start_timeout_s)
        for identity in identities:
            self._check_worker(source, identity)
        self.worker_pids = [i["pid"] for i in identities]
        self.batches_by_pid = Counter()
        return list(self._actors)

    def _cluster_workers(self, ray) -> int:
        return max(1, int(ray.cluster_resources().get("CPU", 1) // self.cpus_per_worker))

    def _get(self, ray, refs, doing: str, timeout: float | None = None):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RayBuildError(f"Ray workers did not finish {doing} within {timeout:g} s: the cluster has "
                                f"{ray.available_resources().get('CPU', 0):g} CPU(s) free, each worker needs "
                                f"{self.cpus_per_worker:g}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            raise RayBuildError(f"a Ray worker died while {doing}, more than {self.max_retries} time(s) "
                                f"({type(exc).__name__}); chunks stored so far are kept, so rerunning the "
                                "build prefills only the rest") from exc

    @staticmethod
    def _check_worker(source: LoadedModel, identity: dict[str, Any]) -> None:
        theirs = ModelFingerprint.from_dict(identity["fingerprint"])
        if theirs.id != source.fingerprint.id:
            raise RayBuildError(f"a Ray worker (pid {identity['pid']}) loaded {theirs.describe()}, but the build's "
                                f"source is {source.fingerprint.describe()}: give every node the same model")
        if identity["chunk_settings"] != source.chunk_settings():
            raise RayBuildError(f"a Ray worker (pid {identity['pid']}) prefills with {identity['chunk_settings']}, "
                                f"the build with {source.chunk_settings()}")

    @staticmethod
    def _check_chunks(source: LoadedModel, texts: list[str], encoded: list[Encoded], settings: dict[str, Any],
                      number: int) -> None:
        """Every frame is intact and is the chunk of its text, model and settings
        (metadata only: the tensors are not decoded)."""
        if not isinstance(encoded, list) or len(encoded) != len(texts):
            raise RayBuildError(f"a Ray worker returned {type(encoded).__name__} for batch {number}, "
                                f"not {len(texts)} chunks")
        wanted = json.loads(json.dumps(settings))  # as the frame's JSON metadata holds them
        for text, item in zip(texts, encoded):
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], bytes)
                    or not isinstance(item[1], int)):
                raise RayBuildError(f"a Ray worker returned a malformed chunk in batch {number}")
            try:
                meta = read_metadata(item[0])
            except ChunkError as exc:
                raise RayBuildError(f"a Ray worker returned a damaged chunk in batch {number}: {exc}") from None
            try:
                model_id = ModelFingerprint.from_dict(meta.get("model") or {}).id
            except ChunkError:
                model_id = None
            if (meta.get("text_hash") != text_sha256(text) or model_id != source.fingerprint.id
                    or meta.get("settings") != wanted):
                raise RayBuildError(f"a Ray worker returned a chunk of another text, model or settings "
                                    f"in batch {number}")
