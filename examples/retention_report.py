"""How much answer quality does a cached context keep? A small retention report.

    python examples/retention_report.py [--target qwen2.5-0.5b] [--source smollm2-135m] [--questions 6]

Runs the evaluation harness (`eval/`) on a few synthetic knowledge-base questions:
every question is answered with no context, with direct context (the target reads
the retrieved text), with the target's own chunk caches, and with the store's
chunks translated from the source model (when a mapper for the pair exists), all
on the same retrieved chunks. Prints the table the harness writes; `cag eval` is
the full version of this.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from eval.datasets import get_dataset
from eval.run import run_eval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-0.5b")
    parser.add_argument("--source", default="smollm2-135m", help="the model that built the store")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, help="report folder (default: a temporary one)")
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="cag-retention-"))
    items = get_dataset("synthetic-kb", limit=args.questions)
    summary = run_eval(items, out, source=args.source, targets=[args.target], methods=["auto"],
                       top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                       command="python examples/retention_report.py")
    print((out / "results.md").read_text())
    for row in summary["table"]:
        print(json.dumps({"condition": row["condition"], "f1": row["f1"],
                          "f1_retention": row["retention"]["f1"]["value"]}))
    print(f"report folder: {out}")


if __name__ == "__main__":
    main()
