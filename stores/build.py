"""The nightly build: prefill a corpus once with the source model, incrementally.

A build reads the corpus, compares every document's content hash with the
published manifest, and does only the work that changed:

1. **plan**   read and chunk new and changed documents; unchanged ones keep their
              manifest entry; documents that are gone are dropped;
2. **prefill** every chunk whose content address is not in the chunk store yet,
              in batches through the source model, each chunk `put` as soon as
              it is encoded (one atomic entry each);
3. **index**  the previous version's index minus dropped and changed documents,
              plus the rows of new and changed ones (only those are embedded);
4. **publish** manifest and index as the next store version, atomically;
5. **gc**     chunks no kept version references are deleted.

Why this survives SIGKILL anywhere: steps 1 and 3 touch nothing on disk; step 2
writes only content-addressed entries, each complete or absent, so a rerun
finds them and never prefills a finished chunk again; the rerun then recomputes
steps 3-4 from the same previous version and the same inputs, giving the same
manifest and index an uninterrupted build would have published; step 5 only
deletes what nothing published refers to. Readers see either version.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cag.kv import normalize_dtype, text_sha256
from cag.models.loaded import LoadedModel

from .base import ChunkStore, chunk_key
from .chunker import Chunk, Chunker, ChunkerSettings
from .errors import StoreError
from .index import Embedder, Row, VectorIndex, resolve_embedder
from .location import StoreLocation, open_store
from .manifest import DocumentEntry, Manifest
from .translations import base_key

DEFAULT_MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
# int8 (KIVI's layout): 12,121 bytes per SmolLM2 token against 23,071 in bf16, and on the quick
# eval not one of 48 cached answers moved (eval/results/chunk_dtype/chunk_dtype.md)
DEFAULT_CHUNK_DTYPE = "int8"


class EmptyCorpusError(StoreError):
    """A corpus with no documents: building it would delete every document of the store."""


@dataclass(frozen=True)
class SourceDocument:
    """A document to build: an id, and a way to read its text (called once, late).

    Reading late means a file that vanishes or turns out binary fails on its own,
    while the rest of the build goes on.
    """

    doc_id: str
    read: Callable[[], str]


@dataclass
class BuildEvent:
    """Progress reported to `on_event`: what happened, and the running totals."""

    kind: str  # "planned" | "chunk_stored" | "indexed" | "published" | "collected"
    chunks_stored: int = 0
    tokens_prefilled: int = 0
    detail: Any = None


@dataclass
class BuildSummary:
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)
    documents: int = 0
    chunks: int = 0
    chunks_prefilled: int = 0
    chunks_reused: int = 0
    tokens: int = 0
    tokens_prefilled: int = 0
    chunks_collected: int = 0
    bytes_on_disk: int = 0
    bytes_per_token: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    tokens_per_s: float = 0.0
    version: int | None = None
    published: bool = False
    dtype: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ documents


def read_text_file(path: Path, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> str:
    """A document's text, or a `ValueError` that says plainly what is wrong with the file."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size / 1e6:.1f} MB is over the {max_bytes / 1e6:.1f} MB document limit "
                         "(split it, or raise --max-doc-mb)")
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise ValueError("binary file (NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (undecodable byte at offset {exc.start})") from None
    return text


def corpus_documents(corpus: str | os.PathLike[str], *,
                     max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> list[SourceDocument]:
    """Every regular, non-hidden file under `corpus` (or the file itself), sorted by id.

    The id is the path relative to the corpus folder, so a build is the same
    wherever the folder is mounted.
    """
    root = Path(corpus)
    if root.is_file():
        return [SourceDocument(root.name, lambda p=root: read_text_file(p, max_bytes))]
    if not root.is_dir():
        raise FileNotFoundError(f"corpus {root} does not exist")
    docs = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        docs.append(SourceDocument(rel.as_posix(), lambda p=path: read_text_file(p, max_bytes)))
    return docs


def as_source_documents(documents: Iterable[Any]) -> list[SourceDocument]:
    """Accept `SourceDocument`s, LlamaIndex `Document`s, or ``(doc_id, text)`` pairs."""
    out = []
    for doc in documents:
        if isinstance(doc, SourceDocument):
            out.append(doc)
        elif isinstance(doc, tuple) and len(doc) == 2:
            out.append(SourceDocument(str(doc[0]), lambda t=doc[1]: t))
        elif hasattr(doc, "text") and (hasattr(doc, "doc_id") or hasattr(doc, "id_")):
            doc_id = getattr(doc, "doc_id", None) or doc.id_
            out.append(SourceDocument(str(doc_id), lambda t=doc.text: t))
        else:
            raise TypeError(f"cannot build from a {type(doc).__name__}; pass (doc_id, text) pairs, "
                            "SourceDocuments or LlamaIndex Documents")
    ids = [d.doc_id for d in out]
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"document ids must be unique; repeated: {dupes[:5]}")
    return out


