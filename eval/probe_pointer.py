"""Does any head of the target point at the answer's first token through a translated cache?

    python eval/probe_pointer.py --target qwen2.5-0.5b \\
        --stores eval/results/copy_prior/qwen-text-stop-code --out eval/results/first_token/pointer-qwen

The copy prior cannot choose the answer's first token (`eval/probe_first_token.py`: greedy starts 10 of the
gate's 24 calibration codes wrong into Qwen2.5). Retrieval heads (Wu et al., 2024) are heads whose strongest
attention, at the position that predicts a copied token, falls on that token in the context. If some head of the
target still points at the answer's first token when the context's keys are translated, that head is a pointer
the copy prior could start from.

For each calibration item: the store's chunks for the question, translated as the plain path serves them and
placed as stored (`Assembler.heads_attention(last_token=True)`); for every (layer, head), whether its most
attended context position is a token that covers the gold answer's first character where the answer occurs in
the chunks' text. Heads are ranked on 30 `calib-lookup` questions of another seed (`--choose-seed`, its own
store) and read on the gate's items: its 30 lookups (seed 0) and 24 codes (seed 900), so neither figure is
chosen on itself. Items whose answer does not occur in the placed text are counted apart. Rows: OUT/rows.jsonl (resumable); summary: OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval.calibrate_copy_prior import append_row, part_items, part_store, read_rows  # noqa: E402
from eval.diagnose_length import translated_chunks  # noqa: E402
from eval.harness import ItemRunner, host_info  # noqa: E402

PARTS = ("choose", "lookups", "codes")


def items_of(part: str, choose_seed: int, target: str = "", n_needles: int = 12) -> list:
    """A part's items; "M@L": `n_needles` needles of material M ("codes", "wordcodes", "facts") in L target tokens
    of one held-out essay, read whole (`eval/diagnose_length.py`'s calibration material, seeds 300 + L)."""
    if "@" in part:
        from cag.models import registry
        from eval.diagnose_length import needles

        material, length = part.split("@")
        return needles(int(length), n_needles, registry.load(target, "auto").tokenizer, material=material)
    if part == "choose" or part.startswith("lookups-s"):  # "lookups-sN": all 60 calibration lookups of seed N
        from eval.calibration_lookup import calibration_lookup

        return calibration_lookup(seed=choose_seed)[:30] if part == "choose" else calibration_lookup(seed=int(part[9:]))
    return part_items(part)


def gold_positions(chunks, texts: list[str], answer: str, n_prefix: int) -> list[int]:
    """Placed positions of the tokens covering the first character of each occurrence of `answer`."""
    found, start = [], n_prefix
    for chunk, text in zip(chunks, texts):
        at = text.find(answer)
        while at >= 0:
            offsets = chunk.offsets.tolist()
            found += [start + i for i, (a, b) in enumerate(offsets) if a <= at < b]
            at = text.find(answer, at + 1)
        start += chunk.num_tokens
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--method", default="bottleneck", help="'identity' probes the target's own chunks")
    ap.add_argument("--stores", type=Path, help="a calibrate_copy_prior.py OUT whose store-<part> folders to reuse")
    ap.add_argument("--top", type=int, default=8, help="how many of the choosing items' best heads to read")
    ap.add_argument("--choose-seed", type=int, default=5, help="calib-lookup seed of the items that rank the heads")
    ap.add_argument("--needle-lengths", type=int, nargs="*", default=[], help="also read the heads on code needles "
                    "at these lengths, the whole haystack placed (diagnosis, not ranking)")
    ap.add_argument("--needles", type=int, default=12, help="code needles per length")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    parts = [*PARTS, *(f"codes@{n}" for n in args.needle_lengths)]
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = {(r["part"], r["item"]): r for r in read_rows(rows_path)}
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", ""), "target": args.target, "method": args.method,
            "choose_seed": args.choose_seed}
    for part in parts:
        items = items_of(part, args.choose_seed, args.target, args.needles)
        store = part_store(part, items, args.source, args.stores, args.out)
        ctx = CachedContext(store=store, target=args.target, mapper=args.method, top_k=4, translation_cache_mb=0)
        runner, asm = ItemRunner(ctx, {}), ctx.assembler
        n_prefix = asm.prefix().num_tokens
        meta["artifact"] = getattr(ctx.active_mapper, "artifact_id", args.method)
        with Progress(f"pointer: {part}", total=len(items), unit="items", interval_s=20) as bar:
            for item in items:
                if (part, item.id) in done:
                    bar.advance(1)
                    continue
                # the chunks `cag eval` places for the item, in `CachedContext.prepare`'s order
                chunks, used = translated_chunks(ctx, item, ctx._order(runner.hits_for(item)))
                texts = [h.text for h in used]
                gold = gold_positions(chunks, texts, item.answers[0], n_prefix)
                row = {"part": part, "item": item.id, "answer": item.answers[0], "in_context": bool(gold)}
                if gold:
                    (mass,) = asm.heads_attention(chunks, [asm.question_ids(item.question)], last_token=True)
                    pointed = mass[:, :, n_prefix:].argmax(-1) + n_prefix  # [layers, heads]
                    hit = torch.isin(pointed, torch.tensor(gold))
                    row["hits"] = hit.int().tolist()
                    mean_pointed = int(mass[:, :, n_prefix:].mean(dim=(0, 1)).argmax()) + n_prefix
                    row["mean_hit"] = mean_pointed in gold
                append_row(rows_path, row)
                done[(part, item.id)] = row
                bar.advance(1)
    by_part = {p: [r for r in done.values() if r["part"] == p] for p in parts}
    hits = {p: torch.tensor([r["hits"] for r in rows if r["in_context"]], dtype=torch.float32)
            for p, rows in by_part.items()}
    choose = hits["choose"].mean(0)
    order = torch.argsort(choose.flatten(), descending=True)[:args.top]
    chosen = [(int(i) // choose.shape[1], int(i) % choose.shape[1]) for i in order]
    best = [{"layer": l, "head": h, **{p: round(float(hits[p][:, l, h].mean()), 3) if len(hits[p]) else None
                                        for p in parts}} for l, h in chosen]
    summary = {"run": meta, "n": {p: len(rows) for p, rows in by_part.items()},
               "answer_in_context": {p: sum(r["in_context"] for r in rows) for p, rows in by_part.items()},
               "mean_of_heads_hit": {p: sum(bool(r.get("mean_hit")) for r in rows) for p, rows in by_part.items()},
               "best_heads": best}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# Pointer heads through the {args.method} path ({args.target}, {meta.get('artifact', '')})", "",
             f"`{meta['command']}`", "", f"{meta['date']}, {meta['host']}.", "",
             "| items | n | answer in the placed chunks | all heads' mean points at its first token |",
             "| --- | --- | --- | --- |"]
    names = {"choose": f"calib-lookup seed {args.choose_seed} (ranks the heads)", "lookups": "the gate's lookups",
             "codes": "the gate's codes", **{f"codes@{n}": f"code needles in {n} tokens of one essay, whole"
                                             for n in args.needle_lengths}}
    lines += [f"| {names[p]} | {summary['n'][p]} | {summary['answer_in_context'][p]} | "
              f"{summary['mean_of_heads_hit'][p]} |" for p in parts]
    lines += ["", f"The best {args.top} heads on the first row's items; each cell: the share of items (answer in "
              "context) where the head's strongest context position, from the question's last token, is the "
              "answer's first token.", "", "| layer | head | " + " | ".join(names[p] for p in parts) + " |",
              "| --- | --- | " + " | ".join("---" for _ in parts) + " |"]
    lines += [f"| {b['layer']} | {b['head']} | " + " | ".join(str(b[p]) for p in parts) + " |" for b in best]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
