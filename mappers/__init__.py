"""Translation between KV spaces: token and layer alignment, the mapper interface
and artifact format, the methods (identity, KV Ridge, Dense Latent, HeteroFold,
Mixture-of-Translators), fitting, the training loop and fidelity. Imports only
the ground (`cag.kv`, `cag.models`); names load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Mapper": "mappers.base",
    "MapperError": "mappers.base",
    "MapperMismatchError": "mappers.base",
    "MapperArtifactError": "mappers.base",
    "TextMismatchError": "mappers.base",
    "UnknownMethodError": "mappers.base",
    "load_mapper": "mappers.base",
    "mapper_class": "mappers.base",
    "available_methods": "mappers.base",
    "IdentityMapper": "mappers.identity",
    "RidgeMapper": "mappers.ridge",
    "LatentMapper": "mappers.latent",
    "HeteroFoldMapper": "mappers.heterofold",
    "MoTMapper": "mappers.mot",
    "align_tokens": "mappers.token_alignment",
    "agreed_spans": "mappers.token_alignment",
    "TokenAlignment": "mappers.token_alignment",
    "align_layers": "mappers.layer_alignment",
    "fit_mapper": "mappers.fit",
    "measure_fidelity": "mappers.fidelity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mappers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
