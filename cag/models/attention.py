"""The target's attention, observed and replayed outside its forward.

Three users need the queries a model computes, not only its outputs: mapper
fidelity (attention-output cosine), HeteroFold's output-aware calibration (the
target's own queries attending over a translated context) and the assembler's
question-guided recompute (where the question looks in a placed context).
`capture_attention` records, per layer, what the model hands its attention
function (queries and keys already rotated, values, scaling, sliding window);
`attention_logits` replays the masked scores from them.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch

# Masked scores get a large finite value rather than -inf: softmax still gives
# exact zeros there, and a KL or gradient over them stays 0 instead of 0·inf = nan.
MASKED = -1e30


@contextmanager
def capture_attention(model, store: dict):
    """Record each attention layer's (query, key, value, scaling, window) during a forward.

    Tensors are batch row 0, detached: ``[heads, tokens, head_dim]``. Works with
    any registered attention implementation (sdpa by default), not with eager.
    """
    def wrap(original):
        def wrapper(module, query, key, value, attention_mask, **kwargs):
            store[module.layer_idx] = (query.detach()[0], key.detach()[0], value.detach()[0],
                                       kwargs.get("scaling"), kwargs.get("sliding_window"))
            return original(module, query, key, value, attention_mask, **kwargs)
        return wrapper

    with _wrapped_attention(model, wrap, "attention capture"):
        yield


# The attention implementation `LoadedModel` gives a model loaded with transformers' sdpa:
# the same function, except where the heads are grouped, a mask is given and the tensors
# are on CPU (`gqa_sdpa_attention`).
GQA_SDPA = "cag_sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs):
    """transformers' sdpa attention, with grouped key/value heads read in place under a mask on CPU.

    transformers copies every key/value head once per query head whenever a mask is given
    (torch's CUDA kernels would fall back to the math path with grouped heads and a mask),
    and a question read over a placed context always has one: for Qwen2.5 (7 query heads
    per key/value head) at 4K that is 15 MB copied per layer, about a sixth of the question's
    forward. Torch's CPU kernel takes the grouped heads and the mask as they are
    (``enable_gqa``), with the same result (tests/unit/test_query_path_fast.py). Anything
    else (one query, no mask, an accelerator, bias, softcap, sinks, a paged cache) is
    transformers' own code."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.shape[1] != key.shape[1] and attention_mask is not None and query.shape[2] > 1
            and query.device.type == "cpu"
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and kwargs.get("cache") is None and getattr(module, "sinks", None) is None):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def use_gqa_sdpa(model) -> None:
    """Switch a model loaded with transformers' sdpa to `gqa_sdpa_attention` (others stay as they are).

    Registered under its own name, with sdpa's masks, so the model's code and masks are
    transformers' own and only the attention call differs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)


@contextmanager
def _wrapped_attention(model, wrap, purpose: str):
    """Replace `model`'s registered attention function by ``wrap(original)`` for a while.

    transformers looks the function up by name at every forward, so swapping the
    registry entry changes the model's attention without forking its code."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(model.config, "_attn_implementation", None)
    if impl in (None, "eager") or impl not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(f"{purpose} needs a registered attention function, not {impl!r}")
    original = ALL_ATTENTION_FUNCTIONS[impl]
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
    ALL_ATTENTION_FUNCTIONS[impl] = wrap(original)
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[impl] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]


