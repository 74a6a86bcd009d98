"""Does the plain translated path answer more when it reads fewer chunks: the ones the question is about?

    python eval/probe_focus.py --target qwen2.5-0.5b --stores eval/results/copy_prior/qwen-text-stop-code \\
        --needle-stores eval/results/first_token/pointer-qwen --out eval/results/focus/qwen

Why: in a whole haystack the translated keys of the other chunks drown the answer (eval/TRANSLATION.md, "Where
it breaks with length"). Damping them × 0.3 did not help, even around the right chunk, because flat logits over
thousands of tokens still collect mass. Leaving them out does remove that mass. The translated path then reads
a short context, where the lab's single-chunk needles are found 25 of 40 times (native 31).

Which chunks to keep is chosen without the answer, from what a query already has:
- `retriever`: each chunk's best sentence by the retriever's cosine similarity to the question (the index's
  sentence vectors; no model forward);
- `fused`: the same sentences ranked by the retriever and the source model's contrastive attention together
  (`cag.selection.fused_sentence_scores`, what the served crux path recomputes).
For each scorer and m, the m best chunks are placed in document order and answered as the served plain path does
(`CachedContext.prepare` with the copy prior and the pointer head). `all` places every chunk: the baseline.
Also recorded, per scorer: the rank of the best chunk holding the gold answer (diagnosis only).

Items: the gate's calibration parts (30 lookups, 24 codes, 36 essay questions) and calibration code needles in
one held-out essay read whole (`--needle-lengths`, eval/diagnose_length.py). Never an evaluation set.
Rows: OUT/rows.jsonl (resumable); summary: OUT/summary.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag import selection  # noqa: E402
from cag.context import CachedContext  # noqa: E402
from cag.generate import generate, stop_token_ids  # noqa: E402
from cag.kv import KVChunk  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval import metrics  # noqa: E402
from eval.calibrate_copy_prior import append_row, part_store, read_rows, write_summary  # noqa: E402
from eval.eval_chunk_dtype import paired_delta  # noqa: E402
from eval.harness import ItemRunner, host_info  # noqa: E402
from eval.probe_pointer import items_of  # noqa: E402

SCORERS = ("retriever", "fused")


def sentence_scores(ctx: CachedContext, question: str, used: list, scorer: str) -> list[list[float]]:
    """Per chunk of `used`, per sentence: the retriever's similarity, or its rank fusion with the source model's
    contrastive attention (as `CachedContext._guided_spans` ranks them for `source_retriever`)."""
    manifest, index = ctx._current_view()
    texts = [h.text for h in used]
    retriever = selection.retriever_sentence_scores(index.embed, texts, question,
                                                    [index.sentence_vectors(h.key) for h in used])
    if scorer == "retriever":
        return retriever
    heads = selection.retrieval_heads(manifest.source_fingerprint.id)
    upto = max(layer for layer, _ in heads) + 1 if heads else None
    source_chunks = [KVChunk.from_bytes(ctx._chunks.get(h.key), expect_model=manifest.source_fingerprint,
                                        first_layers=upto) for h in used]
    source = selection._source_sentence_scores(ctx._source_assembler(), source_chunks, texts, question, heads)
    return selection.fused_sentence_scores(source, retriever)


def chunk_scores(scores: list[list[float]]) -> list[float]:
    """Each chunk's best sentence (a chunk without sentences last)."""
    return [max(s, default=float("-inf")) for s in scores]


