"""The router on the real models: a smollm2-135m store, qwen2.5-0.5b as the large model.

Three short documents; the question asks for a made-up name only one of them holds.
The thresholds are forced (±inf), so the test does not depend on the calibrated policy
file: escalated, the large model must find the fact through whatever path its gate
serves; a follow-up prefills no context.
"""

from __future__ import annotations

import math
import warnings

import pytest

pytestmark = pytest.mark.integration

SMALL, LARGE = "smollm2-135m", "qwen2.5-0.5b"
FACT = "Wendeline Marsk"
QUESTION = "Who is the ferry pilot of Osterholm?"
DOCUMENTS = [
    ("ferry.txt", f"Osterholm ferry notes. The ferry pilot of Osterholm is {FACT}. She has crossed the "
                  "strait twice a day for eleven years and keeps a brass compass on the bridge."),
    ("market.txt", "The Saturday market on the quay sells smoked fish, wool and apples. Stalls open at "
                   "seven, and the fishmonger closes first, by noon."),
    ("school.txt", "The island school has forty pupils and one bus. Lessons end at three, and the "
                   "library stays open until five on weekdays."),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from cag.models import registry
    from stores.build import build_store

    path = tmp_path_factory.mktemp("router-real") / "store"
    build_store(DOCUMENTS, path, registry.load(SMALL, "bfloat16"), chunk_tokens=128)
    return path


def test_router_escalates_reuses_the_hits_and_follows_up_without_prefill(store):
    from cag import Router, RouterPolicy

    up = Router(store=store, large=LARGE, policy=RouterPolicy(threshold=math.inf), top_k=2, max_new_tokens=12)
    assert up.small_context.target_model_name == SMALL  # small=None: the store's source model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gate's reason, when it serves direct context
        first = up.answer(QUESTION)
    assert first.route == "large" and first.large_path in ("translated", "translated+repair", "direct"), first.route_info()
    assert FACT.split()[-1] in first.text, first.route_info() | {"text": first.text}
    assert "ferry.txt" in [h.doc_id for h in first.sources]
    assert first.small_ttft_s > 0 and first.large_ttft_s > 0 and first.ttft_s >= first.small_total_s
    follow = up.follow_up("What does the pilot keep on the bridge?")
    assert follow.context_prefill_tokens == 0 and follow.route == "large"
    assert [h.key for h in follow.sources] == [h.key for h in first.sources]
    if first.large_path == "direct":  # the first turn prefilled the text; the follow-up did not
        assert first.context_prefill_tokens > first.context_tokens > 0
        assert follow.large_ttft_s < first.large_ttft_s

    down = Router(store=store, large=LARGE, policy=RouterPolicy(threshold=-math.inf), top_k=2,
                  max_new_tokens=12)
    small = down.answer(QUESTION)
    assert small.route == "small" and small.large_ttft_s is None and small.path == "native"
    assert small.small_answer == first.small_answer and small.confidence == pytest.approx(first.confidence)
    assert small.context_prefill_tokens == 0  # the small model's own chunk caches: nothing prefilled
