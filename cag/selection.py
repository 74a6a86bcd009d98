"""Choosing the crux: which context tokens the target recomputes, chosen *outside* the target.

"Translate the bulk, prefill the crux" (#9): a translated cache's keys mislead
the target's own attention (`recompute_select="question"` looks straight
through them), so the choice is made where attention can be trusted.

- **source** (CacheClip's idea): the store's source model reads its *own* chunk
  caches natively; its question attention says where the answer is. Raw mass
  favours the chunk nearest the question (measured: it held the answer 2 of 15
  times against the retriever's 10), so the score is **contrastive**: the
  question's mass minus a neutral question's over the same placed chunks, which
  cancels the positional prior and the sink-like tokens every question looks at.
- **retriever**: sentence embeddings of each sentence against the question (the
  store's own embedder): the cheapest baseline, no model forward at all.

Both score *sentences* (a fact is a span: a name's first piece draws the
attention, the rest must be right too) and pick the best until the budget of
target tokens is spent. Spans are character ranges of each chunk's text, so
they carry over to any tokenizer: `spans_to_positions` finds the target tokens
that overlap them.

The ``*_chunk`` variants choose whole **chunks** instead ("prefill the crux"): the
best chunks by the same score (a chunk's best sentence for the source model, the
index's own score for the retriever), whole, while they fit in the budget, and
always at least the best one. A fact and the sentences that name its subject then
come back together, recomputed in context, the way a scratch probe found that one
native chunk among translated ones answers (6 of 9 essay questions, against 4 of 9
with all four chunks native).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from cag.kv import KVChunk

NEUTRAL_QUESTION = "What is this text about?"
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+[\"')\]]*|\n|$)")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of `text`'s sentences (newlines end sentences too); whitespace trimmed."""
    spans = []
    for m in _SENTENCE.finditer(text):
        start, end = m.start(), m.end()
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return spans


def _token_sentences(chunk: KVChunk, spans: list[tuple[int, int]]) -> list[list[int]]:
    """For each sentence span, the chunk's token indices that overlap it."""
    offsets = chunk.offsets.tolist()
    return [[j for j, (s, e) in enumerate(offsets) if s < end and e > start] for start, end in spans]


def _pick(scored: list[tuple[float, int, int]], sizes: dict[tuple[int, int], int],
          budget: int) -> dict[tuple[int, int], int]:
    """Best-scoring (chunk, sentence) pairs within `budget` target tokens → tokens taken of each.

    Whole sentences while they fit; the best sentence that does not fit any more is
    taken in part (its first tokens) to fill the budget, then the choice stops.
    """
    chosen, used = {}, 0
    for _, c, s in sorted(scored, key=lambda x: -x[0]):
        size = sizes[(c, s)]
        if size == 0:
            continue
        if used + size > budget:
            if budget - used > 0:
                chosen[(c, s)] = budget - used
            break
        chosen[(c, s)] = size
        used += size
    return chosen


def spans_to_positions(target_chunks: Sequence[KVChunk], spans: Sequence[Sequence[tuple[int, int]]],
                       n_prefix: int) -> torch.Tensor:
    """Placed positions of the target tokens overlapping `spans` (per chunk, character ranges)."""
    out, start = [], n_prefix
    for chunk, chunk_spans in zip(target_chunks, spans):
        for idx in _token_sentences(chunk, list(chunk_spans)):
            out.extend(start + j for j in idx)
        start += chunk.num_tokens
    return torch.tensor(sorted(set(out)), dtype=torch.long)


def _choose(target_chunks, texts, sentence_scores, budget_tokens) -> list[list[tuple[int, int]]]:
    spans = [sentence_spans(t) for t in texts]
    tokens = {(c, s): idx for c, chunk in enumerate(target_chunks)
              for s, idx in enumerate(_token_sentences(chunk, spans[c]))}
    scored = [(sentence_scores[c][s], c, s) for c in range(len(texts)) for s in range(len(spans[c]))]
    chosen = _pick(scored, {k: len(v) for k, v in tokens.items()}, budget_tokens)
    out = []
    for c, chunk in enumerate(target_chunks):
        mine = []
        for s, (start, end) in enumerate(spans[c]):
            take = chosen.get((c, s), 0)
            if take:  # a partial sentence ends where its last taken token ends
                last = tokens[(c, s)][take - 1]
                mine.append((start, min(end, int(chunk.offsets[last, 1]))))
        out.append(mine)
    return out


