from __future__ import annotations

import json

import numpy as np
import pytest

from stores.errors import EmbedderMismatchError, StoreIntegrityError
from stores.index import DEFAULT_EMBEDDER_ID, ROWS_FILE, Hit, Row, VectorIndex

TEXTS = {
    "fox": "The quick brown fox jumps over the lazy dog.",
    "cache": "Key value caches are stored on disk and reused.",
    "paris": "Paris is the capital of France.",
    "tea": "Green tea is brewed with hot water.",
}


def rows(doc="d1"):
    out, pos = [], 0
    for key, text in TEXTS.items():
        out.append(Row(key=key, doc_id=doc, text=text, start=pos, end=pos + len(text)))
        pos += len(text)
    return out


def test_add_search_remove(fake_embedder):
    idx = VectorIndex(fake_embedder)
    assert idx.search("anything") == []
    assert idx.add(rows()) == 4 and len(idx) == 4
    assert idx.add(rows()) == 0  # identical rows are not duplicated
    hits = idx.search("capital of France", k=2)
    assert isinstance(hits[0], Hit) and hits[0].key == "paris" and hits[0].doc_id == "d1"
    assert hits[0].text == TEXTS["paris"] and hits[0].end - hits[0].start == len(TEXTS["paris"])
    assert 0.0 < hits[0].score <= 1.0 + 1e-6 and hits[0].score >= hits[1].score
    assert len(idx.search("fox", k=100)) == 4
    assert idx.search("fox", k=0) == []

    idx.add(rows("d2"))  # the same chunks in another document
    assert len(idx) == 8
    assert idx.remove(["paris"]) == 2
    assert "paris" not in {h.key for h in idx.search("capital of France", k=8)}
    assert idx.remove_docs(["d2"]) == 3 and {r.doc_id for r in idx.rows} == {"d1"}
    # rows and vectors stay aligned after removals
    for key in ("fox", "cache", "tea"):
        assert idx.search(TEXTS[key], k=1)[0].key == key


def test_search_within_some_documents_is_the_full_ranking_filtered(fake_embedder):
    idx = VectorIndex(fake_embedder)
    idx.add(rows("d1"))
    idx.add([Row(key=f"b-{r.key}", doc_id="d2", text=r.text + " Again.", start=r.start, end=r.end) for r in rows()])
    idx.remove(["fox"])  # positions shift: the filter must follow the rows, not their old places
    full = idx.search("capital of France", k=len(idx))
    for docs in (["d2"], ["d1"], ["d1", "d2"]):
        want = [h for h in full if h.doc_id in docs]
        assert idx.search("capital of France", k=3, doc_ids=docs) == want[:3]
    assert idx.search("capital of France", k=10, doc_ids=["d2"]) == [h for h in full if h.doc_id == "d2"]
    assert idx.search("capital of France", k=3, doc_ids=["nobody"]) == []


def test_scores_are_cosine(fake_embedder):
    idx = VectorIndex(fake_embedder)
    idx.add(rows())
    hit = idx.search(TEXTS["tea"], k=1)[0]
    assert hit.key == "tea" and hit.score == pytest.approx(1.0, abs=1e-5)


def test_save_load_round_trip(tmp_path, fake_embedder):
    idx = VectorIndex(fake_embedder)
    idx.add(rows())
    idx.save(tmp_path)
    meta = json.loads((tmp_path / ROWS_FILE).read_text())
    assert meta["embedder_id"] == "fake-bow-64" and meta["dim"] == 64 and len(meta["rows"]) == 4
    back = VectorIndex.load(tmp_path, fake_embedder)
    assert back.rows == idx.rows and back.dim == 64
    q = "lazy dog"
    assert back.search(q, k=4) == idx.search(q, k=4)
    back.add([Row("new", "d3", "Brand new text about owls.", 0, 26)])
    assert back.search("owls", k=1)[0].key == "new"


def test_empty_index_round_trip(tmp_path, fake_embedder):
    VectorIndex(fake_embedder).save(tmp_path)
    back = VectorIndex.load(tmp_path, fake_embedder)
    assert len(back) == 0 and back.search("x") == []


def test_load_mismatch_and_corruption(tmp_path, fake_embedder):
    idx = VectorIndex(fake_embedder)
    idx.add(rows())
    idx.save(tmp_path)
    other = type(fake_embedder)(dim=64, id="another-embedder")
    with pytest.raises(EmbedderMismatchError, match="fake-bow-64"):
        VectorIndex.load(tmp_path, other)
    with pytest.raises(EmbedderMismatchError):
        VectorIndex.load(tmp_path, "some/other-model")
    with pytest.raises(EmbedderMismatchError):
        VectorIndex.load(tmp_path, type(fake_embedder)(dim=32))  # same id, other dim
    meta = json.loads((tmp_path / ROWS_FILE).read_text())
    meta["rows"].pop()
    (tmp_path / ROWS_FILE).write_text(json.dumps(meta))
    with pytest.raises(StoreIntegrityError, match="3 rows"):
        VectorIndex.load(tmp_path, fake_embedder)
    (tmp_path / ROWS_FILE).write_text("{not json")
    with pytest.raises(StoreIntegrityError):
        VectorIndex.load(tmp_path, fake_embedder)


def test_embedder_needs_an_id():
    with pytest.raises(ValueError):
        VectorIndex(lambda texts: np.zeros((len(texts), 4), dtype=np.float32))
    idx = VectorIndex(lambda texts: np.ones((len(texts), 4), dtype=np.float32), embedder_id="ones")
    assert idx.embedder_id == "ones" and idx.add([Row("k", "d", "t", 0, 1)]) == 1 and idx.dim == 4


