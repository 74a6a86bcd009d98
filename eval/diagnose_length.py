"""Why translated caches lose their facts as the context grows: a diagnosis on calibration needles.

    python eval/diagnose_length.py --target qwen2.5-0.5b --method bottleneck \\
        --lengths 1024 2048 4096 --n 8 --out eval/results/length_diagnosis

On `cag eval`'s needles the shipped bottleneck's gold log-likelihood falls with
context length, to below no context at 4K, while the target's own chunk caches
hold. This script reproduces that on *calibration-side* needles (a fact planted
in a window of the calibration essays the translation lab holds out of its
training rows; no evaluation set is read) and takes the translated cache apart,
one swap at a time, on the same chunks of a SmolLM2 store (256-token chunks,
each prefilled after the prompt head, as `cag build` makes them):

- ``native`` / ``translated``: every chunk the target's own / translated;
- ``needle native, rest translated`` and ``needle translated, rest native``: is it
  the fact's own chunk that fails, or the translated neighbours that drown it?
- ``K translated, V native`` and ``K native, V translated``: which half breaks;
- ``translated, first 8 native``: each chunk's first 8 tokens native (a chunk-start
  artefact of translation would show here);
- ``K native in layers a-b, rest translated``: native keys in one quarter of the target's layers
  at a time, translated elsewhere (which layers' translated keys lose the fact).

Per condition: found, token F1, the gold answer's log-likelihood (teacher-forced),
and where the question's attention goes per layer (the prompt head, the needle's
chunk, the answer's own tokens, the other chunks, and by position inside a chunk).
Resumable (one JSON line per item); writes OUT/results.jsonl, OUT/summary.json,
OUT/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext, Timings  # noqa: E402
from cag.generate import generate, last_logits, stop_token_ids  # noqa: E402
from cag.kv import KVChunk  # noqa: E402
from cag.models.attention import context_temperature  # noqa: E402
from eval import metrics  # noqa: E402
from eval.calibration_lookup import NEEDLE_MATERIALS  # noqa: E402
from eval.lab.score import question_attentions  # noqa: E402

CHUNK_TOKENS = 256          # the store's default chunk size (`cag build`)
FIRST_K = 8
LAYER_GROUPS = 4            # "K native in layers a-b": the target's layers in this many groups
CRUX_KEY_SCALE = 0.3        # eval/results/crux_key_scale.md: chosen for Qwen2.5 on 50 calib-lookup items
POSITION_BUCKETS = ((0, 4), (4, 16), (16, 64), (64, 10**9))
SEED_BASE = 300             # calib-needle seeds nobody else reads (gate 0, lab >= 100 and its items)


def needles(length: int, n: int, tokenizer, seed_base: int = SEED_BASE, essays: list[str] | None = None,
            material: str = "facts") -> list:
    """`n` calibration needles in windows of about `length` target tokens of `essays` (default: the
    lab's held-out essays, which its training rows never saw); `material`: a key of `NEEDLE_MATERIALS`."""
    from eval.datasets import essay_text
    from eval.lab.data import held_out_essays

    essays = essays or held_out_essays()
    words = {e: len(essay_text(e).split()) for e in essays}
    per_word = len(tokenizer(" ".join(essay_text(essays[0]).split()[:2000]))["input_ids"]) / 2000
    want = int(length / per_word)
    long_enough = [e for e in essays if words[e] >= want]
    if not long_enough:  # the longest essay, whole: the item says how long it really was
        long_enough = [max(essays, key=words.get)]
    return NEEDLE_MATERIALS[material](seed=seed_base + length, n=n, words=want, essays=long_enough)


def mixed(native: KVChunk, translated: KVChunk, keys_from: str, values_from: str, first_native: int = 0) -> KVChunk:
    src = {"native": native, "translated": translated}
    if not torch.equal(native.token_ids, translated.token_ids):
        raise ValueError("native and translated chunks tokenize differently")
    keys, values = src[keys_from].keys.float().clone(), src[values_from].values.float().clone()
    if first_native:
        keys[:, :, :first_native] = native.keys[:, :, :first_native].float()
        values[:, :, :first_native] = native.values[:, :, :first_native].float()
    return KVChunk(keys, values, native.token_ids, native.offsets, native.text_hash, native.model, native.settings)


def damped(chunks: list[KVChunk], keep: int | None, scale: float) -> list[KVChunk]:
    """Every chunk but ``keep`` with its keys × ``scale`` (rotation is linear, so this scales its logits)."""
    return [c if i == keep else replace(c, keys=c.keys * scale) for i, c in enumerate(chunks)]


def key_corrected(chunks: list[KVChunk], correction: tuple[torch.Tensor, torch.Tensor]) -> list[KVChunk]:
    """Translated chunks with `eval/fit_key_correction.py`'s ``k + (k A) B`` on their position-free keys."""
    from mappers.bottleneck import corrected_keys

    a, b = correction
    return [replace(c, keys=corrected_keys(c.keys.float(), a, b)) for c in chunks]


def conditions(natives: list[KVChunk], translated: list[KVChunk], needle: int | None,
               offsets: bool = False, top: int | None = None,
               correction: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, list[KVChunk]]:
    """Condition name → chunks to place. A name ending in ``+ offset`` is placed with the calibrated
    per-head context logit offsets (`eval/calibrate_context_mass.py`). ``top``: the chunk the
    retriever's embedder ranks first for the question (no label read)."""
    both = list(zip(natives, translated))
    out = {
        "native": [mixed(n, t, "native", "native") for n, t in both],
        "translated": [mixed(n, t, "translated", "translated") for n, t in both],
        "K translated, V native": [mixed(n, t, "translated", "native") for n, t in both],
        "K native, V translated": [mixed(n, t, "native", "translated") for n, t in both],
        f"translated, first {FIRST_K} native": [mixed(n, t, "translated", "translated", FIRST_K) for n, t in both],
    }
    if needle is not None:
        out["needle native, rest translated"] = [mixed(n, t, *(("native",) * 2 if i == needle else ("translated",) * 2))
                                                 for i, (n, t) in enumerate(both)]
        out["needle translated, rest native"] = [mixed(n, t, *(("translated",) * 2 if i == needle else ("native",) * 2))
                                                 for i, (n, t) in enumerate(both)]
    # Translate everything, prefill nothing: the crux stays translated and its translated
    # neighbours are damped (the crux path's calibrated key scale), by the label or the retriever.
    if needle is not None:
        out[f"translated, others' keys x{CRUX_KEY_SCALE} (needle)"] = damped(out["translated"], needle, CRUX_KEY_SCALE)
    if top is not None:
        out[f"translated, others' keys x{CRUX_KEY_SCALE} (retriever top)"] = damped(out["translated"], top,
                                                                                 CRUX_KEY_SCALE)
    # Which layers' translated keys lose the fact: native keys in one quarter of the layers at a time.
    layers = natives[0].keys.shape[0]
    step = -(-layers // LAYER_GROUPS)  # ceil: Gemma-3's 18 layers in groups of 5, 5, 5, 3
    for lo in range(0, layers, step):
        hi = min(layers, lo + step)
        out[f"K native in layers {lo}-{hi - 1}, rest translated"] = [
            replace(t, keys=torch.cat([t.keys[:lo].float(), n.keys[lo:hi].float(), t.keys[hi:].float()]))
            for n, t in zip(natives, out["translated"])]
    if correction is not None:
        out["translated + key correction"] = key_corrected(out["translated"], correction)
        if needle is not None:
            out["needle native, rest translated + key correction"] = [
                n if i == needle else k
                for i, (n, k) in enumerate(zip(natives, out["translated + key correction"]))]
    if offsets:
        out["translated + offset"] = out["translated"]
        if needle is not None:
            out["needle native, rest translated + offset"] = out["needle native, rest translated"]
    return out


def translated_chunks(ctx: CachedContext, item, hits: list | None = None) -> tuple[list[KVChunk], list]:
    """The chunks of ``hits`` (default: the item's documents whole, in document order) as the query
    path translates them (no stored translations, no LRU in these scripts' contexts), and their hits."""
    hits = hits if hits is not None else ctx.document_hits([d.id for d in item.documents])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "translated path below the gate": these scripts measure it
        return ctx._target_chunks(hits, Timings(), [])


def measurement_context(items: list, out: Path, source: str, target: str, method: str) -> CachedContext:
    """A `source` store of the items' documents in OUT/store-<source> (256-token chunks, as `cag build`
    makes them) and the query path over it, without LRU or gate: what these scripts measure. One
    store per source: a store holds one source model's chunks, and pairs fitted into the same OUT
    differ in their source."""
    from eval.run import build_eval_store

    out.mkdir(parents=True, exist_ok=True)
    store = out / f"store-{source}"
    build_eval_store(items, store, source, chunk_tokens=CHUNK_TOKENS, progress=True)
    return CachedContext(store=store, target=target, mapper=method, translation_cache_mb=0, min_retention=0)


def pair_arguments(ap: argparse.ArgumentParser, *, n: int, lengths: list[int]) -> None:
    """The arguments every calibration-needle script here shares."""
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--method", default="bottleneck")
    ap.add_argument("--lengths", type=int, nargs="+", default=lengths)
    ap.add_argument("--n", type=int, default=n, help="needles per length (and material)")
    ap.add_argument("--material", nargs="+", choices=list(NEEDLE_MATERIALS), default=["facts"],
                    help="what the needles ask for: facts (common words, numbers, names) and/or codes (register "
                    "codes, call signs, archive numbers, invented names and words, copied exactly)")


def answer_location(hits, chunks: list[KVChunk], answers) -> tuple[int | None, tuple[int, int] | None]:
    """(chunk index, [start, end) token span inside the whole placed context) of the answer's first occurrence."""
    before = 0
    for i, (hit, chunk) in enumerate(zip(hits, chunks)):
        for answer in answers:
            at = hit.text.find(answer)
            if at >= 0:
                off = chunk.offsets
                inside = ((off[:, 1] > at) & (off[:, 0] < at + len(answer))).nonzero().flatten()
                if inside.numel():
                    return i, (before + int(inside.min()), before + int(inside.max()) + 1)
        before += chunk.num_tokens
    return None, None


def attention_profile(lm, placed, q: torch.Tensor, sizes: list[int], needle: int | None,
                      span: tuple[int, int] | None) -> dict[str, list[float]]:
    """Per layer, the question's attention (mean over heads and question tokens) by where it lands."""
    att = question_attentions(lm.model, placed, q)
    p = placed.prefix_tokens
    starts = torch.tensor([0, *sizes]).cumsum(0)
    in_chunk = torch.cat([torch.arange(s) for s in sizes])           # position of each context token in its chunk
    owner = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    out: dict[str, list[float]] = {"head": [], "needle_chunk": [], "answer": [], "other_chunks": []}
    for lo, hi in POSITION_BUCKETS:
        out[f"pos{lo}-{min(hi, 999)}"] = []
    for a in att:
        a = a[0].float().mean(0).mean(0)                             # [total]: mean over heads, question tokens
        ctx = a[p:p + int(starts[-1])]
        out["head"].append(float(a[:p].sum()))
        nd = float(ctx[owner == needle].sum()) if needle is not None else float("nan")
        out["needle_chunk"].append(nd)
        out["answer"].append(float(ctx[span[0]:span[1]].sum()) if span else float("nan"))
        out["other_chunks"].append(float(ctx.sum()) - (nd if needle is not None else 0.0))
        for lo, hi in POSITION_BUCKETS:
            out[f"pos{lo}-{min(hi, 999)}"].append(float(ctx[(in_chunk >= lo) & (in_chunk < hi)].sum()))
    return out


@torch.inference_mode()
def run_item(ctx: CachedContext, item, max_new_tokens: int, offsets: torch.Tensor | None = None,
             only: list[str] | None = None, correction: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    lm, _, asm = ctx._ready()
    translated, hits = translated_chunks(ctx, item)
    natives = [lm.prefill(h.text) for h in hits]
    needle, span = answer_location(hits, natives, item.answers)
    q = asm.question_ids(item.question)
    chat = asm.layout.chat
    gold = lm.tokenize(item.answers[0] if chat else " " + item.answers[0])[0]
    stops = stop_token_ids(lm.tokenizer)
    sizes = [c.num_tokens for c in natives]
    row = {"id": item.id, "context_tokens": sum(sizes), "chunks": len(sizes), "needle_chunk": needle,
           "depth": item.meta.get("depth"), "conditions": {}}
    _, index = ctx._current_view()
    top = int((index.embed([h.text for h in hits]) @ index.embed([item.question])[0]).argmax())  # unit-norm rows
    row["retriever_top_holds_needle"] = top == needle
    todo = {"no context": [], **conditions(natives, translated, needle, offsets is not None, top, correction)}
    for name, chunks in todo.items():
        if only and name not in only:
            continue
        placed = asm.place(chunks)
        with_offset = name.endswith("+ offset")
        adjust = (context_temperature(lm.model, placed.prefix_tokens, placed.context_ids.numel(), offsets=offsets)
                  if with_offset else nullcontext())
        with adjust:
            logits = last_logits(lm.model, torch.cat([q, gold[:-1]])[None], copy.deepcopy(placed.cache),
                                 positions=gold.numel())
            logp = torch.log_softmax(logits.float(), -1)
            gen = generate(lm.model, lm.tokenizer, copy.deepcopy(placed.cache), q, max_new_tokens=max_new_tokens,
                           stop_ids=stops)
        entry = {"answer": gen.text.strip(), "found": metrics.contains_answer(gen.text, item.answers),
                 "f1": metrics.token_f1(gen.text, item.answers), "gold_ll": metrics.gold_log_likelihood(logp, gold)}
        if chunks and not with_offset:  # eager attention (for the profile) cannot be wrapped
            entry["attention"] = attention_profile(lm, placed, q, sizes, needle, span)
        row["conditions"][name] = entry
    return row


def summarize(rows: list[dict]) -> dict:
    by_length: dict[int, dict] = {}
    for row in rows:
        group = by_length.setdefault(row["length"], {"n": 0, "context_tokens": [], "conditions": {}})
        group["n"] += 1
        group["context_tokens"].append(row["context_tokens"])
        if "retriever_top_holds_needle" in row:
            group.setdefault("top_holds", []).append(row["retriever_top_holds_needle"])
        for name, e in row["conditions"].items():
            c = group["conditions"].setdefault(name, {"found": [], "f1": [], "gold_ll": [], "attention": {}})
            for k in ("found", "f1", "gold_ll"):
                c[k].append(e[k])
            for where, per_layer in e.get("attention", {}).items():
                c["attention"].setdefault(where, []).append(per_layer)
    out = {}
    for length, g in sorted(by_length.items()):
        conds = {}
        for name, c in g["conditions"].items():
            gl = torch.tensor(c["gold_ll"])
            conds[name] = {"found": sum(c["found"]) / len(c["found"]), "f1": sum(c["f1"]) / len(c["f1"]),
                           "gold_ll": float(gl.mean()), "gold_ll_ci": list(metrics_ci(gl)),
                           "attention": {w: torch.tensor(v).mean(0).tolist() for w, v in c["attention"].items()}}
        out[str(length)] = {"n": g["n"], "mean_context_tokens": sum(g["context_tokens"]) / g["n"], "conditions": conds}
        if g.get("top_holds"):
            out[str(length)]["retriever_top_holds_needle"] = sum(g["top_holds"]) / len(g["top_holds"])
    return out


def metrics_ci(values: torch.Tensor, reps: int = 2000) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, values.numel(), (reps, values.numel()), generator=g)
    means = values[idx].mean(1).sort().values
    return float(means[int(0.025 * reps)]), float(means[int(0.975 * reps) - 1])


def render(summary: dict, meta: dict) -> str:
    lines = [f"# Translated caches at length: where the needle is lost ({meta['method']} → {meta['target']})", "",
             f"`{meta['command']}`, {meta['date']}, {meta['host']}.", "",
             "Calibration needles (a calib-lookup fact planted in a window of the 3 calibration essays the "
             "translation lab holds out), SmolLM2 store of 256-token chunks, every condition on the same chunks. "
             "Gold LL: mean log-likelihood per gold token, teacher-forced, with a bootstrap 95% interval over items.",
             ""]
    for length, g in summary.items():
        lines += [f"## {length} target tokens (n = {g['n']}, mean {g['mean_context_tokens']:.0f} context tokens)", "",
                  "| condition | found | F1 | gold LL | attention: head | needle chunk | answer | other chunks |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        if "retriever_top_holds_needle" in g:
            lines[-2:-2] = [f"The retriever's top chunk holds the needle in {g['retriever_top_holds_needle']:.2f} "
                            "of items.", ""]
        for name, c in g["conditions"].items():
            att = c["attention"]
            mean = (lambda k: sum(att[k]) / len(att[k])) if att else None
            cells = [f"{mean(k):.3f}" if mean else "–" for k in ("head", "needle_chunk", "answer", "other_chunks")]
            lo, hi = c["gold_ll_ci"]
            lines.append(f"| {name} | {c['found']:.2f} | {c['f1']:.2f} | {c['gold_ll']:.2f} [{lo:.2f}, {hi:.2f}] | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from cag.models import registry
    from cag.progress import Progress
    from eval.harness import host_info
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(ap, n=8, lengths=[1024, 2048, 4096])
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "length_diagnosis")
    ap.add_argument("--offsets", type=Path, help="calibrated context logit offsets (eval/calibrate_context_mass.py): "
                    "adds the '+ offset' conditions")
    ap.add_argument("--key-correction", type=Path, help="a key correction (eval/fit_key_correction.py, "
                    ".safetensors): adds the 'translated + key correction' conditions")
    ap.add_argument("--only", nargs="+", help="run only these conditions")
    ap.add_argument("--tag", default="", help="results-<tag>.jsonl beside the first run's results")
    args = ap.parse_args(argv)
    offsets = torch.tensor(json.loads(args.offsets.read_text())["offset"]) if args.offsets else None
    correction = meta = None
    if args.key_correction:
        from safetensors.torch import load_file

        weights = load_file(str(args.key_correction))
        meta = json.loads(args.key_correction.with_name(args.key_correction.name.replace(
            ".safetensors", ".json")).read_text())
        if "u" in weights or meta.get("started_from_artifact_correction"):
            raise SystemExit(f"{args.key_correction} has a token part or continues the artifact's own correction: "
                             "export it (fit_key_correction.py --export) and measure the shipped map")
        correction = (weights["a"], weights["b"])

    lm = registry.load(args.target, "auto")
    items = {length: [it for m in args.material for it in needles(length, args.n, lm.tokenizer, material=m)]
             for length in args.lengths}
    ctx = measurement_context([it for its in items.values() for it in its], args.out, args.source, args.target,
                              args.method)
    if meta is not None:
        # A correction is fitted on top of one artifact; on another (e.g. the shipped map that
        # already carries it since `fit_key_correction.py --export`) it would be applied twice.
        fitted_on = meta["mapper_artifact"]
        artifact = getattr(ctx._ready()[1], "artifact_id", None)
        if artifact != fitted_on:
            raise SystemExit(f"{args.key_correction} was fitted on mapper artifact {fitted_on}; this run's "
                             f"{args.method} is {artifact} (it may carry the correction already)")
    path = args.out / (f"results-{args.tag}.jsonl" if args.tag else "results.jsonl")
    done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo = [(length, it) for length, its in items.items() for it in its if it.id not in done]
    with Progress("length diagnosis", total=len(todo), unit="items", interval_s=20) as bar, path.open("a") as f:
        for length, item in todo:
            row = run_item(ctx, item, args.max_new_tokens, offsets, args.only, correction)
            row["length"] = length
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.advance(1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    summary = summarize(rows)
    meta = {"target": args.target, "source": args.source, "method": args.method,
            "mapper": ctx._ready()[1].artifact_id if hasattr(ctx._ready()[1], "artifact_id") else args.method,
            "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", "")}
    stem = f"-{args.tag}" if args.tag else ""
    (args.out / f"summary{stem}.json").write_text(json.dumps({"meta": meta, "by_length": summary}, indent=1) + "\n")
    (args.out / f"README{stem}.md").write_text(render(summary, meta))
    print((args.out / f"README{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
