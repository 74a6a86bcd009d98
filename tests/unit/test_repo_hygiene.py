"""What the repository may hold: shipped mappers within their budget, no stores or fit state.

A previous submission was refused for size: evaluation stores (hundreds of MB)
had been committed. Stores and fit statistics are rebuilt by scripts; only
the fitted mapper artifacts (each ≤ 20 MB) ship.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_MB = 20.0
MAX_TOTAL_MB = 300.0


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("the tests run from a git checkout (CI clones the repository)")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_large_or_generated_files_are_tracked():
    files = [f for f in tracked_files() if f.exists()]
    big = {str(f.relative_to(ROOT)): round(f.stat().st_size / 1e6, 1) for f in files
           if f.stat().st_size > MAX_FILE_MB * 1e6}
    assert not big, f"files over {MAX_FILE_MB} MB are tracked: {big}"
    generated = [str(f.relative_to(ROOT)) for f in files
                 if "fit_state" in f.parts or ("results" in f.parts and "store" in f.parts)]
    assert not generated, f"stores or fit state are tracked: {generated[:5]}"
    total = sum(f.stat().st_size for f in files) / 1e6
    assert total < MAX_TOTAL_MB, f"tracked files add up to {total:.0f} MB"
