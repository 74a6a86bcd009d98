"""The router against its parts on the same questions and the same retrieved chunks.

    python eval/router_eval.py --dataset synthetic-kb --n 30 --follow-ups 5

Per question, with the chunks retrieved once (retrieval is left out of every TTFT):

- ``small``: the small model (the store's source) over its own chunk caches; TTFT is
  its own first token (what it would show if it were served alone);
- ``large_direct``: the large model prefills the retrieved text (`CachedContext.answer_direct`);
- ``large_cached``: the large model through its quality gate (`CachedContext.answer`):
  the translated chunks if that path passes the gate, else direct context; the path is
  reported;
- ``router``: `cag.Router` with its policy (by default the one `eval/router_calibrate.py`
  wrote from calibration items; never chosen on these questions). Its TTFT is until the
  served answer's first token: the whole small answer (its confidence needs every
  token), plus the large model's TTFT when it escalates.

Multi-turn: on the first ``--follow-ups`` questions a router that always escalates
answers the question, then a follow-up (the next item's question) over the same
context, then that same question fresh; reported are the context tokens each prefilled
and both models' TTFT, and whether the follow-up's answer equals the fresh one.

Writes ``eval/results/router.md`` and ``router.json`` (command, date, host, per-item rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.progress import Progress  # noqa: E402
from cag.router import Router, RouterPolicy  # noqa: E402
from eval import metrics  # noqa: E402
from eval.datasets import get_dataset  # noqa: E402
from eval.harness import host_info, host_line, measure_prefill_rate  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

CONDITIONS = ("small", "large_direct", "large_cached", "router")


def scored(text: str, answers, ttft: float, **extra) -> dict:
    return {"answer": text.strip(), "found": metrics.contains_answer(text, answers),
            "f1": metrics.token_f1(text, answers), "exact_match": metrics.exact_match(text, answers),
            "ttft_s": ttft, **extra}


def hits_for(router: Router, item):
    if item.context == "all":
        return router.small_context.document_hits([d.id for d in item.documents])
    return router.retrieve(item.question)


def run_item(router: Router, item) -> dict:
    hits = hits_for(router, item)
    large = router.large_context
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gate's reason, once per question otherwise
        routed = router.answer(item.question, hits)
        cached = large.answer(item.question, hits)
        direct = large.answer_direct(item.question, hits)
    a = item.answers
    return {"item": item.id, "question": item.question, "answers": list(a),
            "context_tokens": direct.context_tokens,
            "results": {
                "small": scored(routed.small_answer, a, routed.small_ttft_s),
                "large_direct": scored(direct.text, a, direct.timings.first_token, path="direct"),
                "large_cached": scored(cached.text, a, cached.timings.first_token, path=cached.path),
                "router": scored(routed.text, a, routed.ttft_s, route=routed.route, path=routed.path,
                                 confidence=routed.confidence, large_path=routed.large_path),
            }}


def run_follow_up(router: Router, item, next_question: str) -> dict:
    hits = hits_for(router, item)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = router.answer(item.question, hits)
        follow = router.follow_up(next_question)
        fresh = router.answer(next_question, hits)
    turn = lambda r: {"context_prefill_tokens": r.context_prefill_tokens, "small_ttft_s": r.small_ttft_s,  # noqa: E731
                      "large_ttft_s": r.large_ttft_s, "ttft_s": r.ttft_s, "large_path": r.large_path,
                      "answer": r.text.strip()}
    return {"item": item.id, "question": item.question, "follow_up": next_question, "first": turn(first),
            "follow": turn(follow), "fresh": turn(fresh), "same_answer": follow.text == fresh.text}


def summarize(rows: list[dict], follow_rows: list[dict]) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    table = []
    for cond in CONDITIONS:
        res = [r["results"][cond] for r in rows]
        entry = {"condition": cond, "n": len(res), "found": mean([x["found"] for x in res]),
                 "found_count": int(sum(x["found"] for x in res)), "f1": mean([x["f1"] for x in res]),
                 "exact_match": mean([x["exact_match"] for x in res]),
                 "ttft_s_mean": mean([x["ttft_s"] for x in res]),
                 "ttft_s_median": statistics.median([x["ttft_s"] for x in res]) if res else None}
        paths = sorted({x.get("path") for x in res if x.get("path")})
        if paths:
            entry["paths"] = {p: sum(1 for x in res if x.get("path") == p) for p in paths}
        table.append(entry)
    routes = [r["results"]["router"]["route"] for r in rows]
    multi = {}
    if follow_rows:
        for key in ("follow", "fresh"):
            turns = [f[key] for f in follow_rows]
            multi[key] = {"context_prefill_tokens_mean": mean([t["context_prefill_tokens"] for t in turns]),
                          "small_ttft_s_mean": mean([t["small_ttft_s"] for t in turns]),
                          "large_ttft_s_mean": mean([t["large_ttft_s"] for t in turns if t["large_ttft_s"]]),
                          "ttft_s_mean": mean([t["ttft_s"] for t in turns])}
        multi["n"] = len(follow_rows)
        multi["same_answer"] = mean([float(f["same_answer"]) for f in follow_rows])
        multi["large_paths"] = sorted({str(f["follow"]["large_path"]) for f in follow_rows})
    return {"table": table, "escalated_share": mean([float(r == "large") for r in routes]),
            "multi_turn": multi}


def _f(v, d=2):
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"


def render(report: dict) -> str:
    run, s = report["run"], report["summary"]
    pol = run["policy"]
    lines = ["# Router: small model first, the large one when it is unsure", "",
             f"Command: `{run['command']}`  ", f"Date: {run['date']}; machine: {run['machine']}.  ",
             host_line(run["host"], run["prefill"]), "",
             f"Dataset: {run['dataset']} (first {run['n']} questions), top-k {run['top_k']}, "
             f"{run['max_new_tokens']} new tokens at most. Small model {run['small']}, large {run['large']}.  ",
             f"Policy: escalate when {pol['metric']} < {pol['threshold']:.4g}"
             + (f", calibrated on {pol['calibration'].get('items')} ({pol['calibration'].get('command')})"
                if pol.get("calibration") else " (given on the command line)") + ".", ""]
    if run.get("note"):
        lines += [run["note"], ""]
    lines += ["| condition | n | found | F1 | EM | TTFT s (mean) | TTFT s (median) | path |",
              "|---|---|---|---|---|---|---|---|"]
    for e in s["table"]:
        paths = ", ".join(f"{p} {c}" for p, c in e.get("paths", {}).items())
        lines.append(f"| {e['condition']} | {e['n']} | {_f(e['found'])} ({e['found_count']}/{e['n']}) | "
                     f"{_f(e['f1'])} | {_f(e['exact_match'])} | {_f(e['ttft_s_mean'], 3)} | "
                     f"{_f(e['ttft_s_median'], 3)} | {paths or '–'} |")
    lines += ["", f"Escalated to the large model: {_f(s['escalated_share'])} of the questions.", "",
              "TTFT leaves out retrieval (the same for every condition). The small row is the small model's "
              "own first token; the router's is until the served answer's first token (the whole small answer, "
              "plus the large model's TTFT when it escalates).", ""]
    m = s.get("multi_turn") or {}
    if m:
        fo, fr = m["follow"], m["fresh"]
        lines += ["## Multi-turn: a follow-up on the same context", "",
                  f"{m['n']} questions; a router that always escalates answers the question, then a follow-up "
                  "(the next item's question) over the kept context caches, then the same follow-up question "
                  f"fresh. Large path: {', '.join(m['large_paths'])}.", "",
                  "| turn | context tokens prefilled (mean) | small TTFT s | large TTFT s | router TTFT s |",
                  "|---|---|---|---|---|",
                  f"| follow-up | {_f(fo['context_prefill_tokens_mean'], 1)} | {_f(fo['small_ttft_s_mean'], 3)} | "
                  f"{_f(fo['large_ttft_s_mean'], 3)} | {_f(fo['ttft_s_mean'], 3)} |",
                  f"| fresh query | {_f(fr['context_prefill_tokens_mean'], 1)} | {_f(fr['small_ttft_s_mean'], 3)} | "
                  f"{_f(fr['large_ttft_s_mean'], 3)} | {_f(fr['ttft_s_mean'], 3)} |", "",
                  f"Follow-up answer identical to the fresh one: {_f(m['same_answer'])}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="synthetic-kb", help="an evaluation set (reporting only)")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", default="smollm2-135m")
    ap.add_argument("--large", default="qwen2.5-0.5b")
    ap.add_argument("--threshold", type=float, default=None,
                    help="override the calibrated policy (mean_logprob); default: cag/router_policy.json")
    ap.add_argument("--follow-ups", type=int, default=5, help="questions for the multi-turn figure")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--prefill-rate-tokens", type=int, default=512)
    ap.add_argument("--work", type=Path, default=None, help="store folder (default: a temporary one)")
    ap.add_argument("--note", default="", help="a line for the report (e.g. why n is small)")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results")
    args = ap.parse_args(argv)
    host = host_info()
    items = get_dataset(args.dataset, seed=args.seed, limit=args.n)
    policy = None if args.threshold is None else RouterPolicy(threshold=args.threshold)
    settings = dict(small=args.small, large=args.large, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                    context_options={"translation_cache_mb": 0})  # every query translates: no warm LRU
    with tempfile.TemporaryDirectory(prefix="cag-router-eval-") as tmp:
        store = (args.work or Path(tmp)) / "store"
        if not store.exists():
            print(f"building the store ({args.small}) in {store}", file=sys.stderr)
            build_eval_store(items, store, args.small, chunk_tokens=args.chunk_tokens)
        router = Router(store=store, policy=policy, **settings)
        active = router.active_policy
        prefill = {name: measure_prefill_rate(ctx.target_model, args.prefill_rate_tokens)
                   for name, ctx in ((args.small, router.small_context), (args.large, router.large_context))}
        rows, follow_rows = [], []
        with Progress("router eval", len(items), unit="questions") as bar:
            for item in items:
                rows.append(run_item(router, item))
                r = rows[-1]["results"]["router"]
                bar.advance(note=f"{r['route']} {'✓' if r['found'] else '✗'}")
        up = Router(store=store, policy=RouterPolicy(threshold=math.inf), **settings)
        followed = items[:args.follow_ups]
        with Progress("router follow-ups", len(followed), unit="questions") as bar:
            for i, item in enumerate(followed):
                follow_rows.append(run_follow_up(up, item, items[(i + 1) % len(items)].question))
                bar.advance()
        router.close()
        up.close()
    command = " ".join(["python", "eval/router_eval.py", *(argv if argv is not None else sys.argv[1:])])
    report = {"run": {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "host": host,
                      "prefill": prefill, "dataset": args.dataset, "n": len(items), "top_k": args.top_k,
                      "max_new_tokens": args.max_new_tokens, "small": args.small, "large": args.large,
                      "policy": active.model_dump(), "note": args.note},
              "summary": summarize(rows, follow_rows), "rows": rows, "follow_ups": follow_rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "router.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
