"""The `ChunkStore` interface: where the KV bytes of prefilled chunks live.

A chunk store is a persistent map from a *chunk key* (a content address, see
`chunk_key`) to the bytes of one `cag.kv.KVChunk` frame. Stores hold **bytes
only**: they never see, build or unpickle Python objects, and they do not decode
the frames either — decoding and fingerprint checks are the caller's, through
`KVChunk.from_bytes(data, expect_model=...)`.

Primitives, and who calls them:

======================  ===========================================================
primitive               caller
======================  ===========================================================
``put(key, value)``     **builder** (nightly build): store one encoded chunk. Keys
                        are content addresses, so by default an existing key is
                        kept (the same text under the same model is prefilled
                        once); ``overwrite=True`` replaces a bad entry. Each put is
                        atomic: a reader sees the old entry, the new one, or none.
``contains(key)``       **builder**: skip the prefill of a chunk already stored.
``get(key)``            **query-time reader**: the bytes of a retrieved chunk, or
                        ``None`` when absent. Raises `StoreIntegrityError` for an
                        entry that is not plain bytes (it is never deserialised).
``delete(key)``         **maintenance** (gc of chunks no manifest references).
``keys()``              **maintenance**: iterate every stored key (gc, verify,
                        listings); order unspecified.
``stats()``             **maintenance** / reporting: `StoreStats` (entries, bytes
                        on disk, path).
``close()``             everyone, at the end: release files and connections.
======================  ===========================================================

Implementations: `stores.diskcache_store.DiskCacheChunkStore` (local disk);
remote backends later implement the same protocol.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

from cag.kv import ModelFingerprint

__all__ = ["ChunkStore", "StoreStats", "chunk_key", "canonical_json", "CHUNK_KEY_VERSION"]

CHUNK_KEY_VERSION = 1


@dataclass(frozen=True)
class StoreStats:
    """Size of a store: number of entries, bytes on disk, where it lives."""

    entries: int
    bytes: int
    path: str


@runtime_checkable
class ChunkStore(Protocol):
    """A persistent ``str -> bytes`` map of encoded `KVChunk` frames (see module doc)."""

    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`, or ``None`` when absent (query-time reader)."""
        ...

    def put(self, key: str, value: bytes, *, overwrite: bool = False) -> bool:
        """Store `value` (bytes only) under `key`; True if written (builder)."""
        ...

    def contains(self, key: str) -> bool:
        """Whether `key` is stored, without reading its value (builder)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove `key`; True if it was present (maintenance)."""
        ...

    def keys(self) -> Iterator[str]:
        """Every stored key, in no particular order (maintenance)."""
        ...

    def stats(self) -> StoreStats:
        """Entries, bytes on disk and path of the store (maintenance)."""
        ...

    def close(self) -> None:
        """Release the store's files and connections."""
        ...


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no whitespace: equal data gives equal text."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def chunk_key(source: ModelFingerprint, settings: Mapping[str, Any], text: str) -> str:
    """Content address of a chunk: sha256 over the source model's fingerprint id,
    the canonical JSON of the settings it was made with, and its text.

    The same text, chunked the same way and prefilled by the same model, always
    gets the same key — so it is prefilled and stored once. The three parts are
    joined with NUL bytes, which neither a fingerprint id (hex) nor canonical JSON
    contains, so no two different triples hash the same input.
    """
    if not isinstance(source, ModelFingerprint):
        raise TypeError(f"source must be a ModelFingerprint, got {type(source).__name__}")
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    h = hashlib.sha256()
    h.update(f"cag-chunk-key-v{CHUNK_KEY_VERSION}\0".encode())
    h.update(source.id.encode())
    h.update(b"\0")
    h.update(canonical_json(dict(settings)).encode("utf-8"))
    h.update(b"\0")
    h.update(text.encode("utf-8"))
    return h.hexdigest()
