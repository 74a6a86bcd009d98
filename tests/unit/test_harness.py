"""The evaluation harness on a tiny model: the checks that keep it honest."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from eval.harness import DIRECT, NATIVE, NO_CONTEXT, ItemRunner
from eval.run import run_eval
from tests.stores.test_build import HashEmbedder, doc
from tests.unit.test_context import saved


@dataclass(frozen=True)
class Doc:
    id: str
    text: str


@dataclass(frozen=True)
class Item:
    id: str
    question: str
    answers: tuple
    documents: tuple = ()
    context: str = "retrieve"
    meta: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = saved(root, "llama")
    docs = tuple(Doc(f"d{i}", doc(i, paragraphs=2)) for i in range(3))
    items = [Item(f"q{i}", f"What is in document {i}? {docs[i].text[:40]}", ("maps", "tower"), docs,
                  meta={"dataset": "toy"}) for i in range(3)]
    items.append(Item("whole", "Which doc?", ("velmora",), (docs[0],), context="all", meta={"dataset": "toy"}))
    return root, str(model), items


def test_conditions_and_self_consistency(setup):
    from cag.context import CachedContext
    from eval.run import build_eval_store
    root, model, items = setup
    build_eval_store(items, root / "store", model, chunk_tokens=32, embedder=HashEmbedder())
    base = CachedContext(store=root / "store", target=model, mapper="identity", embedder=HashEmbedder(),
                         dtype="float32", recompute_ratio=1.0)
    runner = ItemRunner(base, {"identity": base}, max_new_tokens=6)
    results = runner.run(items[0])
    assert set(results) == {NO_CONTEXT, DIRECT, NATIVE, "cache:identity"}
    # with full recompute, native and stored-chunk caches are direct context
    for cond in (NATIVE, "cache:identity"):
        assert results[cond].kl_from_direct == pytest.approx(0.0, abs=1e-4)
        assert results[cond].top1_with_direct == 1.0
        assert results[cond].answer == results[DIRECT].answer
        assert results[cond].context_tokens == results[DIRECT].context_tokens > 0
    assert results[NO_CONTEXT].context_tokens == 0
    assert results[NO_CONTEXT].kl_from_direct > 1e-3
    # Scored as served: with a recompute and the model's own attention the question was read in the
    # recompute's forward (and still gives direct context's log-probs and answer, above).
    runs = runner.cache_runs(items[0], runner.hits_for(items[0]))
    assert all(runs[c].first_logits is not None for c in (NATIVE, "cache:identity"))
    whole = runner.run(items[-1])
    assert whole[DIRECT].context_tokens == sum(lm_tokens for lm_tokens in [
        base.target_model.tokenize(h.text)[0].numel() for h in base.document_hits(["d0"])])


def test_a_copy_prior_condition_gets_its_text_only_control(setup):
    from cag.context import CachedContext
    from eval.harness import COPY_ONLY
    from eval.run import build_eval_store
    root, model, items = setup
    build_eval_store(items, root / "store-copy", model, chunk_tokens=32, embedder=HashEmbedder())
    base = CachedContext(store=root / "store-copy", target=model, mapper="identity", embedder=HashEmbedder(),
                         dtype="float32")
    copying = CachedContext(store=root / "store-copy", target=model, mapper="identity", embedder=HashEmbedder(),
                            dtype="float32", copy_prior=0.5)
    runner = ItemRunner(base, {"identity": copying}, max_new_tokens=6)
    runs = runner.cache_runs(items[0], runner.hits_for(items[0]))
    control = runs[f"{COPY_ONLY}:identity"]
    assert control.context_tokens == 0 and control.cache.get_seq_length() == runs[NATIVE].context_span[0]
    prior = runs["cache:identity"].copy_prior
    assert control.copy_prior is not prior and control.copy_prior._texts == prior._texts   # the same text
    results = runner.run(items[0])
    assert f"{COPY_ONLY}:identity" in results and results[f"{COPY_ONLY}:identity"].context_tokens == 0
    assert f"{COPY_ONLY}:identity" not in ItemRunner(base, {"identity": base}).run(items[0])  # no prior: none


def test_run_eval_writes_report_and_resumes(setup, tmp_path):
    root, model, items = setup
    out = tmp_path / "out"
    summary = run_eval(items, out, source=model, targets=[model], methods=["identity", "ridge"], top_k=2,
                       max_new_tokens=4, chunk_tokens=32, embedder=HashEmbedder())
    rows = (out / "results.jsonl").read_text().splitlines()
    assert len(rows) == len(items)
    direct = [e for e in summary["table"] if e["condition"] == DIRECT][0]
    import math
    f1_retention = direct["retention"]["f1"]["value"]
    assert f1_retention == 1.0 if direct["f1"] > 0 else math.isnan(f1_retention)
    assert direct["retention"]["likelihood"]["value"] == pytest.approx(1.0)
    assert any("ridge" in n for n in summary["notes"])  # no ridge mapper for a model and itself: said
    assert (out / "results.md").read_text().count("| toy |") == len(summary["table"])
    assert (out / "retention.png").exists() and (out / "ttft.png").exists()
    # resume: a rerun recomputes nothing; without plots (the gate's runs) it draws none
    for png in ("retention.png", "ttft.png"):
        (out / png).unlink()
    again = run_eval(items, out, store=out / "store", source=model, targets=[model], methods=["identity"],
                     top_k=2, max_new_tokens=4, embedder=HashEmbedder(), plots=False)
    assert len((out / "results.jsonl").read_text().splitlines()) == len(items)
    assert again["rows"] == len(items)
    assert (out / "results.md").exists() and not list(out.glob("*.png"))


def test_an_artifact_folder_is_measured_under_its_own_label(tmp_path):
    """`--methods FOLDER`: the replaced map's rows stand beside the shipped map of the same method."""
    from types import SimpleNamespace

    from eval.run import condition_label

    mapper = SimpleNamespace(method="bottleneck", artifact_id="5f29070010f62802")
    assert condition_label("bottleneck", mapper) == "bottleneck"
    assert condition_label(str(tmp_path), mapper) == "bottleneck@5f29070010f62802"
    assert condition_label(str(tmp_path), SimpleNamespace(method="ridge")) == f"ridge@{tmp_path.name}"


