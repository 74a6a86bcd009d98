"""The example scripts, run as a user would (subprocesses, small settings).

Each one loads a packaged model and builds a store in a temp dir; together they
take a few minutes on CPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("name", ["llama_index_pipeline.py", "nightly_build.py", "retention_report.py"])
def test_help(name):
    assert "usage:" in run_example(name, "--help")


def test_llama_index_pipeline(tmp_path):
    out = run_example("llama_index_pipeline.py", "--essays", "1", "--max-chars", "1000",
                      "--max-new-tokens", "16",
                      "--store", str(tmp_path / "store"))
    cached = re.search(r"^\[cached context\] .*answer: (.*)$", out, re.M)
    direct = re.search(r"^\[direct context\] .*answer: (.*)$", out, re.M)
    assert cached and direct, out
    assert "Oskarine Thrupp" in cached.group(1), out
    sources = out.split("[cached context]")[1]
    assert "harbour-notes.txt" in sources.split("\n")[1], out  # the planted document ranks first
    assert re.search(r"cached timings \(s\): .*first_token \d", out), out
    assert re.search(r"wall time per query: direct \d+\.\d+s, cached \d+\.\d+s", out), out


def test_nightly_build_demo(tmp_path):
    out = run_example("nightly_build.py", "--demo", "--essays", "2", "--store", str(tmp_path / "store"))
    first, second = out.split("\nsecond build:")
    assert re.search(r"new 2, changed 0, unchanged 0, removed 0, failed 0", first), out
    assert re.search(r"new 0, changed 1, unchanged 1, removed 0, failed 0", second), out
    total = int(re.search(r"chunks\s+(\d+) in the store", first).group(1))
    assert re.search(rf"{total} prefilled", first), out  # the first build prefills everything
    edited = re.search(r"edited (\S+) \(appended", out).group(1)
    by_doc = re.search(r"prefilled in the second build: \{(.*)\} \((\d+) of", out)
    assert by_doc, out
    # only the edited essay's new chunks were prefilled, fewer than the store holds
    assert re.fullmatch(rf"'{re.escape(edited)}': \d+", by_doc.group(1)), out
    n = int(by_doc.group(2))
    assert 1 <= n < total, out
    assert re.search(rf"chunks\s+\d+ in the store, {n} prefilled", second), out


def test_retention_report(tmp_path):
    out = run_example("retention_report.py", "--questions", "2", "--max-chars", "1000",
                      "--max-new-tokens", "12",
                      "--store", str(tmp_path / "store"))
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(cached|direct|no context)\s+(\d\.\d{3})\s+(\d\.\d{3})$", out, re.M)}
    assert set(rows) == {"cached", "direct", "no context"}, out
    assert all(0.0 <= v <= 1.0 for pair in rows.values() for v in pair)
    assert rows["direct"][1] > rows["no context"][1], out  # the planted facts need the context
    assert re.search(r"retention EM \(cached / direct\): ", out), out
    assert re.search(r"retention F1 \(cached / direct\): \d\.\d{3}", out), out
