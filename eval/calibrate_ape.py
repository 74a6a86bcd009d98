"""Choose APE's context temperature and scale per target, label-free, on calibration questions.

    python eval/calibrate_ape.py --targets qwen2.5-0.5b gemma3-270m smollm2-135m --n 50

For each calibration lookup item (`calib-lookup`, never an evaluation set), the
target answers with direct context (its own prefill of the retrieved chunks); that
greedy answer, not the gold one, is the reference, so no label is read. The same
chunks are then placed as the target's own chunk caches (the native path, prefilled
after the prompt head) and, for every (T, S) on the grid, the question plus that
answer is teacher-forced over them under `context_temperature`. The mean KL(direct ‖
native) over the answer tokens is the figure; the grid point with the lowest mean
KL is the target's default, kept only if it beats T = S = 1 by more than its
paired bootstrap interval says noise could.

Writes ``eval/results/ape.json`` and ``ape.md`` (every grid point, per target) and,
unless ``--no-write``, ``cag/ape_defaults.json``, which `CachedContext` reads.
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

from cag.assembler import Assembler  # noqa: E402
from cag.generate import generate, last_logits, stop_token_ids  # noqa: E402
from cag.models import registry  # noqa: E402
from cag.models.attention import context_temperature  # noqa: E402
from cag.prompt import layout_for  # noqa: E402
from eval.calibration_lookup import calibration_lookup  # noqa: E402

GRID_T = (0.8, 0.9, 1.0, 1.1, 1.2)
GRID_S = (0.8, 0.9, 1.0, 1.2)


def _retrieve(item, k: int = 3):
    """The item's documents ranked by word overlap with the question (no embedder needed)."""
    q = set(item.question.lower().replace("?", "").split())
    scored = sorted(item.documents, key=lambda d: -len(q & set(d.text.lower().replace(".", "").split())))
    return [d.text for d in scored[:k]]


def _load_progress(path: Path, fingerprint: str) -> dict[int, dict]:
    """Items already scored by an interrupted run of the same model (one JSON line each)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the interruption
                continue
            if row.get("fingerprint") == fingerprint:
                done[row["item"]] = row["kl"]
    return done


def direct_reference(lm, asm, texts: list[str], question: str, stops) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct context's own greedy answer over `texts` (no label is read): the ids a cached context
    is teacher-forced on (question, answer) and direct context's log-probs ``[n, vocab]`` over the answer."""
    direct_ids = asm.direct_ids([lm.tokenize(t)[0] for t in texts], question)
    gen = generate(lm.model, lm.tokenizer, DynamicCache(config=lm.model.config), direct_ids, max_new_tokens=12,
                   stop_ids=stops)
    answer = torch.tensor(gen.token_ids or [min(stops)], dtype=torch.long)  # an empty answer: its stop
    ref = torch.log_softmax(last_logits(lm.model, torch.cat([direct_ids, answer[:-1]])[None],
                                        DynamicCache(config=lm.model.config), positions=answer.numel()).float(), -1)
    return torch.cat([asm.question_ids(question), answer[:-1]]), ref