def attention_logits(q: torch.Tensor, k: torch.Tensor, scaling: float | None, window: int | None,
                     q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Masked scores ``[Hq, Tq, Tk]`` of q ``[Hq, Tq, D]`` over k ``[Hk, Tk, D]`` (causal, optional window)."""
    hq, hk = q.shape[0], k.shape[0]
    if hq != hk:  # grouped-query attention: each KV head serves hq / hk query heads
        k = k.repeat_interleave(hq // hk, dim=0)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(1, 2)) * scale
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window:
        allowed &= diff < window
    return scores.masked_fill(~allowed, MASKED)


def attend(q, k, v, scaling, window, q_pos, k_pos) -> torch.Tensor:
    """Attention outputs ``[Hq, Tq, D]`` (fp32)."""
    probs = torch.softmax(attention_logits(q, k, scaling, window, q_pos, k_pos), -1)
    hq, hk = probs.shape[0], v.shape[0]
    if hq != hk:
        v = v.repeat_interleave(hq // hk, dim=0)
    return probs @ v.float()


@contextmanager
def context_temperature(model, start: int, end: int, temperature: float = 1.0, scale: float = 1.0,
                        offsets: torch.Tensor | None = None):
    """APE's query-time adjustment of attention over a placed context block, during a forward.

    For every attention layer whose keys still hold the whole context (full-attention
    layers; a sliding layer only sees its window, so it is left as it is), the scores
    of keys at positions ``start..end-1`` become ``q·k / (√d·T) + log S``: the
    temperature ``T`` sharpens (T < 1) or flattens the attention *within* the
    context, and the scale ``S`` draws more (S > 1) or less attention to the context
    as a whole. Chunks prefilled apart overlap in what they hold, so together they
    draw too much, too flat attention (APE, ICLR 2025: T = S = 0.9 there).

    Implemented by wrapping the model's registered attention function (the model
    code is not forked): the context's keys are divided by ``T`` and ``log S`` is
    added to the mask. ``T = S = 1`` is exactly the model's own attention.

    `offsets` ``[layers, query heads]``: a logit offset per layer and query head on top
    of ``log S`` (a translated context's mass matched to native's,
    `eval/calibrate_context_mass.py`); ``None`` adds nothing.
    """
    import math

    if temperature <= 0 or scale <= 0:
        raise ValueError(f"temperature and scale must be > 0, got {temperature}, {scale}")
    if temperature == 1.0 and scale == 1.0 and offsets is None:
        yield
        return
    log_s = math.log(scale)

    def wrap(original):
        def wrapper(module, query, key, value, attention_mask, **kwargs):
            kv_len, q_len = key.shape[2], query.shape[2]
            if kwargs.get("sliding_window") or kv_len < end:
                return original(module, query, key, value, attention_mask, **kwargs)
            key = key.clone()
            key[:, :, start:end] = key[:, :, start:end] / temperature
            if attention_mask is None:  # the causal pattern sdpa would have used, as an additive mask
                q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
                allowed = torch.arange(kv_len, device=query.device)[None, :] <= q_pos
            elif attention_mask.dtype == torch.bool:
                allowed = attention_mask
            else:
                allowed = None
            if allowed is not None:
                mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
                mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
            else:
                mask = attention_mask
            while mask.dim() < 4:
                mask = mask[None]
            if offsets is None:
                mask = mask.expand(*mask.shape[:-2], q_len, kv_len).clone()
                mask[..., start:end] += log_s
            else:  # one offset per query head: the mask gets a head dimension of its own
                mask = mask.expand(mask.shape[0], query.shape[1], q_len, kv_len).clone()
                per_head = offsets[module.layer_idx].to(device=mask.device, dtype=mask.dtype)
                mask[..., start:end] += log_s + per_head[None, :, None, None]
            return original(module, query, key, value, mask, **kwargs)
        return wrapper

    with _wrapped_attention(model, wrap, "context temperature"):
        yield


@lru_cache(maxsize=None)  # one class, defined when first needed (transformers loads lazily)
def _recompute_layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class RecomputeLayer(CacheLayerMixin):
        """One layer of `recompute_cache`: buffers in position order, the forward's K/V written at `chosen`."""

        is_sliding = False
        is_croppable = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, chosen: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values = keys, values
            self.chosen = chosen.to(keys.device)
            self.written = 0
            self.is_initialized = True
            self.dtype, self.device = keys.dtype, keys.device

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states.shape[-2] != self.chosen.numel() or self.written:
                raise RuntimeError("a recompute cache takes one forward of exactly its chosen positions")
            self.keys.index_copy_(2, self.chosen, key_states)
            self.values.index_copy_(2, self.chosen, value_states)
            self.written = self.chosen.numel()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            # What a cache of the kept tokens alone would say: the forward then counts its
            # queries after them and asks for masks over every position, as it did for one.
            return self.keys.shape[-2] - self.chosen.numel() + self.written

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[-2], 0

        def get_max_length(self) -> int:
            return -1

        def lazy_initialization(self, key_states, value_states) -> None:
            raise RuntimeError("a recompute cache is built full")

    return RecomputeLayer


def recompute_cache(keys: torch.Tensor, values: torch.Tensor, chosen: torch.Tensor):
    """A transformers cache over every placed position, for a forward of the `chosen` ones only.

    `keys`/`values` ``[layers, heads, positions, dim]`` (keys rotated) stay in position
    order: the forward of the chosen positions writes their new K/V into these very
    buffers (in place), and each attention layer reads them whole, in position order.
    No kept/chosen layout to gather into and back out of, per layer and per call; the
    masks (and `blocked_recompute`) are by position. Every layer keeps every position,
    whatever its kind (a sliding layer's window is in its mask).
    """
    from transformers.cache_utils import Cache

    layer = _recompute_layer_class()
    return Cache(layers=[layer(keys[i][None], values[i][None], chosen) for i in range(keys.shape[0])])


