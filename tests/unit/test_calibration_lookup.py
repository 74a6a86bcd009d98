"""Calibration-side lookup items: reproducible, well-formed, and disjoint from every evaluation set."""

import re

import pytest

from eval import datasets as ds
from eval.calibration_lookup import _FACTS, calibration_lookup, calibration_needles


def names(text):
    return {w.strip(".,?") for w in text.split() if w[:1].isupper()}


def test_reproducible_from_the_seed():
    a, b = calibration_lookup(seed=3), calibration_lookup(seed=3)
    assert [i.to_json() for i in a] == [i.to_json() for i in b]
    assert [i.to_json() for i in a] != [i.to_json() for i in calibration_lookup(seed=4)]
    assert [i.to_json() for i in calibration_needles(seed=1)] == [i.to_json() for i in calibration_needles(seed=1)]


def test_each_answer_is_in_its_gold_document_and_distractors_exist():
    items = calibration_lookup()
    assert len(items) == 60
    docs = {d.id: d.text for d in items[0].documents}
    for item in items:
        assert item.answers[0] in docs[item.meta["gold_doc"]], item
    assert sum(i.meta["n_distractors_same_fact"] > 0 for i in items) > 40


def test_disjoint_from_evaluation_sets():
    calib_text = " ".join(d.text for d in calibration_lookup()[0].documents)
    calib_questions = {i.question for i in calibration_lookup()}
    for seed in range(3):
        kb = ds.synthetic_kb(seed=seed)
        kb_text = " ".join(d.text for d in kb[0].documents)
        shared = (names(calib_text) & names(kb_text)) - {"The", "Its", "It", "Her", "Today", "Comet"}
        assert not shared, shared
        assert not calib_questions & {i.question for i in kb}
    # No calibration question template is a synthetic-kb or needle template.
    kb_templates = set(ds._QUESTIONS.values()) | {q for _, q, _ in ds._NEEDLE_TEMPLATES}
    assert not kb_templates & {q for _, q in _FACTS.values()}
    # Needles are planted in calibration essays only: never in an essay the evaluation reads.
    evaluation = " ".join(ds.normalize_ws(ds.essay_text(e)) for e in ds.evaluation_essays())
    for item in calibration_needles(n=4):
        window = item.documents[0].text
        planted = next(s for s in re.split(r"(?<=\.) ", window) if item.answers[0] in s)
        assert planted not in evaluation


def test_code_needles_reproducible_exact_and_disjoint_from_evaluation():
    from eval.calibration_lookup import _CODE_FACTS, calibration_code_needles

    a = calibration_code_needles(seed=2, n=12)
    assert [i.to_json() for i in a] == [i.to_json() for i in calibration_code_needles(seed=2, n=12)]
    assert [i.to_json() for i in a] != [i.to_json() for i in calibration_code_needles(seed=3, n=12)]
    # Every format equally often, one exact answer each, planted once in its window with its subject named.
    assert sorted(i.meta["fact_type"] for i in a) == sorted(list(_CODE_FACTS) * 2)
    for item in a:
        (answer,) = item.answers
        text = item.documents[0].text
        assert text.count(answer) == 1
        planted = next(s for s in re.split(r"(?<=\.) ", text) if answer in s)
        name = next(w for w in item.question.rstrip("?").split()[1:] if w[:1].isupper() and w not in ("Comet", "Hut"))
        assert name in planted, (planted, item.question)
    # Own templates and values: no evaluation template, no evaluation needle word, no synthetic-kb name.
    evaluation_templates = set(ds._QUESTIONS.values()) | {q for _, q, _ in ds._NEEDLE_TEMPLATES}
    assert not evaluation_templates & {q for _, q in _CODE_FACTS.values()}
    values = " ".join(i.answers[0].lower() for i in calibration_code_needles(n=60))
    assert not set(re.findall(r"[a-z]+", values)) & set(ds._NEEDLE_WORDS)
    kb_names = {n.lower() for seed in range(3) for n in names(" ".join(d.text for d in ds.synthetic_kb(seed=seed)[0].documents))}
    assert not set(re.findall(r"[a-z]+", values)) & kb_names


def test_word_code_needles_reproducible_exact_and_disjoint_from_evaluation():
    from eval.calibration_lookup import _CODE_WORDS, _WORD_CODE_FACTS, calibration_word_code_needles

    a = calibration_word_code_needles(seed=2, n=9)
    assert [i.to_json() for i in a] == [i.to_json() for i in calibration_word_code_needles(seed=2, n=9)]
    assert sorted(i.meta["fact_type"] for i in a) == sorted(list(_WORD_CODE_FACTS) * 3)
    for item in a:
        (answer,) = item.answers
        assert item.documents[0].text.count(answer) == 1
        parts = answer.split("-")
        assert len(parts) == 3 and sum(p.isdigit() for p in parts) == 1 and set(parts) - {p for p in parts
                                                                                         if p.isdigit()} <= set(_CODE_WORDS)
    evaluation_templates = set(ds._QUESTIONS.values()) | {q for _, q, _ in ds._NEEDLE_TEMPLATES}
    assert not evaluation_templates & {q for _, q in _WORD_CODE_FACTS.values()}
    assert not set(_CODE_WORDS) & set(ds._NEEDLE_WORDS)
    assert not any("passphrase" in t or "opens" in t for ts, q in _WORD_CODE_FACTS.values() for t in [*ts, q])


def test_length_needles_by_material_come_from_the_held_out_essays(tiny):
    from eval.diagnose_length import needles
    from eval.lab.data import held_out_essays

    facts = needles(1024, 4, tiny.tokenizer)
    codes = needles(1024, 4, tiny.tokenizer, material="codes")
    assert [i.to_json() for i in codes] == [i.to_json() for i in needles(1024, 4, tiny.tokenizer, material="codes")]
    assert {i.meta["dataset"] for i in facts} == {"calib-lookup-needle"}
    assert {i.meta["dataset"] for i in codes} == {"calib-lookup-code-needle"}
    held = " ".join(ds.normalize_ws(ds.essay_text(e)) for e in held_out_essays())
    for item in codes:
        assert " ".join(item.documents[0].text.split(" ")[:8]) in held  # the window before the planted fact
    with pytest.raises(KeyError):
        needles(1024, 1, tiny.tokenizer, material="passphrases")


def test_the_key_correction_fits_on_lookups_no_gate_or_calibration_seed_reads():
    """`fit_key_correction.py --lookups N`: retrieve-mode items from pools of their own (seeds 700+),
    never the gate's (0), APE's and γ's (1), the repair ablation's (2) or the source heads' (3)."""
    from eval.fit_key_correction import training_lookups

    items = training_lookups(60)
    assert len(items) == 60 and all(it.context == "retrieve" for it in items)
    assert {it.id.split("-")[2] for it in items} == {"s700", "s701"}   # 48 a pool, then the next
    fitted = {d.text for it in items for d in it.documents}
    for seed in range(4):
        assert not fitted & {d.text for d in calibration_lookup(seed=seed)[0].documents}
