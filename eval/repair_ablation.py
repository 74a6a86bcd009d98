"""Chunk repair in one table: quality and TTFT against recompute ratio × selector × path × target.

    python eval/repair_ablation.py --dataset synthetic-kb --limit 50 --targets qwen2.5-0.5b
    python eval/repair_ablation.py --dataset essay-qa --targets qwen2.5-0.5b
    python eval/repair_ablation.py --dataset needle --targets qwen2.5-0.5b   # 1K and 4K, 3 depths × 3
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
import shlex
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
from eval.harness import DIRECT, NO_CONTEXT, ItemRunner, host_line, host_info  # noqa: E402
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


def load_items(dataset: str, limit: int | None, args=None):
    if dataset == "needle":
        # Lengths counted in the first target's tokens, as `cag eval` counts them.
        from cag.models import registry

        tokenizer = registry.load(args.targets[0], "auto").tokenizer
        items = ds.needle(lengths=tuple(args.needle_lengths), depths=tuple(args.needle_depths),
                          repeats=args.needle_repeats, tokenizer=tokenizer)
    elif dataset == "synthetic-kb":  # 60 questions; the first 40 are `cag eval`'s
        items = ds.synthetic_kb(n_questions=60)
    elif dataset == "calib-lookup":
        from eval.calibration_lookup import calibration_lookup

        items = calibration_lookup(seed=2)  # seed 2: neither the gate's items (0) nor APE's (1)
    else:
        items = ds.get_dataset(dataset)
    return items[:limit] if limit else items


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    """The rows of ``results.jsonl`` by (question, target); a later row replaces an earlier one (a later
    pass that adds settings rewrites its question's whole row)."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # cut by an interruption: that question is redone
                continue
            rows[(row["item"], row["target"])] = row
    return rows


def setting_order(setting: str) -> tuple:
    """Sort key of a setting label: no repair, then by ratio (selectors in `SELECTORS` order), first-k last."""
    base, _, decay = setting.partition(" γ=")
    if base == "none":
        rank = (0, 0.0, 0)
    elif base.startswith("first_k"):
        rank = (2, 0.0, 0)
    else:
        select, ratio = base.rsplit(" ", 1)
        order = SELECTORS.index(select) if select in SELECTORS else len(SELECTORS)
        rank = (1, float(ratio.rstrip("%")), order)
    return (decay, *rank)


def _holds(hits, answers) -> bool:
    # ds.text_holds_answer, not metrics.contains_answer, which misses 5 of the 25 top chunks that
    # hold an essay-qa answer.
    return ds.text_holds_answer(" ".join(h.text for h in hits), answers)


def run(args) -> list[Path]:
    return [run_dataset(args, dataset) for dataset in args.dataset]


def run_dataset(args, dataset: str) -> Path:
    """Measure every (question, target) of `dataset` at every setting of the grid it lacks.

    A question already measured at some settings keeps them; the missing ones (a ratio added to
    the grid later) are measured now, with direct context prefilled again in the same pass, so a
    setting's speedup divides by a direct TTFT measured beside it (``direct_ttft_by_setting``)."""
    items = load_items(dataset, args.limit, args)
    out = args.out / dataset
    out.mkdir(parents=True, exist_ok=True)
    # Needle haystacks are cut to the first target's tokens: a store per first target.
    tag = f"needle-{args.targets[0]}" if dataset == "needle" else dataset
    store = args.store_root / f"{tag}-{args.source}"
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    grid = settings(args.ratios, args.selectors, args.first_k)
    decays = [parse_decay(v) for v in args.rank_key_decays]
    labels = {decay_label(label(*g), d): (d, g) for d in decays for g in grid}
    results_path = out / "results.jsonl"
    rows = _rows(results_path)
    foreign = ds.foreign_rows(rows.values(), items)
    if foreign:  # an id names an item only among the arguments that generated it
        raise SystemExit(f"{results_path} holds rows of other items under the ids {', '.join(foreign[:3])}"
                         f"{' …' if len(foreign) > 3 else ''} ({len(foreign)} in all): were the dataset's "
                         "arguments changed (needle lengths, depths, repeats, the first target)? Pass another --out")
    this_run = {"command": args.command, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    old = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    history = old.get("history") or ([{"command": old["command"], "date": old["date"]}] if old else [])
    # Running the same command again resumes it: one entry, the latest date.
    history = [h for h in history if h["command"] != this_run["command"]]
    meta = {**this_run, "history": [*history, this_run], "host": host_info(), "dataset": dataset,
            "n": len(items), "source": args.source,
            "settings": sorted(set(old.get("settings", [])) | set(labels), key=setting_order), "top_k": args.top_k,
            "translated_key_scale": args.translated_key_scale, "max_new_tokens": args.max_new_tokens}
    for key in ("top_k", "translated_key_scale", "max_new_tokens"):
        if key in old and old[key] != meta[key]:
            raise SystemExit(f"{out} was measured with {key} = {old[key]}, this run asks {meta[key]}: "
                             "pass another --out")
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")

    def missing(item, target) -> list[str]:
        have = rows.get((item.id, target), {}).get("settings", {})
        return [lab for lab in labels if lab not in have]

    todo = [(i, t) for t in args.targets for i in items if missing(i, t)]
    log(f"repair_ablation: {dataset}: {len(todo)} of {len(items) * len(args.targets)} (question, target) pairs "
        f"lack a setting; store {store}")
    if todo:  # a set measured at every setting needs no store (a build costs minutes)
        build_eval_store(items, store, args.source, chunk_tokens=args.chunk_tokens)
    with Progress("repair_ablation", len(todo), unit="questions") as bar:
        for target in args.targets:
            if not any(t == target for _, t in todo):
                continue
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
                todo_labels = missing(item, target)
                if not todo_labels:
                    continue
                row = rows.get((item.id, target))
                if row is not None:  # checked above: measured on this item
                    row.setdefault("item_sha", ds.item_fingerprint(item))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    hits = runner.hits_for(item)
                    if row is None:
                        row = {"item": item.id, "item_sha": ds.item_fingerprint(item), "target": target,
                               "meta": dict(item.meta),
                               "answers": list(item.answers),
                               "ape": {"native": base.ape_settings(native=True),
                                       **{m: c.ape_settings() for m, c in contexts.items()}},
                               "rank_key_decay": served_decay, "settings": {}}
                        text = runner.text_runs(item, hits)
                        text[DIRECT_TOP1] = runner._text_run(item, hits[:1], with_context=True)
                        # Was retrieval right? Whether an answer string lies in the top chunk, in any hit.
                        row["answer_in"] = {"top_chunk": _holds(hits[:1], item.answers),
                                            "hits": _holds(hits, item.answers)}
                        reference = runner.teacher_forced(text[DIRECT], runner.gold_ids(item.answers[0]))
                        row["text"] = {k: v.to_dict() for k, v in runner.score(item, text, reference).items()}
                        direct_ttft = row["text"][DIRECT]["ttft_s"]
                    else:  # a later pass: only direct context again, for the reference and a TTFT beside
                        served = {"rank_key_decay": served_decay, "ape": base.ape_settings(native=True)}
                        measured = {"rank_key_decay": row.get("rank_key_decay"), "ape": row.get("ape", {}).get("native")}
                        if json.loads(json.dumps(served)) != measured:
                            raise SystemExit(f"{item.id}: measured with {measured}, served now {served}; "
                                             "pass another --out")
                        direct = runner._text_run(item, hits, with_context=True)
                        reference = runner.teacher_forced(direct, runner.gold_ids(item.answers[0]))
                        direct_ttft = runner.score(item, {DIRECT: direct}, reference)[DIRECT].ttft_s
                    by_setting = row.setdefault("direct_ttft_by_setting", {})
                    for lab in todo_labels:
                        decay, (select, ratio) = labels[lab]
                        for ctx in (base, *contexts.values()):
                            ctx.rank_key_decay = decay
                            if select == "first_k":
                                ctx.recompute_select, ctx.recompute_ratio, ctx.recompute_first_k = \
                                    "first_k", 0.0, int(ratio)
                            else:
                                ctx.recompute_select = "deviation" if select == "none" else select
                                ctx.recompute_ratio = ratio
                        scored = runner.score(item, runner.cache_runs(item, hits), reference)
                        row["settings"][lab] = {k: v.to_dict() for k, v in scored.items()}
                        by_setting[lab] = direct_ttft
                rows[(item.id, target)] = row
                with open(results_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                bar.advance(note=f"{dataset}, {target}")
    return out


# ------------------------------------------------------------------- report


def summarize(out: Path) -> dict:
    meta = json.loads((out / "run.json").read_text())
    rows = list(_rows(out / "results.jsonl").values())
    table = []
    by_target: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_target[row["target"]].append(row)
    for target, group in sorted(by_target.items()):
        direct = [r["text"][DIRECT] for r in group]
        base_rows = [(NO_CONTEXT, "–", group, [r["text"][NO_CONTEXT] for r in group]), (DIRECT, "–", group, direct)]
        if all(DIRECT_TOP1 in r["text"] for r in group):  # runs before 2026-12-03 lack it
            base_rows.append((DIRECT_TOP1, "–", group, [r["text"][DIRECT_TOP1] for r in group]))
        paths = sorted({c for r in group for s in r["settings"].values() for c in s})
        cells = list(base_rows)
        for setting in meta["settings"]:
            measured = [r for r in group if setting in r["settings"]]  # a setting added later: its rows
            for cond in paths:
                cells.append((cond, setting, measured, [r["settings"][setting][cond] for r in measured]))
        for cond, setting, rs, xs in cells:
            if not xs:
                continue
            dc = [r["text"][DIRECT] for r in rs]
            # Direct context's TTFT from the pass that measured this setting (a later pass prefills it again).
            dc_ttft = float(np.median([r.get("direct_ttft_by_setting", {}).get(setting, r["text"][DIRECT]["ttft_s"])
                                       for r in rs]))
            f1 = metrics.retention([x["f1"] for x in xs], [d["f1"] for d in dc])
            found = metrics.retention([x["found"] for x in xs], [d["found"] for d in dc])
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


def _history(run: dict) -> list[dict]:
    """The commands that measured a set (runs before 2026-12-06 kept only the last one)."""
    return run.get("history") or [{"command": run["command"], "date": run["date"]}]


def render(summary: dict) -> str:
    run, lines = summary["run"], []
    lines += [f"# Chunk repair ablation: {run['dataset']}", "",
              *[f"Command ({h['date']}): `{h['command']}`{' (' + h['note'] + ')' if h.get('note') else ''}  "
                for h in _history(run)],
              host_line(run["host"], {}), "",
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


def _plottable(e: dict) -> bool:
    """A cell with a retention (direct context found something) and a speedup to put on a log axis."""
    return bool(e["speedup_vs_direct"]) and e["speedup_vs_direct"] > 0 and np.isfinite(e["f1_retention"]["value"])


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _panel(ax, table: list[dict], title: str, *, leave_out: tuple, annotate: bool) -> None:
    """Retention against speedup on a log axis, a series per (target, path)."""
    series: dict[str, list[dict]] = defaultdict(list)
    for e in table:
        if e["path"] not in leave_out and _plottable(e):
            series[f"{e['target']} · {e['path']}"].append(e)
    for name, pts in sorted(series.items()):
        ax.scatter([p["speedup_vs_direct"] for p in pts], [p["f1_retention"]["value"] for p in pts], label=name,
                   s=None if annotate else 14)
        for p in pts if annotate else ():
            ax.annotate(p["setting"], (p["speedup_vs_direct"], p["f1_retention"]["value"]), fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT speedup vs direct context (median)")
    ax.set_ylabel("F1 retention vs direct context")
    ax.set_title(title)
    ax.legend(fontsize=7 if annotate else 6)


def plot(summary: dict, out: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _panel(ax, summary["table"], f"Chunk repair: {summary['run']['dataset']}", leave_out=(NO_CONTEXT, DIRECT),
           annotate=True)
    fig.tight_layout()
    path = out / "retention_vs_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(out: Path) -> dict:
    summary = summarize(out)
    text = render(summary)
    (out / "ablation.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "ablation.md").write_text(text)
    plot(summary, out)
    print(text)
    return summary


def grid_report(root: Path, datasets: list[str], known: dict[str, dict] | None = None) -> str:
    """The whole grid in one table: a row per (path, setting), a column per (dataset, target); each cell
    F1 retention and TTFT speedup against direct context on the same questions. Written to
    ``<root>/README.md`` and ``grid.json``, with ``grid.png`` (retention against speedup, a panel per set)."""
    known = known or {}  # summaries this process already made (report's), by set
    summaries = {d: known.get(d) or summarize(root / d) for d in datasets if (root / d / "results.jsonl").exists()}
    if not summaries:
        return ""
    columns = [(d, t) for d, sm in summaries.items() for t in sorted({e["target"] for e in sm["table"]})]
    cells = {(d, e["target"], e["path"], e["setting"]): e for d, sm in summaries.items() for e in sm["table"]}
    settings_seen = sorted({e["setting"] for sm in summaries.values() for e in sm["table"] if e["setting"] != "–"},
                           key=setting_order)
    paths = sorted({e["path"] for sm in summaries.values() for e in sm["table"]} - {NO_CONTEXT, DIRECT, DIRECT_TOP1})
    row_keys = [(p, "–") for p in (NO_CONTEXT, DIRECT_TOP1)] + [(p, s) for p in paths for s in settings_seen]
    lines = ["# Chunk repair: the whole grid", "",
             "Each cell: F1 retention against direct context on the same questions (paired bootstrap 95% "
             "interval in each set's `ablation.md`) · TTFT speedup against direct context measured in the "
             "same pass. Rows: the path (the target's own chunk caches, or the store's source-model chunks "
             "translated) and the repair (the share of context tokens recomputed, chosen by the selector). "
             "A blank cell was not measured.", "",
             "Commands (each set's `run.json` keeps its history):", ""]
    for d, sm in summaries.items():
        for h in _history(sm["run"]):
            lines.append(f"- {d}, {h['date']}: `{h['command']}`" + (f" ({h['note']})" if h.get("note") else ""))
    lines += ["", "| path | repair | " + " | ".join(f"{d} · {t}" for d, t in columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    direct = []
    for d, t in columns:
        e = cells.get((d, t, DIRECT, "–"))
        direct.append(f"F1 {e['f1']:.2f}, found {e['found']:.2f}, n = {e['n']}, {e['ttft_s']:.1f} s" if e else "")
    lines.append("| direct context | – | " + " | ".join(direct) + " |")
    for path, setting in row_keys:
        out = []
        for d, t in columns:
            e = cells.get((d, t, path, setting))
            out.append("" if e is None else f"{e['f1_retention']['value']:.2f} · {e['speedup_vs_direct']:.1f}×")
        if any(out):
            lines.append(f"| {path} | {setting} | " + " | ".join(out) + " |")
    text = "\n".join(lines) + "\n"
    (root / "README.md").write_text(text)
    (root / "grid.json").write_text(json.dumps({d: sm for d, sm in summaries.items()}, indent=2) + "\n")
    _grid_plot(summaries, root / "grid.png")
    return text


def _grid_plot(summaries: dict, path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 4.5), squeeze=False)
    for ax, (d, sm) in zip(axes[0], summaries.items()):
        _panel(ax, sm["table"], d, leave_out=(NO_CONTEXT, DIRECT, DIRECT_TOP1), annotate=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", nargs="+", default=["synthetic-kb"],
                    help="one or more of synthetic-kb, essay-qa, needle, calib-lookup")
    ap.add_argument("--needle-lengths", nargs="+", type=int, default=[1024, 4096],
                    help="needle haystack lengths in the first target's tokens")
    ap.add_argument("--needle-depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    ap.add_argument("--needle-repeats", type=int, default=3, help="needles per (length, depth)")
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
    args.command = shlex.join(["python", "eval/repair_ablation.py", *(sys.argv[1:] if argv is None else argv)])
    outs = [args.out / d for d in args.dataset] if args.report else run(args)
    known = {out.name: report(out) for out in outs}
    print(grid_report(args.out, ["synthetic-kb", "essay-qa", "needle"], known), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
