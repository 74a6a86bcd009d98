"""`cag build` and `cag store stats|verify|gc` end to end on a tiny model saved to a folder."""

from __future__ import annotations

import json

import diskcache
import pytest
from typer.testing import CliRunner

from cag.cli import app
from stores.diskcache_store import DiskCacheChunkStore
from stores.manifest import chunks_dir, open_current
from tests.stores.test_build import doc
from tests.tiny import tiny_loaded, tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model, tok = tiny_model("qwen2")
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"d{i}.txt").write_text(doc(i))
    (corpus / "empty.txt").write_text("")
    result = runner.invoke(app, ["build", str(corpus), "--store", str(root / "store"), "--source",
                                 str(root / "model"), "--chunk-tokens", "32", "--json"])
    assert result.exit_code == 0, result.output
    return root, json.loads(result.stdout.strip().splitlines()[-1])


def invoke_json(*args):
    result = runner.invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def test_build_summary_and_stats(built):
    root, summary = built
    assert summary["new"] == 3 and summary["failed"][0]["doc_id"] == "empty.txt"
    assert summary["chunks_prefilled"] > 0 and summary["bytes_per_token"] > 0
    code, stats = invoke_json("store", "stats", str(root / "store"))
    assert code == 0 and stats["documents"] == 3 and stats["index_rows"] == summary["chunks"]
    code, report = invoke_json("store", "verify", str(root / "store"))
    assert code == 0 and report["ok"] == report["checked"] > 0 and not report["problems"]


def test_verify_reports_tampered_entries_and_never_loads_them(built, tmp_path):
    import shutil
    root, _ = built
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    manifest, _ = open_current(store, embedder="sentence-transformers/all-MiniLM-L6-v2")
    keys = sorted(manifest.chunk_keys())
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        data = bytearray(chunks.get(keys[0]))
        data[-3] ^= 0xFF
        chunks.put(keys[0], bytes(data), overwrite=True)                     # bad checksum
        chunks.put(keys[1], chunks.get(keys[1])[:100], overwrite=True)       # truncated
        foreign = tiny_loaded("llama").prefill("A chunk of another model.")
        chunks.put(keys[2], foreign.to_bytes(), overwrite=True)             # other fingerprint
        chunks.delete(keys[3])                                              # missing
    with diskcache.Cache(str(chunks_dir(store))) as plain:                  # pickled, behind our back
        plain.set(keys[4], {"not": "bytes"})
    code, report = invoke_json("store", "verify", str(store))
    assert code == 1
    kinds = {p["key"]: p["kind"] for p in report["problems"]}
    assert kinds[keys[0]] == "checksum" and kinds[keys[1]] == "truncated"
    assert kinds[keys[2]] == "foreign" and kinds[keys[3]] == "missing" and kinds[keys[4]] == "refused"
    assert report["ok"] == report["checked"] - 4


def test_gc_and_errors(built, tmp_path):
    root, _ = built
    code, gc = invoke_json("store", "gc", str(root / "store"))
    assert code == 0 and gc["chunks_collected"] == 0
    result = runner.invoke(app, ["store", "stats", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and "no store" in result.output
    result = runner.invoke(app, ["build", str(tmp_path / "missing"), "--store", str(tmp_path / "s")])
    assert result.exit_code == 1 and "does not exist" in result.output


def test_build_refuses_a_store_of_another_model(built, tmp_path):
    root, _ = built
    model, tok = tiny_model("llama")
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    result = runner.invoke(app, ["build", str(root / "corpus"), "--store", str(root / "store"),
                                 "--source", str(tmp_path / "other"), "--chunk-tokens", "32"])
    assert result.exit_code == 1 and "new --store" in result.output
