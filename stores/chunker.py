"""Split a document into chunks of about N tokens, on natural boundaries, losslessly.

The document is tokenized **once** (with character offsets); cut points are then
chosen chunk by chunk, each looking only at its own window of text, so the work is
linear in the document's length. For every chunk, the cut is the last

1. paragraph boundary (after a blank line), else
2. sentence boundary (after ``. ! ? …`` and closing quotes/brackets), else
3. whitespace boundary, else
4. token boundary

that keeps the chunk within ``chunk_tokens`` tokens and fills at least
``min_fill`` of it (a paragraph break that would leave a tiny chunk loses to a
later sentence break). Whitespace after a cut stays with the earlier chunk, so
chunks start with text.

Invariants: ``"".join(c.text for c in chunks) == doc``; ``doc[c.start:c.end] ==
c.text``; chunks are contiguous; the result depends only on the text, the
tokenizer and the settings. Token counts are counted in the document's own
tokenization (a chunk re-tokenized alone can differ by a token at its edges
for merging tokenizers).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Chunk", "Chunker", "ChunkerSettings", "chunk_text", "sentence_spans", "tokenizer_id", "CHUNKER_VERSION"]

CHUNKER_VERSION = 1

# Documents longer than this are tokenized in segments cut at paragraph (else
# whitespace) boundaries, a batch at a time, to bound memory.
_SEGMENT_CHARS = 1_000_000
_BATCH = 8  # segments per `encode_batch` call (parallel in the Rust tokenizer)

_PARAGRAPH = re.compile(r"\n[^\S\n]*\n\s*")
_SENTENCE = re.compile(r"(?<=[.!?…。！？])[\"'”’»)\]]*\s+")
_WHITESPACE = re.compile(r"\s+")
# A sentence of a chunk's text, for choosing what to recompute (cag.selection) and for the
# index's sentence vectors (stores.index): a run up to . ! ? (and closing quotes), or a line.
_SENTENCE_SPAN = re.compile(r"[^.!?\n]+(?:[.!?]+[\"')\]]*|\n|$)")


TokenizerLike = Any  # a transformers fast tokenizer or a `tokenizers.Tokenizer`


class ChunkerSettings(BaseModel):
    """How documents are chunked; part of every chunk's content address.

    `tokenizer` identifies the tokenizer counts are made in (a model fingerprint's
    tokenizer hash, or `tokenizer_id(tok)`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_tokens: int = Field(256, ge=1)
    tokenizer: str
    min_fill: float = Field(0.5, ge=0.0, le=1.0)
    version: int = CHUNKER_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain, stable dict (sorted keys) for manifests and content addresses."""
        return dict(sorted(self.model_dump(mode="json").items()))


@dataclass(frozen=True)
class Chunk:
    """One chunk: its text and its ``[start, end)`` character span in the document."""

    index: int
    text: str
    start: int
    end: int
    n_tokens: int


def _backend(tokenizer: TokenizerLike) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "encode_batch"):
        raise TypeError(
            "the chunker needs a fast tokenizer (transformers PreTrainedTokenizerFast or "
            f"tokenizers.Tokenizer), got {type(tokenizer).__name__}"
        )
    return backend


def tokenizer_id(tokenizer: TokenizerLike) -> str:
    """A stable id of a fast tokenizer: sha256 of its serialised definition (first 20 hex)."""
    return hashlib.sha256(_backend(tokenizer).to_str().encode("utf-8")).hexdigest()[:20]


class Chunker:
    """Splits documents with one tokenizer and one `ChunkerSettings`.

    Without `settings`, they are made from `chunk_tokens` and `tokenizer_id(tokenizer)`;
    a caller that has a model fingerprint passes settings naming its tokenizer hash.
    """

    def __init__(self, tokenizer: TokenizerLike, settings: ChunkerSettings | None = None,
                 *, chunk_tokens: int = 256) -> None:
        self._tok = _backend(tokenizer)
        self.settings = settings or ChunkerSettings(chunk_tokens=chunk_tokens, tokenizer=tokenizer_id(tokenizer))

    # ------------------------------------------------------------------ tokens

    def token_spans(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Character ``(starts, ends)`` of every non-empty token of `text`
        (two non-decreasing int64 arrays), from one tokenization."""
        bases, pieces = _segments(text)
        parts = []
        for i in range(0, len(pieces), _BATCH):  # a few segments at a time bounds memory
            encodings = self._tok.encode_batch(pieces[i:i + _BATCH], add_special_tokens=False)
            for base, enc in zip(bases[i:i + _BATCH], encodings):
                spans = [se for se in enc.offsets if se[1] > se[0]]
                if spans:
                    parts.append(np.asarray(spans, dtype=np.int64) + base)
            del encodings
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        spans = np.concatenate(parts)
        # guard against overlapping offsets: keep both sequences monotonic
        return np.maximum.accumulate(spans[:, 0]), np.maximum.accumulate(spans[:, 1])

    # ------------------------------------------------------------------ split

    def split(self, text: str) -> list[Chunk]:
        """The chunks of `text` (empty list for empty text)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if not text:
            return []
        starts, ends = self.token_spans(text)
        n_tok = len(starts)
        budget = self.settings.chunk_tokens
        min_tokens = max(1, int(budget * self.settings.min_fill))
        chunks: list[Chunk] = []
        pos, tok = 0, 0  # char position of the chunk start; first token at or after it
        n = len(text)
        while pos < n:
            limit_tok = tok + budget
            if limit_tok >= n_tok:
                cut = n
            else:
                limit = int(starts[limit_tok])
                if limit <= pos:  # many tokens share one character (byte-level splits)
                    nxt = int(np.searchsorted(starts, pos, side="right"))
                    limit = int(starts[nxt]) if nxt < n_tok else n
                cut = self._choose_cut(text, pos, limit, starts, tok, min_tokens)
                # never cut inside a token (e.g. byte-level BPE's " word" starts at the space)
                t = int(np.searchsorted(starts, cut, side="right")) - 1
                if t >= tok and ends[t] > cut and starts[t] > pos:
                    cut = int(starts[t])
            end_tok = n_tok if cut == n else int(np.searchsorted(starts, cut, side="left"))
            chunks.append(Chunk(len(chunks), text[pos:cut], pos, cut, end_tok - tok))
            pos, tok = cut, end_tok
        return chunks

    def _choose_cut(self, text: str, pos: int, limit: int, starts: np.ndarray, tok: int,
                    min_tokens: int) -> int:
        """Best cut in ``(pos, limit]``: a paragraph, sentence or whitespace boundary
        that fills at least `min_tokens`, else the last whitespace boundary, else `limit`
        (a token boundary)."""
        window = text[pos:limit]
        fallback = limit
        for pattern in (_PARAGRAPH, _SENTENCE, _WHITESPACE):
            last = None
            for m in pattern.finditer(window):
                last = m.end()
            if last is None:
                continue
            cut = pos + last
            filled = int(np.searchsorted(starts, cut, side="left")) - tok
            if filled >= min_tokens:
                return cut
            if pattern is _WHITESPACE:
                fallback = cut  # a short chunk that ends on a word beats splitting one
        return fallback


def _segments(text: str) -> tuple[list[int], list[str]]:
    """Split a long text into ~`_SEGMENT_CHARS` pieces at paragraph (else whitespace)
    boundaries for tokenization; short texts are one piece."""
    if len(text) <= _SEGMENT_CHARS:
        return [0], [text]
    bases, pieces = [], []
    pos, n = 0, len(text)
    while pos < n:
        end = min(n, pos + _SEGMENT_CHARS)
        if end < n:
            lo = pos + _SEGMENT_CHARS // 2
            cut = text.rfind("\n\n", lo, end)
            if cut < 0:
                m = None
                for m in _WHITESPACE.finditer(text, lo, end):
                    pass
                cut = m.start() if m is not None else -1
            if cut > pos:
                end = cut
        bases.append(pos)
        pieces.append(text[pos:end])
        pos = end
    return bases, pieces


def chunk_text(text: str, tokenizer: TokenizerLike, chunk_tokens: int = 256) -> list[Chunk]:
    """Convenience: `Chunker(tokenizer, chunk_tokens=chunk_tokens).split(text)`."""
    return Chunker(tokenizer, chunk_tokens=chunk_tokens).split(text)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of `text`'s sentences (newlines end sentences too); whitespace trimmed."""
    spans = []
    for m in _SENTENCE_SPAN.finditer(text):
        start, end = m.start(), m.end()
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return spans
