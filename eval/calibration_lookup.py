"""Calibration-side lookup items: fact documents, questions and answers for *choosing*
defaults, thresholds and gates, never for reporting.

Everything `cag` calibrates on questions (the quality gate's per-path fidelity,
the router's confidence threshold, attention-temperature defaults) reads these
items, and no evaluation set ever does. They are built to be unlike
`synthetic-kb` (which stays evaluation-only) in every visible way:

- entity types: ships, mountain huts, comets, herbal remedies, river ferries,
  and botanical gardens, not institutes, guilds or breweries;
- facts: a captain, a home port, a tonnage, a cargo, an altitude, a warden, a
  discoverer, an orbital period, an ingredient, a dose, a crossing time, a
  species count; numbers in other ranges and formats (decimals, thousands
  separators, units);
- phrasings: their own sentence and question templates;
- names: drawn from the same syllable generator but never any name that
  `synthetic-kb` uses for seeds 0-9 (checked by a test).

`calibration_lookup(seed=...)` mirrors `synthetic_kb`'s shape (a pool of short
documents, several with facts of the same type as distractors, each item
carrying the pool and retrieving from it), so a gate measured here speaks about
the same kind of lookup. `calibration_needles` plants one fact in a calibration
essay (`datasets.calibration_essays`, which no evaluation set reads).
"""

from __future__ import annotations

import random

from eval.datasets import Document, QAItem, _Names, calibration_essays, essay_text, normalize_ws, synthetic_kb

DATASET = "calib-lookup"

# kind -> (introduction, fact types it can carry)
_KINDS = {
    "ship": ("The {N} is a merchant ship.", ("captain", "port", "tonnage", "cargo")),
    "hut": ("The {N} Hut is a mountain hut.", ("altitude", "warden", "beds", "opened")),
    "comet": ("Comet {N} is a periodic comet.", ("discoverer", "period", "tail")),
    "remedy": ("{N} tincture is a herbal remedy.", ("ingredient", "dose", "maker")),
    "ferry": ("The {N} ferry crosses a wide river.", ("crossing", "cars", "pilot")),
    "garden": ("The {N} botanical garden is open all year.", ("species", "curator", "glasshouse")),
}
_SUBJECT = {"ship": "the {N}", "hut": "the {N} Hut", "comet": "Comet {N}", "remedy": "{N} tincture",
            "ferry": "the {N} ferry", "garden": "the {N} botanical garden"}
_CARGOES = ["tinned pilchards", "raw cotton", "slate roofing", "olive oil", "copper wire", "rolled oats",
            "cork bark", "salted cod", "indigo dye", "tea chests"]
_TAILS = ["a faint green tail", "a double blue tail", "a short golden tail", "a long silver tail",
          "a forked white tail", "a pale violet tail"]
_INGREDIENTS = ["dried yarrow", "crushed fennel seed", "lemon balm", "wild thyme", "nettle root",
                "elderflower", "meadowsweet", "hawthorn berry"]
_GLASS = ["a palm house of 1911", "a hexagonal fern house", "a heated cactus house", "a tall orchid house",
          "a Victorian lily house", "a low alpine house"]

# fact -> (sentences, question, how the value is made)
_FACTS = {
    "captain": (["Her captain is {V}.", "{S} sails under Captain {V}."], "Who is the captain of {s}?"),
    "port": (["{S} is registered in the port of {V}.", "Her home port is {V}."], "What is the home port of {s}?"),
    "tonnage": (["{S} displaces {V}.", "Fully loaded, she weighs {V}."], "How heavy is {s} fully loaded?"),
    "cargo": (["{S} usually carries {V}.", "Her usual cargo is {V}."], "What does {s} usually carry?"),
    "altitude": (["{S} stands at {V} above sea level.", "It sits at an altitude of {V}."],
                 "At what altitude does {s} stand?"),
    "warden": (["The warden of {s} is {V}.", "{V} keeps {s} as its warden."], "Who is the warden of {s}?"),
    "beds": (["{S} sleeps {V} guests.", "It has bunks for {V} guests."], "How many guests can {s} sleep?"),
    "opened": (["{S} first opened its doors in {V}.", "It opened to walkers in {V}."], "When did {s} first open?"),
    "discoverer": (["{S} was first sighted by {V}.", "The astronomer {V} first sighted it."],
                   "Who first sighted {s}?"),
    "period": (["{S} returns every {V}.", "Its orbit takes {V}."], "How long is the orbit of {s}?"),
    "tail": (["{S} shows {V} near the sun.", "Near the sun it grows {V}."], "What kind of tail does {s} show?"),
    "ingredient": (["The main ingredient of {s} is {V}.", "{S} is made mostly from {V}."],
                   "What is the main ingredient of {s}?"),
    "dose": (["The usual dose of {s} is {V}.", "Herbalists give {V} of it at a time."],
             "What is the usual dose of {s}?"),
    "maker": (["{S} is prepared by the apothecary {V}.", "It is made by the apothecary {V}."],
              "Which apothecary prepares {s}?"),
    "crossing": (["{S} takes {V} to cross.", "A crossing on it lasts {V}."], "How long does a crossing on {s} take?"),
    "cars": (["{S} carries up to {V} cars.", "Its deck holds {V} cars."], "How many cars can {s} carry?"),
    "pilot": (["The pilot of {s} is {V}.", "{V} pilots {s}."], "Who pilots {s}?"),
    "species": (["{S} grows {V} species of plants.", "Its beds hold {V} plant species."],
                "How many plant species does {s} grow?"),
    "curator": (["The curator of {s} is {V}.", "{V} is its curator."], "Who is the curator of {s}?"),
    "glasshouse": (["The pride of {s} is {V}.", "Its best-known building is {V}."],
                   "What is the best-known building of {s}?"),
}
_FILLERS = [
    "Few travel guides mention it.",
    "Its records are kept in a small office nearby.",
    "A painting of it hangs in a seaside café.",
    "Schoolchildren sometimes visit it on outings.",
    "Its history was written up in a local pamphlet.",
    "Postcards of it are sold at the railway station.",
    "Older residents still tell stories about it.",
]


