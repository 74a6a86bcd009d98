"""What storing chunks in 8 bits costs in answers: `cag eval` once per storage format, side by side.

    python eval/eval_chunk_dtype.py                      # quick profile, bfloat16 against int8
    python eval/eval_chunk_dtype.py --dtypes bfloat16 int8 float8_e4m3fn -- --methods auto

Runs ``cag eval --dtype D --out OUT/D`` (resumable, progress on stderr) for every
format on the same questions, so every store holds the same chunks and only
their format differs: the source model's chunks (the translated path) and the
target's own chunks written through the store (the native path). No context and
direct context do not read chunks; they are computed in every run and serve as a
check that the runs saw the same questions.

Then, per dataset, target and cached condition, and pooled over them: F1, found-rate
and KL(direct ‖ condition) in each format, and the paired difference of F1 against
the first format with a bootstrap 95% interval over questions. Issue #11's bar:
an 8-bit format may become the default if it moves F1 by ≤ 1 point (0.01).

Writes OUT/chunk_dtype.json and OUT/chunk_dtype.md (default OUT: eval/results/chunk_dtype).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.harness import host_line  # noqa: E402
CACHED = ("native_cache", "cache:")  # the conditions that read chunks
BAR_F1 = 0.01


def rows_of(folder: Path) -> dict[tuple[str, str], dict]:
    """A run's rows by (question, target); an archived run keeps them gzipped (``results.jsonl.gz``)."""
    import gzip

    path = folder / "results.jsonl"
    text = path.read_text() if path.exists() else gzip.decompress((folder / "results.jsonl.gz").read_bytes()).decode()
    rows = {}
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["item"], row["target"])] = row
    return rows


def paired_delta(x: list[float], y: list[float], samples: int = 2000, seed: int = 0) -> dict:
    """mean(y − x) and its paired bootstrap 95% interval."""
    d = np.asarray(y, dtype=float) - np.asarray(x, dtype=float)
    idx = np.random.default_rng(seed).integers(0, d.size, size=(samples, d.size))
    low, high = np.quantile(d[idx].mean(1), [0.025, 0.975])
    return {"delta": float(d.mean()), "low": float(low), "high": float(high), "n": int(d.size),
            "changed": int((d != 0).sum())}


def compare(folders: dict[str, Path]) -> dict:
    names = list(folders)
    runs = {name: rows_of(folder) for name, folder in folders.items()}
    shared = sorted(set.intersection(*(set(r) for r in runs.values())))
    groups: dict[tuple[str, str, str], list[tuple[str, str]]] = defaultdict(list)
    for key in shared:
        row = runs[names[0]][key]
        for cond in row["results"]:
            if cond.startswith(CACHED) and all(cond in runs[n][key]["results"] for n in names):
                groups[(row["meta"].get("dataset", "qa"), row["target"], cond)].append(key)
    mismatched = [k for k in shared if len({runs[n][k]["results"]["direct"]["answer"] for n in names}) > 1]

    def block(pairs: list[tuple[tuple[str, str], str]]) -> dict:
        """Means per format and ΔF1 over (question key, condition) pairs."""
        out = {"n": len(pairs)}
        for name in names:
            res = [runs[name][k]["results"][c] for k, c in pairs]
            kl = [r["kl_from_direct"] for r in res if r.get("kl_from_direct") is not None]
            out[name] = {"f1": float(np.mean([r["f1"] for r in res])),
                         "found": float(np.mean([r["found"] for r in res])),
                         "kl_from_direct": float(np.mean(kl)) if kl else None}
        f1 = {name: [runs[name][k]["results"][c]["f1"] for k, c in pairs] for name in names}
        out["f1_delta"] = {name: paired_delta(f1[names[0]], f1[name]) for name in names[1:]}
        return out

    table = [{"dataset": dataset, "target": target, "condition": cond, **block([(k, cond) for k in keys])}
             for (dataset, target, cond), keys in sorted(groups.items())]
    pooled_pairs = [(k, cond) for (_, _, cond), keys in sorted(groups.items()) for k in keys]
    pooled = block(pooled_pairs) if pooled_pairs else {}
    return {"formats": names, "questions": len(shared), "table": table, "pooled": pooled,
            "direct_answers_differ": len(mismatched)}


def render(report: dict) -> str:
    names = report["formats"]
    base = names[0]
    lines = ["# What 8-bit chunks cost in answers", "",
             f"Command: `{report['command']}`  ", f"Date: {report['date']}. {report['machine']}", "",
             f"Each format's `cag eval` run built its own store of the same documents; {report['questions']} "
             f"(question, target) pairs ran in every one. Only cached conditions read chunks. ΔF1 is the paired "
             f"difference against {base} with a bootstrap 95% interval over questions; 'changed' counts the "
             f"questions whose F1 moved at all. Direct context's answer differed between runs on "
             f"{report['direct_answers_differ']} pairs (it reads no chunk, so this checks the runs agree).", ""]
    head = "| dataset | target | condition | n | " + " | ".join(f"F1 {n}" for n in names) + " | " + \
        " | ".join(f"found {n}" for n in names) + " | " + " | ".join(f"KL {n}" for n in names) + " | " + \
        " | ".join(f"ΔF1 {n} (changed)" for n in names[1:]) + " |"
    lines += [head, "|" + "---|" * (4 + 3 * len(names) + len(names) - 1)]

    def cells(r: dict) -> str:
        kl = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
        return (" | ".join(f"{r[n]['f1']:.3f}" for n in names) + " | "
                + " | ".join(f"{r[n]['found']:.2f}" for n in names) + " | "
                + " | ".join(kl(r[n]["kl_from_direct"]) for n in names) + " | "
                + " | ".join(f"{d['delta']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] ({d['changed']})"
                             for d in (r["f1_delta"][n] for n in names[1:])) + " |")

    for r in report["table"]:
        lines.append(f"| {r['dataset']} | {r['target']} | {r['condition']} | {r['n']} | " + cells(r))
    if report["pooled"]:
        lines.append(f"| **all** | | **cached conditions pooled** | {report['pooled']['n']} | " + cells(report["pooled"]))
        lines += ["", "Bar (issue #11): an 8-bit default moves F1 by at most 1 point (0.01)."]
        for n in names[1:]:
            d = report["pooled"]["f1_delta"][n]
            verdict = "meets" if abs(d["delta"]) <= BAR_F1 else "misses"
            lines.append(f"- {n}: pooled ΔF1 {d['delta']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], {verdict} it "
                         f"on the point estimate ({d['changed']} of {d['n']} answers' F1 moved).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8"])
    ap.add_argument("--profile", default="quick")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "chunk_dtype")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    folders = {}
    for i, dtype in enumerate(args.dtypes):
        folder = args.out / dtype
        cmd = [sys.executable, "-m", "cag.cli", "eval", "--profile", args.profile, "--dtype", dtype,
               "--out", str(folder), "--json", *extra]
        print(f"eval_chunk_dtype: {i + 1}/{len(args.dtypes)} {dtype}: {shlex.join(cmd[2:])}", file=sys.stderr,
              flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        folders[dtype] = folder
    run = json.loads((folders[args.dtypes[0]] / "results.json").read_text())["run"]
    report = compare(folders)
    report.update(command=shlex.join(["python", "eval/eval_chunk_dtype.py", *argv]),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), machine=host_line(run["host"], run["prefill"]))
    table = render(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunk_dtype.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "chunk_dtype.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
