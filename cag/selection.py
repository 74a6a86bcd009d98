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
- **source_retriever**: both, by reciprocal rank fusion of their sentence rankings.

Both score *sentences* (a fact is a span: a name's first piece draws the
attention, the rest must be right too) and pick the best until the budget of
target tokens is spent. Spans are character ranges of each chunk's text, so
they carry over to any tokenizer: `spans_to_positions` finds the target tokens
that overlap them.

Not every head of the source model looks things up: most attend by position or to
the sink. `eval/calibrate_source_heads.py` finds, on calibration lookups, the heads
whose contrastive attention lands on the sentence that holds the answer, and writes
them to ``cag/source_heads.json`` keyed by the source model's weight fingerprint;
the source score then averages those heads only (all heads for a model never
calibrated).

**Focus** (`focus`) uses the retriever's sentence scores the other way round: a plain
translated path (no recompute) reads only the chunks whose best sentence is most similar
to the question, within a budget of target tokens. Translated keys lose a lookup as the
context grows, because the other chunks' keys drown the answer's (README, "Focus"). Leaving
those chunks out removes their attention mass; damping their keys did not. The budget is
calibrated per target (`focus_tokens`).

The ``*_chunk`` variants choose whole **chunks** instead ("prefill the crux"): the
best chunks by the same score (a chunk's best sentence for the source model, the
index's own score for the retriever), whole, while they fit in the budget, and
always at least the best one. A fact and the sentences that name its subject then
come back together, recomputed in context, the way a scratch probe found that one
native chunk among translated ones answers (6 of 9 essay questions, against 4 of 9
with all four chunks native).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from cag.kv import KVChunk
from stores.chunker import sentence_spans  # the index embeds the same sentences at build

NEUTRAL_QUESTION = "What is this text about?"
# The plain translated path's context budget in target tokens per target, keyed by its weight fingerprint
# (`CachedContext.translated_focus_tokens`; 0 reads every chunk): chosen on calibration code needles at 1K/2K/4K
# in held-out lab essays (eval/results/focus/README.md). A target with no entry reads every chunk.
FOCUS_FILE = Path(__file__).with_name("focus_tokens.json")
HEADS_FILE = Path(__file__).with_name("source_heads.json")


@lru_cache(maxsize=None)
def _json_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def focus_tokens(fingerprint_id: str, path: Path | None = None) -> int:
    """The calibrated focus budget of a target (`FOCUS_FILE`); 0, every chunk, where none was calibrated."""
    entry = _json_file(path or FOCUS_FILE).get(fingerprint_id)
    return int(entry["tokens"]) if entry else 0


def retrieval_heads(fingerprint_id: str, path: Path | None = None) -> list[tuple[int, int]] | None:
    """The (layer, head) pairs calibrated to look up facts for this source model, or None (all heads)."""
    entry = _json_file(path or HEADS_FILE).get(fingerprint_id)
    if not entry or not entry.get("heads"):
        return None
    return [(int(layer), int(head)) for layer, head in entry["heads"]]


def _token_sentences(chunk: KVChunk, spans: list[tuple[int, int]]) -> list[list[int]]:
    """For each sentence span, the chunk's token indices that overlap it."""
    if not spans:
        return []
    bounds = torch.tensor(spans, dtype=chunk.offsets.dtype)  # [sentences, 2]
    overlap = (chunk.offsets[None, :, 0] < bounds[:, 1:]) & (chunk.offsets[None, :, 1] > bounds[:, :1])
    return [row.nonzero().squeeze(1).tolist() for row in overlap]


def _pick(scored: list[tuple[float, int, int]], sizes: dict[tuple[int, int], int],
          budget: int) -> dict[tuple[int, int], int]:
    """Best-scoring (chunk, sentence) pairs within `budget` target tokens → tokens taken of each.

    Whole sentences while they fit; the best sentence that does not fit any more is
    taken in part (its first tokens) to fill the budget, then the choice stops. The
    best sentence is always taken whole, even past a budget smaller than it: in a short
    context 20% can be less than one sentence, and its first tokens alone cut the answer
    off at its end (a name recomputed half, "Oskarine" without "Thrupp", came back garbled).
    """
    chosen, used = {}, 0
    for _, c, s in sorted(scored, key=lambda x: -x[0]):
        size = sizes[(c, s)]
        if size == 0:
            continue
        if used + size > budget:
            if not chosen and budget > 0:  # the best sentence, whole
                chosen[(c, s)] = size
            elif budget - used > 0:
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


def contrastive_attention(source_assembler, source_chunks: Sequence[KVChunk], question: str,
                          heads: Sequence[tuple[int, int]] | None = None, per_head: bool = False) -> torch.Tensor:
    """The question's attention on each placed position minus a neutral question's.

    ``[positions]``, averaged over `heads` (every head when None), or ``[layers, heads,
    positions]`` with `per_head` (for calibrating which heads to keep)."""
    q_ids = source_assembler.question_ids(question)
    n_ids = source_assembler.question_ids(NEUTRAL_QUESTION)
    # One placement for both questions; with `heads`, only the layers up to the deepest run
    # (retrieval heads sit mid-model) and only those heads' scores are computed.
    asked, neutral = source_assembler.heads_attention(source_chunks, [q_ids, n_ids],
                                                      None if per_head else heads)
    contrast = asked - neutral
    if per_head:
        return contrast
    return contrast.mean(dim=(0, 1)) if heads is None else contrast.mean(dim=0)


def _source_sentence_scores(source_assembler, source_chunks: Sequence[KVChunk], texts: Sequence[str],
                            question: str, heads: Sequence[tuple[int, int]] | None = None) -> list[list[float]]:
    """Per chunk, per sentence: the contrastive source attention of its strongest tokens."""
    contrast = contrastive_attention(source_assembler, source_chunks, question, heads)
    return sentence_scores(contrast, source_chunks, texts, source_assembler.prefix_ids.numel())


def sentence_scores(token_scores: torch.Tensor, chunks: Sequence[KVChunk], texts: Sequence[str],
                    start: int) -> list[list[float]]:
    """Per chunk, per sentence: the mean of its 3 best token scores (`token_scores` over placed positions,
    the chunks starting at `start`)."""
    scores = []
    for chunk, text in zip(chunks, texts):
        token_score = token_scores[start:start + chunk.num_tokens]
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
                        texts: Sequence[str], question: str, budget_tokens: int,
                        heads: Sequence[tuple[int, int]] | None = None) -> list[list[tuple[int, int]]]:
    """Sentences the source model's contrastive question attention points at (see module doc).

    `source_assembler` is an `Assembler` of the source model (its own layout and head);
    `source_chunks` are the store's chunks as stored, `target_chunks` their translations
    (for the budget, counted in target tokens); `heads` the source's retrieval heads (None: all).
    """
    scores = _source_sentence_scores(source_assembler, source_chunks, texts, question, heads)
    return _choose(target_chunks, texts, scores, budget_tokens)