@contextmanager
def blocked_recompute(model, chosen: torch.Tensor, total: int, block: int = 64, *,
                      question_from: int | None = None, question_key_scale: torch.Tensor | None = None):
    """A selective recompute's forward, with each block of queries attending only to keys it can see.

    The recompute forward runs the `chosen` context positions (sorted) over a cache of all
    `total` positions in position order (`recompute_cache`) with an additive mask that hides
    every key placed after a query. Dense attention still computes those hidden scores: on
    average half of them. Here the queries go in blocks of `block`, by position, and each
    block attends over the positions up to its last query only (in a sliding-window layer,
    from the oldest its first query's window reaches): every key left out was masked for the
    whole block, so the result is the dense one (softmax gave those keys exactly 0), at about
    ``1 + block / (2 · mean position)`` of the exact causal count of scores instead of twice it.

    A block's keys are a slice of the layer's, not a copy, and its mask, by position, is built
    once per block and layer kind and shared by every layer.

    Only a forward whose shapes are the recompute's is blocked; any other passes through.
    Under sdpa each block goes through `gqa_sdpa_attention` (grouped key/value heads read in
    place on CPU), also for a model loaded outside `LoadedModel`, whose sdpa would copy every
    key/value head once per query head under the block's mask (Qwen2.5: 7×).

    `question_from`: the chosen positions from this one on are the question's, run in the
    same forward (`Assembler.place(with_question=...)`): they go in a block of their own, and
    with `question_key_scale` (one factor per position) they read the keys multiplied by it,
    as the question of a separate forward reads a cache whose keys were scaled after the
    recompute (the rank key decay); the buffers themselves are not scaled here.
    """
    n_chosen = chosen.numel()
    if n_chosen and (not bool((chosen[1:] > chosen[:-1]).all()) or chosen[0] < 0 or chosen[-1] >= total):
        raise ValueError(f"chosen positions must be sorted, distinct and within [0, {total})")
    if question_key_scale is not None and (question_from is None or question_key_scale.shape != (total,)):
        raise ValueError(f"question_key_scale needs question_from and one factor for each of the {total} positions")
    grouped_in_place = getattr(model.config, "_attn_implementation", None) in ("sdpa", GQA_SDPA)
    n_context = n_chosen if question_from is None else int((chosen < question_from).sum())
    blocks = [(r0, min(r0 + block, n_context)) for r0 in range(0, n_context, block)]
    if n_context < n_chosen:
        blocks.append((n_context, n_chosen))  # the question: one block, after every context block
    spans: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}

    def spans_for(window: int | None, dtype: torch.dtype, device) -> list[tuple[int, int, torch.Tensor]]:
        """Per block: the positions ``lo..hi-1`` its keys cover and its additive mask over them."""
        key = (window, dtype, str(device))
        if key not in spans:
            out = []
            for r0, r1 in blocks:
                q_pos = chosen[r0:r1, None]
                lo = max(0, int(chosen[r0]) - window + 1) if window else 0
                hi = int(chosen[r1 - 1]) + 1
                k_pos = torch.arange(lo, hi)[None, :]
                allowed = k_pos <= q_pos
                if window:
                    allowed &= (q_pos - k_pos) < window
                mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
                out.append((lo, hi, mask[None, None].to(device)))
            spans[key] = out
        return spans[key]

    def wrap(original):
        def wrapper(module, query, key, value, attention_mask, **kwargs):
            if ((len(blocks) < 2 and question_key_scale is None) or query.shape[2] != n_chosen
                    or key.shape[2] != total or attention_mask is None or attention_mask.dim() != 4):
                return original(module, query, key, value, attention_mask, **kwargs)
            outputs = []
            for (r0, r1), (lo, hi, mask) in zip(blocks, spans_for(kwargs.get("sliding_window"),
                                                                 query.dtype, query.device)):
                q, k, v = query[:, :, r0:r1], key[:, :, lo:hi], value[:, :, lo:hi]
                if question_key_scale is not None and r0 == n_context:
                    # A scaled copy, the question's alone, rounded as the buffer scaled in place would be
                    # (a bf16 tensor times a float scalar is computed in fp32).
                    k = (k.float() * question_key_scale[lo:hi].to(k.device, torch.float32)[:, None]).to(k.dtype)
                out, _ = (gqa_sdpa_attention if grouped_in_place else original)(module, q, k, v, mask, **kwargs)
                outputs.append(out)
            return torch.cat(outputs, dim=1), None  # attention outputs are [batch, queries, heads, dim]
        return wrapper

    with _wrapped_attention(model, wrap, "blocked recompute"):
        yield
