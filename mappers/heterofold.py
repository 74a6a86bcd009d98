"""HeteroFold: ridge, then moment-matched recoloring, then output-aware calibration,
all folded into one affine map per target layer (both models frozen).

1. **Ridge** (`mappers.ridge`): ``ŷ = (x − μx) W + μy`` per target layer, from the
   aligned window of source layers, λ per head on held-out rows.
2. **Recoloring.** Ridge regresses to the mean: its predictions have less spread
   than the target's own K/V, which flattens the target's attention (DESIGN.md's
   probe). For every layer and KV head the closed-form Gaussian transport map
   ``A = Σ̂^{-1/2} (Σ̂^{1/2} Σ Σ̂^{1/2})^{1/2} Σ̂^{-1/2}`` takes the predictions'
   covariance ``Σ̂ = Wᵀ Cxx W / n`` to the target's ``Σ = Cyy / n`` (both from the
   streamed statistics). It is symmetric positive definite: of all maps that
   match the moments it moves the predictions least. ``W ← W A`` per head.
3. **Output-aware calibration**, with the frozen target in the loop. On
   calibration texts split into context and continuation, the target's own
   queries of the continuation attend over ``[sink, context, continuation]``,
   once with its native K/V and once with the translated context. Trained, per
   layer and kind: ``M = diag(s) + U V`` (rank ``calib_rank``) and a bias ``b``
   applied to the recoloured prediction, ``y = (x − μx) W A M + μy + b``. The key
   loss is KL(native ‖ translated) of the attention distributions (what the
   target attends to); the value loss is the relative error of the attention
   outputs after ``o_proj`` (what it reads). No gradient flows through the
   model: only its attention is replayed, from captured queries.

The three stages fold into the ridge tensors (``W ← W A M``, ``μy ← μy + b``),
so the artifact has exactly a ridge mapper's tensors and translation costs
what ridge costs: one matmul per kind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from cag.models.attention import attention_logits, capture_attention
from mappers.base import register_mapper
from mappers.fidelity import split_continuation
from mappers.linear import KINDS, unflatten_heads
from mappers.ridge import RidgeMapper
from mappers.stats import MomentAccumulator
from mappers.training import TrainConfig, train


def _sqrtm_psd(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Square root and inverse square root of symmetric PSD matrices ``[..., d, d]``."""
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(0.0)
    root = evals.sqrt()
    inv = torch.where(root > 0, 1.0 / root.clamp_min(1e-300), torch.zeros_like(root))
    def compose(d):
        return (evecs * d[..., None, :]) @ evecs.transpose(-1, -2)
    return compose(root), compose(inv)


