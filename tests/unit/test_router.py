"""The router (#13) on tiny models: it escalates exactly when the policy says, records both
timings, reuses one retrieval, and a follow-up prefills no context and reads what a fresh query reads."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from cag import router as router_mod
from cag.gate import GateError
from cag.generate import generate, last_logits, stop_token_ids
from cag.models import registry
from cag.router import Confidence, Router, RouterPolicy, RouterPolicyError, greedy_decode
from mappers.fit import fit_mapper
from stores.build import build_store
from tests.mappers.conftest import TEXTS
from tests.stores.test_build import HashEmbedder, doc
from tests.unit.test_context import saved

QUESTIONS = ["Zorblat maps?", "tower of Velmora", "archivist keeps maps", "quick brown fox",
             "Where are the letters?", "What did Idris write?"]


@pytest.fixture(scope="module")
def kb(tmp_path_factory):
    """A tiny qwen2 store (the small model's own chunks), a tiny llama as the large model and a
    ridge mapper between them (so the large model has a translated path)."""
    root = tmp_path_factory.mktemp("router")
    small, large = saved(root, "qwen2"), saved(root, "llama")
    small_lm, large_lm = registry.load(str(small), "float32"), registry.load(str(large), "float32")
    build_store([(f"doc{i}", doc(i, paragraphs=2)) for i in range(4)], root / "store", small_lm,
                chunk_tokens=32, embedder=HashEmbedder())
    fit_mapper(small_lm, large_lm, "ridge", TEXTS, root / "mapper", progress=False, fidelity_texts=2,
               batch_size=4)
    return root, small, large


def make(kb, threshold=0.0, metric="mean_logprob", **kw):
    root, small, large = kb
    kw.setdefault("min_retention", 0.0)  # tiny models have no measured fidelity: consent to the translated path
    kw.setdefault("policy", RouterPolicy(metric=metric, threshold=threshold))
    return Router(store=root / "store", small=str(small), large=str(large), mapper=str(root / "mapper"),
                  embedder=HashEmbedder(), dtype="float32", max_new_tokens=6, top_k=3, **kw)


def confidences(kb, metric="mean_logprob"):
    router = make(kb, threshold=-math.inf, metric=metric)
    return {q: router.answer(q).confidence for q in QUESTIONS}


def test_forced_routes_and_both_timings(kb):
    small = make(kb, threshold=-math.inf).answer("Zorblat maps?")
    assert small.route == "small" and small.large_ttft_s is None and small.large_path is None
    assert small.text == small.small_answer and small.path == "native" and small.mapper == "identity"
    assert 0 < small.small_ttft_s <= small.small_total_s <= small.ttft_s
    large = make(kb, threshold=math.inf).answer("Zorblat maps?")
    assert large.route == "large" and large.large_path == "translated" and large.path == "translated"
    assert large.small_answer == small.small_answer and large.confidence == small.confidence
    assert large.large_ttft_s > 0 and large.small_ttft_s > 0
    # the served answer comes after the whole small answer and the large model's first token
    assert large.ttft_s >= large.small_total_s + large.large_ttft_s - 1e-3
    assert large.timings.first_token == large.ttft_s and large.timings.total >= large.ttft_s
    assert [h.key for h in large.sources] == [h.key for h in small.sources]  # the same hits, once retrieved
    json.dumps(large.to_dict())  # serialisable as `cag query --json` would print it


@pytest.mark.parametrize("metric", ["mean_logprob", "neg_entropy"])
def test_escalates_exactly_below_the_threshold(kb, metric):
    conf = confidences(kb, metric)
    values = sorted(set(conf.values()))
    assert len(values) >= 2, f"the tiny model gives one confidence for every question: {conf}"
    low, high = values[0], values[-1]
    cut = (low + high) / 2
    router = make(kb, threshold=cut, metric=metric)
    for q, c in conf.items():
        routed = router.answer(q)
        assert routed.confidence == pytest.approx(c)
        assert routed.route == ("large" if c < cut else "small"), (q, c, cut)
    # at the threshold itself the small answer is served (escalate only when strictly below)
    q_high = next(q for q, c in conf.items() if c == high)
    assert make(kb, threshold=high, metric=metric).answer(q_high).route == "small"
    assert make(kb, threshold=math.nextafter(high, math.inf), metric=metric).answer(q_high).route == "large"


def test_confidence_records_both_metrics():
    conf = Confidence.of_decoded(router_mod.Decoded(token_ids=[5, 6], logprobs=[-0.5, -1.5],
                                                    entropies=[1.0, 2.0, 3.0, 4.0, 9.0]))
    assert conf.mean_logprob == -1.0 and conf.neg_entropy == -2.5 and conf.tokens == 2
    empty = Confidence.of_decoded(router_mod.Decoded(entropies=[0.1]))  # stopped at once
    assert empty.mean_logprob == -math.inf and empty.neg_entropy == pytest.approx(-0.1)
    assert RouterPolicy(threshold=-1.0).escalates(empty)  # an empty answer is never trusted
    with pytest.raises(ValueError):
        conf.of("max_prob")
    with pytest.raises(ValidationError):
        RouterPolicy(threshold=float("nan"))


def test_greedy_decode_is_the_library_loop(kb):
    """The router's decode (with log-probs) picks the same tokens as cag.generate on the same cache."""
    router = make(kb)
    ctx = router.small_context
    lm = ctx.target_model
    hits = ctx.retrieve("tower of Velmora")
    a = ctx.prepare("tower of Velmora", hits, max_new_tokens=6)
    b = ctx.prepare("tower of Velmora", hits, max_new_tokens=6)
    steps = greedy_decode(lm.model, lm.tokenizer, a.cache, a.question_ids, max_new_tokens=6,
                          stop_ids=stop_token_ids(lm.tokenizer))
    pieces = []
    try:
        while True:
            pieces.append(next(steps).text)
    except StopIteration as stop:
        dec = stop.value
    ref = generate(lm.model, lm.tokenizer, b.cache, b.question_ids, max_new_tokens=6,
                   stop_ids=stop_token_ids(lm.tokenizer))
    assert dec.token_ids == ref.token_ids and dec.text == ref.text == "".join(pieces)
    assert len(dec.logprobs) == len(dec.token_ids) and all(lp <= 0 for lp in dec.logprobs)


def _fresh_logits(ctx, question, hits):
    prepared = ctx.prepare(question, hits, max_new_tokens=6)
    lm = ctx.target_model
    with torch.inference_mode():
        return last_logits(lm.model, prepared.question_ids[None], prepared.cache)[-1].float()


def test_follow_up_prefills_no_context_and_reads_what_a_fresh_query_reads(kb):
    router = make(kb, threshold=math.inf, recompute_ratio=0.5)  # both models; the large one recomputes
    first = router.answer("Zorblat maps?")
    assert first.route == "large" and first.context_prefill_tokens > 0  # the recomputed tokens
    kept = router._conversation
    lengths = (kept.small.cache.get_seq_length(), kept.large.cache.get_seq_length())
    follow = router.follow_up("tower of Velmora")
    assert follow.follow_up and follow.context_prefill_tokens == 0
    assert follow.small_timings.load == follow.small_timings.translate == 0.0
    assert follow.large_timings.recompute == 0.0 and follow.large_timings.retrieve == 0.0
    assert [h.key for h in follow.sources] == [h.key for h in first.sources]
    # the kept caches are still the context alone: the questions went into copies
    assert (kept.small.cache.get_seq_length(), kept.large.cache.get_seq_length()) == lengths
    hits = router._conversation.hits
    torch.testing.assert_close(follow.small_decoded.first_logits,
                               _fresh_logits(router.small_context, "tower of Velmora", hits))
    # a fresh large query recomputes chosen by deviation, which does not depend on the question
    torch.testing.assert_close(follow.large_decoded.first_logits,
                               _fresh_logits(router.large_context, "tower of Velmora", hits),
                               atol=1e-4, rtol=1e-4)
    fresh = router.answer("tower of Velmora", hits)
    assert fresh.context_prefill_tokens > 0 and fresh.text == follow.text


def test_gate_sends_the_large_model_to_direct_context_and_follow_up_skips_its_prefill(kb):
    router = make(kb, threshold=math.inf, min_retention=0.6)  # tiny paths are unmeasured: the gate refuses
    with pytest.warns(UserWarning, match="no measured lookup fidelity"):
        first = router.answer("archivist keeps maps")
    assert first.large_path == "direct" and first.path == "direct" and first.condition == "direct"
    head = router.large_context.assembler.prefix_ids.numel()
    assert first.context_prefill_tokens == head + first.context_tokens > head  # the text, prefilled once
    follow = router.follow_up("quick brown fox")
    assert follow.context_prefill_tokens == 0 and follow.large_path == "direct"
    # direct context as CachedContext serves it (one prefill of head, text and question): same reading
    hits = router._conversation.hits
    direct = router.large_context.answer_direct("quick brown fox", hits, max_new_tokens=6)
    assert follow.text == direct.text
    with pytest.raises(GateError, match="quality gate"):
        make(kb, threshold=math.inf, min_retention=0.6, fallback="raise").answer("archivist keeps maps")


def test_a_gated_repair_path_is_served_as_it_was_measured(kb, tmp_path):
    """When the gate picks translated+repair, the large model recomputes the crux with the record's
    settings (not the plain translated path under the +repair label)."""
    import shutil

    from mappers.base import Mapper, write_card

    root, small, large = kb
    mapper = tmp_path / "mapper"
    shutil.copytree(root / "mapper", mapper)
    card = Mapper.read_card(mapper)
    passing = {"found_retention": 0.9, "found_rate": 0.45, "direct_found_rate": 0.5, "no_context_found_rate": 0.1,
               "n": 30, "items": "unit", "repair": {"ratio": 0.25, "select": "first_k"}}
    cheaper = {**passing, "found_retention": 0.2, "found_rate": 0.11, "repair": {"ratio": 0.1, "select": "first_k"}}
    # no plain "lookup" record: that path fails; the cheaper repair setting fails too, so the 25% one serves
    card.setdefault("fidelity", {})["lookup_repair"] = [passing, cheaper]
    write_card(mapper, card)
    from cag.context import CachedContext

    chosen = CachedContext(store=root / "store", target=str(large), mapper=str(mapper), embedder=HashEmbedder(),
                           dtype="float32", min_retention=0.6).decision
    assert chosen.path == "translated+repair" and chosen.fidelity.repair == passing["repair"]
    assert "first_k 10%" in chosen.rejected[-1][1]
    # a caller who fixes the setting is judged on that setting's record alone
    fixed = CachedContext(store=root / "store", target=str(large), mapper=str(mapper), embedder=HashEmbedder(),
                          dtype="float32", min_retention=0.6, recompute_ratio=0.1, recompute_select="first_k")
    assert fixed.decision.path == "direct"
    router = Router(store=root / "store", small=str(small), large=str(large), mapper=str(mapper),
                    embedder=HashEmbedder(), dtype="float32", max_new_tokens=6, top_k=3, min_retention=0.6,
                    policy=RouterPolicy(threshold=math.inf))
    first = router.answer("archivist keeps maps")
    assert first.large_path == "translated+repair" and first.path == "translated+repair"
    assert first.answer.recomputed_tokens > 0  # first_k: the first 16 tokens of every chunk
    assert first.context_prefill_tokens == first.answer.recomputed_tokens
    follow = router.follow_up("quick brown fox")  # the repaired cache is kept: nothing recomputed again
    assert follow.context_prefill_tokens == 0 and follow.large_path == "translated+repair"


def test_the_policy_file(kb, tmp_path, monkeypatch):
    root, small, large = kb
    missing = tmp_path / "router_policy.json"
    monkeypatch.setattr(router_mod, "policy_path", lambda: missing)
    with pytest.raises(RouterPolicyError, match="router_calibrate.py"):
        Router(store=root / "store", small=str(small), large=str(large))
    missing.write_text(json.dumps({"policies": [{"small": "some-other-model", "metric": "mean_logprob",
                                                 "threshold": -1.0}]}))
    router = make(kb, policy=None)
    with pytest.raises(RouterPolicyError, match="some-other-model"):
        router.answer("maps")
    name = router.small_context.target_model_name
    missing.write_text(json.dumps({"policies": [
        {"small": name, "large": "elsewhere", "metric": "neg_entropy", "threshold": 1.0},
        {"small": name, "large": router.large, "metric": "mean_logprob", "threshold": -math.inf}]}))
    router = make(kb, policy=None)
    assert router.active_policy.threshold == -math.inf and router.active_policy.metric == "mean_logprob"
    assert router.answer("maps").route == "small"


def test_bad_set_up(kb):
    root, small, large = kb
    with pytest.raises(ValueError, match="store's source model"):
        Router(store=root / "store", small=str(large), policy=RouterPolicy(threshold=0.0),
               embedder=HashEmbedder(), dtype="float32").answer("maps")
    with pytest.raises(ValidationError, match="not CachedContext settings"):
        make(kb, context_options={"chunk_ordre": "document"})
    with pytest.raises(ValidationError, match="set by the router"):
        make(kb, context_options={"target": "x"})
    with pytest.raises(RuntimeError, match="answer\\(\\) first"):
        make(kb).follow_up("maps")


def test_router_as_llama_index_llm_and_query_engine(kb):
    router = make(kb, threshold=math.inf)
    response = router.as_query_engine(top_k=2).query("Zorblat maps?")
    assert response.metadata["mode"] == "cached"
    route = response.metadata["router"]
    assert route["route"] == "large" and route["large_path"] == "translated" and route["large_ttft_s"] > 0
    assert str(response) == router.last_answer.text and len(response.source_nodes) == 2
    nodes = router.as_retriever().retrieve("tower of Velmora")
    streamed = list(router.as_llm().stream_complete("tower of Velmora", nodes=nodes))
    assert streamed[-1].additional_kwargs["router"]["route"] == "large"
    assert streamed[-1].text == router.last_answer.text


def test_calibration_rule_picks_the_best_threshold_within_the_escalation_cap():
    from eval.router_calibrate import candidates, choose

    def row(lp, ent, small, large):
        return {"confidence": {"mean_logprob": lp, "neg_entropy": ent}, "small_found": small, "large_found": large}

    # the small model is right when confident; the large one fixes the two least confident
    rows = [row(-0.1, -1.0, 1.0, 1.0), row(-0.2, -3.0, 1.0, 0.0), row(-1.5, -2.0, 0.0, 1.0),
            row(-2.5, -0.5, 0.0, 1.0)]
    assert candidates([-1.0, -math.inf, -1.0, 0.0]) == [-math.inf, -1.0, -0.5, math.inf]
    metric, point, best = choose(rows, max_escalation=0.5)
    assert metric == "mean_logprob" and point["found"] == 1.0 and point["escalated"] == 0.5
    assert -1.5 < point["threshold"] < -0.2  # between the last escalated and the first kept
    assert best["neg_entropy"]["found"] < 1.0
    # a cap of one question in four: the least confident only
    metric, point, _ = choose(rows, max_escalation=0.25)
    assert point["escalated"] == 0.25 and point["found"] == 0.75 and -2.5 < point["threshold"] < -1.5
    # no escalation allowed: never escalate
    assert choose(rows, max_escalation=0.0)[1]["threshold"] == -math.inf


def test_router_finds_other_retrievers_nodes_through_the_store(kb):
    """A stock retriever's node text maps to the store's chunk by content address (write-through)."""
    router = make(kb)
    hit = router.retrieve("tower of Velmora")[0]
    lookup = router.ensure_chunks([hit.text])
    assert lookup.keys == [hit.key] and lookup.found == 1 and lookup.prefilled == 0
