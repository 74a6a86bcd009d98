"""`CachedContext.as_query_engine()` and `cag query` on the real qwen2.5-0.5b target.

A store of three short documents is prefilled by the target itself (identity
mapper); the question asks for a made-up name that only one document holds, so
the model cannot answer it from what it knows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TARGET = "qwen2.5-0.5b"
FACT = "Oskarine Thrupp"
QUESTION = "What is the name of the lighthouse keeper of Vellmark Island?"
DOCUMENTS = {
    "harbour-notes.txt": ("Harbour notes, spring edition. The lighthouse keeper of Vellmark Island is "
                          f"named {FACT}. She keeps a blue logbook and rings the harbour bell at dawn."),
    "bakery.txt": ("The bakery on Mill Street sells rye bread and seed cakes. It opens at six in the "
                   "morning, and the owner, a retired sailor, feeds the street cats at noon."),
    "trains.txt": ("Trains to the coast leave every hour from platform four. Tickets are sold at the "
                   "kiosk by the main entrance; the last train back leaves at eleven at night."),
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from llama_index.core import Document

    from cag import CachedContext

    documents = [Document(text=text, id_=doc_id) for doc_id, text in DOCUMENTS.items()]
    # min_retention=0: these tests are about the cached mechanics, so they consent to the native
    # path whatever the gate measured for it (test_gate_* below test the default).
    ctx = CachedContext.from_documents(documents, tmp_path_factory.mktemp("qe") / "store", source=TARGET,
                                       target=TARGET, chunk_tokens=128, top_k=2, max_new_tokens=16,
                                       min_retention=0.0)
    yield ctx
    ctx.close()


def test_query_engine_answers_the_planted_fact(ctx):
    response = ctx.as_query_engine().query(QUESTION)
    assert FACT in str(response), str(response)
    docs = [n.node.ref_doc_id for n in response.source_nodes]
    assert "harbour-notes.txt" in docs, docs
    assert response.metadata["mode"] == "cached"
    assert response.metadata["timings"]["first_token"] > 0
    assert [w for w in response.metadata["warnings"] if "quality gate off" not in w] == []


def test_cli_query_direct_json(ctx):
    proc = subprocess.run([sys.executable, "-m", "cag.cli", "query", QUESTION, "--store", str(ctx.store),
                           "--target", TARGET, "--top-k", "2", "--max-new-tokens", "16",
                           "--min-retention", "0", "--direct", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["condition"] for r in rows] == ["cached", "direct"], proc.stdout
    assert rows[0]["path"] == "native" and rows[0]["gate"]["path"] == "native"
    for row in rows:
        assert FACT in row["text"], row
        assert "harbour-notes.txt" in [s["doc_id"] for s in row["sources"]], row
        timings = row["timings"]
        assert 0 < timings["first_token"] <= timings["total"], timings
        assert timings["retrieve"] > 0, timings
    assert rows[0]["sources"] == rows[1]["sources"]  # both answered from the same chunks


def test_gate_smollm2_store_queried_by_qwen_answers_and_says_how(tmp_path):
    """#10's bar: a SmolLM2 store, Qwen2.5 answering with the default gate, a fact planted in one
    document: the right answer, through a translated path if one passes the gate, else the
    fallback, and `cag query --json` says which and why."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for doc_id, text in DOCUMENTS.items():
        (docs / doc_id).write_text(text)
    store = tmp_path / "store"
    build = subprocess.run([sys.executable, "-m", "cag.cli", "build", str(docs), "--store", str(store),
                            "--source", "smollm2-135m", "--chunk-tokens", "128", "--json"],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    proc = subprocess.run([sys.executable, "-m", "cag.cli", "query", QUESTION, "--store", str(store),
                           "--target", TARGET, "--top-k", "2", "--max-new-tokens", "16", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout.splitlines()[0])
    assert FACT in row["text"], row
    assert row["path"] in ("translated", "translated+repair", "direct") and row["gate"]["reason"], row
    assert row["path"] == row["gate"]["path"]
    if row["path"] == "direct":  # the translated path was refused: the reason names it
        assert any(r["path"].startswith("translated") for r in row["gate"]["rejected"]), row["gate"]
