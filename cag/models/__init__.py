"""Models: the registry of packaged models, loading, per-family adapters.

Names are exported lazily (PEP 562) so that ``import cag.models`` costs nothing:
torch and transformers load only when a model does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load": "cag.models.registry",
    "install": "cag.models.registry",
    "resolve": "cag.models.registry",
    "weights_hash": "cag.models.registry",
    "cag_home": "cag.models.registry",
    "list_models": "cag.models.registry",
    "REGISTRY": "cag.models.registry",
    "ModelSpec": "cag.models.registry",
    "ModelError": "cag.models.registry",
    "ModelPackageError": "cag.models.registry",
    "ModelIntegrityError": "cag.models.registry",
    "ModelNotFoundError": "cag.models.registry",
    "LoadedModel": "cag.models.loaded",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from cag.models.loaded import LoadedModel
    from cag.models.registry import (
        REGISTRY,
        ModelError,
        ModelIntegrityError,
        ModelNotFoundError,
        ModelPackageError,
        ModelSpec,
        cag_home,
        install,
        list_models,
        load,
        resolve,
        weights_hash,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cag.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
