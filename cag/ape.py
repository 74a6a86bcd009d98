"""APE's context temperature and scale: the defaults calibrated per target.

`eval/calibrate_ape.py` chooses (T, S) per target model, label-free, on
calibration lookup questions (never an evaluation set): the grid point whose
native chunk caches come closest, in KL over the answer, to direct context. It
writes ``cag/ape_defaults.json``, keyed by the model's weight fingerprint, so a
default never follows a name onto other weights.

The defaults were measured on the target's own chunk caches only, so they apply
to the native path; translated caches keep T = S = 1 unless the caller sets them.
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


def resolve(temperature: float | None, scale: float | None, *, fingerprint_id: str,
            native: bool) -> tuple[float, float]:
    """The (T, S) a query uses: what the caller set, else the calibrated default on the native path, else 1."""
    default = (calibrated(fingerprint_id) if native else None) or NEUTRAL
    return (default[0] if temperature is None else temperature,
            default[1] if scale is None else scale)
