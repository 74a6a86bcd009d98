"""Fidelity of a mapper: how close translated K/V come to the target's own.

`measure_fidelity` is the one function the fitting pipeline and `eval/` share.
For each text it splits off a continuation (the last `continuation_fraction` of
the characters, cut at whitespace), and with the rest as the chunk it measures:

- **R² per target layer** of keys and of values: translated vs the target's own
  prefill of the chunk, over target tokens that have an aligned source token;
  ``R² = 1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` pooled over all texts (ȳ: the pooled mean).
- **Spread ratio per layer**: ``sqrt(Σ‖ŷ − mean ŷ‖² / Σ‖y − ȳ‖²)``, how much of
  the native K/V spread the translation keeps (regression to the mean gives < 1;
  DESIGN.md's probe found shrunken keys to flatten the target's attention).
- **Attention-output cosine per layer**: the target's own queries for the chunk
  tokens (captured from its native forward over ``sink + chunk``) attend once over
  the native K/V and once over the translated K/V (the sink's K/V native in both,
  causal and sliding-window masks as the layer has them); the cosine of the two
  outputs, per query head and token, averaged.
- **Next-token KL(native ‖ translated) and top-1 agreement** over the
  continuation positions: native = the target's forward over ``sink + chunk +
  continuation``; translated = ``build_cache([prefix_chunk(), translated])``
  followed by the continuation tokens. The same with only the prefix in the
  cache gives the no-context floor (``kl_no_context``, ``top1_no_context``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from cag.models.attention import attend, capture_attention
from mappers.token_alignment import align_tokens


def split_continuation(text: str, fraction: float) -> tuple[str, str]:
    """Cut `text` at the whitespace nearest before ``(1 - fraction)`` of its length."""
    if fraction <= 0:
        return text, ""
    cut = int(len(text) * (1.0 - fraction))
    space = text.rfind(" ", 0, cut)
    if space > 0:
        cut = space
    return text[:cut], text[cut:]


def _kl_top1(native_logits: torch.Tensor, other_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = F.log_softmax(native_logits.float(), -1)
    lq = F.log_softmax(other_logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (native_logits.argmax(-1) == other_logits.argmax(-1)).float()
    return kl, top1


@torch.inference_mode()
def measure_fidelity(mapper, source, target, texts: Sequence[str], *,
                     continuation_fraction: float = 0.25, attention: bool = True) -> dict[str, Any]:
    """Fidelity of `mapper` (source → target `LoadedModel`s) on `texts`; see the module doc."""
    L = target.adapter.num_layers
    sse = {k: torch.zeros(L, dtype=torch.float64) for k in ("keys", "values")}
    sy = {k: None for k in ("keys", "values")}
    syy = {k: torch.zeros(L, dtype=torch.float64) for k in ("keys", "values")}
    shat = {k: None for k in ("keys", "values")}
    shh = {k: torch.zeros(L, dtype=torch.float64) for k in ("keys", "values")}
    n_rows = 0
    cos_sum = torch.zeros(L, dtype=torch.float64)
    cos_n = 0
    kls, top1s, kls_nc, top1s_nc = [], [], [], []
    prefix = target.prefix_chunk() if target.sink_ids else None
    n_sink = len(target.sink_ids)
    attention_ok = attention
    used = 0
    for text in texts:
        ctx, cont = split_continuation(text, continuation_fraction)
        ids_ctx, off_ctx = target.tokenize(ctx)
        if ids_ctx.numel() == 0:
            continue
        chunk = source.prefill(ctx)
        translated = mapper.translate(chunk, ctx, target)
        native = target.prefill(ctx)
        used += 1
        # --- R² per layer, tokens with a source
        has = align_tokens(chunk.offsets, native.offsets).has_source
        for kind in ("keys", "values"):
            y = getattr(native, kind).double()[:, :, has]            # [L, H, T, D]
            yh = getattr(translated, kind).double()[:, :, has]
            sse[kind] += ((y - yh) ** 2).sum(dim=(1, 2, 3))
            s = y.sum(dim=2)                                          # [L, H, D]
            sy[kind] = s if sy[kind] is None else sy[kind] + s
            syy[kind] += (y ** 2).sum(dim=(1, 2, 3))
            s = yh.sum(dim=2)
            shat[kind] = s if shat[kind] is None else shat[kind] + s
            shh[kind] += (yh ** 2).sum(dim=(1, 2, 3))
        n_rows += int(has.sum())
        # --- native forward over sink + ctx + cont (captures queries, gives reference logits)
        ids_cont, _ = target.tokenize(cont) if cont else (torch.zeros(0, dtype=torch.long), None)
        full = torch.cat([torch.tensor(target.sink_ids, dtype=torch.long), ids_ctx, ids_cont])
        captured: dict = {}
        if attention_ok:
            try:
                with capture_attention(target.model, captured):
                    out = target.model(input_ids=full[None].to(target.device))
            except RuntimeError:
                attention_ok = False
                out = target.model(input_ids=full[None].to(target.device))
        else:
            out = target.model(input_ids=full[None].to(target.device))
        T = ids_ctx.numel()
        if attention_ok and len(captured) == L:
            pos = torch.arange(n_sink, n_sink + T)
            k_pos = torch.arange(n_sink + T)
            k_tr = target.adapter.rotate(translated.keys.float(), pos)
            for layer in range(L):
                q, k, v, scaling, window = captured[layer]
                q = q[:, n_sink:n_sink + T]
                k, v = k[:, :n_sink + T].float(), v[:, :n_sink + T].float()
                o_nat = attend(q, k, v, scaling, window, pos, k_pos)
                k2 = torch.cat([k[:, :n_sink], k_tr[layer]], dim=1)
                v2 = torch.cat([v[:, :n_sink], translated.values[layer].float()], dim=1)
                o_tr = attend(q, k2, v2, scaling, window, pos, k_pos)
                cos_sum[layer] += F.cosine_similarity(o_nat, o_tr, dim=-1).double().mean()
            cos_n += 1
        # --- continuation: KL and top-1 with the translated cache injected after the prefix
        if ids_cont.numel() > 0 and prefix is not None:
            native_logits = out.logits[0, n_sink + T:]
            cont_in = ids_cont[None].to(target.device)
            tr = target.model(input_ids=cont_in, past_key_values=target.build_cache([prefix, translated]))
            nc = target.model(input_ids=cont_in, past_key_values=target.build_cache([prefix]))
            kl, t1 = _kl_top1(native_logits, tr.logits[0])
            kls.append(kl), top1s.append(t1)
            kl, t1 = _kl_top1(native_logits, nc.logits[0])
            kls_nc.append(kl), top1s_nc.append(t1)
    report: dict[str, Any] = {"texts": used, "aligned_tokens": n_rows}
    for kind, name in (("keys", "key"), ("values", "value")):
        if sy[kind] is None or n_rows == 0:
            continue
        sst = syy[kind] - (sy[kind] ** 2).sum(dim=(1, 2)) / n_rows
        r2 = 1.0 - sse[kind] / sst.clamp_min(1e-30)
        report[f"{name}_r2_per_layer"] = r2.tolist()
        report[f"{name}_r2"] = float(r2.mean())
        # spread of translated vs native (ridge shrinks toward the mean: < 1)
        ssh = shh[kind] - (shat[kind] ** 2).sum(dim=(1, 2)) / n_rows
        ratio = (ssh / sst.clamp_min(1e-30)).clamp_min(0).sqrt()
        report[f"{name}_spread_ratio_per_layer"] = ratio.tolist()
        report[f"{name}_spread_ratio"] = float(ratio.mean())
    if cos_n:
        per_layer = cos_sum / cos_n
        report["attn_cos_per_layer"] = per_layer.tolist()
        report["attn_cos"] = float(per_layer.mean())
    if kls:
        report["continuation_tokens"] = int(sum(k.numel() for k in kls))
        report["kl"] = float(torch.cat(kls).mean())
        report["top1"] = float(torch.cat(top1s).mean())
        report["kl_no_context"] = float(torch.cat(kls_nc).mean())
        report["top1_no_context"] = float(torch.cat(top1s_nc).mean())
    return report
