"""The metric code on hand-made cases."""

import math

import pytest
import torch

from eval.metrics import (contains_answer, exact_match, gold_log_likelihood, kl_divergence, normalize_answer,
                          retention, token_f1, top1_agreement)


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert exact_match("the eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0


def test_token_f1_hand_computed():
    # pred {paris, france} vs gold {paris}: p = 1/2, r = 1, f1 = 2/3
    assert token_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    assert token_f1("London", ["Paris", "london"]) == 1.0
    assert token_f1("", ["Paris"]) == 0.0
    assert token_f1("cats cats", ["cats"]) == pytest.approx(2 / 3)  # counts, not sets


def test_contains_answer_respects_word_boundaries():
    assert contains_answer("It is Amber-Lantern-42, I think", ["amber-lantern-42"]) == 1.0
    assert contains_answer("forty", ["42"]) == 0.0
    assert contains_answer("1421", ["42"]) == 0.0


def test_distribution_metrics():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]]), -1)
    assert kl_divergence(ref, ref) == pytest.approx(0.0, abs=1e-7)
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, -1.0], [0.0, 3.0, 0.0]]), -1)
    p = ref[0].exp()
    by_hand = float((p * (ref[0] - other[0])).sum()) / 2
    assert kl_divergence(ref, other) == pytest.approx(by_hand, rel=1e-5)
    assert top1_agreement(ref, other) == 0.5
    gold = torch.tensor([0, 1])
    assert gold_log_likelihood(ref, gold) == pytest.approx(float((ref[0, 0] + ref[1, 1]) / 2))


def test_retention_and_interval():
    same = [0.2, 0.5, 1.0, 0.0]
    r = retention(same, same)
    assert r.value == 1.0 and r.low == 1.0 and r.high == 1.0
    half = [v / 2 for v in same]
    assert retention(half, same).value == pytest.approx(0.5)
    r = retention([1, 0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1])
    assert r.value == 0.75 and r.low < 0.75 < r.high <= 1.0
    assert math.isnan(retention([1.0], [0.0]).value)
    with pytest.raises(ValueError):
        retention([1.0], [1.0, 2.0])
