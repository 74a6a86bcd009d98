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

With ``--source S`` the placed chunks are S's, translated by the mapper ``--mapper`` resolves
for the pair (``auto``: the one a query would use), at T = S = 1 as a translated path is served; γ then
belongs to that mapper and goes into its card (``fidelity.rank_key_decay``), and the tables to
``calibration-<S>.{json,md}``:

    python eval/calibrate_rank_decay.py --targets qwen2.5-0.5b --source smollm2-135m --n 50
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag import ape  # noqa: E402
from cag.assembler import Assembler  # noqa: E402
from cag.generate import stop_token_ids  # noqa: E402
from cag.models import registry  # noqa: E402
from cag.models.attention import context_temperature  # noqa: E402
from cag.prompt import layout_for  # noqa: E402
from eval.calibrate_ape import (  # noqa: E402
    _load_progress, _retrieve, closest_to_direct, direct_reference, kl_from_reference)
from eval.calibration_lookup import calibration_lookup  # noqa: E402

GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6)


def schedule_scales(n: int, decay: float, max_rank: int | None) -> list[float] | None:
    """Key factors of `n` chunks placed best first: γ**min(rank, max_rank); None when all are 1."""
    if decay == 1.0:
        return None
    return [decay ** (r if max_rank is None else min(r, max_rank)) for r in range(n)]


def point_name(point: tuple[float, int | None]) -> str:
    decay, max_rank = point
    return f"{decay}" if max_rank is None else f"{decay}|{max_rank}"


def bootstrap_choice(kls: dict[tuple, list[float]], seed: int = 0) -> tuple[list[dict], dict]:
    """Every grid point's mean KL and paired gain over γ = 1; the lowest-KL point if its gain's
    95% interval excludes 0, else γ = 1."""
    stats, chosen, _ = closest_to_direct(kls, (1.0, None), seed)
    rows = {p: {"decay": p[0], "max_rank": p[1], **v} for p, v in stats.items()}
    return list(rows.values()), rows[chosen]


@torch.inference_mode()
def calibrate(target: str, items, top_ks: list[int], log, progress_dir: Path, source: str | None = None,
              method: str = "auto", caps: tuple[int | None, ...] = (None,)) -> dict:
    """KL(direct ‖ cached) of every (γ, cap) on the grid, over every item at every `top_ks`; pooled
    over the ks, it chooses the point (`bootstrap_choice`)."""
    lm = registry.load(target, "auto")
    asm = Assembler(lm, layout_for(lm.tokenizer))
    stops = stop_token_ids(lm.tokenizer)
    mapper = src = None
    if source is not None:  # the translated path: the source's chunks through the pair's mapper
        from cag.mapping import resolve_mapper

        src = registry.load(source, "auto")
        mapper = resolve_mapper(method, src.fingerprint, lm)
    temperature, scale = ape.resolve(None, None, fingerprint_id=lm.fingerprint.id, native=mapper is None)
    points = [(1.0, None)] + [(g, c) for g in GRID if g != 1.0 for c in caps]
    per_k: dict[int, dict[tuple, list[float]]] = {k: {p: [] for p in points} for k in top_ks}
    progress_dir.mkdir(parents=True, exist_ok=True)
    tag = "" if mapper is None else f"-{mapper.artifact_id}"

    def item_kls(item, k: int, row: dict) -> dict:
        """`row` completed with the KL of every grid point it lacks, for `item` at top-`k`."""
        texts = _retrieve(item, k)  # best first: the i-th placed chunk has rank i
        forced, ref = direct_reference(lm, asm, texts, item.question, stops)
        if mapper is None:
            chunks = [lm.prefill(t) for t in texts]
        else:
            chunks = mapper.translate_batch([src.prefill(t) for t in texts], texts, lm)
        for p in (p for p in points if point_name(p) not in row):
            placed = asm.place(chunks, key_scales=schedule_scales(len(chunks), *p))
            with context_temperature(lm.model, placed.prefix_tokens, placed.context_ids.numel(),
                                     temperature=temperature, scale=scale):
                row[point_name(p)] = kl_from_reference(lm, placed.cache, forced, ref)
        return row

    for k in top_ks:
        progress = progress_dir / f"{target.replace('/', '_')}-k{k}{tag}.jsonl"
        done = _load_progress(progress, lm.fingerprint.id)
        for i, item in enumerate(items, 1):
            row = dict(done.get(item.id) or {})
            if any(point_name(p) not in row for p in points):  # new, or a grid point it lacks
                row = item_kls(item, k, row)
                with progress.open("a") as f:
                    f.write(json.dumps({"item": item.id, "fingerprint": lm.fingerprint.id, "kl": row}) + "\n")
            for p in points:
                per_k[k][p].append(row[point_name(p)])
            log(f"calibrate_rank_decay: {target} top-{k} {i}/{len(items)}")
    # pooled: every item at every k, paired across grid points
    rows, chosen = bootstrap_choice({p: [v for k in top_ks for v in per_k[k][p]] for p in points})
    for r in rows:
        r["kl_at"] = {str(k): float(np.mean(per_k[k][(r["decay"], r["max_rank"])])) for k in top_ks}
    return {"target": target, "n": len(items), "top_k": top_ks[0] if len(top_ks) == 1 else top_ks,
            "ape": [temperature, scale], "grid": rows, "chosen": chosen, "fingerprint": lm.fingerprint.id,
            "source": source,
            "mapper": None if mapper is None else {"method": mapper.method, "artifact_id": mapper.artifact_id}}


