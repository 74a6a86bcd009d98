"""Early versus late layers: where translation error hurts, and what replaying costs.

    python eval/layer_study.py --source smollm2-135m --target qwen2.5-0.5b --method heterofold \\
                               --layers 0 4 8 12 [--texts 8] [--out eval/results/layer_study]

Mixture-of-Translators names two failure modes: a translated early layer sends its
error up through the target's whole depth; a cache translated only in its late
layers leaves the early ones without the context. For the first k target layers
this measures, on held-out calibration continuations (the texts no mapper was
fitted on), next-token KL(native ‖ X) and top-1 agreement of three variants:

- ``translated``: every layer translated (k is ignored; the reference row);
- ``late_only``: layers < k carry no context information (the mapper's mean K/V,
  what a token without any source gets), layers ≥ k translated;
- ``replay``: layers < k computed by the target itself over the context (a
  prefill stopped after layer k − 1, costing about k/L of a full prefill), layers
  ≥ k translated.

and the seconds of that partial prefill per 1,000 context tokens against the full
prefill, i.e. what replaying would add to TTFT. Writes OUT.json and OUT.md
(appending one section per direction).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cag.kv import KVChunk
from cag.mapping import resolve_mapper
from cag.models import registry
from eval.datasets import calibration_sample
from mappers.fidelity import split_continuation
from mappers.fit import split_texts


@torch.inference_mode()
def first_layers_kv(target, text: str, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The target's own de-rotated K/V of `text` (after its sink) for layers < k, and the seconds it took."""
    ids, _ = target.tokenize(text)
    full = torch.cat([torch.tensor(target.sink_ids, dtype=torch.long), ids])
    started = time.perf_counter()
    cache = target.first_layers_cache(full, k)
    seconds = time.perf_counter() - started
    n_sink = len(target.sink_ids)
    keys = torch.stack([cache.layers[i].keys[0, :, n_sink:] for i in range(k)])
    values = torch.stack([cache.layers[i].values[0, :, n_sink:] for i in range(k)])
    positions = torch.arange(n_sink, n_sink + ids.numel())
    pad = target.adapter.num_layers - k  # the adapter rotates whole stacks: pad, derotate, cut
    padded = torch.cat([keys.float(), keys.new_zeros((pad, *keys.shape[1:])).float()])
    keys = target.adapter.derotate(padded, positions)[:k]
    return keys, values.float(), seconds


@torch.inference_mode()
def full_prefill_seconds(target, text: str) -> float:
    ids, _ = target.tokenize(text)
    full = torch.cat([torch.tensor(target.sink_ids, dtype=torch.long), ids])
    started = time.perf_counter()
    target.model.model(input_ids=full[None])
    return time.perf_counter() - started


def variant(chunk: KVChunk, k: int, mode: str, mapper, native_first=None) -> KVChunk:
    if mode == "translated" or k == 0:
        return chunk
    keys, values = chunk.keys.clone(), chunk.values.clone()
    if mode == "late_only":
        for kind, t in (("keys", keys), ("values", values)):
            mean = mapper.y_mean[kind][:k].reshape(k, 1, mapper.target.num_kv_heads, -1).permute(0, 2, 1, 3)
            t[:k] = mean.to(t.dtype)
    else:
        keys[:k], values[:k] = native_first[0].to(keys.dtype), native_first[1].to(values.dtype)
    return KVChunk(keys, values, chunk.token_ids, chunk.offsets, chunk.text_hash, chunk.model, chunk.settings)