def test_real_minilm(tmp_path):
    idx = VectorIndex()  # the packaged all-MiniLM-L6-v2, offline, CPU
    assert idx.embedder_id == DEFAULT_EMBEDDER_ID and idx.dim == 384
    idx.add(rows())
    assert idx.search("Which city is France's capital?", k=1)[0].key == "paris"
    assert idx.search("where are KV caches kept", k=1)[0].key == "cache"
    idx.save(tmp_path)
    back = VectorIndex.load(tmp_path)  # recorded default embedder is re-created
    assert back.search("a hot drink", k=1)[0].key == "tea"


# ------------------------------------------------------------ sentence vectors


def two_sentence_rows():
    text = "Zorblat keeps 417 maps. The tower stands in Velmora!\nIdris wrote it down."
    return [Row("z", "d1", text, 0, len(text)), *rows()]


def test_sentence_vectors_are_each_sentence_embedded_at_add(fake_embedder):
    from stores.chunker import sentence_spans

    idx = VectorIndex(fake_embedder)
    idx.add(two_sentence_rows())
    for r in idx.rows:
        want = idx.embed([r.text[a:b] for a, b in sentence_spans(r.text)])
        np.testing.assert_array_equal(idx.sentence_vectors(r.key), want)
    assert len(idx.sentence_vectors("z")) == 3 and idx.sentence_vectors("nobody") is None
    idx.remove(["z"])
    assert idx.sentence_vectors("z") is None and idx.sentence_vectors("fox") is not None


def test_sentence_vectors_survive_save_and_load(tmp_path, fake_embedder):
    from stores.index import SENTENCES_FILE

    idx = VectorIndex(fake_embedder)
    idx.add(two_sentence_rows())
    idx.save(tmp_path)
    assert (tmp_path / SENTENCES_FILE).read_bytes()[:6] == b"\x93NUMPY"  # numpy's own format, never pickle
    back = VectorIndex.load(tmp_path, fake_embedder)
    for r in idx.rows:
        np.testing.assert_array_equal(back.sentence_vectors(r.key), idx.sentence_vectors(r.key))


def test_an_index_saved_before_sentence_vectors_loads_and_gains_them_at_its_next_add(tmp_path, fake_embedder):
    from stores.index import SENTENCES_FILE

    idx = VectorIndex(fake_embedder)
    idx.add(two_sentence_rows())
    idx.save(tmp_path)
    meta = json.loads((tmp_path / ROWS_FILE).read_text())
    del meta["sentences"]  # what an older cag wrote
    (tmp_path / ROWS_FILE).write_text(json.dumps(meta))
    (tmp_path / SENTENCES_FILE).unlink()
    old = VectorIndex.load(tmp_path, fake_embedder)
    assert old.sentence_vectors("z") is None
    old.add([Row("new", "d3", "Owls hunt at night. They fly silently.", 0, 38)])
    for key in ("z", "fox"):  # the old rows are filled in too
        np.testing.assert_array_equal(old.sentence_vectors(key), idx.sentence_vectors(key))
    assert len(old.sentence_vectors("new")) == 2


def test_corrupt_sentence_vectors_are_refused(tmp_path, fake_embedder):
    from stores.index import SENTENCES_FILE

    idx = VectorIndex(fake_embedder)
    idx.add(two_sentence_rows())
    idx.save(tmp_path)
    good = (tmp_path / SENTENCES_FILE).read_bytes()
    (tmp_path / SENTENCES_FILE).write_bytes(good[:len(good) // 2])  # truncated
    with pytest.raises(StoreIntegrityError, match="sentences.npy"):
        VectorIndex.load(tmp_path, fake_embedder)
    np.save(tmp_path / SENTENCES_FILE, np.zeros((2, 64), dtype=np.float32))  # too few rows
    with pytest.raises(StoreIntegrityError, match="sentence"):
        VectorIndex.load(tmp_path, fake_embedder)
    np.save(tmp_path / SENTENCES_FILE, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # a pickle
    with pytest.raises(StoreIntegrityError, match="sentences.npy"):
        VectorIndex.load(tmp_path, fake_embedder)
    (tmp_path / SENTENCES_FILE).unlink()
    with pytest.raises(StoreIntegrityError, match="missing"):
        VectorIndex.load(tmp_path, fake_embedder)


def test_a_question_searched_is_not_embedded_again_for_its_crux(fake_embedder):
    """`search` and a one-text `embed` share the last questions' vectors: the crux's sentence ranking
    (cag.selection) embeds the question the query just searched with, and gets the very same vector."""
    calls: list[list[str]] = []

    def counting(texts):
        calls.append(list(texts))
        return fake_embedder(texts)

    counting.id, counting.dim = fake_embedder.id, fake_embedder.dim
    idx = VectorIndex(counting)
    idx.add([Row("k1", "d1", "alpha beta", 0, 10), Row("k2", "d2", "gamma delta", 0, 11)])
    calls.clear()
    hits = idx.search("alpha?", k=1)
    again = idx.embed(["alpha?"])
    assert calls == [["alpha?"]] and hits[0].key == "k1"
    np.testing.assert_array_equal(again, fake_embedder(["alpha?"]) / np.linalg.norm(fake_embedder(["alpha?"])))
    again[0, 0] = 99.0  # the caller's copy: the remembered vector is untouched
    assert idx.embed(["alpha?"])[0, 0] != 99.0
    idx.embed(["other", "texts"])  # several texts: embedded, never remembered
    idx.embed(["other"])
    assert calls == [["alpha?"], ["other", "texts"], ["other"]]
