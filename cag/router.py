"""`Router`: the small model answers first from its own chunk caches; the large one only when
the small one is unsure, reusing the same retrieved chunks through its gated path.

    from cag import Router
    router = Router(store="kb-store", large="qwen2.5-0.5b")   # small: the store's source model
    routed = router.answer("When is the reading room open?")
    routed.route, routed.confidence, routed.text, routed.small_ttft_s, routed.large_ttft_s
    again = router.follow_up("And on Sundays?")    # same context, not placed or prefilled again
    again.context_prefill_tokens                    # 0

One query:

1. Retrieve once. The hits are handed to both models.
2. The **small** model (the store's source model: the chunk caches are its own,
   ``mapper="identity"``) places them and answers greedily, recording each
   generated token's log-probability and each step's entropy.
3. Its **confidence** is the policy's metric: ``mean_logprob`` (mean log-probability
   of the answer tokens; an empty answer has -inf) or ``neg_entropy`` (minus the
   mean entropy, in nats, of the first `FIRST_TOKENS` next-token distributions).
   Both are recorded whatever the policy reads.
4. Confidence ``>= threshold``: the small answer is served. Below: the **large** model
   answers over the same hits through a `CachedContext` whose quality gate
   (`cag.gate`) picks the path: the translated chunks when that path passes the
   gate, else direct context (its own prefill of the retrieved text), or
   `GateError` with ``fallback="raise"``. The router never prefills unless the
   large model's gate says so.

The threshold comes from `RouterPolicy`; without one, the policy calibrated by
``eval/router_calibrate.py`` on calibration-side lookup items (never an evaluation
set) is read from ``cag/router_policy.json``, for this small model. If there is no
such file or no entry for the small model, the router refuses to guess one.

**Follow-ups.** Each model's placed context cache (prompt head + chunks, nothing of
any question) is kept after `answer`. `follow_up` answers a new question over the
same context: it copies that cache (a deep copy, so the kept one is never
extended) and prefills only the new question. Each answer's
``context_prefill_tokens`` counts the context tokens a model ran a forward over
for it: 0 on a follow-up over contexts already placed. A follow-up is a new
question on the same context; the previous question and answer are not part of it.
A recompute chosen by the question (``recompute_select="question"``, ``"source"``,
``"retriever"``) was chosen for the first one and is kept with the cache.

The small model's answer is served only once it is complete (its mean
log-probability needs every token), so the router's own time to first token
(`RoutedAnswer.ttft_s`) is the small model's whole answer on the small route,
and that plus the large model's time to first token when it escalates.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import threading
import time
import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cag.context import Answer, CachedContext, Timings
from cag.gate import DEFAULT_MIN_RETENTION, served_repair

# neg_entropy reads the first this many next-token distributions of the small answer.
FIRST_TOKENS = 4
METRICS = ("mean_logprob", "neg_entropy")
POLICY_FILE = "router_policy.json"
# What the router sets on its two contexts itself; `context_options` may not.
_ROUTER_MANAGED = {"store", "target", "mapper", "top_k", "max_new_tokens", "min_retention", "fallback",
                   "recompute_ratio", "recompute_select", "dtype", "embedder"}


class RouterPolicyError(LookupError):
    """No routing policy was given and none is recorded for this small model."""


def policy_path() -> Path:
    return Path(__file__).resolve().with_name(POLICY_FILE)


class RouterPolicy(BaseModel):
    """When to escalate: the small answer's confidence (`metric`) below `threshold`."""

    metric: Literal["mean_logprob", "neg_entropy"] = "mean_logprob"
    threshold: float = Field(description="Escalate when confidence < threshold; -inf never escalates, "
                             "+inf always does.")
    small: str | None = Field(None, description="The small model the threshold was calibrated for.")
    large: str | None = Field(None, description="The large model it was calibrated with.")
    calibration: dict[str, Any] = Field(default_factory=dict, description="How it was chosen "
                                        "(items, rule, figures): written by eval/router_calibrate.py.")

    @field_validator("threshold")
    @classmethod
    def _not_nan(cls, value: float) -> float:
        if math.isnan(value):
            raise ValueError("threshold must be a number or ±inf, not NaN")
        return value

    def escalates(self, confidence: "Confidence") -> bool:
        return confidence.of(self.metric) < self.threshold

    @classmethod
    def recorded(cls, small: str, large: str | None = None, path: Path | None = None) -> "RouterPolicy":
        """The calibrated policy for `small` (preferring one calibrated with `large`) from the policy file."""
        path = path or policy_path()
        if not path.is_file():
            raise RouterPolicyError(_no_policy_file(path))
        entries = json.loads(path.read_text()).get("policies") or []
        mine = [e for e in entries if e.get("small") == small]
        if not mine:
            have = sorted({str(e.get("small")) for e in entries})
            raise RouterPolicyError(
                f"no router policy for the small model {small!r} in {path.name} (it has: {', '.join(have) or 'none'}): "
                "a log-probability threshold belongs to one model. Pass policy=RouterPolicy(...) or run "
                "`python eval/router_calibrate.py --small ...`.")
        best = next((e for e in mine if e.get("large") == large), mine[0])
        return cls.model_validate(best)