def _value(fact: str, rng: random.Random, names: _Names) -> tuple[str, tuple[str, ...]]:
    """A value for `fact` and its acceptable answers (the first is the gold)."""
    person = lambda: f"{names.take(n_syll=(2, 2))} {names.take(n_syll=(2, 3))}"  # noqa: E731
    if fact in ("captain", "warden", "discoverer", "maker", "pilot", "curator"):
        v = person()
        return v, (v, v.split()[-1])
    if fact == "port":
        v = names.take(n_syll=(2, 3), suffix=("haven", "mouth", "quay", "sund"))
        return v, (v,)
    if fact == "tonnage":
        v = f"{rng.randint(12, 98) * 100:,} tonnes"
        return v, (v, v.split()[0])
    if fact == "altitude":
        v = f"{rng.randint(1500, 3400):,} metres"
        return v, (v, v.split()[0])
    if fact == "beds":
        v = str(rng.randint(14, 86))
        return v, (v,)
    if fact == "opened":
        v = f"{rng.choice(['March', 'June', 'July', 'September'])} {rng.randint(1875, 1968)}"
        return v, (v, v.split()[1])
    if fact == "period":
        v = f"{rng.randint(31, 240) / 10:.1f} years"
        return v, (v, v.split()[0])
    if fact == "dose":
        v = f"{rng.choice([5, 10, 15, 20, 25, 30])} drops"
        return v, (v,)
    if fact == "crossing":
        v = f"{rng.randint(11, 58)} minutes"
        return v, (v, v.split()[0])
    if fact == "cars":
        v = str(rng.randint(6, 44))
        return v, (v,)
    if fact == "species":
        v = f"{rng.randint(1200, 9800):,}"
        return v, (v, v.replace(",", ""))
    pools = {"cargo": _CARGOES, "tail": _TAILS, "ingredient": _INGREDIENTS, "glasshouse": _GLASS}
    v = rng.choice(pools[fact])
    return v, (v,)


def _reserved_names() -> list[str]:
    """Every capitalised word synthetic-kb uses (seeds 0-9): never reused here."""
    words = set()
    for seed in range(10):
        for doc in synthetic_kb(seed=seed)[0].documents:
            words.update(w.strip(".,") for w in doc.text.split() if w[:1].isupper())
    return sorted(words)


def calibration_lookup(*, seed: int = 0, n_docs: int = 36, n_questions: int = 60) -> list[QAItem]:
    """Lookup questions over a pool of fact documents (see module doc)."""
    if n_docs < 6:
        raise ValueError("n_docs must be at least 6 (one entity of each kind)")
    rng = random.Random(f"{DATASET}:{seed}")
    names = _Names(rng)
    names.used.extend(_reserved_names())
    kinds = list(_KINDS)
    docs, facts = [], []  # facts[i] = [(fact, answers)]
    for i in range(n_docs):
        kind = kinds[i % len(kinds)]
        name = names.take(n_syll=(2, 3))
        intro, fact_types = _KINDS[kind]
        subject = _SUBJECT[kind].format(N=name)
        chosen = rng.sample(fact_types, min(len(fact_types), rng.choice((2, 3))))
        sents, mine = [intro.format(N=name)], []
        for fact in chosen:
            value, answers = _value(fact, rng, names)
            template = rng.choice(_FACTS[fact][0])
            sents.append(template.format(S=subject[0].upper() + subject[1:], s=subject, V=value))
            mine.append((fact, answers, subject))
        body = sents[1:] + rng.sample(_FILLERS, rng.randint(1, 3))
        rng.shuffle(body)
        docs.append(Document(f"calib{seed}-{i:03d}", " ".join([sents[0]] + body)))
        facts.append(mine)
    pool = tuple(docs)
    pairs = [(i, j) for i, fs in enumerate(facts) for j in range(len(fs))]
    rng.shuffle(pairs)
    items = []
    for k, (i, j) in enumerate(pairs[:n_questions]):
        fact, answers, subject = facts[i][j]
        n_same = sum(1 for m, fs in enumerate(facts) if m != i and any(f == fact for f, _, _ in fs))
        items.append(QAItem(
            id=f"{DATASET}-s{seed}-{k:03d}", question=_FACTS[fact][1].format(s=subject),
            answers=answers, documents=pool, context="retrieve",
            meta={"dataset": DATASET, "fact_type": fact, "gold_doc": docs[i].id,
                  "n_distractors_same_fact": n_same},
        ))
    return items


