"""What the target's own first m layers over a context cost: the speed side of #11's partial-native curve.

    python eval/bench_native_layers.py --target qwen2.5-0.5b --layers 0 3 6 12 24 --out eval/results/native_layers

The lab scores a translated chunk whose first m target layers are the target's own (`shipped+nat<m>`,
`eval/lab/variants.py`); serving that means running the target's first m layers over every chunk of the
context, at query time (or at build time, for every target). This times exactly that work: the decoder's
first m layers (`LoadedModel.forward_first_layers`, no LM head) over `--chunks` chunks of `--tokens` tokens
of essay text, each chunk from position 0 as a chunk prefill runs, for every m in one process, interleaved,
medians of `--repeats` after a warm-up. m = L is the whole chunk prefill a native store pays once.
Writes ``native_layers.json`` and ``native_layers.md`` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.models import registry  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval.bench_cache_forward import chunk_ids  # noqa: E402
from eval.harness import host_info  # noqa: E402


@torch.inference_mode()
def first_layers(lm, chunks: list[torch.Tensor], m: int) -> None:
    """The target's first `m` layers over each chunk, as `m` native layers of a context would be computed."""
    if m == 0:
        return
    for ids in chunks:
        lm.forward_first_layers(m, input_ids=ids[None], past_key_values=DynamicCache(), use_cache=True)


def run(target: str, asked: list[int], tokens: int, chunks: int, repeats: int) -> dict:
    lm = registry.load(target)
    num_layers = lm.adapter.num_layers
    if any(m < 0 for m in asked):
        raise SystemExit(f"--layers must be at least 0, got {asked}")
    layers = sorted({min(m, num_layers) for m in asked} | {num_layers})  # L: the ratio's denominator
    pieces = chunk_ids(lm, tokens, chunks)
    first_layers(lm, pieces, num_layers)  # warm-up: allocator, kernels
    times: dict[int, list[float]] = {m: [] for m in layers}
    with Progress(f"native layers: {target}", total=repeats * len(layers), unit="runs") as bar:
        for _ in range(repeats):
            for m in layers:  # interleaved, so drift on a shared host spreads over every m alike
                t = time.perf_counter()
                first_layers(lm, pieces, m)
                times[m].append(time.perf_counter() - t)
                bar.advance(1)
    full = statistics.median(times[num_layers])
    rows = [{"layers": m, "fraction_of_layers": m / num_layers, "seconds": statistics.median(times[m]),
             "all_runs_s": times[m], "of_full_prefill": statistics.median(times[m]) / full} for m in layers]
    return {"target": target, "num_layers": num_layers, "tokens_per_chunk": tokens, "chunks": chunks,
            "repeats": repeats, "rows": rows, "host": host_info(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def render(results: list[dict], command: str) -> str:
    host = results[0]["host"]
    out = ["# The target's own first m layers over a context (#11's partial-native curve, speed side)", "",
           f"`{command}`", "", f"{results[0]['date']}; {host.get('cpu')}, {host.get('cores')} cores, torch "
           f"{results[0]['torch']}; medians of {results[0]['repeats']} interleaved runs after a warm-up.", "",
           "| target | m of L layers | seconds over the context | of a whole chunk prefill |", "| --- | --- | --- | --- |"]
    for res in results:
        ctx = f"{res['chunks']} chunks × {res['tokens_per_chunk']} tokens"
        for r in res["rows"]:
            out.append(f"| {res['target']} ({ctx}) | {r['layers']} / {res['num_layers']} | {r['seconds']:.3f} | "
                       f"{r['of_full_prefill']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", required=True, help="repeat for several targets")
    ap.add_argument("--layers", type=int, nargs="+", required=True, help="the m values; include L for the ratio")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk (the store's chunk size)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = [run(target, args.layers, args.tokens, args.chunks, args.repeats) for target in args.target]
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *sys.argv])
    (args.out / "native_layers.json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
    text = render(results, command)
    (args.out / "native_layers.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