def best_within(sizes: Sequence[int], chunk_scores: Sequence[float], budget_tokens: int) -> list[int]:
    """Indices of the best-scoring chunks while their `sizes` fit in `budget_tokens`, in their given order;
    at least the best one. Ties keep the given order."""
    chosen, used = set(), 0
    for c in sorted(range(len(sizes)), key=lambda c: -chunk_scores[c]):
        if chosen and used + sizes[c] > budget_tokens:
            break
        chosen.add(c)
        used += sizes[c]
    return sorted(chosen)


def _whole_chunks(target_chunks, texts, chunk_scores, budget_tokens) -> list[list[tuple[int, int]]]:
    """The best chunks, whole, while they fit in `budget_tokens`; at least the best one."""
    chosen = set(best_within([c.num_tokens for c in target_chunks], chunk_scores, budget_tokens))
    return [[(0, len(t))] if c in chosen and t else [] for c, t in enumerate(texts)]


def focus(embed: Callable[[list[str]], torch.Tensor], texts: Sequence[str], sizes: Sequence[int], question: str,
          budget_tokens: int, sentence_vectors: Sequence[np.ndarray | None] | None = None) -> list[int]:
    """The chunks a plain translated path reads when `texts` exceed `budget_tokens` (`sizes`: their target
    tokens): those whose best sentence is most similar to the question, while they fit, in their given order.
    All of them when they fit already (no embedding call)."""
    if sum(sizes) <= budget_tokens:
        return list(range(len(texts)))
    scores = retriever_sentence_scores(embed, texts, question, sentence_vectors)
    return best_within(sizes, [max(s, default=float("-inf")) for s in scores], budget_tokens)


