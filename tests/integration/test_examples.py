"""The example scripts, run as a user would (subprocesses, small settings).

Each one loads a packaged model and builds a store in a temp dir; together they
take a few minutes on CPU.
"""

from __future__ import annotations

import json
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
    out = run_example("retention_report.py", "--questions", "3", "--max-new-tokens", "8",
                      "--source", "qwen2.5-0.5b", "--out", str(tmp_path / "report"))
    rows = {r["condition"]: r for r in map(json.loads, re.findall(r"^(\{.*\})$", out, re.M))}
    assert {"no_context", "direct", "native_cache", "cache:identity"} <= set(rows), out
    assert all(0.0 <= r["f1"] <= 1.0 for r in rows.values())
    assert rows["direct"]["f1"] > rows["no_context"]["f1"], out  # the facts need the context
    assert "| synthetic-kb | qwen2.5-0.5b | direct |" in out
    assert (tmp_path / "report" / "results.json").exists()