def _source_sentence_scores(source_assembler, source_chunks: Sequence[KVChunk], texts: Sequence[str],
                            question: str) -> list[list[float]]:
    """Per chunk, per sentence: the contrastive source attention of its strongest tokens."""
    q_ids = source_assembler.question_ids(question)
    n_ids = source_assembler.question_ids(NEUTRAL_QUESTION)
    contrast = (source_assembler.context_attention(source_chunks, q_ids)
                - source_assembler.context_attention(source_chunks, n_ids))
    scores, start = [], source_assembler.prefix_ids.numel()
    for chunk, text in zip(source_chunks, texts):
        token_score = contrast[start:start + chunk.num_tokens]
        start += chunk.num_tokens
        per_sentence = []
        for idx in _token_sentences(chunk, sentence_spans(text)):
            # The sentence's strongest tokens: a fact draws attention on a few of its pieces.
            vals = token_score[idx] if idx else torch.zeros(1)
            per_sentence.append(float(vals.topk(min(3, vals.numel())).values.mean()))
        scores.append(per_sentence)
    return scores


@torch.inference_mode()
def source_guided_spans(source_assembler, source_chunks: Sequence[KVChunk], target_chunks: Sequence[KVChunk],
                        texts: Sequence[str], question: str, budget_tokens: int) -> list[list[tuple[int, int]]]:
    """Sentences the source model's contrastive question attention points at (see module doc).

    `source_assembler` is an `Assembler` of the source model (its own layout and head);
    `source_chunks` are the store's chunks as stored, `target_chunks` their translations
    (for the budget, counted in target tokens).
    """
    scores = _source_sentence_scores(source_assembler, source_chunks, texts, question)
    return _choose(target_chunks, texts, scores, budget_tokens)


def _whole_chunks(target_chunks, texts, chunk_scores, budget_tokens) -> list[list[tuple[int, int]]]:
    """The best chunks, whole, while they fit in `budget_tokens`; at least the best one."""
    chosen, used = set(), 0
    for c in sorted(range(len(texts)), key=lambda c: -chunk_scores[c]):
        size = target_chunks[c].num_tokens
        if chosen and used + size > budget_tokens:
            break
        chosen.add(c)
        used += size
    return [[(0, len(t))] if c in chosen and t else [] for c, t in enumerate(texts)]


@torch.inference_mode()
def source_guided_chunks(source_assembler, source_chunks: Sequence[KVChunk], target_chunks: Sequence[KVChunk],
                         texts: Sequence[str], question: str, budget_tokens: int) -> list[list[tuple[int, int]]]:
    """Whole chunks ranked by their best sentence's contrastive source attention."""
    scores = _source_sentence_scores(source_assembler, source_chunks, texts, question)
    return _whole_chunks(target_chunks, texts, [max(s, default=float("-inf")) for s in scores], budget_tokens)


def retriever_chunks(hit_scores: Sequence[float], target_chunks: Sequence[KVChunk], texts: Sequence[str],
                     budget_tokens: int) -> list[list[tuple[int, int]]]:
    """Whole chunks in the retriever's order (its own similarity scores): no model forward."""
    return _whole_chunks(target_chunks, texts, list(hit_scores), budget_tokens)


def retriever_spans(embed: Callable[[list[str]], torch.Tensor], target_chunks: Sequence[KVChunk],
                    texts: Sequence[str], question: str, budget_tokens: int) -> list[list[tuple[int, int]]]:
    """Sentences most similar to the question by sentence embedding (the store's embedder)."""
    spans = [sentence_spans(t) for t in texts]
    sentences = [t[s:e] for t, sp in zip(texts, spans) for s, e in sp]
    if not sentences:
        return [[] for _ in texts]
    vectors = torch.as_tensor(embed([question] + sentences), dtype=torch.float32)
    vectors = torch.nn.functional.normalize(vectors, dim=-1)
    sims = (vectors[1:] @ vectors[0]).tolist()
    scores, k = [], 0
    for sp in spans:
        scores.append(sims[k:k + len(sp)])
        k += len(sp)
    return _choose(target_chunks, texts, scores, budget_tokens)
