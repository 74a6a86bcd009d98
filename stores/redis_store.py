"""A store on a Redis server: chunk bytes, manifest, index and ``CURRENT`` in one place.

``cag build --store redis://host:port/NAME`` (and ``cag query``, ``cag store …``,
``CachedContext(store=...)``) put a whole store under the key prefix ``NAME`` of
one Redis server, so any number of query servers share it through the network
with nothing else to mount. Like LMCache's remote backends, the server holds
opaque bytes and the client does the rest: chunk frames are written and read as
raw Redis strings and are never deserialised here (decoding and its checksum
and fingerprint checks stay with `KVChunk.from_bytes`); nothing is ever pickled.

Keys (``P`` = the prefix)::

    P:chunk:<key>      string   one encoded KVChunk frame (content-addressed, immutable)
    P:version:<n>      hash     manifest.json, index.faiss, rows.json, sha256 (of the three)
    P:versions         set      the version numbers kept
    P:CURRENT          string   "7": the published version
    P:next-version     string   the last version number handed out
    P:staging:<uuid>   hash     a version being uploaded (expires after a day if orphaned)

Why the manifest and the index live in Redis too, not in a shared folder: a
reader then needs one address instead of a server *and* a network file system
whose rename and fsync semantics (NFS, SMB, FUSE mounts of object stores) are
exactly what an atomic publish cannot rely on; and Redis gives atomicity for
free — a Lua script runs alone on the server. The version files are the very
bytes `Manifest.save` and `VectorIndex.save` write for a local store (JSON, and
faiss's own index format — never pickle), read back through `Manifest.load` and
`VectorIndex.load` from a temporary folder, so both backends parse and check
versions with the same code.

Publication, and why it is atomic for readers in other processes:

1. a version number is allocated (a script: above every number ever used);
2. the version's files and their sha256 are uploaded into ``P:staging:<uuid>``
   (one MULTI/EXEC with an expiry: a writer killed here leaves an orphan that
   Redis deletes by itself, and no reader ever looks at staging keys);
3. one script renames the staged hash to ``P:version:<n>``, adds ``n`` to
   ``P:versions`` and sets ``P:CURRENT`` — unless a publish that started later
   already made a newer version current (the newest number wins, as under the
   local store's lock the last writer wins).

A reader reads ``P:CURRENT`` and that version's hash in one script, so it gets a
whole version — the previous one or the new one, never a mix — and never races
a cleanup. Old versions are deleted after publishing, keeping the last two.

Scope: one Redis server (or its primary); the scripts name keys they compute,
which Redis Cluster does not allow. Redis keeps data in memory: size the server
for the store (`cag store stats` reports its bytes) and turn on persistence
(RDB/AOF) in its configuration if the store must survive a server restart.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping
from urllib.parse import urlsplit, urlunsplit

try:
    import redis
except ModuleNotFoundError as exc:  # the extra is optional; say how to get it
    raise ModuleNotFoundError(
        "redis:// stores need the `redis` package: pip install 'cag[redis]'", name="redis") from exc

from cag.kv import ModelFingerprint

from .base import StoreStats, canonical_json
from .diskcache_store import VerifyReport, verify_chunks
from .errors import StoreError, StoreIntegrityError, StoreMismatchError
from .index import INDEX_FILE, ROWS_FILE, SENTENCES_FILE, VectorIndex
from .manifest import MANIFEST_FILE, Manifest

if TYPE_CHECKING:
    from .index import Embedder

__all__ = ["RedisChunkStore", "RedisStore", "RedisTarget", "StoreConnectionError", "parse_redis_url"]

_VERSION_FILES = (MANIFEST_FILE, INDEX_FILE, ROWS_FILE, SENTENCES_FILE)
# Files a version published by an older cag lacks (its sha256 record does not name them either).
_OPTIONAL_FILES = (SENTENCES_FILE,)
_SHA_FIELD = "sha256"
_STAGING_TTL_S = 24 * 3600
_SCAN_BATCH = 1000
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StoreConnectionError(StoreError):
    """The store's server cannot be reached, refused the login, or timed out."""


