"""The copy prior on the real packaged models: the plain translated path into Qwen2.5 spells a calibration
lookup's invented name (eval/results/copy_prior/: without the prior it answered "Skuske Quolubou")."""

from __future__ import annotations

import pytest

from cag.context import CachedContext
from eval.calibration_lookup import calibration_lookup
from eval.run import build_eval_store

pytestmark = pytest.mark.integration


def test_the_copy_prior_spells_the_name_the_translated_cache_finds(tmp_path):
    item = calibration_lookup(seed=0)[1]          # the gate's second lookup: "Skuske Repoziv"
    build_eval_store([item], tmp_path / "store", "smollm2-135m", chunk_tokens=256)
    answers = {}
    for weight in (0.0, 0.5):
        # The pointer may land on the question's words here: with them left out, as served since the nineteenth
        # session, this lookup is one of the two the gate's items lose ("its warden", eval/results/sentence_pointer).
        ctx = CachedContext(store=tmp_path / "store", target="qwen2.5-0.5b", mapper="bottleneck", min_retention=0.0,
                            max_new_tokens=16, translation_cache_mb=0, copy_prior=weight, pointer_skips_question=False)
        hits = ctx.retrieve(item.question, doc_ids=[d.id for d in item.documents])
        with pytest.warns(UserWarning):           # the gate is off: the answer says so
            answer = ctx.answer(item.question, hits)
        assert answer.path == "translated"
        answers[weight] = answer.text
    assert "Skuske Repoziv" in answers[0.5], answers
