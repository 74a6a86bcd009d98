"""The metrics of DESIGN.md, "What is measured", exactly as defined there.

Answer quality (generated answer against the acceptable answers):
- **exact match** and **token F1** with SQuAD normalisation (lower case, no
  punctuation, no articles a/an/the, single spaces), the best over the answers.

Distributional (teacher forcing the gold answer after the question):
- **gold log-likelihood per token**: mean log p(gold token) under a condition;
  its retention is taken on the per-token likelihood ``exp(mean log p)``, a
  positive quantity for which "X keeps 90% of DC" means what it says;
- **KL(DC ‖ X)**: mean over gold positions of the KL divergence from the direct-
  context next-token distribution to the condition's;
- **top-1 agreement**: fraction of gold positions where both pick the same token.

**Retention** = mean metric(X) / mean metric(DC) over the same questions, with a
paired bootstrap 95% interval (questions resampled with replacement, the same
resample for X and DC).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def _f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    return max(_f1(prediction, a) for a in answers)


def contains_answer(prediction: str, answers: Sequence[str]) -> float:
    """Whether a normalised answer occurs in the normalised prediction (needle "found")."""
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(a)} " in pred for a in answers if normalize_answer(a)))


# ---------------------------------------------------------------- distributions


def gold_log_likelihood(log_probs: torch.Tensor, gold_ids: torch.Tensor) -> float:
    """Mean log p(gold) per token; `log_probs` ``[gold_len, vocab]`` (log-softmaxed)."""
    return log_probs.float().gather(1, gold_ids[:, None].long()).mean().item()


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference ‖ other), both ``[positions, vocab]`` log-probs."""
    ref, oth = reference.float(), other.float()
    return (ref.exp() * (ref - oth)).sum(-1).mean().item()


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (reference.argmax(-1) == other.argmax(-1)).float().mean().item()


# -------------------------------------------------------------------- retention


@dataclass(frozen=True)
class Retention:
    value: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}


def retention(condition: Sequence[float], reference: Sequence[float], *, samples: int = 2000,
              seed: int = 0, confidence: float = 0.95) -> Retention:
    """mean(condition) / mean(reference), paired bootstrap interval over questions.

    A resample whose reference mean is 0 has no ratio and is left out; when the
    reference itself is 0 the retention is undefined (NaN).
    """
    x, y = np.asarray(condition, dtype=float), np.asarray(reference, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError("retention needs two equal, non-empty lists of per-question values")
    if y.mean() == 0:
        return Retention(float("nan"), float("nan"), float("nan"), int(x.size))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(samples, x.size))
    num, den = x[idx].mean(1), y[idx].mean(1)
    ok = den != 0
    ratios = num[ok] / den[ok]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    return Retention(float(x.mean() / y.mean()), float(low), float(high), int(x.size))
