"""Time the 4K crux path under several code trees, side by side on one host (an A/B of commits).

    git worktree add /tmp/before <rev>
    python eval/ab_crux_trees.py --trees /tmp/before . --target qwen2.5-0.5b --ratio 0.1 --key-scale 0.5 \
        --out eval/results/<folder>/ab.json

`cag bench` compares every path with direct context in one run; comparing two commits' benches means two
runs, minutes apart, on a shared machine. Here each tree answers the bench's question over the bench's
4K-token essay (a SmolLM2 store, stored translations, the crux chosen by `--select` at `--ratio`, keys times
`--key-scale`)
in its own process (`--queries` answers after one warm-up, medians of each timing), and the trees take
turns for `--rounds` rounds, so a slow minute of the host falls on all of them. Each tree's figure is the
median over its rounds. Progress on stderr; the table on stdout and in `--out` (JSON) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

# Run inside each tree's process: the tree's own code answers; its timings come back as one JSON line.
CHILD = r"""
import json, statistics, sys, tempfile, warnings
tree, target, ratio, key_scale, queries, select = (sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]),
                                                  int(sys.argv[5]), sys.argv[6])
sys.path.insert(0, tree)
warnings.simplefilter("ignore")
from pathlib import Path
from cag.context import CachedContext
from cag.models import registry
from cag.store_translation import translate_store
from eval.bench_ttft import QUESTION, cut_to_tokens, essay_text
from stores.build import build_store
with tempfile.TemporaryDirectory(prefix="cag-ab-") as tmp:
    store = Path(tmp) / "store"
    text = cut_to_tokens(essay_text(), registry.load(target, "auto").tokenizer, 4096)
    build_store([("essay", text)], store, registry.load("smollm2-135m", "auto"))
    plain = CachedContext(store=store, target=target, mapper="bottleneck", translation_cache_mb=0, min_retention=0.0,
                          stored_translations=False)
    translate_store(store, plain.target_model, mapper="bottleneck")
    ctx = CachedContext(store=store, target=target, mapper="bottleneck", translation_cache_mb=0, max_new_tokens=1,
                        min_retention=0.0, recompute_select=select, recompute_ratio=ratio,
                        translated_key_scale=key_scale, stored_translations=True)
    hits = ctx.document_hits(["essay"])
    rows = []
    for i in range(queries + 1):
        ctx.retrieve(QUESTION)  # the search every query pays, as cag bench times it
        timings = ctx.answer(QUESTION, hits, max_new_tokens=1).timings.to_dict()
        if i:
            rows.append(timings)
print(json.dumps({k: statistics.median(r[k] for r in rows) for k in rows[0]}))
"""

KEYS = ("load", "assemble", "choose", "recompute", "question_prefill", "first_token")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", required=True, help="code trees (a git worktree per commit)")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--key-scale", type=float, default=0.5)
    ap.add_argument("--select", default="source_retriever")
    ap.add_argument("--queries", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    trees = [str(Path(t).resolve()) for t in args.trees]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            print(f"round {r + 1}/{args.rounds}: {tree}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, "-c", CHILD, tree, args.target, str(args.ratio), str(args.key_scale),
                                  str(args.queries), args.select], capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for tree in trees:
        revision = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        rows.append({"tree": tree, "revision": revision + ("+changes" if dirty else ""),
                     **{k: statistics.median(run[k] for run in runs[tree]) for k in KEYS}, "rounds": runs[tree]})
    from eval.harness import host_info
    report = {"command": " ".join(["python", "eval/ab_crux_trees.py", *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": host_info(),
              "target": args.target, "ratio": args.ratio, "select": args.select, "key_scale": args.key_scale,
              "queries": args.queries,
              "rows": rows}
    lines = ["| tree | " + " | ".join(KEYS) + " |", "|" + " --- |" * (len(KEYS) + 1)]
    lines += [f"| {r['revision']} | " + " | ".join(f"{r[k]:.3f}" for k in KEYS) + " |" for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
