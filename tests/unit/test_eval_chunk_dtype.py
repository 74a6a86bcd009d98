"""eval/eval_chunk_dtype.py's comparison: paired over the same questions, cached conditions only."""

import json

import pytest

from eval.eval_chunk_dtype import compare, render


def _write(folder, rows):
    folder.mkdir(parents=True)
    with open(folder / "results.jsonl", "w") as f:
        for item, target, dataset, res in rows:
            results = {c: {"f1": f1, "found": float(f1 > 0.5), "kl_from_direct": kl, "answer": c}
                       for c, (f1, kl) in res.items()}
            results["direct"]["kl_from_direct"] = None
            f.write(json.dumps({"item": item, "target": target, "meta": {"dataset": dataset},
                                "results": results}) + "\n")


def test_compare_pairs_questions_and_ignores_conditions_without_chunks(tmp_path):
    base = {"no_context": (0.0, 3.0), "direct": (1.0, None), "native_cache": (1.0, 0.1), "cache:mot": (0.0, 2.0)}
    _write(tmp_path / "bf16", [("q1", "t", "kb", base), ("q2", "t", "kb", base), ("q3", "t", "kb", base)])
    moved = dict(base, native_cache=(0.5, 0.2), no_context=(1.0, 3.0))  # no_context must not count
    _write(tmp_path / "int8", [("q1", "t", "kb", moved), ("q2", "t", "kb", base), ("q9", "t", "kb", base)])
    report = compare({"bfloat16": tmp_path / "bf16", "int8": tmp_path / "int8"})
    assert report["questions"] == 2  # q3 and q9 ran in one format only
    rows = {r["condition"]: r for r in report["table"]}
    assert set(rows) == {"native_cache", "cache:mot"}
    native = rows["native_cache"]
    assert native["n"] == 2 and native["bfloat16"]["f1"] == 1.0 and native["int8"]["f1"] == 0.75
    assert native["f1_delta"]["int8"]["delta"] == pytest.approx(-0.25)
    assert native["f1_delta"]["int8"]["changed"] == 1
    assert native["int8"]["kl_from_direct"] == pytest.approx(0.15)
    assert rows["cache:mot"]["f1_delta"]["int8"]["delta"] == 0.0
    pooled = report["pooled"]
    assert pooled["n"] == 4 and pooled["f1_delta"]["int8"]["delta"] == pytest.approx(-0.125)
    report.update(command="python eval/eval_chunk_dtype.py", date="today", machine="here")
    text = render(report)
    assert "misses" in text and "| kb | t | native_cache | 2 |" in text
