"""Choose the copy prior's weight (`cag.copy_prior`) on the gate's calibration items, never an evaluation set.

    python eval/calibrate_copy_prior.py --target qwen2.5-0.5b --weights 0 0.2 0.35 0.5 \\
        --stores eval/results/gate-kc-plain-more/refit --out eval/results/copy_prior/qwen

The gate's three calibration parts (`eval/gate_fidelity.py`): 30 `calib-lookup` questions (seed 0), 24 code
needles planted in the essays the translation lab holds out (seed 900), 36 free questions about those essays.
Each question's cached paths (the translated one through `--method`, and the target's own chunks) are placed
once, as `cag eval` places them (same retrieval, `eval.harness.ItemRunner`), and answered greedily at every
weight from a copy of the placed cache. Weight 0 is the model alone and reproduces the gate's answers.
`--paths control` adds `cag eval`'s text-only control: no context cache, the same rules over the same chunks' text.
`--stores` reuses the stores a gate run built (its `source-<model>`, `-copy` and `-essays` folders); without
it each part's store is built in OUT. Rows go to OUT/rows.jsonl as they finish, so a stopped run resumes;
OUT/summary.json and summary.md hold found and F1 per weight, paired against weight 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from cag.copy_prior import TextCopyPrior, mixed, pointer_starts  # noqa: E402
from cag.generate import generate, stop_token_ids  # noqa: E402
from cag.progress import Progress  # noqa: E402
from eval import metrics  # noqa: E402
from eval.eval_chunk_dtype import paired_delta  # noqa: E402
from eval.harness import NATIVE, ItemRunner, host_info  # noqa: E402
from eval.run import build_eval_store  # noqa: E402

PARTS = ("lookups", "codes", "essays")
STORE_SUFFIX = {"lookups": "", "codes": "-copy", "essays": "-essays"}  # gate_fidelity's folder names


class TokenCopyPrior:
    """The copy prior with the suffix matched in the context's tokens: `--unit token`, the first calibration
    run (copy_prior/qwen/); the served `TextCopyPrior` beat it on names the model splits otherwise.

    `context_ids`: the context's target-token ids, one sequence per chunk (a suffix never matches
    across two chunks). `weight`: w above, in [0, 1]. `max_order`: the longest suffix looked for.
    """

    def __init__(self, context_ids: Sequence[Sequence[int]], weight: float, max_order: int = 8, *,
                 stop_ids: Sequence[int] = ()) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"copy prior weight must be in [0, 1], got {weight}")
        if max_order < 1:
            raise ValueError(f"max_order must be at least 1, got {max_order}")
        self.weight = float(weight)
        self.max_order = int(max_order)
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self._seqs = [[int(t) for t in seq] for seq in context_ids]
        # token → every (chunk, position) holding it that has a next token: the suffix's last token is
        # looked up here, then extended backwards, so a step costs the occurrences of one token
        self._where: dict[int, list[tuple[int, int]]] = {}
        for c, seq in enumerate(self._seqs):
            for p in range(len(seq) - 1):
                self._where.setdefault(seq[p], []).append((c, p))

    def continuations(self, generated: Sequence[int]) -> dict[int, int]:
        """The tokens that follow the longest suffix of `generated` found in the context, with counts."""
        if not generated:
            return {}
        best, found = 0, {}
        for c, p in self._where.get(int(generated[-1]), ()):
            seq, n = self._seqs[c], 1
            while n < self.max_order and n < len(generated) and p - n >= 0 and seq[p - n] == generated[-1 - n]:
                n += 1
            if n > best:
                best, found = n, {}
            if n == best:
                nxt = seq[p + 1]
                found[nxt] = found.get(nxt, 0) + 1
        return found

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """Log-probabilities of the mixture (the logits as they are where nothing is copied)."""
        return mixed(logits, self.continuations(generated) if self.weight > 0 else {}, self.weight, self.stop_ids)


def pointer_first(ctx: CachedContext, question: str, hits, head: str, top: int | None = None) -> dict[str, float]:
    """`cag.copy_prior.pointer_starts` of (layer, head) `head` ("16.7") over the translated chunks of `hits`;
    `top`: only the words the head looks at most (`--pointer-top 1`, a hard pointer: negative, not served)."""
    from eval.diagnose_length import translated_chunks

    layer, h = (int(x) for x in head.split("."))
    asm = ctx.assembler
    chunks, used = translated_chunks(ctx, None, ctx._order(hits))  # as `CachedContext.prepare` places them
    starts = pointer_starts(asm, chunks, [u.text for u in used], asm.question_ids(question), layer, h,
                            chat=asm.layout.chat)
    return starts if top is None else dict(sorted(starts.items(), key=lambda kv: -kv[1])[:top])


def part_items(part: str) -> list:
    """The gate's items of one part, as `gate_fidelity.py` draws them with its defaults."""
    from eval.calibration_lookup import calibration_lookup
    from eval.datasets import calibration_essay_gate_qa
    from eval.gate_fidelity import COPY_SEED, copy_items

    if part == "lookups":
        return calibration_lookup(seed=0)[:30]
    if part == "codes":
        return copy_items(24, COPY_SEED)
    return calibration_essay_gate_qa()[:36]


