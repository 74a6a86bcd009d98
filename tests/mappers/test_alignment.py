"""Token and layer alignment: hand-made tricky offsets and two real tiny tokenizers."""

import pytest
import torch

from mappers.layer_alignment import align_layers, center_layers
from mappers.token_alignment import agreed_spans, align_tokens, assert_no_lookahead, token_reach
from tests.mappers.conftest import TEXTS, other_tokenizer
from tests.tiny import tiny_tokenizer


def check_rule(src, tgt, window=1):
    """Every valid slot: reach <= target reach; column 0 is the *last* such source token."""
    a = align_tokens(src, tgt, window=window)
    assert_no_lookahead(a)
    s_reach, t_reach = token_reach(src), token_reach(tgt)
    for t in range(len(tgt)):  # reference loop (tests only)
        admissible = [i for i in range(len(src)) if s_reach[i] <= t_reach[t]]
        if admissible:
            assert a.has_source[t] and a.index[t, 0] == admissible[-1]
            for k in range(1, window):
                expect = admissible[-1] - k
                assert bool(a.valid[t, k]) == (expect >= 0)
                if expect >= 0:
                    assert a.index[t, k] == expect
        else:
            assert not a.has_source[t] and not a.valid[t].any()
    return a


def test_merged_whitespace():
    text = "the quick fox"
    # source keeps the space in front of the word; target leaves it out of the span
    src = [(0, 3), (3, 9), (9, 13)]
    tgt = [(0, 3), (4, 9), (10, 13)]
    a = check_rule(src, tgt)
    assert a.index[:, 0].tolist() == [0, 1, 2]
    # target splits finer: "qu" ends before any source token past "the"
    tgt2 = [(0, 3), (3, 6), (6, 9), (9, 13)]
    a = check_rule(src, tgt2)
    assert a.index[:, 0].tolist() == [0, 0, 1, 2]
    assert text[slice(*tgt2[1])] == " qu"


def test_special_tokens_and_empty_spans():
    # a BOS (0,0) at the start and a special token in the middle, both empty spans
    src = [(0, 0), (0, 2), (2, 5), (0, 0), (5, 8)]
    tgt = [(0, 0), (0, 1), (1, 5), (5, 8)]
    a = check_rule(src, tgt, window=2)
    # target BOS reaches 0: the source BOS (reach 0) is admissible and last with reach 0
    assert a.index[0, 0] == 0 and a.has_source[0]
    # target "(1,5)" reaches 5: last source with reach <= 5 is the mid special token (index 3)
    assert a.index[2, 0] == 3


def test_byte_fallback_overlapping_and_empty():
    # "日本" split into bytes: three tokens share (0,1), the next character's tokens (1,2), (2,2)
    src = [(0, 1), (0, 1), (0, 1), (1, 2), (1, 2), (2, 2)]
    tgt = [(0, 1), (1, 2)]
    a = check_rule(src, tgt, window=3)
    assert a.index[:, 0].tolist() == [2, 5]
    assert a.index[0].tolist() == [2, 1, 0]
    # reverse: target is byte-split, source whole characters
    a = check_rule(tgt, src)
    assert a.index[:, 0].tolist() == [0, 0, 0, 1, 1, 1]


def test_no_source_flagged():
    src = [(0, 5), (5, 9)]
    tgt = [(0, 2), (2, 5), (5, 9)]
    a = check_rule(src, tgt)
    assert a.has_source.tolist() == [False, True, True]
    assert a.index[0, 0] == 0  # clamped, safe for gather
    assert a.fully_valid.tolist() == [False, True, True]


def test_empty_inputs():
    a = align_tokens(torch.zeros(0, 2, dtype=torch.long), [(0, 3)])
    assert not a.has_source.any()
    a = align_tokens([(0, 3)], torch.zeros(0, 2, dtype=torch.long))
    assert a.index.shape == (0, 1)


def test_unicode_and_real_tokenizers():
    tok_a, tok_b = tiny_tokenizer(), other_tokenizer()
    differ = 0
    for text in TEXTS + ["naïve café — 日本語 ＡＢＣ 🙂 end", "  leading  spaces\tand\ttabs  "]:
        ea = tok_a(text, add_special_tokens=False, return_offsets_mapping=True)
        eb = tok_b(text, add_special_tokens=False, return_offsets_mapping=True)
        src = torch.tensor(ea["offset_mapping"]).reshape(-1, 2)
        tgt = torch.tensor(eb["offset_mapping"]).reshape(-1, 2)
        differ += src.shape != tgt.shape or not torch.equal(src, tgt)
        check_rule(src, tgt, window=2)
        check_rule(tgt, src, window=1)
        spans = agreed_spans(src, tgt)
        assert len(spans) >= 1
        # spans partition both token sequences consistently and cover equal text
        for k in range(len(spans)):
            s0, s1 = int(spans.source_start[k]), int(spans.source_end[k])
            t0, t1 = int(spans.target_start[k]), int(spans.target_end[k])
            assert s1 > s0 and t1 > t0
            assert token_reach(src)[s1 - 1] == token_reach(tgt)[t1 - 1] == spans.boundaries[k]
        assert spans.boundaries[-1] == token_reach(src)[-1] == len(text)
    assert differ >= len(TEXTS) // 2  # the two tokenizers really differ


def test_agreed_spans_hand_made():
    src = [(0, 3), (3, 9), (9, 13)]
    tgt = [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    sp = agreed_spans(src, tgt)
    assert sp.boundaries.tolist() == [3, 9, 13]
    assert sp.source_end.tolist() == [1, 2, 3] and sp.target_end.tolist() == [1, 3, 5]
    assert sp.source_start.tolist() == [0, 1, 2] and sp.target_start.tolist() == [0, 1, 3]


@pytest.mark.parametrize("ls,lt", [(30, 24), (3, 4), (4, 3), (1, 5), (5, 1), (24, 24)])
def test_layer_alignment(ls, lt):
    idx = align_layers(ls, lt, radius=1)
    width = min(3, ls)
    assert idx.shape == (lt, width)
    assert int(idx.min()) >= 0 and int(idx.max()) < ls
    centre = center_layers(ls, lt)
    assert bool((idx == centre[:, None]).any(1).all())  # the centre is always in the window
    assert bool((idx[:, 1:] > idx[:, :-1]).all())
    if lt > 1:
        assert centre[0] == 0 and centre[-1] == ls - 1
        assert bool((centre[1:] >= centre[:-1]).all())


def test_layer_alignment_relative_depth():
    assert center_layers(30, 24).tolist()[:4] == [0, 1, 3, 4]
    assert align_layers(30, 24, radius=0).flatten().tolist() == center_layers(30, 24).tolist()
    assert align_layers(30, 24, radius=2)[0].tolist() == [0, 1, 2, 3, 4]  # shifted at the edge
