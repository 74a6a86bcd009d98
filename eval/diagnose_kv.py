"""Keys or values: which half of a translated cache loses the facts.

    python eval/diagnose_kv.py --store eval/results/eval-quick/store --target qwen2.5-0.5b \\
                               --methods ridge heterofold [--limit 10] [--out eval/results/kv_diagnosis]

On the same questions and the same retrieved chunks as `cag eval` (synthetic KB),
the target answers from four caches that differ only in where K and V come from:

- ``K native + V native``: the target's own chunk caches (`native_cache` in `cag eval`);
- ``K translated + V native`` and ``K native + V translated``: one half swapped;
- ``K translated + V translated``: the translated cache (`cache:<method>`).

Token F1, answer found, and the gold answer's mean log-likelihood (teacher-forced)
tell which half carries the loss. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path

import torch

from cag.context import CachedContext, Timings
from cag.generate import generate, last_logits, stop_token_ids
from cag.kv import KVChunk
from eval import datasets as ds
from eval import metrics

MIXES = {"K native + V native": ("native", "native"), "K translated + V native": ("translated", "native"),
         "K native + V translated": ("native", "translated"),
         "K translated + V translated": ("translated", "translated")}


def mix(native: KVChunk, translated: KVChunk, keys_from: str, values_from: str) -> KVChunk:
    src = {"native": native, "translated": translated}
    if not torch.equal(native.token_ids, translated.token_ids):
        raise ValueError("native and translated chunks tokenize differently")
    return KVChunk(src[keys_from].keys.float(), src[values_from].values.float(), native.token_ids,
                   native.offsets, native.text_hash, native.model, native.settings)


@torch.inference_mode()
def diagnose(store: Path, target: str, methods: list[str], items, max_new_tokens: int = 16) -> dict:
    scores: dict[str, dict[str, list[float]]] = {}
    for method in methods:
        ctx = CachedContext(store=store, target=target, mapper=method, translation_cache_mb=0,
                            max_new_tokens=max_new_tokens)
        lm, mapper, asm = ctx._ready()
        stops = stop_token_ids(lm.tokenizer)
        for item in items:
            hits = ctx.retrieve(item.question)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                translated, hits = ctx._target_chunks(hits, Timings(), [])
            natives = [lm.prefill(h.text) for h in hits]
            q = asm.question_ids(item.question)
            gold = lm.tokenize((" " if not asm.layout.chat else "") + item.answers[0])[0]
            for name, (k_from, v_from) in MIXES.items():
                if name == "K native + V native" and method != methods[0]:
                    continue  # the same for every method: measured once
                label = name if name == "K native + V native" else f"{method}: {name}"
                chunks = [mix(n, t, k_from, v_from) for n, t in zip(natives, translated)]
                placed = asm.place(chunks)
                # a forward extends a cache in place: teacher-force on a copy, generate from the original
                logits = last_logits(lm.model, torch.cat([q, gold[:-1]])[None],
                                     copy.deepcopy(placed.cache), positions=gold.numel())
                logp = torch.log_softmax(logits.float(), -1)
                gen = generate(lm.model, lm.tokenizer, placed.cache, q, max_new_tokens=max_new_tokens,
                               stop_ids=stops)
                entry = scores.setdefault(label, {"f1": [], "found": [], "gold_ll": []})
                entry["f1"].append(metrics.token_f1(gen.text, item.answers))
                entry["found"].append(metrics.contains_answer(gen.text, item.answers))
                entry["gold_ll"].append(metrics.gold_log_likelihood(logp, gold))
    return {k: {m: sum(v) / len(v) for m, v in e.items()} | {"n": len(e["f1"])} for k, e in scores.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--target", default="qwen2.5-0.5b")
    parser.add_argument("--methods", nargs="+", default=["ridge", "heterofold"])
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("eval/results/kv_diagnosis"))
    args = parser.parse_args(argv)
    items = ds.get_dataset("synthetic-kb", limit=args.limit)
    result = diagnose(args.store, args.target, args.methods, items)
    path = args.out.with_suffix(".json")
    everything = json.loads(path.read_text()) if path.exists() else {}
    command = "python eval/diagnose_kv.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    everything[args.target] = {"result": result, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(everything, indent=2))
    lines = ["# Keys or values: where a translated cache loses the facts", "",
             "Synthetic-KB questions, the same retrieved chunks; each cache takes its keys and its values "
             "either from the target's own chunk prefill (native) or from a mapper's translation of the "
             "store's source chunks.", ""]
    for tgt, entry in everything.items():
        lines += [f"## target {tgt}", "", f"Command: `{entry['command']}` ({entry['date']})", "",
                  "| cache | n | F1 | found | gold log-likelihood per token |", "|---|---|---|---|---|"]
        for label, r in entry["result"].items():
            lines.append(f"| {label} | {r['n']} | {r['f1']:.2f} | {r['found']:.2f} | {r['gold_ll']:.2f} |")
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