@torch.inference_mode()
def source_guided_chunks(source_assembler, source_chunks: Sequence[KVChunk], target_chunks: Sequence[KVChunk],
                         texts: Sequence[str], question: str, budget_tokens: int,
                         heads: Sequence[tuple[int, int]] | None = None) -> list[list[tuple[int, int]]]:
    """Whole chunks ranked by their best sentence's contrastive source attention."""
    scores = _source_sentence_scores(source_assembler, source_chunks, texts, question, heads)
    return _whole_chunks(target_chunks, texts, [max(s, default=float("-inf")) for s in scores], budget_tokens)


def retriever_chunks(hit_scores: Sequence[float], target_chunks: Sequence[KVChunk], texts: Sequence[str],
                     budget_tokens: int) -> list[list[tuple[int, int]]]:
    """Whole chunks in the retriever's order (its own similarity scores): no model forward."""
    return _whole_chunks(target_chunks, texts, list(hit_scores), budget_tokens)


def retriever_spans(embed: Callable[[list[str]], torch.Tensor], target_chunks: Sequence[KVChunk],
                    texts: Sequence[str], question: str, budget_tokens: int,
                    sentence_vectors: Sequence[np.ndarray | None] | None = None) -> list[list[tuple[int, int]]]:
    """Sentences most similar to the question by sentence embedding (the store's embedder).

    `sentence_vectors`: per chunk, its sentences' unit vectors embedded at build
    (`stores.index.VectorIndex.sentence_vectors`), or None where it has none; only the
    question and the sentences without vectors are embedded now."""
    return _choose(target_chunks, texts, retriever_sentence_scores(embed, texts, question, sentence_vectors),
                   budget_tokens)


# Reciprocal rank fusion's constant (Cormack, Clarke and Büttcher, SIGIR 2009), as published: not tuned here.
RRF_K = 60


def fused_sentence_scores(*rankings: list[list[float]]) -> list[list[float]]:
    """Reciprocal rank fusion of per-chunk, per-sentence scores: each sentence gets
    ``Σ 1 / (RRF_K + rank)`` over the rankings (rank 1 = best over every chunk's sentences).

    Ranks, not raw values: attention contrasts and cosine similarities live on
    unrelated scales, and a sentence both choices rank high beats one that only one does."""
    shape = [len(r) for r in rankings[0]]
    fused = [[0.0] * n for n in shape]
    for ranking in rankings:
        if [len(r) for r in ranking] != shape:
            raise ValueError("rankings over different sentences")
        flat = sorted(((v, c, s) for c, row in enumerate(ranking) for s, v in enumerate(row)), key=lambda x: -x[0])
        for rank, (_, c, s) in enumerate(flat, start=1):
            fused[c][s] += 1.0 / (RRF_K + rank)
    return fused


