"""Mixture-of-Translators (MoT): HeteroFold's affine map plus routed low-rank translators.

What is fitted, for each kind (keys, values) and target layer ``l``, on the
centred features ``xc = x − μx`` of `mappers.linear`::

    y = xc W + Σ_e g_e(xc) · (xc D_e) U_e + μy,     g = softmax(xc R + b)

``W``, ``μy``: HeteroFold's folded map (fitted first, frozen here). ``D_e``
``[F, r]`` and ``U_e`` ``[r, D]``: the ``E`` translators (rank ``r``); ``R`` ``[F, E]``,
``b`` ``[E]``: the per-token router. ``U`` starts at zero, so an untrained MoT
translates exactly as its base: training starts from HeteroFold's map rather than
a random perturbation of it, and since early stopping keeps the best held-out
loss seen (step 0 included), the result is never worse than the base on held-out
text. ``experts`` and then ``expert_rank`` are halved until the artifact estimate
fits ``max_artifact_mb``.

Training (`calibrate`, after HeteroFold's own) runs the frozen target on each
calibration text split into context and continuation: the translated context is
placed after the target's own sink, the continuation is run over it, and the loss
is ``loss_lm · CE(continuation) + loss_kl · KL(native ‖ translated) +
loss_trajectory · Σ_l‖h_l − h̄_l‖² / Σ_l‖h̄_l‖²`` (h̄: the target's hidden states
of the continuation after its native context, all layers; the ratio is of sums
over layers and positions). The KL is taken over the native top-``kl_top_k``
tokens plus one bucket for the rest of the vocabulary: a lower bound of the full
KL, exact when ``kl_top_k`` covers the vocabulary. Only the MoT tensors train.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cag.kv import FLOAT_DTYPES, normalize_dtype
from cag.models.loaded import EmptyChunkError
from mappers.base import MapperError, register_mapper
from mappers.fidelity import split_continuation
from mappers.heterofold import HeteroFoldMapper
from mappers.linear import KINDS, unflatten_heads
from mappers.stats import MomentAccumulator
from mappers.training import TrainConfig, train

MOT_TENSORS = ("router", "router_bias", "down", "up")
HELDOUT_ITEMS = 8


def native_buckets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[T, V]`` → top-k ids ``[T, k]``, their log-probs ``[T, k]`` and the log of the rest ``[T]``.

    With ``k ≥ V`` the rest is empty and its log is ``-inf``.
    """
    logp = F.log_softmax(logits.float(), -1)
    k = min(int(k), logp.shape[-1])
    top_logp, ids = logp.topk(k, dim=-1)
    if k < logp.shape[-1]:
        rest = logp.scatter(-1, ids, float("-inf")).logsumexp(-1)
    else:
        rest = torch.full(logp.shape[:-1], float("-inf"))
    return ids, top_logp, rest


def bucket_kl(ids: torch.Tensor, top_logp: torch.Tensor, log_rest: torch.Tensor,
              logits: torch.Tensor) -> torch.Tensor:
    """``[T]`` KL(native ‖ other) over the native top-k tokens plus one rest bucket.

    `logits` ``[T, V]``: the other distribution. By the log-sum inequality merging
    tokens into a bucket can only lower the KL, so this bounds the full KL from
    below, and equals it when the top-k is the whole vocabulary.
    """
    logq = F.log_softmax(logits.float(), -1)
    kl = (top_logp.exp() * (top_logp - logq.gather(-1, ids))).sum(-1)
    if ids.shape[-1] < logq.shape[-1]:
        # only with a non-empty rest: an empty one would give 0·(−inf − (−inf)) = nan
        q_rest = logq.scatter(-1, ids, float("-inf")).logsumexp(-1)
        kl = kl + log_rest.exp() * (log_rest - q_rest)
    return kl


