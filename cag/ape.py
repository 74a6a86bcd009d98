"""Query-time attention over placed chunks: the defaults calibrated per target.

Two settings, both label-free and measured on the target's own chunk caches:

- APE's context temperature and scale (T, S) over the whole placed context;
- the rank key decay γ: the keys of the chunk the retriever ranked i-th (0 = best)
  are multiplied by γ**i, so lower-ranked chunks pull the question less. Direct
  context has this for free: the best chunk comes first and the model favours
  what it read first, while chunks prefilled apart all look like "the first
  document" (eval/results/rank_key_decay/).

`eval/calibrate_ape.py` chooses (T, S) per target model, label-free, on
calibration lookup questions (never an evaluation set): the grid point whose
native chunk caches come closest, in KL over the answer, to direct context. It
writes ``cag/ape_defaults.json``, keyed by the model's weight fingerprint, so a
default never follows a name onto other weights.

`eval/calibrate_rank_decay.py` then chooses γ the same way, at the calibrated (T, S),
and adds it to the same entry.

(T, S) were measured on the target's own chunk caches only, so translated caches keep T = S = 1
unless the caller sets them. A translated path's γ is calibrated the same way over the mapper's
translated chunks (`calibrate_rank_decay.py --source ...`) and kept in the mapper's card
(``fidelity.rank_key_decay``), since it belongs to those keys; without one it is 1.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DEFAULTS_FILE = Path(__file__).with_name("ape_defaults.json")
NEUTRAL = (1.0, 1.0)  # T = S = 1 leaves the model's attention exactly as it is


@lru_cache(maxsize=None)
def _defaults(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def calibrated(fingerprint_id: str, path: Path | None = None) -> tuple[float, float] | None:
    """(T, S) calibrated for the model with this weight fingerprint, or None if it was never calibrated."""
    entry = _defaults(path or DEFAULTS_FILE).get(fingerprint_id)
    if entry is None:
        return None
    return float(entry["temperature"]), float(entry["scale"])


def calibrated_rank_decay(fingerprint_id: str, path: Path | None = None) -> float | None:
    """γ calibrated for the model with this weight fingerprint, or None if it was never calibrated."""
    entry = _defaults(path or DEFAULTS_FILE).get(fingerprint_id)
    if entry is None or "rank_key_decay" not in entry:
        return None
    return float(entry["rank_key_decay"])


def resolve_rank_decay(decay: float | None, *, fingerprint_id: str, native: bool,
                       mapper_fidelity: dict | None = None) -> float:
    """The γ a query uses: what the caller set, else the calibrated default of the path (the target's
    on the native path, the mapper card's ``fidelity.rank_key_decay`` on a translated one), else 1."""
    if decay is not None:
        return decay
    if native:
        return calibrated_rank_decay(fingerprint_id) or 1.0
    record = (mapper_fidelity or {}).get("rank_key_decay") or {}
    return float(record.get("value", 1.0))


def rank_key_scales(scores: list[float], decay: float) -> list[float]:
    """γ**rank for each chunk, its rank the number of chunks that score strictly higher (0 = best).

    Ties share a rank: whole-document context gives every chunk the same score, and there the
    decay has no ranking to follow, so it leaves every chunk as it is. (Ranking ties by their
    order muted a 4K needle haystack's 16th chunk to 0.95**15 and cut Qwen2.5's needle
    found-rate from 0.56 to 0.22, eval/results/eval-bar-lab300k/.)"""
    return [decay ** sum(other > s for other in scores) for s in scores]


def resolve(temperature: float | None, scale: float | None, *, fingerprint_id: str,
            native: bool) -> tuple[float, float]:
    """The (T, S) a query uses: what the caller set, else the calibrated default on the native path, else 1."""
    default = (calibrated(fingerprint_id) if native else None) or NEUTRAL
    return (default[0] if temperature is None else temperature,
            default[1] if scale is None else scale)