# ---------------------------------------------------------------------- build


def build_settings(source: LoadedModel, chunk_tokens: int, dtype: str) -> dict[str, Any]:
    """What every chunk of a store depends on besides its text: one dict, in the
    manifest and in every content address."""
    chunker = ChunkerSettings(chunk_tokens=chunk_tokens, tokenizer=source.fingerprint.tokenizer_hash[:20])
    return {**chunker.to_dict(), **source.chunk_settings(), "dtype": dtype}


@dataclass
class _PlannedDoc:
    doc_id: str
    status: str  # new | changed | unchanged
    entry: DocumentEntry
    chunks: list[Chunk]


def existing_dtype(location: StoreLocation) -> str | None:
    """The chunk format of the store's published version (None for a new store)."""
    version = location.current_version()
    if version is None:
        return None
    return location.load_manifest(version).chunker.get("dtype", "bfloat16")


def build_store(
    documents: Iterable[Any] | str | os.PathLike[str],
    store_dir: str | os.PathLike[str] | StoreLocation,
    source: LoadedModel,
    *,
    chunk_tokens: int = 256,
    batch_size: int = 4,
    dtype: str | None = None,
    embedder: Embedder | str | None = None,
    allow_empty: bool = False,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    on_event: Callable[[BuildEvent], None] | None = None,
    progress: bool = False,
    prefill: PrefillStep | None = None,
) -> BuildSummary:
    """Build or update the store at `store_dir` from `documents` (a folder, or an
    iterable of documents, see `as_source_documents`). Returns the summary.

    `store_dir` is a folder, a ``redis://host:port/NAME`` URL or an opened location
    (`stores.location.open_store`).

    `dtype`: the chunks' storage format (`cag.kv.STORAGE_DTYPES`); None keeps an existing
    store's and gives a new one `DEFAULT_CHUNK_DTYPE`.

    `prefill` computes the chunks' bytes (default `prefill_locally`, in this process;
    `stores.ray_build.RayPrefill` spreads it over Ray workers). Every write stays here.

    Raises `StoreMismatchError` before doing any work when the store was built with
    another source model or other settings, and `EmptyCorpusError` for a corpus of
    no documents unless `allow_empty` (which then removes every document).
    """
    started = time.perf_counter()
    emit = on_event or (lambda event: None)
    location = open_store(store_dir)
    docs = (corpus_documents(documents, max_bytes=max_document_bytes)
            if isinstance(documents, (str, os.PathLike)) else as_source_documents(documents))
    if not docs and not allow_empty:
        raise EmptyCorpusError("the corpus has no documents; nothing was built "
                               "(pass allow_empty / --allow-empty to remove every document from the store)")
    if dtype is None:  # a store built before the default changed keeps its format, so it keeps building
        dtype = existing_dtype(location) or DEFAULT_CHUNK_DTYPE
    dtype = normalize_dtype(dtype)  # "i8" and "int8" are one format: one chunk address, one store
    settings = build_settings(source, chunk_tokens, dtype)
    embed = resolve_embedder(embedder)
    embedder_id = getattr(embed, "id")
    previous = location.check_compatible(source.fingerprint, settings, embedder_id)
    old_docs = previous.documents if previous else {}
    summary = BuildSummary(dtype=dtype)

    # 1. plan
    store = location.chunks()
    chunker = Chunker(source.tokenizer, ChunkerSettings(**{k: settings[k] for k in
                                                            ("chunk_tokens", "tokenizer", "min_fill", "version")}))
    planned: list[_PlannedDoc] = []
    with _progress(progress) as bar:
        reading = bar.add_task("read + chunk", total=len(docs), unit="docs") if bar else None
        for doc in docs:
            if bar:
                bar.advance(reading)
            try:
                text = doc.read()
                if not isinstance(text, str):
                    raise ValueError(f"document text is a {type(text).__name__}, not str")
                if not text.strip():
                    raise ValueError("empty document (no text)")
            except (OSError, ValueError) as exc:
                reason = "file vanished during the build" if isinstance(exc, FileNotFoundError) else str(exc)
                summary.failed.append({"doc_id": doc.doc_id, "error": reason})
                continue
            content = text_sha256(text)
            old = old_docs.get(doc.doc_id)
            if old is not None and old.content_sha256 == content:
                complete = all(store.contains(k) for k in old.chunk_keys)
                # Unchanged, but if entries went missing (a damaged store, a manual
                # delete), chunk it again so that step 2 restores them.
                planned.append(_PlannedDoc(doc.doc_id, "unchanged", old, [] if complete else chunker.split(text)))
                continue
            chunks = chunker.split(text)
            keys = [chunk_key(source.fingerprint, settings, c.text) for c in chunks]
            entry = DocumentEntry(content_sha256=content, chunk_keys=keys,
                                  n_tokens=sum(c.n_tokens for c in chunks), char_length=len(text))
            planned.append(_PlannedDoc(doc.doc_id, "new" if old is None else "changed", entry, chunks))
    # A document that fails to read keeps its previous version rather than vanishing
    # from the store because of one bad night.
    failed_ids = {f["doc_id"] for f in summary.failed}
    kept_on_failure = {d: e for d, e in old_docs.items() if d in failed_ids}
    seen = {p.doc_id for p in planned} | failed_ids
    removed = sorted(d for d in old_docs if d not in seen)
    emit(BuildEvent("planned", detail={"documents": len(planned), "removed": len(removed)}))

    # 2. prefill what the store lacks
    try:
        todo: dict[str, Chunk] = {}  # key -> chunk, in corpus order, each key once
        for p in planned:
            for key, c in zip(p.entry.chunk_keys, p.chunks):
                if key not in todo and not store.contains(key):
                    todo[key] = c
        prefill_started = time.perf_counter()
        _prefill_into(store, source, todo, settings, batch_size, dtype, summary, emit, progress,
                      prefill or prefill_locally)
        summary.prefill_s = time.perf_counter() - prefill_started

        # 3. index: previous version's rows, minus what changed, plus what is new
        index = _next_index(location, previous, embed, embedder_id)
        stale = [p.doc_id for p in planned if p.status == "changed"] + removed
        index.remove_docs(stale)
        rows = [Row(key, p.doc_id, c.text, c.start, c.end)
                for p in planned if p.status != "unchanged"
                for key, c in zip(p.entry.chunk_keys, p.chunks)]
        index.add(rows)
        emit(BuildEvent("indexed", summary.chunks_prefilled, summary.tokens_prefilled, len(rows)))

        documents_out = {**kept_on_failure, **{p.doc_id: p.entry for p in planned}}
        manifest = Manifest(source_model=source.fingerprint.to_dict(), chunker=settings,
                            embedder_id=embedder_id, documents=dict(sorted(documents_out.items())))

        # 4. publish, unless nothing changed
        summary.new = sum(p.status == "new" for p in planned)
        summary.changed = sum(p.status == "changed" for p in planned)
        summary.unchanged = sum(p.status == "unchanged" for p in planned)
        summary.removed = len(removed)
        if previous is None or summary.new or summary.changed or summary.removed:
            summary.version = location.publish(manifest, index)
            summary.published = True
            emit(BuildEvent("published", summary.chunks_prefilled, summary.tokens_prefilled, summary.version))
        else:
            summary.version = previous.version

        # 5. gc
        summary.chunks_collected = collect_garbage(location, store)
        emit(BuildEvent("collected", summary.chunks_prefilled, summary.tokens_prefilled, summary.chunks_collected))

        summary.documents = len(manifest.documents)
        all_keys = [k for e in manifest.documents.values() for k in e.chunk_keys]
        summary.chunks = len(all_keys)
        summary.chunks_reused = len(set(all_keys)) - summary.chunks_prefilled
        summary.tokens = sum(e.n_tokens for e in manifest.documents.values())
        stats = store.stats()
        summary.bytes_on_disk = stats.bytes
        summary.bytes_per_token = stats.bytes / summary.tokens if summary.tokens else 0.0
    finally:
        store.close()
        if location is not store_dir:  # opened here: release its connections
            location.close()
    summary.wall_s = time.perf_counter() - started
    summary.tokens_per_s = summary.tokens_prefilled / summary.prefill_s if summary.prefill_s > 0 else 0.0
    return summary


