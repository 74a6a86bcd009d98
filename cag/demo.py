"""`cag demo`: the main job in one command, on a small bundled knowledge base.

1. **Nightly build**: the source model (default SmolLM2-135M) prefills the
   handbook of a fictional rail museum (`examples/data/handbook/`, 18 short
   documents written for this project) into a store, once; a second run finds
   every document unchanged and prefills nothing.
2. **Queries**: the target model (default Qwen2.5-0.5B) answers a few questions
   about it (`examples/data/handbook_questions.jsonl`) through the path the
   quality gate picks (`cag.gate`: the fastest cached path whose measured lookup
   fidelity passes, else direct context), and through direct context (the target
   prefills the same retrieved text), timing the first token of each.
3. **The table**: question, expected answer, answer, whether it is right, the
   path, both TTFTs and the speedup.

Point it at your own folder with ``cag demo --corpus DIR --questions FILE.jsonl``
(one ``{"question": ..., "answers": [...]}`` per line).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
DEFAULT_CORPUS = DATA / "handbook"
DEFAULT_QUESTIONS = DATA / "handbook_questions.jsonl"


@dataclass
class DemoRow:
    question: str
    expected: str
    answer: str
    correct: bool
    path: str
    ttft_s: float
    direct_answer: str
    direct_correct: bool
    direct_ttft_s: float
    speedup: float
    sources: list[str]
    # When the gate serves direct context, what the fastest cached path it refused would have
    # answered, and how fast: the speed it would buy and the quality it would cost, side by side.
    unserved_path: str = ""
    unserved_answer: str = ""
    unserved_correct: bool | None = None
    unserved_ttft_s: float | None = None


def load_questions(path: Path) -> list[tuple[str, list[str]]]:
    """``(question, acceptable answers)`` per line of a JSONL file; a clear error otherwise."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            question, answers = str(obj["question"]), [str(a) for a in obj["answers"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: need {{\"question\": ..., \"answers\": [...]}} ({exc})") from None
        if not question.strip() or not answers:
            raise ValueError(f"{path}:{n}: empty question or no answers")
        out.append((question, answers))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def is_correct(answer: str, answers: list[str]) -> bool:
    """The gold answer (any acceptable form) appears in the answer, SQuAD-normalised."""
    from eval.metrics import contains_answer

    return bool(contains_answer(answer, answers))


def _ttft(answer) -> float:
    """Time to first token without retrieval (the same search for every path)."""
    return answer.timings.first_token - answer.timings.retrieve


def run_demo(*, store: Path, corpus: Path = DEFAULT_CORPUS, questions: Path = DEFAULT_QUESTIONS,
             source: str = "smollm2-135m", target: str = "qwen2.5-0.5b", top_k: int = 3,
             max_new_tokens: int = 24, log=lambda message: None) -> dict[str, Any]:
    """Build (incrementally), answer every question both ways, return the report."""
    from cag.context import CachedContext
    from cag.models import registry
    from stores.build import build_store

    qs = load_questions(questions)
    log(f"cag demo: nightly build of {corpus} with {source} → {store}")
    t = time.perf_counter()
    summary = build_store(corpus, store, registry.load(source, "auto"))
    build = {"documents": summary.documents, "chunks": summary.chunks, "prefilled": summary.chunks_prefilled,
             "reused": summary.chunks_reused, "seconds": round(time.perf_counter() - t, 2)}
    log(f"cag demo: {summary.documents} documents, {summary.chunks} chunks, "
        f"{summary.chunks_prefilled} prefilled now, in {build['seconds']:.1f} s")
    ctx = CachedContext(store=store, target=target, top_k=top_k, max_new_tokens=max_new_tokens)
    refused = None  # the fastest cached path the gate refused, served here only to show it
    try:
        log(f"cag demo: loading {target}; the quality gate chooses the serving path")
        decision = ctx.decision
        log(f"cag demo: path {decision.path!r}: {decision.reason}")
        if decision.path == "direct" and decision.rejected:
            refused = CachedContext(store=store, target=target, top_k=top_k, max_new_tokens=max_new_tokens,
                                    min_retention=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the gate's reason is reported once, above
            # One untimed query per path first: first-call costs (mapper load, kernels) are not TTFT.
            for c in (ctx, refused):
                if c is not None:
                    c.answer(qs[0][0], max_new_tokens=1)
            ctx.answer_direct(qs[0][0], max_new_tokens=1)
            rows = []
            for i, (question, answers) in enumerate(qs, 1):
                hits = ctx.retrieve(question)
                direct = ctx.answer_direct(question, hits)
                # When the gate serves direct context, that *is* the answer: not run twice.
                cached = direct if decision.path == "direct" else ctx.answer(question, hits)
                ttft = _ttft(cached)
                row = DemoRow(question, answers[0], cached.text.strip(), is_correct(cached.text, answers),
                              decision.path, round(ttft, 4), direct.text.strip(), is_correct(direct.text, answers),
                              round(_ttft(direct), 4), round(_ttft(direct) / ttft, 2) if ttft > 0 else 0.0,
                              [h.doc_id for h in cached.sources])
                if refused is not None:
                    other = refused.answer(question, hits)
                    row.unserved_path, row.unserved_answer = other.path, other.text.strip()
                    row.unserved_correct = is_correct(other.text, answers)
                    row.unserved_ttft_s = round(_ttft(other), 4)
                rows.append(row)
                log(f"cag demo: {i}/{len(qs)} answered ({decision.path})")
    finally:
        ctx.close()
        if refused is not None:
            refused.close()
    return {"store": str(store), "corpus": str(corpus), "source": source, "target": target,
            "gate": decision.to_dict(), "build": build, "questions": [asdict(r) for r in rows],
            "correct": sum(r.correct for r in rows), "direct_correct": sum(r.direct_correct for r in rows),
            "note": "TTFT excludes retrieval (the same for both); both answer from the same retrieved chunks"}
