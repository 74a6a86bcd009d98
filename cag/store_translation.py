"""Translate a whole store for one target, once, so its queries load instead of translate.

    from cag.store_translation import translate_store
    summary = translate_store("kb-store", target="qwen2.5-0.5b")     # what `cag store translate` runs

The chunks of the store's published version are translated by the mapper a
`CachedContext` with the same ``mapper`` setting would use (``auto``: the gate's best
for the pair) and kept next to their source chunks (`stores.translations`). A query
then reads them with ``CachedContext(stored_translations=True)``, the default, and
pays only the load. A re-run translates only what is new (a nightly build's new
chunks); translations of chunks a build removes are garbage-collected with them.
"""

from __future__ import annotations

import os
from typing import Any

from cag.models import registry
from cag.progress import Progress


def translate_store(store: str | os.PathLike[str] | Any, target: str | Any, *, mapper: str = "auto",
                    dtype: str | None = None, batch_chunks: int = 8, progress: bool | Progress = False,
                    compute_dtype: str = "auto"):
    """Translate every chunk of the store's published version into `target`; returns a
    `stores.translations.TranslateSummary`.

    `store`: folder, URL or opened location; `target`: a model name or a loaded model;
    `dtype`: the translations' storage format (default: the store's own chunk format);
    `progress`: plain lines or a bar on stderr (True), or a `Progress` to advance.
    """
    from cag.mapping import resolve_mapper
    from stores.index import RowsOnlyEmbedder
    from stores.location import open_store
    from stores.translations import translate_chunks

    location = open_store(store)
    try:
        if location.current_version() is None:
            raise FileNotFoundError(f"no store version published in {location}; run `cag build` first")
        manifest, index = location.open_current(embedder=RowsOnlyEmbedder.for_store(location))
        lm = registry.load(target, compute_dtype) if isinstance(target, (str, os.PathLike)) else target
        mp = resolve_mapper(mapper, manifest.source_fingerprint, lm)
        items = list(dict.fromkeys((r.key, r.text) for r in index.rows))
        fmt = dtype or manifest.chunker.get("dtype", "bfloat16")
        bar = progress if isinstance(progress, Progress) else (
            Progress("cag store translate", total=len(items), unit="chunks") if progress else None)
        try:
            with location.chunks() as chunks:
                return translate_chunks(chunks, items, mp, lm, dtype=fmt, batch_chunks=batch_chunks,
                                        on_batch=(lambda done, total: bar.update(completed=done, total=total))
                                        if bar is not None else None)
        finally:
            if bar is not None and bar is not progress:
                bar.close()
    finally:
        if location is not store:
            location.close()