def mixture(xc: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor,
            down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``Σ_e g_e (xc D_e) U_e`` ``[L, T, D]`` for centred features `xc` ``[L, T, F]``, in xc's dtype.

    ``Σ_e g_e (h_e U_e) = [g_1 h_1 … g_E h_E] [U_1; …; U_E]``: all translators are
    two batched matmuls, whatever E.
    """
    L, T, Fdim = xc.shape
    E, r = down.shape[1], down.shape[3]
    dt = xc.dtype
    # the softmax in fp32: bf16 logits are fine, bf16 normalisation is not
    logits = torch.bmm(xc, router.to(dt)).float() + router_bias.float()[:, None, :]
    gates = torch.softmax(logits, dim=-1).to(dt)                                # [L, T, E]
    h = torch.bmm(xc, down.to(dt).permute(0, 2, 1, 3).reshape(L, Fdim, E * r))  # [L, T, E·r]
    h = h * gates.repeat_interleave(r, dim=2)
    return torch.bmm(h, up.to(dt).reshape(L, E * r, up.shape[-1]))


@register_mapper
class MoTMapper(HeteroFoldMapper):
    method = "mot"

    @classmethod
    def extra_defaults(cls) -> dict[str, Any]:
        return {**super().extra_defaults(), "experts": 4, "expert_rank": 16, "mot_steps": 80, "mot_lr": 1e-3,
                "mot_accumulate": 2, "mot_eval_every": 10, "mot_patience": 3, "mot_max_seconds": None,
                "mot_checkpoint_every": 0, "mot_seed": 0, "loss_lm": 1.0, "loss_kl": 1.0,
                "loss_trajectory": 1.0, "kl_top_k": 256, "continuation_fraction": 0.25,
                "max_artifact_mb": 20, "base_artifact": None}

    def __init__(self, source, target, settings=None) -> None:
        super().__init__(source, target, settings)
        self.mot: dict[str, torch.Tensor] = {}
        self._fit_budget()

    # ----------------------------------------------------------- geometry

    def _mot_shapes(self, experts: int, rank: int) -> dict[str, tuple[int, ...]]:
        L, Fdim, D = self.target.num_layers, self.num_features, self.num_outputs
        out = {}
        for kind in KINDS:
            out[f"{kind}.router"] = (L, Fdim, experts)
            out[f"{kind}.router_bias"] = (L, experts)
            out[f"{kind}.down"] = (L, experts, Fdim, rank)
            out[f"{kind}.up"] = (L, experts, rank, D)
        return out

    def artifact_bytes(self, experts: int, rank: int) -> int:
        """Estimated weights-file size: means in fp32, every weight in the storage dtype."""
        store = FLOAT_DTYPES[normalize_dtype(self.settings.get("storage_dtype", "float32"))].itemsize
        L, Fdim, D = self.target.num_layers, self.num_features, self.num_outputs
        shapes = list(super()._weight_names().values()) + list(self._mot_shapes(experts, rank).values())
        return len(KINDS) * L * (Fdim + D) * 4 + store * sum(math.prod(s) for s in shapes)

    def _fit_budget(self) -> None:
        experts, rank = int(self.settings["experts"]), int(self.settings["expert_rank"])
        if experts < 1 or rank < 1:
            raise ValueError(f"experts and expert_rank must be ≥ 1, got {experts} and {rank}")
        budget = self.settings.get("max_artifact_mb")
        if budget is not None:
            limit = float(budget) * 1e6
            while self.artifact_bytes(experts, rank) > limit and (experts > 1 or rank > 1):
                if experts > 1:
                    experts //= 2
                else:
                    rank //= 2
            if self.artifact_bytes(experts, rank) > limit:
                raise MapperError(f"mot: even one rank-1 translator gives a {self.artifact_bytes(1, 1) / 1e6:.1f} MB "
                                  f"artifact, over max_artifact_mb={budget} (the base map alone is too large)")
        # the values actually used: an artifact reloads with the shapes it was fitted with
        self.settings["experts"], self.settings["expert_rank"] = experts, rank

    # ---------------------------------------------------------- inference

    def project(self, kind: str, x_centered: torch.Tensor) -> torch.Tensor:
        y = super().project(kind, x_centered)
        if f"{kind}.up" not in self.mot:
            return y  # HeteroFold's own fit runs before the translators exist
        return y + mixture(x_centered, *(self.mot[f"{kind}.{n}"] for n in MOT_TENSORS))

    # ------------------------------------------------------------- weights

    def _weight_names(self) -> dict[str, tuple[int, ...]]:
        return {**super()._weight_names(),
                **self._mot_shapes(int(self.settings["experts"]), int(self.settings["expert_rank"]))}

    def _weights(self) -> dict[str, torch.Tensor]:
        return {**super()._weights(), **self.mot}

    def _set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        super()._set_weights(tensors)
        names = self._mot_shapes(int(self.settings["experts"]), int(self.settings["expert_rank"]))
        self.mot.update({n: tensors[n] for n in names if n in tensors})

    # ----------------------------------------------------------------- fit

    def fit_from_stats(self, train_stats: dict[str, MomentAccumulator],
                       heldout: dict[str, MomentAccumulator] | None = None) -> dict[str, Any]:
        report = super().fit_from_stats(train_stats, heldout)
        self.init_translators(train_stats)
        return report

    def init_translators(self, train_stats: dict[str, MomentAccumulator]) -> None:
        """Random `down` and `router` scaled to the features, zero `up` and `router_bias` (seeded)."""
        E, r = int(self.settings["experts"]), int(self.settings["expert_rank"])
        shapes = self._mot_shapes(E, r)
        gen = torch.Generator().manual_seed(int(self.settings["mot_seed"]))
        for kind in KINDS:
            cxx, _, _ = train_stats[kind].centered()
            total_var = torch.diagonal(cxx, dim1=1, dim2=2).sum(-1) / max(train_stats[kind].count, 1)
            # 1/sqrt(total variance): each translator coordinate and router logit has
            # about unit variance on the features, whatever the source's K/V scale
            scale = total_var.clamp_min(1e-12).rsqrt().float()
            for name in ("router", "down"):
                shape = shapes[f"{kind}.{name}"]
                t = torch.randn(shape, generator=gen)
                self.mot[f"{kind}.{name}"] = t * scale.reshape(-1, *([1] * (len(shape) - 1)))
            self.mot[f"{kind}.router_bias"] = torch.zeros(shapes[f"{kind}.router_bias"])
            self.mot[f"{kind}.up"] = torch.zeros(shapes[f"{kind}.up"])

    def calibrate(self, source, target, train_texts, heldout_texts, *, state_dir, progress: bool = True,
                  on_step=None) -> dict[str, Any]:
        """HeteroFold's calibration, then the translators' training (see the module doc)."""
        params = list(target.model.parameters())
        flags = [p.requires_grad for p in params]
        try:
            # frozen for both stages: nothing may accumulate a .grad in the target
            for p in params:
                p.requires_grad_(False)
            report: dict[str, Any] = {}
            if self.settings.get("base_artifact"):
                report["heterofold"] = self._load_base(self.settings["base_artifact"])
            else:
                report["heterofold"] = super().calibrate(source, target, train_texts, heldout_texts,
                                                         state_dir=state_dir, progress=progress, on_step=on_step)
            report["mot"] = self._train_translators(source, target, train_texts, heldout_texts,
                                                    state_dir=state_dir, progress=progress, on_step=on_step)
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
        report["experts"], report["expert_rank"] = int(self.settings["experts"]), int(self.settings["expert_rank"])
        return report

    def _load_base(self, path) -> dict[str, Any]:
        """Take the base map from a fitted HeteroFold artifact instead of calibrating it again.

        The same fit (pair, alignment settings, calibration texts) gives the same
        map, so a HeteroFold artifact already fitted for the pair saves its whole
        calibration; the pair and the alignment settings are checked.
        """
        from mappers.base import load_mapper

        base = load_mapper(path, source=self.source, target=self.target, method="heterofold")
        for key in ("layer_radius", "token_window"):
            if base.settings.get(key) != self.settings.get(key):
                raise MapperError(f"mot: base artifact {path} has {key}={base.settings.get(key)!r}, "
                                  f"this fit {self.settings.get(key)!r}")
        self.weight = {k: v.float().clone() for k, v in base.weight.items()}
        self.x_mean = {k: v.float().clone() for k, v in base.x_mean.items()}
        self.y_mean = {k: v.float().clone() for k, v in base.y_mean.items()}
        return {"loaded": str(path), "artifact_id": base.artifact_id,
                "fitted_on": base.fitted_on.get("texts_sha256"), "calibration": base.fidelity.get("calibration")}

    def _train_translators(self, source, target, train_texts, heldout_texts, *, state_dir, progress,
                           on_step) -> dict[str, Any]:
        s = self.settings
        if not self.mot:
            raise MapperError("mot: fit_from_stats must run before calibrate")
        if not any(float(s[k]) for k in ("loss_lm", "loss_kl", "loss_trajectory")):
            raise ValueError("mot: loss_lm, loss_kl and loss_trajectory are all zero")
        acc = int(s["mot_accumulate"])
        # steps·accumulate micro-batches see at most that many distinct items
        items = self._items(source, target, train_texts, int(s["mot_steps"]) * acc)
        held = self._items(source, target, heldout_texts, HELDOUT_ITEMS)
        if not items:
            return {"skipped": "no calibration text with both a context and a continuation"}
        params = {n: t.detach().float().clone().requires_grad_(True) for n, t in self.mot.items()}
        prefix = self._prefix(target)
        n = len(items)

        def loss_of(item) -> torch.Tensor:
            return self._loss(item, params, target, prefix)

        config = TrainConfig(steps=int(s["mot_steps"]), lr=float(s["mot_lr"]), accumulate=acc,
                             eval_every=int(s["mot_eval_every"]), patience=int(s["mot_patience"]),
                             max_seconds=s.get("mot_max_seconds"),
                             checkpoint_every=int(s.get("mot_checkpoint_every") or 0))
        base = hashlib.sha256()
        for kind in KINDS:  # a checkpoint trained over another base map is not resumed
            base.update(self.weight[kind].float().numpy().tobytes())
            base.update(self.y_mean[kind].float().numpy().tobytes())
        config_id = hashlib.sha256(json.dumps(
            {"settings": s, "source": self.source.id, "target": self.target.id,
             "texts": [it["hash"] for it in items + held], "base": base.hexdigest()},
            sort_keys=True, default=str).encode()).hexdigest()
        report = train(params, lambda step, micro: loss_of(items[(step * acc + micro) % n]), config=config,
                       heldout_loss=(lambda: float(sum(float(loss_of(it)) for it in held) / len(held)))
                       if held else None,
                       checkpoint_dir=Path(state_dir) / "mot", config_id=config_id, progress=progress,
                       description=f"train {self.method}", on_step=on_step)
        self.mot = {name: t.detach().requires_grad_(False) for name, t in params.items()}
        report["items"] = {"train": n, "heldout": len(held)}
        return report

    # ------------------------------------------------------------ training

    @staticmethod
    @torch.no_grad()
    def _prefix(target) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's own sink K/V, keys rotated at 0..len(sink)−1 (fp32)."""
        if not target.sink_ids:
            return None
        chunk = target.prefix_chunk()
        keys = target.adapter.rotate(chunk.keys.float(), torch.arange(chunk.num_tokens))
        # clones on the CPU, where the translation is computed (a prefill gives inference tensors)
        return keys.cpu().clone(), chunk.values.float().cpu().clone()

    @torch.no_grad()
    def _items(self, source, target, texts, limit: int) -> list[dict[str, Any]]:
        """Everything a step needs that does not depend on the MoT tensors, computed once per text."""
        s = self.settings
        dtype = self.compute_dtype
        n_sink = len(target.sink_ids)
        sink = torch.tensor(target.sink_ids, dtype=torch.long)
        items: list[dict[str, Any]] = []
        for text in texts:
            if len(items) >= limit:
                break
            ctx, cont = split_continuation(text, float(s["continuation_fraction"]))
            ids_ctx, off_ctx = target.tokenize(ctx)
            ids_cont = target.tokenize(cont)[0] if cont.strip() else torch.zeros(0, dtype=torch.long)
            if ids_ctx.numel() == 0 or ids_cont.numel() == 0:
                continue
            try:
                chunk = source.prefill(ctx)
            except EmptyChunkError:
                continue
            alignment = self.align(chunk.offsets, off_ctx)
            has = alignment.has_source
            xc, base = {}, {}
            for kind in KINDS:
                # features and base map exactly as `_translate_batch` computes them,
                # so the translators learn to correct what inference will produce
                x = self.features(kind, chunk, alignment, target, ids_ctx, dtype=dtype, fill=self.x_mean[kind])
                xc[kind] = x - self.x_mean[kind].to(dtype)[:, None, :]
                b = super().project(kind, xc[kind]).float() + self.y_mean[kind][:, None, :]
                b[:, ~has] = self.y_mean[kind][:, None, :]
                base[kind] = b
            T, Tc = ids_ctx.numel(), ids_cont.numel()
            full = torch.cat([sink, ids_ctx, ids_cont])
            out = target.model(input_ids=full[None].to(target.device), output_hidden_states=True,
                               logits_to_keep=Tc)
            top_ids, top_logp, log_rest = native_buckets(out.logits[0, -Tc:].float().cpu(), int(s["kl_top_k"]))
            # hidden_states[0] is the continuation's embeddings, the same in both runs
            hidden = torch.stack([h[0, n_sink + T:] for h in out.hidden_states[1:]]).cpu()
            items.append({"hash": hashlib.sha256(text.encode()).hexdigest()[:16], "xc": xc, "base": base,
                          "has": has, "n_sink": n_sink, "T": T, "cont": ids_cont, "top_ids": top_ids,
                          "top_logp": top_logp, "log_rest": log_rest, "hidden": hidden,
                          "hidden_sq": (hidden.float() ** 2).sum()})
        return items

    def translated_context(self, item, params, target) -> tuple[torch.Tensor, torch.Tensor]:
        """An item's translated context, keys rotated into place: ``[L, H, T, Dh]`` each (fp32, with grad)."""
        kv = {}
        keep = item["has"].float()[None, :, None]  # tokens without a source stay at μy, as in inference
        for kind in KINDS:
            mix = mixture(item["xc"][kind].float(), *(params[f"{kind}.{n}"] for n in MOT_TENSORS))
            kv[kind] = unflatten_heads(item["base"][kind] + mix * keep, self.target.num_kv_heads)
        n_sink, T = item["n_sink"], item["T"]
        return target.adapter.rotate(kv["keys"], torch.arange(n_sink, n_sink + T)), kv["values"]

    def _loss(self, item, params, target, prefix) -> torch.Tensor:
        s = self.settings
        keys, values = self.translated_context(item, params, target)
        if prefix is not None:
            keys = torch.cat([prefix[0], keys], dim=2)
            values = torch.cat([prefix[1], values], dim=2)
        cache = target.adapter.fill_cache(keys.to(device=target.device, dtype=target.dtype),
                                          values.to(device=target.device, dtype=target.dtype))
        w_lm, w_kl, w_tr = float(s["loss_lm"]), float(s["loss_kl"]), float(s["loss_trajectory"])
        out = target.model(input_ids=item["cont"][None].to(target.device), past_key_values=cache,
                           output_hidden_states=w_tr != 0)
        logits = out.logits[0].float().cpu()                                       # [Tc, V]
        loss = torch.zeros(())
        if w_lm and logits.shape[0] > 1:
            loss = loss + w_lm * F.cross_entropy(logits[:-1], item["cont"][1:])
        if w_kl:
            loss = loss + w_kl * bucket_kl(item["top_ids"], item["top_logp"], item["log_rest"], logits).mean()
        if w_tr:
            hidden = torch.stack([h[0] for h in out.hidden_states[1:]]).float().cpu()
            err = ((hidden - item["hidden"].float()) ** 2).sum()
            loss = loss + w_tr * err / item["hidden_sq"].clamp_min(1e-12)
        return loss
