"""Dense Latent: a shared low-rank (canonical) latent space per target layer.

What is fitted, for each kind (keys, values) and each target layer ``l``, from
the centred scatter matrices ``Cxx`` (source features, see `mappers.linear`),
``Cyy`` (the target layer's K or V, all heads) and ``Cxy``:

1. Regularised canonical correlation analysis. With
   ``Rx = (Cxx + λ τx I)^{-1/2}`` and ``Ry = (Cyy + μ τy I)^{-1/2}`` (τ = mean
   variance, λ from the grid ``lambdas``, μ = ``target_reg``), take the SVD
   ``Rx Cxy Ry = U S Vᵀ``. The latent of a source row is ``z = (x − μx) E`` with the
   encoder ``E = Rx U_r`` (``r = rank``): its coordinates are the r source
   directions most correlated with the target's cache, i.e. the space both
   caches share.
2. Reconstruction of the target from the latent by least squares:
   ``Dec = (Eᵀ Cxx E)⁻¹ Eᵀ Cxy``, so ``ŷ = z Dec + μy``.

Translation is two batched matmuls (``[T, F]·[F, r]`` then ``[T, r]·[r, D]``), cheaper
than ridge's ``[F, D]`` when ``r`` is small. λ is chosen per target layer (the latent
is shared by the layer's heads) on held-out statistics.
"""

from __future__ import annotations

from typing import Any

import torch

from mappers.base import register_mapper
from mappers.linear import KINDS, LinearKVMapper, heldout_r2
from mappers.stats import MomentAccumulator


def _inv_sqrt(c: torch.Tensor, reg: float) -> torch.Tensor:
    f = c.shape[-1]
    tau = torch.diagonal(c, dim1=1, dim2=2).sum(-1) / f
    evals, evecs = torch.linalg.eigh(c)
    d = (evals.clamp_min(0.0) + reg * tau[:, None] + 1e-300).rsqrt()
    return evecs @ (d[:, :, None] * evecs.transpose(1, 2))


def cca_latent(train: MomentAccumulator, rank: int, lam: float, target_reg: float):
    """Encoder ``[L, F, r]``, decoder ``[L, r, D]``, bias ``[L, D]`` and canonical correlations."""
    cxx, cxy, cyy = train.centered()
    mx, my = train.means()
    rx = _inv_sqrt(cxx, lam)
    ry = _inv_sqrt(cyy, target_reg)
    u, s, _ = torch.linalg.svd(rx @ cxy @ ry, full_matrices=False)
    r = min(rank, u.shape[-1])
    enc = rx @ u[:, :, :r]                                              # [L, F, r]
    gram = enc.transpose(1, 2) @ cxx @ enc                              # [L, r, r]
    eye = torch.eye(r, dtype=gram.dtype)
    scale = torch.diagonal(gram, dim1=1, dim2=2).mean(-1)[:, None, None]
    dec = torch.linalg.solve(gram + 1e-10 * scale * eye, enc.transpose(1, 2) @ cxy)   # [L, r, D]
    w = enc @ dec
    bias = my - torch.bmm(mx[:, None, :], w)[:, 0]
    return enc, dec, bias, s[:, :r]


@register_mapper
class LatentMapper(LinearKVMapper):
    method = "latent"

    @classmethod
    def extra_defaults(cls) -> dict[str, Any]:
        return {"rank": 64, "target_reg": 1e-3, "default_lambda": 1e-2}

    def __init__(self, source, target, settings=None) -> None:
        super().__init__(source, target, settings)
        self.encoder: dict[str, torch.Tensor] = {}
        self.decoder: dict[str, torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return min(int(self.settings["rank"]), self.num_features, self.num_outputs)

    def project(self, kind: str, x_centered: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(x_centered, self.encoder[kind].to(x_centered.dtype))
        return torch.bmm(z, self.decoder[kind].to(x_centered.dtype))

    def _weight_names(self) -> dict[str, tuple[int, ...]]:
        lt = self.target.num_layers
        out = {}
        for kind in KINDS:
            out[f"{kind}.encoder"] = (lt, self.num_features, self.rank)
            out[f"{kind}.decoder"] = (lt, self.rank, self.num_outputs)
        return out

    def _weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind in KINDS:
            out[f"{kind}.encoder"] = self.encoder[kind]
            out[f"{kind}.decoder"] = self.decoder[kind]
        return out

    def _set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.encoder = {k: tensors[f"{k}.encoder"] for k in KINDS}
        self.decoder = {k: tensors[f"{k}.decoder"] for k in KINDS}

    def fit_from_stats(self, train: dict[str, MomentAccumulator],
                       heldout: dict[str, MomentAccumulator] | None = None) -> dict[str, Any]:
        heads = self.target.num_kv_heads
        report: dict[str, Any] = {}
        for kind in KINDS:
            acc = train[kind]
            if acc.count < 2:
                raise ValueError(f"latent needs at least 2 aligned rows, got {acc.count}")
            mx, my = acc.means()
            ho = heldout[kind] if heldout is not None and heldout[kind].count > 0 else None
            lambdas = [float(v) for v in self.settings["lambdas"]] if ho is not None \
                else [float(self.settings["default_lambda"])]
            fits = [cca_latent(acc, self.rank, lam, float(self.settings["target_reg"])) for lam in lambdas]
            L = acc.layers
            if ho is not None:
                sse = torch.stack([ho.sse(e @ d, b).sum(-1) for e, d, b, _ in fits])   # [G, L]
                best = sse.argmin(0)
            else:
                best = torch.zeros(L, dtype=torch.long)
            enc = torch.stack([fits[int(best[l])][0][l] for l in range(L)])
            dec = torch.stack([fits[int(best[l])][1][l] for l in range(L)])
            bias = torch.stack([fits[int(best[l])][2][l] for l in range(L)])
            corr = torch.stack([fits[int(best[l])][3][l] for l in range(L)])
            self.encoder[kind], self.decoder[kind] = enc.float(), dec.float()
            self.x_mean[kind], self.y_mean[kind] = mx.float(), my.float()
            entry = {"lambda": [lambdas[int(g)] for g in best], "rank": self.rank,
                     "top_canonical_corr": corr[:, 0].tolist()}
            if ho is not None:
                r2 = heldout_r2(ho, enc @ dec, bias, heads)
                entry["heldout_r2_per_layer"] = r2.mean(1).tolist()
                entry["heldout_r2"] = float(r2.mean())
            report[kind] = entry
        return report