def write_card_decay(result: dict, command: str) -> Path:
    """Put a translated path's γ into the card of the mapper it was measured with."""
    from cag.mapping import available_mappers
    from mappers.base import Mapper, write_card

    for folder, card in available_mappers():  # matched as eval/gate_fidelity.py matches its records
        if (card["source"].get("name"), card["target"].get("name"), card.get("method")) ==                 (result["source"], result["target"], result["mapper"]["method"]):
            card = Mapper.read_card(folder)
            card.setdefault("fidelity", {})["rank_key_decay"] = {
                "value": result["chosen"]["decay"], "kl": result["chosen"]["kl"], "n": result["n"],
                "items": "calib-lookup seed 1", "top_k": result["top_k"], "command": command,
                "artifact_id": result["mapper"]["artifact_id"],
                "measured": time.strftime("%Y-%m-%d")}
            write_card(folder, card)
            return Path(folder)
    raise SystemExit(f"no shipped {result['mapper']['method']} mapper for {result['source']} → {result['target']} "
                     "to record γ in")


def write_defaults(results: list[dict], command: str, path: Path = ape.DEFAULTS_FILE) -> None:
    """Add each target's γ to its entry (keyed by weight fingerprint), keeping what else the entry holds."""
    defaults = json.loads(path.read_text()) if path.exists() else {}
    for r in results:
        entry = defaults.setdefault(r["fingerprint"], {"name": r["target"], "temperature": 1.0, "scale": 1.0})
        entry["rank_key_decay"] = r["chosen"]["decay"]
        entry["rank_key_decay_command"] = command
    path.write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")


def parse_cap(value: str) -> int | None:
    return None if value == "none" else int(value)


def report(results: list[dict], command: str, top_ks: list[int], source: str | None) -> list[str]:
    ks = ", ".join(map(str, top_ks))
    lines = ["# Rank key decay γ, chosen on calibration questions (label-free)", "",
             f"`{command}`, {time.strftime('%Y-%m-%d')}; calib-lookup seed 1, top-{ks} documents by word "
             "overlap, best first, placed as " + ("the target's own chunk caches (prefilled after the prompt head) at "
             "its calibrated APE (T, S)" if source is None else f"{source}'s chunks translated by the "
             "pair's mapper (T = S = 1, as a translated path is served)") + "; KL(direct ‖ cached) over direct "
             "context's own greedy answer. The i-th chunk's keys × γ**min(i, cap) (cap –: none). "
             "Gain = KL at γ = 1 minus KL at the point, paired bootstrap 95% interval, pooled over every top-k.", ""]
    for r in results:
        via = "" if r["mapper"] is None else f", {r['source']} → via {r['mapper']['method']} {r['mapper']['artifact_id']}"
        cap = r["chosen"]["max_rank"]
        lines += [f"## {r['target']}{via} (n = {r['n']} per top-k, APE T, S = {r['ape'][0]}, {r['ape'][1]}): "
                  f"chosen γ = {r['chosen']['decay']}" + ("" if cap is None else f", cap {cap}"), "",
                  "| γ | cap | KL (pooled) | gain [95%] | " + " | ".join(f"KL top-{k}" for k in top_ks) + " |",
                  "| --- | --- | --- | --- | " + " | ".join("---" for _ in top_ks) + " |"]
        for g in sorted(r["grid"], key=lambda g: (-g["decay"], g["max_rank"] is None, g["max_rank"] or 0)):
            lines.append(f"| {g['decay']} | {'–' if g['max_rank'] is None else g['max_rank']} | {g['kl']:.3f} | "
                         f"{g['gain']:+.3f} [{g['gain_low']:+.3f}, {g['gain_high']:+.3f}] | "
                         + " | ".join(f"{g['kl_at'][str(k)]:.3f}" for k in top_ks) + " |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["qwen2.5-0.5b", "gemma3-270m", "smollm2-135m"])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--top-k", type=int, nargs="+", default=[4],
                    help="documents placed per question (CachedContext.top_k); several: KL pooled over all")
    ap.add_argument("--caps", type=parse_cap, nargs="+", default=[None],
                    help="largest exponent of γ to try ('none': γ**rank at every rank); the grid is γ × caps")
    ap.add_argument("--progress", type=Path, default=Path.home() / ".cache" / "cag" / "calibrate_rank_decay",
                    help="Per-item results, so an interrupted run resumes where it stopped.")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "rank_key_decay")
    ap.add_argument("--name", default=None, help="file name of the tables (default: calibration[-SOURCE])")
    ap.add_argument("--source", default=None, help="calibrate the translated path from this source "
                    "model's chunks (default: the target's own chunks, the native path)")
    ap.add_argument("--mapper", default="auto", help="with --source: the mapper (default: auto's pick)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    items = calibration_lookup(seed=1)[: args.n]  # seed 1: APE's items, not the gate's (0)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = [calibrate(t, items, args.top_k, log, args.progress, args.source, args.mapper, tuple(args.caps))
               for t in args.targets]
    command = " ".join(["python", *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("calibration" if args.source is None else f"calibration-{args.source}")
    (args.out / f"{name}.json").write_text(json.dumps(
        {"command": command, "date": time.strftime("%Y-%m-%d"), "results": results}, indent=2) + "\n")
    lines = report(results, command, args.top_k, args.source)
    (args.out / f"{name}.md").write_text("\n".join(lines))
    capped = [r["target"] for r in results if r["chosen"].get("max_rank") is not None]
    if capped and not args.no_write:  # the runtime applies γ**rank uncapped: a capped choice would be served wrong
        raise SystemExit(f"a capped γ was chosen for {capped}, and `cag.ape` serves γ uncapped; the tables are "
                         "written, the defaults are not (rerun with --no-write, or teach the runtime the cap)")
    if not args.no_write and args.source is None:
        write_defaults(results, command)
    elif not args.no_write:
        for r in results:
            log(f"calibrate_rank_decay: γ = {r['chosen']['decay']} recorded in {write_card_decay(r, command)}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