def read_rows(path: Path) -> list[dict]:
    """The rows a stopped run wrote to its JSONL file (none if it never started): runs resume from them."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(path: Path, row: dict) -> None:
    """One finished row, appended as soon as it is done: a stopped run resumes from `read_rows`."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def write_summary(out: Path, run: dict, table: list[dict], text: str) -> None:
    """OUT/summary.json (the run and its table), OUT/summary.md (`text`), and `text` on stdout."""
    (out / "summary.json").write_text(json.dumps({"run": run, "table": table}, indent=1) + "\n")
    (out / "summary.md").write_text(text)
    print(text)


def part_store(part: str, items: list, source: str, stores: Path | None, out: Path) -> Path:
    """The SmolLM2 store of one part's items: a gate run's (`source-<model>[-copy|-essays]`) or another run
    of these scripts' (`store-<part>`) under `stores`, else built once in `out`."""
    candidates = [] if stores is None else [stores / f"store-{part}"]
    if stores is not None and part in STORE_SUFFIX:  # a gate run holds the gate's three parts only
        candidates.insert(0, stores / f"source-{source}{STORE_SUFFIX[part]}" / "store")
    for store in candidates:
        if store.is_dir():
            return store
    store = out / f"store-{part}"
    if not store.is_dir():
        build_eval_store(items, store, source, chunk_tokens=256)
    return store


def answer_at(runner: ItemRunner, name: str, run, prior, answers, stops) -> dict:
    lm = runner.lm
    with runner._ape(name, run):
        gen = generate(lm.model, lm.tokenizer, copy.deepcopy(run.cache), run.question_ids,
                       max_new_tokens=runner.max_new_tokens, stop_ids=stops, first_logits=run.first_logits,
                       copy_prior=prior)
    return {"answer": gen.text.strip(), "found": metrics.contains_answer(gen.text, answers),
            "f1": metrics.token_f1(gen.text, answers)}


def summarize(rows: list[dict], weights: list[float]) -> list[dict]:
    table = []
    for part in PARTS:
        for path in sorted({r["path"] for r in rows}):
            mine = [r for r in rows if r["part"] == part and r["path"] == path]
            if not mine:
                continue
            base_found = [r["by_weight"]["0"]["found"] for r in mine] if all("0" in r["by_weight"] for r in mine) \
                else None
            base_f1 = [r["by_weight"]["0"]["f1"] for r in mine] if base_found is not None else None
            for w in weights:
                key = f"{w:g}"
                found = [r["by_weight"][key]["found"] for r in mine]
                f1 = [r["by_weight"][key]["f1"] for r in mine]
                line = {"part": part, "path": path, "weight": w, "n": len(mine), "found": int(sum(found)),
                        "f1": round(sum(f1) / len(f1), 4)}
                if base_found is not None and w != 0:
                    line["d_found"] = paired_delta(base_found, found)
                    line["d_f1"] = paired_delta(base_f1, f1)
                table.append(line)
    return table


