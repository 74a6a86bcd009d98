"""`cag eval`: build a store for the questions, run every condition, write the report.

Results are appended to ``results.jsonl`` one (question, target) at a time, so an
interrupted run resumes where it stopped; the summary (``results.json``), the
table (``results.md``) and the plots are recomputed from that file at the end.
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from cag.context import CachedContext
from cag.mapping import MapperNotFoundError
from cag.models import registry
from cag.progress import Progress, build_progress
from eval import metrics
from eval.datasets import foreign_rows, item_fingerprint
from eval.harness import DIRECT, NO_CONTEXT, ItemRunner, host_info, host_line, measure_prefill_rate
from stores.build import existing_dtype
from stores.location import open_store

RESULTS, SUMMARY, TABLE = "results.jsonl", "results.json", "results.md"


def build_eval_store(items, store_dir: Path, source: str, *, chunk_tokens: int, embedder=None,
                     progress: bool = False, on_event: Callable[[Any], None] | None = None,
                     dtype: str | None = None):
    """One store holding every document of `items`, prefilled by `source`, its chunks stored in `dtype`
    (None: `cag build`'s default)."""
    from stores.build import build_store

    docs: dict[str, str] = {}
    for item in items:
        for d in item.documents:
            docs.setdefault(d.id, d.text)
    if not docs:
        raise ValueError("these questions bring no documents; pass --store with a built store")
    return build_store(sorted(docs.items()), store_dir, registry.load(source, "auto"),
                       chunk_tokens=chunk_tokens, embedder=embedder, progress=progress, on_event=on_event,
                       dtype=dtype)


def store_dtype(store) -> str | None:
    """The chunk format of a built store (a folder, URL or opened location); None for a new one."""
    location = open_store(store)
    try:
        return existing_dtype(location)
    finally:
        location.close()


class ResumeMismatchError(RuntimeError):
    """An output folder holds rows measured otherwise than this run would measure them."""


def _finished_rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(item, target) of every finished row → the row."""
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by an interruption: redo that question
            continue
        rows[(row["item"], row["target"])] = row
    return rows


def _check_items(finished: dict[tuple[str, str], dict], items: Sequence[Any], path: Path) -> None:
    """A resumed run must ask the questions its earlier rows answered: the same id can name another
    item when a generator's arguments change (`eval.datasets.item_fingerprint`)."""
    foreign = foreign_rows(finished.values(), items)
    if foreign:
        raise ResumeMismatchError(f"{path} holds rows of other items under the ids of this run's "
                                  f"{', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''} ({len(foreign)} in all): "
                                  "were the dataset's arguments changed? Use another --out, or delete the file to redo it.")


def _check_budget(finished: dict[tuple[str, str], dict], max_new_tokens: int, path: Path) -> None:
    """A resumed run must generate as many tokens as its earlier rows: found-rate and F1 depend on
    it (a model that restates the question before answering is cut off by a short budget), so two
    budgets in one table would compare unlike answers. Rows from before the budget was recorded
    are taken as they are."""
    for (item, target), row in finished.items():
        recorded = row.get("max_new_tokens")
        if recorded is not None and recorded != max_new_tokens:
            raise ResumeMismatchError(f"{path} holds rows generated with max_new_tokens = {recorded} ({item}, {target}); "
                                      f"this run asks {max_new_tokens}. Use another --out, or delete the file to redo it.")


def _check_setting(finished: dict[tuple[str, str], dict], name: str, value, before, path: Path) -> None:
    """A resumed run must decode its translated conditions with the same `name` setting (`before`: what rows
    from before the setting was recorded were measured with)."""
    for (item, target), row in finished.items():
        recorded = row.get(name, before)
        if recorded != value:
            raise ResumeMismatchError(f"{path} holds rows measured with {name} = {recorded} ({item}, {target}); "
                                      f"this run asks {value}. Use another --out, or delete the file to redo it.")


def _check_resumable(done: dict[tuple[str, str], dict[str, str]], target: str, mappers: dict[str, str],
                     path: Path) -> None:
    """A resumed run must translate with the mappers its earlier rows used: a refitted artifact
    under the same method name would otherwise mix two maps in one table."""
    for (item, t), recorded in done.items():
        for label, artifact in recorded.items():
            if t == target and label in mappers and mappers[label] != artifact:
                raise ResumeMismatchError(f"{path} holds rows measured with {label} mapper {artifact} ({item}, {target}); "
                                          f"this run's is {mappers[label]}. Use another --out, or delete the file to redo it.")


def condition_label(method: str, mapper) -> str:
    """The name of a translated condition: the mapper's method, and for an artifact folder (the map a
    refit replaced, say) its artifact id too, so it is measured beside the shipped one of that method."""
    if not os.path.isdir(method):
        return mapper.method
    return f"{mapper.method}@{getattr(mapper, 'artifact_id', None) or Path(method).name}"


def run_eval(items: Sequence[Any], out_dir: Path, *, store: Path | None = None, source: str = "smollm2-135m",
             targets: Sequence[str] = ("qwen2.5-0.5b", "gemma3-270m"), methods: Sequence[str] = ("auto",),
             top_k: int = 4, max_new_tokens: int = 24, chunk_tokens: int = 256, embedder=None,
             recompute_ratio: float = 0.0, recompute_select: str = "deviation", command: str = "",
             progress: bool = False, prefill_rate_tokens: int = 1024, dtype: str | None = None,
             translated_key_scale: float = 1.0, rank_key_decay: float | None = None,
             copy_prior: float = 0.0, translated_focus_tokens: int | None = None,
             plots: bool = True) -> dict[str, Any]:
    """Every condition on every (question, target) not yet in ``out_dir/results.jsonl``; the summary.

    `plots`: also draw retention.png and ttft.png (a caller with a table of its own, the gate, leaves them out).

    `dtype`: the storage format of the store built for the questions (its chunks, and the
    target's own chunks written through it; None: `cag build`'s default); a given `store`
    keeps its own.

    `translated_key_scale`: `CachedContext.translated_key_scale` of the translated
    conditions (the crux path; the native condition is never scaled).

    `copy_prior`: `CachedContext.copy_prior` of the translated conditions (never the native one, the
    reference they are compared with, nor direct context).

    `translated_focus_tokens`: `CachedContext.translated_focus_tokens` of the translated conditions (None: each
    target's calibrated budget, recorded per row as `focus_budget`; the native condition reads every chunk).

    `rank_key_decay`: `CachedContext.rank_key_decay` of every cached condition; None serves
    each path's calibrated default (the target's on the native path, the mapper card's on a translated one).

    `progress`: report on stderr (`cag.progress.Progress`: a bar on a terminal,
    plain lines elsewhere). Each target's prefill rate is measured in this run
    (`prefill_rate_tokens` tokens), so the report says what host its TTFTs are from.
    """
    def reporter(label: str, total: int | None = None, **kw):
        return Progress(label, total, **kw) if progress else nullcontext(None)

    host = host_info()  # before the run loads the machine itself
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / RESULTS
    # Refuse a mismatched resume before the store build, which costs minutes.
    finished = _finished_rows(results_path)
    _check_budget(finished, max_new_tokens, results_path)
    _check_setting(finished, "copy_prior", copy_prior, 0.0, results_path)
    # None: each target's calibrated budget (`CachedContext.focus_budget`), recorded per row
    _check_setting(finished, "focus_tokens", translated_focus_tokens, None, results_path)
    _check_items(finished, items, results_path)
    done = {key: row.get("mappers", {}) for key, row in finished.items()}
    built = store is None
    if built:
        store = out_dir / "store"
        with build_progress("cag eval: store") if progress else nullcontext({}) as kw:
            dtype = build_eval_store(items, store, source, chunk_tokens=chunk_tokens, embedder=embedder,
                                     dtype=dtype, **kw).dtype
    notes: list[str] = []
    total = len(items) * len(targets)
    count = len([1 for i in items for t in targets if (i.id, t) in done])
    rates: dict[str, dict[str, Any]] = {}
    decays: dict[str, float] = {}  # the native path's γ as served, per target
    with reporter("cag eval", total, unit="questions", completed=count) as bar:
        for target in targets:
            settings = dict(store=store, target=target, top_k=top_k, max_new_tokens=max_new_tokens,
                            embedder=embedder, translation_cache_mb=0, recompute_ratio=recompute_ratio,
                            recompute_select=recompute_select, rank_key_decay=rank_key_decay)
            base = CachedContext(mapper="identity", **settings)
            decays[target] = base.rank_decay(native=True)
            if bar:
                bar.log(f"{target}: loading, measuring its prefill rate")
            rates[target] = measure_prefill_rate(base.target_model, prefill_rate_tokens)
            if bar:
                bar.log(f"{target}: prefill {rates[target]['prefill_tok_s']:,.0f} tokens/s "
                        f"({rates[target]['prefill_tokens']} tokens)")
            contexts: dict[str, CachedContext] = {}
            for method in methods:
                ctx = CachedContext(mapper=method, translated_key_scale=translated_key_scale, copy_prior=copy_prior,
                                    translated_focus_tokens=translated_focus_tokens, **settings)
                try:
                    label = condition_label(method, ctx.active_mapper)
                except (MapperNotFoundError, ValueError) as exc:
                    notes.append(f"{target}: no {method!r} mapper from the store's source ({exc.__class__.__name__})")
                    continue
                contexts[label] = ctx
            mappers = {f"cache:{label}": ctx.active_mapper.artifact_id for label, ctx in contexts.items()
                       if getattr(ctx.active_mapper, "artifact_id", None)}
            _check_resumable(done, target, mappers, results_path)
            runner = ItemRunner(base, contexts, max_new_tokens=max_new_tokens)
            # what the translated conditions read: the caller's budget, else the target's calibrated one
            budget = base.focus_budget() if translated_focus_tokens is None else translated_focus_tokens
            for item in items:
                if (item.id, target) in done:
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    results = runner.run(item)
                row = {"item": item.id, "item_sha": item_fingerprint(item), "target": target,
                       "meta": dict(item.meta), "question": item.question,
                       "answers": list(item.answers), "mappers": mappers, "max_new_tokens": max_new_tokens,
                       **({"copy_prior": copy_prior} if copy_prior else {}),
                       **({"focus_tokens": translated_focus_tokens} if translated_focus_tokens is not None else {}),
                       "focus_budget": budget,
                       "results": {k: v.to_dict() for k, v in results.items()}}
                with open(results_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                if bar:
                    bar.advance(note=f"{item.meta.get('dataset', 'qa')}, {target}")
    summary = summarize(results_path, rates)
    summary["notes"] = notes + summary["notes"]
    summary["run"] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "host": host,
                      "prefill": rates, "source": source,
                      "targets": list(targets), "methods": list(methods), "top_k": top_k,
                      "recompute_ratio": recompute_ratio, "recompute_select": recompute_select,
                      "translated_key_scale": translated_key_scale, "rank_key_decay": rank_key_decay,
                      "copy_prior": copy_prior, "translated_focus_tokens": translated_focus_tokens,
                      "rank_key_decay_native": decays,
                      "max_new_tokens": max_new_tokens, "chunk_tokens": chunk_tokens,
                      "dtype": dtype if built else store_dtype(store)}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    (out_dir / TABLE).write_text(render_markdown(summary))
    if plots:
        plot(summary, out_dir)
    return summary


# ------------------------------------------------------------------ summary

_MEANS = ("exact_match", "f1", "found", "gold_log_likelihood", "kl_from_direct", "top1_with_direct")
_RETAINED = {"exact_match": "exact_match", "f1": "f1", "found": "found", "likelihood": "gold_log_likelihood"}


def summarize(results_path: Path, rates: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per (dataset, target, condition): means, median TTFT, retention against DC.

    `rates`: each target's prefill measurement of this run (`measure_prefill_rate`),
    carried on its rows so that every ratio comes with the host's own speed.
    """
    rates = rates or {}
    rows = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["meta"].get("dataset", "qa"), row["target"])].append(row)
    table, notes = [], []
    for (dataset, target), group in sorted(groups.items()):
        conditions = sorted({c for r in group for c in r["results"]}, key=_condition_order)
        direct = [r["results"][DIRECT] for r in group]
        for cond in conditions:
            paired = [(r["results"][cond], r["results"][DIRECT]) for r in group if cond in r["results"]]
            x = [p[0] for p in paired]
            entry: dict[str, Any] = {"dataset": dataset, "target": target, "condition": cond, "n": len(x)}
            for key in _MEANS:
                vals = [v[key] for v in x if v[key] is not None]
                entry[key] = float(np.mean(vals)) if vals else None
            entry["ttft_s_median"] = float(np.median([v["ttft_s"] for v in x]))
            entry["context_tokens_mean"] = float(np.mean([v["context_tokens"] for v in x]))
            entry["prefill_tok_s"] = rates.get(target, {}).get("prefill_tok_s")
            entry["retention"] = {}
            for name, key in _RETAINED.items():
                cx = [v[key] for v, _ in paired]
                dx = [d[key] for _, d in paired]
                if name == "likelihood":  # per-token likelihood, a positive quantity
                    cx, dx = np.exp(cx), np.exp(dx)
                entry["retention"][name] = metrics.retention(cx, dx).to_dict()
            table.append(entry)
        nc = [r["results"][NO_CONTEXT]["f1"] for r in group]
        dc = [d["f1"] for d in direct]
        if np.mean(dc) < np.mean(nc) + 0.1:
            notes.append(f"{dataset} on {target}: direct context F1 {np.mean(dc):.2f} is not well above "
                         f"no context {np.mean(nc):.2f}; this dataset measures little for this target")
    return {"table": table, "notes": notes, "rows": len(rows)}


def _condition_order(name: str) -> tuple[int, str]:
    order = {NO_CONTEXT: 0, DIRECT: 1, "native_cache": 2}
    return (order.get(name, 3), name)


def _fmt(v, digits=2) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.{digits}f}"


def _ret(r: dict) -> str:
    if r["value"] != r["value"]:  # NaN
        return "–"
    return f"{r['value']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def render_markdown(summary: dict[str, Any]) -> str:
    run = summary.get("run", {})
    lines = ["# cag eval results", ""]
    if run:
        lines += [f"Command: `{run.get('command', '')}`  ", f"Date: {run.get('date')}; machine: {run.get('machine')}; "
                  f"source model: {run.get('source')}; top-k {run.get('top_k')}; chunk tokens {run.get('chunk_tokens')}; "
                  f"recompute ratio {run.get('recompute_ratio', 0.0)}, selected by {run.get('recompute_select', 'deviation')} (native and cached conditions).", ""]
        if run.get("host"):
            lines += [host_line(run["host"], run.get("prefill", {})), ""]
    lines += ["Retention = metric(condition) / metric(direct context) on the same questions and chunks, "
              "with a paired bootstrap 95% interval. KL and top-1 are against direct context's next-token "
              "distributions over the gold answer. TTFT excludes retrieval (the same for every condition).", "",
              "| dataset | target | condition | n | EM | F1 | found | F1 retention | found retention | "
              "likelihood retention | KL(DC‖X) | top-1 | TTFT s (median) | context tokens | target prefill tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary["table"]:
        r = e["retention"]
        lines.append(f"| {e['dataset']} | {e['target']} | {e['condition']} | {e['n']} | {_fmt(e['exact_match'])} | "
                     f"{_fmt(e['f1'])} | {_fmt(e['found'])} | {_ret(r['f1'])} | {_ret(r['found'])} | "
                     f"{_ret(r['likelihood'])} | {_fmt(e['kl_from_direct'], 3)} | {_fmt(e['top1_with_direct'])} | "
                     f"{_fmt(e['ttft_s_median'], 3)} | {e['context_tokens_mean']:.0f} | "
                     f"{_fmt(e.get('prefill_tok_s'), 0)} |")
    if summary.get("notes"):
        lines += ["", "Notes:", *[f"- {n}" for n in summary["notes"]]]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """retention.png (F1 retention by condition and target, with intervals) and ttft.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [e for e in summary["table"] if e["condition"] != DIRECT]
    if not rows:
        return []
    paths = []
    labels = [f"{e['dataset']}\n{e['target']}\n{e['condition']}" for e in rows]
    vals = [e["retention"]["f1"]["value"] for e in rows]
    lows = [max(0.0, v - e["retention"]["f1"]["low"]) if v == v else 0 for v, e in zip(vals, rows)]
    highs = [max(0.0, e["retention"]["f1"]["high"] - v) if v == v else 0 for v, e in zip(vals, rows)]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [v if v == v else 0 for v in vals], yerr=[lows, highs], capsize=3, color="#4c72b0")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("F1 retention vs direct context")
    ax.set_title("Quality retention (95% paired bootstrap)")
    fig.tight_layout()
    paths.append(out_dir / "retention.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    by_cond: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in summary["table"]:
        by_cond[f"{e['target']} {e['condition']}"].append((e["context_tokens_mean"], e["ttft_s_median"]))
    for name, pts in sorted(by_cond.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (s, median)")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    ax.set_title("Time to first token")
    fig.tight_layout()
    paths.append(out_dir / "ttft.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
