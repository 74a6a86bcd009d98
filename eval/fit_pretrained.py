"""Fit the shipped mappers: every direction among the three packaged models.

    python eval/fit_pretrained.py [--methods ridge latent heterofold mot] [--words 12000]
                                  [--pairs smollm2-135m:qwen2.5-0.5b ...] [--set KEY=JSON ...]
    python eval/fit_pretrained.py --remeasure --words 12000     # every card on the same held-out texts
    python eval/fit_pretrained.py --methods bottleneck [--pairs ...] [--run]   # the lab maps `auto` picks

The lab's bottleneck maps are refitted by a chain of resumable lab tools, not by `fit_mapper`:
`--methods bottleneck` prints each pair's chain as its shipped card records it (`eval/lab/recipe.py`), and
runs it with `--run` (hours per pair on 2 cores, several GB of lab data each under $CAG_LAB).

Writes `mappers/pretrained/<source>__<target>__<method>/` (weights + card with fidelity)
and `eval/results/mappers.md` (a table of what was fitted, how long it took and how
faithful it is). The same as `cag fit` for each pair, with the models loaded once.
The held-out texts are chosen per text by a hash, so every --words setting holds
out the same texts of the calibration essays, and no fit ever trains on them.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cag.kv import text_sha256
from cag.models import registry
from eval.datasets import calibration_sample
from mappers.base import load_mapper, write_card
from mappers.fidelity import measure_fidelity
from mappers.fit import fit_mapper, parse_settings, split_texts

MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"]
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["ridge", "latent"])
    parser.add_argument("--words", type=int, default=8000, help="calibration words per fit")
    parser.add_argument("--pairs", nargs="*", help="source:target pairs (default: all six directions)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="a method setting for every fit (repeatable)")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure every shipped artifact of the pairs again on the same held-out texts "
                             "(those of this --words setting), so that their cards, and mapper='auto', "
                             "compare like with like")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table from the shipped cards")
    parser.add_argument("--run", action="store_true", help="--methods bottleneck: run the printed commands "
                        "(else only print them)")
    args = parser.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs] if args.pairs else list(itertools.permutations(MODELS, 2))
    if "bottleneck" in args.methods:
        refit_bottleneck(pairs, run=args.run)
        args.methods = [m for m in args.methods if m != "bottleneck"]
        if not args.methods:
            return
    if args.table_only:
        write_table(rows_from_cards(), f"python eval/fit_pretrained.py --words {args.words} "
                    f"--methods {' '.join(args.methods)}")
        return
    texts = calibration_sample(args.words)
    words = sum(len(t.split()) for t in texts)
    settings = parse_settings(args.set)
    loaded = {name: registry.load(name, "bfloat16") for name in {m for p in pairs for m in p}}
    if args.remeasure:
        remeasure(pairs, loaded, texts)
        write_table(rows_from_cards(), f"python eval/fit_pretrained.py --words {args.words} --remeasure")
        return
    for (source, target), method in itertools.product(pairs, args.methods):
        out = ROOT / "mappers/pretrained" / f"{source}__{target}__{method}"
        started = time.perf_counter()
        mapper = fit_mapper(loaded[source], loaded[target], method, texts, out, settings=settings,
                            corpus_name=f"cag calibration essays ({len(texts)} texts, {words} words)")
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        row = {"source": source, "target": target, "method": method, "bytes": size,
               "wall_s": round(time.perf_counter() - started, 1), "fit_seconds": mapper.fit_seconds,
               **{k: v for k, v in mapper.fidelity.get("heldout", {}).items() if isinstance(v, (int, float))}}
        print(json.dumps(row), flush=True)
    write_table(rows_from_cards(), f"python eval/fit_pretrained.py --words {args.words} "
                f"--methods {' '.join(args.methods)}" + "".join(f" --set {s}" for s in args.set))


def refit_bottleneck(pairs, run: bool) -> None:
    """Each pair's lab recipe (`eval.lab.recipe`), read from its shipped card: printed, and run in order with
    `run`. Every step resumes where it stopped, so a stopped refit is continued by running it again."""
    from eval.lab.recipe import card_recipe

    for source, target in pairs:
        folder = ROOT / "mappers/pretrained" / f"{source}__{target}__bottleneck"
        if not (folder / "card.json").is_file():
            raise SystemExit(f"no shipped bottleneck map for {source} -> {target} ({folder})")
        steps = card_recipe(folder, python=sys.executable if run else "python")
        print(f"# {source} -> {target}: {len(steps)} steps", flush=True)
        for i, argv in enumerate(steps, 1):
            print(shlex.join(argv), flush=True)
            if run:
                print(f"fit_pretrained: {source} -> {target}, step {i} of {len(steps)}", file=sys.stderr, flush=True)
                subprocess.run(argv, cwd=ROOT, check=True)


def remeasure(pairs, loaded, texts, n_texts: int = 8) -> None:
    """Fidelity of every shipped artifact of `pairs` on the same held-out texts, written to its card."""
    _, held = split_texts(texts, 0.1, 0)
    held = held[:n_texts]
    digest = hashlib.sha256("".join(sorted(text_sha256(t) for t in held)).encode()).hexdigest()
    for source, target in pairs:
        for folder in sorted((ROOT / "mappers/pretrained").glob(f"{source}__{target}__*")):
            mapper = load_mapper(folder)
            started = time.perf_counter()
            fidelity = measure_fidelity(mapper, loaded[source], loaded[target], held)
            card = json.loads((folder / "card.json").read_text())
            card.setdefault("fidelity", {})["heldout"] = fidelity
            card["fidelity"]["heldout_texts"] = {"count": len(held), "texts_sha256": digest,
                                                 "remeasured": time.strftime("%Y-%m-%d %H:%M")}
            write_card(folder, card)
            print(json.dumps({"artifact": folder.name, "seconds": round(time.perf_counter() - started, 1),
                              **{k: v for k, v in fidelity.items() if isinstance(v, (int, float))}}), flush=True)


def rows_from_cards() -> dict:
    """One row per shipped artifact, from its card (what `cag mappers list` shows)."""
    rows = {}
    for card_path in sorted((ROOT / "mappers/pretrained").glob("*/card.json")):
        card = json.loads(card_path.read_text())
        folder = card_path.parent
        rows[folder.name] = {"source": card["source"]["name"], "target": card["target"]["name"],
                             "method": card["method"], "wall_s": card.get("fit_seconds") or 0.0,
                             "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
                             "tokens": (card.get("fitted_on") or {}).get("train_tokens"),
                             **(card.get("fidelity") or {}).get("heldout", {})}
    return rows


def write_table(results: dict, command: str) -> None:
    lines = ["# Shipped mappers", "", f"Command: `{command}`  ",
             f"Date: {time.strftime('%Y-%m-%d %H:%M')}; machine: {platform.platform()}, {os.cpu_count()} CPUs "
             "(shared with other work while fitting: times are upper bounds).", "",
             "Fidelity on held-out calibration texts (about 200-token chunks, the last quarter as continuation; "
             "after `--remeasure`, the same texts for every artifact, which no fit trained on): "
             "R² of keys and values, attention-output cosine, next-token KL(native ‖ translated) and top-1 "
             "agreement against the target's own prefill, and the same KL with no context at all.", "",
             "| source → target | method | MB | train tokens | fit s | K R² | V R² | attn cos | KL | KL no context | top-1 | top-1 no context |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results.values():
        g = lambda k: f"{row[k]:.3f}" if isinstance(row.get(k), (int, float)) else "–"
        lines.append(f"| {row['source']} → {row['target']} | {row['method']} | {row['bytes'] / 1e6:.1f} | "
                     f"{row.get('tokens') or '–'} | {row['wall_s']:.0f} | {g('key_r2')} | {g('value_r2')} | {g('attn_cos')} | {g('kl')} | "
                     f"{g('kl_no_context')} | {g('top1')} | {g('top1_no_context')} |")
    (ROOT / "eval/results/mappers.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