@torch.inference_mode()
def study(source, target, mapper, texts, layers) -> dict:
    prefix = target.prefix_chunk()
    results: dict = {}
    timing = {"partial": {k: 0.0 for k in layers if k}, "full": 0.0, "tokens": 0}
    for text in texts:
        ctx, cont = split_continuation(text, 0.25)
        ids_ctx, _ = target.tokenize(ctx)
        ids_cont, _ = target.tokenize(cont)
        full = torch.cat([torch.tensor(target.sink_ids, dtype=torch.long), ids_ctx, ids_cont])
        native_logits = target.model(input_ids=full[None]).logits[0, -ids_cont.numel():]
        chunk = mapper.translate(source.prefill(ctx), ctx, target)
        timing["full"] += full_prefill_seconds(target, ctx)
        timing["tokens"] += ids_ctx.numel()
        for k in layers:
            native_first = None
            if k:
                *native_first, secs = first_layers_kv(target, ctx, k)
                timing["partial"][k] += secs
            for mode in (("translated",) if k == 0 else ("late_only", "replay")):
                placed = variant(chunk, k, mode, mapper, native_first)
                logits = target.model(input_ids=ids_cont[None],
                                      past_key_values=target.build_cache([prefix, placed])).logits[0]
                lp, lq = F.log_softmax(native_logits.float(), -1), F.log_softmax(logits.float(), -1)
                kl = (lp.exp() * (lp - lq)).sum(-1)
                top1 = (native_logits.argmax(-1) == logits.argmax(-1)).float()
                entry = results.setdefault(f"{mode}:{k}", {"kl": [], "top1": []})
                entry["kl"].append(kl)
                entry["top1"].append(top1)
    per_1k = 1000.0 / max(timing["tokens"], 1)
    out = {}
    for key, entry in results.items():
        mode, k = key.split(":")
        k = int(k)
        out[key] = {"mode": mode, "k": k, "kl": float(torch.cat(entry["kl"]).mean()),
                    "top1": float(torch.cat(entry["top1"]).mean()),
                    "replay_s_per_1k": round(timing["partial"].get(k, 0.0) * per_1k, 3) if mode == "replay" else 0.0}
    out["full_prefill_s_per_1k"] = round(timing["full"] * per_1k, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="qwen2.5-0.5b")
    parser.add_argument("--method", default="heterofold")
    parser.add_argument("--layers", nargs="+", type=int, default=[0, 4, 8, 12])
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--words", type=int, default=12000, help="the calibration set whose held-out texts are used")
    parser.add_argument("--out", type=Path, default=Path("eval/results/layer_study"))
    args = parser.parse_args(argv)
    texts = calibration_sample(args.words)
    _, held = split_texts(texts, 0.1, 0)
    source, target = registry.load(args.source, "bfloat16"), registry.load(args.target, "bfloat16")
    mapper = resolve_mapper(args.method, source.fingerprint, target)
    layers = sorted(set([0, *args.layers]))
    result = study(source, target, mapper, held[: args.texts], layers)
    direction = f"{args.source} → {args.target} ({args.method})"
    path_json = args.out.with_suffix(".json")
    all_results = json.loads(path_json.read_text()) if path_json.exists() else {}
    all_results[direction] = {"result": result, "texts": len(held[: args.texts]),
                              "command": "python eval/layer_study.py " + " ".join(argv or __import__("sys").argv[1:]),
                              "date": time.strftime("%Y-%m-%d %H:%M")}
    path_json.parent.mkdir(parents=True, exist_ok=True)
    path_json.write_text(json.dumps(all_results, indent=2))
    lines = ["# Early versus late layers", "",
             "Held-out calibration continuations (no mapper was fitted on them); KL(native ‖ X) and top-1 "
             "over the continuation's next tokens. `late_only`: the first k target layers carry no context "
             "information (mean K/V); `replay`: the target computes them itself (a prefill stopped after "
             "layer k − 1), at the cost shown per 1,000 context tokens.", ""]
    for d, entry in all_results.items():
        r = entry["result"]
        lines += [f"## {d}", "", f"Command: `{entry['command']}` ({entry['date']}, {entry['texts']} texts). "
                  f"Full prefill of the context: {r['full_prefill_s_per_1k']:.2f} s per 1K tokens.", "",
                  "| k | variant | KL | top-1 | replay s per 1K tokens |", "|---|---|---|---|---|"]
        for key in sorted((k for k in r if ":" in k), key=lambda k: (r[k]["k"], r[k]["mode"])):
            row = r[key]
            lines.append(f"| {row['k']} | {row['mode']} | {row['kl']:.3f} | {row['top1']:.3f} | "
                         f"{row['replay_s_per_1k']:.2f} |")
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
