"""The lab's nonlinear lever (`+mlp<h>`): a small per-layer network over the bottleneck.

Every linear map the lab fitted (PCA, reduced-rank, full ridge, with the target's own
direct path of tokens t and t−1 beside it) finds 0 of the 48 code needles, whose answers
must be copied token by token. What a copy reads is which token sat at each position, and
a linear function of a 352-wide bottleneck and two tokens' direct paths may not say that
precisely enough. This lever tests whether *nonlinear* capacity does: per target layer l,

    r_l = W2_l · gelu(W1_l · [z, f_l] + b1_l) + b2_l

added to a linear variant's keys and values, where z is the variant's bottleneck (the
source's all-layer K/V in its r directions) and f_l the target's direct path of tokens t
and t−1 at layer l (`mappers.bottleneck.direct_features`). It is fitted by squared error on
the lab's rows, each target layer's keys and values weighted alike (as reduced-rank
regression weights them), with Adam, held-out contexts choosing the epoch. W2 starts at 0,
so epoch 0 *is* the linear variant. Trained weights are cached under the lab.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from eval.lab.variants import Variant, context_rows, fit_cache, is_heldout_context, residual_rows
from mappers.bottleneck import direct_features, split_residual


class PerLayerMLP(torch.nn.Module):
    """``L`` independent two-layer networks, batched: ``[L, N, in]`` → ``[L, N, out]``."""

    def __init__(self, layers: int, d_in: int, hidden: int, d_out: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(layers, d_in, hidden, generator=g) / d_in ** 0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(layers, 1, hidden))
        self.w2 = torch.nn.Parameter(torch.zeros(layers, hidden, d_out))   # starts as the linear variant
        self.b2 = torch.nn.Parameter(torch.zeros(layers, 1, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.b2, torch.nn.functional.gelu(torch.baddbmm(self.b1, x, self.w1)), self.w2)


def _linear_of(variant):
    return getattr(variant, "base", variant)  # a token-residual variant wraps its linear map


def _inputs(z: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``[L, T, r + F]``: the shared bottleneck beside each layer's direct-path features."""
    return torch.cat([z[None].expand(f.shape[0], -1, -1), f], -1)


def collect_rows(base, lab: Path, source, target) -> dict[str, torch.Tensor]:
    """Every lab row's bottleneck z, direct features f and the base variant's residual r, with a
    held-out flag per row (the lab's held-out contexts). fp16 storage: 61k rows of Qwen2.5 take ~2.3 GB."""
    zs, fs, rs, held = [], [], [], []
    for ctx, item, y, ids, pos in context_rows(lab, source, target, "lab mlp rows"):
        res = residual_rows(y, *base.translate_rows(item, target, ids, pos))            # [L, T', 2HD]
        zs.append(_linear_of(base).bottleneck(item))
        fs.append(direct_features(target, ids, 2)[:, pos].half())
        rs.append(res.half())
        held.append(torch.full((res.shape[1],), is_heldout_context(ctx)))
    return {"z": torch.cat(zs).float(), "f": torch.cat(fs, 1), "r": torch.cat(rs, 1), "held": torch.cat(held)}


