"""Bottleneck: every source layer's keys and values through one shared per-token bottleneck.

Where KV Ridge gives each target layer a window of ±1 source layers and predicts
keys from keys only, this map sees the whole source cache of a token at once:

    x  = [K_0 … K_{Ls−1}, V_0 … V_{Ls−1}]   of the aligned source token (de-rotated keys)
    z  = ((x − μx) / σx) · P                  P: the top r principal directions  [F, r]
    ŷ  = (z · C) ⊙ s + μy                     C: ridge map to every target layer's K and V  [r, D]

plus, optionally (``token_residual``), per target layer l a ridge map from the target's own
*direct path* of tokens t, t−1, … (``token_window`` of them, default 2; embedding → layer l's norm → k and v projections,
`mappers.linear.direct_path`) to what the bottleneck still gets wrong. That direct path is
which token sits at each position in the target's own vocabulary: a source with another
tokenizer cannot supply it, and copying a name or a number out of the context needs it.

Optionally (``key_correction_rank`` r > 0), a low-rank correction of every translated key,
per target layer l and KV head h, on the finished position-free keys:

    k' = k + (k · A[l,h]) · B[l,h]            A: [D, r], B: [r, D]

fitted through the frozen target on lookups among several translated chunks
(`eval/fit_key_correction.py`): the rest of the map is fitted one token at a time
and never sees translated neighbours match a question they should not.

Optionally (``repair_key_correction_rank`` r₂ > 0), a second correction (A₂, B₂) of the same form,
fitted on the ``+repair`` path, where the target recomputes the crux of the context among the
translated keys (`eval/fit_key_correction.py --repair`): that path serves k + (k A₂) B₂ instead.
The two paths want different keys: a correction fitted on the served path found 4 more of 30 gate
lookups there and lost plain-path lookups, in both directions (eval/results/gate-kc-two-paths/).
Translations are kept (LRU, stored translations) as the plain path serves them, so `repair_keys`
maps them at placement, exactly (Woodbury):

    k₂ = k₁ (I + A B)⁻¹ (I + A₂ B₂) = k₁ + (k₁ U) V,    U = [A₂, −A C],  V = [B₂; B (I + A₂ B₂)],
    C = (I + B A)⁻¹                                     (rank r + r₂: 2·(r + r₂)·D multiply-adds a key)

``s`` restores each translated key channel's spread (ridge shrinks every channel
toward its mean, and the few massive low-frequency rotary channels that carry
lookups suffer most); values keep s = 1. z is the same for every target layer,
so translation costs two matmuls per chunk, whatever the number of layers.

Fitted by the translation lab (`eval/translation_lab.py export`), not by the
generic ``cag fit`` loop: the lab's aligned rows, its held-out λ per target head,
and its lookup score are what the card records. Standardisation is folded into
the stored projection (``proj = P / σx``, ``bias = −(μx/σx)·P``) and the spread
into the ridge map, so inference is ``(x·proj + bias)·coef + y_mean``.
"""

from __future__ import annotations

from typing import Any

import torch

from cag.kv import FLOAT_DTYPES, KVChunk, normalize_dtype
from mappers.base import Mapper, MapperArtifactError, register_mapper, runtime_dtype
from mappers.linear import direct_path, flatten_heads
from mappers.token_alignment import align_tokens

NAMES = ("proj", "bias", "coef", "y_mean")
TOKEN_NAMES = ("tok_w", "tok_mean_f", "tok_mean_r")
MATRICES = ("proj", "coef", "tok_w")  # rounded to the storage dtype; biases and means stay fp32


def direct_features(target, ids: torch.Tensor, window: int = 2) -> torch.Tensor:
    """``[L, T, window·2·Ht·Dt]``: per target layer, the direct path (keys, values) of tokens
    t, t−1, …, t−window+1 (zeros before the chunk's first token)."""
    now = direct_path(target, ids, "both")
    parts = [now]
    for back in range(1, window):
        prev = torch.zeros_like(now)
        prev[:, back:] = now[:, :-back]
        parts.append(prev)
    return torch.cat(parts, -1)


