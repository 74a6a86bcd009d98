"""Where a store lives — a local folder or a server URL — behind one small interface.

A *store location* is everything a store is besides the chunk bytes' format: the
chunk store itself (`chunks()`, a `ChunkStore`) and the published versions
(manifest and vector index, `publish` / `open_current` / `cleanup_versions`).
`open_store(spec)` turns what a user typed into one:

==========================  ============================================  ==========================
spec                        location                                      module
==========================  ============================================  ==========================
a folder path               `LocalStore`: diskcache chunks + version      `stores.manifest`
                            folders and an atomic ``CURRENT`` file
``redis://host:port/NAME``  `stores.redis_store.RedisStore`: chunks,      `stores.redis_store`
``rediss://…`` (TLS)        versions and ``CURRENT`` in one Redis server  (``pip install "cag[redis]"``)
==========================  ============================================  ==========================

This is the one place that dispatches on the spec, as LMCache's
``CreateConnector`` picks a remote backend by the scheme of ``remote_url``:
the build (`stores.build`), `cag.context.CachedContext` and the CLI only ever
call `open_store` and the methods below, so a new backend is one class and one
line here. The Redis client is imported only when a ``redis://`` spec is opened.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from cag.kv import ModelFingerprint

from .base import ChunkStore

if TYPE_CHECKING:  # faiss and pydantic are imported by the methods that need them
    from .index import Embedder, VectorIndex
    from .manifest import Manifest

__all__ = ["StoreLocation", "LocalStore", "open_store", "is_store_url", "URL_SCHEMES"]

URL_SCHEMES = ("redis", "rediss")


@runtime_checkable
class StoreLocation(Protocol):
    """A store: its chunk bytes and its published versions (see module doc)."""

    def __str__(self) -> str:
        """Where the store is, for messages (a path, or a URL without its password)."""
        ...

    def exists(self) -> bool:
        """Whether anything was ever written here (a build creates it)."""
        ...

    def chunks(self) -> ChunkStore:
        """A new handle on the chunk bytes; the caller closes it."""
        ...

    def current_version(self) -> int | None:
        """The published version number, None when nothing is published."""
        ...

    def list_versions(self) -> list[int]:
        """The complete versions kept, ascending."""
        ...

    def load_manifest(self, version: int) -> "Manifest":
        """The manifest of one kept version (`FileNotFoundError` if it is gone)."""
        ...

    def index_info(self, version: int) -> dict[str, Any]:
        """Embedder id, dim and row count of a version's index, without loading it."""
        ...

    def open_current(self, embedder: "Embedder | str | None" = None, *,
                     embedder_id: str | None = None) -> tuple["Manifest", "VectorIndex"]:
        """The published manifest and its index, from one version (`FileNotFoundError`
        when nothing is published)."""
        ...

    def check_compatible(self, source: ModelFingerprint | Mapping[str, Any], chunker: Mapping[str, Any],
                         embedder_id: str | None = None) -> "Manifest | None":
        """For a build: the current manifest if built with these settings, None for an
        empty store, `StoreMismatchError` otherwise."""
        ...

    def publish(self, manifest: "Manifest", index: "VectorIndex", *, keep: int = 2) -> int:
        """Publish the next version atomically; returns its number."""
        ...

    def cleanup_versions(self, *, keep: int = 2) -> list[int]:
        """Delete all but the newest `keep` versions (never the current one)."""
        ...

    def close(self) -> None:
        """Release connections (a no-op for a folder)."""
        ...


def is_store_url(spec: object) -> bool:
    """Whether `spec` names a store on a server (``scheme://…``) rather than a folder."""
    return isinstance(spec, str) and "://" in spec


def open_store(spec: "str | os.PathLike[str] | StoreLocation") -> StoreLocation:
    """The store `spec` names: a folder path, a ``redis://host:port/NAME`` URL, or a
    location already opened (returned as is). Opening connects to nothing yet."""
    if not isinstance(spec, (str, os.PathLike)):
        if isinstance(spec, StoreLocation):
            return spec
        raise TypeError(f"a store is a folder path or a URL, got {type(spec).__name__}")
    if not is_store_url(spec):
        return LocalStore(spec)
    scheme = spec.split("://", 1)[0].lower()
    if scheme in URL_SCHEMES:
        from .redis_store import RedisStore  # needs the optional `redis` package

        return RedisStore.from_url(spec)
    raise ValueError(f"unknown store URL scheme {scheme!r}; cag opens a folder path or "
                     f"{', '.join(s + '://host:port/NAME' for s in URL_SCHEMES)} URLs")


class LocalStore:
    """A store in a local folder: the layout and atomic publication of `stores.manifest`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.path)!r})"

    def exists(self) -> bool:
        return self.path.is_dir()

    def chunks(self) -> ChunkStore:
        from .diskcache_store import DiskCacheChunkStore
        from .manifest import chunks_dir

        return DiskCacheChunkStore(chunks_dir(self.path))

    def current_version(self) -> int | None:
        from .manifest import current_version

        return current_version(self.path)

    def list_versions(self) -> list[int]:
        from .manifest import list_versions

        return list_versions(self.path)

    def load_manifest(self, version: int) -> "Manifest":
        from .manifest import MANIFEST_FILE, Manifest, version_dir

        return Manifest.load(version_dir(self.path, version) / MANIFEST_FILE)

    def index_info(self, version: int) -> dict[str, Any]:
        from .index import VectorIndex
        from .manifest import version_dir

        return VectorIndex.read_info(version_dir(self.path, version))

    def open_current(self, embedder: "Embedder | str | None" = None, *,
                     embedder_id: str | None = None) -> tuple["Manifest", "VectorIndex"]:
        from .manifest import open_current

        return open_current(self.path, embedder, embedder_id=embedder_id)

    def check_compatible(self, source: ModelFingerprint | Mapping[str, Any], chunker: Mapping[str, Any],
                         embedder_id: str | None = None) -> "Manifest | None":
        from .manifest import check_compatible

        return check_compatible(self.path, source, chunker, embedder_id)

    def publish(self, manifest: "Manifest", index: "VectorIndex", *, keep: int = 2) -> int:
        from .manifest import publish

        return publish(self.path, manifest, index, keep=keep)

    def cleanup_versions(self, *, keep: int = 2) -> list[int]:
        from .manifest import cleanup_versions

        return cleanup_versions(self.path, keep=keep)

    def close(self) -> None:
        pass