def _no_policy_file(path: Path) -> str:
    return (f"no router policy: {path} does not exist. Pass policy=RouterPolicy(metric='mean_logprob', "
            "threshold=...) or calibrate one with `python eval/router_calibrate.py` (calibration items only).")


# -------------------------------------------------------------------- decoding


@dataclass
class Decoded:
    """One greedy answer with what the router reads from it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)  # log p of each generated (answer) token
    entropies: list[float] = field(default_factory=list)  # nats, per step (a final stop step included)
    first_logits: Any = None  # float32 logits after the question: the first token's distribution
    question_prefill_s: float = 0.0  # question read → first token chosen
    decode_s: float = 0.0


@dataclass(frozen=True)
class Confidence:
    mean_logprob: float  # mean log p of the answer tokens; -inf for an empty answer
    neg_entropy: float  # minus the mean entropy of the first FIRST_TOKENS steps
    tokens: int

    @classmethod
    def of_decoded(cls, dec: Decoded) -> "Confidence":
        mean_lp = sum(dec.logprobs) / len(dec.logprobs) if dec.logprobs else float("-inf")
        first = dec.entropies[:FIRST_TOKENS]
        return cls(mean_lp, -sum(first) / len(first) if first else float("-inf"), len(dec.token_ids))

    def of(self, metric: str) -> float:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        return getattr(self, metric)


def greedy_decode(model, tokenizer, cache, question_ids, *, max_new_tokens: int,
                  stop_ids: set[int]) -> Generator[Any, None, Decoded]:
    """`cag.generate.stream_tokens` that also records log-probabilities and entropies.

    Yields `cag.generate.Step`s (text held back mid-character, as there); returns
    the `Decoded`. The cache is extended in place: pass a copy to keep it.
    """
    import torch

    from cag.generate import Step, last_logits

    if question_ids.numel() == 0:
        raise ValueError("nothing to prefill: the question has no tokens")
    device = next(model.parameters()).device
    out = Decoded()
    with torch.inference_mode():
        started = time.perf_counter()
        logits = last_logits(model, question_ids[None].to(device), cache)[-1].float()
        out.first_logits = logits.cpu()
        shown = ""
        first_at = None
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(logits))
            out.entropies.append(float(-(logp.exp() * logp).sum()))
            if token in stop_ids:
                break
            out.token_ids.append(token)
            out.logprobs.append(float(logp[token]))
            if first_at is None:
                first_at = time.perf_counter() - started
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            piece = ""
            if not text.endswith("\ufffd"):  # half a character: wait for the rest
                piece, shown = text[len(shown):], text
            yield Step(token, piece, time.perf_counter() - started)
            if len(out.token_ids) == max_new_tokens:
                break
            logits = last_logits(model, torch.tensor([[token]], device=device), cache)[-1].float()
        total = time.perf_counter() - started
    out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if out.text != shown:
        yield Step(None, out.text[len(shown):], total)
    out.question_prefill_s = first_at if first_at is not None else total
    out.decode_s = total - out.question_prefill_s
    return out


# ----------------------------------------------------------------- the answer


@dataclass
class RoutedAnswer:
    """The served `Answer` and how it was routed. Reads like an `Answer` (text, sources, ...)."""

    answer: Answer  # the served answer, with its own model's timings
    route: str  # "small" | "large"
    confidence: float  # the small answer's confidence under the policy's metric
    threshold: float
    metric: str
    small_answer: str
    small_ttft_s: float  # the small model's time to first token, from the start of the query
    small_total_s: float  # the small model's whole answer: the routing decision waits for it
    large_ttft_s: float | None  # the large model's time to first token from the start of its turn
    large_path: str | None  # the large model's gated path: "translated[+repair]" | "direct" (None: not escalated)
    ttft_s: float  # start of the query → first token of the served answer
    total_s: float  # start of the query → the served answer complete
    context_prefill_tokens: int  # context tokens any model ran a forward over for this answer
    small_confidence: Confidence
    follow_up: bool = False
    small_timings: Timings = field(default_factory=Timings)
    large_timings: Timings | None = None
    small_decoded: Decoded | None = field(default=None, repr=False)
    large_decoded: Decoded | None = field(default=None, repr=False)
    warnings: list[str] = field(default_factory=list)

    # the Answer surface (cag.llama_index reads these)
    @property
    def text(self) -> str:
        return self.answer.text

    @property
    def sources(self) -> list[Any]:
        return self.answer.sources

    @property
    def context_tokens(self) -> int:
        return self.answer.context_tokens

    @property
    def mapper(self) -> str:
        return self.answer.mapper

    @property
    def path(self) -> str:
        return self.answer.path

    @property
    def gate(self) -> dict[str, Any]:
        return self.answer.gate

    @property
    def condition(self) -> str:
        return self.answer.condition

    @property
    def timings(self) -> Timings:
        """End to end: both models' set-up summed, the served model's question prefill and decode,
        ``first_token`` = `ttft_s`, ``total`` from the start of the query."""
        s, lg = self.small_timings, self.large_timings or Timings()
        served = self.answer.timings
        return Timings(retrieve=s.retrieve, load=s.load + lg.load, translate=s.translate + lg.translate,
                       assemble=s.assemble + lg.assemble, choose=s.choose + lg.choose,
                       recompute=s.recompute + lg.recompute, point=s.point + lg.point,
                       question_prefill=served.question_prefill, first_token=self.ttft_s,
                       decode=served.decode, total=self.total_s)

    def route_info(self) -> dict[str, Any]:
        return {"route": self.route, "confidence": self.confidence, "threshold": self.threshold,
                "metric": self.metric, "small_answer": self.small_answer, "small_ttft_s": self.small_ttft_s,
                "small_total_s": self.small_total_s, "large_ttft_s": self.large_ttft_s,
                "large_path": self.large_path, "ttft_s": self.ttft_s, "total_s": self.total_s,
                "context_prefill_tokens": self.context_prefill_tokens, "follow_up": self.follow_up,
                "small_confidence": {"mean_logprob": self.small_confidence.mean_logprob,
                                     "neg_entropy": self.small_confidence.neg_entropy,
                                     "tokens": self.small_confidence.tokens}}

    def to_dict(self) -> dict[str, Any]:
        return {**self.route_info(), "answer": self.answer.to_dict(), "timings": self.timings.to_dict(),
                "small_timings": self.small_timings.to_dict(),
                "large_timings": self.large_timings.to_dict() if self.large_timings else None,
                "warnings": list(self.warnings)}


# ---------------------------------------------------------------------- router


@dataclass
class _Placed:
    """One model's context cache (head + chunks), kept for follow-ups and never extended."""

    cache: Any
    length: int  # tokens the cache covers
    template: Answer  # sources, context tokens, mapper, path, gate, warnings; no text
    prefill_tokens: int  # context tokens the model ran a forward over to make it
    # load / translate / assemble / recompute, or the direct prefill (in `assemble`); None once a turn
    # has counted it (follow-ups start from the kept cache)
    setup: Timings | None


