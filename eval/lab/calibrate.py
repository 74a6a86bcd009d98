"""Lookup calibration through the frozen target: one logit scale per target layer and KV head.

Ridge regresses every key toward its mean, so attention over translated context
is too flat (or, after spread matching, possibly too sharp), and by a different
amount in every head. This lever learns ``a[l, h]`` so that the translated context
keys of layer l, head h are multiplied by ``exp(a[l, h])`` (a per-head attention
temperature on the context block only; the native prompt head is untouched), by
minimising the teacher-forced NLL of the gold answer on the lab's **tune** lookup
items through the frozen target: MoT's context-correction idea applied to
lookups, with L·H parameters (48 for Qwen2.5) instead of a network.

Scaling a de-rotated key scales its rotated key by the same factor, so the
learned scales fold into a linear map's key columns exactly (`fold_into`).
"""

from __future__ import annotations

import torch

from cag.assembler import Assembler
from cag.prompt import layout_for


def _gold(asm: Assembler, target, answer: str) -> torch.Tensor:
    return target.tokenize(answer if asm.layout.chat else " " + answer)[0]


def placed_kv(asm: Assembler, chunk) -> tuple[torch.Tensor, torch.Tensor, int]:
    """De-rotated keys and values of prompt head + chunk ``[L, H, T, D]``, and the head's length."""
    prefix = asm.prefix()
    return (torch.cat([prefix.keys, chunk.keys], 2).float(), torch.cat([prefix.values, chunk.values], 2).float(),
            prefix.num_tokens)


def answer_nll(target, asm: Assembler, placed, question: str, answer: str, log_scale: torch.Tensor) -> torch.Tensor:
    """Mean gold-answer NLL with the context keys of every layer and head scaled by exp(log_scale)."""
    keys, values, n_prefix = placed
    factor = torch.cat([torch.ones(keys.shape[0], keys.shape[1], n_prefix, 1),
                        torch.exp(log_scale)[:, :, None, None].expand(-1, -1, keys.shape[2] - n_prefix, 1)], dim=2)
    # scaling commutes with rotation, so the scaled keys are rotated like any placed chunk
    rotated = target.adapter.rotate((keys * factor).to(target.dtype), torch.arange(keys.shape[2]))
    cache = target.adapter.fill_cache(rotated, values.to(target.dtype))
    q = asm.question_ids(question)
    gold = _gold(asm, target, answer)
    ids = torch.cat([q, gold[:-1]])[None]
    hidden = target.model.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    logits = target.model.lm_head(hidden[0, -gold.numel():])
    return torch.nn.functional.cross_entropy(logits.float(), gold)


def fit_log_scales(target, items: list[dict], translate, *, epochs: int = 6, lr: float = 0.05,
                   l2: float = 1e-3, progress=None) -> tuple[torch.Tensor, list[float]]:
    """Learn ``[L, H]`` log-scales on `items` (each with ``question``, ``answers`` and what `translate`
    needs); returns them and the mean NLL before each epoch and after the last."""
    asm = Assembler(target, layout_for(target.tokenizer))
    fp = target.fingerprint
    log_scale = torch.zeros(fp.num_layers, fp.num_kv_heads, requires_grad=True)
    opt = torch.optim.Adam([log_scale], lr=lr)
    for p in target.model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        placed = [placed_kv(asm, translate(item)) for item in items]
    history = []
    for epoch in range(epochs + 1):
        total = 0.0
        for item, pl in zip(items, placed):
            loss = answer_nll(target, asm, pl, item["question"], item["answers"][0], log_scale)
            total += float(loss.detach())
            if epoch < epochs:
                opt.zero_grad()
                (loss + l2 * (log_scale ** 2).sum()).backward()
                opt.step()
            if progress is not None:
                progress.advance(1)
        history.append(total / max(1, len(items)))
    return log_scale.detach(), history


def fold_into(coef: torch.Tensor, y_mean: torch.Tensor, log_scale: torch.Tensor, head_dim: int):
    """Scale a linear map's key columns (the first half of [keys | values], per layer and head)."""
    scale = torch.exp(log_scale).flatten().repeat_interleave(head_dim)    # [L·H·D] in layer, head order
    d = coef.shape[1] // 2
    coef, y_mean = coef.clone(), y_mean.clone()
    coef[:, :d] *= scale
    y_mean[:d] *= scale
    return coef, y_mean
