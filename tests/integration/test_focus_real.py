"""Focus on the real packaged models: the plain translated path into Qwen2.5 copies a calibration code that a
whole 4K haystack of translated chunks drowns (eval/results/focus/: "JW109" for JPT9W with every chunk read)."""

from __future__ import annotations

import pytest

from cag.context import CachedContext
from cag.models import registry
from eval.diagnose_length import needles
from eval.run import build_eval_store

pytestmark = pytest.mark.integration


def test_the_translated_path_reads_the_needles_chunks_and_copies_the_code(tmp_path):
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


def test_the_translated_path_enters_a_word_code_at_its_start(tmp_path, monkeypatch):
    """The code start (cag.copy_prior, on for Qwen2.5 in pointer_heads.json): without it the plain path answers
    "67-lemon" for cedar-67-lemon (eval/results/focus/qwen-wordcodes)."""
    import cag.copy_prior

    item = needles(1024, 24, registry.load("qwen2.5-0.5b", "auto").tokenizer, material="wordcodes")[4]
    assert list(item.answers) == ["cedar-67-lemon"]   # calibration material: a held-out lab essay
    build_eval_store([item], tmp_path / "store", "smollm2-135m", chunk_tokens=256)

    def answer() -> str:
        ctx = CachedContext(store=tmp_path / "store", target="qwen2.5-0.5b", mapper="bottleneck", min_retention=0.0,
                            max_new_tokens=16, translation_cache_mb=0, copy_prior=0.5)
        with pytest.warns(UserWarning):
            return ctx.answer(item.question, ctx.document_hits([d.id for d in item.documents])).text

    served = answer()
    monkeypatch.setattr(cag.copy_prior, "code_start", lambda fingerprint_id: False)
    assert "cedar-67-lemon" in served and "cedar-67-lemon" not in answer(), served