# One encoded chunk: its frame bytes (exactly what the store keeps) and its token count.
Encoded = tuple[bytes, int]
# The pluggable part of step 2: (source, batches of chunk texts, settings, storage dtype) ->
# (batch number, that batch's encoded chunks in order), each batch once, in any order.
# It only computes; the build puts what it yields, so writes stay in one process.
PrefillStep = Callable[[LoadedModel, Sequence[list[str]], dict[str, Any], str], Iterable[tuple[int, list[Encoded]]]]


def prefill_locally(source: LoadedModel, batches: Sequence[list[str]], settings: dict[str, Any],
                    dtype: str) -> Iterator[tuple[int, list[Encoded]]]:
    """The single-process prefill step: one forward per batch, in order, lazily
    (each batch is stored before the next is computed)."""
    for number, texts in enumerate(batches):
        yield number, [(c.to_bytes(dtype), c.num_tokens) for c in source.prefill_batch(texts, settings=settings)]


def _prefill_into(store, source: LoadedModel, todo: dict[str, Chunk], settings: dict, batch_size: int,
                  dtype: str, summary: BuildSummary, emit, progress: bool, prefill: PrefillStep) -> None:
    items = list(todo.items())
    step = max(1, batch_size)
    batches = [items[start:start + step] for start in range(0, len(items), step)]
    done: set[int] = set()
    with _progress(progress) as bar:
        # the total counts tokens as the chunker did (whole-document tokenization)
        task = bar.add_task("prefill", total=sum(c.n_tokens for _, c in items), unit="tokens") if bar else None
        for number, encoded in prefill(source, [[c.text for _, c in batch] for batch in batches], settings, dtype):
            # A step is pluggable; one that loses or repeats a batch would publish a
            # manifest naming chunks the store lacks, so check before anything is put.
            if not 0 <= number < len(batches) or number in done or len(encoded) != len(batches[number]):
                raise StoreError(f"the prefill step returned batch {number} wrongly "
                                 f"({len(encoded)} chunks; {len(batches)} batches, {len(done)} done)")
            done.add(number)
            for (key, _), (data, num_tokens) in zip(batches[number], encoded):
                store.put(key, data)
                summary.chunks_prefilled += 1
                summary.tokens_prefilled += num_tokens
                emit(BuildEvent("chunk_stored", summary.chunks_prefilled, summary.tokens_prefilled, key))
                if bar:
                    bar.advance(task, num_tokens)
    if len(done) != len(batches):
        raise StoreError(f"the prefill step returned {len(done)} of {len(batches)} batches")


