"""The shipped mappers on the real packaged models: present (or retired, with the replacement named),
within budget, for these exact models, and HeteroFold better than KV Ridge where it matters (next-token fidelity).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cag.mapping import MapperRetiredError, card_fidelity, resolve_mapper
from cag.models import registry as reg
from eval.datasets import essay_text, evaluation_essays
from mappers.base import load_mapper
from mappers.fidelity import measure_fidelity

pytestmark = pytest.mark.integration

PRETRAINED = Path(__file__).resolve().parents[2] / "mappers" / "pretrained"
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"]
DIRECTIONS = list(itertools.permutations(MODELS, 2))
METHODS = ["ridge", "latent", "heterofold", "mot"]
# Where the lab's bottleneck ships, MoT lost to it (0 found on the gate's lookups or, into SmolLM2, the lab's
# 40 needles) and was retired.
RETIRED = {("smollm2-135m", "qwen2.5-0.5b"): {"mot": "bottleneck"}, ("smollm2-135m", "gemma3-270m"): {"mot": "bottleneck"},
           ("gemma3-270m", "qwen2.5-0.5b"): {"mot": "bottleneck"}, ("qwen2.5-0.5b", "gemma3-270m"): {"mot": "bottleneck"},
           ("gemma3-270m", "smollm2-135m"): {"mot": "bottleneck"}, ("qwen2.5-0.5b", "smollm2-135m"): {"mot": "bottleneck"}}


@pytest.fixture(scope="module")
def models():
    return {name: reg.load(name, "bfloat16") for name in MODELS}


@pytest.mark.parametrize("source,target", DIRECTIONS)
def test_every_direction_ships_every_method_for_these_models(source, target, models):
    retired = RETIRED.get((source, target), {})
    for method, replacement in retired.items():
        with pytest.raises(MapperRetiredError, match=f"Use {source}__{target}__{replacement}"):
            resolve_mapper(method, models[source].fingerprint, models[target])
    for method in (m for m in METHODS if m not in retired):
        folder = PRETRAINED / f"{source}__{target}__{method}"
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        assert size <= 20e6, f"{folder.name} is {size / 1e6:.1f} MB"
        mapper = load_mapper(folder, source=models[source].fingerprint, target=models[target].fingerprint)
        assert mapper.method == method
        fid = card_fidelity(mapper.card())
        assert fid["kl"] < fid["kl_no_context"], f"{folder.name}: no better than no context on its card"


@pytest.mark.parametrize("source,target", DIRECTIONS)
def test_heterofold_beats_ridge_on_the_same_heldout_texts(source, target):
    cards = {m: json.loads((PRETRAINED / f"{source}__{target}__{m}" / "card.json").read_text())
             for m in ("ridge", "heterofold")}
    texts = {m: c["fidelity"].get("heldout_texts", {}).get("texts_sha256") for m, c in cards.items()}
    assert texts["ridge"] and texts["ridge"] == texts["heterofold"], "cards measured on different texts"
    assert card_fidelity(cards["heterofold"])["kl"] < card_fidelity(cards["ridge"])["kl"]


def test_auto_ranks_by_lookup_fidelity_and_heterofold_is_live_better_on_an_evaluation_essay(models):
    source, target = models["smollm2-135m"], models["qwen2.5-0.5b"]
    auto = resolve_mapper("auto", source.fingerprint, target)
    cards = {m: json.loads(p.read_text()) for m in (*METHODS, "bottleneck")
             for p in [PRETRAINED / f"smollm2-135m__qwen2.5-0.5b__{m}" / "card.json"] if p.exists()}
    lookup = {m: c.get("fidelity", {}).get("lookup", {}).get("found_retention") for m, c in cards.items()}
    measured = {m: r for m, r in lookup.items() if r is not None}
    assert measured, "the gate measured no mapper for this pair"
    best = max(measured.values())
    tied = [m for m, r in measured.items() if r == best]
    kls = {m: card_fidelity(cards[m]).get("kl", float("inf")) for m in tied}
    assert auto.method == min(kls, key=kls.get)
    # a passage of an essay that no mapper was fitted on
    words = essay_text(evaluation_essays()[0]).split()
    text = " ".join(words[200:380])
    live = {m: measure_fidelity(resolve_mapper(m, source.fingerprint, target), source, target, [text],
                                attention=False)["kl"] for m in ("ridge", "heterofold")}
    assert live["heterofold"] < live["ridge"]


# the lab items each shipped map's card was scored on: SmolLM2 → Gemma-3's card keeps its first
# scan's n = 16 (README, "The translation lab")
LAB_N = {("smollm2-135m", "qwen2.5-0.5b"): 40, ("smollm2-135m", "gemma3-270m"): 16,
         ("gemma3-270m", "qwen2.5-0.5b"): 40, ("qwen2.5-0.5b", "gemma3-270m"): 40, ("gemma3-270m", "smollm2-135m"): 40,
         ("qwen2.5-0.5b", "smollm2-135m"): 40}


@pytest.mark.parametrize("source_name,target_name", sorted(LAB_N))
def test_shipped_bottleneck_is_within_budget_loads_for_its_pair_and_beats_no_context_on_lab_lookups(
        models, source_name, target_name):
    folder = PRETRAINED / f"{source_name}__{target_name}__bottleneck"
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    assert size <= 20e6, f"{folder.name} is {size / 1e6:.1f} MB"
    source, target = models[source_name], models[target_name]
    mapper = resolve_mapper("bottleneck", source.fingerprint, target)
    lab = mapper.card()["fidelity"]["lab_lookup"]
    assert lab["n"] >= LAB_N[(source_name, target_name)] and lab["found"] > lab["no_context_found"] and lab["gold_ll"] > lab["no_context_gold_ll"] + 1
    assert mapper.fitted_on["prefill_prefix"] == {"source": source.prefill_prefix, "target": target.prefill_prefix}
    text = " ".join(essay_text(evaluation_essays()[0]).split()[100:220])
    out = mapper.translate(source.prefill(text), text, target)
    fp = target.fingerprint
    assert out.keys.shape == (fp.num_layers, fp.num_kv_heads, target.tokenize(text)[0].numel(), fp.head_dim)
    assert bool(out.keys.isfinite().all()) and bool(out.values.isfinite().all())


@pytest.mark.parametrize("source_name,target_name", sorted(LAB_N))
def test_auto_serves_the_bottleneck_where_it_ships_because_it_finds_the_most_gate_lookups(models, source_name,
                                                                                            target_name):
    source, target = models[source_name], models[target_name]
    assert resolve_mapper("auto", source.fingerprint, target).method == "bottleneck"
    found = {m: json.loads(p.read_text()).get("fidelity", {}).get("lookup", {}).get("found_retention")
             for m in (*METHODS, "bottleneck")
             for p in [PRETRAINED / f"{source_name}__{target_name}__{m}" / "card.json"] if p.exists()}
    assert found["bottleneck"] is not None, "the gate has not measured the bottleneck for this pair"
    assert all(r is None or r < found["bottleneck"] for m, r in found.items() if m != "bottleneck")