def gaussian_transport(pred_cov: torch.Tensor, target_cov: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The SPD map ``A`` with ``Aᵀ Σ̂ A = Σ`` (batched ``[..., d, d]``, float64).

    `eps` (relative to the mean variance) regularises a rank-deficient ``Σ̂``.
    """
    d = pred_cov.shape[-1]
    eye = torch.eye(d, dtype=pred_cov.dtype)
    scale = torch.diagonal(pred_cov, dim1=-2, dim2=-1).mean(-1)[..., None, None]
    sigma_hat = pred_cov + eps * scale * eye
    root, inv_root = _sqrtm_psd(sigma_hat)
    middle, _ = _sqrtm_psd(root @ target_cov @ root)
    a = inv_root @ middle @ inv_root
    return 0.5 * (a + a.transpose(-1, -2))


def quote_continuation(context: str, fallback: str, words: int = 16) -> str:
    """A continuation that repeats a span of the context (chosen by a hash of it).

    Plain continuations mostly attend nearby; a quote makes the target's queries
    look a span up in the context, the attention a question needs to find a fact.
    """
    tokens = context.split()
    if len(tokens) < 2 * words:
        return fallback
    start = int(hashlib.sha256(context.encode()).hexdigest(), 16) % (len(tokens) - words)
    return " As it says: " + " ".join(tokens[start:start + words])


@register_mapper
class HeteroFoldMapper(RidgeMapper):
    method = "heterofold"

    @classmethod
    def extra_defaults(cls) -> dict[str, Any]:
        return {**super().extra_defaults(), "recolor": True, "calib_rank": 16, "calib_steps": 200,
                "calib_lr": 2e-3, "calib_accumulate": 4, "calib_eval_every": 20, "calib_patience": 4,
                "calib_max_seconds": None, "calib_checkpoint_every": 0, "calib_texts": 96,
                "calib_heldout_texts": 8, "continuation_fraction": 0.25, "value_loss_weight": 1.0,
                "continuation": "text"}

    # ---------------------------------------------------------------- stage 2

    def fit_from_stats(self, train_stats: dict[str, MomentAccumulator],
                       heldout: dict[str, MomentAccumulator] | None = None) -> dict[str, Any]:
        report = super().fit_from_stats(train_stats, heldout)
        if self.settings.get("recolor", True):
            for kind in KINDS:
                report[kind]["recolor"] = self.recolor(kind, train_stats[kind])
        return report

    @torch.no_grad()
    def recolor(self, kind: str, acc: MomentAccumulator) -> dict[str, Any]:
        """Fold the per-head Gaussian transport into ``W``; returns spread before/after."""
        cxx, _, cyy = acc.centered()
        n = max(acc.count - 1, 1)
        w = self.weight[kind].double()                                    # [L, F, D]
        heads, dt = self.target.num_kv_heads, self.target.head_dim
        pred = w.transpose(1, 2) @ cxx @ w / n                           # [L, D, D]
        target = cyy / n
        new_w = w.clone()
        ratio_before, ratio_after = [], []
        for h in range(heads):
            sl = slice(h * dt, (h + 1) * dt)
            a = gaussian_transport(pred[:, sl, sl], target[:, sl, sl])  # [L, dt, dt]
            new_w[:, :, sl] = w[:, :, sl] @ a
            tr_t = torch.diagonal(target[:, sl, sl], dim1=1, dim2=2).sum(-1)
            tr_p = torch.diagonal(pred[:, sl, sl], dim1=1, dim2=2).sum(-1)
            after = a.transpose(1, 2) @ pred[:, sl, sl] @ a
            ratio_before.append((tr_p / tr_t.clamp_min(1e-30)).sqrt())
            ratio_after.append((torch.diagonal(after, dim1=1, dim2=2).sum(-1) / tr_t.clamp_min(1e-30)).sqrt())
        self.weight[kind] = new_w.float()
        return {"spread_before": float(torch.stack(ratio_before).mean()),
                "spread_after": float(torch.stack(ratio_after).mean())}

    # ---------------------------------------------------------------- stage 3

    def calibrate(self, source, target, train_texts, heldout_texts, *, state_dir, progress: bool = True,
                  on_step=None) -> dict[str, Any]:
        """Output-aware calibration (see the module doc); folds the result into the weights."""
        s = self.settings
        replay = _AttentionReplay(target)  # holds fp32 copies of o_proj for this fit only
        train_items = self._calibration_items(source, target, train_texts[: int(s["calib_texts"])], replay)
        held_items = self._calibration_items(source, target, heldout_texts[: int(s["calib_heldout_texts"])], replay)
        if not train_items:
            return {"skipped": "no calibration text long enough for a continuation"}
        L, D, r = self.target.num_layers, self.num_outputs, int(s["calib_rank"])
        gen = torch.Generator().manual_seed(0)
        params: dict[str, torch.Tensor] = {}
        for kind in KINDS:
            params[f"{kind}.scale"] = torch.ones(L, D)
            params[f"{kind}.u"] = torch.randn(L, D, r, generator=gen) * (D ** -0.5)
            params[f"{kind}.v"] = torch.zeros(L, r, D)  # zero: calibration starts at the recoloured map
            params[f"{kind}.bias"] = torch.zeros(L, D)
        for t in params.values():
            t.requires_grad_(True)
        def loss_of(item) -> torch.Tensor:
            return replay.loss(item, self._corrected(item, params), float(s["value_loss_weight"]))

        n = len(train_items)
        acc = int(s["calib_accumulate"])
        config = TrainConfig(steps=int(s["calib_steps"]), lr=float(s["calib_lr"]), accumulate=acc,
                             eval_every=int(s["calib_eval_every"]), patience=int(s["calib_patience"]),
                             max_seconds=s.get("calib_max_seconds"),
                             checkpoint_every=int(s["calib_checkpoint_every"]))
        config_id = hashlib.sha256(json.dumps(
            {"settings": s, "source": self.source.id, "target": self.target.id,
             "texts": [it["hash"] for it in train_items + held_items],
             "w": [float(self.weight[k].double().sum()) for k in KINDS]},
            sort_keys=True, default=str).encode()).hexdigest()
        report = train(params, lambda step, micro: loss_of(train_items[(step * acc + micro) % n]),
                       config=config,
                       heldout_loss=(lambda: float(sum(loss_of(it) for it in held_items) / len(held_items)))
                       if held_items else None,
                       checkpoint_dir=Path(state_dir) / "heterofold", config_id=config_id,
                       progress=progress, description=f"calibrate {self.method}", on_step=on_step)
        self._fold(params)
        report["items"] = {"train": len(train_items), "heldout": len(held_items)}
        return report

    def _corrected(self, item, params) -> dict[str, torch.Tensor]:
        """Translated K/V ``[L, H, T, Dh]`` of an item's context with the corrections applied."""
        out = {}
        for kind in KINDS:
            base = item["base"][kind]                                        # [L, T, D] centred
            m = base * params[f"{kind}.scale"][:, None, :] + (base @ params[f"{kind}.u"]) @ params[f"{kind}.v"]
            y = m + (self.y_mean[kind] + params[f"{kind}.bias"])[:, None, :]
            if not bool(item["has_source"].all()):
                fill = (self.y_mean[kind] + params[f"{kind}.bias"])[:, None, :].expand_as(y)
                y = torch.where(item["has_source"][None, :, None], y, fill)
            out[kind] = unflatten_heads(y, self.target.num_kv_heads)
        return out

    @torch.no_grad()
    def _fold(self, params) -> None:
        for kind in KINDS:
            m = torch.diag_embed(params[f"{kind}.scale"]) + params[f"{kind}.u"] @ params[f"{kind}.v"]
            self.weight[kind] = (self.weight[kind].double() @ m.double()).float()
            self.y_mean[kind] = (self.y_mean[kind] + params[f"{kind}.bias"]).float()

    @torch.no_grad()
    def _calibration_items(self, source, target, texts, replay: "_AttentionReplay") -> list[dict[str, Any]]:
        items = []
        frac = float(self.settings["continuation_fraction"])
        n_sink = len(target.sink_ids)
        for text in texts:
            ctx, cont = split_continuation(text, frac)
            if self.settings.get("continuation", "text") == "quote":
                cont = quote_continuation(ctx, cont)
            ids_ctx, off_ctx = target.tokenize(ctx)
            ids_cont, _ = target.tokenize(cont) if cont.strip() else (torch.zeros(0, dtype=torch.long), None)
            if ids_ctx.numel() == 0 or ids_cont.numel() == 0:
                continue
            chunk = source.prefill(ctx)
            alignment = self.align(chunk.offsets, off_ctx)
            base = {}
            for kind in KINDS:
                x = self.features(kind, chunk, alignment, target, ids_ctx, dtype=torch.float32,
                                  fill=self.x_mean[kind])
                base[kind] = torch.bmm(x - self.x_mean[kind][:, None, :], self.weight[kind])
            full = torch.cat([torch.tensor(target.sink_ids, dtype=torch.long), ids_ctx, ids_cont])
            captured: dict = {}
            with capture_attention(target.model, captured):
                target.model(input_ids=full[None].to(target.device))
            T = ids_ctx.numel()
            start = n_sink + T
            layers = []
            for layer in range(self.target.num_layers):
                q, k, v, scaling, window = captured[layer]
                layers.append({"q": q[:, start:].float(), "k": k.float(), "v": v.float(),
                               "scaling": scaling, "window": window})
            items.append({"hash": hashlib.sha256(text.encode()).hexdigest()[:16], "base": base,
                          "has_source": alignment.has_source, "layers": layers, "n_sink": n_sink,
                          "T": T, "Tc": ids_cont.numel()})
        replay.precompute_native(items)
        return items


class _AttentionReplay:
    """The target's attention over its context, replayed from captured queries (fp32)."""

    def __init__(self, target) -> None:
        self.target = target
        # fp32 copies made once, detached: the target stays frozen
        self.o_proj = [layer.self_attn.o_proj.weight.detach().float() for layer in target.model.model.layers]

    def _output(self, layer, probs, v):
        hq, hk = probs.shape[0], v.shape[0]
        if hq != hk:
            v = v.repeat_interleave(hq // hk, dim=0)
        o = (probs @ v).transpose(0, 1).reshape(probs.shape[1], -1)         # [Tc, Hq·Dh]
        return o @ self.o_proj[layer].t()

    @torch.no_grad()
    def precompute_native(self, items) -> None:
        for item in items:
            n_sink, T, Tc = item["n_sink"], item["T"], item["Tc"]
            q_pos = torch.arange(n_sink + T, n_sink + T + Tc)
            k_pos = torch.arange(n_sink + T + Tc)
            for i, lay in enumerate(item["layers"]):
                logp = torch.log_softmax(attention_logits(lay["q"], lay["k"], lay["scaling"], lay["window"],
                                                      q_pos, k_pos), -1)
                lay["native_logp"] = logp
                out = self._output(i, logp.exp(), lay["v"])
                lay["native_out"] = out
                lay["native_out_sq"] = (out ** 2).sum()

    def loss(self, item, translated: dict[str, torch.Tensor], value_weight: float) -> torch.Tensor:
        n_sink, T, Tc = item["n_sink"], item["T"], item["Tc"]
        q_pos = torch.arange(n_sink + T, n_sink + T + Tc)
        k_pos = torch.arange(n_sink + T + Tc)
        keys = self.target.adapter.rotate(translated["keys"], torch.arange(n_sink, n_sink + T))
        total = torch.zeros(())
        L = len(item["layers"])
        for i, lay in enumerate(item["layers"]):
            k = torch.cat([lay["k"][:, :n_sink], keys[i], lay["k"][:, n_sink + T:]], dim=1)
            v = torch.cat([lay["v"][:, :n_sink], translated["values"][i], lay["v"][:, n_sink + T:]], dim=1)
            logq = torch.log_softmax(attention_logits(lay["q"], k, lay["scaling"], lay["window"], q_pos, k_pos), -1)
            p = lay["native_logp"].exp()
            kl = (p * (lay["native_logp"] - logq)).sum(-1).mean()
            out = self._output(i, logq.exp(), v)
            rel = ((out - lay["native_out"]) ** 2).sum() / lay["native_out_sq"].clamp_min(1e-12)
            total = total + kl + value_weight * rel
        return total / L
