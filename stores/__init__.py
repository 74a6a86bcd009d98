"""`stores`: where prefilled chunks live — chunking, the chunk store, the vector index,
the manifest and its atomic versions.

Imports only the ground (`cag.kv`, `cag.models`). Names are exported lazily, so
`import stores` pulls in neither faiss nor diskcache until they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Chunk": "chunker", "Chunker": "chunker", "ChunkerSettings": "chunker", "chunk_text": "chunker",
    "tokenizer_id": "chunker",
    "ChunkStore": "base", "StoreStats": "base", "chunk_key": "base",
    "DiskCacheChunkStore": "diskcache_store", "VerifyReport": "diskcache_store", "EntryProblem": "diskcache_store",
    "VectorIndex": "index", "Row": "index", "Hit": "index", "SentenceTransformerEmbedder": "index",
    "default_embedder": "index", "DEFAULT_EMBEDDER_ID": "index",
    "Manifest": "manifest", "DocumentEntry": "manifest", "publish": "manifest", "open_current": "manifest",
    "check_compatible": "manifest", "cleanup_versions": "manifest", "chunks_dir": "manifest",
    "StoreError": "errors", "StoreIntegrityError": "errors", "StoreMismatchError": "errors",
    "EmbedderMismatchError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stores' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
