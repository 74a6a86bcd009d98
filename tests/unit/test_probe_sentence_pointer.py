"""eval/probe_sentence_pointer.py's bookkeeping: the ablation table over several runs' rows, paired per item."""

import json

import pytest

from eval.probe_sentence_pointer import ablation, main


def rows(path, items):
    path.mkdir()
    lines = [json.dumps({"part": part, "item": item, "answers": ["x"],
                         "by_k": {k: {"answer": "", "found": f, "f1": f} for k, f in found.items()}})
             for part, item, found in items]
    (path / "rows.jsonl").write_text("\n".join(lines) + "\n")


def test_the_ablation_counts_found_per_part_and_pairs_each_step(tmp_path):
    rows(tmp_path / "a", [("lookups", "i1", {"0": 1, "1qae": 0}), ("lookups", "i2", {"0": 0, "1qae": 1}),
                          ("lookups", "i1", {"0": 1, "1qae": 1})])          # a rerun's row: the last one wins
    rows(tmp_path / "b", [("codes@1024", "n1", {"0": 0, "1qae": 1}), ("codes@1024", "n2", {"0": 1})])  # no 1qae
    table = ablation([tmp_path / "a", tmp_path / "b"], ["0", "1qae"], [("0", "1qae")])
    assert "| lookups | 2 | 1 | 2 |" in table
    assert "| codes@1024 | 1 | 0 | 1 |" in table                           # n2 lacks a variant: left out
    assert "| all | 3 | 1 | 3 |" in table
    assert "| F1 (mean, all) | 3 | 0.333 | 1.000 |" in table
    assert "| 0 → 1qae | 2 | 0 |" in table


def test_unknown_variant_letters_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--sentences", "0", "1cqae", "--out", str(tmp_path)])         # the retired chunk scope
    with pytest.raises(SystemExit):
        main(["--sentences", "0", "1qae@x", "--out", str(tmp_path)])        # a weight is a number
    with pytest.raises(SystemExit):
        main(["--sentences", "0"])                                           # a run needs --out


def test_a_variant_sets_the_served_rules_it_names_and_restores_them(tmp_path):
    import cag.copy_prior
    from eval.probe_sentence_pointer import rules_as

    chosen = tmp_path / "rules.json"
    chosen.write_text(json.dumps({"fp": {"model": "m", "head": [1, 0], "weight": 0.4, "sentences": 1,
                                         "anchor": True, "wrapped": True, "sentence_stops": True}}))
    served = cag.copy_prior.pointer_rules
    with rules_as(wrapped=False, sentence_stops=False):
        inside = cag.copy_prior.pointer_rules("fp", chosen)
    assert cag.copy_prior.pointer_rules is served
    assert inside == cag.copy_prior.PointerRules(sentences=1, anchor=True)   # the rest as served
    assert served("fp", chosen).wrapped and served("fp", chosen).sentence_stops


def test_the_uniform_pointer_control_keeps_the_words_and_evens_their_mass(monkeypatch):
    import cag.copy_prior
    from eval.probe_sentence_pointer import uniform_pointer

    monkeypatch.setattr(cag.copy_prior, "pointer_starts", lambda *a, **k: {"cedar": 0.9, "the": 0.05, "x": 0.05})
    served = cag.copy_prior.pointer_starts
    with uniform_pointer(True):
        assert cag.copy_prior.pointer_starts() == {"cedar": 1 / 3, "the": 1 / 3, "x": 1 / 3}
    assert cag.copy_prior.pointer_starts is served
    with uniform_pointer(False):
        assert cag.copy_prior.pointer_starts is served                       # no control: the head's masses