class _NullProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    """A rich progress bar on stderr (rate and ETA), or nothing."""
    if not enabled:
        return _NullProgress()
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TaskProgressColumn,
                               TextColumn, TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task):
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} {task.fields['unit']}/s" if speed else "", style="progress.data.speed")

    return Progress(TextColumn("[bold]{task.description:<13}"), BarColumn(), TaskProgressColumn(),
                    MofNCompleteColumn(), TextColumn("{task.fields[unit]}"), Rate(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))


def _next_index(location: StoreLocation, previous: Manifest | None, embed, embedder_id: str) -> VectorIndex:
    if previous is None:
        return VectorIndex(embed, embedder_id=embedder_id)
    _, index = location.open_current(embed, embedder_id=embedder_id)
    return index


def referenced_keys(store_dir: str | os.PathLike[str] | StoreLocation) -> set[str]:
    """Chunk keys that any kept store version refers to."""
    location = open_store(store_dir)
    keys: set[str] = set()
    for number in location.list_versions():
        try:
            keys |= location.load_manifest(number).chunk_keys()
        except FileNotFoundError:  # deleted by a concurrent cleanup: nothing of it is kept
            pass
    return keys


def collect_garbage(store_dir: str | os.PathLike[str] | StoreLocation, store: ChunkStore | None = None) -> int:
    """Delete chunks that no kept version references, and their translations; returns how many."""
    location = open_store(store_dir)
    location.cleanup_versions()
    own = store is None
    store = location.chunks() if own else store  # not `store or …`: an empty store is falsy
    try:
        keep = referenced_keys(location)
        # a stored translation (stores.translations) lives exactly as long as its source chunk
        doomed = [k for k in store.keys() if base_key(k) not in keep]
        for key in doomed:
            store.delete(key)
        return len(doomed)
    finally:
        if own:
            store.close()
        if location is not store_dir:
            location.close()