def _small_run(model: str) -> dict:
    """`run_eval` arguments for a resume test: one tiny model, answers of two tokens."""
    return dict(source=model, targets=[model], methods=["identity"], top_k=2, max_new_tokens=2, chunk_tokens=32,
                embedder=HashEmbedder())


def test_a_resumed_run_refuses_rows_measured_with_another_mapper_artifact(setup, tmp_path):
    import json

    root, model, items = setup
    out = tmp_path / "refit"
    kw = _small_run(model)
    run_eval(items[:1], out, **kw)
    path = out / "results.jsonl"
    row = json.loads(path.read_text())
    assert row["mappers"] == {"cache:identity": row["mappers"]["cache:identity"]} and row["mappers"]["cache:identity"]
    run_eval(items[:2], out, store=out / "store", **kw)  # the same artifact: resumes
    assert len(path.read_text().splitlines()) == 2
    # as if the mapper had been refitted under the same method name since those rows were written
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["mappers"]["cache:identity"] = "0123456789abcdef"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="0123456789abcdef.*Use another --out"):
        run_eval(items[:3], out, store=out / "store", **kw)
    assert len(path.read_text().splitlines()) == 2  # nothing was mixed in


def test_a_resumed_run_refuses_rows_generated_with_another_token_budget(setup, tmp_path):
    import json

    root, model, items = setup
    out = tmp_path / "budget"
    kw = _small_run(model)
    del kw["max_new_tokens"]
    summary = run_eval(items[:1], out, max_new_tokens=2, **kw)
    path = out / "results.jsonl"
    assert json.loads(path.read_text())["max_new_tokens"] == 2 == summary["run"]["max_new_tokens"]
    run_eval(items[:2], out, store=out / "store", max_new_tokens=2, **kw)  # the same budget: resumes
    assert len(path.read_text().splitlines()) == 2
    with pytest.raises(RuntimeError, match="max_new_tokens = 2 .*asks 5.*Use another --out"):
        run_eval(items[:3], out, store=out / "store", max_new_tokens=5, **kw)
    assert len(path.read_text().splitlines()) == 2  # nothing was mixed in


