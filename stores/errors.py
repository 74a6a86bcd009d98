"""Errors raised by `stores`: one base class, so a caller can catch everything a store says.

None of them derives from `OSError`: diskcache treats an `OSError` raised while
reading a value as "deleted concurrently" and silently returns the default,
which would hide a refused entry.
"""

from __future__ import annotations

__all__ = ["StoreError", "StoreIntegrityError", "StoreMismatchError", "EmbedderMismatchError"]


class StoreError(Exception):
    """Base of every error raised by a chunk store, index or manifest."""


class StoreIntegrityError(StoreError):
    """An entry or file is not what the store wrote: a pickled or non-bytes value,
    a missing or inconsistent index file, a malformed manifest."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StoreMismatchError(StoreError):
    """A store was built with other settings (source model, chunker, embedder) than
    the ones asked for; mixing them would give silently wrong answers."""


class EmbedderMismatchError(StoreMismatchError):
    """A saved vector index was built with another embedder than the one given."""