def fit_mlp(rows: dict[str, torch.Tensor], hidden: int, *, epochs: int = 12, batch: int = 256, lr: float = 1e-3,
            weight_decay: float = 1e-4, log=print) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Train the per-layer network on the rows; the epoch with the least held-out weighted error wins.
    Returns its state (with the input/output normalisation folded in as tensors) and the history."""
    z, f, r, held = rows["z"], rows["f"], rows["r"], rows["held"]
    L, d_out = r.shape[0], r.shape[2]
    tr, ho = (~held).nonzero().flatten(), held.nonzero().flatten()
    # inputs standardised per feature; outputs weighted so each layer's keys and values count alike
    x_mean = torch.cat([z[tr].mean(0).expand(L, -1), f[:, tr].float().mean(1)], -1)[:, None, :]
    x_sd = torch.cat([z[tr].std(0).expand(L, -1), f[:, tr].float().std(1)], -1).clamp_min(1e-6)[:, None, :]
    half = d_out // 2
    r_var = r[:, tr].float().var(1)                                                       # [L, d_out]
    w_out = torch.cat([r_var[:, :half].mean(-1, keepdim=True).expand(-1, half),
                       r_var[:, half:].mean(-1, keepdim=True).expand(-1, half)], -1).rsqrt()[:, None, :]
    net = PerLayerMLP(L, x_mean.shape[-1], hidden, d_out)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * ((len(tr) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        x = (_inputs(z[idx], f[:, idx].float()) - x_mean) / x_sd
        return (((net(x) - r[:, idx].float()) * w_out) ** 2).mean()

    def heldout() -> float:
        with torch.no_grad():
            return sum(float(batch_loss(ho[i:i + 2048])) * len(ho[i:i + 2048]) for i in range(0, len(ho), 2048)) / len(ho)

    base_err = heldout()   # W2 = 0: the base variant's own weighted error
    history = [{"epoch": 0, "heldout": base_err}]
    best, best_state = base_err, {k: v.detach().clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for epoch in range(1, epochs + 1):
        started, total = time.perf_counter(), 0.0
        order = tr[torch.randperm(len(tr), generator=g)]
        for i in range(0, len(order), batch):
            loss = batch_loss(order[i:i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(order[i:i + batch])
        err = heldout()
        history.append({"epoch": epoch, "train": total / len(tr), "heldout": err,
                        "seconds": round(time.perf_counter() - started, 1)})
        log(f"lab mlp{hidden}: epoch {epoch}/{epochs} train {total / len(tr):.4f} held-out {err:.4f} "
            f"(linear {base_err:.4f}) {time.perf_counter() - started:.0f}s")
        if err < best:
            best, best_state = err, {k: v.detach().clone() for k, v in net.state_dict().items()}
    state = {**best_state, "x_mean": x_mean, "x_sd": x_sd}
    return state, history


class MLPResidualVariant(Variant):
    """A linear (or token-residual) variant plus the fitted per-layer network (`fit_mlp`)."""

    def __init__(self, base, base_name: str, lab: Path, source, target, hidden: int) -> None:
        from safetensors.torch import load_file, save_file

        self.base, self.train_rows, self.hidden_width = base, base.train_rows, hidden
        path = fit_cache(lab, "mlp_residual", f"{base_name}.mlp{hidden}")
        if path.exists():
            state = load_file(str(path))
            self.history = json.loads(path.with_suffix(".json").read_text())
        else:
            rows = collect_rows(base, lab, source, target)
            state, self.history = fit_mlp(rows, hidden, log=lambda s: print(s, file=sys.stderr, flush=True))
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
            path.with_suffix(".json").write_text(json.dumps(self.history))
        self.x_mean, self.x_sd = state.pop("x_mean"), state.pop("x_sd")
        L, d_in, _ = state["w1"].shape
        self.net = PerLayerMLP(L, d_in, hidden, state["w2"].shape[-1])
        self.net.load_state_dict(state)
        self.net.requires_grad_(False)

    def describe(self) -> str:
        h = self.history
        best = min(h, key=lambda e: e["heldout"])
        params = sum(p.numel() for p in self.net.parameters())
        return (f"{self.base.describe()}, + per-layer MLP (hidden {self.hidden_width}, {params / 1e6:.1f} M parameters) "
                f"over [bottleneck, direct path of t, t−1]: held-out weighted error {h[0]['heldout']:.4f} → "
                f"{best['heldout']:.4f} (epoch {best['epoch']} of {len(h) - 1})")

    def translate(self, item: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.base.translate(item, target)
        z = _linear_of(self.base).bottleneck(item)
        f = direct_features(target, item["token_ids"], 2)
        with torch.no_grad():
            r = self.net((_inputs(z, f) - self.x_mean) / self.x_sd)
        rk, rv = split_residual(r, target.fingerprint.num_kv_heads)
        has = item["has_source"]
        rk[:, :, ~has], rv[:, :, ~has] = 0, 0   # rows without a source token keep the base's mean
        return keys + rk, values + rv
