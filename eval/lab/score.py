"""Scoring a translation variant on the lab's held-out lookup items, through the frozen target.

For each item (one needle planted in a held-out calibration essay window, one
chunk of about 1K target tokens) three caches are placed behind the target's
prompt head with the project's own `Assembler`: the variant's translation, the
target's native chunk cache (the ceiling: what a translation can at best
reproduce) and no context (the floor). For each:

- **lookup**: greedy answer → found (gold in the answer) and token F1; the gold
  answer's mean log-likelihood, teacher-forced;
- **KL** (native ‖ variant) of the next-token distributions over the gold answer;
- **attention diagnostics**, per target layer: the share of the question's
  attention (mean over heads and question tokens) that lands on the answer's own
  tokens in the context, on the prompt head, and on the rest of the context.
  Where translated keys fail, the answer's share collapses toward its share of
  tokens (the question "looks straight through" the context).

Native and no-context results do not depend on the variant; they are computed
once per item and kept in ``baseline.json`` beside the results.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from cag.assembler import Assembler
from cag.generate import generate, last_logits, stop_token_ids
from cag.kv import KVChunk
from cag.prompt import layout_for
from eval import metrics
from eval.lab import data


def load_item(path: Path) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    meta = data.load_meta(path)
    tensors.update({k: json.loads(v) for k, v in meta.items()})
    return tensors


def answer_token_span(item: dict) -> tuple[int, int] | None:
    """Target token indices [start, end) of the first occurrence of the gold answer in the context."""
    text, offsets = item["text"], item["offsets"]
    for answer in item["answers"]:
        at = text.find(answer)
        if at >= 0:
            inside = ((offsets[:, 1] > at) & (offsets[:, 0] < at + len(answer))).nonzero().flatten()
            if inside.numel():
                return int(inside.min()), int(inside.max()) + 1
    return None


class Scorer:
    def __init__(self, target) -> None:
        self.target = target
        self.asm = Assembler(target, layout_for(target.tokenizer))
        self.stops = stop_token_ids(target.tokenizer)

    def chunk(self, item: dict, keys: torch.Tensor, values: torch.Tensor) -> KVChunk:
        return KVChunk(keys.float(), values.float(), item["token_ids"], item["offsets"], item["text_hash"],
                       self.target.fingerprint, self.target.chunk_settings())

    def gold(self, item: dict) -> torch.Tensor:
        answer = item["answers"][0]
        return self.target.tokenize(answer if self.asm.layout.chat else " " + answer)[0]

    @torch.inference_mode()
    def condition(self, item: dict, chunk: KVChunk | None, reference: torch.Tensor | None = None,
                  max_new_tokens: int = 16, diagnose: bool = True) -> dict:
        lm = self.target
        placed = self.asm.place([chunk] if chunk is not None else [])
        q = self.asm.question_ids(item["question"])
        gold = self.gold(item)
        ids = torch.cat([q, gold[:-1]])
        logp = torch.log_softmax(last_logits(lm.model, ids[None], copy.deepcopy(placed.cache),
                                             positions=gold.numel()).float(), -1)
        out = {"gold_ll": metrics.gold_log_likelihood(logp, gold)}
        if reference is not None:
            out["kl_native"] = metrics.kl_divergence(reference, logp)
        if diagnose and chunk is not None:
            out["attention"] = self.attention(item, placed, q)
        gen = generate(lm.model, lm.tokenizer, copy.deepcopy(placed.cache), q, max_new_tokens=max_new_tokens,
                       stop_ids=self.stops)
        out.update({"answer": gen.text.strip(), "found": metrics.contains_answer(gen.text, item["answers"]),
                    "f1": metrics.token_f1(gen.text, item["answers"])})
        return out, logp

    def attention(self, item: dict, placed, q: torch.Tensor) -> dict:
        """Per layer: the question's attention share on the answer span, the head, the rest."""
        att = question_attentions(self.target.model, placed, q)
        n_prefix = placed.prefix_tokens
        span = answer_token_span(item)
        answer, head, rest = [], [], []
        for a in att:
            a = a[0].float().mean(0)                            # [Tq, total]: mean over heads
            ctx = a[:, n_prefix:placed.context_ids.numel()]
            head.append(float(a[:, :n_prefix].sum(-1).mean()))
            if span is not None:
                ans = float(ctx[:, span[0]:span[1]].sum(-1).mean())
            else:
                ans = float("nan")
            answer.append(ans)
            rest.append(float(ctx.sum(-1).mean()) - (ans if span is not None else 0.0))
        share = (span[1] - span[0]) / max(1, placed.context_ids.numel() - n_prefix) if span else float("nan")
        return {"answer": answer, "head": head, "rest": rest, "answer_token_share": share}


def question_attentions(model, placed, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per layer ``[1, heads, Tq, total]``: the question's attention over a placed cache (a copy), computed
    eagerly (sdpa returns no weights), the model's attention implementation restored after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model.model(input_ids=q[None], past_key_values=copy.deepcopy(placed.cache), use_cache=True,
                           output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)


def baseline(scorer: Scorer, items: list[tuple[Path, dict]], folder: Path, max_new_tokens: int) -> dict:
    """Native and no-context results per item (cached: they do not depend on the variant)."""
    from cag.progress import Progress

    path = folder / "baseline.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    todo = [(p, item) for p, item in items if p.stem not in done]
    with Progress("lab baseline (native, no context)", total=len(items), completed=len(items) - len(todo),
                  unit="items", interval_s=20) as bar:
        for p, item in todo:
            native, _ = scorer.condition(item, scorer.chunk(item, item["native_keys"], item["native_values"]),
                                         max_new_tokens=max_new_tokens)
            none, _ = scorer.condition(item, None, max_new_tokens=max_new_tokens, diagnose=False)
            done[p.stem] = {"native": native, "no_context": none}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(done, indent=1))
            bar.advance(1)
    return done