def _window(rng: random.Random, text: list[str], words: int) -> list[str]:
    start = rng.randint(0, max(0, len(text) - words))
    return text[start:start + words]


def _plant(rng: random.Random, window: list[str], sentence: str) -> tuple[str, float]:
    """`window` with `sentence` inserted between its first and last fifth; (text, depth)."""
    at = rng.randint(len(window) // 5, 4 * len(window) // 5)
    return " ".join(window[:at] + [sentence] + window[at:]), at / max(1, len(window))


def _essay_words(essays: list[str] | None) -> list[list[str]]:
    allowed = set(calibration_essays())
    chosen = list(essays) if essays is not None else sorted(allowed)
    if not chosen or not set(chosen) <= allowed:
        raise ValueError(f"needles are planted in calibration essays only; not: {sorted(set(chosen) - allowed)}")
    return [normalize_ws(essay_text(e)).split(" ") for e in chosen]


def _planted_needles(dataset: str, doc_prefix: str, *, seed: int, n: int, words: int, essays: list[str] | None,
                     facts: dict, pick_fact, make_value) -> list[QAItem]:
    """One fact of `facts` planted per item in a window of a calibration essay: ``pick_fact(k, kind, rng)``
    chooses its type, ``make_value(fact, rng, names)`` its value and acceptable answers."""
    rng = random.Random(f"{dataset}:{seed}")
    names = _Names(rng)
    names.used.extend(_reserved_names())
    texts = _essay_words(essays)
    items = []
    for k in range(n):
        window = _window(rng, texts[k % len(texts)], words)
        kind = rng.choice(list(_KINDS))
        fact = pick_fact(k, kind, rng)
        subject = _SUBJECT[kind].format(N=names.take(n_syll=(2, 3)))
        value, answers = make_value(fact, rng, names)
        sentence = rng.choice(facts[fact][0]).format(S=subject[0].upper() + subject[1:], s=subject, V=value)
        body, depth = _plant(rng, window, sentence)
        items.append(QAItem(
            id=f"{dataset}-s{seed}-{k:03d}", question=facts[fact][1].format(s=subject), answers=answers,
            documents=(Document(f"{doc_prefix}{seed}-{k:03d}", body),), context="all",
            meta={"dataset": dataset, "fact_type": fact, "depth": depth},
        ))
    return items


def calibration_needles(*, seed: int = 0, n: int = 12, words: int = 700,
                        essays: list[str] | None = None) -> list[QAItem]:
    """One planted fact per item in a window of a calibration essay (whole-document context).

    `essays`: the calibration essays to plant in (default: all of them); the
    translation lab passes the few it holds out of its training data."""
    return _planted_needles(f"{DATASET}-needle", "calib-needle", seed=seed, n=n, words=words, essays=essays,
                            facts=_FACTS, pick_fact=lambda k, kind, rng: rng.choice(_KINDS[kind][1]),
                            make_value=_value)


# Answers that must be copied character by character: register codes, call signs, archive numbers,
# invented multi-part names and words. `calibration_needles` asks mostly for common words and plain
# numbers, which a translated cache can get right by guessing near the value; the evaluation needles
# ask for passphrases, codes and invented names, and a map fitted on the former copied the latter
# wrong (eval/results/length_diagnosis/FINDINGS.md). Own templates and formats: none is an
# evaluation template, and no value is drawn from an evaluation word list (tested).
_CODE_FACTS = {
    "register": (["{S} is entered in the district register as {V}.", "The district register lists {s} as {V}."],
                 "Under which entry of the district register is {s} recorded?"),
    "callsign": (["{S} answers the radio to the call sign {V}.", "The radio call sign of {s} is {V}."],
                 "What is the radio call sign of {s}?"),
    "archive": (["The county archive files {s} under the number {V}.", "The county archive number of {s} is {V}."],
                "Under which number does the county archive file {s}?"),
    "surveyor": (["{S} was first mapped by the surveyor {V}.", "The surveyor {V} first mapped {s}."],
                 "Which surveyor first mapped {s}?"),
    "oldname": (["Before 1900 {s} was known as {V}.", "The name of {s} before 1900 was {V}."],
                "What was {s} called before 1900?"),
    "motto": (["The motto painted over the door of {s} reads {V}.", "Over the door of {s} is painted the motto {V}."],
              "Which motto is painted over the door of {s}?"),
}
_CODE_LETTERS = "BCDFGHJKLMNPRSTVWXZ"


def _code_value(fact: str, rng: random.Random, names: _Names) -> str:
    letters = lambda k: "".join(rng.choice(_CODE_LETTERS) for _ in range(k))  # noqa: E731
    digits = lambda k: "".join(str(rng.randint(0, 9)) for _ in range(k))  # noqa: E731
    if fact == "register":
        return f"{letters(2)}/{digits(rng.choice((4, 5)))}"
    if fact == "callsign":
        return f"{letters(3)}{digits(1)}{letters(1)}"
    if fact == "archive":
        return f"{digits(2)}.{digits(3)}.{digits(2)}"
    if fact == "surveyor":
        return f"{names.take(n_syll=(2, 2))} {names.take(n_syll=(2, 3))}-{names.take(n_syll=(2, 2))}"
    if fact == "oldname":
        return names.take(n_syll=(3, 4))
    return f"{names.take(n_syll=(2, 2)).lower()} {names.take(n_syll=(2, 3)).lower()}"   # motto


def _exact_needles(name: str, facts: dict, value, *, seed: int, n: int, words: int,
                   essays: list[str] | None) -> list[QAItem]:
    """Needles of `facts`, each format equally often, whose one answer ``value(fact, rng, names)`` must be
    copied exactly."""
    formats = list(facts)

    def make_value(fact, rng, names):
        answer = value(fact, rng, names)
        return answer, (answer,)

    return _planted_needles(f"{DATASET}-{name}", f"calib-{name}", seed=seed, n=n, words=words, essays=essays,
                            facts=facts, pick_fact=lambda k, kind, rng: formats[k % len(formats)],
                            make_value=make_value)


def calibration_code_needles(*, seed: int = 0, n: int = 12, words: int = 700,
                             essays: list[str] | None = None) -> list[QAItem]:
    """Like `calibration_needles`, with answers that must be copied exactly (see `_CODE_FACTS`)."""
    return _exact_needles("code-needle", _CODE_FACTS, _code_value, seed=seed, n=n, words=words, essays=essays)


# Codes made of common words and a number, joined by hyphens (diceware-style keys: "maple-sparrow-62"). A
# translated cache into Qwen2.5 starts such a code at its number (README, "Focus"); the code needles above are
# letters, digits and invented words. Own templates and word list: none is an evaluation template or needle word
# (tested).
_WORD_CODE_FACTS = {
    "wifi": (["Guests at {s} join the wireless network with the key {V}.", "The wireless key of {s} is {V}."],
             "Which key joins the wireless network at {s}?"),
    "booking": (["Tours of {s} are booked under the reference {V}.", "The booking reference of {s} is {V}."],
                "Under which reference are tours of {s} booked?"),
    "logbook": (["The night crew of {s} signs its logbook with {V}.", "{S} signs its logbook with {V}."],
                "With what does the night crew of {s} sign its logbook?"),
}
_CODE_WORDS = ["river", "pepper", "granite", "sparrow", "maple", "canyon", "lemon", "thistle", "beacon", "walnut",
               "crimson", "glacier", "hazel", "pebble", "cedar", "otter", "prism", "harvest", "cobble", "heron"]


def _word_code(rng: random.Random) -> str:
    first, second = rng.sample(_CODE_WORDS, 2)
    number = str(rng.randint(10, 99))
    return rng.choice((f"{first}-{second}-{number}", f"{first}-{number}-{second}", f"{number}-{first}-{second}"))


def calibration_word_code_needles(*, seed: int = 0, n: int = 12, words: int = 700,
                                  essays: list[str] | None = None) -> list[QAItem]:
    """Like `calibration_code_needles`, with codes of two common words and a number (see `_WORD_CODE_FACTS`)."""
    return _exact_needles("word-code-needle", _WORD_CODE_FACTS, lambda fact, rng, names: _word_code(rng),
                          seed=seed, n=n, words=words, essays=essays)


# What a calibration needle asks for → the function that makes it (`eval/diagnose_length.py --material`).
NEEDLE_MATERIALS = {"facts": calibration_needles, "codes": calibration_code_needles,
                    "wordcodes": calibration_word_code_needles}
