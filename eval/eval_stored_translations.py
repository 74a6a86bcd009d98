"""What storing translations costs in answers: translated at query time against translated once and stored.

    python eval/eval_stored_translations.py                 # SmolLM2 store -> Qwen2.5, auto's mapper, int8
    python eval/eval_stored_translations.py --target gemma3-270m --n 60

On the gate's calibration lookups (`calib-lookup` seed 0: 36 fact documents, same-shape
distractors, top-4 retrieval) one SmolLM2 store is built, then translated once with
`cag.store_translation.translate_store` in the store's own format (int8 by default).
Every question is answered twice over the same retrieved chunks: translating at query
time in the target's compute dtype (``stored_translations=False``) and loading the stored
translation (``True``). Both are greedy. Per question: found, F1, whether the two answers
are the same text, and KL(query-time ‖ stored) of the first answer token's distribution.
Calibration-side items only: nothing here is tuned, the two paths are only compared.

Writes OUT/stored_translations.json and .md (default OUT: eval/results/stored_translations),
a row per question as it goes (``rows.jsonl``: a re-run resumes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from cag.generate import last_logits  # noqa: E402
from cag.models import registry  # noqa: E402
from cag.progress import Progress  # noqa: E402
from cag.store_translation import translate_store  # noqa: E402
from eval.calibration_lookup import calibration_lookup  # noqa: E402
from eval.harness import host_info, host_line  # noqa: E402
from eval.metrics import contains_answer, kl_divergence, token_f1  # noqa: E402
from stores.build import build_store  # noqa: E402


def first_token_logprobs(ctx: CachedContext, question: str, hits) -> torch.Tensor:
    lm, _, asm = ctx._ready()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ctx.prepare(question, hits)
    with asm.model_lock, torch.inference_mode():
        return torch.log_softmax(last_logits(lm.model, prepared.question_ids[None].to(lm.device), prepared.cache).float(), -1)[-1]


def translation_bytes(store: Path, made) -> tuple[int, int]:
    """Bytes and target tokens of the stored translations by `made`'s mapper (however many runs wrote them)."""
    from cag.kv import KVChunk
    from stores.location import open_store
    from stores.translations import base_key, is_translation_key

    location = open_store(store)
    live = location.load_manifest(location.current_version()).chunk_keys()
    size = tokens = 0
    with location.chunks() as chunks:
        for key in chunks.keys():
            if is_translation_key(key) and base_key(key) in live:
                data = chunks.get(key)
                chunk = KVChunk.from_bytes(data)
                if chunk.settings["translated"]["mapper"] == made.mapper_id:
                    size, tokens = size + len(data), tokens + chunk.num_tokens
    return size, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--mapper", default="auto")
    ap.add_argument("--dtype", default=None, help="the translations' format (default: the store's, int8)")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "cag" / "stored_translations_eval")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "stored_translations")
    args = ap.parse_args(argv)
    host = host_info()
    items = calibration_lookup(seed=0)[:args.n]
    store = args.work / f"store-{args.source}"
    build_store([(d.id, d.text) for d in items[0].documents], store, registry.load(args.source, "auto"))
    made = translate_store(store, args.target, mapper=args.mapper, dtype=args.dtype, progress=True)
    stored_bytes, stored_tokens = translation_bytes(store, made)
    print(f"translations: {made.translated} new, {made.present} kept, {stored_bytes / stored_tokens:,.0f} "
          "bytes/token", file=sys.stderr)
    common = dict(store=store, target=args.target, mapper=args.mapper, min_retention=0.0, translation_cache_mb=0,
                  max_new_tokens=args.max_new_tokens)
    fly, stored = CachedContext(stored_translations=False, **common), CachedContext(stored_translations=True, **common)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / f"rows-{args.target}.jsonl"
    done = {json.loads(line)["id"]: json.loads(line) for line in rows_path.open()} if rows_path.exists() else {}
    with Progress("stored translations", total=len(items), unit="questions", completed=len(done)) as bar, \
            rows_path.open("a") as sink:
        for item in items:
            if item.id in done:
                continue
            hits = fly.retrieve(item.question)
            row = {"id": item.id}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name, ctx in (("query_time", fly), ("stored", stored)):
                    a = ctx.answer(item.question, hits)
                    row[name] = {"text": a.text, "found": contains_answer(a.text, item.answers),
                                 "f1": token_f1(a.text, item.answers), "translate_s": a.timings.translate,
                                 "load_s": a.timings.load}
            row["kl_first_token"] = kl_divergence(first_token_logprobs(fly, item.question, hits),
                                                  first_token_logprobs(stored, item.question, hits))
            row["same_text"] = row["query_time"]["text"] == row["stored"]["text"]
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done[item.id] = row
            bar.advance(note=f"{sum(r['same_text'] for r in done.values())} identical so far")
    rows = [done[i.id] for i in items]
    summary = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
               "date": time.strftime("%Y-%m-%d %H:%M"), "host": host, "source": args.source, "target": args.target,
               "mapper": made.mapper, "mapper_id": made.mapper_id, "dtype": made.dtype, "n": len(rows),
               "translation_bytes_per_token": round(stored_bytes / stored_tokens, 1),
               "same_text": sum(r["same_text"] for r in rows),
               "kl_first_token_mean": float(np.mean([r["kl_first_token"] for r in rows])),
               "kl_first_token_max": float(np.max([r["kl_first_token"] for r in rows]))}
    diff = np.array([r["stored"]["f1"] - r["query_time"]["f1"] for r in rows])
    boot = np.random.default_rng(0).choice(diff, (2000, diff.size)).mean(1)
    summary["delta_f1"] = {"value": float(diff.mean()), "low": float(np.quantile(boot, 0.025)),
                           "high": float(np.quantile(boot, 0.975))}
    for name in ("query_time", "stored"):
        summary[name] = {k: float(np.mean([r[name][k] for r in rows])) for k in ("found", "f1", "translate_s",
                                                                                   "load_s")}
    (args.out / f"quality-{args.target}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    q, s = summary["query_time"], summary["stored"]
    md = [f"# Stored translations against translating at query time: {args.source} → {args.target}", "",
          f"Command: `{summary['command']}`  ", f"Date: {summary['date']}. {host_line(host, {})}", "",
          f"{summary['n']} calibration lookups (calib-lookup seed 0, top-4 retrieval, greedy, "
          f"{args.max_new_tokens} new tokens); mapper {made.mapper} ({made.mapper_id}); translations stored in "
          f"{made.dtype}.", "",
          "| path | found | F1 | translate s (mean) | load s (mean) |", "|---|---|---|---|---|",
          f"| translated at query time | {q['found']:.3f} | {q['f1']:.3f} | {q['translate_s']:.3f} | "
          f"{q['load_s']:.3f} |",
          f"| stored translation | {s['found']:.3f} | {s['f1']:.3f} | {s['translate_s']:.3f} | {s['load_s']:.3f} |",
          "", f"F1 stored − query time, paired: {summary['delta_f1']['value']:+.4f} "
          f"[{summary['delta_f1']['low']:+.4f}, {summary['delta_f1']['high']:+.4f}] (95% bootstrap over questions). "
          f"Stored translations cost {summary['translation_bytes_per_token']:,.0f} bytes per target token.",
          "", f"Identical answers: {summary['same_text']} of {summary['n']}. KL(query time ‖ stored) of the first "
          f"answer token: mean {summary['kl_first_token_mean']:.2e}, max {summary['kl_first_token_max']:.2e}.", ""]
    (args.out / f"quality-{args.target}.md").write_text("\n".join(md))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
