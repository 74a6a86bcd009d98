"""Translated chunks kept in the store: translate once per (chunk, mapper, target), read at query time.

A translated path pays for its translation at every query: the shipped bottleneck does
about 15 M multiply-adds per context token, several times the question's own prefill
(eval/results/query_path/). A nightly build knows which targets will answer, so it can
translate then (``cag build --translate-for TARGET`` or ``cag store translate``) and let
a query load the target's cache as a native one is loaded.

A translation lives in the same `ChunkStore` as its source chunk, under a key derived
from three things that together fix its bytes::

    translation_key(chunk_key, mapper_id, target_id) = chunk_key + "~" + sha256(v, mapper_id, target_id)[:32]

``mapper_id`` is the mapper's ``artifact_id`` (method, settings, provenance and weights
digest), so a refitted mapper never reads an older one's translations; ``target_id`` is
the target's fingerprint. Its frame is an ordinary `KVChunk` of the *target*, whose
``settings["translated"]`` names the method, the source model and the mapper. Because
the base key is the key's prefix, garbage collection keeps a translation exactly as long
as its source chunk (`base_key`), on every backend, without reading a byte.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from cag.kv import ChunkError, KVChunk, normalize_dtype, text_sha256

from .base import ChunkStore
from .errors import StoreIntegrityError

__all__ = ["TRANSLATION_KEY_VERSION", "translation_key", "base_key", "translation_suffix", "is_translation_key",
           "read_translation", "translate_chunks", "TranslateSummary"]

TRANSLATION_KEY_VERSION = 1
_SEP = "~"  # never in a chunk key (hex), so a key splits into its base and suffix unambiguously


def translation_key(chunk_key: str, mapper_id: str, target_id: str) -> str:
    """Where the translation of `chunk_key` by mapper `mapper_id` into target `target_id` is kept."""
    for name, value in (("chunk_key", chunk_key), ("mapper_id", mapper_id), ("target_id", target_id)):
        if not isinstance(value, str) or not value or _SEP in value or "\0" in value:
            raise ValueError(f"{name} must be a non-empty str without {_SEP!r} or NUL, got {value!r}")
    digest = hashlib.sha256(f"cag-translation-v{TRANSLATION_KEY_VERSION}\0{mapper_id}\0{target_id}".encode())
    return f"{chunk_key}{_SEP}{digest.hexdigest()[:32]}"


def is_translation_key(key: str) -> bool:
    return _SEP in key


def base_key(key: str) -> str:
    """The source chunk's key of a translation key (a chunk key is its own base)."""
    return key.split(_SEP, 1)[0]


def translation_suffix(key: str) -> str:
    """What a translation key adds to its chunk key: the same for every chunk of one (mapper, target)."""
    return key[len(base_key(key)):]


def read_translation(store: ChunkStore, chunk_key: str, text: str, mapper_id: str, target,
                     decode_dtype=None) -> KVChunk | None:
    """The stored translation of one chunk, or None when there is none.

    `target` is the target's `ModelFingerprint`. A stored entry that is corrupt, of
    another model, of another text or of another mapper raises `ChunkError`: the caller
    says so and translates the source chunk instead, so a damaged translation loses nothing.
    """
    data = store.get(translation_key(chunk_key, mapper_id, target.id))
    if data is None:
        return None
    chunk = KVChunk.from_bytes(data, expect_model=target, decode_dtype=decode_dtype)
    made_by = (chunk.settings.get("translated") or {}).get("mapper")
    if made_by != mapper_id:
        raise ChunkError(f"stored translation was made by mapper {made_by!r}, not {mapper_id!r}")
    if chunk.text_hash != text_sha256(text):
        raise ChunkError("stored translation is of another text than its chunk")
    return chunk


@dataclass
class TranslateSummary:
    """What `translate_chunks` did for one (mapper, target)."""

    target: str
    mapper: str  # method
    mapper_id: str
    dtype: str
    chunks: int = 0  # chunks asked for
    translated: int = 0  # translated and stored now
    present: int = 0  # already stored (a re-run resumes here)
    failed: list[dict[str, str]] = field(default_factory=list)  # source chunk missing or corrupt
    tokens: int = 0  # target tokens translated now
    bytes_written: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_written / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": round(self.bytes_per_token, 1),
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else 0.0}


def translate_chunks(store: ChunkStore, items: Iterable[tuple[str, str]], mapper: Any, target: Any, *,
                     dtype: str = "int8", batch_chunks: int = 8,
                     on_batch: Callable[[int, int], None] | None = None) -> TranslateSummary:
    """Translate the chunks `items` (``(chunk key, text)``) with `mapper` into `target` and store them.

    `mapper` is a `mappers.base.Mapper` (``translate_batch``, ``artifact_id``, ``method``,
    ``source``); `target` a loaded model. Chunks already translated are skipped, so an
    interrupted run resumes where it stopped; every put is atomic. A source chunk that is
    missing or fails its checks is listed in ``failed`` and skipped. `on_batch(done, total)`
    reports progress in chunks.
    """
    if mapper.method == "identity":
        raise ValueError("the store's chunks are already the target's own: there is nothing to translate")
    dtype = normalize_dtype(dtype)
    fp, mapper_id = target.fingerprint, mapper.artifact_id
    todo = list(dict.fromkeys(items))  # each chunk once, in order
    summary = TranslateSummary(target=fp.name, mapper=mapper.method, mapper_id=mapper_id, dtype=dtype,
                               chunks=len(todo))
    started = time.perf_counter()
    pending = [(k, t) for k, t in todo if not store.contains(translation_key(k, mapper_id, fp.id))]
    summary.present = len(todo) - len(pending)
    done, step = summary.present, max(1, batch_chunks)
    for start in range(0, len(pending), step):
        batch, chunks = [], []
        for key, text in pending[start:start + step]:
            try:
                data = store.get(key)
                if data is None:
                    raise ChunkError("missing from the chunk store")
                chunks.append(KVChunk.from_bytes(data, expect_model=mapper.source, decode_dtype=target.dtype))
                batch.append((key, text))
            except (ChunkError, StoreIntegrityError) as exc:
                summary.failed.append({"key": key, "error": str(exc)})
        if batch:
            for (key, _), out in zip(batch, mapper.translate_batch(chunks, [t for _, t in batch], target)):
                data = out.to_bytes(dtype)
                store.put(translation_key(key, mapper_id, fp.id), data)
                summary.translated += 1
                summary.tokens += out.num_tokens
                summary.bytes_written += len(data)
        done += len(pending[start:start + step])
        if on_batch is not None:
            on_batch(done, len(todo))
    summary.seconds = time.perf_counter() - started
    return summary
