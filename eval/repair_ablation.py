"""Chunk repair in one table: quality and TTFT against recompute ratio × selector × path × target.

    python eval/repair_ablation.py --dataset synthetic-kb --limit 50 --targets qwen2.5-0.5b
    python eval/repair_ablation.py --dataset essay-qa --targets qwen2.5-0.5b
    python eval/repair_ablation.py --dataset calib-lookup --limit 50 --targets qwen2.5-0.5b   # choosing defaults

For every question the text conditions (no context, direct context) are measured
once, and then every repair setting on the same retrieved chunks: the target's own
chunk caches (``native_cache``) and the store's source-model chunks translated by the
pair's mapper (``cache:<method>``), each with selective recompute of a share of the
context tokens chosen by one selector (`cag.selection` / `Assembler.place`). Every
run goes through the same `eval.harness.ItemRunner` code as `cag eval`, so a cell
here is the figure `cag eval --recompute R --recompute-select S` reports.

A default is chosen on calibration questions (`calib-lookup`, never an evaluation
set): pass ``--dataset calib-lookup``; the evaluation sets only report.

Results are appended per (question, target) to ``<out>/<dataset>/results.jsonl``, so an
interrupted run resumes; ``ablation.md``/``.json`` and ``retention_vs_speedup.png`` are
rebuilt from that file at the end (or alone with ``--report``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval import datasets as ds  # noqa: E402
from eval import metrics  # noqa: E402
from eval.harness import DIRECT, NATIVE, NO_CONTEXT, ItemRunner, host_line, host_info  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

# "question" (the target's question attention over the placed cache) is left out of the default
# grid: over translated keys it looks straight through them (#7), and on native caches
# eval/results/eval-recompute-question measured it; pass --selectors question to add it.
SELECTORS = ("deviation", "source", "retriever")
NO_REPAIR = ("none", 0.0)
# The crux path's fair baseline: the retriever's top chunk alone, prefilled as text. It costs
# about what recomputing that chunk costs, with no translation and no neighbours.
DIRECT_TOP1 = "direct_top1"


def settings(ratios, selectors, first_k: int) -> list[tuple[str, float]]:
    """(selector, ratio) pairs: no repair once, each selector at each ratio > 0, and first-k once."""
    out = [NO_REPAIR]
    out += [(s, r) for r in ratios if r > 0 for s in selectors if s != "first_k"]
    if "first_k" in selectors and first_k > 0:
        out.append(("first_k", float(first_k)))  # k tokens per chunk: its share is measured, not set
    return out


def label(select: str, ratio: float) -> str:
    if select == "none":
        return "none"
    if select == "first_k":
        return f"first_k k={int(ratio)}"
    return f"{select} {ratio:.0%}"


def decay_label(setting: str, decay: float | None) -> str:
    """A setting's label at rank key decay `decay` (None: each path's served default, unmarked)."""
    return setting if decay is None else f"{setting} γ={decay:g}"


def parse_decay(value: str) -> float | None:
    return None if value == "default" else float(value)


def load_items(dataset: str, limit: int | None):
    if dataset == "synthetic-kb":  # 60 questions; the first 40 are `cag eval`'s
        items = ds.synthetic_kb(n_questions=60)
    elif dataset == "calib-lookup":
        from eval.calibration_lookup import calibration_lookup

        items = calibration_lookup(seed=2)  # seed 2: neither the gate's items (0) nor APE's (1)
    else:
        items = ds.get_dataset(dataset)
    return items[:limit] if limit else items


def _done(path: Path) -> set[tuple[str, str]]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # cut by an interruption: that question is redone
                continue
            done.add((row["item"], row["target"]))
    return done


def _holds(hits, answers) -> bool:
    # ds.text_holds_answer, not metrics.contains_answer, which misses 5 of the 25 top chunks that
    # hold an essay-qa answer.
    return ds.text_holds_answer(" ".join(h.text for h in hits), answers)


def run(args) -> Path:
    items = load_items(args.dataset, args.limit)
    out = args.out / args.dataset
    out.mkdir(parents=True, exist_ok=True)
    store = args.store_root / f"{args.dataset}-{args.source}"
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"repair_ablation: store {store} ({len(items)} questions)")
    build_eval_store(items, store, args.source, chunk_tokens=args.chunk_tokens)
    grid = settings(args.ratios, args.selectors, args.first_k)
    decays = [parse_decay(v) for v in args.rank_key_decays]
    results_path = out / "results.jsonl"
    done = _done(results_path)
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": host_info(), "dataset": args.dataset, "n": len(items), "source": args.source,
            "settings": [decay_label(label(*g), d) for d in decays for g in grid], "top_k": args.top_k,
            "translated_key_scale": args.translated_key_scale, "max_new_tokens": args.max_new_tokens}
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = len(items) * len(args.targets)
    with Progress("repair_ablation", total, unit="questions",
                  completed=sum((i.id, t) in done for i in items for t in args.targets)) as bar:
        for target in args.targets:
            common = dict(store=store, target=target, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                          translation_cache_mb=0, min_retention=0.0)
            base = CachedContext(mapper="identity", **common)
            contexts = {}
            if args.method != "none":
                ctx = CachedContext(mapper=args.method, translated_key_scale=args.translated_key_scale, **common)
                contexts[ctx.active_mapper.method] = ctx
            runner = ItemRunner(base, contexts, max_new_tokens=args.max_new_tokens)
            # What each path serves by default, read before the grid below sets γ on the contexts.
            served_decay = {"native": base.rank_decay(native=True), **{m: c.rank_decay() for m, c in contexts.items()}}
            for item in items:
                if (item.id, target) in done:
                    continue
                row = {"item": item.id, "target": target, "meta": dict(item.meta), "answers": list(item.answers),
                       "ape": {"native": base.ape_settings(native=True),
                               **{m: c.ape_settings() for m, c in contexts.items()}},
                       "rank_key_decay": served_decay,
                       "settings": {}}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    hits = runner.hits_for(item)
                    text = runner.text_runs(item, hits)
                    text[DIRECT_TOP1] = runner._text_run(item, hits[:1], with_context=True)
                    # Was retrieval right? Whether an answer string lies in the top chunk, in any hit.
                    row["answer_in"] = {"top_chunk": _holds(hits[:1], item.answers), "hits": _holds(hits, item.answers)}
                    reference = runner.teacher_forced(text[DIRECT], runner.gold_ids(item.answers[0]))
                    row["text"] = {k: v.to_dict() for k, v in runner.score(item, text, reference).items()}
                    for decay, (select, ratio) in ((d, g) for d in decays for g in grid):
                        for ctx in (base, *contexts.values()):
                            ctx.rank_key_decay = decay
                            if select == "first_k":
                                ctx.recompute_select, ctx.recompute_ratio, ctx.recompute_first_k = \
                                    "first_k", 0.0, int(ratio)
                            else:
                                ctx.recompute_select = "deviation" if select == "none" else select
                                ctx.recompute_ratio = ratio
                        scored = runner.score(item, runner.cache_runs(item, hits), reference)
                        row["settings"][decay_label(label(select, ratio), decay)] = \
                            {k: v.to_dict() for k, v in scored.items()}
                with open(results_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                bar.advance(note=f"{args.dataset}, {target}")
    return out


# ------------------------------------------------------------------- report


def summarize(out: Path) -> dict:
    meta = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    table = []
    by_target: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_target[row["target"]].append(row)
    for target, group in sorted(by_target.items()):
        direct = [r["text"][DIRECT] for r in group]
        dc_f1, dc_found = [d["f1"] for d in direct], [d["found"] for d in direct]
        dc_ttft = float(np.median([d["ttft_s"] for d in direct]))
        base_rows = [(NO_CONTEXT, "–", [r["text"][NO_CONTEXT] for r in group]), (DIRECT, "–", direct)]
        if all(DIRECT_TOP1 in r["text"] for r in group):  # runs before 2026-12-03 lack it
            base_rows.append((DIRECT_TOP1, "–", [r["text"][DIRECT_TOP1] for r in group]))
        paths = sorted({c for r in group for s in r["settings"].values() for c in s})
        cells = list(base_rows)
        for setting in meta["settings"]:
            for cond in paths:
                cells.append((cond, setting, [r["settings"][setting][cond] for r in group]))
        for cond, setting, xs in cells:
            f1 = metrics.retention([x["f1"] for x in xs], dc_f1)
            found = metrics.retention([x["found"] for x in xs], dc_found)
            kls = [x["kl_from_direct"] for x in xs if x["kl_from_direct"] is not None]
            ttft = float(np.median([x["ttft_s"] for x in xs]))
            share = [x.get("recomputed_tokens", 0) / x["context_tokens"] for x in xs if x["context_tokens"]]
            table.append({"target": target, "path": cond, "setting": setting, "n": len(xs),
                          "f1": float(np.mean([x["f1"] for x in xs])), "found": float(np.mean([x["found"] for x in xs])),
                          "f1_retention": f1.to_dict(), "found_retention": found.to_dict(),
                          "kl": float(np.mean(kls)) if kls else None, "ttft_s": ttft,
                          "speedup_vs_direct": dc_ttft / ttft if ttft else None,
                          "recomputed_share": float(np.mean(share)) if share else 0.0,
                          "context_tokens": float(np.mean([x["context_tokens"] for x in xs]))})
    ape = {r["target"]: r.get("ape") for r in rows}
    decay = {r["target"]: r["rank_key_decay"] for r in rows if "rank_key_decay" in r}
    retrieval = {t: {k: float(np.mean([r["answer_in"][k] for r in g])) for k in ("top_chunk", "hits")}
                 for t, g in by_target.items() if all("answer_in" in r for r in g)}
    return {"run": meta, "ape": ape, "rank_key_decay": decay, "retrieval": retrieval, "table": table}


def render(summary: dict) -> str:
    run, lines = summary["run"], []
    lines += [f"# Chunk repair ablation: {run['dataset']}", "",
              f"Command: `{run['command']}`  ", f"Date: {run['date']}; {host_line(run['host'], {})}", "",
              f"{run['n']} questions, top-{run['top_k']} chunks of a store built by {run['source']}; every setting "
              "on the same chunks. Retention = metric / direct context's on the same questions, paired bootstrap "
              "95% interval. Recomputed = the share of context tokens the target recomputed (measured). "
              "TTFT = chunk loads, translation, selection and recompute, question prefill and first token "
              "(direct: the prefill of the text); speedup = direct context's median TTFT over the setting's.", ""]
    for target, ape in summary["ape"].items():
        lines.append(f"APE (T, S) as served, {target}: {ape}")
    for target, decay in summary.get("rank_key_decay", {}).items():
        lines.append(f"Rank key decay γ as served (settings without 'γ='), {target}: {decay}")
    for target, r in summary.get("retrieval", {}).items():
        lines.append(f"Retrieval, {target}: an answer string lies in the top chunk for {r['top_chunk']:.0%} of "
                     f"questions, in the top-{run['top_k']} for {r['hits']:.0%}. `{DIRECT_TOP1}`: the top chunk "
                     "alone, prefilled as text (the crux path's fair baseline).")
    lines += ["", "| target | path | repair | n | F1 | F1 retention | found | found retention | KL(DC‖X) | "
              "recomputed | TTFT s | speedup vs direct |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary["table"]:
        r, fr = e["f1_retention"], e["found_retention"]
        kl = "–" if e["kl"] is None else f"{e['kl']:.3f}"
        lines.append(f"| {e['target']} | {e['path']} | {e['setting']} | {e['n']} | {e['f1']:.2f} | "
                     f"{r['value']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | {e['found']:.2f} | "
                     f"{fr['value']:.2f} [{fr['low']:.2f}, {fr['high']:.2f}] | {kl} | {e['recomputed_share']:.0%} | "
                     f"{e['ttft_s']:.3f} | {e['speedup_vs_direct']:.1f}× |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[dict]] = defaultdict(list)
    for e in summary["table"]:
        if e["path"] not in (NO_CONTEXT, DIRECT):
            series[f"{e['target']} · {e['path']}"].append(e)
    for name, pts in sorted(series.items()):
        ax.scatter([p["speedup_vs_direct"] for p in pts], [p["f1_retention"]["value"] for p in pts], label=name)
        for p in pts:
            ax.annotate(p["setting"], (p["speedup_vs_direct"], p["f1_retention"]["value"]), fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT speedup vs direct context (median)")
    ax.set_ylabel("F1 retention vs direct context")
    ax.set_title(f"Chunk repair: {summary['run']['dataset']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "retention_vs_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(out: Path) -> None:
    summary = summarize(out)
    (out / "ablation.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "ablation.md").write_text(render(summary))
    plot(summary, out)
    print(render(summary))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="synthetic-kb", help="synthetic-kb, essay-qa, calib-lookup")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--targets", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--method", default="auto", help="the translated path's mapper ('none': native only)")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2])
    ap.add_argument("--selectors", nargs="+", default=[*SELECTORS, "first_k"])
    ap.add_argument("--first-k", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--translated-key-scale", type=float, default=1.0,
                    help="CachedContext.translated_key_scale on the translated path")
    ap.add_argument("--rank-key-decays", nargs="+", default=["default"],
                    help="γ of CachedContext.rank_key_decay to measure, each over the whole grid; 'default': "
                         "each path's served default (the target's calibrated γ on the native path, the mapper card's on a "
                         "translated one)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "repair_ablation")
    ap.add_argument("--store-root", type=Path, default=Path.home() / ".cache" / "cag" / "repair_ablation")
    ap.add_argument("--report", action="store_true", help="only rebuild the report from results.jsonl")
    args = ap.parse_args(argv)
    out = args.out / args.dataset if args.report else run(args)
    report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
