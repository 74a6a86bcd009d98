"""The quality gate: which serving path a `CachedContext` may use for a (source, target) pair.

A *serving path* is how the target gets the retrieved context:

=====================  ==========================================================
path                   what the target does
=====================  ==========================================================
``native``             places its own chunk caches (the store was built by it)
``native+repair``      the same, then recomputes the crux (a share of the context
                       tokens chosen by `cag.selection`, as measured)
``translated``         places the store's chunks translated by a mapper
``translated+repair``  the same, then recomputes the crux (chosen by the source
                       model or the retriever), translated keys scaled as measured
``direct``             prefills the retrieved text itself (the reference; no speedup)
=====================  ==========================================================

Each cached path has a **measured lookup fidelity** for its pair, recorded where
``mapper="auto"`` reads it: the mapper card's ``fidelity.lookup`` for translated
paths, ``mappers/pretrained/native_lookup.json`` for native ones. Both are
written by ``python eval/gate_fidelity.py`` from `cag eval`'s conditions on
**calibration-side lookup items** (`eval/calibration_lookup.py`), never on an
evaluation set. The figure the gate reads is the *found-rate retention*: the
share of questions whose gold answer appears in the path's answer, over the
share direct context finds on the same items.

A ``+repair`` path may have several records, one per recompute setting measured
(share, selector, translated key scale); each is its own candidate, ordered by what
it costs at query time (`repair_cost`: the share recomputed, which dominates at
length, then the choice's own cost), so the cheapest setting that passes is served.

The gate takes the fastest path whose retention is at least ``min_retention``
(on the lookups, and on the answers copied exactly and the free questions about
calibration essays where the record measured them)
*and* that finds more answers than no context did on the same items (a path that
measures no better than no context is never served by default). A path with no
measurement does not pass: unknown is not good. When nothing cached passes,
``fallback="direct"`` prefills the retrieved text (correct, not fast), and
``fallback="raise"`` raises `GateError`. ``min_retention=0`` is the caller's
explicit consent to serve a path whatever it measures (benchmarks do this);
the answer still carries the measurement and a warning.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Fastest first within a pair (a store has one source, so a pair has either the native
# paths or the translated ones). "direct" is always last: the fallback, never gated.
PATHS = ("native", "native+repair", "translated", "translated+repair", "direct")
DEFAULT_MIN_RETENTION = 0.6
NATIVE_LOOKUP_FILE = "native_lookup.json"
# What choosing the crux costs before the recompute, cheapest first (at 4K into Qwen2.5: the
# first tokens and the index's sentence vectors are free, the source model's choice ~0.18 s on
# an Intel Xeon with AMX (its chunks read, its two question forwards), a partial prefill of the
# target's first layers for CacheBlend's deviation ~2 s on the AMD host).
SELECT_COST = ("first_k", "retriever", "retriever_chunk", "source_retriever", "source", "source_chunk",
               "question", "deviation")


class GateError(RuntimeError):
    """No cached path meets the gate and the caller asked not to fall back to direct context."""


@dataclass(frozen=True)
class PathFidelity:
    """What one serving path measured on calibration lookup items (None: not measured)."""

    path: str
    found_retention: float | None = None  # found(path) / found(direct)
    f1_retention: float | None = None
    found_rate: float | None = None
    direct_found_rate: float | None = None
    no_context_found_rate: float | None = None
    n: int = 0
    items: str = ""  # which calibration items (dataset name and seed)
    recorded_in: str = ""  # the card or file the figures come from
    method: str = ""  # the mapper method of a translated path
    # For a +repair path, the settings it was measured with: {"ratio": r, "select": selector}, and on a
    # translated path "translated_key_scale" (absent: 1). A record speaks only for those settings.
    repair: dict | None = None
    # Answers copied exactly (codes, call signs, invented names), measured beside the lookups when the
    # record has them: found(path) / found(direct) and n. Common-word lookups alone let a translated
    # path pass that garbles such answers (eval/results/gate-lab300k); None: not measured.
    copy_found_retention: float | None = None
    copy_n: int = 0
    # Free questions about calibration essays (what the answer is, in the essay's words), measured beside
    # the lookups when the record has them: found(path) / found(direct) and n. Lookups and codes ask for one
    # planted fact among same-shaped ones; a path can pass them and lose free questions. None: not measured.
    essay_found_retention: float | None = None
    essay_n: int = 0
    # The copy prior's weight the path decoded with when measured (`cag.copy_prior`; 0: the model alone).
    # Whoever serves the record serves it with that weight.
    copy_prior: float = 0.0

    @classmethod
    def from_record(cls, path: str, record: dict[str, Any] | None, *, recorded_in: str,
                    method: str = "") -> "PathFidelity":
        if not record:
            return cls(path, recorded_in=recorded_in, method=method)
        repair = record.get("repair") if path.endswith("+repair") else None
        copy = record.get("copy") if isinstance(record.get("copy"), dict) else {}
        essays = record.get("essays") if isinstance(record.get("essays"), dict) else {}
        def num(key, rec=record):
            value = rec.get(key)
            return float(value) if isinstance(value, (int, float)) else None
        return cls(path, num("found_retention"), num("f1_retention"), num("found_rate"),
                   num("direct_found_rate"), num("no_context_found_rate"), int(record.get("n") or 0),
                   str(record.get("items", "")), recorded_in, method, dict(repair) if repair else None,
                   num("found_retention", copy), int(copy.get("n") or 0),
                   num("found_retention", essays), int(essays.get("n") or 0),
                   copy_prior=float(record.get("copy_prior") or 0.0))

    def repair_matches(self, ratio: float, select: str, translated_key_scale: float = 1.0) -> bool:
        """Whether this +repair record was measured with these settings."""
        return _repair_key({"repair": self.repair}) == (ratio, select, float(translated_key_scale))

    @property
    def label(self) -> str:
        """The path, and for a +repair record the setting it speaks for."""
        prior = f"copy prior {self.copy_prior:g}" if self.copy_prior else ""
        if not self.repair:
            return f"{self.path} ({prior})" if prior else self.path
        rec = self.repair
        scale = float(rec.get("translated_key_scale", 1.0))
        return (f"{self.path} ({rec.get('select')} {float(rec.get('ratio', 0)):.0%}"
                + (f", translated keys ×{scale:g}" if scale != 1.0 else "") + (f", {prior}" if prior else "") + ")")

    @property
    def measured(self) -> bool:
        return self.found_retention is not None and self.n > 0

    def beats_no_context(self) -> bool:
        if self.found_rate is None or self.no_context_found_rate is None:
            return False
        return self.found_rate > self.no_context_found_rate

    def verdict(self, min_retention: float) -> tuple[bool, str]:
        """Whether this path passes a gate of `min_retention`, and why (one line)."""
        if self.path == "direct":
            return True, "direct context is the reference"
        if min_retention <= 0.0:
            return True, "gate off (min_retention=0): served whatever it measures"
        if not self.measured:
            return False, f"{self.label} path has no measured lookup fidelity for this pair"
        if not self.beats_no_context():
            return False, (f"{self.label} path finds no more answers than no context "
                           f"({self.found_rate:.2f} vs {self.no_context_found_rate:.2f}, n={self.n})")
        if self.found_retention < min_retention:
            return False, (f"{self.label} path keeps {self.found_retention:.2f} of direct context's found-rate "
                           f"(n={self.n}), below the gate's {min_retention:.2f}")
        if self.copy_found_retention is not None and self.copy_found_retention < min_retention:
            return False, (f"{self.label} path keeps {self.found_retention:.2f} of direct context's found-rate on "
                           f"lookups but {self.copy_found_retention:.2f} on answers copied exactly (codes, invented "
                           f"names; n={self.copy_n}), below the gate's {min_retention:.2f}")
        if self.essay_found_retention is not None and self.essay_found_retention < min_retention:
            return False, (f"{self.label} path keeps {self.found_retention:.2f} of direct context's found-rate on "
                           f"lookups but {self.essay_found_retention:.2f} on free questions about calibration "
                           f"essays (n={self.essay_n}), below the gate's {min_retention:.2f}")
        also = "" if self.copy_found_retention is None else \
            f", {self.copy_found_retention:.2f} on answers copied exactly (n={self.copy_n})"
        if self.essay_found_retention is not None:
            also += f", {self.essay_found_retention:.2f} on free essay questions (n={self.essay_n})"
        return True, (f"{self.label} path keeps {self.found_retention:.2f} of direct context's found-rate "
                      f"(n={self.n}{also}; gate {min_retention:.2f})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GateDecision:
    path: str
    fidelity: PathFidelity
    reason: str
    rejected: tuple[tuple[str, str], ...]  # (path, why) of faster paths that did not pass

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "fidelity": self.fidelity.to_dict(),
                "rejected": [{"path": p, "why": w} for p, w in self.rejected]}


def choose_path(candidates: list[PathFidelity], min_retention: float, fallback: str) -> GateDecision:
    """The first (fastest) candidate that passes; then direct context or `GateError`."""
    if fallback not in ("direct", "raise"):
        raise ValueError(f"fallback must be 'direct' or 'raise', got {fallback!r}")
    rejected = []
    for cand in candidates:
        ok, why = cand.verdict(min_retention)
        if ok:
            return GateDecision(cand.path, cand, why, tuple(rejected))
        rejected.append((cand.path, why))
    if fallback == "raise":
        raise GateError("no cached path meets the quality gate: " + "; ".join(w for _, w in rejected)
                        + ". Pass fallback='direct' to prefill the retrieved text, or min_retention=0 "
                        "to serve a cached path anyway.")
    why = "no cached path meets the gate (" + "; ".join(w for _, w in rejected) + "): prefilling the text"
    return GateDecision("direct", PathFidelity("direct"), why, tuple(rejected))


def no_mapper(exc: Exception) -> GateDecision:
    """Direct context for a pair no mapper translates (`MapperNotFoundError`), saying which is missing."""
    missing = str(exc).split(". ")[0]
    return GateDecision("direct", PathFidelity("direct"), missing + ": prefilling the text", (("translated", missing),))


def candidates_for(mapper: Any, target_id: str, target_name: str = "") -> list[PathFidelity]:
    """The serving paths the gate weighs for chunks read through `mapper` by the target, fastest first: the
    target's own chunks (and their +repair records) for the identity mapper, else the mapper card's records."""
    if mapper.method == "identity":
        return [native_fidelity(target_id, target_name), *native_repair_fidelities(target_id, target_name)]
    card = {"method": mapper.method, "fidelity": mapper.fidelity}
    name = getattr(mapper, "artifact_id", mapper.method)
    return [translated_fidelity(card, name), *translated_repair_fidelities(card, name)]


def repair_cost(fidelity: PathFidelity) -> tuple[float, int]:
    """Sort key of +repair records, cheapest first: the share recomputed, then the choice's cost."""
    rec = fidelity.repair or {}
    select = rec.get("select")
    return (float(rec.get("ratio", 1.0)), SELECT_COST.index(select) if select in SELECT_COST else len(SELECT_COST))


