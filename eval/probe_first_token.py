"""Where the translated path's first answer token goes wrong, and whether the context's words would right it.

    python eval/probe_first_token.py --target qwen2.5-0.5b \\
        --stores eval/results/copy_prior/qwen-text-stop-code --out eval/results/first_token/qwen

The copy prior (`cag.copy_prior`) copies once an answer has begun; its first token is the model's alone, and on
the codes and needles that is where the translated path fails ("10" for 38.246.37). An answer copied from the
context starts at the start of one of its words. This probe asks, on the gate's calibration items only, how the
gold answer's first token ranks under the translated path's first-token distribution:

- over the whole vocabulary (rank 1: greedy decoding starts right);
- among the tokens that spell the start of a word of the placed chunks (an extractive first token);
- among those of the retriever's best `--top-sentences` sentences (by the store's embedder, as
  `recompute_select="retriever"` ranks them).

A restriction can only help where the gold's first token is in its set and outranks the model's choice there.
Rows go to OUT/rows.jsonl as they finish (a stopped run resumes); OUT/summary.md counts rank 1 under each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cag.context import CachedContext  # noqa: E402
from cag.copy_prior import _spellings  # noqa: E402
from cag.generate import last_logits  # noqa: E402
from cag.progress import Progress  # noqa: E402
from cag.selection import retriever_sentence_scores  # noqa: E402
from eval.calibrate_copy_prior import PARTS, append_row, part_items, part_store, read_rows  # noqa: E402
from eval.harness import ItemRunner, host_info  # noqa: E402
from stores.chunker import sentence_spans  # noqa: E402


def word_start_tokens(texts: list[str], vocab: dict[str, int], longest: int) -> set[int]:
    """The longest vocabulary token spelling the start of each whitespace-delimited word of `texts`."""
    found = set()
    for text in texts:
        for i, ch in enumerate(text):
            if ch.isspace() or (i > 0 and not text[i - 1].isspace()):
                continue
            rest = text[i:i + longest]
            for k in range(len(rest), 0, -1):
                if rest[:k] in vocab:
                    found.add(vocab[rest[:k]])
                    break
    return found


def rank_within(logits: torch.Tensor, token: int, allowed: set[int] | None) -> int | None:
    """1 + the number of allowed tokens the model prefers to `token`; None if `token` is not allowed."""
    if allowed is not None and token not in allowed:
        return None
    better = logits > logits[token]
    if allowed is not None:
        mask = torch.zeros_like(better)
        mask[torch.tensor(sorted(allowed))] = True
        better &= mask
    return 1 + int(better.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="smollm2-135m")
    ap.add_argument("--target", default="qwen2.5-0.5b")
    ap.add_argument("--method", default="bottleneck")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--top-sentences", type=int, default=3)
    ap.add_argument("--stores", type=Path, help="a calibrate_copy_prior.py OUT whose store-<part> folders to reuse")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = {(r["part"], r["item"]): r for r in read_rows(rows_path)}
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": host_info().get("cpu", ""), "target": args.target, "method": args.method,
            "top_sentences": args.top_sentences}
    for part in args.parts:
        items = part_items(part)
        store = part_store(part, items, args.source, args.stores, args.out)
        settings = dict(store=store, target=args.target, top_k=4, max_new_tokens=16, translation_cache_mb=0)
        ctx = CachedContext(mapper=args.method, **settings)
        runner = ItemRunner(CachedContext(mapper="identity", **settings), {args.method: ctx}, max_new_tokens=16)
        lm = runner.lm
        vocab, longest = _spellings(lm.tokenizer)
        meta["artifact"] = getattr(ctx.active_mapper, "artifact_id", args.method)
        embed = ctx._current_view()[1].embed  # the store's embedder, as the retriever selection uses it
        with Progress(f"first token: {part}", total=len(items), unit="items", interval_s=20) as bar:
            for item in items:
                if (part, item.id) in done:
                    bar.advance(1)
                    continue
                hits = runner.hits_for(item)
                texts = [h.text for h in hits]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run = runner._cached_run(ctx, item, hits)
                    logits = run.first_logits if run.first_logits is not None else \
                        last_logits(lm.model, run.question_ids[None], run.cache)[-1]
                logits = logits.float().reshape(-1)
                gold = int(runner.gold_ids(item.answers[0])[0])
                scores = retriever_sentence_scores(embed, texts, item.question)
                ranked = sorted(((s, c, j) for c, row in enumerate(scores) for j, s in enumerate(row)), reverse=True)
                spans = [sentence_spans(t) for t in texts]
                top = [texts[c][slice(*spans[c][j])] for _, c, j in ranked[:args.top_sentences]]
                in_context, in_top = word_start_tokens(texts, vocab, longest), word_start_tokens(top, vocab, longest)
                choice = int(logits.argmax())
                row = {"part": part, "item": item.id, "answer": item.answers[0],
                       "gold_first": lm.tokenizer.decode([gold]), "model_first": lm.tokenizer.decode([choice]),
                       "rank": rank_within(logits, gold, None),
                       "rank_context_words": rank_within(logits, gold, in_context),
                       "rank_top_sentences": rank_within(logits, gold, in_top),
                       "context_words": len(in_context), "top_sentence_words": len(in_top)}
                append_row(rows_path, row)
                done[(part, item.id)] = row
                bar.advance(1)
    lines = [f"# The translated path's first answer token ({args.target}, {args.method} {meta.get('artifact', '')})",
             "", f"`{meta['command']}`", "", f"{meta['date']}, {meta['host']}. Rank 1: greedy decoding starts with "
             "the gold answer's first token, over the vocabulary or restricted to the set named.", "",
             "| part | n | rank 1 (vocabulary) | gold starts a context word | rank 1 among context words | "
             f"gold starts a word of the top {args.top_sentences} sentences | rank 1 among those |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    summary = []
    for part in args.parts:
        rows = [r for r in done.values() if r["part"] == part]
        s = {"part": part, "n": len(rows), "rank1": sum(r["rank"] == 1 for r in rows),
             "in_context": sum(r["rank_context_words"] is not None for r in rows),
             "rank1_context": sum(r["rank_context_words"] == 1 for r in rows),
             "in_top": sum(r["rank_top_sentences"] is not None for r in rows),
             "rank1_top": sum(r["rank_top_sentences"] == 1 for r in rows)}
        summary.append(s)
        lines.append(f"| {part} | {s['n']} | {s['rank1']} | {s['in_context']} | {s['rank1_context']} | "
                     f"{s['in_top']} | {s['rank1_top']} |")
    (args.out / "summary.json").write_text(json.dumps({"run": meta, "table": summary}, indent=1) + "\n")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
