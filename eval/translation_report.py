"""One table per translation direction from `cag eval` runs, checked against issue #7's bar.

    python eval/translation_report.py RUN_DIR [RUN_DIR ...] [--ttft eval/results/ttft.json]
                                      [--out eval/results/translation]

Each RUN_DIR is a `cag eval` output folder (its `results.json` names the source
model; each target in it is one direction). Runs with recompute are reported
as their own rows (``cache:heterofold @ question 0.10``). Writes
``OUT.md``, ``OUT.json`` and ``OUT.png`` (F1 and found retention per direction
and condition). The bar: the best translated condition keeps ≥ 95% of direct
context's token F1; it scores ≥ 1.5× KV Ridge's F1 wherever ridge keeps < 90%;
on the needles it finds the answer as often as direct context, ±5 points;
its TTFT is within 1.2× of ridge's (from `cag bench`'s ttft.json, when given).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

BASELINES = ("no_context", "direct", "native_cache")


def load_runs(dirs: list[Path]) -> list[dict]:
    """Rows of every run, each tagged with its direction and recompute setting."""
    rows = []
    for folder in dirs:
        summary = json.loads((folder / "results.json").read_text())
        run = summary.get("run", {})
        ratio = float(run.get("recompute_ratio") or 0.0)
        tag = f" @ {run.get('recompute_select', 'deviation')} {ratio:.2f}" if ratio else ""
        for row in summary["table"]:
            cond = row["condition"]
            if tag and cond not in ("no_context", "direct"):
                cond = cond + tag
            rows.append({**row, "condition": cond, "source": run.get("source"), "run": str(folder),
                         "command": run.get("command", "")})
    return rows


def _ret(row: dict, metric: str) -> float | None:
    value = (row.get("retention") or {}).get(metric, {}).get("value")
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def direction_tables(rows: list[dict]) -> dict[str, dict]:
    """{ "source → target": {dataset: {condition: row}} }, one entry per condition (first run wins)."""
    out: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        key = f"{row['source']} → {row['target']}"
        out[key][row["dataset"]].setdefault(row["condition"], row)
    return out


def check_bar(tables: dict[str, dict], ttft: dict | None) -> dict[str, dict]:
    verdicts = {}
    for direction, datasets in tables.items():
        v: dict = {}
        kb = datasets.get("synthetic-kb", {})
        # the bar compares translation alone: recompute rows (which pay for prefill) are shown, not judged
        translated = {c: r for c, r in kb.items() if c.startswith("cache:") and " @ " not in c}
        if translated:
            # ties (often all zero) go to the higher found rate, then the lower KL
            best_c, best = max(translated.items(), key=lambda kv: (kv[1]["f1"], kv[1]["found"],
                                                                  -(kv[1].get("kl_from_direct") or math.inf)))
            f1_dc = kb.get("direct", {}).get("f1")
            ridge = kb.get("cache:ridge")
            v["best"] = best_c
            v["best_f1"] = best["f1"]
            v["direct_f1"] = f1_dc
            v["best_f1_retention"] = _ret(best, "f1")
            v["retention_ge_95"] = bool(v["best_f1_retention"] is not None and v["best_f1_retention"] >= 0.95)
            if ridge is not None:
                r_ret = _ret(ridge, "f1")
                v["ridge_f1"] = ridge["f1"]
                if r_ret is not None and r_ret < 0.9:
                    v["ge_1_5x_ridge"] = bool(best["f1"] > 0 and best["f1"] >= 1.5 * ridge["f1"])
        needle = datasets.get("needle", {})
        if needle and "direct" in needle:
            found_dc = needle["direct"]["found"]
            v["needle_direct_found"] = found_dc
            if found_dc == 0:
                v["needle_within_5_points"] = "direct context finds no needle: nothing to compare"
            else:
                v["needle_within_5_points"] = {c: bool(abs(r["found"] - found_dc) <= 0.05)
                                               for c, r in needle.items() if c.startswith("cache:")}
        verdicts[direction] = v
    if ttft:
        verdicts["ttft_vs_ridge"] = ttft_ratios(ttft)
    return verdicts


def ttft_ratios(ttft: dict) -> dict[str, float]:
    """TTFT(method) / TTFT(ridge) per target and length, from `cag bench`'s medians."""
    out = {}
    for row in ttft.get("rows", []):
        method = row.get("condition", "")
        if not method.startswith("cache:") or method == "cache:ridge":
            continue
        ridge = next((r for r in ttft.get("rows", [])
                      if r.get("condition") == "cache:ridge" and r.get("target") == row.get("target")
                      and r.get("length") == row.get("length")), None)
        if ridge and ridge.get("ttft_median_s"):
            out[f"{row['target']} {row['length']} {method}"] = round(row["ttft_median_s"] / ridge["ttft_median_s"], 3)
    return out


