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
the chunks' text. Heads are ranked on the lookups (`calib-lookup` seed 0) and the ranking is read on the codes
(seed 900, other items), so the codes' figure is not chosen on themselves. Items whose answer does not occur in
the placed text are counted apart. Rows: OUT/rows.jsonl (resumable); summary: OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext, Timings  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval.calibrate_copy_prior import part_items  # noqa: E402
from eval.harness import host_info  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

PARTS = ("lookups", "codes")


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
    ap.add_argument("--top", type=int, default=8, help="how many of the lookups' best heads to read on the codes")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = {}
    if rows_path.is_file():
        for line in rows_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["part"], r["item"])] = r
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", ""), "target": args.target, "method": args.method}
    for part in PARTS:
        items = part_items(part)
        store = (args.stores / f"store-{part}") if args.stores else None
        if store is None or not store.is_dir():
            store = args.out / f"store-{part}"
            if not store.is_dir():
                build_eval_store(items, store, args.source, chunk_tokens=256)
        ctx = CachedContext(store=store, target=args.target, mapper=args.method, top_k=4, translation_cache_mb=0)
        asm = ctx.assembler
        n_prefix = asm.prefix().num_tokens
        meta["artifact"] = getattr(ctx.active_mapper, "artifact_id", args.method)
        with Progress(f"pointer: {part}", total=len(items), unit="items", interval_s=20) as bar:
            for item in items:
                if (part, item.id) in done:
                    bar.advance(1)
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    hits = ctx._order(ctx.retrieve(item.question))
                    chunks, used = ctx._target_chunks(hits, Timings(), [])
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
                with open(rows_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                done[(part, item.id)] = row
                bar.advance(1)
    by_part = {p: [r for r in done.values() if r["part"] == p] for p in PARTS}
    rates = {}
    for p, rows in by_part.items():
        scored = [r for r in rows if r["in_context"]]
        rates[p] = torch.tensor([r["hits"] for r in scored], dtype=torch.float32).mean(0) if scored else None
    look = rates["lookups"]
    flat = look.flatten()
    order = torch.argsort(flat, descending=True)[:args.top]
    layers_heads = [(int(i) // look.shape[1], int(i) % look.shape[1]) for i in order]
    codes = [r for r in by_part["codes"] if r["in_context"]]
    code_hits = torch.tensor([r["hits"] for r in codes], dtype=torch.float32) if codes else None
    best = []
    for layer, head in layers_heads:
        best.append({"layer": layer, "head": head, "lookups": round(float(look[layer, head]), 3),
                     "codes": round(float(code_hits[:, layer, head].mean()), 3) if codes else None})
    vote = None
    if codes:  # any of the top heads points right
        vote = float(torch.stack([code_hits[:, l, h] for l, h in layers_heads], 1).max(1).values.mean())
    summary = {"run": meta, "n": {p: len(rows) for p, rows in by_part.items()},
               "answer_in_context": {p: sum(r["in_context"] for r in rows) for p, rows in by_part.items()},
               "mean_of_heads_hit": {p: sum(bool(r.get("mean_hit")) for r in rows) for p, rows in by_part.items()},
               "best_heads": best, "codes_any_top_head": vote,
               "best_head_on_codes": round(float(code_hits.mean(0).max()), 3) if codes else None}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# Pointer heads through the {args.method} path ({args.target}, {meta.get('artifact', '')})", "",
             f"`{meta['command']}`", "", f"{meta['date']}, {meta['host']}.", "",
             f"Answer occurs in the placed chunks: lookups {summary['answer_in_context']['lookups']} of "
             f"{summary['n']['lookups']}, codes {summary['answer_in_context']['codes']} of {summary['n']['codes']}. "
             "Attention averaged over every head points at the answer's first token: lookups "
             f"{summary['mean_of_heads_hit']['lookups']}, codes {summary['mean_of_heads_hit']['codes']}.", "",
             f"The lookups' best {args.top} heads, each head's share of items where its strongest context "
             "position is the answer's first token (codes: read, not chosen):", "",
             "| layer | head | lookups | codes |", "| --- | --- | --- | --- |"]
    lines += [f"| {b['layer']} | {b['head']} | {b['lookups']} | {b['codes']} |" for b in best]
    lines += ["", f"Any of those {args.top} heads right on the codes: {vote if vote is None else round(vote, 3)}; "
              f"the best single head on the codes (chosen on the codes, an upper bound): "
              f"{summary['best_head_on_codes']}."]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
