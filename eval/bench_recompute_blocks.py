"""Where the 4K crux's time goes: the choice, and the recompute forward dense or in query blocks.

    python eval/bench_recompute_blocks.py --out eval/results/crux_ttft_blocked

`cag bench` times the crux path end to end; its ratios move with the direct run's own noise on
a shared 2-core host. This measures the parts side by side in one process, on the bench's own
4K context (the essay text cut to 4,096 Qwen2.5 tokens, a SmolLM2 store of 256-token chunks,
the bottleneck map): the crux choice (`CachedContext._guided_positions`) once per selector, then
`Assembler.place` with the chosen positions at each `recompute_block` (one dense block and
blocks of 128 and 256 queries; `cag.models.attention.blocked_recompute`), interleaved, repeated,
medians. Writes ``recompute_blocks.json`` and ``README.md`` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext, Timings  # noqa: E402
from cag.models import registry  # noqa: E402
from eval.bench_ttft import QUESTION, cut_to_tokens, essay_text  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402

DENSE = 10**9  # one block: the dense masked forward


def run(*, target: str, source: str, method: str, tokens: int, ratio: float, blocks: list[int], repeats: int,
        work: Path) -> dict:
    from stores.build import build_store

    host = host_info()
    text = cut_to_tokens(essay_text(), registry.load(target, "auto").tokenizer, tokens)
    build_store([("essay", text)], work / "store", registry.load(source, "auto"), chunk_tokens=256)
    out = {"host": host, "target": target, "source": source, "method": method, "tokens": tokens, "ratio": ratio,
           "repeats": repeats, "choice_s": {}, "forward_s": {}}
    for select in ("retriever", "source"):
        ctx = CachedContext(store=work / "store", target=target, mapper=method, translation_cache_mb=0,
                            max_new_tokens=1, min_retention=0.0, recompute_select=select, recompute_ratio=ratio)
        hits = ctx.document_hits(["essay"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the gate-off note
            ctx.answer(QUESTION, hits, max_new_tokens=1)  # warm-up: models, kernels, tables
        asm = ctx.assembler
        chunks, used = ctx._target_chunks(ctx._order(hits), Timings(), [])
        times, positions = [], None
        for _ in range(repeats):
            t = time.perf_counter()
            positions = ctx._guided_positions(QUESTION, chunks, used, asm, ratio=ratio, select=select)
            times.append(time.perf_counter() - t)
        out["choice_s"][select] = {"median": statistics.median(times), "all": times,
                                   "recomputed_tokens": int(positions.numel())}
        if select != "retriever":
            continue
        out["recomputed_tokens"] = int(positions.numel())  # the forward below recomputes the retriever's choice
        forward: dict[int, list[float]] = {b: [] for b in blocks}
        for rep in range(repeats):
            for block in blocks:  # interleaved, so drift on the host hits every setting alike
                asm.recompute_block = block
                with asm.model_lock:
                    placed = asm.place(chunks, recompute_ratio=ratio, recompute_select=select, positions=positions)
                forward[block].append(placed.recompute_s)
                print(f"bench_recompute_blocks: repeat {rep + 1}/{repeats}, block {block}: "
                      f"{placed.recompute_s:.2f} s", file=sys.stderr, flush=True)
        out["forward_s"] = {("dense" if b == DENSE else str(b)): {"median": statistics.median(ts), "all": ts}
                            for b, ts in forward.items()}
        ctx.close()
    return out


def render(report: dict, command: str) -> str:
    lines = ["# The 4K crux, part by part", "",
             f"Command: `{command}`  ", f"Date: {report['date']}. {host_line(report['host'], {})}", "",
             f"{report['target']} answering from a {report['source']} store ({report['method']} map), "
             f"{report['tokens']} context tokens; the forward recomputes the retriever's choice, "
             f"{report['recomputed_tokens']} tokens ({report['ratio']:.0%}); medians of {report['repeats']} "
             "interleaved repeats, one process.", "",
             "| part | setting | seconds (median) | all |", "| --- | --- | --- | --- |"]
    for select, t in report["choice_s"].items():
        lines.append(f"| choice of the crux | {select} | {t['median']:.3f} | "
                     + ", ".join(f"{x:.2f}" for x in t["all"]) + " |")
    for block, t in report["forward_s"].items():
        name = "one dense block" if block == "dense" else f"blocks of {block} queries"
        lines.append(f"| recompute forward | {name} | {t['median']:.3f} | "
                     + ", ".join(f"{x:.2f}" for x in t["all"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--method", default="bottleneck")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--blocks", type=int, nargs="+", default=[DENSE, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "crux_ttft_blocked")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = run(target=args.target, source=args.source, method=args.method, tokens=args.tokens,
                     ratio=args.ratio, blocks=args.blocks, repeats=args.repeats, work=Path(tmp))
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    command = "python eval/bench_recompute_blocks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report["command"] = command.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recompute_blocks.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(render(report, report["command"]))
    print(render(report, report["command"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