def token_residual(target, ids: torch.Tensor, w: torch.Tensor, mean_f: torch.Tensor,
                   mean_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The direct-path correction of keys and of values ``[L, H, T, D]``: per layer l,
    ``(f_l − mean_f_l) · w_l + mean_r_l`` over `direct_features` f (its token window is
    w's width over 2·H·D)."""
    hd = target.fingerprint.num_kv_heads * target.fingerprint.head_dim
    f = direct_features(target, ids, w.shape[1] // (2 * hd)) - mean_f[:, None, :]         # [L, T, window·2HD]
    return split_residual(torch.bmm(f, w) + mean_r[:, None, :], target.fingerprint.num_kv_heads)


def split_residual(r: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, T, 2·H·D]`` per-layer rows (keys, then values) → keys, values ``[L, H, T, D]``."""
    hd = r.shape[-1] // 2
    shape = (r.shape[0], r.shape[1], num_kv_heads, hd // num_kv_heads)
    return r[..., :hd].reshape(shape).permute(0, 2, 1, 3), r[..., hd:].reshape(shape).permute(0, 2, 1, 3)


def all_layer_features(chunk: KVChunk) -> torch.Tensor:
    """``[T, Ls·2·Hs·Ds]``: every layer's de-rotated keys, then every layer's values, per token."""
    parts = []
    for kv in (chunk.keys, chunk.values):
        flat = flatten_heads(kv.float())                    # [Ls, T, H·D]
        parts.append(flat.permute(1, 0, 2).reshape(flat.shape[1], -1))
    return torch.cat(parts, -1)


def split_outputs(y: torch.Tensor, num_layers: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 2·L·H·D]`` (keys of all layers, then values) → keys, values ``[L, H, T, D]``."""
    t, half = y.shape[0], y.shape[1] // 2
    out = []
    for part in (y[:, :half], y[:, half:]):
        flat = part.reshape(t, num_layers, half // num_layers).permute(1, 0, 2)
        out.append(flat.reshape(num_layers, t, heads, -1).permute(0, 2, 1, 3).contiguous())
    return out[0], out[1]


def corrected_keys(keys: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``k + (k A) B`` per layer and head: keys ``[L, H, T, D]``, A ``[L, H, D, r]``, B ``[L, H, r, D]``."""
    return keys + (keys @ a) @ b


def repair_delta(a2: torch.Tensor, b2: torch.Tensor, a: torch.Tensor | None = None,
                 b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) with ``k₁ + (k₁ U) V = k + (k A₂) B₂`` for every ``k₁ = k + (k A) B``: the plain path's
    corrected keys → the ``+repair`` path's (A, B None: the plain path has no correction)."""
    if a is None:
        return a2, b2
    a, b, a2, b2 = (t.double() for t in (a, b, a2, b2))
    c = torch.linalg.inv(torch.eye(a.shape[-1], dtype=a.dtype) + b @ a)          # [L, H, r, r]
    u = torch.cat([a2, -(a @ c)], -1)
    v = torch.cat([b2, b + (b @ a2) @ b2], -2)
    return u.float(), v.float()


@register_mapper
class BottleneckMapper(Mapper):
    method = "bottleneck"

    def __init__(self, source, target, settings: dict[str, Any] | None = None) -> None:
        super().__init__(source, target, {"rank": 512, "storage_dtype": "float16", "compute_dtype": "float32",
                                          **(settings or {})})
        self.weights: dict[str, torch.Tensor] = {}
        self._repair_deltas: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # by (plain rank, keys' dtype)

    @property
    def num_features(self) -> int:
        s = self.source
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim

    @property
    def num_outputs(self) -> int:
        t = self.target
        return 2 * t.num_layers * t.num_kv_heads * t.head_dim

    @property
    def token_residual(self) -> bool:
        return bool(self.settings.get("token_residual", False))

    @property
    def token_window(self) -> int:
        return int(self.settings.get("token_window", 2))  # tokens t … t−window+1; artifacts before it: 2

    @property
    def key_correction_rank(self) -> int:
        return int(self.settings.get("key_correction_rank", 0))  # artifacts before it: none

    @property
    def repair_key_correction_rank(self) -> int:
        return int(self.settings.get("repair_key_correction_rank", 0))  # artifacts before it: none

    def repair_keys(self, keys: torch.Tensor) -> torch.Tensor:
        if not self.repair_key_correction_rank:
            return keys
        rank = self.key_correction_rank  # 0 while the fit translates with the plain correction off
        at = (rank, keys.dtype)
        if at not in self._repair_deltas:
            w = self.weights
            plain = (w["key_a"], w["key_b"]) if rank else (None, None)
            u, v = repair_delta(w["repair_key_a"], w["repair_key_b"], *plain)
            self._repair_deltas[at] = (u.to(keys.dtype), v.to(keys.dtype))
        u, v = self._repair_deltas[at]
        # in the keys' own dtype: in fp32, the copies cost Qwen2.5 65 ms a query at 4K, in bf16 5 ms
        return keys + (keys @ u) @ v

    def set_weights(self, **tensors: torch.Tensor) -> None:
        """Install fitted weights, rounded to their storage dtype (what is measured is what is saved)."""
        store = FLOAT_DTYPES[normalize_dtype(self.settings["storage_dtype"])]
        self.weights = {k: (v.to(store) if k in MATRICES else v).float() for k, v in tensors.items()}
        self._repair_deltas = {}
        self._check(self.weights)

    def tensors(self) -> dict[str, torch.Tensor]:
        store = FLOAT_DTYPES[normalize_dtype(self.settings["storage_dtype"])]
        return {k: (v.to(store) if k in MATRICES else v) for k, v in self.weights.items()}

    def _check(self, tensors: dict[str, torch.Tensor]) -> None:
        r, f, d = int(self.settings["rank"]), self.num_features, self.num_outputs
        expected = {"proj": (f, r), "bias": (r,), "coef": (r, d), "y_mean": (d,)}
        if self.token_residual:
            t = self.target
            hd = t.num_kv_heads * t.head_dim
            fw = 2 * self.token_window * hd
            expected.update({"tok_w": (t.num_layers, fw, 2 * hd), "tok_mean_f": (t.num_layers, fw),
                             "tok_mean_r": (t.num_layers, 2 * hd)})
        if self.key_correction_rank:
            t, kr = self.target, self.key_correction_rank
            expected.update({"key_a": (t.num_layers, t.num_kv_heads, t.head_dim, kr),
                             "key_b": (t.num_layers, t.num_kv_heads, kr, t.head_dim)})
        if self.repair_key_correction_rank:
            t, kr = self.target, self.repair_key_correction_rank
            expected.update({"repair_key_a": (t.num_layers, t.num_kv_heads, t.head_dim, kr),
                             "repair_key_b": (t.num_layers, t.num_kv_heads, kr, t.head_dim)})
        if set(tensors) != set(expected):
            raise MapperArtifactError(f"bottleneck weights: expected {sorted(expected)}, got {sorted(tensors)}")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise MapperArtifactError(f"bottleneck weight {name} has shape {tuple(tensors[name].shape)}, "
                                          f"expected {shape}")
            if not torch.isfinite(tensors[name]).all():
                raise MapperArtifactError(f"bottleneck weight {name} holds non-finite values")

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._check(tensors)
        self.weights = {k: v.float() for k, v in tensors.items()}
        self._repair_deltas = {}

    @torch.no_grad()
    def _translate_batch(self, chunks: list[KVChunk], texts: list[str], target) -> list[KVChunk]:
        if not self.weights:
            raise MapperArtifactError("bottleneck mapper is not fitted")
        dtype = runtime_dtype(self.settings["compute_dtype"])
        w = {k: v.to(dtype) for k, v in self.weights.items()}
        # One pair of matmuls for all chunks of the query: rows of every chunk stacked.
        rows, metas = [], []
        for chunk, text in zip(chunks, texts):
            ids, offsets = target.tokenize(text)
            al = align_tokens(chunk.offsets, offsets, window=1)
            rows.append(all_layer_features(chunk).to(dtype)[al.index[:, 0]])
            metas.append((ids, offsets, al.has_source))
        y = ((torch.cat(rows) @ w["proj"] + w["bias"]) @ w["coef"]) + w["y_mean"]
        out, start = [], 0
        fp = self.target
        for chunk, (ids, offsets, has_source) in zip(chunks, metas):
            part = y[start:start + ids.numel()]
            start += ids.numel()
            part[~has_source] = w["y_mean"]  # a target token with no admissible source: the mean
            keys, values = split_outputs(part.float(), fp.num_layers, fp.num_kv_heads)
            if self.token_residual:
                t = self.weights  # in fp32, as the direct path is
                rk, rv = token_residual(target, ids, t["tok_w"], t["tok_mean_f"], t["tok_mean_r"])
                keys, values = keys + rk, values + rv
            if self.key_correction_rank:
                keys = corrected_keys(keys, self.weights["key_a"], self.weights["key_b"])
            out.append(self._target_chunk(keys, values, ids, offsets, chunk, target))
        return out
