"""What a chunk's prefill costs with the LM head and without: the cache-only forward.

    python eval/bench_cache_forward.py --out eval/results/cache_forward

A chunk's prefill exists for the keys and values it leaves in the cache. Until
2026-12-05 it ran the model's whole forward (`model(...)`), which applies the LM head
to every token of the chunk, and the last layer's MLP, neither of which feeds a cache.
`LoadedModel.forward_for_cache` stops the decoder once the last layer has written its
K/V. This times both on the same chunks of essay text, per packaged model, interleaved
in one process (medians of `--repeats`), and checks that they leave the same cache.
Writes ``cache_forward.json`` and ``README.md`` into `--out`.
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
from eval.bench_ttft import essay_text  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402


def chunk_ids(lm, tokens: int, n: int) -> list[torch.Tensor]:
    """`n` consecutive `tokens`-token pieces of the essay text, each behind the model's sink."""
    ids = lm.tokenize(essay_text())[0]
    if ids.numel() < tokens * n:
        raise SystemExit(f"the essay text has {ids.numel()} {lm.name} tokens, fewer than {tokens * n}")
    sink = torch.tensor(lm.sink_ids, dtype=torch.long)
    return [torch.cat([sink, ids[i * tokens:(i + 1) * tokens]]) for i in range(n)]


@torch.inference_mode()
def with_head(lm, ids: torch.Tensor) -> DynamicCache:
    """The forward chunk prefill ran before: the whole model, logits over every token."""
    cache = DynamicCache()
    lm.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def cache_only(lm, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    lm.forward_for_cache(cache, input_ids=ids[None])
    return cache


def run(models: list[str], tokens: int, chunks: int, repeats: int) -> dict:
    out = {"host": host_info(), "tokens": tokens, "chunks": chunks, "repeats": repeats, "models": {}}
    for name in models:
        lm = registry.load(name, "auto")
        pieces = chunk_ids(lm, tokens, chunks)
        a, b = with_head(lm, pieces[0]), cache_only(lm, pieces[0])  # warm-up, and the same cache?
        diff = max(max((x.keys - y.keys).abs().max().item(), (x.values - y.values).abs().max().item())
                   for x, y in zip(a.layers, b.layers))
        times: dict[str, list[float]] = {"with_head": [], "cache_only": []}
        for rep in range(repeats):
            for label, fn in (("with_head", with_head), ("cache_only", cache_only)):
                t = time.perf_counter()
                for ids in pieces:
                    fn(lm, ids)
                times[label].append(time.perf_counter() - t)
            print(f"bench_cache_forward: {name} repeat {rep + 1}/{repeats}: with head "
                  f"{times['with_head'][-1]:.2f} s, cache only {times['cache_only'][-1]:.2f} s",
                  file=sys.stderr, flush=True)
        cfg = lm.model.config
        med = {k: statistics.median(v) for k, v in times.items()}
        n_tok = chunks * pieces[0].numel()
        out["models"][name] = {
            "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": lm.adapter.num_layers,
            "dtype": str(lm.dtype).replace("torch.", ""), "max_abs_diff": diff,
            "seconds": times, "median_s": med,
            "tok_s": {k: n_tok / v for k, v in med.items()},
            "speedup": med["with_head"] / med["cache_only"],
        }
    return out


def render(report: dict) -> str:
    lines = ["# Chunk prefill: the whole forward against the cache-only forward", "",
             f"Command: `{report['command']}`  ",
             f"Date: {report['date']}. {host_line(report['host'], {})}", "",
             f"{report['chunks']} chunks of {report['tokens']} essay tokens (each behind the model's sink), "
             f"prefilled one at a time; medians of {report['repeats']} interleaved repeats, one process. "
             "*With head*: `model(...)`, what chunk prefill ran before (logits over every token); "
             "*cache only*: `LoadedModel.forward_for_cache` (no LM head, no last MLP). "
             "Max |Δ| = the largest difference between the two caches' keys and values.", "",
             "| model | vocab × hidden | layers | dtype | with head s | cache only s | tok/s with head | "
             "tok/s cache only | speedup | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in report["models"].items():
        lines.append(f"| {name} | {r['vocab']:,} × {r['hidden']} | {r['layers']} | {r['dtype']} | "
                     f"{r['median_s']['with_head']:.2f} | {r['median_s']['cache_only']:.2f} | "
                     f"{r['tok_s']['with_head']:,.0f} | {r['tok_s']['cache_only']:,.0f} | "
                     f"**{r['speedup']:.2f}×** | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "cache_forward")
    args = ap.parse_args(argv)
    report = run(args.models, args.tokens, args.chunks, args.repeats)
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["command"] = ("python eval/bench_cache_forward.py "
                         + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_forward.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