def served_repair(decision: GateDecision) -> dict | None:
    """The recompute settings a ``+repair`` path was measured with (pass to `CachedContext.prepare`),
    or None: whoever serves the gate's choice must serve it as it was measured."""
    repair = decision.fidelity.repair if decision.path.endswith("+repair") else None
    return dict(repair) if repair else None


def served_copy_prior(decision: GateDecision) -> float:
    """The copy prior's weight the chosen path was measured with (0 for direct context and the model alone)."""
    return 0.0 if decision.path == "direct" else decision.fidelity.copy_prior


# ------------------------------------------------------------------- records


def native_lookup_path() -> Path:
    import mappers

    return Path(mappers.__file__).resolve().parent / "pretrained" / NATIVE_LOOKUP_FILE


def repair_records(slot: Any) -> list[dict]:
    """The records of a +repair slot: one dict (cards written before several were kept) or a list."""
    if isinstance(slot, dict):
        return [slot]
    if isinstance(slot, list):
        return [r for r in slot if isinstance(r, dict)]
    return []


def _repair_key(record: dict) -> tuple:
    rec = record.get("repair") or {}
    return (rec.get("ratio"), rec.get("select"), float(rec.get("translated_key_scale", 1.0)))


def with_repair_record(slot: Any, record: dict) -> list[dict]:
    """`slot`'s records with `record` in place of any measured with the same settings (others kept)."""
    return [r for r in repair_records(slot) if _repair_key(r) != _repair_key(record)] + [record]


