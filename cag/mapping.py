"""Finding the mapper that turns a store's chunks into a target's KV space.

``mapper="auto"`` means: the identity when the store's source model *is* the
target; otherwise the best measured mapper shipped for (source, target), where
"best" is the highest lookup fidelity recorded in its card (found-rate retention on
calibration lookup items, `eval/gate_fidelity.py`), then the lowest next-token KL.
Whether the chosen path is *served* is the quality gate's call (`cag.gate`). Other values: a method
name (``"ridge"``, ``"latent"``, ...) picks the shipped mapper of that method for
the pair, and a path loads that artifact (checked against the pair).

Shipped mappers live in ``mappers/pretrained/<name>/`` (installed with the
package) and in ``$CAG_HOME/mappers/<name>/`` (fitted locally by ``cag fit``).
Artifacts a refit has beaten are deleted, not kept beside their replacement;
``mappers/pretrained/retired.json`` remembers them, so asking for one (by its folder
name, or loading an old copy, recognised by its weights' sha256) says what replaced it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cag.kv import ModelFingerprint
from cag.models.loaded import LoadedModel
from cag.models.registry import cag_home


class MapperNotFoundError(LookupError):
    """No mapper exists for the (source, target) pair asked for."""


class MapperRetiredError(MapperNotFoundError):
    """The artifact asked for was retired; the message names its replacement."""


def retired_artifacts() -> dict[str, dict[str, dict[str, str]]]:
    import json

    import mappers

    path = Path(mappers.__file__).resolve().parent / "pretrained" / "retired.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _check_not_retired(spec: str) -> None:
    """Raise `MapperRetiredError` when `spec` names a retired artifact folder or is an old copy of one."""
    from mappers.base import Mapper, MapperArtifactError

    retired = retired_artifacts()
    entry = retired.get("by_name", {}).get(Path(spec).name)
    if entry is None and os.path.isdir(spec):
        try:
            sha = Mapper.read_card(Path(spec)).get("weights_sha256")
        except MapperArtifactError:
            return  # loading it will say what is wrong with it
        entry = retired.get("by_weights_sha256", {}).get(sha)
    if entry is not None:
        raise MapperRetiredError(
            f"mapper {spec} is retired ({entry['retired']}): {entry['was']}. Use {entry['replacement']} "
            f"(mapper=\"auto\" picks it): {entry['why']}.")


def mapper_dirs() -> list[Path]:
    import mappers

    return [Path(mappers.__file__).resolve().parent / "pretrained", cag_home() / "mappers"]


def available_mappers() -> list[tuple[Path, dict[str, Any]]]:
    """Every readable mapper artifact (folder, card) in the mapper folders."""
    from mappers.base import Mapper, MapperArtifactError

    found = []
    for root in mapper_dirs():
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            try:
                found.append((folder, Mapper.read_card(folder)))
            except MapperArtifactError:
                continue
    return found


def card_fidelity(card: dict[str, Any]) -> dict[str, Any]:
    """The held-out fidelity figures of a mapper card (R², attention cosine, KL, top-1)."""
    fidelity = card.get("fidelity") or {}
    return fidelity.get("heldout", fidelity)


def _score(card: dict[str, Any]) -> tuple[float, float]:
    """Rank for ``auto``: lookup fidelity first (found-rate retention on calibration lookup
    items, higher is better; unmeasured ranks last), then the plain-text next-token KL."""
    lookup = (card.get("fidelity") or {}).get("lookup") or {}
    found = lookup.get("found_retention")
    kl = card_fidelity(card).get("kl")
    return (-float(found) if isinstance(found, (int, float)) else float("inf"),
            float(kl) if isinstance(kl, (int, float)) else float("inf"))


def resolve_mapper(spec: str | os.PathLike, source: ModelFingerprint, target: LoadedModel):
    """The `Mapper` for chunks of `source` answered by `target` (see module doc)."""
    from mappers.base import load_mapper
    from mappers.identity import IdentityMapper

    same = source.id == target.fingerprint.id
    spec = str(spec)
    if spec == "identity" or (spec == "auto" and same):
        return IdentityMapper(source, target.fingerprint)
    _check_not_retired(spec)
    if os.path.isdir(spec):
        return load_mapper(spec, source=source, target=target.fingerprint)
    candidates = [(folder, card) for folder, card in available_mappers()
                  if ModelFingerprint.from_dict(card["source"]).id == source.id
                  and ModelFingerprint.from_dict(card["target"]).id == target.fingerprint.id
                  and (spec == "auto" or card.get("method") == spec)]
    if not candidates:
        if spec != "auto":  # a method whose artifact for this pair was retired: name what replaced it
            _check_not_retired(f"{source.name}__{target.name}__{spec}")
        pairs = sorted({f"{c['source'].get('name')} → {c['target'].get('name')} ({c.get('method')})"
                        for _, c in available_mappers()})
        raise MapperNotFoundError(
            f"no {'' if spec == 'auto' else spec + ' '}mapper from {source.describe()} to "
            f"{target.fingerprint.describe()}. Fit one with `cag fit --source {source.name or '...'} "
            f"--target {target.name}`, pass mapper=<artifact folder>, or answer with the source model "
            f"itself. Mappers available: {', '.join(pairs) or 'none'}"
        )
    folder, _ = min(candidates, key=lambda fc: _score(fc[1]))
    return load_mapper(folder, source=source, target=target.fingerprint)
