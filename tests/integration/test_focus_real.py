"""Focus on the real packaged models: the plain translated path into Qwen2.5 copies a calibration code that a
whole 4K haystack of translated chunks drowns (eval/results/focus/: "JW109" for JPT9W with every chunk read)."""

from __future__ import annotations

import pytest

from cag.context import CachedContext
from cag.models import registry
from eval.diagnose_length import needles
from eval.metrics import contains_answer
from eval.run import build_eval_store

pytestmark = pytest.mark.integration


def test_the_translated_path_reads_the_needles_chunks_and_copies_the_code(tmp_path, monkeypatch):
    """With the first-token rules of the eighteenth session (the code start only): since the nineteenth session's
    rules the pointer reads the retriever's best sentence, and the whole haystack finds this code too."""
    import cag.copy_prior

    monkeypatch.setattr(cag.copy_prior, "pointer_rules", lambda fingerprint_id: cag.copy_prior.PointerRules(
        code_start=True))
    item = needles(4096, 12, registry.load("qwen2.5-0.5b", "auto").tokenizer, material="codes")[7]
    assert list(item.answers) == ["JPT9W"]         # calibration material: a held-out lab essay, never evaluated
    build_eval_store([item], tmp_path / "store", "smollm2-135m", chunk_tokens=256)
    answers = {}
    for budget in (0, None):                       # every chunk, then the calibrated budget
        ctx = CachedContext(store=tmp_path / "store", target="qwen2.5-0.5b", mapper="bottleneck", min_retention=0.0,
                            max_new_tokens=16, translation_cache_mb=0, copy_prior=0.5, translated_focus_tokens=budget)
        hits = ctx.document_hits([d.id for d in item.documents])
        with pytest.warns(UserWarning):            # the gate is off (and focus, where it reads less, says so)
            answer = ctx.answer(item.question, hits)
        assert answer.path == "translated"
        answers[budget] = answer
    whole, focused = answers[0], answers[None]
    assert len(whole.sources) == len(hits) > 15 and whole.context_tokens > 3500
    assert len(focused.sources) < len(hits) and focused.context_tokens <= 1024
    assert any("chunks" in w and "translated_focus_tokens=1024" in w for w in focused.warnings)
    assert "JPT9W" not in whole.text and "JPT9W" in focused.text, (whole.text, focused.text)


def test_the_first_token_rules_start_and_end_word_codes_right(tmp_path, monkeypatch):
    """The first-token rules chosen for Qwen2.5 (cag/pointer_heads.json; eval/results/focus/qwen-wordcodes,
    eval/results/sentence_pointer): without any, the plain path answers "67-lemon" for cedar-67-lemon; with the
    code start alone (the eighteenth session's), "Quoumsum botanical garden" for pepper-cedar-63; without end stops,
    "lemon-canyon-90.90.90.90" for lemon-canyon-90, whose needle closes its chunk (and its best sentence: since the
    twentieth session the sentence stops end it there too, so both are off)."""
    import cag.copy_prior
    from cag.copy_prior import PointerRules

    tokenizer = registry.load("qwen2.5-0.5b", "auto").tokenizer
    items = [needles(1024, 24, tokenizer, material="wordcodes")[i] for i in (4, 19, 10)]
    assert [list(i.answers) for i in items] == [["cedar-67-lemon"], ["pepper-cedar-63"], ["lemon-canyon-90"]]
    build_eval_store(items, tmp_path / "store", "smollm2-135m", chunk_tokens=256)   # calibration: held-out essays
    served = cag.copy_prior.pointer_rules(registry.load("qwen2.5-0.5b", "auto").fingerprint.id)
    assert served == PointerRules(sentences=1, skip_question=True, wrapped=True, sentence_stops=True,
                                  code_start=True, anchor=True, end_stops=True)

    def answer(item, rules: PointerRules) -> str:
        monkeypatch.setattr(cag.copy_prior, "pointer_rules", lambda fingerprint_id: rules)
        ctx = CachedContext(store=tmp_path / "store", target="qwen2.5-0.5b", mapper="bottleneck", min_retention=0.0,
                            max_new_tokens=16, translation_cache_mb=0, copy_prior=0.5)
        with pytest.warns(UserWarning):
            return ctx.answer(item.question, ctx.document_hits([d.id for d in item.documents])).text

    from dataclasses import replace

    for item, without in zip(items, (PointerRules(), PointerRules(code_start=True),
                                          replace(served, end_stops=False, sentence_stops=False))):
        got, missed = answer(item, served), answer(item, without)
        assert contains_answer(got, item.answers) and not contains_answer(missed, item.answers), (got, missed)


def test_sentence_stops_end_a_word_code_at_its_sentences_full_stop(tmp_path, monkeypatch):
    """The twentieth session's sentence stops (eval/results/sentence_pointer, "t"): without them the answer to
    canyon-otter-54 runs on into the essay, "canyon-otter-54. coffee with a friend matters"."""
    import cag.copy_prior
    from dataclasses import replace

    model = registry.load("qwen2.5-0.5b", "auto")
    item = needles(1024, 24, model.tokenizer, material="wordcodes")[8]
    assert list(item.answers) == ["canyon-otter-54"]
    build_eval_store([item], tmp_path / "store", "smollm2-135m", chunk_tokens=256)   # calibration: held-out essay
    served = cag.copy_prior.pointer_rules(model.fingerprint.id)
    texts = {}
    for stops in (True, False):
        monkeypatch.setattr(cag.copy_prior, "pointer_rules",
                            lambda fingerprint_id, stops=stops: replace(served, sentence_stops=stops))
        ctx = CachedContext(store=tmp_path / "store", target="qwen2.5-0.5b", mapper="bottleneck", min_retention=0.0,
                            max_new_tokens=16, translation_cache_mb=0, copy_prior=0.5)
        with pytest.warns(UserWarning):
            texts[stops] = ctx.answer(item.question, ctx.document_hits([d.id for d in item.documents])).text.strip()
    assert texts[True] == "canyon-otter-54.", texts
    assert texts[False].startswith("canyon-otter-54.") and len(texts[False]) > len(texts[True]) + 5, texts