def render(table: list[dict], meta: dict) -> str:
    out = [f"# Copy prior weight on the gate's calibration items ({meta['target']}, {meta['method']}, "
           f"suffix matched in the context's {meta['unit']}s)", "",
           f"Stop-aware: {meta['stop_aware']}; text unit: suffix of at least {meta['min_chars']} characters; "
           f"inside a word: {meta.get('words', 'letters')} (cag.copy_prior.WORD_RULES).", "",
           f"`{meta['command']}`", "", f"{meta['date']}, {meta['host']}; greedy, {meta['max_new_tokens']} new "
           "tokens, the paths placed once per question and answered at every weight.", "",
           "| part | path | weight | n | found | F1 | Δfound vs 0 [95%] | ΔF1 vs 0 [95%] |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in table:
        def iv(d):
            return f"{d['delta']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]" if d else ""
        out.append(f"| {t['part']} | {t['path']} | {t['weight']:g} | {t['n']} | {t['found']} | {t['f1']:.3f} | "
                   f"{iv(t.get('d_found'))} | {iv(t.get('d_f1'))} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--method", default="bottleneck", help="the translated path's mapper")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.2, 0.35, 0.5])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--paths", nargs="+", choices=("translated", "native", "control"),
                    default=["translated", "native"],
                    help="control: no context cache, the copy prior over the same chunks' text (cag eval's "
                         "copy_only): what the rules find from the text alone")
    ap.add_argument("--unit", choices=("token", "text"), default="token", help="match the answer's suffix in the "
                    "context's tokens (TokenCopyPrior) or its characters (TextCopyPrior)")
    ap.add_argument("--stop-aware", action="store_true", help="the model keeps its own probability of ending "
                    "the answer (stop_ids)")
    ap.add_argument("--min-chars", type=int, default=2, help="--unit text: the shortest suffix that copies")
    ap.add_argument("--words", choices=("letters", "code"), default="code", help="--unit text --stop-aware: "
                    "what counts as inside a word of the context, where the answer may not stop (cag.copy_prior)")
    ap.add_argument("--pointer", help="LAYER.HEAD: the first token's copy distribution is where this head of the "
                    "target looks from the question's last token, over the translated chunks placed as stored "
                    "(eval/probe_pointer.py ranks the heads)")
    ap.add_argument("--pointer-weight", type=float, help="--pointer: the first token's weight (default: the "
                    "weight of the run's column)")
    ap.add_argument("--pointer-top", type=int, help="--pointer: only the words the head looks at most (1: its "
                    "strongest word alone)")
    ap.add_argument("--code-start", action="store_true", help="--unit text: a first token the context spells only "
                    "inside a code starts that code (TextCopyPrior.code_start)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="the gate's budget")
    ap.add_argument("--stores", type=Path, help="a gate run's folder whose stores to reuse")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    weights = sorted(set(args.weights) | {0.0})
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = {}
    for r in read_rows(rows_path):
        if set(r["by_weight"]) != {f"{w:g}" for w in weights}:
            raise SystemExit(f"{rows_path} holds weights {sorted(r['by_weight'])}, not {weights}: use another --out")
        done[(r["part"], r["item"], r["path"])] = r
    meta = {"source": args.source, "target": args.target, "method": args.method, "weights": weights,
            "unit": args.unit, "stop_aware": args.stop_aware, "min_chars": args.min_chars, "words": args.words,
            "pointer": args.pointer, "pointer_weight": args.pointer_weight, "pointer_top": args.pointer_top,
            "code_start": args.code_start,
            "max_new_tokens": args.max_new_tokens, "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "host": host_info().get("cpu", "")}
    for part in args.parts:
        items = part_items(part)
        store = part_store(part, items, args.source, args.stores, args.out)
        settings = dict(store=store, target=args.target, top_k=4, max_new_tokens=args.max_new_tokens,
                        translation_cache_mb=0)
        base = CachedContext(mapper="identity", **settings)
        ctx = CachedContext(mapper=args.method, **settings)
        runner = ItemRunner(base, {args.method: ctx}, max_new_tokens=args.max_new_tokens)
        lm = runner.lm
        stops = stop_token_ids(lm.tokenizer)
        lm_chat = base.assembler.layout.chat
        if "translated" in args.paths:
            meta.setdefault("artifacts", {})[args.method] = getattr(ctx.active_mapper, "artifact_id", args.method)
        with Progress(f"copy prior: {part}", total=len(items) * len(args.paths), unit="answers",
                      interval_s=20) as bar:
            for item in items:
                todo = [p for p in args.paths if (part, item.id, p) not in done]
                bar.advance(len(args.paths) - len(todo))
                if not todo:
                    continue
                hits = runner.hits_for(item)
                context = [lm.tokenize(h.text)[0].tolist() for h in hits]
                first = pointer_first(ctx, item.question, hits, args.pointer, args.pointer_top) if args.pointer else None

                def prior(w: float):
                    if w == 0:
                        return None
                    ends = stops if args.stop_aware else ()
                    if args.unit == "text":
                        return TextCopyPrior([h.text for h in hits], lm.tokenizer, w, min_chars=args.min_chars,
                                             stop_ids=ends, words=args.words, first=first,
                                             first_weight=args.pointer_weight, code_start=args.code_start,
                                             chat=lm_chat)
                    return TokenCopyPrior(context, w, stop_ids=ends)
                for path in todo:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        if path == "translated":
                            run, name = runner._cached_run(ctx, item, hits), f"cache:{args.method}"
                        elif path == "native":
                            run, name = runner._native_run(item, hits), NATIVE
                        else:  # no context cache; at weight 0 this is no context
                            run, name = runner._text_run(item, hits, with_context=False), "none"
                    by_weight = {f"{w:g}": answer_at(runner, name, run, prior(w), item.answers, stops)
                                 for w in weights}
                    row = {"part": part, "item": item.id, "path": path, "answers": list(item.answers),
                           "by_weight": by_weight}
                    append_row(rows_path, row)
                    done[(part, item.id, path)] = row
                    bar.advance(1)
    rows = [r for r in done.values() if r["part"] in args.parts]
    table = summarize(rows, weights)
    write_summary(args.out, meta, table, render(table, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
