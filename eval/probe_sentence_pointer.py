"""Does the first answer token start right more often when the pointer may only choose among the words of the
retriever's best sentences?

    python eval/probe_sentence_pointer.py --target qwen2.5-0.5b --stores eval/results/copy_prior/qwen-text-stop-code \\
        --needle-stores eval/results/focus/qwen-wordcodes --material wordcodes --sentences 0 1 2 3 \\
        --out eval/results/sentence_pointer/qwen-wordcodes

Why: on the plain translated path the pointer head (`cag.copy_prior.pointer_starts`) looks from the question's
last token over every placed word, and a translated cache often points at a wrong one ("28800" for
amber-quartz-28, "ipso facto"). The retriever already knows which sentences are about the question: the index
holds each sentence's vector, so choosing them costs no model forward. `CachedContext(pointer_sentences=k)`
keeps the pointer's mass on the words of the k best sentences only; the model's own distribution and the rest
of the copy prior are unchanged. k = 0 is the path as served before. A variant "kq" also leaves out the question's
own words (`CachedContext(pointer_skips_question=True)`): within the right sentence a translated cache's pointer
often lands on the entity it was asked about, and the answer then restates it and stops. With an "a" suffix
the first token, where it starts a word the pointer chose, copies that word to its end
(`TextCopyPrior.anchor_pointer`): a first piece such as "pr" otherwise continues from any of its occurrences.
A "c" suffix kept the k best sentences' whole chunks (`pointer_scope="chunk"`, measured at commit 300ffcb and
retired: fewer found). With an "e" suffix a chunk's text that ends at a full stop ends the answer copied up to it
(`TextCopyPrior.end_stops`). With a "w" suffix each best sentence is read whole across the text's line wraps
(`PointerRules.wrapped`, `cag.selection.wrapped_sentence`): the index's sentences end at every newline, so in
hard-wrapped essays the best one is a line and the answer often stands on the next. With a "t" suffix an
answer copied up to a best sentence's final punctuation ends there (`PointerRules.sentence_stops`), as "e" ends
it at a chunk's. Two controls measure what the translated cache itself adds to these rules: "u" gives the
pointer's words equal mass (no head's attention), "n" answers with a model that reads no context cache at all,
only the copy prior over the chunks' text; "un" is the rules alone, a text-only extractor. An "s" suffix kept
the model from stopping inside a clause of the context (`TextCopyPrior(words="clause")`, measured at commit
6bdeae9 and retired: more found, lower F1). A suffix "@W" sets the pointer's weight on the first token (served:
0.4, `pointer_heads.json`).

Each item is answered once per k on the served plain path (`CachedContext.prepare`: focus, copy prior 0.5,
pointer head, the code start), nothing else changed. Items: the gate's calibration parts (30 lookups, 24 codes,
36 essay questions) and calibration needles (`--material`, `--needle-lengths`) in held-out lab essays. Never an
evaluation set. Rows: OUT/rows.jsonl (resumable; a rerun with more variants answers only those, and an
item's last row wins); summary: OUT/summary.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cag.copy_prior  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval.calibrate_copy_prior import append_row, read_rows, write_summary  # noqa: E402
from eval.eval_chunk_dtype import paired_delta  # noqa: E402
from eval.probe_focus import add_probe_args, answer, part_context, probe_run  # noqa: E402


@contextlib.contextmanager
def uniform_pointer(on: bool):
    """A control: the pointer's words as chosen, each with the same mass (no head's attention read)."""
    served = cag.copy_prior.pointer_starts
    if on:
        def even(*args, **kwargs):
            starts = served(*args, **kwargs)
            return {w: 1.0 / len(starts) for w in starts}
        cag.copy_prior.pointer_starts = even
    try:
        yield
    finally:
        cag.copy_prior.pointer_starts = served


@contextlib.contextmanager
def rules_as(**fields):
    """The served `PointerRules` with `fields` set as the variant asks (the context reads them per query)."""
    served = cag.copy_prior.pointer_rules
    cag.copy_prior.pointer_rules = lambda fingerprint_id, path=None: dataclasses.replace(
        served(fingerprint_id, path), **fields)
    try:
        yield
    finally:
        cag.copy_prior.pointer_rules = served


def summarize(rows: list[dict], parts: list[str], ks: list[str]) -> list[dict]:
    table = []
    for part in parts:
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        base = [r["by_k"][ks[0]] for r in mine]
        for k in ks:
            got = [r["by_k"][k] for r in mine]
            line = {"part": part, "k": k, "n": len(mine), "found": int(sum(g["found"] for g in got)),
                    "f1": round(sum(g["f1"] for g in got) / len(got), 4)}
            if k != ks[0]:
                line["d_found"] = paired_delta([b["found"] for b in base], [g["found"] for g in got])
                line["d_f1"] = paired_delta([b["f1"] for b in base], [g["f1"] for g in got])
                line["gained"] = sum(g["found"] > b["found"] for b, g in zip(base, got))
                line["lost"] = sum(g["found"] < b["found"] for b, g in zip(base, got))
            table.append(line)
    return table


def render(table: list[dict], meta: dict, ks: list[str]) -> str:
    def iv(d):
        return f"{d['delta']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]" if d else ""

    def gained_lost(t):
        return f"{t['gained']} / {t['lost']}" if "gained" in t else ""
    out = [f"# The pointer within the retriever's best sentences ({meta['target']}, {meta['method']} "
           f"{meta.get('artifact', '')}, copy prior {meta['copy_prior']:g})", "", f"`{meta['command']}`", "",
           f"{meta['date']}, {meta['host']}; greedy, {meta['max_new_tokens']} new tokens; k = 0 is the pointer "
           "over every placed word; q: the question's own words left out; a: the pointer's word copied to its end; "
           "e: a chunk's final full stop ends the answer.", "",
           f"| part | k | n | found | F1 | gained / lost vs k={ks[0]} | Δfound [95%] | ΔF1 [95%] |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {t['part']} | {t['k']} | {t['n']} | {t['found']} | {t['f1']:.3f} | "
            f"{gained_lost(t)} | {iv(t.get('d_found'))} | "
            f"{iv(t.get('d_f1'))} |" for t in table]
    totals = {}
    for t in table:
        totals.setdefault(t["k"], [0, 0])
        totals[t["k"]][0] += t["found"]
        totals[t["k"]][1] += t["n"]
    out += ["", "All parts: " + ", ".join(f"k={k}: {f} of {n}" for k, (f, n) in totals.items())]
    return "\n".join(out) + "\n"


def ablation(outs: list[Path], variants: list[str], steps: list[tuple[str, str]]) -> str:
    """One table over several runs' rows (found per part and variant), and the paired change of each step; the
    items answered under every variant only."""
    parts: dict[str, list[dict]] = {}
    for out in outs:
        for r in {(r["part"], r["item"]): r for r in read_rows(out / "rows.jsonl")}.values():
            if all(v in r["by_k"] for v in variants):
                parts.setdefault(r["part"], []).append(r)
    every = [r for rows in parts.values() for r in rows]
    lines = ["| part | n | " + " | ".join(variants) + " |", "| --- | --- |" + " --- |" * len(variants)]
    for part, rows in [*parts.items(), ("all", every)]:
        found = [str(int(sum(r["by_k"][v]["found"] for r in rows))) for v in variants]
        lines.append(f"| {part} | {len(rows)} | " + " | ".join(found) + " |")
    f1 = [f"{sum(r['by_k'][v]['f1'] for r in every) / max(len(every), 1):.3f}" for v in variants]
    lines.append(f"| F1 (mean, all) | {len(every)} | " + " | ".join(f1) + " |")
    lines += ["", "| step | gained | lost | Δfound [95%] |", "| --- | --- | --- | --- |"]
    for a, b in steps:
        x, y = [r["by_k"][a]["found"] for r in every], [r["by_k"][b]["found"] for r in every]
        d = paired_delta(x, y)
        lines.append(f"| {a} → {b} | {sum(q > p for p, q in zip(x, y))} | {sum(q < p for p, q in zip(x, y))} | "
                     f"{d['delta']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(ap, needle_lengths=[1024, 2048, 4096], needles=24)
    ap.add_argument("--sentences", nargs="+", default=["0", "1", "2", "3"],
                    help="variants: k (CachedContext.pointer_sentences), with suffixes q: pointer_skips_question, "
                    "a: TextCopyPrior.anchor_pointer, e: TextCopyPrior.end_stops, w: PointerRules.wrapped, "
                    "t: PointerRules.sentence_stops, u: (control) the pointer's words at equal mass, n: (control) the "
                    "model reads no context cache, @W: the pointer's weight on the "
                    "first token (served: pointer_heads.json's); the first is the baseline")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ablation", type=Path, nargs="+", help="print one table over these runs' rows "
                    "(variants: --sentences; steps: each variant against the first, and --steps) and stop")
    ap.add_argument("--steps", nargs="*", default=[], help="A>B pairs for --ablation")
    args = ap.parse_args(argv)
    bad = [v for v in args.sentences if not re.fullmatch(r"\d+q?a?e?w?t?u?n?(@[0-9.]+)?", v)]
    if bad and not args.ablation:  # the ablation reads old rows too (c, s: the retired chunk scope and clause)
        ap.error(f"variants are k followed by any of q, a, e, w, t, u, n in that order, then @W, got {bad}")
    if args.ablation:
        steps = [(args.sentences[0], v) for v in args.sentences[1:]] + [tuple(s.split(">")) for s in args.steps]
        print(ablation(args.ablation, args.sentences, steps), end="")
        return 0
    if args.out is None:
        ap.error("--out is required (unless --ablation)")
    parts, rows_path, done, meta = probe_run(args, sentences=args.sentences)
    for part in parts:
        # the served path: the target's focus budget and code start; only the first token's rules vary
        items, ctx, runner = part_context(args, part, meta)
        with Progress(f"sentence pointer: {part}", total=len(items), unit="items", interval_s=20) as bar:
            for item in items:
                # a row answered under other variants gets only the missing ones: the item's last row wins
                row = done.get((part, item.id)) or {"part": part, "item": item.id, "answers": list(item.answers),
                                                     "by_k": {}}
                missing = [k for k in args.sentences if k not in row["by_k"]]
                if not missing:
                    bar.advance(1)
                    continue
                hits = runner.hits_for(item)
                for k in missing:
                    ctx.pointer_sentences, ctx.pointer_skips_question = int(re.match(r"\d+", k)[0]), "q" in k
                    weight = float(k.split("@")[1]) if "@" in k else None
                    with rules_as(wrapped="w" in k, sentence_stops="t" in k), uniform_pointer("u" in k):
                        row["by_k"][k] = answer(runner, ctx, item, hits, args.copy_prior, anchor_pointer="a" in k,
                                                end_stops="e" in k, first_weight=weight, without_cache="n" in k)
                append_row(rows_path, row)
                done[(part, item.id)] = row
                bar.advance(1)
    # one row per item again (a rerun appended updated rows): written aside, then moved over the old file
    tmp = rows_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    tmp.replace(rows_path)
    rows = [r for r in done.values() if r["part"] in parts]
    table = summarize(rows, parts, args.sentences)
    write_summary(args.out, meta, table, render(table, meta, args.sentences))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