@dataclass
class _Conversation:
    hits: list[Any]
    small: _Placed | None = None
    large: _Placed | None = None


class Router(BaseModel):
    """Small model first, large model when it is unsure, both over one retrieval (see module doc)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: Path | str = Field(description="The store (`cag build`): a directory or a redis:// URL.")
    small: str | None = Field(None, description="The small model: the store's source model (default: "
                              "the one the store records). Its chunk caches are native to it.")
    large: str = Field("qwen2.5-0.5b", description="The model that answers when the small one is unsure.")
    policy: RouterPolicy | None = Field(None, description="When to escalate; None: the calibrated "
                                        "policy in cag/router_policy.json for the small model.")
    top_k: int = Field(4, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    mapper: str = Field("auto", description="The large model's mapper (its CachedContext's `mapper`).")
    min_retention: float = Field(DEFAULT_MIN_RETENTION, ge=0.0, le=1.0,
                                 description="The large model's quality gate (cag.gate).")
    fallback: Literal["direct", "raise"] = "direct"
    recompute_ratio: float = Field(0.0, ge=0.0, le=1.0, description="The large model's selective "
                                   "recompute on its translated chunks (repair).")
    recompute_select: Literal["deviation", "question", "first_k", "source", "retriever"] = "deviation"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    embedder: Any = Field(None, exclude=True)
    context_options: dict[str, Any] = Field(default_factory=dict, description="Other CachedContext "
                                            "settings for both models (chunk_order, translation_cache_mb, ...).")

    _small_ctx: Any = PrivateAttr(None)
    _large_ctx: Any = PrivateAttr(None)
    _policy: Any = PrivateAttr(None)
    _conversation: Any = PrivateAttr(None)
    _last_answer: Any = PrivateAttr(None)
    _lock: Any = PrivateAttr(default_factory=threading.RLock)

    @field_validator("context_options")
    @classmethod
    def _known_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(CachedContext.model_fields))
        managed = sorted(set(value) & _ROUTER_MANAGED)
        if unknown:
            raise ValueError(f"context_options: not CachedContext settings: {unknown}")
        if managed:
            raise ValueError(f"context_options: set by the router itself (use its own fields): {managed}")
        return value

    @model_validator(mode="after")
    def _policy_exists(self) -> "Router":
        # Checked now, not at the first query: a router without a threshold is a set-up error.
        if self.policy is None and not policy_path().is_file():
            raise RouterPolicyError(_no_policy_file(policy_path()))
        return self

    # ------------------------------------------------------------------ set-up

    @property
    def small_context(self) -> CachedContext:
        """The small model's context: the store's own chunk caches (identity mapper)."""
        with self._lock:
            if self._small_ctx is None:
                ctx = CachedContext(store=self.store, target=self.small or "", mapper="identity", **self._shared())
                source = ctx._current_view()[0].source_fingerprint  # EmptyStoreError when nothing is published
                if not self.small:
                    ctx.target = source.name  # the store records the model that made its chunks (read lazily)
                lm = ctx.target_model
                if lm.fingerprint.id != source.id:
                    raise ValueError(f"the router's small model must be the store's source model "
                                     f"{source.describe()} (its chunk caches are native to it); "
                                     f"{self.small!r} is {lm.fingerprint.describe()}")
                self._small_ctx = ctx
            return self._small_ctx

    @property
    def large_context(self) -> CachedContext:
        """The large model's context over the same store; its quality gate picks its path."""
        with self._lock:
            if self._large_ctx is None:
                self._large_ctx = CachedContext(
                    store=self.store, target=self.large, mapper=self.mapper, min_retention=self.min_retention,
                    fallback=self.fallback, recompute_ratio=self.recompute_ratio,
                    recompute_select=self.recompute_select, **self._shared())
            return self._large_ctx

    def _shared(self) -> dict[str, Any]:
        return dict(top_k=self.top_k, max_new_tokens=self.max_new_tokens, dtype=self.dtype,
                    embedder=self.embedder, **self.context_options)

    @property
    def active_policy(self) -> RouterPolicy:
        with self._lock:
            if self._policy is None:
                self._policy = self.policy or RouterPolicy.recorded(self.small_context.target_model_name,
                                                                    self.large)
            return self._policy

    @property
    def last_answer(self) -> RoutedAnswer | None:
        return self._last_answer

    def ensure_chunks(self, texts: list[str]):
        """Find (or write through) the chunk caches of nodes from any retriever: the store's own,
        so the small model's context does it (see `CachedContext.ensure_chunks`)."""
        return self.small_context.ensure_chunks(texts)

    def retrieve(self, question: str, top_k: int | None = None) -> list[Any]:
        return self.small_context.retrieve(question, top_k)

    def reset(self) -> None:
        """Forget the kept context caches (the next `follow_up` needs an `answer` first)."""
        with self._lock:
            self._conversation = None

    # ----------------------------------------------------------------- answers

    def answer(self, question: str, hits: list[Any] | None = None, *,
               max_new_tokens: int | None = None) -> RoutedAnswer:
        """Route `question` over `hits` (retrieved once when None); keeps the context for follow-ups."""
        for _ in self.stream(question, hits, max_new_tokens=max_new_tokens):
            pass
        return self._last_answer

    def follow_up(self, question: str, *, max_new_tokens: int | None = None) -> RoutedAnswer:
        """A new question over the last answer's context, without placing or prefilling it again."""
        for _ in self.stream_follow_up(question, max_new_tokens=max_new_tokens):
            pass
        return self._last_answer

    def stream(self, question: str, hits: list[Any] | None = None, *,
               max_new_tokens: int | None = None) -> Generator[str, None, RoutedAnswer]:
        """Yield the served answer's text; the small route's comes in one piece, once it is complete."""
        with self._lock:
            t0 = time.perf_counter()
            retrieve_s = 0.0
            if hits is None:
                hits = self.retrieve(question)
                retrieve_s = time.perf_counter() - t0
            conversation = _Conversation(list(hits))
            self._conversation = conversation
            routed = yield from self._serve(question, conversation, t0, retrieve_s, max_new_tokens, False)
            return routed

    def stream_follow_up(self, question: str, *,
                         max_new_tokens: int | None = None) -> Generator[str, None, RoutedAnswer]:
        with self._lock:
            if self._conversation is None:
                raise RuntimeError("no context to follow up on: call answer() first (or after reset())")
            routed = yield from self._serve(question, self._conversation, time.perf_counter(), 0.0,
                                            max_new_tokens, True)
            return routed

    def _serve(self, question: str, conv: _Conversation, t0: float, retrieve_s: float,
               max_new_tokens: int | None, follow_up: bool):
        policy = self.active_policy
        max_new = max_new_tokens or self.max_new_tokens
        prefilled = 0
        small = self.small_context
        if conv.small is None:
            conv.small = self._place_small(question, conv.hits, max_new)
            prefilled += conv.small.prefill_tokens
        s_answer, s_dec = None, None
        turn = self._turn(small, conv.small, question, max_new, t0, retrieve_s)
        try:
            while True:
                next(turn)  # the small answer is not shown before it is judged
        except StopIteration as stop:
            s_answer, s_dec = stop.value
        confidence = Confidence.of_decoded(s_dec)
        value = confidence.of(policy.metric)
        common = dict(confidence=value, threshold=policy.threshold, metric=policy.metric,
                      small_answer=s_answer.text, small_ttft_s=s_answer.timings.first_token,
                      small_total_s=s_answer.timings.total, small_confidence=confidence, follow_up=follow_up,
                      small_timings=s_answer.timings, small_decoded=s_dec)
        if not policy.escalates(confidence):
            decided = time.perf_counter() - t0
            routed = RoutedAnswer(s_answer, "small", large_ttft_s=None, large_path=None, ttft_s=decided,
                                  total_s=decided, context_prefill_tokens=prefilled,
                                  warnings=list(s_answer.warnings), **common)
            self._last_answer = routed
            if s_answer.text:
                yield s_answer.text
            return routed
        large = self.large_context
        t_large = time.perf_counter()
        if conv.large is None:
            conv.large = self._place_large(question, conv.hits, max_new)
            prefilled += conv.large.prefill_tokens
        turn = self._turn(large, conv.large, question, max_new, t_large, 0.0)
        try:
            while True:
                yield next(turn)
        except StopIteration as stop:
            l_answer, l_dec = stop.value
        routed = RoutedAnswer(l_answer, "large", large_ttft_s=l_answer.timings.first_token,
                              large_path=l_answer.path, ttft_s=t_large - t0 + l_answer.timings.first_token,
                              total_s=time.perf_counter() - t0, context_prefill_tokens=prefilled,
                              large_timings=l_answer.timings, large_decoded=l_dec,
                              warnings=list(s_answer.warnings) + list(l_answer.warnings), **common)
        self._last_answer = routed
        return routed

    def _turn(self, ctx: CachedContext, placed: _Placed, question: str, max_new: int, t0: float,
              retrieve_s: float):
        """Answer `question` against a copy of `placed` with `ctx`'s model: yields text pieces,
        returns (Answer, Decoded). Timings from `t0`; set-up counted once, where it was paid."""
        from cag.generate import stop_token_ids

        lm, asm = ctx.target_model, ctx.assembler
        question_ids = asm.question_ids(question)
        window = ctx.context_window
        if placed.length + question_ids.numel() + max_new > window:
            raise ValueError(f"{lm.name}: the context ({placed.length} tokens), the question "
                             f"({question_ids.numel()}) and {max_new} new tokens exceed its window of {window}")
        timings = copy.copy(placed.setup) if placed.setup is not None else Timings()
        placed.setup = None  # paid by the turn that placed it; later turns start from the kept cache
        timings.retrieve = retrieve_s
        answer = copy.copy(placed.template)
        answer.text, answer.timings, answer.warnings = "", timings, list(placed.template.warnings)
        with asm.model_lock:
            t = time.perf_counter()
            cache = copy.deepcopy(placed.cache)  # the kept cache stays head + context only
            timings.assemble += time.perf_counter() - t
            decode = greedy_decode(lm.model, lm.tokenizer, cache, question_ids, max_new_tokens=max_new,
                                   stop_ids=stop_token_ids(lm.tokenizer))
            first = None
            try:
                while True:
                    step = next(decode)
                    if first is None and step.token_id is not None:
                        first = time.perf_counter()
                    answer.text += step.text
                    if step.text:
                        yield step.text
            except StopIteration as stop:
                dec = stop.value
        end = time.perf_counter()
        timings.question_prefill, timings.decode = dec.question_prefill_s, dec.decode_s
        timings.first_token = (first if first is not None else end) - t0
        timings.total = end - t0
        return answer, dec

    def _place_small(self, question: str, hits: list[Any], max_new: int) -> _Placed:
        """The small model's own chunk caches behind its head: no forward over the context."""
        ctx = self.small_context
        prepared = ctx.prepare(question, hits, max_new_tokens=max_new)
        template = prepared.answer
        template.gate = {"path": "native", "reason": "router: the small model's own chunk caches, served "
                         "when its confidence meets the policy's threshold", "fidelity": {}, "rejected": []}
        setup = copy.copy(template.timings)
        return _Placed(prepared.cache, ctx.assembler.prefix_ids.numel() + template.context_tokens, template,
                       template.recomputed_tokens, setup)

    def _place_large(self, question: str, hits: list[Any], max_new: int) -> _Placed:
        """The large model's context through its gate: translated chunks, or its own prefill of the text."""
        ctx = self.large_context
        decision = ctx.decision  # GateError here with fallback="raise" and nothing passing
        lm, asm = ctx.target_model, ctx.assembler
        if decision.path != "direct":
            prepared = ctx.prepare(question, hits, max_new_tokens=max_new, repair=served_repair(decision))
            # the same path, gate record and warnings CachedContext.stream gives its answers
            ctx._gate_answer(prepared.answer, decision, lm)
            template = prepared.answer
            return _Placed(prepared.cache, asm.prefix_ids.numel() + template.context_tokens, template,
                           template.recomputed_tokens, copy.copy(template.timings))
        warnings.warn(decision.reason, stacklevel=5)
        setup = Timings()
        ordered = ctx._order(hits)
        context_ids = [lm.tokenize(h.text)[0] for h in ordered]
        n_context = sum(c.numel() for c in context_ids)
        t = time.perf_counter()
        with asm.model_lock:
            cache = asm.direct_cache(context_ids)
        setup.assemble = time.perf_counter() - t  # the prefill of the text: the direct path's set-up
        template = Answer("", ordered, setup, context_tokens=n_context,
                          warnings=[decision.reason], condition="direct", path="direct", gate=decision.to_dict())
        n = asm.prefix_ids.numel() + n_context
        return _Placed(cache, n, template, n, setup)

    # -------------------------------------------------------- the LLM surface

    @property
    def context_window(self) -> int:
        return min(self.small_context.context_window, self.large_context.context_window)

    @property
    def target_model_name(self) -> str:
        return f"router({self.small_context.target_model_name}→{self.large_context.target_model_name})"

    def complete_text(self, prompt: str, *, max_new_tokens: int | None = None) -> str:
        """A plain prompt (no retrieved context) goes to the large model: the threshold was
        calibrated on lookups over retrieved context, and there is no cache to reuse."""
        return self.large_context.complete_text(prompt, max_new_tokens=max_new_tokens)

    def stream_text(self, prompt: str, *, max_new_tokens: int | None = None) -> Iterator[str]:
        return self.large_context.stream_text(prompt, max_new_tokens=max_new_tokens)

    def as_retriever(self, **kwargs):
        from cag.llama_index import make_retriever

        return make_retriever(self, **kwargs)

    def as_llm(self, *, max_new_tokens: int | None = None, callback_manager=None):
        """A LlamaIndex LLM: ``complete(question, nodes=...)`` routes over the nodes' caches;
        the route is in the completion's ``additional_kwargs``."""
        kwargs = {"callback_manager": callback_manager} if callback_manager else {}
        return router_llm_class()(self, max_new_tokens=max_new_tokens, **kwargs)

    def as_query_engine(self, streaming: bool = False, top_k: int | None = None, *,
                        max_new_tokens: int | None = None, node_postprocessors=None, callback_manager=None):
        """A stock `RetrieverQueryEngine` with the router as its LLM; response metadata has the route."""
        from llama_index.core.query_engine.retriever_query_engine import RetrieverQueryEngine

        from cag.llama_index import CachedContextSynthesizer, make_retriever

        llm = self.as_llm(max_new_tokens=max_new_tokens, callback_manager=callback_manager)
        synthesizer = CachedContextSynthesizer(self, llm=llm, streaming=streaming, max_new_tokens=max_new_tokens,
                                               callback_manager=callback_manager)
        return RetrieverQueryEngine(retriever=make_retriever(self, top_k=top_k, callback_manager=callback_manager),
                                    response_synthesizer=synthesizer, node_postprocessors=node_postprocessors,
                                    callback_manager=callback_manager)

    def close(self) -> None:
        for ctx in (self._small_ctx, self._large_ctx):
            if ctx is not None:
                ctx.close()


# ------------------------------------------------------------------- LlamaIndex


@functools.cache
def router_llm_class():
    """`RouterLLM`: `cag.llama_index.CachedContextLLM` over a `Router`, with the route in each
    completion's ``additional_kwargs["router"]`` (so in a query engine's response metadata).

    `CachedContextLLM` only needs the context surface the router has (``answer``, ``stream``,
    ``last_answer``, ``complete_text``, ...); this adds the route. Made on first use, so that
    ``import cag.router`` does not import LlamaIndex.
    """
    from cag.llama_index import CachedContextLLM

    def with_route(response):
        if isinstance(response.raw, RoutedAnswer):
            response.additional_kwargs["router"] = response.raw.route_info()
        return response

    class RouterLLM(CachedContextLLM):
        @classmethod
        def class_name(cls) -> str:
            return "RouterLLM"

        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any):
            return with_route(super().complete(prompt, formatted, **kwargs))

        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any):
            responses = super().stream_complete(prompt, formatted, **kwargs)
            return (with_route(r) for r in responses)

    return RouterLLM
