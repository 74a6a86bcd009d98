"""cag: cache-augmented generation with KV caches shared across models.

Public names are exported lazily (PEP 562): ``import cag`` (and so importing
``stores`` or ``mappers``, which sit above ``cag.kv``) never pulls in torch,
transformers or the runtime, and no import loop can form through this file.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute in that module)
_EXPORTS: dict[str, tuple[str, str]] = {
    "load_model": ("cag.models.registry", "load"),
    "KVChunk": ("cag.kv", "KVChunk"),
    "CachedContext": ("cag.context", "CachedContext"),
    "Answer": ("cag.context", "Answer"),
    "Router": ("cag.router", "Router"),
    "RouterPolicy": ("cag.router", "RouterPolicy"),
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:
    from cag.context import Answer, CachedContext
    from cag.kv import KVChunk
    from cag.models.registry import load as load_model
    from cag.router import Router, RouterPolicy


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'cag' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