# -------------------------------------------------------------------- the URL


@dataclass(frozen=True)
class RedisTarget:
    """A parsed store URL: the server to connect to, and the store's key prefix."""

    server_url: str  # what redis-py connects to (may hold a password: never printed)
    prefix: str
    where: str  # the URL without user or password, for messages

    def client(self) -> "redis.Redis":
        # bytes in, bytes out (decode_responses=False): frames are never turned into str
        return redis.Redis.from_url(self.server_url, decode_responses=False, socket_connect_timeout=10)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))


def parse_redis_url(url: str) -> RedisTarget:
    """``redis://[user:password@]host[:port]/NAME[?db=N]`` (or ``rediss://`` for TLS).

    The path is the store's name (its key prefix), not a database number as in
    plain Redis URLs; pick a database with ``?db=N``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a redis:// or rediss:// URL: {parts.scheme}://…")
    host = parts.hostname or "localhost"
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"bad port in the store URL {parts.scheme}://{parts.netloc.split('@')[-1]}") from None
    where = f"{parts.scheme}://{host}:{port}"
    prefix = parts.path.strip("/")
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"a Redis store URL names the store after the server: {parts.scheme}://host:port/NAME, "
            f"NAME being letters, digits, '.', '_' or '-' (at most 128); got {where}/{prefix}")
    return RedisTarget(urlunsplit((parts.scheme, parts.netloc, "", parts.query, "")), prefix,
                       f"{where}/{prefix}" + (f"?{parts.query}" if parts.query else ""))


@contextmanager
def _talking(where: str):
    """Turn redis-py's connection failures into a `StoreConnectionError` naming the store."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # AuthenticationError is a ConnectionError
        raise StoreConnectionError(f"cannot talk to the Redis server of the store {where}: {exc} "
                                   "(is redis-server running there, and the address right?)") from None
    except redis.RedisError as exc:  # e.g. OOM under maxmemory, a read-only replica
        raise StoreError(f"the Redis server of the store {where} refused: {exc}") from None


# --------------------------------------------------------------- chunk bytes


