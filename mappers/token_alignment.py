"""Token alignment: which source tokens a target token may draw features from.

Both models tokenize the same chunk text; each tokenizer reports, per token, the
character span ``[start, end)`` it covers. Alignment works on those spans only,
so it is independent of the two vocabularies.

**What a token has seen.** A causal model's state at token *i* depends on the text
up to the furthest character any of tokens ``0..i`` covers. That is the running
maximum of the span ends, which this module calls a token's *reach*. Using the
reach instead of the raw end makes the awkward cases regular:

- special tokens carry the span ``(0, 0)``; their reach is that of the token
  before them (0 at the start), so they neither look ahead nor break sorting;
- byte-fallback and split multi-byte characters give several tokens the same
  or overlapping spans (``(3, 4), (3, 4), (3, 4)``), or empty ones (``(4, 4)``);
  they share one reach, the end of the character;
- whitespace-merging tokenizers put the space at the start of the next token
  (``"Ġfox"`` = ``(3, 7)``) or leave it out of the span (``(4, 7)``); ends, and so
  reaches, are the same either way.

**The rule (no look-ahead).** Target token *t* with reach ``r_t`` is aligned to the
last source token whose reach is ``<= r_t`` (one ``searchsorted``), optionally with
the ``window - 1`` source tokens before it. Every source token used has seen no
text beyond the target token's own end.

**A target token with no source.** When every source token reaches past ``r_t``
(the target splits the first word finer than the source), the token has no
admissible source feature. It is then flagged ``has_source = False``, its index is
clamped to 0 so that ``gather`` stays legal, and a mapper must not use the
gathered feature: the mappers here substitute the calibration mean of the
features (so a linear map predicts the target's mean K/V for it) and leave such
tokens out of fitting. The same holds per window slot (``valid``).

Everything is vectorised (``torch.searchsorted``, ``cummax``); there is no Python
loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenAlignment:
    """Target token → source token indices, ready for ``gather``/``index_select``.

    index:      ``[target_tokens, window]`` int64 source-token indices; column 0 is
                the last admissible source token, column k the k-th one before it.
                Invalid slots are clamped to 0 (see `valid`).
    valid:      ``[target_tokens, window]`` bool, True where the slot is a real
                admissible source token.
    has_source: ``[target_tokens]`` bool, ``valid[:, 0]``.
    source_reach, target_reach: ``[tokens]`` int64 running-max span ends.
    """

    index: torch.Tensor
    valid: torch.Tensor
    has_source: torch.Tensor
    source_reach: torch.Tensor
    target_reach: torch.Tensor

    @property
    def window(self) -> int:
        return int(self.index.shape[1])

    @property
    def num_target(self) -> int:
        return int(self.index.shape[0])

    @property
    def fully_valid(self) -> torch.Tensor:
        """``[target_tokens]`` bool: every window slot is real (the rows used for fitting)."""
        return self.valid.all(dim=1)


def _as_offsets(offsets) -> torch.Tensor:
    t = torch.as_tensor(offsets, dtype=torch.long)
    if t.numel() == 0:
        return t.reshape(0, 2)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"offsets must be [tokens, 2], got {tuple(t.shape)}")
    return t


def token_reach(offsets) -> torch.Tensor:
    """Running maximum of span ends: how far into the text each token's state has seen."""
    off = _as_offsets(offsets)
    if off.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.cummax(off[:, 1], dim=0).values


def align_tokens(source_offsets, target_offsets, *, window: int = 1) -> TokenAlignment:
    """Align target tokens to source tokens of the same text by character offsets.

    See the module docstring for the rule and for tokens without a source.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    src_reach = token_reach(source_offsets)
    tgt_reach = token_reach(target_offsets)
    # last source token with reach <= target reach
    last = torch.searchsorted(src_reach, tgt_reach, right=True) - 1  # [T]
    steps = torch.arange(window, dtype=torch.long)
    index = last[:, None] - steps[None, :]
    valid = index >= 0
    index = index.clamp_min(0)
    if src_reach.numel() == 0:
        valid = torch.zeros_like(valid)
    return TokenAlignment(index=index, valid=valid, has_source=valid[:, 0].clone(),
                          source_reach=src_reach, target_reach=tgt_reach)


@dataclass(frozen=True)
class AgreedSpans:
    """Spans on which both tokenizations agree on the boundaries (tokenkit-style).

    A *boundary* is a character position that both tokenizations reach exactly at
    some token (the last token of each side with that reach). Consecutive
    boundaries delimit spans of equal text: source tokens
    ``source_start[k]:source_end[k]`` and target tokens
    ``target_start[k]:target_end[k]`` cover the same characters.
    """

    boundaries: torch.Tensor  # [spans] char positions (end of each span)
    source_end: torch.Tensor  # [spans] exclusive token index
    target_end: torch.Tensor
    source_start: torch.Tensor
    target_start: torch.Tensor

    def __len__(self) -> int:
        return int(self.boundaries.numel())


def _last_of_each_reach(reach: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct positive reaches and, for each, the index of the last token having it."""
    if reach.numel() == 0:
        return reach, reach
    is_last = torch.ones_like(reach, dtype=torch.bool)
    is_last[:-1] = reach[1:] != reach[:-1]
    is_last &= reach > 0
    idx = torch.nonzero(is_last).flatten()
    return reach[idx], idx


def agreed_spans(source_offsets, target_offsets) -> AgreedSpans:
    """Spans of equal text whose boundaries both tokenizations share."""
    s_vals, s_idx = _last_of_each_reach(token_reach(source_offsets))
    t_vals, t_idx = _last_of_each_reach(token_reach(target_offsets))
    # intersect two sorted unique vectors
    if t_vals.numel() == 0:
        pos = torch.zeros_like(s_vals)
        match = torch.zeros_like(s_vals, dtype=torch.bool)
    else:
        pos = torch.searchsorted(t_vals, s_vals).clamp_max(t_vals.numel() - 1)
        match = t_vals[pos] == s_vals
    bounds = s_vals[match]
    s_end = s_idx[match] + 1
    t_end = t_idx[pos[match]] + 1
    zero = torch.zeros(1, dtype=torch.long)
    return AgreedSpans(boundaries=bounds, source_end=s_end, target_end=t_end,
                       source_start=torch.cat([zero, s_end[:-1]]),
                       target_start=torch.cat([zero, t_end[:-1]]))


def assert_no_lookahead(alignment: TokenAlignment) -> None:
    """Raise if any valid slot uses a source token that has seen past its target token's end."""
    reach = alignment.source_reach[alignment.index] if alignment.source_reach.numel() else alignment.index
    bad = alignment.valid & (reach > alignment.target_reach[:, None])
    if bool(bad.any()):
        raise AssertionError(f"{int(bad.sum())} aligned slots look ahead")