def kl_from_reference(lm, cache, forced: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean KL(direct ‖ cached) over the answer, `forced` teacher-forced on a copy of `cache`."""
    got = torch.log_softmax(last_logits(lm.model, forced[None], copy.deepcopy(cache),
                                        positions=ref.shape[-2]).float(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def closest_to_direct(kls: dict, neutral, seed: int = 0) -> tuple[dict, object, object]:
    """Per grid point its mean KL and paired bootstrap gain over `neutral` (> 0: closer to direct
    context); the chosen point (the lowest KL if its gain's 95% interval excludes 0, else `neutral`)
    and the lowest-KL point."""
    base = np.array(kls[neutral])
    rng = np.random.default_rng(seed)
    stats = {}
    for key, values in kls.items():
        diff = base - np.array(values)
        boots = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(2000)]
        stats[key] = {"kl": float(np.mean(values)), "gain": float(diff.mean()),
                      "gain_low": float(np.percentile(boots, 2.5)), "gain_high": float(np.percentile(boots, 97.5))}
    best = min(stats, key=lambda k: stats[k]["kl"])
    return stats, best if stats[best]["gain_low"] > 0 else neutral, best


@torch.inference_mode()
def calibrate(target: str, items, log, progress_dir: Path) -> dict:
    lm = registry.load(target, "auto")
    asm = Assembler(lm, layout_for(lm.tokenizer))
    stops = stop_token_ids(lm.tokenizer)
    kls = {(t, s): [] for t in GRID_T for s in GRID_S}
    progress_dir.mkdir(parents=True, exist_ok=True)
    progress = progress_dir / f"{target.replace('/', '_')}.jsonl"
    done = _load_progress(progress, lm.fingerprint.id)
    for i, item in enumerate(items, 1):
        if item.id in done:  # resumed: this item was scored before the interruption
            for (t, s), out in kls.items():
                out.append(done[item.id][f"{t},{s}"])
            continue
        texts = _retrieve(item)
        forced, ref = direct_reference(lm, asm, texts, item.question, stops)
        placed = asm.place([lm.prefill(t) for t in texts])
        span = (placed.prefix_tokens, placed.context_ids.numel())
        for (t, s), out in kls.items():
            with context_temperature(lm.model, *span, temperature=t, scale=s):
                out.append(kl_from_reference(lm, placed.cache, forced, ref))
        row = {"item": item.id, "fingerprint": lm.fingerprint.id, "kl": {f"{t},{s}": v[-1] for (t, s), v in kls.items()}}
        with progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(f"calibrate_ape: {target} {i}/{len(items)}")
    stats, chosen, best = closest_to_direct(kls, (1.0, 1.0))
    rows = {key: {"temperature": key[0], "scale": key[1], **v} for key, v in stats.items()}
    return {"target": target, "n": len(items), "grid": list(rows.values()), "chosen": rows[chosen],
            "best": rows[best], "fingerprint": lm.fingerprint.id}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["qwen2.5-0.5b", "gemma3-270m", "smollm2-135m"])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--progress", type=Path, default=Path.home() / ".cache" / "cag" / "calibrate_ape",
                    help="Per-item results, so an interrupted run resumes where it stopped.")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    items = calibration_lookup(seed=1)[: args.n]  # seed 1: not the items the gate is measured on
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = [calibrate(t, items, log, args.progress) for t in args.targets]
    command = " ".join(["python", *sys.argv])
    (args.out / "ape.json").write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                                                   "results": results}, indent=2) + "\n")
    lines = ["# APE context temperature and scale, chosen on calibration questions (label-free)", "",
             f"`{command}`, {time.strftime('%Y-%m-%d')}; calib-lookup seed 1, the target's own chunk caches "
             "(prefilled after the prompt head), KL(direct ‖ native) over direct context's own greedy answer. "
             "Gain = KL at T=S=1 minus KL here, with a paired bootstrap 95% interval.", ""]
    for r in results:
        c = r["chosen"]
        lines += [f"## {r['target']} (n = {r['n']}): chosen T = {c['temperature']}, S = {c['scale']}", "",
                  "| T | S | KL | gain [95%] |", "| --- | --- | --- | --- |"]
        for g in sorted(r["grid"], key=lambda g: g["kl"]):
            lines.append(f"| {g['temperature']} | {g['scale']} | {g['kl']:.3f} | "
                         f"{g['gain']:+.3f} [{g['gain_low']:+.3f}, {g['gain_high']:+.3f}] |")
        lines.append("")
    (args.out / "ape.md").write_text("\n".join(lines))
    if not args.no_write:
        path = ROOT / "cag" / "ape_defaults.json"
        defaults = json.loads(path.read_text()) if path.exists() else {}
        for r in results:  # the entry's other settings (eval/calibrate_rank_decay.py's γ) are kept
            defaults.setdefault(r["fingerprint"], {}).update(
                {"name": r["target"], "temperature": r["chosen"]["temperature"], "scale": r["chosen"]["scale"],
                 "n": r["n"], "command": command})
        path.write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
