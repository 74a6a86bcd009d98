"""Does combining the source model's choice with the retriever's cover more answers?

    python eval/probe_selector_fusion.py --limit 50      # calib-lookup seed 2, SmolLM2 store

A diagnosis on calibration lookups (no generation, no evaluation set): for each question,
every retrieved sentence gets the source model's score (contrastive attention of its
retrieval heads, `cag/source_heads.json`) and the retriever's (embedding similarity to
the question); each choice of the crux at `--ratios` of the context tokens is judged by
whether its sentences hold the answer (cover). Fusions: the sum of the two scores' ranks,
of their z-scores, and the larger rank. Writes ``eval/results/selector_fusion.md``/``.json``.
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

from cag import selection  # noqa: E402
from cag.context import CachedContext  # noqa: E402
from cag.kv import KVChunk  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402
from eval.probe_crux_cover import calib_lookup_store, covers  # noqa: E402


def _ranks(t: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(t)).float() / max(t.numel() - 1, 1)


def _z(t: torch.Tensor) -> torch.Tensor:
    return (t - t.mean()) / (t.std() + 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2])
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "selector_fusion")
    ap.add_argument("--store-root", type=Path, default=Path.home() / ".cache" / "cag" / "repair_ablation")
    args = ap.parse_args(argv)

    items, store = calib_lookup_store(args.source, args.limit, args.store_root)
    ctx = CachedContext(store=store, target=args.source, mapper="identity", top_k=4, min_retention=0.0,
                        translation_cache_mb=0)
    asm = ctx.assembler  # loads the model and opens the chunk store
    manifest, index = ctx._current_view()
    heads = selection.retrieval_heads(manifest.source_fingerprint.id)
    names = ["source", "retriever", "rank sum", "z-score sum", "larger rank"]
    got = {r: {k: [] for k in names} for r in args.ratios}
    for item in items:
        hits = ctx.retrieve(item.question)
        texts = [h.text for h in hits]
        chunks = [KVChunk.from_bytes(ctx._chunks.get(h.key), expect_model=manifest.source_fingerprint) for h in hits]
        with torch.inference_mode():
            src = selection._source_sentence_scores(asm, chunks, texts, item.question, heads)
        spans = [selection.sentence_spans(t) for t in texts]
        sentences = [t[s:e] for t, sp in zip(texts, spans) for s, e in sp]
        vectors = torch.nn.functional.normalize(
            torch.as_tensor(index.embed([item.question] + sentences), dtype=torch.float32), dim=-1)
        sims = vectors[1:] @ vectors[0]
        flat = torch.tensor([v for c in src for v in c])

        def per_chunk(t: torch.Tensor) -> list[list[float]]:
            out, k = [], 0
            for sp in spans:
                out.append(t[k:k + len(sp)].tolist())
                k += len(sp)
            return out
        scores = {"source": src, "retriever": per_chunk(sims), "rank sum": per_chunk(_ranks(flat) + _ranks(sims)),
                  "z-score sum": per_chunk(_z(flat) + _z(sims)),
                  "larger rank": per_chunk(torch.maximum(_ranks(flat), _ranks(sims)))}
        for ratio in args.ratios:
            budget = round(ratio * sum(c.num_tokens for c in chunks))
            for name, sc in scores.items():
                got[ratio][name].append(covers(texts, selection._choose(chunks, texts, sc, budget), item.answers))
    table = {f"{r:g}": {k: sum(v) / len(v) for k, v in got[r].items()} for r in args.ratios}
    result = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "host": host_info(), "items": "calib-lookup seed 2", "n": len(items), "heads": heads, "cover": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Choosing the crux: source model, retriever, and their fusions (cover)", "",
             f"`{result['command']}`, {result['date']}; {host_line(result['host'], {})}", "",
             f"{len(items)} calib-lookup items (seed 2), {args.source} store, top-4 chunks of 256 tokens. Cover: the "
             "chosen sentences hold the answer (a retrieved sentence holds it for 96%).", "",
             "| budget | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {r} | " + " | ".join(f"{row[k]:.2f}" for k in names) + " |" for r, row in table.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
