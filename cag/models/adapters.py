"""Per-family knowledge of where position lives in a model's KV cache.

`cag` stores keys without position and places them later, so for every family
it must know three things: which rotary embedding each layer uses, how the
model applies it, and what kind of cache layer (full or sliding window) holds
each layer's states. Everything else about a model is left to transformers.

Rotation is never re-implemented: `cos`/`sin` come from the model's own rotary
module and are applied with the model's own `apply_rotary_pos_emb`. Undoing a
rotation uses the same function with the inverse rotation, ``(cos, -sin) /
(cos² + sin²)``, which is exact for any RoPE variant of the rotate-half form,
including those whose `attention_scaling` is not 1. The start-up self-check
(`cag.models.selfcheck`) proves on each loaded model that this is the identity
and that caches built here reproduce the model's own forward.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


# RoPE types whose cos/sin at a position do not depend on the sequence length (tables
# can be cached); "dynamic" and "longrope" rescale with it and are computed per call.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedModelError(ValueError):
    """A model whose family `cag` has no adapter for."""


class FamilyAdapter:
    """RoPE and cache layout of one loaded model (llama-like default)."""

    family = "llama"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        cfg = self.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        self.layer_types: list[str] = list(layer_types)
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"{self.family}: layer types {sorted(unknown)} are not supported")
        self.sliding_window: int | None = getattr(cfg, "sliding_window", None)
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError(f"{self.family}: sliding layers without a sliding_window")
        self.rotary = model.model.rotary_emb
        module = sys.modules[type(model).__module__]
        self._apply_rope = module.apply_rotary_pos_emb
        # Layers are rotated in groups that share one rotary embedding, so a
        # [layers, heads, tokens, dim] tensor is rotated with one call per group.
        self.rope_groups: dict[str, list[int]] = {}
        for i, kind in enumerate(self.layer_types):
            self.rope_groups.setdefault(self._rope_key(kind), []).append(i)
        # cos/sin of positions 0..n-1 per (rope key, device), grown on demand (`cos_sin`).
        # Only for RoPE types whose tables do not depend on the sequence length.
        self._tables: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        rope_types = getattr(self.rotary, "rope_type", "default")
        rope_types = set(rope_types.values()) if isinstance(rope_types, dict) else {rope_types}
        self._static_rope = rope_types <= STATIC_ROPE_TYPES

    # --------------------------------------------------------------- rotation

    def _rope_key(self, layer_type: str) -> str:
        """Which rotary embedding a layer type uses; one for all in llama/qwen2."""
        return "default"

    def _cos_sin(self, positions: torch.Tensor, rope_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary module at `positions`: fp32 ``[1, tokens, dim]``."""
        dummy = torch.empty(0, dtype=torch.float32, device=positions.device)
        return self.rotary(dummy, positions[None, :])

    def cos_sin(self, positions: torch.Tensor, rope_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos``/``sin`` ``[1, tokens, dim]`` at `positions`, read from a table.

        The table holds the rotary module's own output for positions 0..n-1, computed
        once per rope key and device and regrown (doubling) when a position past its end
        is asked for. Each row is an elementwise function of its position alone, so a row
        read from the table is bit for bit what the module gives for that position in
        any call (the unit tests hold this). Rotation runs in fp32 whatever the storage
        dtype, so one fp32 table serves every dtype. RoPE types whose tables change with
        the sequence length (dynamic, longrope) are computed per call, as the model does.
        """
        if not self._static_rope or positions.numel() == 0:
            return self._cos_sin(positions, rope_key)
        key = (rope_key, positions.device)
        need = int(positions.max()) + 1
        table = self._tables.get(key)
        if table is None or table[0].shape[1] < need:
            size = max(need, 2 * table[0].shape[1] if table is not None else 4096)
            limit = getattr(self.config, "max_position_embeddings", None)
            if limit:
                size = max(need, min(size, limit))
            table = self._cos_sin(torch.arange(size, device=positions.device), rope_key)
            self._tables[key] = table  # one assignment: a concurrent reader sees the old table or this one
        cos, sin = table
        return cos.index_select(1, positions), sin.index_select(1, positions)

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Apply RoPE at `positions` to position-free keys ``[layers, heads, tokens, dim]``
        (every layer of the model, or its first ones: a forward cut short needs no more).

        `out`: where the rotated keys go (the same shape and dtype; `keys` itself rotates
        them in place); a new tensor by default."""
        return self._rotate(keys, positions, inverse=False, out=out)

    def derotate(self, keys: torch.Tensor, positions: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Undo the RoPE that the model applied at `positions` (`out` as in `rotate`)."""
        return self._rotate(keys, positions, inverse=True, out=out)

    def _rotate(self, keys: torch.Tensor, positions: torch.Tensor, *, inverse: bool,
                out: torch.Tensor | None) -> torch.Tensor:
        if keys.dim() != 4 or not 1 <= keys.shape[0] <= self.num_layers:
            raise ValueError(f"keys must be [layers ≤ {self.num_layers}, heads, tokens, dim], got {tuple(keys.shape)}")
        if positions.shape != (keys.shape[2],):
            raise ValueError(f"need one position per token: {tuple(positions.shape)} vs {keys.shape[2]} tokens")
        if out is None:
            out = torch.empty_like(keys)
        elif out.shape != keys.shape or out.dtype != keys.dtype:
            raise ValueError(f"out must be {tuple(keys.shape)} {keys.dtype}, got {tuple(out.shape)} {out.dtype}")
        positions = positions.to(device=keys.device, dtype=torch.long)
        # `q` of the model's function is a throwaway: an empty batch broadcasts to nothing.
        no_q = torch.empty(0, 1, 1, keys.shape[-1], device=keys.device)
        for rope_key, layers in self.rope_groups.items():
            cos, sin = self.cos_sin(positions, rope_key)  # [1, tokens, dim], fp32
            if inverse:
                norm = cos * cos + sin * sin
                cos, sin = cos / norm, -sin / norm
            # One layer at a time, in fp32 whatever the storage dtype, with the model's own
            # function: the fp32 temporaries are one layer's (they stay in the CPU's caches),
            # and the result is written straight into `out`. Elementwise, so equal bit for
            # bit to rotating all layers at once.
            for i in (i for i in layers if i < keys.shape[0]):
                _, rotated = self._apply_rope(no_q, keys[i : i + 1].float(), cos, sin)
                out[i].copy_(rotated[0])
        return out

    # ---------------------------------------------------------------- caches

    def new_cache(self) -> DynamicCache:
        """An empty cache with the model's own layer kinds (sliding windows included)."""
        return DynamicCache(config=self.config)

    def fill_cache(self, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
        """A cache holding rotated `keys`/`values` ``[layers, heads, tokens, dim]`` for batch 1.

        Each layer is filled as its own `update` fills an empty layer, so a
        sliding-window layer keeps only the tokens its window can still see and
        records the true sequence length, exactly as if the model had prefilled
        these tokens; the layers hold views of `keys`/`values` (no copy).
        """
        cache = self.new_cache()
        for i in range(self.num_layers):
            _fill_layer(cache.layers[i], keys[i][None], values[i][None])
        return cache

    def cache_tensors(self, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack a full-attention cache's layers into ``[layers, heads, tokens, dim]``.

        Refuses caches whose sliding layers have already dropped tokens, since
        those tokens cannot be recovered.
        """
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) != 1:
            raise ValueError(
                "cache layers hold different token counts (a sliding window dropped some); "
                "prefill chunks no longer than the model's sliding window"
            )
        keys = torch.stack([layer.keys[0] for layer in cache.layers])
        values = torch.stack([layer.values[0] for layer in cache.layers])
        return keys, values

    def check_placement(self, total_tokens: int) -> None:
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit and total_tokens > limit:
            raise ValueError(f"{total_tokens} tokens exceed the model's {limit} positions")


class Qwen2Adapter(FamilyAdapter):
    family = "qwen2"


class Gemma3Adapter(FamilyAdapter):
    """Gemma 3: local sliding-window layers and global layers with two RoPE bases."""

    family = "gemma3"

    def _rope_key(self, layer_type: str) -> str:
        return layer_type

    def _cos_sin(self, positions: torch.Tensor, rope_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, dtype=torch.float32, device=positions.device)
        return self.rotary(dummy, positions[None, :], rope_key)


def _fill_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``layer.update(keys, values)`` on an empty cache layer, without the copy its
    concatenation with the empty tensor makes (the whole context, every layer, per query).

    Done for the two layer classes whose `update` is known (transformers 5.x): a full
    layer takes the states as they are; a sliding one counts every token and keeps
    the last ``sliding_window - 1``. Any other class, or a sliding layer recording its
    past, is filled through its own `update`. tests/unit/test_query_path_fast.py holds
    this equal to `update` for every family.
    """
    kind = type(layer)
    if layer.is_initialized or kind not in (DynamicLayer, DynamicSlidingWindowLayer) or (
            kind is DynamicSlidingWindowLayer and layer.record_past):
        layer.update(keys, values)
        return
    layer.lazy_initialization(keys, values)
    if kind is DynamicSlidingWindowLayer:
        layer.cumulative_length += keys.shape[-2]
        keys, values = keys[:, :, -layer.sliding_window + 1 :], values[:, :, -layer.sliding_window + 1 :]
    layer.keys, layer.values = keys, values


def concat_tokens(tensors: Sequence[torch.Tensor], dtype: torch.dtype, room: int = 0) -> torch.Tensor:
    """``[layers, heads, n_i, dim]`` tensors back to back along the tokens, in `dtype`,
    followed by `room` positions of zeros (for tokens a forward will write there).

    One tensor is allocated for the whole sequence and each part is copied (and cast)
    into its slice once, where ``torch.cat(...).to(dtype)`` would copy twice when the
    parts are not in `dtype` already. The cast is the same elementwise rounding.
    """
    if not tensors:
        raise ValueError("nothing to concatenate")
    first = tensors[0]
    total = sum(t.shape[2] for t in tensors)
    out = torch.empty((first.shape[0], first.shape[1], total + room, first.shape[3]), dtype=dtype, device=first.device)
    start = 0
    for t in tensors:
        out[:, :, start : start + t.shape[2]].copy_(t)
        start += t.shape[2]
    if room:
        out[:, :, total:].zero_()
    return out


# transformers `model_type` → adapter. Gemma 3 text-only checkpoints say gemma3_text.
ADAPTERS: dict[str, type[FamilyAdapter]] = {
    "llama": FamilyAdapter,
    "qwen2": Qwen2Adapter,
    "gemma3_text": Gemma3Adapter,
}


def adapter_for(model: PreTrainedModel) -> FamilyAdapter:
    model_type = getattr(model.config, "model_type", None)
    try:
        cls = ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"no cag adapter for model type {model_type!r}; supported: {sorted(ADAPTERS)}"
        ) from None
    return cls(model)


def supported_model_types() -> Sequence[str]:
    return sorted(ADAPTERS)
