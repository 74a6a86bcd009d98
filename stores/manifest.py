"""The store `Manifest` and the atomic publication of store versions.

A store directory holds the chunk bytes (a `ChunkStore`, shared by all versions:
its entries are content-addressed and immutable) and a sequence of published
*versions*, each a complete description of the corpus::

    <store>/
      CURRENT              "7\\n": the published version
      versions/6/          manifest.json, index.faiss, rows.json   (previous)
      versions/7/          manifest.json, index.faiss, rows.json   (current)
      chunks/              the chunk store (see `chunks_dir`)

`publish` writes a new version into a temporary folder, fsyncs it, renames it to
``versions/<n>/`` and then replaces ``CURRENT`` with `os.replace`, so a reader
that opens the store (`open_current`) sees the previous complete version or the
new one, never a mix. Old versions are deleted after publishing, keeping the last
two (a reader that raced a cleanup retries on the new ``CURRENT``).

A build refuses to extend a store made with another source model, other chunker
settings or another embedder (`check_compatible`, `StoreMismatchError`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cag.kv import ModelFingerprint

from .base import canonical_json
from .errors import StoreIntegrityError, StoreMismatchError
from .index import Embedder, VectorIndex

__all__ = [
    "DocumentEntry", "Manifest", "MANIFEST_FILE", "STORE_FORMAT_VERSION", "publish", "open_current",
    "current_version", "list_versions", "cleanup_versions", "check_compatible", "chunks_dir",
    "version_dir",
]

STORE_FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
CURRENT_FILE = "CURRENT"
VERSIONS_DIR = "versions"
CHUNKS_DIR = "chunks"
_LOCK_FILE = ".publish.lock"


class DocumentEntry(BaseModel):
    """One document of the corpus: its content hash and its chunks, in order."""

    model_config = ConfigDict(extra="forbid")

    content_sha256: str = Field(min_length=64, max_length=64)
    chunk_keys: list[str]
    n_tokens: int = Field(ge=0)
    char_length: int = Field(ge=0)


class Manifest(BaseModel):
    """What one store version contains and how it was built."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = STORE_FORMAT_VERSION
    version: int = Field(0, ge=0, description="publication number; set by `publish`")
    source_model: dict[str, Any]
    chunker: dict[str, Any]
    embedder_id: str
    documents: dict[str, DocumentEntry] = Field(default_factory=dict)
    published_at: float | None = None

    @property
    def source_fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint.from_dict(self.source_model)

    def chunk_keys(self) -> set[str]:
        """Every chunk key any document references (what gc must keep)."""
        return {k for doc in self.documents.values() for k in doc.chunk_keys}

    # ------------------------------------------------------------------ JSON

    def save(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.model_dump_json(indent=1))
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Manifest":
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            manifest = cls.model_validate_json(text)
        except ValidationError as exc:
            raise StoreIntegrityError(f"{path} is not a valid store manifest: {exc}") from None
        if manifest.format_version != STORE_FORMAT_VERSION:
            raise StoreIntegrityError(
                f"{path}: store format version {manifest.format_version}, this cag reads {STORE_FORMAT_VERSION}"
            )
        return manifest

    # ---------------------------------------------------------- compatibility

    def ensure_compatible(self, source: ModelFingerprint | Mapping[str, Any], chunker: Mapping[str, Any],
                          embedder_id: str | None = None, *, where: str = "this store") -> None:
        """Raise `StoreMismatchError` unless this manifest was built with the same
        source model (by fingerprint id), chunker settings and embedder."""
        src = source if isinstance(source, ModelFingerprint) else ModelFingerprint.from_dict(source)
        mine = self.source_fingerprint
        problems = []
        if mine.id != src.id:
            problems.append(f"source model {mine.describe()} (this build uses {src.describe()})")
        if self.chunker.get("prefill_prefix", "bos") != dict(chunker).get("prefill_prefix", "bos"):
            problems.append(f"chunks prefilled after {self.chunker.get('prefill_prefix', 'bos')!r} "
                            f"(this build prefills after {dict(chunker).get('prefill_prefix', 'bos')!r}; "
                            "chunks prefilled after the prompt head answer better: rebuild into a new store)")
        elif canonical_json(self.chunker) != canonical_json(dict(chunker)):
            problems.append(f"chunker settings {canonical_json(self.chunker)} "
                            f"(this build uses {canonical_json(dict(chunker))})")
        if embedder_id is not None and embedder_id != self.embedder_id:
            problems.append(f"embedder {self.embedder_id!r} (this build uses {embedder_id!r})")
        if problems:
            raise StoreMismatchError(
                f"{where} was built with " + "; ".join(problems) + ". A store holds one source model "
                "and one chunking; to rebuild, use a new --store directory, or delete this one "
                "(`cag store gc` / remove the directory) and build again."
            )


# ----------------------------------------------------------------- layout


def chunks_dir(store_dir: str | os.PathLike[str]) -> Path:
    """Where the store's chunk bytes live (a `DiskCacheChunkStore` directory)."""
    return Path(store_dir) / CHUNKS_DIR


