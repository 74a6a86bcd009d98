"""`cag demo` end to end on the real packaged models: the integration test of the main job (#10).

It builds the bundled handbook with SmolLM2, answers through the path the quality gate
picks for Qwen2.5 and through direct context, and reports both, as `make demo` does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cag.demo import DEFAULT_QUESTIONS, is_correct, load_questions

pytestmark = pytest.mark.integration

FIELDS = {"question", "expected", "answer", "correct", "path", "ttft_s", "direct_ttft_s"}


def test_cag_demo_json(tmp_path):
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-m", "cag.cli", "demo", "--store", str(store), "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)  # stdout is the JSON alone; progress went to stderr
    assert "cag demo:" in proc.stderr
    questions = load_questions(DEFAULT_QUESTIONS)
    assert len(report["questions"]) == len(questions)
    gate = report["gate"]
    assert gate["path"] in ("native", "native+repair", "translated", "translated+repair", "direct") and gate["reason"]
    for row, (question, answers) in zip(report["questions"], questions):
        assert FIELDS <= set(row)
        assert row["question"] == question and row["expected"] == answers[0]
        assert row["path"] == gate["path"]  # the gate's choice is what answered
        assert row["correct"] == is_correct(row["answer"], answers)  # "right" means right
        assert row["ttft_s"] > 0 and row["direct_ttft_s"] > 0
    # The reference path must actually answer this handbook, or the demo shows nothing.
    assert report["direct_correct"] >= 3, report["questions"]
    # A second run is the next night's build: nothing changed, nothing is prefilled again.
    again = subprocess.run([sys.executable, "-m", "cag.cli", "demo", "--store", str(store), "--json"],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads(again.stdout)["build"]["prefilled"] == 0