class RedisChunkStore:
    """A `ChunkStore` of raw frames under ``<prefix>:chunk:`` on a Redis server.

    Each put is one command (``SET`` or ``SET NX``), so a reader sees the old
    entry, the new one, or none. Safe to share between threads (redis-py's pool).
    """

    def __init__(self, target: RedisTarget) -> None:
        self.target = target
        self._r = target.client()
        self._chunk_prefix = target.key("chunk", "")

    @classmethod
    def from_url(cls, url: str) -> "RedisChunkStore":
        return cls(parse_redis_url(url))

    def _k(self, key: str) -> str:
        _check_key(key)
        return self._chunk_prefix + key

    def get(self, key: str) -> bytes | None:
        """The bytes under `key`, or None. `StoreIntegrityError` for an entry that is not
        a plain Redis string (a hash, a list… written by something else)."""
        name = self._k(key)
        with _talking(self.target.where):
            try:
                value = self._r.get(name)
            except redis.ResponseError as exc:
                if not str(exc).startswith("WRONGTYPE"):
                    raise
                kind = self._r.type(name).decode()
                raise StoreIntegrityError(
                    f"store entry {key!r} in {self.target.where} is a Redis {kind}, not raw bytes; it was "
                    "not written by this store and is refused. Delete it or rebuild the store.", key=key,
                ) from None
        return value  # bytes (decode_responses=False), never decoded here

    def put(self, key: str, value: bytes, *, overwrite: bool = False) -> bool:
        """Store `value` under `key`. Without `overwrite`, an existing key is kept
        (``SET NX``: content addresses, same key, same bytes) and False is returned."""
        name = self._k(key)
        if type(value) is not bytes:
            if not isinstance(value, (bytearray, memoryview)):
                # redis-py would happily send str(value): refuse, as the local store does
                raise TypeError(f"chunk store values are bytes, got {type(value).__name__}")
            value = bytes(value)
        with _talking(self.target.where):
            return bool(self._r.set(name, value, nx=not overwrite))

    def contains(self, key: str) -> bool:
        name = self._k(key)
        with _talking(self.target.where):
            return self._r.exists(name) == 1

    __contains__ = contains

    def delete(self, key: str) -> bool:
        name = self._k(key)
        with _talking(self.target.where):
            return self._r.delete(name) == 1

    def keys(self) -> Iterator[str]:
        """Every chunk key, by ``SCAN`` (which may repeat a key: repeats are dropped)."""
        seen: set[str] = set()
        start = len(self._chunk_prefix)
        with _talking(self.target.where):
            for name in self._r.scan_iter(match=self._chunk_prefix + "*", count=_SCAN_BATCH):
                key = name[start:].decode("utf-8")
                if key not in seen:
                    seen.add(key)
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def stats(self) -> StoreStats:
        """Entries and the bytes of their values (what the frames take, not Redis's overhead)."""
        entries = total = 0
        keys = list(self.keys())
        with _talking(self.target.where):
            for start in range(0, len(keys), _SCAN_BATCH):
                pipe = self._r.pipeline(transaction=False)
                for key in keys[start:start + _SCAN_BATCH]:
                    pipe.strlen(self._chunk_prefix + key)
                sizes = pipe.execute(raise_on_error=False)
                entries += sum(1 for s in sizes if isinstance(s, int))
                total += sum(s for s in sizes if isinstance(s, int))
        return StoreStats(entries=entries, bytes=total, path=self.target.where)

    def verify(self, expect_model: ModelFingerprint | None = None) -> VerifyReport:
        """Re-read every entry and check its frame, as `DiskCacheChunkStore.verify` does."""
        return verify_chunks(self, expect_model)

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> "RedisChunkStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_key(key: object) -> None:
    if type(key) is not str or not key:
        raise TypeError(f"chunk keys are non-empty str, got {key!r}")


# ------------------------------------------------------------------ versions

# Next version number: one above the counter, CURRENT and every kept version, so a
# number is never handed out twice, even if the counter key was lost.
# KEYS: next-version, CURRENT, versions
_ALLOCATE = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local c = tonumber(redis.call('GET', KEYS[2]) or '0')
if c > n then n = c end
for _, v in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local m = tonumber(v)
  if m > n then n = m end
end
n = n + 1
redis.call('SET', KEYS[1], n)
return n
"""

# The publication itself: staged hash -> version n, kept, current (unless newer).
# KEYS: staging, version:n, versions, CURRENT   ARGV: n
_FLIP = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('the staged version expired before it was published')
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('SADD', KEYS[3], ARGV[1])
local c = tonumber(redis.call('GET', KEYS[4]) or '0')
if tonumber(ARGV[1]) > c then
  redis.call('SET', KEYS[4], ARGV[1])
  return 1
end
return 0
"""

# A reader's snapshot: CURRENT and fields of that version, in one step.
# KEYS: CURRENT   ARGV: 'P:version:', field...
_READ_CURRENT = """
local n = redis.call('GET', KEYS[1])
if not n then return false end
return {n, redis.call('HMGET', ARGV[1] .. n, unpack(ARGV, 2))}
"""