def _order(cond: str) -> tuple:
    base = cond.split(" @ ")[0]
    rank = {"no_context": 0, "direct": 1, "native_cache": 2, "cache:ridge": 3, "cache:latent": 4,
            "cache:heterofold": 5, "cache:mot": 6}.get(base, 7)
    return (" @ " in cond, rank, cond)


def render(tables: dict[str, dict], verdicts: dict, commands: list[str]) -> str:
    f = lambda x, d=2: "–" if x is None else f"{x:.{d}f}"
    lines = ["# Cross-model translation against direct context", "",
             "From `cag eval` runs (one per source model); every direction is one source → target pair, "
             "on the same questions and the same retrieved chunks for every condition. "
             "F1 retention = F1(X) / F1(direct context), paired bootstrap 95% interval. "
             "KL(DC‖X) and top-1 over the gold answer, teacher-forced.", "",
             "Commands:", *[f"- `{c}`" for c in commands], ""]
    for direction in sorted(tables):
        lines += [f"## {direction}", "",
                  "| dataset | condition | n | F1 | found | F1 retention | found retention | KL(DC‖X) | top-1 | TTFT s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for dataset in sorted(tables[direction]):
            for cond in sorted(tables[direction][dataset], key=_order):
                r = tables[direction][dataset][cond]
                ret = r.get("retention", {})
                ci = lambda m: (f"{f(ret[m]['value'])} [{f(ret[m]['low'])}, {f(ret[m]['high'])}]"
                                if m in ret and ret[m].get("value") is not None
                                and not math.isnan(ret[m]["value"]) else "–")
                lines.append(f"| {dataset} | {cond} | {r['n']} | {f(r['f1'])} | {f(r['found'])} | {ci('f1')} | "
                             f"{ci('found')} | {f(r.get('kl_from_direct'), 3)} | {f(r.get('top1_with_direct'))} | "
                             f"{f(r.get('ttft_s_median'), 3)} |")
        v = verdicts.get(direction, {})
        if v:
            lines += ["", "Bar: " + "; ".join(f"{k} = {json.dumps(val)}" for k, val in v.items()), ""]
    if "ttft_vs_ridge" in verdicts:
        lines += ["## TTFT against the KV Ridge path", "",
                  "| target, length, method | TTFT / TTFT(ridge) |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in verdicts["ttft_vs_ridge"].items()]
    return "\n".join(lines) + "\n"


def plot(tables: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = sorted(tables)
    conds = sorted({c for d in directions for ds in tables[d].values() for c in ds
                    if c not in ("no_context", "direct")}, key=_order)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.8 / max(len(conds), 1)
    for ax, (dataset, metric) in zip(axes, (("synthetic-kb", "f1"), ("needle", "found"))):
        for i, cond in enumerate(conds):
            vals = []
            for d in directions:
                r = tables[d].get(dataset, {}).get(cond)
                vals.append(_ret(r, metric) or 0.0 if r else 0.0)
            ax.bar([j + i * width for j in range(len(directions))], vals, width, label=cond)
        ax.axhline(0.95, color="k", ls="--", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(directions))])
        ax.set_xticklabels([d.replace(" → ", "\n→ ") for d in directions], fontsize=7)
        ax.set_title(f"{dataset}: {metric} retention vs direct context")
    axes[0].set_ylabel("retention")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--ttft", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("eval/results/translation"))
    args = parser.parse_args(argv)
    rows = load_runs(args.runs)
    tables = direction_tables(rows)
    ttft = json.loads(args.ttft.read_text()) if args.ttft and args.ttft.exists() else None
    verdicts = check_bar(tables, ttft)
    commands = sorted({r["command"] for r in rows if r.get("command")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(render(tables, verdicts, commands))
    args.out.with_suffix(".json").write_text(json.dumps({"verdicts": verdicts, "runs": [str(r) for r in args.runs]},
                                                        indent=2))
    plot(tables, args.out.with_suffix(".png"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
