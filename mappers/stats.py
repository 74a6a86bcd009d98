"""Streamed sufficient statistics for per-layer linear maps (float64).

For every target layer ``l`` the accumulator keeps, over all rows seen so far,
``n``, ``Σx``, ``Σy``, ``XᵀX``, ``XᵀY`` and ``YᵀY`` (rows are aligned tokens, ``x``
the source features, ``y`` the target's K or V of that layer). Any least-squares
fit of ``y`` on ``x`` with an intercept, and its error on any other set, follows
from these alone, so activations are never held: memory is
``L·(F² + F·D + D²)`` doubles whatever the corpus size.
"""

from __future__ import annotations

import torch


class MomentAccumulator:
    def __init__(self, layers: int, features: int, outputs: int) -> None:
        self.layers, self.features, self.outputs = layers, features, outputs
        f64 = torch.float64
        self.n = torch.zeros((), dtype=f64)
        self.sx = torch.zeros(layers, features, dtype=f64)
        self.sy = torch.zeros(layers, outputs, dtype=f64)
        self.sxx = torch.zeros(layers, features, features, dtype=f64)
        self.sxy = torch.zeros(layers, features, outputs, dtype=f64)
        self.syy = torch.zeros(layers, outputs, outputs, dtype=f64)

    _FIELDS = ("n", "sx", "sy", "sxx", "sxy", "syy")

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows: ``x [L, rows, F]``, ``y [L, rows, D]``."""
        if x.dim() != 3 or x.shape[0] != self.layers or x.shape[2] != self.features:
            raise ValueError(f"x must be [{self.layers}, rows, {self.features}], got {tuple(x.shape)}")
        if y.shape != (self.layers, x.shape[1], self.outputs):
            raise ValueError(f"y must be [{self.layers}, {x.shape[1]}, {self.outputs}], got {tuple(y.shape)}")
        if x.shape[1] == 0:
            return
        x = x.to(torch.float64)
        y = y.to(torch.float64)
        xt = x.transpose(1, 2)
        self.n += x.shape[1]
        self.sx += x.sum(1)
        self.sy += y.sum(1)
        self.sxx.baddbmm_(xt, x)
        self.sxy.baddbmm_(xt, y)
        self.syy.baddbmm_(y.transpose(1, 2), y)

    # ------------------------------------------------------------ moments

    @property
    def count(self) -> int:
        return int(self.n.item())

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(self.n.item(), 1.0)
        return self.sx / n, self.sy / n

    def centered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Centred scatter matrices ``Cxx, Cxy, Cyy`` (sums, not divided by n)."""
        mx, my = self.means()
        n = self.n
        cxx = self.sxx - n * mx[:, :, None] * mx[:, None, :]
        cxy = self.sxy - n * mx[:, :, None] * my[:, None, :]
        cyy = self.syy - n * my[:, :, None] * my[:, None, :]
        return cxx, cxy, cyy

    def sse(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``[L, D]`` sum of squared errors of ``ŷ = x W + b`` over the rows seen.

        weight ``[L, F, D]``, bias ``[L, D]`` (float64).
        """
        w, b = weight.to(torch.float64), bias.to(torch.float64)
        syy = torch.diagonal(self.syy, dim1=1, dim2=2)
        cross = (w * self.sxy).sum(1)                       # Σ y·(xW)
        quad = (w * torch.bmm(self.sxx, w)).sum(1)          # Σ (xW)²
        xw = torch.bmm(self.sx[:, None, :], w)[:, 0]       # Σ xW
        return syy - 2 * cross - 2 * b * self.sy + quad + 2 * b * xw + self.n * b * b

    def sst(self) -> torch.Tensor:
        """``[L, D]`` total sum of squares around these rows' own mean."""
        _, my = self.means()
        return torch.diagonal(self.syy, dim1=1, dim2=2) - self.n * my * my

    # ------------------------------------------------------- checkpointing

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {prefix + k: getattr(self, k).clone() for k in self._FIELDS}

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        for k in self._FIELDS:
            t = state[prefix + k]
            if t.shape != getattr(self, k).shape:
                raise ValueError(f"checkpoint {prefix + k} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(getattr(self, k).shape)}")
            setattr(self, k, t.to(torch.float64).clone())

    def equal(self, other: "MomentAccumulator", *, rtol: float = 1e-9, atol: float = 1e-9) -> bool:
        return all(torch.allclose(getattr(self, k), getattr(other, k), rtol=rtol, atol=atol)
                   for k in self._FIELDS)
