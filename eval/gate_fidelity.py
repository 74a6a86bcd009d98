"""Measure each serving path's lookup fidelity on calibration items and record it for the gate.

    python eval/gate_fidelity.py --sources smollm2-135m qwen2.5-0.5b gemma3-270m --n 40
    python eval/gate_fidelity.py --sources smollm2-135m --targets qwen2.5-0.5b --n 30 \
        --methods bottleneck --out eval/results/gate-bottleneck     # one more mapper, its own folder

For every source model, one resumable `cag eval` run (`eval.run.run_eval`) over
`calib-lookup` items (calibration-side, `eval/calibration_lookup.py`) answers each
question under every condition: no context, direct context, the target's own
chunk caches (the native path) and the store's chunks through ``auto``'s mapper
(the translated path). From those runs it writes what `cag.gate` reads:

- ``mappers/pretrained/native_lookup.json``: per model (fingerprint id), the native
  path's found-rate, direct context's and no context's on the same items, and the
  retention found(native) / found(direct);
- ``fidelity.lookup`` in the card of the mapper ``auto`` picks for each pair.

With ``--repair`` it measures the ``+repair`` paths at one recompute setting and adds that
record beside the ones measured at other settings (a record at the same setting is replaced):
the gate serves the cheapest setting that passes.

Beside the lookups it measures the same paths on calibration needles whose answers must be
copied exactly (``--copy-n``, codes and invented names in the essays the translation lab holds
out), recorded under ``copy``: `cag.gate` refuses a path that passes on lookups and garbles those.
And on free questions about those essays (``--essay-n``, `eval.datasets.calibration_essay_gate_qa`,
never fitted on), recorded under ``essays``: a path must keep them too.

``--cards-only`` writes the mapper cards and leaves ``native_lookup.json`` as it is (and
does not measure the source answering its own chunks): a run that adds one mapper should
not move the gate's native records.

Never point this at an evaluation set: the gate would then be tuned on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.gate import native_lookup_path, repair_records, with_repair_record  # noqa: E402
from cag.mapping import MapperNotFoundError, available_mappers, resolve_mapper  # noqa: E402
from cag.models import registry  # noqa: E402
from eval.calibration_lookup import DATASET, calibration_lookup  # noqa: E402
from eval.datasets import calibration_essay_gate_qa  # noqa: E402
from eval.run import RESULTS, run_eval  # noqa: E402
from mappers.base import Mapper, write_card  # noqa: E402

MODELS = ("smollm2-135m", "qwen2.5-0.5b", "gemma3-270m")
COPY_SEED = 900  # calib-code-needle seeds: lab 13, key correction 700+, length diagnosis 300+


def copy_items(n: int, seed: int) -> list:
    """Code needles planted in the calibration essays the translation lab holds out of its rows."""
    from eval.calibration_lookup import calibration_code_needles
    from eval.lab.data import held_out_essays

    return calibration_code_needles(seed=seed, n=n, essays=held_out_essays()) if n > 0 else []


def path_record(rows: list[dict], condition: str, items: str) -> dict:
    """Found-rate and F1 of `condition` against direct and no context, on the same rows."""
    paired = [r["results"] for r in rows if condition in r["results"]]
    n = len(paired)
    mean = lambda cond, key: sum(p[cond][key] for p in paired) / n  # noqa: E731
    found, direct = mean(condition, "found"), mean("direct", "found")
    f1, direct_f1 = mean(condition, "f1"), mean("direct", "f1")
    return {"n": n, "items": items, "found_rate": round(found, 4), "direct_found_rate": round(direct, 4),
            "no_context_found_rate": round(mean("no_context", "found"), 4),
            "found_retention": round(found / direct, 4) if direct else 0.0,
            "f1": round(f1, 4), "direct_f1": round(direct_f1, 4),
            "f1_retention": round(f1 / direct_f1, 4) if direct_f1 else 0.0,
            "measured": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}


def result_rows(out: Path, items: list) -> list[dict]:
    """A run's result rows for these items (a resumed folder may hold more items than this run's)."""
    wanted = {item.id for item in items}
    return [row for line in (out / RESULTS).read_text().splitlines() if line.strip()
            for row in [json.loads(line)] if row["item"] in wanted]


def with_part(record: dict, rows: list[dict], condition: str, items: str, key: str = "copy") -> dict:
    """The record with another item set's figures under `key` ("copy": answers copied exactly; "essays":
    free questions about calibration essays), when measured: `cag.gate` checks those too."""
    if not any(condition in r["results"] for r in rows):
        return record
    part = path_record(rows, condition, items)
    return {**record, key: {k: part[k] for k in ("n", "items", "found_rate", "direct_found_rate",
                                                 "no_context_found_rate", "found_retention", "f1_retention")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", nargs="+", default=list(MODELS))
    ap.add_argument("--targets", nargs="+", default=list(MODELS), help="answering models (each source's own "
                    "model is always one: its native path)")
    ap.add_argument("--methods", nargs="+", default=["auto"], help="the mappers whose translated path is "
                    "measured and recorded in their cards (default: the one auto picks today)")
    ap.add_argument("--n", type=int, default=40, help="calibration questions per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--copy-n", type=int, default=24, help="calibration needles whose answers are copied exactly "
                    "(codes, call signs, invented names), measured beside the lookups; a path must pass on both")
    ap.add_argument("--copy-seed", type=int, default=COPY_SEED)
    ap.add_argument("--essay-n", type=int, default=36, help="free questions about the calibration essays the "
                    "translation lab holds out (eval/data/calib_essay_gate.jsonl, never fitted on), measured "
                    "beside the lookups; a path must pass on them too (0: not measured)")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "gate")
    ap.add_argument("--no-write", action="store_true", help="measure only; leave cards and files alone")
    ap.add_argument("--cards-only", action="store_true", help="write the translated paths' records to their "
                    "mapper cards but leave native_lookup.json alone, and skip the source's own native path: the "
                    "gate's native records stay the ones it was set with")
    ap.add_argument("--repair", type=float, default=0.0, help="measure the +repair paths: recompute this share "
                    "of context tokens, chosen by --repair-select")
    ap.add_argument("--repair-select", default="source")
    ap.add_argument("--translated-key-scale", type=float, default=1.0, help="with --repair: the translated "
                    "paths' CachedContext.translated_key_scale (the crux path), recorded with their +repair record")
    ap.add_argument("--copy-prior", type=float, default=0.0, help="the translated paths decode with this copy "
                    "prior weight (cag.copy_prior), recorded with their record: the gate serves them with it")
    args = ap.parse_args(argv)
    items = calibration_lookup(seed=args.seed)[: args.n]
    items_name = f"{DATASET} seed {args.seed}, first {len(items)}"
    copies = copy_items(args.copy_n, args.copy_seed)
    copy_name = f"calib-code-needle seed {args.copy_seed}, {len(copies)} in the lab's held-out essays"
    essays = calibration_essay_gate_qa()[: args.essay_n] if args.essay_n > 0 else []
    essay_name = f"calib-essay-gate, {len(essays)} free questions on the lab's held-out essays"
    native_path = native_lookup_path()
    native = json.loads(native_path.read_text()) if native_path.is_file() else {"models": {}}
    cards = {str(folder): (folder, card) for folder, card in available_mappers()}
    report = []
    for source in args.sources:
        # the source's own native path is measured for its native record, which --cards-only does not write
        targets = [t for t in args.targets if t != source] + ([] if args.cards_only else [source])
        out = args.out / f"source-{source}"
        store = None
        repair = {"ratio": args.repair, "select": args.repair_select} if args.repair else None
        scale = args.translated_key_scale if repair else 1.0
        tag = f"repair{args.repair:g}-{args.repair_select}" + (f"-ks{scale:g}" if scale != 1.0 else "") \
            + (f"-cp{args.copy_prior:g}" if args.copy_prior else "")
        if repair:  # the same store and items as the plain run (rebuilt when absent), recomputing the crux
            store = out / "store" if (out / "store").is_dir() else None
            out = args.out / f"source-{source}-{tag}"
        print(f"gate_fidelity: {source} → {', '.join(targets)} ({len(items)} items) in {out}", file=sys.stderr)

        def measure(part: list, folder: Path, part_store: Path | None = None) -> list[dict]:
            """Every path on `part`, in `folder` (its own store unless `part_store`); gate.md is the record,
            so no per-run plots."""
            if not part:
                return []
            run_eval(part, folder, store=part_store, source=source, targets=targets, methods=args.methods,
                     max_new_tokens=args.max_new_tokens, command=" ".join(["python", *sys.argv]), progress=True,
                     recompute_ratio=args.repair, recompute_select=args.repair_select if repair else "deviation",
                     translated_key_scale=scale, copy_prior=args.copy_prior, plots=False)
            return result_rows(folder, part)

        rows = measure(items, out, store)
        copy_rows = measure(copies, out.parent / f"{out.name}-copy")  # answers copied exactly
        essay_rows = measure(essays, out.parent / f"{out.name}-essays")  # free questions, from every essay
        src_fp = registry.load(source, "auto").fingerprint
        for target in targets:
            mine = [r for r in rows if r["target"] == target]
            mine_copy = [r for r in copy_rows if r["target"] == target]
            mine_essays = [r for r in essay_rows if r["target"] == target]
            lm = registry.load(target, "auto")
            section = "repair" if repair else "models"
            native.setdefault(section, {})
            # A source-guided choice over the target's own chunks was made here by this store's source
            # model; a store the target builds itself is guided by the target, which this run did not
            # measure. So such a record would speak for a configuration that is never served.
            borrowed_guide = repair and target != source and args.repair_select.startswith("source")
            if borrowed_guide:
                print(f"gate_fidelity: no native+repair record for {target}: {args.repair_select} was guided by "
                      f"{source} here, by {target} in its own store", file=sys.stderr)
            elif target == source or repair or lm.fingerprint.id not in native[section]:
                rec = with_part(with_part(path_record(mine, "native_cache", items_name), mine_copy, "native_cache",
                                          copy_name), mine_essays, "native_cache", essay_name, "essays")
                if repair:
                    rec["repair"] = repair
                if not args.cards_only:  # with repair, one record per setting: the gate serves the cheapest that passes
                    named, slot = {"name": target, **rec}, native[section].get(lm.fingerprint.id)
                    native[section][lm.fingerprint.id] = with_repair_record(slot, named) if repair else named
                report.append({"source": target, "target": target, "path": "native" + ("+repair" if repair else ""),
                               **rec})
            if target == source:
                continue
            for method in args.methods:
                try:
                    mapper = resolve_mapper(method, src_fp, lm)
                except MapperNotFoundError:
                    continue
                cond = f"cache:{mapper.method}"
                if not any(cond in r["results"] for r in mine):
                    continue  # a resumed folder from a run that measured other methods
                rec = {"method": mapper.method,
                       **with_part(with_part(path_record(mine, cond, items_name), mine_copy, cond, copy_name),
                                   mine_essays, cond, essay_name, "essays")}
                if repair:
                    rec["repair"] = {**repair, **({"translated_key_scale": scale} if scale != 1.0 else {})}
                if args.copy_prior:
                    rec["copy_prior"] = args.copy_prior
                report.append({"source": source, "target": target,
                               "path": "translated" + ("+repair" if repair else ""), **rec})
                for folder, card in cards.values():
                    if (card["source"].get("name"), card["target"].get("name"), card.get("method")) == \
                            (source, target, mapper.method) and not args.no_write:
                        card = Mapper.read_card(folder)
                        fidelity = card.setdefault("fidelity", {})
                        if repair:
                            fidelity["lookup_repair"] = with_repair_record(fidelity.get("lookup_repair"), rec)
                        else:
                            fidelity["lookup"] = rec
                        write_card(folder, card)
    if not (args.no_write or args.cards_only):  # merged into the file as it is now: another run may have
        # written it meanwhile
        current = json.loads(native_path.read_text()) if native_path.is_file() else {}
        for section, records in native.items():
            if section != "repair":
                current.setdefault(section, {}).update(records)
                continue
            for model_id, slot in records.items():  # per setting, so another run's settings are kept
                for rec in repair_records(slot):
                    current.setdefault(section, {})[model_id] = with_repair_record(
                        current[section].get(model_id), rec)
        native_path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    name = f"gate-{tag}" if args.repair else "gate"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Lookup fidelity of each serving path (what the quality gate reads)", "",
             f"`{' '.join(['python', *sys.argv])}`, {time.strftime('%Y-%m-%d')}, calibration items only "
             f"({items_name}; copied exactly: {copy_name if copies else 'not measured'}; free questions: "
             f"{essay_name if essays else 'not measured'}); found-rate = gold "
             "answer appears in the generated answer.", "",
             "| source | target | path | n | found | direct found | no-context found | found retention | F1 retention "
             "| copied exactly: n, found, direct found, found retention "
             "| free essay questions: n, found, direct found, found retention |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report:
        path = r["path"] + (f" ({r['method']})" if r.get("method") else "")
        lines.append(f"| {r['source']} | {r['target']} | {path} | {r['n']} | {r['found_rate']:.2f} | "
                     f"{r['direct_found_rate']:.2f} | {r['no_context_found_rate']:.2f} | "
                     f"{r['found_retention']:.2f} | {r['f1_retention']:.2f} | "
                     + " | ".join(f"{c['n']}, {c['found_rate']:.2f}, {c['direct_found_rate']:.2f}, "
                                  f"{c['found_retention']:.2f}" if (c := r.get(part)) else "–"
                                  for part in ("copy", "essays")) + " |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