def answer(runner: ItemRunner, ctx: CachedContext, item, hits, weight: float, code_start: bool = False,
           anchor_pointer: bool | None = None, end_stops: bool | None = None,
           first_weight: float | None = None, without_cache: bool = False) -> dict:
    """The served plain path's answer; `without_cache`: a control, the same copy prior (the chunks' text, the
    pointer's words) over a model that reads the prompt head and the question only, no context cache."""
    lm = runner.lm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ctx.prepare(item.question, hits, max_new_tokens=runner.max_new_tokens, with_question=True,
                               copy_prior=weight)
    # experiments on the served prior: TextCopyPrior's attributes of these names, where given
    overrides = {"code_start": code_start or None, "anchor_pointer": anchor_pointer, "end_stops": end_stops,
                 "first_weight": first_weight}
    for name, value in overrides.items():
        if value is not None and prepared.copy_prior is not None:
            setattr(prepared.copy_prior, name, value)
    cache, first_logits = copy.deepcopy(prepared.cache), prepared.first_logits
    if without_cache:
        with ctx.assembler.model_lock:
            cache, first_logits = ctx.assembler.direct_cache([]), None
    gen = generate(lm.model, lm.tokenizer, cache, prepared.question_ids,
                   max_new_tokens=runner.max_new_tokens, stop_ids=stop_token_ids(lm.tokenizer),
                   first_logits=first_logits, copy_prior=prepared.copy_prior)
    return {"answer": gen.text.strip(), "found": metrics.contains_answer(gen.text, item.answers),
            "f1": metrics.token_f1(gen.text, item.answers), "context_tokens": prepared.answer.context_tokens}


def variants(scorers: list[str], keep: list[int], budgets: list[int]) -> list[str]:
    return ["all", *(f"{s}@{m}" for s in scorers for m in keep), *(f"{s}<={b}" for s in scorers for b in budgets)]


def summarize(rows: list[dict], parts: list[str], scorers: list[str], keep: list[int],
              budgets: list[int]) -> list[dict]:
    table = []
    for part in parts:
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        base = [r["by_variant"]["all"] for r in mine]
        for v in variants(scorers, keep, budgets):
            got = [r["by_variant"][v] for r in mine]
            line = {"part": part, "variant": v, "n": len(mine), "found": int(sum(g["found"] for g in got)),
                    "f1": round(sum(g["f1"] for g in got) / len(got), 4),
                    "tokens": round(sum(g["context_tokens"] for g in got) / len(got))}
            if v != "all":
                line["d_found"] = paired_delta([b["found"] for b in base], [g["found"] for g in got])
                line["d_f1"] = paired_delta([b["f1"] for b in base], [g["f1"] for g in got])
            table.append(line)
        for s in scorers:
            ranks = [r["gold_rank"][s] for r in mine if r["gold_rank"].get(s) is not None]
            table.append({"part": part, "variant": f"gold rank by {s}", "n": len(ranks),
                          "top1": sum(k == 0 for k in ranks), "top2": sum(k <= 1 for k in ranks),
                          "chunks": round(sum(r["chunks"] for r in mine) / len(mine), 1)})
    return table


def render(table: list[dict], meta: dict) -> str:
    def iv(d):
        return f"{d['delta']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]" if d else ""
    out = [f"# Focus: the plain translated path over its best chunks only ({meta['target']}, {meta['method']} "
           f"{meta.get('artifact', '')}, copy prior {meta['copy_prior']:g})", "", f"`{meta['command']}`", "",
           f"{meta['date']}, {meta['host']}; greedy, {meta['max_new_tokens']} new tokens.", "",
           "| part | variant | n | found | F1 | context tokens | Δfound vs all [95%] | ΔF1 vs all [95%] |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {t['part']} | {t['variant']} | {t['n']} | {t['found']} | {t['f1']:.3f} | {t['tokens']} | "
            f"{iv(t.get('d_found'))} | {iv(t.get('d_f1'))} |" for t in table if "found" in t]
    out += ["", "Where the gold answer's text is in a placed chunk: the rank of its best such chunk.", "",
            "| part | scorer | n | first | in the first two | chunks placed (mean) |", "| --- | --- | --- | --- | --- | --- |"]
    out += [f"| {t['part']} | {t['variant']} | {t['n']} | {t['top1']} | {t['top2']} | {t['chunks']} |"
            for t in table if "top1" in t]
    return "\n".join(out) + "\n"


def add_probe_args(ap: argparse.ArgumentParser, *, needle_lengths: list[int], needles: int) -> None:
    """The items, models and decoding a probe over calibration parts shares (this one, probe_sentence_pointer)."""
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--method", default="bottleneck")
    ap.add_argument("--parts", nargs="*", default=["lookups", "codes", "essays"])
    ap.add_argument("--needle-lengths", type=int, nargs="*", default=needle_lengths)
    ap.add_argument("--needles", type=int, default=needles, help="needles per length")
    ap.add_argument("--material", default="codes", help="what the needles ask for: codes or wordcodes "
                    "(eval.calibration_lookup.NEEDLE_MATERIALS)")
    ap.add_argument("--copy-prior", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=16, help="the gate's budget")
    ap.add_argument("--stores", type=Path, help="a calibrate_copy_prior.py OUT whose store-<part> to reuse")
    ap.add_argument("--needle-stores", type=Path, help="a probe_pointer.py or probe_focus.py OUT whose "
                    "store-MATERIAL@L to reuse")


