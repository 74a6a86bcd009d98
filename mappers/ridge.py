"""KV Ridge: closed-form ridge regression per target layer and KV head.

What is fitted, for each kind (keys, values) and each target layer ``l``:
``ŷ = (x − μx) W_l + μy`` with ``x`` the aligned features of `mappers.linear`
(the window of source layers, all source KV heads, de-rotated keys or values)
and ``y`` the target layer's de-rotated keys or values. For every target KV head
``h`` (a block of ``Dt`` output columns) the ridge strength is chosen separately::

    W_l[:, h] = (Cxx + λ_{l,h} · τ_l · I)⁻¹ Cxy[:, h],     τ_l = tr(Cxx) / F

where ``Cxx``/``Cxy`` are the centred scatter matrices from the streamed
statistics and ``τ_l`` makes the grid ``lambdas`` scale-free (relative to the mean
feature variance). ``λ_{l,h}`` minimises the held-out squared error of head ``h``,
computed exactly from the held-out statistics (no activations kept). All
λ of the grid are solved at once from one eigendecomposition of ``Cxx``.
Without held-out data the setting ``default_lambda`` is used.
"""

from __future__ import annotations

from typing import Any

import torch

from mappers.base import register_mapper
from mappers.linear import KINDS, LinearKVMapper, heldout_r2
from mappers.stats import MomentAccumulator


def ridge_path(train: MomentAccumulator, lambdas) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge solutions for every λ: weights ``[G, L, F, D]`` and biases ``[G, L, D]`` (float64)."""
    cxx, cxy, _ = train.centered()
    mx, my = train.means()
    f = cxx.shape[-1]
    tau = torch.diagonal(cxx, dim1=1, dim2=2).sum(-1) / f            # [L]
    evals, evecs = torch.linalg.eigh(cxx)                             # [L, F], [L, F, F]
    evals = evals.clamp_min(0.0)
    qty = evecs.transpose(1, 2) @ cxy                                 # [L, F, D]
    weights, biases = [], []
    for lam in lambdas:
        inv = 1.0 / (evals + float(lam) * tau[:, None] + 1e-300)     # [L, F]
        w = evecs @ (inv[:, :, None] * qty)
        weights.append(w)
        biases.append(my - torch.bmm(mx[:, None, :], w)[:, 0])
    return torch.stack(weights), torch.stack(biases)


@register_mapper
class RidgeMapper(LinearKVMapper):
    method = "ridge"

    @classmethod
    def extra_defaults(cls) -> dict[str, Any]:
        return {"default_lambda": 1e-2}

    def __init__(self, source, target, settings=None) -> None:
        super().__init__(source, target, settings)
        self.weight: dict[str, torch.Tensor] = {}

    def project(self, kind: str, x_centered: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x_centered, self.weight[kind].to(x_centered.dtype))

    def _weight_names(self) -> dict[str, tuple[int, ...]]:
        shape = (self.target.num_layers, self.num_features, self.num_outputs)
        return {f"{kind}.weight": shape for kind in KINDS}

    def _weights(self) -> dict[str, torch.Tensor]:
        return {f"{kind}.weight": self.weight[kind] for kind in KINDS}

    def _set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight = {kind: tensors[f"{kind}.weight"] for kind in KINDS}

    def fit_from_stats(self, train: dict[str, MomentAccumulator],
                       heldout: dict[str, MomentAccumulator] | None = None) -> dict[str, Any]:
        heads, dt = self.target.num_kv_heads, self.target.head_dim
        report: dict[str, Any] = {}
        for kind in KINDS:
            acc = train[kind]
            if acc.count < 2:
                raise ValueError(f"ridge needs at least 2 aligned rows, got {acc.count}")
            mx, my = acc.means()
            ho = heldout[kind] if heldout is not None and heldout[kind].count > 0 else None
            lambdas = [float(v) for v in self.settings["lambdas"]] if ho is not None \
                else [float(self.settings["default_lambda"])]
            ws, bs = ridge_path(acc, lambdas)                               # [G, L, F, D], [G, L, D]
            L, F, D = ws.shape[1:]
            if ho is not None:
                sse = torch.stack([ho.sse(ws[g], bs[g]) for g in range(len(lambdas))])   # [G, L, D]
                sse_h = sse.reshape(len(lambdas), L, heads, dt).sum(-1)                  # [G, L, H]
                best = sse_h.argmin(0)                                                   # [L, H]
            else:
                best = torch.zeros(L, heads, dtype=torch.long)
            col_best = best.repeat_interleave(dt, dim=1)                                # [L, D]
            w = torch.gather(ws, 0, col_best[None, :, None, :].expand(1, L, F, D))[0]
            b = torch.gather(bs, 0, col_best[None]).squeeze(0)
            self.weight[kind] = w.float()
            self.x_mean[kind] = mx.float()
            self.y_mean[kind] = my.float()
            lam = torch.tensor(lambdas, dtype=torch.float64)[best]
            entry = {"lambda": lam.tolist()}
            if ho is not None:
                r2 = heldout_r2(ho, w, b, heads)
                entry["heldout_r2_per_layer"] = r2.mean(1).tolist()
                entry["heldout_r2"] = float(r2.mean())
            report[kind] = entry
        return report
