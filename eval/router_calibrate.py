"""Calibrate the router's threshold on calibration-side lookup items and record it for `cag.Router`.

    python eval/router_calibrate.py --n 30 --small smollm2-135m --large qwen2.5-0.5b

Over `calib-lookup` items (`eval/calibration_lookup.py`: calibration only, never an
evaluation set), with the documents in a store prefilled by the small model, a
router that always escalates answers every question: so each item has the small
model's answer and confidence (both metrics) and the large model's answer over
the same hits, through its gated path, as the router would serve it.

**Rule.** For each metric (``mean_logprob``, ``neg_entropy``) and each candidate
threshold t (between consecutive measured confidences, and ±inf), the routed
answer is the small one when its confidence ≥ t and the large one otherwise. The
threshold chosen maximises the routed found-rate (`eval.metrics.contains_answer`)
among those that escalate at most ``--max-escalation`` of the items; ties go to
the one escalating fewer items (faster), then to the lower threshold. The metric
chosen is the one whose best threshold routes more answers right (ties:
``mean_logprob``). A threshold at the midpoint between two measured confidences
leaves both neighbours where the data put them.

Writes the policy into ``cag/router_policy.json`` (replacing the entry for the
same small and large models, keeping the others) and the per-item figures into
``eval/results/router_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.progress import Progress  # noqa: E402
from cag.router import METRICS, Router, RouterPolicy, policy_path  # noqa: E402
from eval import metrics  # noqa: E402
from eval.calibration_lookup import DATASET  # noqa: E402
from eval.datasets import get_dataset  # noqa: E402
from eval.harness import host_info  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

RULE = ("the threshold maximising the routed found-rate (small answer when confidence >= t, else the "
        "large model's) among thresholds escalating at most max_escalation of the calibration items; "
        "ties: fewer escalations, then the lower threshold; the metric whose best threshold routes more "
        "answers right (ties: mean_logprob)")


def candidates(values: list[float]) -> list[float]:
    """-inf, the midpoints between consecutive distinct values (the upper one next to -inf), +inf."""
    distinct = sorted(set(values))
    cuts = [-math.inf]
    for lo, hi in zip(distinct, distinct[1:]):
        cuts.append(hi if math.isinf(lo) else (lo + hi) / 2)
    return cuts + [math.inf]


def evaluate(rows: list[dict], metric: str, threshold: float) -> dict:
    """Routed found-rate and escalated share of `threshold` on the calibration rows."""
    escalated = [r["confidence"][metric] < threshold for r in rows]
    found = [r["large_found"] if e else r["small_found"] for r, e in zip(rows, escalated)]
    return {"threshold": threshold, "escalated": sum(escalated) / len(rows), "found": sum(found) / len(rows)}


def choose(rows: list[dict], max_escalation: float) -> tuple[str, dict, dict]:
    """The (metric, chosen point, best point per metric) by the module's rule."""
    if not rows:
        raise ValueError("no calibration rows")
    best = {}
    for metric in METRICS:
        points = [evaluate(rows, metric, t) for t in candidates([r["confidence"][metric] for r in rows])]
        feasible = [p for p in points if p["escalated"] <= max_escalation + 1e-12]
        best[metric] = min(feasible, key=lambda p: (-p["found"], p["escalated"], p["threshold"]))
    metric = min(METRICS, key=lambda m: (-best[m]["found"], METRICS.index(m)))
    return metric, best[metric], best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=30, help="calibration questions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", default="smollm2-135m", help="the store's source model")
    ap.add_argument("--large", default="qwen2.5-0.5b")
    ap.add_argument("--max-escalation", type=float, default=0.5,
                    help="the largest share of questions the threshold may send to the large model")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--work", type=Path, default=None, help="store folder (default: a temporary one)")
    ap.add_argument("--policy-out", type=Path, default=None, help="default: cag/router_policy.json")
    ap.add_argument("--rows-out", type=Path, default=ROOT / "eval" / "results" / "router_calibration.json")
    args = ap.parse_args(argv)
    if not 0.0 <= args.max_escalation <= 1.0:
        ap.error("--max-escalation must be in [0, 1]")
    host = host_info()
    items = get_dataset(DATASET, seed=args.seed, limit=args.n)
    with tempfile.TemporaryDirectory(prefix="cag-router-calib-") as tmp:
        store = (args.work or Path(tmp)) / "store"
        if not store.exists():
            print(f"building the calibration store ({args.small}) in {store}", file=sys.stderr)
            build_eval_store(items, store, args.small, chunk_tokens=args.chunk_tokens)
        router = Router(store=store, small=args.small, large=args.large, top_k=args.top_k,
                        max_new_tokens=args.max_new_tokens,
                        policy=RouterPolicy(metric="mean_logprob", threshold=math.inf))  # both answers, always
        rows = []
        with Progress("router calibration", len(items), unit="questions") as bar:
            for item in items:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the large model's gate says why on every question
                    routed = router.answer(item.question)
                rows.append({"item": item.id, "question": item.question, "answers": list(item.answers),
                             "small_answer": routed.small_answer.strip(), "large_answer": routed.text.strip(),
                             "small_found": metrics.contains_answer(routed.small_answer, item.answers),
                             "large_found": metrics.contains_answer(routed.text, item.answers),
                             "large_path": routed.large_path,
                             "confidence": {"mean_logprob": routed.small_confidence.mean_logprob,
                                            "neg_entropy": routed.small_confidence.neg_entropy},
                             "small_ttft_s": routed.small_ttft_s, "large_ttft_s": routed.large_ttft_s})
                bar.advance(note=f"small {'✓' if rows[-1]['small_found'] else '✗'} "
                                 f"large {'✓' if rows[-1]['large_found'] else '✗'}")
        small_name = router.small_context.target_model_name
        router.close()
    metric, point, best = choose(rows, args.max_escalation)
    n = len(rows)
    command = " ".join(["python", "eval/router_calibrate.py", *(argv if argv is not None else sys.argv[1:])])
    calibration = {
        "items": f"{DATASET} seed {args.seed}, first {n}", "n": n, "rule": RULE,
        "max_escalation": args.max_escalation, "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
        "small_found_rate": sum(r["small_found"] for r in rows) / n,
        "large_found_rate": sum(r["large_found"] for r in rows) / n,
        "routed_found_rate": point["found"], "escalated_share": point["escalated"],
        "large_paths": sorted({str(r["large_path"]) for r in rows}),
        "best_per_metric": best, "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "cpu": host.get("cpu")}
    entry = {"small": small_name, "large": args.large, "metric": metric, "threshold": point["threshold"],
             "calibration": calibration}
    RouterPolicy.model_validate(entry)  # what the router will read back
    out = args.policy_out or policy_path()
    existing = json.loads(out.read_text()).get("policies", []) if out.is_file() else []
    kept = [e for e in existing if (e.get("small"), e.get("large")) != (small_name, args.large)]
    out.write_text(json.dumps({"rule": RULE, "policies": kept + [entry]}, indent=2) + "\n")
    args.rows_out.parent.mkdir(parents=True, exist_ok=True)
    args.rows_out.write_text(json.dumps({"policy": entry, "rows": rows}, indent=2) + "\n")
    print(json.dumps({"metric": metric, "threshold": point["threshold"], "routed_found_rate": point["found"],
                      "escalated_share": point["escalated"], "small_found_rate": calibration["small_found_rate"],
                      "large_found_rate": calibration["large_found_rate"], "n": n, "policy": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
