"""Why sentence-level crux recompute does not find more answers: choice or drowning?

    python eval/probe_crux_cover.py --limit 50        # calib-lookup seed 2, SmolLM2 store → Qwen2.5

A diagnosis on calibration lookups (the items `eval/calibrate_crux.py` reads), never an
evaluation set. For each question and each sentence-level choice of the crux (`source`,
`retriever`, at `--ratio` of the context tokens; `source` with the retrieval heads of
``cag/source_heads.json`` where the source model has them) it records whether the chosen spans hold
the answer string (**cover**), and the answer the translated path gives with that crux
recomputed (**found**). It adds a label-chosen crux (`oracle`: exactly the sentences that
hold the answer, for diagnosis only, never served) at each translated key scale in `--alphas`.

- cover high, found low: the choice is right and the recomputed sentence is still drowned
  by its translated neighbours (or reads its subject wrong from them);
- cover low: the choice is what fails.

Writes ``<out>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag import selection  # noqa: E402
from cag.context import CachedContext  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval import datasets as ds  # noqa: E402
from eval import metrics  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402
from eval.repair_ablation import load_items  # noqa: E402
from eval.run import build_eval_store  # noqa: E402


def answer_spans(texts: list[str], answers) -> list[list[tuple[int, int]]]:
    """Per chunk, the sentences whose text holds an answer string (case and whitespace folded)."""
    out = []
    for text in texts:
        mine = []
        for start, end in selection.sentence_spans(text):
            if ds.text_holds_answer(text[start:end], answers):
                mine.append((start, end))
        out.append(mine)
    return out


def calib_lookup_store(source: str, limit: int, store_root: Path):
    """The α calibration's items (calib-lookup seed 2) and their store built by `source` (built once)."""
    items = load_items("calib-lookup", limit)
    store = store_root / f"calib-lookup-{source}"
    build_eval_store(items, store, source, chunk_tokens=256)
    return items, store


def covers(texts: list[str], spans, answers) -> bool:
    """Whether the chosen spans (per chunk, of `texts`) hold an answer string."""
    return ds.text_holds_answer(" ".join(t[s:e] for t, sp in zip(texts, spans) for s, e in sp), answers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--alphas", nargs="+", type=float, default=[1.0, 0.5],
                    help="translated key scales for the oracle crux (and for every choice with --all-alphas)")
    ap.add_argument("--selects", nargs="+", default=["source", "retriever", "oracle"],
                    choices=["source", "retriever", "source_retriever", "oracle"])
    ap.add_argument("--all-alphas", action="store_true", help="every choice at every alpha, not only the oracle")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "crux_cover")
    ap.add_argument("--store-root", type=Path, default=Path.home() / ".cache" / "cag" / "repair_ablation")
    args = ap.parse_args(argv)

    items, store = calib_lookup_store(args.source, args.limit, args.store_root)
    ctx = CachedContext(store=store, target=args.target, mapper=args.method, top_k=4, min_retention=0.0,
                        translation_cache_mb=0, max_new_tokens=16, recompute_ratio=args.ratio)
    real_spans = ctx._guided_spans
    conditions = [(s, a) for s in args.selects
                  for a in (args.alphas if s == "oracle" or args.all_alphas else [1.0])]
    rows = {f"{s} α={a:g}": {"select": s, "alpha": a, "cover": [], "found": [], "f1": [], "share": []}
            for s, a in conditions}
    with Progress("probe_crux_cover", len(items) * len(conditions), unit="answers") as bar:
        for item in items:
            hits = ctx.retrieve(item.question)
            texts = [h.text for h in hits]
            oracle = answer_spans(texts, item.answers)
            for select, alpha in conditions:
                row = rows[f"{select} α={alpha:g}"]
                ctx.translated_key_scale = alpha
                chosen: dict = {}

                def spans_for(question, chunks, used, *, ratio=None, select=None, _s=select):
                    # the label's choice for the oracle, else the served one, kept to check its cover
                    spans = (answer_spans([h.text for h in used], item.answers) if _s == "oracle"
                             else real_spans(question, chunks, used, ratio=ratio, select=select))
                    chosen["spans"] = spans
                    return spans

                ctx._guided_spans = spans_for
                ctx.recompute_select = "retriever" if select == "oracle" else select
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ans = ctx.answer(item.question, hits)
                ctx._guided_spans = real_spans
                row["cover"].append(covers(texts, chosen.get("spans", [[] for _ in texts]), item.answers))
                row["found"].append(metrics.contains_answer(ans.text, item.answers))
                row["f1"].append(metrics.token_f1(ans.text, item.answers))
                row["share"].append(ans.recomputed_tokens / max(ans.context_tokens, 1))
                bar.advance(note=f"{select} α={alpha:g}")
            rows.setdefault("_oracle_exists", {"cover": []})["cover"].append(any(oracle))
    n = len(items)
    summary = {k: {"select": r.get("select"), "alpha": r.get("alpha"), "n": n,
                   "cover": sum(r["cover"]) / n, **({"found": sum(r["found"]) / n, "f1": sum(r["f1"]) / n,
                                                      "recomputed": sum(r["share"]) / n} if "found" in r else {}),
                   "per_item": {key: r[key] for key in ("cover", "found") if key in r}}
               for k, r in rows.items()}
    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "host": host_info(), "items": "calib-lookup seed 2", "target": args.target, "source": args.source,
              "mapper": ctx.active_mapper.method, "ratio": args.ratio, "rows": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Sentence-level crux: does the choice hold the answer, and is it found?", "",
             f"`{result['command']}`, {result['date']}; {host_line(result['host'], {})}", "",
             f"{n} calib-lookup items (seed 2), {args.source} store → {args.target} through `{result['mapper']}`, "
             f"top-4 chunks of 256 tokens, crux budget {args.ratio:.0%} of the context tokens; the rest translated, "
             "keys × α. `oracle` recomputes exactly the sentences holding the answer (label-chosen: diagnosis only). "
             f"A retrieved sentence holds the answer for {summary['_oracle_exists']['cover']:.0%} of items.", "",
             "| crux | α | cover (chosen spans hold the answer) | found | F1 | recomputed |", "|---|---|---|---|---|---|"]
    for k, r in summary.items():
        if k.startswith("_"):
            continue
        lines.append(f"| {r['select']} | {r['alpha']:g} | {r['cover']:.2f} | {r['found']:.2f} | {r['f1']:.2f} | "
                     f"{r['recomputed']:.0%} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
