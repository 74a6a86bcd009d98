"""Why the target's own chunk caches lose same-shaped facts: a primacy probe.

    python eval/probe_primacy.py --dataset calib-lookup --limit 50 --target qwen2.5-0.5b

Direct context reads the retriever's best chunk first, and these models favour what
they read first. Chunks prefilled apart each look like the first document after the
prompt head, so every chunk pulls the question as if it were the best one. On the same
retrieved chunks, best first, this measures the native path in ways that test that:

- ``direct best last`` / ``native best last``: the same chunks in reverse order;
- ``native, others follow``: the best chunk prefilled after the head, every other chunk
  after the head *and* a neutral paragraph (a calibration essay's, dropped after), so it
  no longer looks like the first thing read;
- ``native, others' keys × α``: every chunk but the best has its keys scaled by α;
- ``native, keys × γ**rank``: the rank key decay (`CachedContext.rank_key_decay`).

Research code: it chose nothing. `eval/calibrate_rank_decay.py` chooses γ, label-free.
Writes ``<out>/<dataset>-<target>.jsonl`` (resumable) and a summary table.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.ape import rank_key_scales  # noqa: E402
from cag.context import CachedContext  # noqa: E402
from cag.kv import text_sha256  # noqa: E402
from eval import datasets as ds  # noqa: E402
from eval.harness import DIRECT, NATIVE, NO_CONTEXT, ItemRunner, _Run  # noqa: E402
from eval.repair_ablation import load_items  # noqa: E402
from eval.run import build_eval_store  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="calib-lookup")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--source", default="smollm2-135m", help="the store's model (retrieval and chunking only)")
    ap.add_argument("--follow-tokens", type=int, default=64)
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.9, 0.8])
    ap.add_argument("--decays", type=float, nargs="*", default=[0.95, 0.9])
    ap.add_argument("--store-root", type=Path, default=Path.home() / ".cache" / "cag" / "repair_ablation")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "rank_key_decay" / "primacy")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    items = load_items(args.dataset, args.limit)
    store = args.store_root / f"{args.dataset}-{args.source}"
    build_eval_store(items, store, args.source, chunk_tokens=256)
    base = CachedContext(store=store, target=args.target, mapper="identity", top_k=4, max_new_tokens=16,
                         translation_cache_mb=0, min_retention=0.0, rank_key_decay=1.0)
    runner = ItemRunner(base, {}, max_new_tokens=16)
    lm, asm = runner.lm, base.assembler
    # Every cached condition here is the target's own chunks: score them under the native APE settings.
    native_ape = runner._ape
    runner._ape = lambda name, run: native_ape(name if name in (DIRECT, NO_CONTEXT) else NATIVE, run)
    essay = (ds.essays_dir() / ds.calibration_essays()[0]).read_text()
    neutral = lm.tokenize(essay[2000:8000])[0][: args.follow_tokens].tolist()
    follow_memo: dict[str, object] = {}

    def follow(text: str):
        if text not in follow_memo:
            ids, offsets = lm.tokenize(text)
            follow_memo[text] = lm.prefill_tokens(ids, offsets=offsets, text_hash=text_sha256(text),
                                                  sink_ids=list(lm.sink_ids) + neutral)
        return follow_memo[text]

    def placed(chunks, question_ids, scales=None) -> _Run:
        p = asm.place(chunks, key_scales=scales)
        return _Run(p.cache, question_ids, p.context_ids.numel() - p.prefix_tokens, 0.0, [],
                    (p.prefix_tokens, p.context_ids.numel()))

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.dataset}-{args.target}.jsonl"
    done = {json.loads(line)["item"] for line in path.read_text().splitlines() if line.strip()} if path.exists() else set()
    for k, item in enumerate(items, 1):
        if item.id in done:
            continue
        hits = runner.hits_for(item)
        q = asm.question_ids(item.question)
        own = [runner._prefilled(h.text) for h in hits]
        runs = {**runner.text_runs(item, hits), "native": placed(own, q),
                "direct best last": runner._text_run(item, hits[::-1], with_context=True),
                "native best last": placed(own[::-1], q),
                f"native, others follow ({args.follow_tokens} tokens)": placed(own[:1] + [follow(h.text) for h in hits[1:]], q)}
        for a in args.alphas:
            runs[f"native, others' keys × {a:g}"] = placed(own, q, [1.0] + [a] * (len(own) - 1))
        for g in args.decays:
            runs[f"native, keys × {g:g}**rank"] = placed(own, q, rank_key_scales([h.score for h in hits], g))
        reference = runner.teacher_forced(runs[DIRECT], runner.gold_ids(item.answers[0]))
        scored = runner.score(item, runs, reference)
        row = {"item": item.id, "results": {c: {"answer": r.answer, "found": r.found, "f1": r.f1,
                                                "gold_log_likelihood": r.gold_log_likelihood,
                                                "kl_from_direct": r.kl_from_direct} for c, r in scored.items()}}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"probe_primacy: {args.dataset} {args.target} {k}/{len(items)}", file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [f"# Primacy probe: {args.dataset}, {args.target} (n = {len(rows)})", "",
             f"`{' '.join(['python', *sys.argv])}`; top-4 chunks of a {args.source} store, best first unless "
             "named; the target's own chunk caches at its calibrated APE; γ = 1 unless named.", "",
             "| condition | found | F1 | gold LL | KL(DC‖X) |", "| --- | --- | --- | --- | --- |"]
    for cond in rows[0]["results"]:
        xs = [r["results"][cond] for r in rows]
        kl = [x["kl_from_direct"] for x in xs if x["kl_from_direct"] is not None]
        lines.append(f"| {cond} | {np.mean([x['found'] for x in xs]):.2f} | {np.mean([x['f1'] for x in xs]):.2f} | "
                     f"{np.mean([x['gold_log_likelihood'] for x in xs]):.2f} | "
                     + (f"{np.mean(kl):.3f} |" if kl else "– |"))
    (args.out / f"{args.dataset}-{args.target}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
