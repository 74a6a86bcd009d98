"""Choose the source model's retrieval heads for source-guided recompute (`recompute_select="source"`).

    python eval/calibrate_source_heads.py --source smollm2-135m --n 50     # calib-lookup seed 3

The source selector scores each context sentence by the question's attention minus a
neutral question's (`cag.selection`). Averaged over every layer and head it picked a
sentence holding the answer for only 22% of calibration lookups at a 20% budget
(`eval/results/crux_cover.md`): most heads attend by position or to the sink. This
script keeps the heads that look facts up, on calibration items only (calib-lookup
**seed 3**: not the gate's 0, APE's and γ's 1, nor the crux scale's 2, where the
choice is then checked by `eval/probe_crux_cover.py`):

1. per item, the store's top-4 chunks (the source's own, as the selector reads them) and
   every head's contrastive attention;
2. a head scores a hit when its best sentence holds the answer; heads are ranked by hits
   (ties: the answer sentence's mean reciprocal rank);
3. the number of heads kept, H in {1, 2, 4, ..., all}, is the one whose averaged score
   covers the answer most often at `--ratio` of the context's tokens (ties: the larger H,
   the smoother average).

Writes the chosen heads to ``cag/source_heads.json`` under the source model's weight
fingerprint (with `--write`), and ``eval/results/source_heads.json``/``.md`` with every H's cover.
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

from cag import selection  # noqa: E402
from cag.context import CachedContext  # noqa: E402
from cag.kv import KVChunk  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval import datasets as ds  # noqa: E402
from eval.calibration_lookup import calibration_lookup  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

SEED = 3


def item_data(ctx: CachedContext, item) -> tuple[torch.Tensor, list[KVChunk], list[str], int]:
    """The per-head contrast ``[layers, heads, positions]`` over the item's top chunks, as the selector sees them."""
    asm = ctx.assembler  # loads the model and opens the chunk store
    hits = ctx.retrieve(item.question)
    manifest, _ = ctx._current_view()
    chunks = [KVChunk.from_bytes(ctx._chunks.get(h.key), expect_model=manifest.source_fingerprint) for h in hits]
    contrast = selection.contrastive_attention(asm, chunks, item.question, per_head=True)
    return contrast, chunks, [h.text for h in hits], asm.prefix_ids.numel()


def flat_sentences(texts: list[str]) -> list[str]:
    return [t[s:e] for t in texts for s, e in selection.sentence_spans(t)]


def cover(scores: torch.Tensor, chunks, texts, start: int, answers, ratio: float) -> bool:
    """Whether the sentences chosen at `ratio` of the chunks' tokens hold an answer."""
    per_sentence = selection.sentence_scores(scores, chunks, texts, start)
    budget = round(ratio * sum(c.num_tokens for c in chunks))
    spans = selection._choose(chunks, texts, per_sentence, budget)
    return any(ds.text_holds_answer(t[s:e], answers) for t, sp in zip(texts, spans) for s, e in sp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--ratio", type=float, default=0.2, help="the budget the cover is judged at")
    ap.add_argument("--write", action="store_true", help="write the chosen heads to cag/source_heads.json")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "source_heads")
    ap.add_argument("--store-root", type=Path, default=Path.home() / ".cache" / "cag" / "repair_ablation")
    args = ap.parse_args(argv)

    items = calibration_lookup(seed=SEED)[: args.n]
    store = args.store_root / f"calib-lookup-s{SEED}-{args.source}"
    build_eval_store(items, store, args.source, chunk_tokens=256)
    ctx = CachedContext(store=store, target=args.source, mapper="identity", top_k=4, min_retention=0.0,
                        translation_cache_mb=0)
    data = []
    with Progress("calibrate_source_heads", len(items), unit="questions") as bar:
        for item in items:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                data.append((item, *item_data(ctx, item)))
            bar.advance()
    n_layers, n_heads = data[0][1].shape[:2]
    hits = torch.zeros(n_layers, n_heads)
    mrr = torch.zeros(n_layers, n_heads)
    usable = 0
    for item, contrast, chunks, texts, start in data:
        gold = torch.tensor([ds.text_holds_answer(s, item.answers) for s in flat_sentences(texts)])
        if not gold.any():
            continue  # retrieval missed the answer: no head can find it
        usable += 1
        for layer in range(n_layers):
            for head in range(n_heads):
                per = torch.tensor([v for c in selection.sentence_scores(contrast[layer, head], chunks, texts, start)
                                    for v in c])
                order = torch.argsort(per, descending=True)
                ranks = torch.nonzero(gold[order]).squeeze(1)
                hits[layer, head] += float(gold[order[0]])
                mrr[layer, head] += 1.0 / (1 + float(ranks[0]))
    ranked = sorted(((float(hits[l, h]), float(mrr[l, h]), l, h) for l in range(n_layers) for h in range(n_heads)),
                    reverse=True)
    sizes = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k < n_layers * n_heads] + [n_layers * n_heads]
    rows = []
    for k in sizes:
        heads = [(l, h) for _, _, l, h in ranked[:k]]
        layers, hs = zip(*heads)
        got = [cover(contrast[list(layers), list(hs)].mean(0), chunks, texts, start, item.answers, args.ratio)
               for item, contrast, chunks, texts, start in data]
        rows.append({"heads": k, "cover": sum(got) / len(got)})
    best = max(rows, key=lambda r: (r["cover"], r["heads"]))
    chosen = [[l, h] for _, _, l, h in ranked[:best["heads"]]]
    fp = ctx.target_model.fingerprint
    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "host": host_info(), "source": args.source, "fingerprint": fp.id, "items": f"calib-lookup seed {SEED}",
              "n": len(items), "answer_retrieved": usable, "ratio": args.ratio, "rows": rows, "chosen": best["heads"],
              "heads": chosen, "top_heads": [{"layer": l, "head": h, "hits": a, "mrr": round(b / max(usable, 1), 3)}
                                            for a, b, l, h in ranked[:16]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# The source model's retrieval heads, chosen on calibration lookups", "",
             f"`{result['command']}`, {result['date']}; {host_line(result['host'], {})}", "",
             f"{len(items)} calib-lookup items (seed {SEED}), {args.source} store, top-4 chunks of 256 tokens; "
             f"the answer lies in a retrieved sentence for {usable}. Cover: the sentences the averaged contrastive "
             f"attention of the best H heads picks at {args.ratio:.0%} of the tokens hold the answer.", "",
             "| heads kept (H) | cover |", "|---|---|"]
    lines += [f"| {r['heads']}{' **(chosen)**' if r['heads'] == best['heads'] else ''} | {r['cover']:.2f} |"
              for r in rows]
    lines += ["", "Best single heads (layer, head: items whose top sentence held the answer, of "
              f"{usable}; mean reciprocal rank of the answer's sentence):", ""]
    lines += [f"- {t['layer']}, {t['head']}: {t['hits']:.0f}, MRR {t['mrr']}" for t in result["top_heads"]]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write:
        path = selection.HEADS_FILE
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries[fp.id] = {"model": args.source, "heads": chosen, "cover": best["cover"],
                          "cover_all_heads": rows[-1]["cover"], "items": result["items"], "n": len(items),
                          "ratio": args.ratio, "command": result["command"], "date": result["date"]}
        path.write_text(json.dumps(entries, indent=2) + "\n")
        print(f"wrote {len(chosen)} heads for {fp.describe()} to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
