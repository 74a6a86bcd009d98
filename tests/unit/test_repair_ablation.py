"""eval/repair_ablation.py: the grid of repair settings and its report, on results written by hand."""

import json

import pytest

from eval.repair_ablation import (decay_label, grid_report, label, parse_decay, render, setting_order, settings,
                                  summarize)


def test_the_grid_has_no_repair_once_each_selector_at_each_ratio_and_first_k_once():
    grid = settings([0.0, 0.1, 0.2], ["deviation", "source", "first_k"], first_k=16)
    assert grid == [("none", 0.0), ("deviation", 0.1), ("source", 0.1), ("deviation", 0.2), ("source", 0.2),
                    ("first_k", 16.0)]
    assert [label(*g) for g in grid] == ["none", "deviation 10%", "source 10%", "deviation 20%", "source 20%",
                                         "first_k k=16"]
    assert ("first_k", 0.0) not in settings([0.1], ["first_k"], first_k=0)


def test_a_decay_marks_its_settings_and_the_served_default_stays_unmarked():
    assert [parse_decay(v) for v in ("default", "1", "0.85")] == [None, 1.0, 0.85]
    assert decay_label("none", None) == "none"
    assert decay_label("deviation 10%", 1.0) == "deviation 10% γ=1"
    assert decay_label("none", 0.85) == "none γ=0.85"


def _result(f1, kl, ttft, recomputed=0, tokens=100):
    return {"f1": f1, "found": float(f1 > 0.5), "kl_from_direct": kl, "ttft_s": ttft,
            "recomputed_tokens": recomputed, "context_tokens": tokens}


def test_summary_pairs_every_setting_with_direct_context_on_the_same_questions(tmp_path):
    grid = ["none", "source 20%"]
    (tmp_path / "run.json").write_text(json.dumps({"command": "python eval/repair_ablation.py", "date": "today",
                                                   "host": {}, "dataset": "kb", "n": 2, "source": "s",
                                                   "settings": grid, "top_k": 4, "max_new_tokens": 16}))
    rows = []
    for item, native_none, native_src in (("q1", 0.0, 1.0), ("q2", 1.0, 1.0)):
        rows.append({"item": item, "target": "t", "ape": {"native": [0.9, 1.0]},
                     "text": {"no_context": _result(0.0, 3.0, 0.1), "direct": _result(1.0, None, 4.0)},
                     "settings": {"none": {"native_cache": _result(native_none, 0.5, 0.5)},
                                  "source 20%": {"native_cache": _result(native_src, 0.1, 1.0, recomputed=20)}}})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(tmp_path)
    cells = {(e["path"], e["setting"]): e for e in summary["table"]}
    assert cells[("native_cache", "none")]["f1_retention"]["value"] == pytest.approx(0.5)
    src = cells[("native_cache", "source 20%")]
    assert src["f1_retention"]["value"] == 1.0 and src["recomputed_share"] == pytest.approx(0.2)
    assert src["speedup_vs_direct"] == pytest.approx(4.0) and src["kl"] == pytest.approx(0.1)
    assert cells[("no_context", "–")]["f1"] == 0.0
    text = render(summary)
    assert "| t | native_cache | source 20% | 2 | 1.00 |" in text and "[0.9, 1.0]" in text


def test_the_top_chunk_baseline_and_retrieval_rates_are_reported_when_every_row_has_them(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"command": "c", "date": "d", "host": {}, "dataset": "kb", "n": 2,
                                                   "source": "s", "settings": ["none"], "top_k": 4,
                                                   "max_new_tokens": 16}))
    rows = [{"item": f"q{i}", "target": "t", "ape": {}, "answer_in": {"top_chunk": top, "hits": True},
             "text": {"no_context": _result(0.0, 3.0, 0.1), "direct": _result(1.0, None, 4.0),
                      "direct_top1": _result(f1, 0.2, 1.0)},
             "settings": {"none": {"native_cache": _result(1.0, 0.5, 0.5)}}}
            for i, (top, f1) in enumerate(((True, 1.0), (False, 0.0)))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(tmp_path)
    top1 = {e["path"]: e for e in summary["table"]}["direct_top1"]
    assert top1["f1_retention"]["value"] == pytest.approx(0.5) and top1["speedup_vs_direct"] == pytest.approx(4.0)
    assert summary["retrieval"] == {"t": {"top_chunk": 0.5, "hits": 1.0}}
    assert "in the top chunk for 50% of questions, in the top-4 for 100%" in render(summary)


def test_settings_sort_by_ratio_with_no_repair_first_and_first_k_last():
    labels = ["first_k k=16", "retriever 30%", "deviation 5%", "none", "source 10%", "deviation 10%",
              "none γ=1", "deviation 10% γ=1"]
    assert sorted(labels, key=setting_order) == ["none", "deviation 5%", "deviation 10%", "source 10%",
                                                 "retriever 30%", "first_k k=16", "none γ=1", "deviation 10% γ=1"]


def test_a_setting_added_by_a_later_pass_is_scored_on_its_rows_against_the_direct_ttft_beside_it(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"command": "c", "date": "d", "host": {}, "dataset": "kb", "n": 2,
                                                   "source": "s", "settings": ["none", "source 5%"], "top_k": 4,
                                                   "max_new_tokens": 16}))
    first = {"item": "q1", "target": "t", "ape": {},
             "text": {"no_context": _result(0.0, 3.0, 0.1), "direct": _result(1.0, None, 4.0)},
             "settings": {"none": {"native_cache": _result(0.0, 0.5, 0.5)}}}
    # The later pass rewrites q1's row with the new setting and its own direct TTFT; q2 never got it.
    later = json.loads(json.dumps(first))
    later["settings"]["source 5%"] = {"native_cache": _result(1.0, 0.1, 1.0, recomputed=5)}
    later["direct_ttft_by_setting"] = {"source 5%": 2.0}
    q2 = dict(json.loads(json.dumps(first)), item="q2")
    q2["settings"]["none"]["native_cache"] = _result(1.0, 0.5, 0.5)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (first, q2, later)))
    cells = {(e["path"], e["setting"]): e for e in summarize(tmp_path)["table"]}
    assert cells[("native_cache", "none")]["n"] == 2  # q1 counted once: its later row replaced the first
    assert cells[("native_cache", "none")]["f1_retention"]["value"] == pytest.approx(0.5)
    added = cells[("native_cache", "source 5%")]
    assert added["n"] == 1 and added["f1_retention"]["value"] == 1.0
    assert added["speedup_vs_direct"] == pytest.approx(2.0)  # 2.0 s beside it, not the first pass's 4.0 s
    assert cells[("native_cache", "none")]["speedup_vs_direct"] == pytest.approx(8.0)


