"""Shared machinery of the linear mappers (KV Ridge, Dense Latent).

Features. For target layer ``l`` with aligned source layers ``S(l)`` (a window of
``W`` layers, `mappers.layer_alignment`) and target token ``t`` with aligned source
tokens ``A(t)`` (a window of ``w`` tokens, `mappers.token_alignment`), the feature
row is the concatenation, over ``s ∈ S(l)``, ``a ∈ A(t)`` and every source KV head,
of the source's de-rotated keys (for the key map) or values (for the value map):
``F = W · w · Hs · Ds`` numbers. The output row is the target layer's keys
(de-rotated) or values, all its KV heads concatenated: ``D = Ht · Dt``.

Every mapper here is affine per target layer: ``ŷ = (x − μx) M + μy``, where ``M``
is ``[F, D]`` (ridge) or a product ``E·Dec`` of rank r (latent). Maps of all
layers are stacked, so translating a chunk is one batched matmul per kind
(keys, values), over all layers and heads at once, in ``compute_dtype``.
Window slots without an admissible source token take the feature mean μx, so
they contribute nothing; a token with no source at all is predicted as μy.
"""

from __future__ import annotations

from typing import Any

import torch

from cag.kv import FLOAT_DTYPES, KVChunk, ModelFingerprint, normalize_dtype
from mappers.base import Mapper, MapperArtifactError, runtime_dtype
from mappers.layer_alignment import align_layers
from mappers.stats import MomentAccumulator
from mappers.token_alignment import TokenAlignment, align_tokens

KINDS = ("keys", "values")

DEFAULT_SETTINGS: dict[str, Any] = {
    "layer_radius": 1,
    "token_window": 1,
    "compute_dtype": "bfloat16",
    # weights are written in fp16: half the bytes of fp32 (the 20 MB artifact budget),
    # and more mantissa than the bf16 they are applied in
    "storage_dtype": "float16",
    # ridge strengths, relative to the mean feature variance (scale-free grid)
    "lambdas": [1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0],
}


def flatten_heads(kv: torch.Tensor) -> torch.Tensor:
    """``[layers, heads, tokens, dim]`` → ``[layers, tokens, heads·dim]``."""
    layers, heads, tokens, dim = kv.shape
    return kv.permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)