def native_log_probs(scorer: Scorer, item: dict, path: Path) -> torch.Tensor:
    """The native cache's log-probs over the gold answer (the KL reference), cached per item."""
    from safetensors.torch import load_file, save_file

    if path.exists():
        return load_file(str(path))["logp"]
    _, logp = scorer.condition(item, scorer.chunk(item, item["native_keys"], item["native_values"]),
                               max_new_tokens=1, diagnose=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"logp": logp.contiguous()}, str(path))
    return logp


def score_variant(variant, lab: Path, source, target, *, split: str, n: int, max_new_tokens: int) -> dict:
    from cag.progress import Progress

    from eval.translation_lab import RESULTS

    scorer = Scorer(target)
    paths = sorted((lab / "items" / split).glob("*.safetensors"))[:n]
    items = [(p, load_item(p)) for p in paths]
    folder = RESULTS / f"{source.name}__{target.name}"
    base = baseline(scorer, items, folder / f"baseline-{split}", max_new_tokens)
    per_item = []
    with Progress("lab score", total=len(items), unit="items", interval_s=20) as bar:
        for p, item in items:
            keys, values = variant.translate(item, target)
            ref = native_log_probs(scorer, item, folder / f"baseline-{split}" / f"{p.stem}.logp.safetensors")
            res, _ = scorer.condition(item, scorer.chunk(item, keys, values), reference=ref,
                                      max_new_tokens=max_new_tokens)
            per_item.append({"item": p.stem, **res, "native": base[p.stem]["native"],
                             "no_context": base[p.stem]["no_context"]})
            bar.advance(1)
    return summarize(per_item, split)


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(per_item: list[dict], split: str) -> dict:
    n = len(per_item)
    found = [r["found"] for r in per_item]
    native = [r["native"]["found"] for r in per_item]
    out = {"split": split, "n": n,
           "found": _mean(found), "native_found": _mean(native),
           "no_context_found": _mean(r["no_context"]["found"] for r in per_item),
           "f1": _mean(r["f1"] for r in per_item), "native_f1": _mean(r["native"]["f1"] for r in per_item),
           "gold_ll": _mean(r["gold_ll"] for r in per_item),
           "native_gold_ll": _mean(r["native"]["gold_ll"] for r in per_item),
           "no_context_gold_ll": _mean(r["no_context"]["gold_ll"] for r in per_item),
           "kl_native": _mean(r["kl_native"] for r in per_item)}
    out["found_vs_native"] = metrics.retention(found, native).to_dict() if sum(native) else None
    layers = len(per_item[0]["attention"]["answer"])
    for cond, get in (("variant", lambda r: r["attention"]), ("native", lambda r: r["native"]["attention"])):
        out[f"attention_{cond}"] = {
            part: [round(_mean(get(r)[part][i] for r in per_item), 4) for i in range(layers)]
            for part in ("answer", "head", "rest")}
    out["answer_token_share"] = _mean(r["attention"]["answer_token_share"] for r in per_item)
    out["items"] = per_item
    return out


def one_line(r: dict) -> str:
    return (f"{r['variant']}: found {r['found']:.2f} (native {r['native_found']:.2f}, none "
            f"{r['no_context_found']:.2f}), gold LL {r['gold_ll']:.2f} (native {r['native_gold_ll']:.2f}, none "
            f"{r['no_context_gold_ll']:.2f}), KL {r['kl_native']:.2f}, n={r['n']}")


def table(rows: list[dict], source: str, target: str) -> str:
    rows = sorted(rows, key=lambda r: r.get("date", ""))
    lines = [f"# Translation lab: {source} → {target}", "",
             "Held-out lookup items: a needle planted in a held-out calibration essay window (~1K target tokens, "
             "one chunk, `eval/lab/data.py`). found = gold answer in the greedy answer; gold LL = mean "
             "log-likelihood per gold token (teacher-forced); KL = KL(native ‖ variant) over the gold answer; "
             "attn = mean over layers of the question's attention share on the answer's tokens "
             "(native in brackets). Interval: paired bootstrap 95% of found/native found.", "",
             "| variant | n | found | native | none | found/native [95%] | gold LL | native LL | none LL | KL | attn answer | fit s | what |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ret = r.get("found_vs_native") or {}
        iv = f"{ret.get('value', 0):.2f} [{ret.get('low', 0):.2f}, {ret.get('high', 0):.2f}]" if ret else "–"
        att = _mean(r["attention_variant"]["answer"])
        natt = _mean(r["attention_native"]["answer"])
        lines.append(f"| {r['variant']} | {r['n']} | {r['found']:.2f} | {r['native_found']:.2f} | "
                     f"{r['no_context_found']:.2f} | {iv} | {r['gold_ll']:.2f} | {r['native_gold_ll']:.2f} | "
                     f"{r['no_context_gold_ll']:.2f} | {r['kl_native']:.2f} | {att:.3f} ({natt:.3f}) | "
                     f"{r.get('fit_s', 0):.0f} | {r.get('describe', '')} |")
    dates = sorted({r.get("date", "") for r in rows})
    cmds = sorted({r.get("command", "") for r in rows})
    lines += ["", f"Dates: {', '.join(dates)}. Commands: " + "; ".join(f"`{c}`" for c in cmds)]
    return "\n".join(lines) + "\n"
