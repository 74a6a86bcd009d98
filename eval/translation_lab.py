"""The translation lab: aligned K/V on disk once, then a variant fitted and scored in minutes.

    python eval/translation_lab.py build --source smollm2-135m --target qwen2.5-0.5b --tokens 120000
    python eval/translation_lab.py run --variants shipped ridge-all pca512 pca512+match ...
    python eval/translation_lab.py report

`build` prefills the calibration corpus (`eval/lab/data.py`) with both models and
writes aligned rows and lookup items under ``$CAG_LAB`` (default
``~/.cache/cag/lab``); it resumes where a killed build stopped. `run` fits each
variant (`eval/lab/variants.py`) from the rows and scores it on the held-out
lookup items (`eval/lab/score.py`): found-rate, F1 and the gold answer's
log-likelihood through the frozen target, KL against the native chunk cache, and
attention diagnostics per layer. Results go to ``eval/results/lab/`` (one gzipped
JSON per variant, resumable, and a table).

Research code: only what wins here moves into `mappers/`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.models import registry  # noqa: E402
from eval.lab import data  # noqa: E402

RESULTS = ROOT / "eval" / "results" / "lab"


def read_result(path: Path) -> dict | None:
    """A scored variant's result, ``<name>.json`` or, once its per-item rows were compressed to keep the
    repository under its size test, ``<name>.json.gz``; None when neither exists."""
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return json.loads(gzip.decompress(gz.read_bytes()))
    return json.loads(path.read_text()) if path.exists() else None


def _models(args):
    return registry.load(args.source, "auto"), registry.load(args.target, "auto")


def cmd_build(args) -> int:
    source, target = _models(args)
    out = data.lab_dir(args.source, args.target)
    started = time.perf_counter()
    data.build_items(source, target, "test", args.test_items, out)
    data.build_items(source, target, "tune", args.tune_items, out)
    data.build_items(source, target, "codes", args.code_items, out)
    summary = data.build_shards(source, target, data.training_corpus(), out, max_tokens=args.tokens)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))
    return 0


def cmd_run(args) -> int:
    from eval.lab import score, variants

    source, target = _models(args)
    out = data.lab_dir(args.source, args.target)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        path = RESULTS / f"{args.source}__{args.target}" / f"{name}{args.tag}.json"
        if (path.exists() or path.with_name(path.name + ".gz").exists()) and not args.force:
            print(f"lab: {name} already scored ({path}); --force to redo", file=sys.stderr)
            continue
        started = time.perf_counter()
        variant = variants.make(name, out, source, target)
        fitted = time.perf_counter()
        result = score.score_variant(variant, out, source, target, split=args.split, n=args.n,
                                     max_new_tokens=args.max_new_tokens)
        result.update({"variant": name + args.tag, "describe": variant.describe(), "fit_s": round(fitted - started, 1),
                       "score_s": round(time.perf_counter() - fitted, 1), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": " ".join(["python", *sys.argv]), "train_rows": variant.train_rows})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_name(path.name + ".gz").write_bytes(gzip.compress((json.dumps(result, indent=1) + "\n").encode(),
                                                                 mtime=0))
        path.unlink(missing_ok=True)  # a plain result of an earlier run of the same name (--force)
        print(score.one_line(result), file=sys.stderr)
    return cmd_report(args)


def cmd_export(args) -> int:
    """Write a scored variant as a runtime mapper artifact (`mappers.bottleneck`)."""
    from eval.lab import variants

    source, target = _models(args)
    lab = data.lab_dir(args.source, args.target)
    scored = RESULTS / f"{args.source}__{args.target}" / f"{args.variant}{args.tag}.json"
    result = read_result(scored)
    if result is None:
        raise SystemExit(f"{args.variant} has not been scored; run `translation_lab.py run --variants {args.variant}`")
    variant = variants.make(args.variant, lab, source, target)
    mapper = variants.to_mapper(variant, source, target)
    mapper.fitted_on.update(variants.lab_provenance(lab))
    mapper.fitted_on["lab_variant"] = args.variant  # what a refit exports again (eval/lab/recipe.py)
    mapper.fidelity["lab_lookup"] = {k: result[k] for k in ("split", "n", "found", "native_found", "no_context_found",
                                                            "gold_ll", "native_gold_ll", "no_context_gold_ll",
                                                            "kl_native", "found_vs_native")}
    mapper.fidelity["lab_lookup"].update({"variant": args.variant, "measured": result["date"]})
    out = args.out or ROOT / "mappers" / "pretrained" / f"{args.source}__{args.target}__bottleneck"
    mapper.save(out)
    print(json.dumps({"artifact": str(out), "id": mapper.artifact_id,
                      "bytes": (Path(out) / "weights.safetensors").stat().st_size}))
    return 0


def cmd_report(args) -> int:
    from eval.lab import score

    folder = RESULTS / f"{args.source}__{args.target}"
    names = sorted({p.name.removesuffix(".gz") for p in [*folder.glob("*.json"), *folder.glob("*.json.gz")]})
    rows = [read_result(folder / name) for name in names]
    table = score.table(rows, args.source, args.target)
    (folder.parent / f"{args.source}__{args.target}.md").write_text(table)
    print(table)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="prefill the calibration corpus into aligned rows and lookup items")
    b.add_argument("--tokens", type=int, default=120_000, help="target rows to collect")
    b.add_argument("--test-items", type=int, default=40)
    b.add_argument("--tune-items", type=int, default=16)
    b.add_argument("--code-items", type=int, default=48, help="held-out needles whose answers are copied exactly")
    r = sub.add_parser("run", help="fit and score variants")
    r.add_argument("--variants", nargs="+", required=True)
    r.add_argument("--split", default="test", choices=data.SPLITS)
    r.add_argument("--n", type=int, default=40)
    r.add_argument("--max-new-tokens", type=int, default=12)
    r.add_argument("--force", action="store_true")
    r.add_argument("--tag", default="", help="suffix of the result's name (a confirmation run beside the scan)")
    e = sub.add_parser("export", help="write a scored variant as a runtime mapper artifact")
    e.add_argument("--variant", required=True)
    e.add_argument("--out", type=Path)
    e.add_argument("--tag", default="", help="take the lookup figures of this scored run (e.g. @n40)")
    sub.add_parser("report", help="the table of every scored variant")
    args = ap.parse_args(argv)
    return {"build": cmd_build, "run": cmd_run, "export": cmd_export, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