def unflatten_heads(flat: torch.Tensor, heads: int) -> torch.Tensor:
    layers, tokens, hd = flat.shape
    return flat.reshape(layers, tokens, heads, hd // heads).permute(0, 2, 1, 3)


def gather_features(source_kv: torch.Tensor, layer_index: torch.Tensor, alignment: TokenAlignment,
                    fill: torch.Tensor | None = None) -> torch.Tensor:
    """``[Lt, Tt, F]`` features for all target layers and tokens (see module doc).

    `fill` ``[Lt, F]``: value for invalid window slots (the feature mean); zeros if None.
    """
    flat = flatten_heads(source_kv)                          # [Ls, Ts, HD]
    hd = flat.shape[2]
    tok = flat[:, alignment.index]                           # [Ls, Tt, w, HD]
    x = tok[layer_index]                                     # [Lt, W, Tt, w, HD]
    x = x.permute(0, 2, 1, 3, 4)                             # [Lt, Tt, W, w, HD]
    lt, tt, wl, wt, _ = x.shape
    if not bool(alignment.valid.all()):
        mask = alignment.valid[None, :, None, :, None]
        if fill is None:
            fill_t = torch.zeros((), dtype=x.dtype)
        else:
            fill_t = fill.to(x.dtype).reshape(lt, 1, wl, wt, hd)
        x = torch.where(mask, x, fill_t)
    return x.reshape(lt, tt, wl * wt * hd)


@torch.no_grad()
def direct_path(target, ids: torch.Tensor, kind: str) -> torch.Tensor:
    """``[Lt, T, D]``: each target token's embedding through every layer's input norm and
    k (or v) projection, as if nothing else were in the residual stream (fp32);
    ``kind="both"`` gives keys then values ``[Lt, T, 2D]`` with each norm computed once.

    The target's own view of *which token* sits at each position, in that layer's
    K/V space (keys before RoPE, i.e. de-rotated); a source model with another
    tokenizer cannot supply it, and copying or matching a rare name needs it.
    """
    model = target.model.model
    h = model.embed_tokens(ids[None].to(target.device))
    out = []
    for layer in model.layers:
        x = layer.input_layernorm(h)
        attn = layer.self_attn
        parts = []
        if kind in ("keys", "both"):
            y = attn.k_proj(x)
            if getattr(attn, "k_norm", None) is not None:  # Gemma 3 normalises each key head
                y = attn.k_norm(y.view(*y.shape[:2], -1, attn.head_dim)).flatten(2)
            parts.append(y)
        if kind in ("values", "both"):
            parts.append(attn.v_proj(x))
        out.append(torch.cat(parts, -1)[0].float())
    return torch.stack(out).cpu()


class LinearKVMapper(Mapper):
    """Base of affine per-layer mappers; subclasses implement `fit_from_stats`."""

    def __init__(self, source: ModelFingerprint, target: ModelFingerprint,
                 settings: dict[str, Any] | None = None) -> None:
        super().__init__(source, target, {**DEFAULT_SETTINGS, **self.extra_defaults(), **(settings or {})})
        self.layer_index = align_layers(source.num_layers, target.num_layers,
                                        radius=int(self.settings["layer_radius"]))
        self.x_mean: dict[str, torch.Tensor] = {}
        self.y_mean: dict[str, torch.Tensor] = {}

    @classmethod
    def extra_defaults(cls) -> dict[str, Any]:
        return {}

    # ----------------------------------------------------------- geometry

    @property
    def num_source_features(self) -> int:
        s = self.source
        return self.layer_index.shape[1] * int(self.settings["token_window"]) * s.num_kv_heads * s.head_dim

    @property
    def target_token_window(self) -> int:
        return int(self.settings.get("target_token_window", 0))

    @property
    def num_features(self) -> int:
        return self.num_source_features + self.target_token_window * self.num_outputs

    def features(self, kind: str, chunk: KVChunk, alignment: TokenAlignment, target, target_ids: torch.Tensor,
                 *, dtype: torch.dtype, fill: torch.Tensor | None = None) -> torch.Tensor:
        """``[Lt, Tt, F]``: the source features, then (``target_token_window`` = w > 0) the
        target's direct path of tokens t, t−1, …, t−w+1 (`direct_path`). Slots before the
        chunk's first token take `fill` (the feature mean) or zeros."""
        ns = self.num_source_features
        x = gather_features(getattr(chunk, kind).to(dtype), self.layer_index, alignment,
                            fill=None if fill is None else fill[:, :ns])
        w = self.target_token_window
        if not w:
            return x
        direct = direct_path(target, target_ids, kind).to(dtype)                 # [L, T, D]
        parts = [x]
        d = self.num_outputs
        for back in range(w):
            shifted = torch.roll(direct, back, dims=1)
            if back:
                shifted[:, :back] = 0 if fill is None else fill[:, None, ns + back * d: ns + (back + 1) * d].to(dtype)
            parts.append(shifted)
        return torch.cat(parts, dim=-1)

    @property
    def num_outputs(self) -> int:
        return self.target.num_kv_heads * self.target.head_dim

    def new_accumulators(self) -> dict[str, MomentAccumulator]:
        return {k: MomentAccumulator(self.target.num_layers, self.num_features, self.num_outputs) for k in KINDS}

    def align(self, source_offsets, target_offsets) -> TokenAlignment:
        return align_tokens(source_offsets, target_offsets, window=int(self.settings["token_window"]))

    def training_rows(self, chunk: KVChunk, native: KVChunk, target=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Aligned (features, targets) of one text for both kinds; rows with a full window only."""
        alignment = self.align(chunk.offsets, native.offsets)
        keep = alignment.fully_valid.clone()
        keep[: max(self.target_token_window - 1, 0)] = False  # no token before the chunk's first
        rows = {}
        for kind in KINDS:
            x = self.features(kind, chunk, alignment, target, native.token_ids, dtype=torch.float32)[:, keep]
            y = flatten_heads(getattr(native, kind).float())[:, keep]
            rows[kind] = (x, y)
        return rows

    # ---------------------------------------------------------- inference

    @property
    def compute_dtype(self) -> torch.dtype:
        return runtime_dtype(self.settings["compute_dtype"])

    def _require_fitted(self) -> None:
        if not self.x_mean:
            raise MapperArtifactError(f"{self.method} mapper is not fitted")

    def project(self, kind: str, x_centered: torch.Tensor) -> torch.Tensor:
        """``[Lt, T, F]`` centred features → ``[Lt, T, D]`` centred outputs."""
        raise NotImplementedError

    @torch.no_grad()
    def _translate_batch(self, chunks: list[KVChunk], texts: list[str], target) -> list[KVChunk]:
        """All chunks of one query at once: their feature rows are concatenated along the
        tokens, so each kind is one projection (and one cast of the weights to the compute
        dtype) for the whole batch instead of one per chunk; the rows are split back after.
        Every row's features and outputs are those of translating its chunk alone (up to
        the matmul's float rounding: tests/unit/test_query_path_fast.py)."""
        self._require_fitted()
        if not chunks:
            return []
        dtype = self.compute_dtype
        encoded = [target.tokenize(text) for text in texts]
        alignments = [self.align(chunk.offsets, offsets) for chunk, (_, offsets) in zip(chunks, encoded)]
        sizes = [ids.numel() for ids, _ in encoded]
        has_source = torch.cat([a.has_source for a in alignments])
        kv: dict[str, list[torch.Tensor]] = {}
        for kind in KINDS:
            x = torch.cat([self.features(kind, chunk, alignment, target, ids, dtype=dtype, fill=self.x_mean[kind])
                           for chunk, alignment, (ids, _) in zip(chunks, alignments, encoded)], dim=1)
            y_mean = self.y_mean[kind].to(dtype)[:, None, :]
            y = self.project(kind, x.sub_(self.x_mean[kind].to(dtype)[:, None, :])).add_(y_mean)
            if not bool(has_source.all()):
                y[:, ~has_source] = y_mean
            kv[kind] = [unflatten_heads(part, self.target.num_kv_heads).to(torch.float32,
                                                                           memory_format=torch.contiguous_format)
                        for part in y.split(sizes, dim=1)]
        return [self._target_chunk(keys, values, ids, offsets, chunk, target)
                for keys, values, (ids, offsets), chunk in zip(kv["keys"], kv["values"], encoded, chunks)]

    # ------------------------------------------------------------- weights

    def _weight_names(self) -> dict[str, tuple[int, ...]]:
        """Expected tensor names and shapes, besides the means."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind in KINDS:
            out[f"{kind}.x_mean"] = self.x_mean[kind].float()
            out[f"{kind}.y_mean"] = self.y_mean[kind].float()
        store = FLOAT_DTYPES[normalize_dtype(self.settings.get("storage_dtype", "float32"))]
        out.update({name: t.to(store) for name, t in self._weights().items()})
        return out

    def round_to_storage(self) -> None:
        """Round the weights to their storage dtype, so that the fitted mapper in
        memory (and the fidelity measured on it) is exactly the one saved."""
        self._set_weights({name: t.to(FLOAT_DTYPES[normalize_dtype(self.settings.get("storage_dtype", "float32"))])
                           .float() for name, t in self._weights().items()})

    def _weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        lt, f, d = self.target.num_layers, self.num_features, self.num_outputs
        expected = {}
        for kind in KINDS:
            expected[f"{kind}.x_mean"] = (lt, f)
            expected[f"{kind}.y_mean"] = (lt, d)
        expected.update(self._weight_names())
        missing = set(expected) - set(tensors)
        extra = set(tensors) - set(expected)
        if missing or extra:
            raise MapperArtifactError(f"{self.method} weights: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != tuple(shape):
                raise MapperArtifactError(f"{self.method} weight {name} has shape "
                                          f"{tuple(tensors[name].shape)}, expected {tuple(shape)}")
            if not torch.isfinite(tensors[name]).all():
                raise MapperArtifactError(f"{self.method} weight {name} holds non-finite values")
        for kind in KINDS:
            self.x_mean[kind] = tensors[f"{kind}.x_mean"].float()
            self.y_mean[kind] = tensors[f"{kind}.y_mean"].float()
        self._set_weights({k: v.float() for k, v in tensors.items() if k in self._weight_names()})

    # ----------------------------------------------------------------- fit

    def fit_from_stats(self, train: dict[str, MomentAccumulator],
                       heldout: dict[str, MomentAccumulator] | None = None) -> dict[str, Any]:
        """Fit from streamed statistics; returns a report (chosen λ, held-out R² per layer)."""
        raise NotImplementedError


def heldout_r2(acc: MomentAccumulator, weight: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    """``[L, heads]`` R² on the held-out rows of `acc` (per target layer and head)."""
    sse = acc.sse(weight, bias)
    sst = acc.sst()
    L, D = sse.shape
    sse_h = sse.reshape(L, heads, D // heads).sum(-1)
    sst_h = sst.reshape(L, heads, D // heads).sum(-1)
    return 1.0 - sse_h / sst_h.clamp_min(1e-30)
