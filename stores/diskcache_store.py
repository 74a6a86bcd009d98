"""`DiskCacheChunkStore`: a `ChunkStore` on a local `diskcache.Cache`, bytes only.

How "nothing is ever unpickled" is guaranteed
---------------------------------------------
diskcache records, for every row, how its value was serialised: ``MODE_RAW``
(bytes or a number inline in SQLite), ``MODE_BINARY`` (bytes in a side file),
``MODE_TEXT`` (a str in a side file) or ``MODE_PICKLE`` (any other object,
pickled). Keys likewise carry a ``raw`` flag (False = pickled key). Every read
goes through the cache's `Disk` object, so the store plugs in `BytesOnlyDisk`,
whose

* ``fetch`` returns only raw bytes (``MODE_RAW`` holding bytes, ``MODE_BINARY``)
  and raises `StoreIntegrityError` for every other mode *before touching the
  data* — in particular it never calls ``pickle.load``;
* ``get`` (key decoding) refuses pickled keys the same way;
* ``store`` / ``put`` refuse anything but bytes values and str keys, so this
  store can never write a pickle either.

An entry written behind the store's back (e.g. a plain `diskcache.Cache` on the
same directory storing a Python object) is therefore refused with an error
naming its key, never loaded.

Durability: each put is one SQLite transaction (diskcache writes a large value
to its side file first, then commits the row), so a reader sees the old entry,
the new one, or none. Eviction and expiry are disabled: a chunk stays until it
is deleted. The frames themselves are checked by the caller (`KVChunk.from_bytes`)
or in bulk by `verify`.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import diskcache
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT

from cag.kv import (
    ChecksumError,
    ChunkError,
    ChunkFormatError,
    KVChunk,
    ModelFingerprint,
    TruncatedChunkError,
    read_metadata,
)

from .base import StoreStats
from .errors import StoreIntegrityError
from .translations import is_translation_key

__all__ = ["DiskCacheChunkStore", "BytesOnlyDisk", "VerifyReport", "EntryProblem", "verify_chunks"]

_MODE_NAMES = {MODE_RAW: "raw", MODE_BINARY: "binary", MODE_TEXT: "text", MODE_PICKLE: "pickle"}

# Settings the cache is always opened with (diskcache persists settings in its
# SQLite table; passing them on every open overrides whatever is stored there).
_CACHE_SETTINGS: dict[str, Any] = {
    "eviction_policy": "none",  # never drop a chunk to stay under a size limit
    "cull_limit": 0,
    "statistics": False,  # reads stay lock-free (no hit/miss counters to update)
    "tag_index": False,
    "disk_min_file_size": 2**15,  # values >= 32 KiB go to side files (most chunks)
}


class _RefusedValue(Exception):
    """Raised by `BytesOnlyDisk` without a key; the store re-raises it with one."""


class BytesOnlyDisk(diskcache.Disk):
    """A diskcache `Disk` that stores and returns raw bytes only and never unpickles."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError(f"chunk keys are str, got {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise StoreIntegrityError(
                "the store holds a pickled key (written by something else than this store); "
                "refusing to unpickle it"
            )
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> tuple[Any, ...]:
        if read or type(value) is not bytes:
            raise TypeError(f"chunk store values are bytes, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == MODE_RAW and isinstance(value, (bytes, sqlite3.Binary, memoryview)):
            return bytes(value)
        if mode == MODE_BINARY and not read:
            return super().fetch(mode, filename, value, read)
        # MODE_PICKLE, MODE_TEXT, a number stored raw, or anything unknown: refuse
        # before the value is interpreted in any way.
        kind = _MODE_NAMES.get(mode, f"mode {mode}")
        if mode == MODE_RAW:
            kind = f"raw {type(value).__name__}"
        raise _RefusedValue(kind)


@dataclass(frozen=True)
class EntryProblem:
    """One entry `verify` found wrong: its key, a kind and a message.

    kind: ``"refused"`` (pickled/non-bytes value), ``"missing"`` (listed but its
    file is gone), ``"truncated"``, ``"checksum"``, ``"format"`` or ``"foreign"``.
    """

    key: str
    kind: str
    message: str


@dataclass
class VerifyReport:
    """Result of `DiskCacheChunkStore.verify`."""

    checked: int = 0
    ok: int = 0
    corrupt: list[EntryProblem] = field(default_factory=list)
    foreign: list[EntryProblem] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.corrupt and not self.foreign

    @property
    def problems(self) -> list[EntryProblem]:
        return [*self.corrupt, *self.foreign]


class DiskCacheChunkStore:
    """A `ChunkStore` in a local directory, on `diskcache.Cache` with `BytesOnlyDisk`.

    Safe to share between threads and processes (diskcache's SQLite locking).
    Usable as a context manager.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self._cache = diskcache.Cache(str(self.path), timeout=timeout, disk=BytesOnlyDisk, **_CACHE_SETTINGS)

    # ----------------------------------------------------------------- primitives

    def get(self, key: str) -> bytes | None:
        """The bytes under `key`, or None. `StoreIntegrityError` for a non-bytes entry."""
        _check_key(key)
        try:
            value = self._cache.get(key, default=None, retry=True)
        except _RefusedValue as exc:
            raise StoreIntegrityError(
                f"store entry {key!r} in {self.path} is a {exc} value, not raw bytes; "
                "it was not written by this store and is refused (never unpickled). "
                "Delete it or rebuild the store.",
                key=key,
            ) from None
        return value

    def put(self, key: str, value: bytes, *, overwrite: bool = False) -> bool:
        """Store `value` under `key`. Without `overwrite`, an existing key is kept
        (content addresses: same key, same bytes) and False is returned."""
        _check_key(key)
        if type(value) is not bytes:
            if isinstance(value, (bytearray, memoryview)):
                value = bytes(value)
            else:
                raise TypeError(f"chunk store values are bytes, got {type(value).__name__}")
        if overwrite:
            return bool(self._cache.set(key, value, retry=True))
        return bool(self._cache.add(key, value, retry=True))

    def contains(self, key: str) -> bool:
        _check_key(key)
        return key in self._cache

    __contains__ = contains

    def delete(self, key: str) -> bool:
        _check_key(key)
        return bool(self._cache.delete(key, retry=True))

    def keys(self) -> Iterator[str]:
        """Every key (raises `StoreIntegrityError` on a pickled key: never unpickled)."""
        return iter(self._cache.iterkeys())

    def __len__(self) -> int:
        return len(self._cache)

    def stats(self) -> StoreStats:
        return StoreStats(entries=len(self._cache), bytes=int(self._cache.volume()), path=str(self.path))

    def close(self) -> None:
        self._cache.close()

    def __enter__(self) -> "DiskCacheChunkStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- maintenance

    def verify(self, expect_model: ModelFingerprint | None = None) -> VerifyReport:
        """Re-read every entry and check it is a valid `KVChunk` frame (see `verify_chunks`)."""
        return verify_chunks(self, expect_model)


def verify_chunks(store: Any, expect_model: ModelFingerprint | None = None) -> VerifyReport:
    """Re-read every entry of a `ChunkStore` and check it is a valid `KVChunk` frame.

    Per entry: it is raw bytes (else ``refused``), its frame and checksum hold
    and its metadata parses (`read_metadata`), its fingerprint is
    `expect_model`'s when given (else ``foreign``; a stored translation, `stores.translations`,
    must instead say it was translated from `expect_model`), and it fully decodes
    (`KVChunk.from_bytes`). Nothing is repaired or deleted. Any backend's store
    is checked by this one function, so every backend is held to the same checks.
    """
    report = VerifyReport()
    for key in list(store.keys()):
        report.checked += 1
        try:
            data = store.get(key)
        except StoreIntegrityError as exc:
            report.corrupt.append(EntryProblem(key, "refused", str(exc)))
            continue
        if data is None:
            report.corrupt.append(EntryProblem(key, "missing", "listed, but its value cannot be read"))
            continue
        try:
            meta = read_metadata(data)
            model = ModelFingerprint.from_dict(meta.get("model") or {})
            if is_translation_key(key):
                # a stored translation is the target's chunk; what must match is the model it came from
                made_from = ((meta.get("settings") or {}).get("translated") or {}).get("source")
                if made_from is None or (expect_model is not None and made_from != expect_model.id):
                    report.foreign.append(EntryProblem(
                        key, "foreign", f"stored as a translation, but translated from {made_from!r}, not "
                                        f"{expect_model.describe() if expect_model is not None else 'a source'}"))
                    continue
            elif expect_model is not None and model.id != expect_model.id:
                report.foreign.append(
                    EntryProblem(key, "foreign", f"computed by {model.describe()}, "
                                                 f"expected {expect_model.describe()}")
                )
                continue
            KVChunk.from_bytes(data)
        except ChunkError as exc:
            report.corrupt.append(EntryProblem(key, _problem_kind(exc), str(exc)))
            continue
        report.ok += 1
    return report


def _problem_kind(exc: ChunkError) -> str:
    if isinstance(exc, TruncatedChunkError):
        return "truncated"
    if isinstance(exc, ChecksumError):
        return "checksum"
    if isinstance(exc, ChunkFormatError):
        return "format"
    return "format"


def _check_key(key: object) -> None:
    if type(key) is not str or not key:
        raise TypeError(f"chunk keys are non-empty str, got {key!r}")
