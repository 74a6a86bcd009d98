"""A translated context's attention mass, matched to native: one logit offset per layer and query head.

    python eval/calibrate_context_mass.py --target qwen2.5-0.5b --method bottleneck \\
        --lengths 1024 2048 4096 --n 6 --out eval/results/context_mass

`eval/diagnose_length.py` found translated chunks drawing far more of the question's
attention than the target's own chunks of the same text (the prompt head, the
question's sink, gets less), more so the more chunks are placed. This fits the
correction the issue asks for ("a per-head logit offset, so translated context draws
neither more nor less attention than native context"), label-free:

For each calibration needle (seeds of their own, none the diagnosis reads) the
question is run over the native and over the translated placement of the same
chunks; per layer l and query head h, C is the attention mass on the context block
(mean over the question's tokens). Adding ``b`` to every context logit moves
``logit(C)`` by exactly ``b``, so the offset that gives the translated context
native's mass is ``b = logit(C_native) − logit(C_translated)``, averaged over items.
No answer is read. Written to OUT/<source>__<target>__<method>.json (with the
spread over items and over lengths, and the mapper artifact it was measured with);
`eval/diagnose_length.py --offsets FILE` measures what it does to lookups. The
runtime does not read it: it moves there only if the diagnosis finds it helps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402

SEED_BASE = 500  # calib-needle seeds of this calibration only (diagnosis: 300 + length)


def context_mass(lm, placed, q: torch.Tensor) -> torch.Tensor:
    """``[layers, query heads]``: the question's mean attention mass on the placed context block."""
    from eval.lab.score import question_attentions

    att = question_attentions(lm.model, placed, q)
    lo, hi = placed.prefix_tokens, placed.context_ids.numel()
    return torch.stack([a[0, :, :, lo:hi].float().sum(-1).mean(-1) for a in att])


def logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-6, 1 - 1e-6)
    return torch.log(p) - torch.log1p(-p)


@torch.inference_mode()
def item_offsets(ctx: CachedContext, item) -> dict:
    from eval.diagnose_length import translated_chunks

    lm, _, asm = ctx._ready()
    translated, hits = translated_chunks(ctx, item)
    natives = [lm.prefill(h.text) for h in hits]
    q = asm.question_ids(item.question)
    c_native = context_mass(lm, asm.place(natives), q)
    c_translated = context_mass(lm, asm.place(translated), q)
    return {"native": c_native.tolist(), "translated": c_translated.tolist(),
            "offset": (logit(c_native) - logit(c_translated)).tolist(), "context_tokens": sum(c.num_tokens for c in natives)}


def main(argv=None) -> int:
    from cag.models import registry
    from cag.progress import Progress
    from eval.diagnose_length import measurement_context, needles, pair_arguments
    from eval.harness import host_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(ap, n=6, lengths=[1024, 2048, 4096])
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "context_mass")
    args = ap.parse_args(argv)

    lm = registry.load(args.target, "auto")
    items = {length: needles(length, args.n, lm.tokenizer, seed_base=SEED_BASE) for length in args.lengths}
    ctx = measurement_context([it for its in items.values() for it in its], args.out, args.source, args.target,
                              args.method)
    mapper = ctx._ready()[1]
    rows_path = args.out / f"rows-{args.source}__{args.target}.jsonl"
    done = {json.loads(x)["id"] for x in rows_path.read_text().splitlines()} if rows_path.exists() else set()
    todo = [(length, it) for length, its in items.items() for it in its if it.id not in done]
    with Progress("context mass", total=len(todo), unit="items", interval_s=20) as bar, rows_path.open("a") as f:
        for length, item in todo:
            f.write(json.dumps({"id": item.id, "length": length, **item_offsets(ctx, item)}) + "\n")
            f.flush()
            bar.advance(1)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()]
    offsets = torch.tensor([r["offset"] for r in rows])                      # [items, L, H]
    per_length = {str(length): torch.tensor([r["offset"] for r in rows if r["length"] == length]).mean(0)
                  for length in sorted({r["length"] for r in rows})}
    native = torch.tensor([r["native"] for r in rows]).mean(0)
    translated = torch.tensor([r["translated"] for r in rows]).mean(0)
    result = {
        "source": args.source, "target": args.target, "method": mapper.method,
        "mapper_artifact": getattr(mapper, "artifact_id", None), "target_fingerprint": lm.fingerprint.id,
        "offset": offsets.mean(0).tolist(),                                   # [L, H]
        "offset_sd_over_items": offsets.std(0).mean().item(),
        "offset_mean_by_length": {k: float(v.mean()) for k, v in per_length.items()},
        "context_mass_native_by_layer": native.mean(-1).tolist(),
        "context_mass_translated_by_layer": translated.mean(-1).tolist(),
        "n": len(rows), "lengths": args.lengths, "seed_base": SEED_BASE,
        "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": host_info().get("cpu", ""),
    }
    name = f"{args.source}__{args.target}__{args.method}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("n", "offset_sd_over_items", "offset_mean_by_length",
                                             "context_mass_native_by_layer", "context_mass_translated_by_layer")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
