"""Place target-space chunks behind a shared prefix and build the target's cache.

The assembled sequence is ``[head | chunk 1 | chunk 2 | ... ]`` at positions
0..N-1, followed by the question, which the target prefills against the cache.

- **Shared prefix.** The head of the prompt layout (chat-template opening, or
  BOS) is prefilled by the target once and kept; it is the attention sink for
  every chunk, whose own sink was dropped when the chunk was made.
- **Placement.** Chunk keys are stored without position and rotated here, at the
  positions where the chunks land; Gemma's sliding layers keep only what their
  window can see (the cache layer does that, from the true length).
- **Selective recompute** (CacheBlend). Chunks were prefilled (or translated)
  without seeing each other. With ``recompute_ratio=r`` the r·n context tokens
  whose cached K/V deviate most from a fresh computation at a check layer are
  recomputed by the target, attending to everything before them; r = 1 is the
  target's own prefill of the whole context (direct context), r = 0 costs nothing.
  With ``recompute_select="question"`` the tokens are those the question attends
  to most over the placed cache (a cheap pass of the question alone). On the
  target's own chunk caches this beat CacheBlend's choice; on translated caches
  it cannot, since it looks through the translated keys (see README).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cag.kv import KVChunk, text_sha256
from cag.models.adapters import concat_tokens
from cag.models.loaded import LoadedModel
from cag.models.prompt import PromptLayout
from cag.models.prompt import head_ids as prompt_head_ids


# How `place` chooses the tokens to recompute. "source" and "retriever" are chosen
# outside the target (cag.selection) and passed in as `positions`.
RECOMPUTE_SELECT = ("deviation", "question", "first_k", "source", "retriever", "source_retriever", "source_chunk",
                    "retriever_chunk")
GUIDED_SELECT = ("source", "retriever", "source_retriever", "source_chunk", "retriever_chunk")  # positions chosen outside the target


@dataclass
class Placed:
    """An assembled cache and what it stands for."""

    cache: DynamicCache
    context_ids: torch.Tensor  # head + chunk tokens, the ids the cache covers
    prefix_tokens: int
    recomputed_tokens: int
    assemble_s: float
    recompute_s: float
    # With `place(with_question=...)` and a recompute: the logits of the question's last token, read
    # in the recompute's forward; the cache then holds the question too. None: prefill the question.
    question_logits: torch.Tensor | None = None


class Assembler:
    """Assembles caches for one target model and one prompt layout."""

    def __init__(self, target: LoadedModel, layout: PromptLayout, *, check_layer: int = 1) -> None:
        self.target = target
        self.layout = layout
        self.check_layer = min(check_layer, target.adapter.num_layers - 1)
        # The head's first token is the sink; a head-less layout is BOS alone.
        head_ids = prompt_head_ids(target.tokenizer, layout)
        if head_ids.numel() == 0:
            head_ids = torch.tensor(target.sink_ids, dtype=torch.long)
        if head_ids.numel() == 0:
            raise ValueError(f"{target.name}: no prompt head and no sink token to hold the attention sink")
        self.prefix_ids = head_ids
        self._prefix: KVChunk | None = None
        self._lock = threading.Lock()
        # Forwards on one model are serialised: the recompute installs a hook on it.
        self.model_lock = threading.RLock()
        # Recomputed tokens attend in blocks of this many, each over the positions it can see
        # (`cag.models.attention.blocked_recompute`). The 4K crux's forward (819 tokens into Qwen2.5,
        # eval/bench_recompute_blocks.py, 2026-12-05): 6.31 s dense, 5.45 / 6.01 / 5.58 / 5.51 s in
        # blocks of 32 / 64 / 128 / 256, within this host's noise of each other; against the gather
        # per block it replaced, 5.72 s in blocks of 64 against 6.03 s (8 interleaved repeats). On an
        # Intel Xeon with AMX (2026-12-06, 614 tokens, 3 repeats): 0.85 s in blocks of 64 or 256, 0.94 s dense.
        self.recompute_block = 64

    # ------------------------------------------------------------------ parts

    def prefix(self) -> KVChunk:
        """The shared prefix chunk, prefilled by the target once."""
        with self._lock:
            if self._prefix is None:
                with self.model_lock:
                    self._prefix = self.target.prefill_tokens(
                        self.prefix_ids, sink_ids=[], text_hash=text_sha256(self.layout.head),
                        settings={"role": "prefix"})
            return self._prefix

    def question_ids(self, question: str) -> torch.Tensor:
        ids, _ = self.target.tokenize(self.layout.tail(question))
        return ids

    @torch.inference_mode()
    def direct_cache(self, chunk_token_ids: Sequence[torch.Tensor]) -> DynamicCache:
        """The target's own cache of the prompt head and the text, as direct context leaves it
        before the question: one cache-only forward (no LM head, no last MLP, what a cached
        path's recompute skips too). The caller holds `model_lock`."""
        cache = DynamicCache(config=self.target.model.config)
        ids = torch.cat([self.prefix_ids, *chunk_token_ids])
        self.target.forward_for_cache(cache, input_ids=ids[None].to(self.target.device))
        return cache

    def direct_ids(self, chunk_token_ids: Sequence[torch.Tensor], question: str) -> torch.Tensor:
        """The ids direct context prefills: the same head, context tokens and question."""
        return torch.cat([self.prefix_ids, *chunk_token_ids, self.question_ids(question)])

    # --------------------------------------------------------------- assembly

    def place(self, chunks: Sequence[KVChunk], *, recompute_ratio: float = 0.0,
              recompute_select: str = "deviation", question_ids: torch.Tensor | None = None,
              first_k: int = 0, positions: torch.Tensor | None = None,
              key_scales: Sequence[float] | None = None, with_question: torch.Tensor | None = None) -> Placed:
        """Build the cache of head + `chunks` (target-space), recomputing some tokens.

        `recompute_select`: which tokens are recomputed; ``"deviation"`` (CacheBlend:
        the r·n whose K/V differ most from a fresh computation at the check layer),
        ``"question"`` (the r·n the question attends to most, and their neighbours;
        needs `question_ids`), ``"first_k"`` (EPIC: the first `first_k` tokens of
        every chunk, whatever the ratio), or ``"source"`` / ``"retriever"``: the
        context `positions` chosen outside the target (`cag.selection`).

        `key_scales`: one factor per chunk, multiplying its keys in the finished cache
        (after any recompute, so the recomputed tokens were computed against the keys as
        stored). Below 1 the question's logits over that chunk flatten: its pull weakens
        (`CachedContext.rank_key_decay`). ``None``: every chunk as it is.

        `with_question`: the question's ids, run in the recompute's forward after the chosen
        tokens (one pass over the weights instead of two: at 4K into Qwen2.5 the separate
        question prefill was 0.155 s, most of it reading the weights). The cache comes back
        holding the question and `Placed.question_logits` holds its last token's logits, what a
        separate prefill of the question over the finished cache would give (it reads the keys
        as `key_scales` leave them). Only with a recompute (else the caller prefills the
        question) and only for the model's own attention: under a context temperature or
        scale the caller prefills the question itself.
        """
        if key_scales is not None and len(key_scales) != len(chunks):
            raise ValueError(f"key_scales has {len(key_scales)} factors for {len(chunks)} chunks")
        if key_scales is not None and any(not s > 0 for s in key_scales):
            raise ValueError(f"key scales must be > 0, got {list(key_scales)}")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if recompute_select not in RECOMPUTE_SELECT:
            raise ValueError(f"recompute_select must be one of {RECOMPUTE_SELECT}, got {recompute_select!r}")
        if recompute_select == "question" and recompute_ratio > 0 and question_ids is None:
            raise ValueError("question-guided recompute needs the question's ids")
        if recompute_select in GUIDED_SELECT and recompute_ratio > 0 and positions is None:
            raise ValueError(f"{recompute_select}-guided recompute needs the chosen positions")
        if recompute_select == "first_k" and first_k < 0:
            raise ValueError(f"first_k must be >= 0, got {first_k}")
        started = time.perf_counter()
        parts = [self.prefix(), *chunks]
        for chunk in chunks:
            self.target.check_chunk(chunk)
        adapter, dtype = self.target.adapter, self.target.dtype
        context_ids = torch.cat([c.token_ids for c in parts])
        total = context_ids.numel()
        n_prefix = parts[0].num_tokens
        given = None
        if recompute_select == "first_k":
            given = first_k_positions([c.num_tokens for c in chunks], n_prefix, first_k)
        elif recompute_select in GUIDED_SELECT:
            given = (torch.unique(positions.to(torch.long)) if positions is not None
                     else torch.zeros(0, dtype=torch.long))
            if given.numel() and (given.min() < n_prefix or given.max() >= total):
                raise ValueError(f"recompute positions must lie in the context [{n_prefix}, {total})")
        n_recompute = given.numel() if given is not None else round(recompute_ratio * (total - n_prefix))
        # Nothing to recompute: the caller prefills the question itself.
        n_question = with_question.numel() if with_question is not None and n_recompute else 0
        adapter.check_placement(total + n_question)
        # One buffer per kind for the whole sequence (and the question's room, zeros until the
        # forward writes it); keys are rotated in place in it.
        keys = concat_tokens([c.keys for c in parts], dtype, room=n_question)
        values = concat_tokens([c.values for c in parts], dtype, room=n_question)
        adapter.rotate(keys[:, :, :total], torch.arange(total), out=keys[:, :, :total])
        recompute_started = time.perf_counter()
        scaled = []  # (first, end, factor): the positions of each chunk whose keys `key_scales` scales
        start = n_prefix
        for chunk, f in zip(chunks, key_scales if key_scales is not None else [1.0] * len(chunks)):
            if f != 1.0:
                scaled.append((start, start + chunk.num_tokens, f))
            start += chunk.num_tokens
        question_key_scale = None  # what the question reads before the buffers are scaled, one factor a position
        if scaled and n_question:
            question_key_scale = torch.ones(total + n_question, dtype=torch.float32)
            for first, end, f in scaled:
                question_key_scale[first:end] = f
        question_logits = None
        if n_recompute:
            with self.model_lock:
                if given is not None:
                    chosen = given
                elif n_recompute >= total - n_prefix:
                    chosen = torch.arange(n_prefix, total)
                elif recompute_select == "question":
                    chosen = self._question_guided(keys[:, :, :total], values[:, :, :total], context_ids, n_prefix,
                                                   n_recompute, question_ids)
                else:
                    chosen = self._most_deviating(keys[:, :, :total], values[:, :, :total], context_ids, n_prefix,
                                                  n_recompute)
                question_logits = self._recompute(keys, values, context_ids, chosen,
                                                  question_ids=with_question if n_question else None,
                                                  question_key_scale=question_key_scale)
        recompute_s = time.perf_counter() - recompute_started
        # Rotation is linear: scaling the rotated keys scales the logits. In place, in inference
        # mode, since a recompute's keys are inference tensors (the buffer is this call's own).
        with torch.inference_mode():
            for first, end, f in scaled:
                keys[:, :, first:end].mul_(f)
        cache = adapter.fill_cache(keys, values)
        return Placed(cache, context_ids, n_prefix, n_recompute,
                      time.perf_counter() - started - recompute_s, recompute_s, question_logits)

    # ------------------------------------------------------ selective recompute

    def _fresh_kv(self, context_ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's own K/V of the whole context at `layer`, running only layers 0..layer."""
        cache = self.target.first_layers_cache(context_ids, layer + 1)
        return cache.layers[layer].keys[0], cache.layers[layer].values[0]

    @torch.inference_mode()
    def _most_deviating(self, keys, values, context_ids, n_prefix: int, n_recompute: int) -> torch.Tensor:
        """CacheBlend's choice: the context tokens whose K/V deviate most at the check layer."""
        fresh_k, fresh_v = self._fresh_kv(context_ids, self.check_layer)
        cached_k, cached_v = keys[self.check_layer], values[self.check_layer]
        deviation = ((fresh_k - cached_k).float().norm(dim=-1).sum(0)
                     + (fresh_v - cached_v).float().norm(dim=-1).sum(0))
        top = torch.topk(deviation[n_prefix:], n_recompute).indices + n_prefix
        return torch.sort(top).values

    @torch.inference_mode()
    def _question_guided(self, keys, values, context_ids, n_prefix: int, n_recompute: int,
                         question_ids: torch.Tensor) -> torch.Tensor:
        """The context tokens the question attends to most, spread to their neighbours.

        The question is run once over the placed cache (a throwaway copy) and its
        attention mass on each context token, averaged over layers, heads and
        question tokens, is smoothed over a window of 3 (a fact is a span of
        tokens: a name's first piece draws the attention, the rest must be
        right too). The choice is only as good as the placed keys: where they
        are translated and mislead the question, so does this (see README).
        """
        total = context_ids.numel()
        mass = self.question_mass(keys, values, total, question_ids)
        mass[:n_prefix] = 0.0  # the shared prefix is the sink: always native, never recomputed
        smooth = torch.nn.functional.max_pool1d(mass[None, None], 3, stride=1, padding=1)[0, 0]
        smooth = smooth + 1e-3 * mass  # ties (a span's neighbours) go to the token itself first
        smooth[:n_prefix] = -1.0
        top = torch.topk(smooth, n_recompute).indices
        return torch.sort(top).values

    @torch.inference_mode()
    def question_mass(self, keys: torch.Tensor, values: torch.Tensor, total: int,
                      question_ids: torch.Tensor, per_head: bool = False,
                      num_layers: int | None = None) -> torch.Tensor:
        """Attention mass ``[total]`` the question puts on each placed position, averaged over
        layers, heads and question tokens (rotated `keys`/`values` of every position).
        `per_head`: ``[layers, heads, total]`` instead, averaged over question tokens only.
        `num_layers`: the first layers only (the forward stops after them)."""
        from cag.models.attention import attention_logits, capture_attention

        num_layers = num_layers or self.target.adapter.num_layers
        cache = DynamicCache()  # keeps every token, whatever the layer kind
        for i in range(num_layers):
            cache.update(keys[i][None], values[i][None], i)
        captured: dict = {}
        q_len = question_ids.numel()
        with capture_attention(self.target.model, captured):
            self.target.forward_first_layers(num_layers, input_ids=question_ids[None].to(self.target.device),
                                             past_key_values=cache, use_cache=True)
        q_pos = torch.arange(total, total + q_len)
        k_pos = torch.arange(total + q_len)
        per_layer = []
        for layer in range(num_layers):
            q, k, _, scaling, window = captured[layer]
            probs = torch.softmax(attention_logits(q, k, scaling, window, q_pos, k_pos), -1)
            per_layer.append(probs[:, :, :total].float().mean(dim=1).cpu())  # [heads, total]
        heads = torch.stack(per_layer)
        return heads if per_head else heads.mean(dim=(0, 1))

    def context_attention(self, chunks: Sequence[KVChunk], question_ids: torch.Tensor,
                          per_head: bool = False, num_layers: int | None = None) -> torch.Tensor:
        """`question_mass` of `question_ids` over head + `chunks` placed as stored (no recompute),
        ``[layers, heads, total]`` with `per_head`; `num_layers`: of the first layers only (the rest
        are not run). `heads_attention` over every head of those layers."""
        layers = num_layers or self.target.adapter.num_layers
        n_heads = self.target.model.config.num_attention_heads
        (mass,) = self.heads_attention(chunks, [question_ids], [(l, h) for l in range(layers) for h in range(n_heads)])
        mass = mass.view(layers, n_heads, -1)
        return mass if per_head else mass.mean(dim=(0, 1))

    @torch.inference_mode()
    def heads_attention(self, chunks: Sequence[KVChunk], questions: Sequence[torch.Tensor],
                        heads: Sequence[tuple[int, int]] | None = None, *,
                        last_token: bool = False) -> list[torch.Tensor]:
        """Per question: the attention ``[len(heads), total]`` each (layer, query head) of `heads`
        puts on every position of head + `chunks` (placed as stored), averaged over the question's
        tokens (`last_token`: its last token's, the one that predicts the answer's first token);
        `heads` None: every head, ``[layers, heads, total]``.

        What `context_attention` gives per head, for several questions and a few heads at the
        cost of one: the context is placed once, for the layers up to the deepest head only,
        with room behind it for the longest question; each question's forward writes its own
        K/V into that room (no copy of the context per question and layer) and only the
        chosen heads' scores are computed."""
        from cag.models.attention import attention_logits, capture_attention, recompute_cache

        n_layers, n_heads = self.target.adapter.num_layers, self.target.model.config.num_attention_heads
        every = heads is None
        if every:
            heads = [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
        if not heads or not questions:
            raise ValueError("heads_attention needs at least one head and one question")
        upto = max(layer for layer, _ in heads) + 1  # deeper layers feed none of these heads: not run
        parts = [self.prefix(), *chunks]
        for chunk in chunks:
            self.target.check_chunk(chunk, layers=upto)  # a chunk decoded for its first layers will do
        total = sum(c.num_tokens for c in parts)
        room = max(q.numel() for q in questions)
        dtype = self.target.dtype
        spare = torch.zeros((upto, parts[0].keys.shape[1], room, parts[0].keys.shape[3]), dtype=dtype)
        keys = concat_tokens([c.keys[:upto] for c in parts] + [spare], dtype)
        values = concat_tokens([c.values[:upto] for c in parts] + [spare], dtype)
        context = keys[:, :, :total]
        self.target.adapter.rotate(context, torch.arange(total), out=context)
        out = []
        for question_ids in questions:
            n = question_ids.numel()
            cache = recompute_cache(keys[:, :, :total + n], values[:, :, :total + n], torch.arange(total, total + n))
            captured: dict = {}
            with self.model_lock, capture_attention(self.target.model, captured):
                self.target.forward_first_layers(upto, input_ids=question_ids[None].to(self.target.device),
                                                 past_key_values=cache, use_cache=True)
            q_pos, k_pos = torch.arange(total, total + n), torch.arange(total + n)
            rows = []
            for layer, head in heads:
                q, k, _, scaling, window = captured[layer]
                group = q.shape[0] // k.shape[0]  # grouped-query attention: this head's KV head
                logits = attention_logits(q[head:head + 1], k[head // group:head // group + 1], scaling, window,
                                          q_pos, k_pos)
                probs = torch.softmax(logits, -1)[0, :, :total].float()
                rows.append((probs[-1] if last_token else probs.mean(dim=0)).cpu())
            mass = torch.stack(rows)
            out.append(mass.view(n_layers, n_heads, total) if every else mass)
        return out

    @torch.inference_mode()
    def _recompute(self, keys: torch.Tensor, values: torch.Tensor, context_ids: torch.Tensor,
                   chosen: torch.Tensor, *, question_ids: torch.Tensor | None = None,
                   question_key_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """Recompute the `chosen` context positions of the rotated `keys`/`values` (position order).

        Writes the new K/V into `keys` and `values` themselves (the caller's own buffers). With
        `question_ids` (the buffers then have room for them after the context) the question runs in
        the same forward, after the chosen tokens, reading the keys times `question_key_scale`; its
        last token's logits are returned (else None). Called by `place` with the model lock held
        (the forward shares the model)."""
        from cag.generate import head_logits
        from cag.models.attention import blocked_recompute, recompute_cache

        total = context_ids.numel()
        chosen = torch.sort(chosen).values
        ids = context_ids[chosen]
        if question_ids is not None:
            chosen = torch.cat([chosen, torch.arange(total, total + question_ids.numel())])
            ids = torch.cat([ids, question_ids.to(ids.dtype)])
        size = keys.shape[2]
        cache = recompute_cache(keys, values, chosen)
        forward = dict(input_ids=ids[None].to(self.target.device), position_ids=chosen[None].to(self.target.device),
                       attention_mask=self._recompute_masks(chosen, size))
        with blocked_recompute(self.target.model, chosen, size, self.recompute_block,  # skips hidden scores
                               question_from=None if question_ids is None else total,
                               question_key_scale=question_key_scale):
            if question_ids is None:
                self.target.forward_for_cache(cache, **forward)  # the K/V only: no last MLP, no head
                return None
            hidden = self.target.model.model(past_key_values=cache, use_cache=True, **forward).last_hidden_state
        return head_logits(self.target.model, hidden[0, -1:])[-1]

    def _recompute_masks(self, chosen: torch.Tensor, total: int):
        """Additive masks for the recomputed tokens over every position, in position order:
        a chosen token sees every position up to itself, and in a sliding layer only those
        inside its window."""
        q = chosen[:, None]
        kv = torch.arange(total)[None, :]
        visible = kv <= q
        dtype = self.target.dtype

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(allowed.shape, dtype=dtype)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            return mask[None, None].to(self.target.device)

        adapter = self.target.adapter
        if "sliding_attention" not in adapter.layer_types:
            return additive(visible)
        in_window = (q - kv) < adapter.sliding_window
        return {"full_attention": additive(visible), "sliding_attention": additive(visible & in_window)}


def first_k_positions(lengths: Sequence[int], n_prefix: int, k: int) -> torch.Tensor:
    """EPIC's choice: the first `k` positions of every chunk (all of a chunk shorter than k)."""
    out, start = [], n_prefix
    for n in lengths:
        out.append(torch.arange(start, start + min(k, n)))
        start += n
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