def _repair_candidates(path: str, slot: Any, recorded_in: str, method: str = "") -> list[PathFidelity]:
    found = [PathFidelity.from_record(path, r, recorded_in=recorded_in, method=method) for r in repair_records(slot)]
    return sorted(found, key=repair_cost) or [PathFidelity(path, recorded_in=recorded_in, method=method)]


def native_fidelity(model_id: str, model_name: str = "") -> PathFidelity:
    """The native path's record for a model (by fingerprint id), or an unmeasured one."""
    path = native_lookup_path()
    record = (_native_file().get("models") or {}).get(model_id)
    return PathFidelity.from_record("native", record, recorded_in=f"{path.name}[{model_name or model_id}]")


def native_repair_fidelities(model_id: str, model_name: str = "") -> list[PathFidelity]:
    """The native+repair records for a model, cheapest first (one unmeasured when there are none)."""
    slot = (_native_file().get("repair") or {}).get(model_id)
    return _repair_candidates("native+repair", slot, f"{native_lookup_path().name}[{model_name or model_id}]")


def _native_file() -> dict:
    path = native_lookup_path()
    return json.loads(path.read_text()) if path.is_file() else {}


def translated_fidelity(card: dict[str, Any], folder: str | Path) -> PathFidelity:
    """A translated path's record from its mapper card (``fidelity.lookup``)."""
    record = (card.get("fidelity") or {}).get("lookup")
    return PathFidelity.from_record("translated", record, recorded_in=str(Path(folder).name),
                                    method=str(card.get("method", "")))


def translated_repair_fidelities(card: dict[str, Any], folder: str | Path) -> list[PathFidelity]:
    """The translated+repair records of a mapper card (``fidelity.lookup_repair``), cheapest first."""
    slot = (card.get("fidelity") or {}).get("lookup_repair")
    return _repair_candidates("translated+repair", slot, str(Path(folder).name), str(card.get("method", "")))
