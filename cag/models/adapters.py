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

    # --------------------------------------------------------------- rotation

    def _rope_key(self, layer_type: str) -> str:
        """Which rotary embedding a layer type uses; one for all in llama/qwen2."""
        return "default"

    def _cos_sin(self, positions: torch.Tensor, rope_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, dtype=torch.float32, device=positions.device)
        return self.rotary(dummy, positions[None, :])

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE at `positions` to position-free keys ``[layers, heads, tokens, dim]``."""
        return self._rotate(keys, positions, inverse=False)

    def derotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the RoPE that the model applied at `positions`."""
        return self._rotate(keys, positions, inverse=True)

    def _rotate(self, keys: torch.Tensor, positions: torch.Tensor, *, inverse: bool) -> torch.Tensor:
        if keys.dim() != 4 or keys.shape[0] != self.num_layers:
            raise ValueError(f"keys must be [{self.num_layers}, heads, tokens, dim], got {tuple(keys.shape)}")
        if positions.shape != (keys.shape[2],):
            raise ValueError(f"need one position per token: {tuple(positions.shape)} vs {keys.shape[2]} tokens")
        positions = positions.to(device=keys.device, dtype=torch.long)
        out = torch.empty_like(keys)
        for rope_key, layers in self.rope_groups.items():
            cos, sin = self._cos_sin(positions, rope_key)  # [1, tokens, dim], fp32
            if inverse:
                norm = cos * cos + sin * sin
                cos, sin = cos / norm, -sin / norm
            # Rotate in fp32 whatever the storage dtype; the model's own function,
            # with `q` a throwaway broadcastable tensor (only `k` is wanted).
            index = torch.tensor(layers, device=keys.device)
            group = keys.index_select(0, index).float()
            _, rotated = self._apply_rope(cos[:, None], group, cos, sin)
            out.index_copy_(0, index, rotated.to(keys.dtype))
        return out

    # ---------------------------------------------------------------- caches

    def new_cache(self) -> DynamicCache:
        """An empty cache with the model's own layer kinds (sliding windows included)."""
        return DynamicCache(config=self.config)

    def fill_cache(self, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
        """A cache holding rotated `keys`/`values` ``[layers, heads, tokens, dim]`` for batch 1.

        Each layer is filled through its own `update`, so a sliding-window layer
        keeps only the tokens its window can still see and records the true
        sequence length, exactly as if the model had prefilled these tokens.
        """
        cache = self.new_cache()
        for i in range(self.num_layers):
            cache.layers[i].update(keys[i][None], values[i][None])
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