def test_the_grid_report_puts_every_set_and_target_in_one_table(tmp_path):
    for dataset, target in (("synthetic-kb", "a"), ("essay-qa", "b")):
        d = tmp_path / dataset
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"command": f"run {dataset}", "date": "d", "host": {},
                                                "dataset": dataset, "n": 1, "source": "s", "settings": ["none"],
                                                "top_k": 4, "max_new_tokens": 16}))
        row = {"item": "q", "target": target, "ape": {},
               "text": {"no_context": _result(0.0, 3.0, 0.1), "direct": _result(1.0, None, 4.0)},
               "settings": {"none": {"native_cache": _result(1.0, 0.5, 0.5)}}}
        (d / "results.jsonl").write_text(json.dumps(row) + "\n")
    text = grid_report(tmp_path, ["synthetic-kb", "essay-qa", "needle"])
    assert "| path | repair | synthetic-kb · a | essay-qa · b |" in text
    assert "| native_cache | none | 1.00 · 8.0× | 1.00 · 8.0× |" in text
    assert "`run essay-qa`" in text and (tmp_path / "README.md").read_text() == text


def test_a_later_pass_measures_only_the_settings_a_question_lacks(tmp_path, monkeypatch):
    """The grid on a tiny model: a second command with one more ratio adds that setting to every measured
    question (direct context measured again beside it), keeps the first pass's, and a third run of the
    same command measures nothing."""
    import functools

    import eval.repair_ablation as ra
    from eval.run import build_eval_store
    from tests.stores.test_build import HashEmbedder
    from tests.unit.test_context import saved
    from tests.unit.test_harness import Doc, Item

    model = str(saved(tmp_path, "llama"))
    docs = tuple(Doc(f"d{i}", f"Document {i} says the tower of Velm{i} is built of stone number {i}. " * 3)
                 for i in range(3))
    items = [Item(f"q{i}", f"What is the tower of Velm{i} built of?", (f"stone number {i}",), docs,
                  meta={"dataset": "toy"}) for i in range(2)]
    monkeypatch.setattr(ra, "load_items", lambda dataset, limit, args=None: items)
    monkeypatch.setattr(ra, "build_eval_store", functools.partial(build_eval_store, embedder=HashEmbedder()))
    monkeypatch.setattr(ra, "CachedContext", functools.partial(ra.CachedContext, embedder=HashEmbedder(),
                                                               dtype="float32"))
    argv = ["--dataset", "toy", "--targets", model, "--source", model, "--method", "none", "--selectors",
            "deviation", "--first-k", "0", "--max-new-tokens", "3", "--chunk-tokens", "32", "--out", str(tmp_path / "out"),
            "--store-root", str(tmp_path / "stores")]
    results = tmp_path / "out" / "toy" / "results.jsonl"
    ra.main([*argv, "--ratios", "0.5"])
    first = ra._rows(results)
    assert len(results.read_text().splitlines()) == 2
    assert all(set(r["settings"]) == {"none", "deviation 50%"} for r in first.values())
    ra.main([*argv, "--ratios", "0.25", "0.5"])
    later = ra._rows(results)
    assert len(results.read_text().splitlines()) == 4  # each question's row rewritten once
    for key, row in later.items():
        assert set(row["settings"]) == {"none", "deviation 25%", "deviation 50%"}
        assert row["settings"]["none"] == first[key]["settings"]["none"]  # kept, not measured again
        assert row["text"] == first[key]["text"]
        assert set(row["direct_ttft_by_setting"]) == {"none", "deviation 25%", "deviation 50%"}
        assert row["settings"]["deviation 25%"]["native_cache"]["recomputed_tokens"] > 0
    ra.main([*argv, "--ratios", "0.25", "0.5"])
    assert len(results.read_text().splitlines()) == 4
    run = json.loads((tmp_path / "out" / "toy" / "run.json").read_text())
    assert len(run["history"]) == 2 and run["settings"] == ["none", "deviation 25%", "deviation 50%"]
    assert "| native_cache | deviation 25% |" in (tmp_path / "out" / "toy" / "ablation.md").read_text()
    assert all(r["item_sha"] for r in ra._rows(results).values())
    # the same ids for other questions (a generator's arguments changed): refused before anything is measured
    import dataclasses

    changed = [dataclasses.replace(i, question=i.question + " Since when?") for i in items]
    monkeypatch.setattr(ra, "load_items", lambda dataset, limit, args=None: changed)
    with pytest.raises(SystemExit, match="rows of other items under the ids q0, q1"):
        ra.main([*argv, "--ratios", "0.25", "0.5", "0.75"])
    assert len(results.read_text().splitlines()) == 4
    assert len(json.loads((tmp_path / "out" / "toy" / "run.json").read_text())["history"]) == 2