def version_dir(store_dir: str | os.PathLike[str], version: int) -> Path:
    return Path(store_dir) / VERSIONS_DIR / str(version)


def current_version(store_dir: str | os.PathLike[str]) -> int | None:
    """The published version number, or None for a store with nothing published."""
    try:
        text = (Path(store_dir) / CURRENT_FILE).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise StoreIntegrityError(f"{Path(store_dir) / CURRENT_FILE} does not hold a version number: {text!r}")
    return int(text)


def list_versions(store_dir: str | os.PathLike[str]) -> list[int]:
    """Complete version folders present on disk, ascending."""
    vdir = Path(store_dir) / VERSIONS_DIR
    if not vdir.is_dir():
        return []
    return sorted(int(p.name) for p in vdir.iterdir() if p.is_dir() and p.name.isdigit())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- publish


def publish(store_dir: str | os.PathLike[str], manifest: Manifest, index: VectorIndex, *,
            keep: int = 2) -> int:
    """Publish `manifest` and `index` as the store's next version; returns its number.

    Writers are serialised by a lock file; readers need no lock. The manifest
    passed in is not modified (a copy with `version` set is written).
    """
    if manifest.embedder_id != index.embedder_id:
        raise StoreMismatchError(
            f"manifest names embedder {manifest.embedder_id!r} but the index uses {index.embedder_id!r}"
        )
    store = Path(store_dir)
    vroot = store / VERSIONS_DIR
    vroot.mkdir(parents=True, exist_ok=True)
    with FileLock(str(store / _LOCK_FILE)):
        current = current_version(store) or 0
        number = max([current, *list_versions(store)]) + 1
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{number}-", dir=vroot))
        try:
            index.save(tmp, fsync=True)
            manifest.model_copy(update={"version": number, "published_at": time.time()}).save(
                tmp / MANIFEST_FILE, fsync=True)
            _fsync_dir(tmp)
            os.rename(tmp, vroot / str(number))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(vroot)
        pointer = store / f".{CURRENT_FILE}.{uuid.uuid4().hex}"
        with open(pointer, "w", encoding="ascii") as f:
            f.write(f"{number}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, store / CURRENT_FILE)
        _fsync_dir(store)
        _cleanup_locked(store, keep=keep)
    return number


def cleanup_versions(store_dir: str | os.PathLike[str], *, keep: int = 2) -> list[int]:
    """Delete all but the newest `keep` versions (never the current one) and any
    leftover temporary folders; returns the versions deleted."""
    store = Path(store_dir)
    with FileLock(str(store / _LOCK_FILE)):
        return _cleanup_locked(store, keep=keep)


def _cleanup_locked(store: Path, *, keep: int) -> list[int]:
    current = current_version(store)
    versions = list_versions(store)
    doomed = [v for v in versions[: max(0, len(versions) - max(keep, 1))] if v != current]
    for v in doomed:
        shutil.rmtree(version_dir(store, v), ignore_errors=True)
    vroot = store / VERSIONS_DIR
    if vroot.is_dir():
        for p in vroot.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
    return doomed


# ----------------------------------------------------------------- readers


def open_current(store_dir: str | os.PathLike[str], embedder: Embedder | str | None = None, *,
                 embedder_id: str | None = None, retries: int = 5) -> tuple[Manifest, VectorIndex]:
    """The published manifest and its index, from one version.

    Raises `FileNotFoundError` for a store with nothing published. If the version
    `CURRENT` named is deleted while it is being read (two publishes raced this
    reader), it starts over on the new `CURRENT`.
    """
    store = Path(store_dir)
    for attempt in range(retries + 1):
        number = current_version(store)
        if number is None:
            raise FileNotFoundError(f"no store version published in {store} (no {CURRENT_FILE} file)")
        vdir = version_dir(store, number)
        try:
            manifest = Manifest.load(vdir / MANIFEST_FILE)
            index = VectorIndex.load(vdir, embedder, embedder_id=embedder_id)
        except (FileNotFoundError, StoreIntegrityError):
            # the version may have been cleaned up under us: retry if CURRENT moved on
            if attempt < retries and current_version(store) != number:
                continue
            raise
        if manifest.version != number:
            raise StoreIntegrityError(f"{vdir}: manifest says version {manifest.version}, folder is {number}")
        if manifest.embedder_id != index.embedder_id:
            raise StoreIntegrityError(
                f"{vdir}: manifest names embedder {manifest.embedder_id!r}, index {index.embedder_id!r}")
        return manifest, index
    raise AssertionError("unreachable")


def check_compatible(store_dir: str | os.PathLike[str], source: ModelFingerprint | Mapping[str, Any],
                     chunker: Mapping[str, Any], embedder_id: str | None = None) -> Manifest | None:
    """For a build: the current manifest if the store was built with these settings,
    None for a new/empty store, `StoreMismatchError` otherwise."""
    store = Path(store_dir)
    number = current_version(store)
    if number is None:
        return None
    manifest = Manifest.load(version_dir(store, number) / MANIFEST_FILE)
    manifest.ensure_compatible(source, chunker, embedder_id, where=f"the store at {store}")
    return manifest
