"""The identity mapper: source and target are the same model; chunks pass unchanged."""

from __future__ import annotations

from typing import Any

from cag.kv import KVChunk, ModelFingerprint
from mappers.base import Mapper, MapperMismatchError, register_mapper


@register_mapper
class IdentityMapper(Mapper):
    method = "identity"

    def __init__(self, source: ModelFingerprint, target: ModelFingerprint | None = None,
                 settings: dict[str, Any] | None = None) -> None:
        target = source if target is None else target
        if source.id != target.id:
            raise MapperMismatchError(
                f"the identity mapper needs one model, got {source.describe()} → {target.describe()}"
            )
        super().__init__(source, target, settings)

    def _translate_batch(self, chunks: list[KVChunk], texts: list[str], target) -> list[KVChunk]:
        return list(chunks)