def test_a_resumed_run_refuses_rows_read_with_another_focus_budget(setup, tmp_path):
    import json

    root, model, items = setup
    out = tmp_path / "focus"
    kw = _small_run(model)
    summary = run_eval(items[:1], out, **kw)
    path = out / "results.jsonl"
    row = json.loads(path.read_text())
    assert "focus_tokens" not in row and row["focus_budget"] == 0   # the target's own: none calibrated, every chunk
    assert summary["run"]["translated_focus_tokens"] is None
    run_eval(items[:2], out, store=out / "store", **kw)  # the same setting: resumes
    assert len(path.read_text().splitlines()) == 2
    with pytest.raises(RuntimeError, match="focus_tokens = None .*asks 512.*Use another --out"):
        run_eval(items[:3], out, store=out / "store", translated_focus_tokens=512, **kw)
    assert len(path.read_text().splitlines()) == 2  # nothing was mixed in
    other = tmp_path / "focus512"
    run_eval(items[:1], other, store=out / "store", translated_focus_tokens=512, **kw)
    row = json.loads((other / "results.jsonl").read_text())
    assert row["focus_tokens"] == 512 == row["focus_budget"]


def test_a_resumed_run_refuses_rows_of_another_item_under_the_same_id(setup, tmp_path):
    import dataclasses
    import json

    root, model, items = setup
    out = tmp_path / "ids"
    kw = _small_run(model)
    run_eval(items[:1], out, **kw)
    path = out / "results.jsonl"
    assert json.loads(path.read_text())["item_sha"]
    other = dataclasses.replace(items[0], question=items[0].question + " And since when?")
    with pytest.raises(RuntimeError, match=f"{items[0].id}.*arguments changed.*Use another --out"):
        run_eval([other, items[1]], out, store=out / "store", **kw)
    assert len(path.read_text().splitlines()) == 1  # nothing was mixed in
    run_eval(items[:2], out, store=out / "store", **kw)  # the same item: resumes
    assert len(path.read_text().splitlines()) == 2


def test_run_eval_builds_its_store_in_the_dtype_asked(setup, tmp_path):
    from cag.kv import read_metadata
    from stores.location import open_store

    root, model, items = setup
    out = tmp_path / "int8"
    summary = run_eval(items[:1], out, source=model, targets=[model], methods=["identity"], top_k=2,
                       max_new_tokens=2, chunk_tokens=32, embedder=HashEmbedder(), dtype="int8")
    assert summary["run"]["dtype"] == "int8"
    location = open_store(out / "store")
    assert location.load_manifest(location.current_version()).chunker["dtype"] == "int8"
    chunks = location.chunks()
    try:
        frames = [chunks.get(k) for k in chunks.keys()]
    finally:
        chunks.close()
    assert frames and {read_metadata(f)["dtype"] for f in frames} == {"int8"}


def test_a_question_retrieves_from_its_own_pool_only(setup):
    """`cag eval` puts every dataset in one store; a question that brings a pool must not read another's
    documents (the needles' haystacks are cut from the essays essay-qa asks about)."""
    from cag.context import CachedContext
    from eval.run import build_eval_store

    root, model, items = setup
    build_eval_store(items, root / "store", model, chunk_tokens=32, embedder=HashEmbedder())
    base = CachedContext(store=root / "store", target=model, mapper="identity", embedder=HashEmbedder(),
                         dtype="float32", top_k=8)
    runner = ItemRunner(base, {"identity": base}, max_new_tokens=6)
    assert "d0" in {h.doc_id for h in runner.hits_for(items[0])}   # its question is about d0
    own = Item("own", items[0].question, ("maps",), items[0].documents[1:], meta={"dataset": "toy"})
    hits = runner.hits_for(own)
    assert {h.doc_id for h in hits} == {"d1", "d2"}
    assert hits == [h for h in base.retrieve(own.question, top_k=100) if h.doc_id != "d0"][:8]
