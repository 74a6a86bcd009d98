"""Greedy generation against a prepared cache, one token at a time.

A small loop in the style of gpt-fast rather than ``model.generate``: the
caller owns the cache (already holding the context), the loop prefills the
question, then decodes. Owning the loop makes the time to first token exact
(it ends when the first token is chosen), makes streaming a plain iterator, and
keeps the LM head off the question's other positions (`last_logits`), which
matters for a 150k-262k-word vocabulary.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class Step:
    """One generated token, and the text it completes (may be empty mid-character)."""

    token_id: int | None  # None: a closing step that only flushes held-back text
    text: str
    seconds: float  # since the question prefill started


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    question_prefill_s: float = 0.0  # question tokens → first token chosen
    decode_s: float = 0.0
    stopped_by: str = "length"  # "stop_token" | "length"


_STOP_IDS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], frozenset[int]]]" = weakref.WeakKeyDictionary()


CHAT_TURN_ENDS = ("<|im_end|>", "<end_of_turn>")  # what a chat answer ends with: Qwen/SmolLM2's, Gemma's


def stop_token_ids(tokenizer, extra: Iterable[str] = (*CHAT_TURN_ENDS, "<|endoftext|>")) -> set[int]:
    """The EOS id plus the end-of-turn markers of the chat formats we know, where the vocabulary has them.

    Once per tokenizer: its vocabulary dict takes 0.24 s to build for Qwen2.5's 151k tokens,
    which every answer used to pay before its first token.
    """
    key = tuple(extra)
    per_tokenizer = _STOP_IDS.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        ids = set()
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in key if t in vocab)
        per_tokenizer[key] = frozenset(ids)
    return set(per_tokenizer[key])


def last_logits(model, input_ids: torch.Tensor, cache: DynamicCache, *, positions: int = 1) -> torch.Tensor:
    """Logits of the last `positions` positions after reading `input_ids` into `cache`.

    The LM head is applied here, on a 2-D slice of the hidden states, rather than
    through ``logits_to_keep``: transformers applies the head to a 3-D slice view,
    for which matmul falls back to a batched product that copies the whole
    (transposed) head weight on every call: 0.3-0.5 s a token for a 150k-262k
    vocabulary on a CPU, more than the rest of the forward.
    """
    hidden = model.model(input_ids=input_ids, past_key_values=cache, use_cache=True).last_hidden_state
    return head_logits(model, hidden[0, -positions:])


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head (and the final logit soft-cap, where the model has one) over ``[positions, hidden]``."""
    logits = model.lm_head(hidden.contiguous())
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def stream_tokens(model, tokenizer, cache: DynamicCache, question_ids: torch.Tensor, *,
                  max_new_tokens: int, stop_ids: set[int], first_logits: torch.Tensor | None = None,
                  copy_prior: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> Iterator[Step]:
    """Prefill `question_ids` against `cache`, then decode greedily; yields each token.

    The cache is extended in place. Text is decoded incrementally over the whole
    generation so that multi-byte characters split across tokens come out whole.
    `first_logits`: the question is in `cache` already (read in a recompute's forward,
    `Assembler.place(with_question=...)`) and these are its last token's logits.
    `copy_prior`: maps (logits, tokens so far) to the scores a token is chosen by (`cag.copy_prior`).
    """
    if question_ids.numel() == 0:
        raise ValueError("nothing to prefill: the question has no tokens")
    device = next(model.parameters()).device
    started = time.perf_counter()
    if first_logits is None:
        first_logits = last_logits(model, question_ids[None].to(device), cache)[-1]
    logits = first_logits
    generated: list[int] = []
    shown = ""
    for _ in range(max_new_tokens):
        if copy_prior is not None:
            logits = copy_prior(logits, generated)
        token = int(torch.argmax(logits))
        if token in stop_ids:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        piece = ""
        if not text.endswith("\ufffd"):  # else: half a character; wait for the rest
            piece, shown = text[len(shown):], text
        yield Step(token, piece, time.perf_counter() - started)
        if len(generated) == max_new_tokens:
            break
        logits = last_logits(model, torch.tensor([[token]], device=device), cache)[-1]
    final = tokenizer.decode(generated, skip_special_tokens=True)
    if final != shown:  # a character left incomplete at the end: flush what there is
        yield Step(None, final[len(shown):], time.perf_counter() - started)


def generate(model, tokenizer, cache: DynamicCache, question_ids: torch.Tensor, *,
             max_new_tokens: int, stop_ids: set[int], first_logits: torch.Tensor | None = None,
             copy_prior: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> Generation:
    """`stream_tokens`, collected; with the question-prefill and decode times split."""
    out = Generation()
    started = time.perf_counter()
    for step in stream_tokens(model, tokenizer, cache, question_ids, max_new_tokens=max_new_tokens,
                              stop_ids=stop_ids, first_logits=first_logits, copy_prior=copy_prior):
        if step.token_id is None:
            continue
        if not out.token_ids:
            out.question_prefill_s = step.seconds
        out.token_ids.append(step.token_id)
    total = time.perf_counter() - started
    if not out.token_ids:
        out.question_prefill_s = total
    out.decode_s = total - out.question_prefill_s
    out.stopped_by = "length" if len(out.token_ids) >= max_new_tokens else "stop_token"
    out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return out