class RedisStore:
    """A `StoreLocation` on a Redis server (see module doc for keys and guarantees)."""

    def __init__(self, target: RedisTarget) -> None:
        self.target = target
        self._r = target.client()
        self._allocate = self._r.register_script(_ALLOCATE)
        self._flip_script = self._r.register_script(_FLIP)
        self._read_current = self._r.register_script(_READ_CURRENT)
        self._current_key = target.key("CURRENT")
        self._versions_key = target.key("versions")

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        return cls(parse_redis_url(url))

    def __str__(self) -> str:
        return self.target.where

    def __repr__(self) -> str:
        return f"RedisStore({self.target.where!r})"

    def _version_key(self, version: int) -> str:
        return self.target.key("version", str(version))

    # ------------------------------------------------------------ reading

    def exists(self) -> bool:
        with _talking(self.target.where):
            return self._r.exists(self._current_key, self._versions_key, self.target.key("next-version")) > 0

    def chunks(self) -> RedisChunkStore:
        return RedisChunkStore(self.target)

    def current_version(self) -> int | None:
        with _talking(self.target.where):
            return self._number(self._r.get(self._current_key), "CURRENT")

    def list_versions(self) -> list[int]:
        with _talking(self.target.where):
            members = self._r.smembers(self._versions_key)
        return sorted(self._number(m, "versions") for m in members)

    def load_manifest(self, version: int) -> Manifest:
        files = self._read_version(version, (MANIFEST_FILE,))
        with self._as_folder(version, files) as folder:
            return self._load_manifest(folder, version)

    def index_info(self, version: int) -> dict[str, Any]:
        files = self._read_version(version, (ROWS_FILE,))
        with self._as_folder(version, files) as folder:
            return VectorIndex.read_info(folder)

    def open_current(self, embedder: "Embedder | str | None" = None, *,
                     embedder_id: str | None = None) -> tuple[Manifest, VectorIndex]:
        """The published manifest and its index, read from one version in one step."""
        snapshot = self._snapshot(_VERSION_FILES)
        if snapshot is None:
            raise FileNotFoundError(f"no store version published at {self.target.where} (no CURRENT key)")
        number, files = snapshot
        with self._as_folder(number, files) as folder:
            manifest = self._load_manifest(folder, number)
            index = VectorIndex.load(folder, embedder, embedder_id=embedder_id)
        if manifest.embedder_id != index.embedder_id:
            raise StoreIntegrityError(f"{self.target.where} version {number}: manifest names embedder "
                                      f"{manifest.embedder_id!r}, index {index.embedder_id!r}")
        return manifest, index

    def check_compatible(self, source: ModelFingerprint | Mapping[str, Any], chunker: Mapping[str, Any],
                         embedder_id: str | None = None) -> Manifest | None:
        snapshot = self._snapshot((MANIFEST_FILE,))
        if snapshot is None:
            return None
        number, files = snapshot
        with self._as_folder(number, files) as folder:
            manifest = self._load_manifest(folder, number)
        manifest.ensure_compatible(source, chunker, embedder_id, where=f"the store at {self.target.where}")
        return manifest

    def _snapshot(self, names: tuple[str, ...]) -> tuple[int, dict[str, bytes]] | None:
        with _talking(self.target.where):
            reply = self._read_current(keys=[self._current_key],
                                       args=[self.target.key("version", ""), *names, _SHA_FIELD])
        if reply is None:
            return None
        number = self._number(reply[0], "CURRENT")
        return number, self._checked(number, names, reply[1])

    def _read_version(self, version: int, names: tuple[str, ...]) -> dict[str, bytes]:
        with _talking(self.target.where):
            values = self._r.hmget(self._version_key(version), [*names, _SHA_FIELD])
        if all(v is None for v in values):
            raise FileNotFoundError(f"version {version} of the store {self.target.where} is not kept")
        return self._checked(version, names, values)

    def _checked(self, version: int, names: tuple[str, ...], values: list[bytes | None]) -> dict[str, bytes]:
        """The files of a version, each checked against the sha256 recorded at publication."""
        where = f"{self.target.where} version {version}"
        *blobs, digests = values
        if all(v is None for v in values):
            raise StoreIntegrityError(f"CURRENT names version {version} of {self.target.where}, which is missing")
        try:
            expected = json.loads(digests) if digests is not None else None
        except ValueError:
            expected = None
        if not isinstance(expected, dict):
            raise StoreIntegrityError(f"{where} has no valid {_SHA_FIELD} record")
        files = {}
        for name, blob in zip(names, blobs):
            if blob is None and name in _OPTIONAL_FILES and name not in expected:
                continue  # published before this file existed
            if blob is None:
                raise StoreIntegrityError(f"{where} lacks its {name}")
            if hashlib.sha256(blob).hexdigest() != expected.get(name):
                raise StoreIntegrityError(f"{where}: {name} does not match its recorded sha256 (corrupt)")
            files[name] = blob
        return files

    @contextmanager
    def _as_folder(self, version: int, files: dict[str, bytes]):
        """The files in a temporary folder, for the readers the local store uses; their
        errors name the version instead of the temporary folder."""
        with tempfile.TemporaryDirectory(prefix="cag-redis-version-") as tmp:
            for name, data in files.items():
                (Path(tmp) / name).write_bytes(data)
            try:
                yield Path(tmp)
            except StoreError as exc:
                raise type(exc)(str(exc).replace(tmp, f"{self.target.where} version {version}")) from None

    @staticmethod
    def _load_manifest(folder: Path, number: int) -> Manifest:
        manifest = Manifest.load(folder / MANIFEST_FILE)
        if manifest.version != number:
            raise StoreIntegrityError(f"{folder}: manifest says version {manifest.version}, key is {number}")
        return manifest

    def _number(self, raw: bytes | None, what: str) -> int | None:
        if raw is None:
            return None
        text = raw.decode("ascii", "replace")
        if not text.isdigit():
            raise StoreIntegrityError(f"{self.target.key(what)} on {self.target.where} does not hold a version "
                                      f"number: {text!r}")
        return int(text)

    # ------------------------------------------------------------ writing

    def publish(self, manifest: Manifest, index: VectorIndex, *, keep: int = 2) -> int:
        """Publish `manifest` and `index` as the next version (see module doc); returns
        its number. The manifest passed in is not modified."""
        if manifest.embedder_id != index.embedder_id:
            raise StoreMismatchError(
                f"manifest names embedder {manifest.embedder_id!r} but the index uses {index.embedder_id!r}")
        with _talking(self.target.where):
            number = int(self._allocate(keys=[self.target.key("next-version"), self._current_key,
                                              self._versions_key]))
        with tempfile.TemporaryDirectory(prefix="cag-redis-publish-") as tmp:
            # the same files, byte for byte, as a local store version (no fsync: they are read back at once)
            index.save(tmp, fsync=False)
            manifest.model_copy(update={"version": number, "published_at": time.time()}).save(
                Path(tmp) / MANIFEST_FILE, fsync=False)
            files = {name: (Path(tmp) / name).read_bytes() for name in _VERSION_FILES}
        digests = canonical_json({name: hashlib.sha256(data).hexdigest() for name, data in files.items()})
        staging = self.target.key("staging", uuid.uuid4().hex)
        with _talking(self.target.where):
            pipe = self._r.pipeline(transaction=True)
            pipe.hset(staging, mapping={**files, _SHA_FIELD: digests.encode()})
            pipe.expire(staging, _STAGING_TTL_S)
            pipe.execute()
            self._flip(staging, number)
        self.cleanup_versions(keep=keep)
        return number

    def _flip(self, staging: str, number: int) -> bool:
        """Make the staged version `number` kept and current, in one server-side step."""
        try:
            return bool(self._flip_script(keys=[staging, self._version_key(number), self._versions_key,
                                                self._current_key], args=[number]))
        except redis.ResponseError as exc:
            raise StoreError(f"publishing version {number} to {self.target.where} failed: {exc}") from None

    def cleanup_versions(self, *, keep: int = 2) -> list[int]:
        """Delete all but the newest `keep` versions, never the current one. Staged
        versions of killed writers expire by themselves (a day after their upload)."""
        current = self.current_version()
        versions = self.list_versions()
        doomed = [v for v in versions[: max(0, len(versions) - max(keep, 1))] if v != current]
        with _talking(self.target.where):
            for v in doomed:
                pipe = self._r.pipeline(transaction=True)  # forgotten and deleted together
                pipe.srem(self._versions_key, v)
                pipe.delete(self._version_key(v))
                pipe.execute()
        return doomed

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> "RedisStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