def probe_run(args, **meta) -> tuple[list[str], Path, dict, dict]:
    """The parts, the rows file, the rows done so far (resumable) and the run's record."""
    parts = [*args.parts, *(f"{args.material}@{n}" for n in args.needle_lengths)]
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = {(r["part"], r["item"]): r for r in read_rows(rows_path)}
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", ""), "target": args.target, "method": args.method,
            "copy_prior": args.copy_prior, "max_new_tokens": args.max_new_tokens, **meta}
    return parts, rows_path, done, meta


def part_context(args, part: str, meta: dict, **settings) -> tuple[list, CachedContext, ItemRunner]:
    """One part's items, and the plain translated path over its store (`settings`: CachedContext fields)."""
    items = items_of(part, 0, args.target, args.needles)
    stores = args.needle_stores if "@" in part else args.stores
    store = part_store(part, items, args.source, stores, args.out)
    ctx = CachedContext(store=store, target=args.target, mapper=args.method, top_k=4, translation_cache_mb=0,
                        max_new_tokens=args.max_new_tokens, min_retention=0, **settings)
    meta["artifact"] = getattr(ctx.active_mapper, "artifact_id", args.method)
    return items, ctx, ItemRunner(ctx, {}, max_new_tokens=args.max_new_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(ap, needle_lengths=[1024, 4096], needles=12)
    ap.add_argument("--scorers", nargs="+", choices=SCORERS, default=list(SCORERS))
    ap.add_argument("--keep", type=int, nargs="*", default=[1, 2], help="how many of the best chunks to place")
    ap.add_argument("--budgets", type=int, nargs="*", default=[], help="also: the best chunks within this many "
                    "target tokens (the best one always)")
    ap.add_argument("--code-start", action="store_true", help="every variant's prior with TextCopyPrior.code_start")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    parts, rows_path, done, meta = probe_run(args, scorers=args.scorers, keep=args.keep, budgets=args.budgets,
                                             code_start=args.code_start)
    for part in parts:
        # translated_focus_tokens=0: the query path places what it is given; this script chooses the chunks
        items, ctx, runner = part_context(args, part, meta, translated_focus_tokens=0)
        with Progress(f"focus: {part}", total=len(items), unit="items", interval_s=20) as bar:
            for item in items:
                if (part, item.id) in done:
                    bar.advance(1)
                    continue
                used = ctx._order(runner.hits_for(item))  # as `CachedContext.prepare` places them
                holds = [i for i, h in enumerate(used) if any(a in h.text for a in item.answers)]
                row = {"part": part, "item": item.id, "answers": list(item.answers), "chunks": len(used),
                       "gold_chunks": holds, "gold_rank": {}, "by_variant": {}}
                row["by_variant"]["all"] = answer(runner, ctx, item, used, args.copy_prior, args.code_start)
                sizes = [runner.lm.tokenize(h.text)[0].numel() for h in used]
                for scorer in args.scorers:
                    best = chunk_scores(sentence_scores(ctx, item.question, used, scorer))
                    order = sorted(range(len(best)), key=lambda i: -best[i])
                    row["gold_rank"][scorer] = min((order.index(i) for i in holds), default=None)
                    chosen = {**{f"{scorer}@{m}": order[:m] for m in args.keep},
                              **{f"{scorer}<={b}": selection.best_within(sizes, best, b) for b in args.budgets}}
                    for name, keep in chosen.items():
                        kept = [used[i] for i in sorted(keep)]
                        row["by_variant"][name] = answer(runner, ctx, item, kept, args.copy_prior, args.code_start)
                append_row(rows_path, row)
                done[(part, item.id)] = row
                bar.advance(1)
    rows = [r for r in done.values() if r["part"] in parts]
    table = summarize(rows, parts, args.scorers, args.keep, args.budgets)
    write_summary(args.out, meta, table, render(table, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
