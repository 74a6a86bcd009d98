"""One condition of one `cag eval` run against one of another, paired question by question.

    python eval/compare_runs.py eval/results/eval-four-directions/source-gemma cache:mot \\
        eval/results/eval-gemma-bottleneck cache:bottleneck --target qwen2.5-0.5b

Two runs are paired only when they asked the same questions of the same chunks. A new
mapper is often measured in a run of its own, on a copy of an earlier run's store; this
checks that the reference conditions (no context, direct context, the target's own chunk
caches) gave the same answers in both, question by question, and says how many did not.

Per dataset: n, found-rate of each side, the paired difference (second − first) of found
and of the gold answer's log-likelihood with a bootstrap 95% interval over questions.
Markdown on stdout; ``--json`` writes the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.eval_chunk_dtype import paired_delta, rows_of  # noqa: E402

REFERENCES = ("no_context", "direct", "native_cache")


def compare(first: Path, first_cond: str, second: Path, second_cond: str, target: str | None = None) -> dict:
    a, b = rows_of(first), rows_of(second)
    groups: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for key in sorted(set(a) & set(b)):
        if target and key[1] != target:
            continue
        ra, rb = a[key]["results"], b[key]["results"]
        if first_cond in ra and second_cond in rb:
            groups[a[key]["meta"].get("dataset", "qa")].append((ra, rb))
    out = {}
    for dataset, pairs in sorted(groups.items()):
        found, ll = ([[float(p[side][cond][key]) for p in pairs] for side, cond in ((0, first_cond), (1, second_cond))]
                     for key in ("found", "gold_log_likelihood"))
        same = {ref: sum(p[0][ref]["answer"] == p[1][ref]["answer"] for p in pairs if ref in p[0] and ref in p[1])
                for ref in REFERENCES}
        out[dataset] = {"n": len(pairs), "same_reference_answers": same,
                        "found": [sum(v) for v in found], "gold_ll": [sum(v) / len(v) for v in ll],
                        "d_found": paired_delta(*found), "d_gold_ll": paired_delta(*ll)}
    return out


def table(result: dict, first: str, second: str) -> str:
    lines = [f"| dataset | n | found: {first} | found: {second} | Δ found [95%] | gold LL: {first} | gold LL: {second} "
             "| Δ gold LL [95%] | reference answers identical (no context / direct / native) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dataset, r in result.items():
        d, ll = r["d_found"], r["d_gold_ll"]
        same = " / ".join(str(r["same_reference_answers"][k]) for k in REFERENCES)
        lines.append(f"| {dataset} | {r['n']} | {r['found'][0]:.0f} | {r['found'][1]:.0f} | {d['delta']:+.2f} "
                     f"[{d['low']:+.2f}, {d['high']:+.2f}] | {r['gold_ll'][0]:.2f} | {r['gold_ll'][1]:.2f} | "
                     f"{ll['delta']:+.2f} [{ll['low']:+.2f}, {ll['high']:+.2f}] | {same} of {r['n']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", type=Path, help="a cag eval output folder")
    ap.add_argument("first_condition", help="e.g. cache:mot")
    ap.add_argument("second", type=Path)
    ap.add_argument("second_condition")
    ap.add_argument("--target", help="only this answering model's rows")
    ap.add_argument("--json", type=Path, help="also write the comparison here")
    args = ap.parse_args(argv)
    result = compare(args.first, args.first_condition, args.second, args.second_condition, args.target)
    if not result:
        raise SystemExit("the two runs share no question answered under both conditions")
    if args.json:
        args.json.write_text(json.dumps({"first": [str(args.first), args.first_condition],
                                         "second": [str(args.second), args.second_condition],
                                         "target": args.target, "datasets": result}, indent=1) + "\n")
    print(table(result, f"{args.first.name} {args.first_condition}", f"{args.second.name} {args.second_condition}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
