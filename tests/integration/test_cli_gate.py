"""`cag gate`: the serving path the quality gate picks per pair, from the shipped records alone.

What it prints must be what a store of that pair is served with (`CachedContext.decision`), and what the
README's gate table says: these pairs' records are shipped in `mappers/pretrained`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cag.cli import app

pytestmark = pytest.mark.integration


def _rows(*args: str) -> dict[tuple[str, str], dict]:
    result = CliRunner().invoke(app, ["gate", "--json", *args])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {(r["source"], r["target"]): r for r in rows}


def test_a_smollm2_store_is_served_as_the_readme_says():
    rows = _rows("--source", "smollm2-135m")
    assert set(rows) == {("smollm2-135m", t) for t in ("smollm2-135m", "qwen2.5-0.5b", "gemma3-270m")}
    into_qwen, into_gemma = rows["smollm2-135m", "qwen2.5-0.5b"], rows["smollm2-135m", "gemma3-270m"]
    assert into_qwen["path"] == "translated+repair" and "13%" in into_qwen["served"]
    assert into_gemma["path"] == "translated" and "copy prior 0.5" in into_gemma["served"]
    assert into_qwen["method"] == into_gemma["method"] == "bottleneck"
    itself = rows["smollm2-135m", "smollm2-135m"]
    assert itself["path"] == "direct" and itself["method"] == "identity"
    assert "below the gate" in itself["reason"] and itself["rejected"]     # and it says why


def test_the_gate_threshold_is_the_callers():
    rows = _rows("--source", "gemma3-270m", "--target", "smollm2-135m", "--min-retention", "0")
    assert rows["gemma3-270m", "smollm2-135m"]["path"] == "translated"   # min_retention 0: served whatever it measures
    rows = _rows("--source", "gemma3-270m", "--target", "smollm2-135m")
    assert rows["gemma3-270m", "smollm2-135m"]["path"] == "direct"


def test_a_retired_mapper_and_an_unknown_model_fail_with_a_clear_error():
    result = CliRunner().invoke(app, ["gate", "--source", "smollm2-135m", "--target", "qwen2.5-0.5b",
                                      "--mapper", "mot"])
    assert result.exit_code == 1 and "bottleneck" in result.output   # names what replaced it
    result = CliRunner().invoke(app, ["gate", "--source", "no-such-model"])
    assert result.exit_code == 1 and "no-such-model" in result.output