@torch.inference_mode()
def source_retriever_spans(source_assembler, source_chunks: Sequence[KVChunk], target_chunks: Sequence[KVChunk],
                           texts: Sequence[str], question: str, budget_tokens: int,
                           embed: Callable[[list[str]], torch.Tensor],
                           sentence_vectors: Sequence[np.ndarray | None] | None = None,
                           heads: Sequence[tuple[int, int]] | None = None) -> list[list[tuple[int, int]]]:
    """Sentences ranked by both choices at once (`fused_sentence_scores` of the source model's
    contrastive attention and the retriever's similarity): #12's "combination of both"."""
    source = _source_sentence_scores(source_assembler, source_chunks, texts, question, heads)
    retriever = retriever_sentence_scores(embed, texts, question, sentence_vectors)
    return _choose(target_chunks, texts, fused_sentence_scores(source, retriever), budget_tokens)


def best_sentences(texts: Sequence[str], scores: Sequence[Sequence[float]], k: int, *,
                   wrapped: bool = False) -> list[list[tuple[int, int]]]:
    """Per chunk, the character spans (`sentence_spans`) of the `k` best-scored sentences over all chunks.

    `wrapped`: each is widened to the whole sentence its line belongs to (`wrapped_sentence`). `sentence_spans`
    ends a sentence at every newline, as the index embeds them, so in hard-wrapped text ("...a company called\n
    Cybercash,\nsince...") the best-scored piece is a line, and the fact often stands on the next one."""
    flat = sorted(((v, c, s) for c, row in enumerate(scores) for s, v in enumerate(row)), key=lambda x: -x[0])
    chosen = {(c, s) for _, c, s in flat[:k]}
    out = []
    for c, text in enumerate(texts):
        spans = sentence_spans(text)
        mine = [s for s in range(len(spans)) if (c, s) in chosen]
        out.append([wrapped_sentence(text, spans, s) if wrapped else spans[s] for s in mine])
    return out


_ENDS_SENTENCE = re.compile(r"[.!?][\"')\]]*$")


def wrapped_sentence(text: str, spans: Sequence[tuple[int, int]], s: int) -> tuple[int, int]:
    """The span of `spans[s]` joined with its neighbours across line wraps: a piece that does not end in
    sentence punctuation goes on with the next when only one newline lies between them (a blank line is a
    paragraph's end)."""
    def joined(i: int) -> bool:  # spans[i] goes on with spans[i + 1]
        a, b = spans[i][1], spans[i + 1][0]
        return not _ENDS_SENTENCE.search(text[spans[i][0]:a]) and text.count("\n", a, b) == 1
    first, last = s, s
    while first > 0 and joined(first - 1):
        first -= 1
    while last + 1 < len(spans) and joined(last):
        last += 1
    return spans[first][0], spans[last][1]


def retriever_sentence_scores(embed: Callable[[list[str]], torch.Tensor], texts: Sequence[str], question: str,
                              sentence_vectors: Sequence[np.ndarray | None] | None = None) -> list[list[float]]:
    """Per chunk, per sentence: the cosine similarity of its embedding to the question's."""
    spans = [sentence_spans(t) for t in texts]
    if not any(spans):
        return [[] for _ in texts]  # nothing to rank: no embedding call
    given = list(sentence_vectors) if sentence_vectors is not None else [None] * len(texts)
    # Vectors from the index count only if they are the same sentences (same split, same count).
    given = [v if v is not None and len(v) == len(sp) else None for v, sp in zip(given, spans)]
    missing = [t[s:e] for t, sp, v in zip(texts, spans, given) if v is None for s, e in sp]
    fresh = torch.nn.functional.normalize(torch.as_tensor(embed([question] + missing), dtype=torch.float32), dim=-1)
    q, fresh = fresh[0], fresh[1:]
    scores, k = [], 0
    for sp, v in zip(spans, given):
        if v is None:
            vectors, k = fresh[k:k + len(sp)], k + len(sp)
        else:
            vectors = torch.nn.functional.normalize(torch.as_tensor(v, dtype=torch.float32), dim=-1)
        scores.append((vectors @ q).tolist())
    return scores
