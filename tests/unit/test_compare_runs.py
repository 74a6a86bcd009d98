"""eval/compare_runs.py: one condition of one run against one of another, paired by question."""

import gzip
import json

import pytest

from eval.compare_runs import compare, main


def _write(folder, rows):
    folder.mkdir(parents=True)
    with open(folder / "results.jsonl", "w") as f:
        for item, target, dataset, res in rows:
            results = {c: {"found": found, "gold_log_likelihood": ll, "answer": answer}
                       for c, (found, ll, answer) in res.items()}
            f.write(json.dumps({"item": item, "target": target, "meta": {"dataset": dataset},
                                "results": results}) + "\n")


REFS = {"no_context": (0.0, -5.0, "?"), "direct": (1.0, -0.5, "yes"), "native_cache": (1.0, -1.0, "yes")}


def test_pairs_by_question_and_target_and_counts_reference_answers_that_differ(tmp_path):
    _write(tmp_path / "a", [("q1", "t", "kb", {**REFS, "cache:mot": (0.0, -5.0, "no")}),
                            ("q2", "t", "kb", {**REFS, "cache:mot": (1.0, -2.0, "yes")}),
                            ("q3", "t", "kb", {**REFS, "cache:mot": (0.0, -5.0, "no")}),      # not in b
                            ("q1", "u", "kb", {**REFS, "cache:mot": (0.0, -5.0, "no")})])     # other target
    moved = {**REFS, "direct": (1.0, -0.5, "yes, it is")}  # the run saw q2 differently: say so
    _write(tmp_path / "b", [("q1", "t", "kb", {**REFS, "cache:bottleneck": (1.0, -1.0, "yes")}),
                            ("q2", "t", "kb", {**moved, "cache:bottleneck": (1.0, -3.0, "yes")}),
                            ("q1", "u", "kb", {**REFS, "cache:bottleneck": (1.0, -1.0, "yes")})])
    out = compare(tmp_path / "a", "cache:mot", tmp_path / "b", "cache:bottleneck", target="t")["kb"]
    assert out["n"] == 2
    assert out["found"] == [1.0, 2.0]
    assert out["d_found"]["delta"] == pytest.approx(0.5) and out["d_found"]["changed"] == 1
    assert out["gold_ll"] == [pytest.approx(-3.5), pytest.approx(-2.0)]
    assert out["d_gold_ll"]["delta"] == pytest.approx(1.5)
    assert out["same_reference_answers"] == {"no_context": 2, "direct": 1, "native_cache": 2}
    assert compare(tmp_path / "a", "cache:mot", tmp_path / "b", "cache:bottleneck")["kb"]["n"] == 3


def test_refuses_runs_that_share_no_question_under_both_conditions(tmp_path, capsys):
    _write(tmp_path / "a", [("q1", "t", "kb", {**REFS, "cache:mot": (0.0, -5.0, "no")})])
    _write(tmp_path / "b", [("q1", "t", "kb", dict(REFS))])
    with pytest.raises(SystemExit, match="share no question"):
        main([str(tmp_path / "a"), "cache:mot", str(tmp_path / "b"), "cache:bottleneck"])
    assert main([str(tmp_path / "a"), "cache:mot", str(tmp_path / "b"), "native_cache",
                 "--json", str(tmp_path / "c.json")]) == 0
    assert "| kb | 1 | 0 | 1 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["datasets"]["kb"]["n"] == 1


def test_reads_an_archived_run_whose_rows_are_gzipped(tmp_path):
    _write(tmp_path / "a", [("q1", "t", "kb", {**REFS, "cache:mot": (0.0, -5.0, "no")})])
    _write(tmp_path / "b", [("q1", "t", "kb", {**REFS, "cache:mot": (1.0, -1.0, "yes")})])
    rows = tmp_path / "a" / "results.jsonl"
    (tmp_path / "a" / "results.jsonl.gz").write_bytes(gzip.compress(rows.read_bytes()))
    rows.unlink()
    out = compare(tmp_path / "a", "cache:mot", tmp_path / "b", "cache:mot")["kb"]
    assert out["n"] == 1 and out["found"] == [0.0, 1.0]
