"""Choose the rank key decay γ per target, label-free, on calibration questions.

    python eval/calibrate_rank_decay.py --targets qwen2.5-0.5b gemma3-270m smollm2-135m --n 50

Why: chunks prefilled apart each look like the first document after the prompt
head, and a model favours what it read first. In direct context the retriever's
best chunk *is* first; over independent chunk caches every chunk pulls the question
as if it were, and same-shaped facts from weaker chunks win (eval/results/rank_key_decay/).
γ multiplies the keys of the chunk ranked i-th by γ**i (`CachedContext.rank_key_decay`).

How, exactly as `eval/calibrate_ape.py` chooses (T, S) and on the same items
(`calib-lookup` seed 1, never an evaluation set): the target answers each question
with direct context over the top-k documents by word overlap, best first; that greedy
answer, not the gold one, is the reference, so no label is read. The same documents are
placed as the target's own chunk caches at the target's calibrated (T, S), and for every
γ on the grid the question plus that answer is teacher-forced. The γ with the lowest mean
KL(direct ‖ native) is the default, kept only if its paired bootstrap gain over γ = 1
excludes 0. It is added to the target's entry in ``cag/ape_defaults.json`` (unless
``--no-write``); ``eval/results/rank_key_decay/calibration.{json,md}`` hold every grid point.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag import ape  # noqa: E402
from cag.ape import rank_key_scales  # noqa: E402
from cag.assembler import Assembler  # noqa: E402
from cag.generate import generate, last_logits, stop_token_ids  # noqa: E402
from cag.models import registry  # noqa: E402
from cag.models.attention import context_temperature  # noqa: E402
from cag.prompt import layout_for  # noqa: E402
from eval.calibrate_ape import _load_progress, _retrieve  # noqa: E402
from eval.calibration_lookup import calibration_lookup  # noqa: E402

GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6)


def bootstrap_choice(kls: dict[float, list[float]], seed: int = 0) -> tuple[list[dict], dict]:
    """Every grid point's mean KL and paired gain over γ = 1; the lowest-KL point if its gain's
    95% interval excludes 0, else γ = 1."""
    base = np.array(kls[1.0])
    rng = np.random.default_rng(seed)
    rows = []
    for g, values in kls.items():
        diff = base - np.array(values)  # > 0: closer to direct context than γ = 1
        boots = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)]
        rows.append({"decay": g, "kl": float(np.mean(values)), "gain": float(diff.mean()),
                     "gain_low": float(np.percentile(boots, 2.5)), "gain_high": float(np.percentile(boots, 97.5))})
    best = min(rows, key=lambda r: r["kl"])
    chosen = best if best["gain_low"] > 0 else next(r for r in rows if r["decay"] == 1.0)
    return rows, chosen


@torch.inference_mode()
def calibrate(target: str, items, top_k: int, log, progress_dir: Path) -> dict:
    lm = registry.load(target, "auto")
    asm = Assembler(lm, layout_for(lm.tokenizer))
    stops = stop_token_ids(lm.tokenizer)
    temperature, scale = ape.resolve(None, None, fingerprint_id=lm.fingerprint.id, native=True)
    kls: dict[float, list[float]] = {g: [] for g in GRID}
    progress_dir.mkdir(parents=True, exist_ok=True)
    progress = progress_dir / f"{target.replace('/', '_')}-k{top_k}.jsonl"
    done = _load_progress(progress, lm.fingerprint.id)
    for i, item in enumerate(items, 1):
        if item.id in done:  # resumed
            for g, out in kls.items():
                out.append(done[item.id][str(g)])
            continue
        texts = _retrieve(item, top_k)
        q = asm.question_ids(item.question)
        direct_ids = asm.direct_ids([lm.tokenize(t)[0] for t in texts], item.question)
        gen = generate(lm.model, lm.tokenizer, DynamicCache(config=lm.model.config), direct_ids,
                       max_new_tokens=12, stop_ids=stops)
        answer = torch.tensor(gen.token_ids or [min(stops)], dtype=torch.long)  # an empty answer: its stop
        n = answer.numel()
        ref = torch.log_softmax(last_logits(lm.model, torch.cat([direct_ids, answer[:-1]])[None],
                                            DynamicCache(config=lm.model.config), positions=n).float(), -1)
        forced = torch.cat([q, answer[:-1]])
        chunks = [lm.prefill(t) for t in texts]
        # `_retrieve` returns best first; scores that fall with the rank give γ**rank.
        scores = [float(-r) for r in range(len(chunks))]
        for g, out in kls.items():
            placed = asm.place(chunks, key_scales=None if g == 1.0 else rank_key_scales(scores, g))
            with context_temperature(lm.model, placed.prefix_tokens, placed.context_ids.numel(),
                                     temperature=temperature, scale=scale):
                got = torch.log_softmax(last_logits(lm.model, forced[None], copy.deepcopy(placed.cache),
                                                    positions=n).float(), -1)
            out.append(float((ref.exp() * (ref - got)).sum(-1).mean()))
        with progress.open("a") as f:
            f.write(json.dumps({"item": item.id, "fingerprint": lm.fingerprint.id,
                                "kl": {str(g): v[-1] for g, v in kls.items()}}) + "\n")
        log(f"calibrate_rank_decay: {target} {i}/{len(items)}")
    rows, chosen = bootstrap_choice(kls)
    return {"target": target, "n": len(items), "top_k": top_k, "ape": [temperature, scale], "grid": rows,
            "chosen": chosen, "fingerprint": lm.fingerprint.id}


def write_defaults(results: list[dict], command: str, path: Path = ape.DEFAULTS_FILE) -> None:
    """Add each target's γ to its entry (keyed by weight fingerprint), keeping what else the entry holds."""
    defaults = json.loads(path.read_text()) if path.exists() else {}
    for r in results:
        entry = defaults.setdefault(r["fingerprint"], {"name": r["target"], "temperature": 1.0, "scale": 1.0})
        entry["rank_key_decay"] = r["chosen"]["decay"]
        entry["rank_key_decay_command"] = command
    path.write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["qwen2.5-0.5b", "gemma3-270m", "smollm2-135m"])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--top-k", type=int, default=4, help="documents placed per question (CachedContext.top_k)")
    ap.add_argument("--progress", type=Path, default=Path.home() / ".cache" / "cag" / "calibrate_rank_decay",
                    help="Per-item results, so an interrupted run resumes where it stopped.")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "rank_key_decay")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    items = calibration_lookup(seed=1)[: args.n]  # seed 1: APE's items, not the gate's (0)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = [calibrate(t, items, args.top_k, log, args.progress) for t in args.targets]
    command = " ".join(["python", *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(
        {"command": command, "date": time.strftime("%Y-%m-%d"), "results": results}, indent=2) + "\n")
    lines = ["# Rank key decay γ, chosen on calibration questions (label-free)", "",
             f"`{command}`, {time.strftime('%Y-%m-%d')}; calib-lookup seed 1, top-{args.top_k} documents by word "
             "overlap, best first, placed as the target's own chunk caches (prefilled after the prompt head) at "
             "its calibrated APE (T, S); KL(direct ‖ native) over direct context's own greedy answer. "
             "Gain = KL at γ = 1 minus KL at γ, paired bootstrap 95% interval.", ""]
    for r in results:
        lines += [f"## {r['target']} (n = {r['n']}, APE T, S = {r['ape'][0]}, {r['ape'][1]}): "
                  f"chosen γ = {r['chosen']['decay']}", "", "| γ | KL | gain [95%] |", "| --- | --- | --- |"]
        for g in sorted(r["grid"], key=lambda g: -g["decay"]):
            lines.append(f"| {g['decay']} | {g['kl']:.3f} | {g['gain']:+.3f} [{g['gain_low']:+.3f}, "
                         f"{g['gain_high']:+.3f}] |")
        lines.append("")
    (args.out / "calibration.md").write_text("\n".join(lines))
    if not args.no_write:
        write_defaults(results, command)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
