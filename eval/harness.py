"""Run every condition of DESIGN.md on the same question and the same chunks.

For one question and one target model, with the chunks retrieved once:

- ``no_context`` (NC): the shared prefix, then the question. The floor.
- ``direct`` (DC): the target prefills the chunks' text, then the question. The reference.
- ``native_cache`` (NCC): the target's own cache of each chunk, prefilled chunk by
  chunk and assembled: what chunk independence alone costs.
- ``cache:<method>`` (TC): the store's source-model chunks, translated by a mapper
  and assembled, through `CachedContext.prepare`, the path a query takes;
- ``copy_only:<method>``, beside a TC that decodes with a copy prior: a control, the same copy prior
  (the chunks' text, the pointer's words at equal mass) over no context's cache. What the decoding
  rules find without any context cache.

Each condition is measured twice from its context cache (copied, as a forward
extends a cache in place): once teacher-forcing the gold answer after the
question (log-likelihood, and the next-token distributions for KL and top-1
against DC), once generating greedily (exact match, F1, answer found).
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from cag.assembler import GUIDED_SELECT
from cag.context import CachedContext
from cag.generate import generate, last_logits, stop_token_ids
from eval import metrics

NO_CONTEXT, DIRECT, NATIVE = "no_context", "direct", "native_cache"
COPY_ONLY = "copy_only"  # the copy prior's rules with no context cache: a control beside each translated condition

# Any text costs the same to prefill (dense attention): a fixed filler keeps the
# measured rate independent of datasets and of optional packages.
_FILLER = ("The committee met on Tuesday to review the harbour accounts, and the clerk read "
           "the minutes of the previous meeting aloud before the vote. ")


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo on Linux, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_info() -> dict[str, Any]:
    """What a timing depends on besides the code: CPU, cores, torch threads, load.

    Ratios move with the host (a slower CPU makes direct context slower and the
    speedups larger), so every report carries these beside its figures.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def host_line(host: dict[str, Any], prefill: dict[str, dict[str, Any]]) -> str:
    """The host in one sentence, for a report's header: CPU, cores, threads, each target's prefill rate."""
    rates = "; ".join(f"{t} {r['prefill_tok_s']:,.0f} tokens/s ({r['prefill_tokens']} tokens)"
                      for t, r in prefill.items())
    return (f"Host: {host.get('cpu')}, {host.get('cores')} cores ({host.get('usable_cores')} usable), "
            f"torch {host.get('torch')} with {host.get('torch_threads')} threads. Prefill rate measured in this "
            f"run: {rates or 'not measured'}.")


@torch.inference_mode()
def measure_prefill_rate(lm, tokens: int = 1024, repeats: int = 2) -> dict[str, Any]:
    """The target's prefill rate on this host: `tokens` tokens from an empty cache,
    one warm-up then the median of `repeats`, in tokens per second.

    The base model only (no LM head), as a context prefill runs. Capped at the
    model's position limit.
    """
    limit = int(getattr(lm.model.config, "max_position_embeddings", tokens))
    n = max(1, min(tokens, limit))
    ids, _ = lm.tokenize(_FILLER * (n // 8 + 1))
    ids = ids[:n].to(lm.device)
    times = []
    for i in range(repeats + 1):
        cache = DynamicCache(config=lm.model.config)
        started = time.perf_counter()
        with torch.inference_mode():  # as every prefill runs: no autograd graph
            lm.model.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        if i:  # the first forward pays one-time allocations
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {"prefill_tok_s": round(ids.numel() / seconds, 1), "prefill_tokens": int(ids.numel()),
            "prefill_s": round(seconds, 4)}


@dataclass
class ConditionResult:
    condition: str
    answer: str
    exact_match: float
    f1: float
    found: float
    gold_log_likelihood: float
    kl_from_direct: float | None
    top1_with_direct: float | None
    ttft_s: float
    context_tokens: int
    warnings: list[str] = field(default_factory=list)
    recomputed_tokens: int = 0  # context tokens the target recomputed (selective recompute)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Run:
    """A condition's context cache and what it took to get there."""

    cache: DynamicCache
    question_ids: torch.Tensor
    context_tokens: int
    setup_s: float  # the part of TTFT spent before the question is prefilled
    warnings: list[str]
    context_span: tuple[int, int] | None = None  # placed context block, for APE's temperature and scale
    recomputed_tokens: int = 0
    # The question read in the recompute's forward, as `CachedContext.stream` serves it: the cache holds
    # the question and these are its last token's logits. None: the question is prefilled over the cache.
    first_logits: torch.Tensor | None = None
    copy_prior: Any = None  # the context's cag.copy_prior.CopyPrior, as `CachedContext.stream` decodes with it


class ItemRunner:
    """Runs the conditions for one target model (one `CachedContext` per mapper method).

    Methods with no mapper for the pair are simply absent from `contexts`: the
    text and native conditions are measured all the same.
    """

    def __init__(self, base: CachedContext, contexts: dict[str, CachedContext], *,
                 max_new_tokens: int = 24) -> None:
        self.base = base  # retrieval, the target and its assembler
        self.contexts = contexts  # method -> CachedContext over the same store and target
        self.max_new_tokens = max_new_tokens
        self._chunk_memo: dict[str, Any] = {}

    @property
    def lm(self):
        return self.base.target_model

    def hits_for(self, item) -> list[Any]:
        if item.context == "all":
            return self.base.document_hits([d.id for d in item.documents])
        # A question that brings its own pool retrieves from it alone: `cag eval` puts every dataset in one
        # store, and the needles' haystacks are cut from the essays essay-qa asks about (near-copies,
        # some with a planted fact), which took 1-3 of the top 4 chunks on 23 of its 33 questions.
        return self.base.retrieve(item.question, doc_ids=[d.id for d in item.documents] or None)

    # ------------------------------------------------------------ conditions

    def _text_run(self, item, hits, *, with_context: bool) -> _Run:
        lm, asm = self.lm, self.base.assembler
        started = time.perf_counter()
        context = [lm.tokenize(h.text)[0] for h in hits] if with_context else []
        cache = asm.direct_cache(context)
        return _Run(cache, asm.question_ids(item.question), sum(c.numel() for c in context),
                    time.perf_counter() - started, [])

    def _prefilled(self, text: str):
        """The target's own chunk of `text`, prefilled once per runner (an ablation places it many times)."""
        chunk = self._chunk_memo.get(text)
        if chunk is None:
            if len(self._chunk_memo) >= 32:  # a few items' chunks: memory stays bounded on long runs
                self._chunk_memo.clear()
            chunk = self._chunk_memo[text] = self.lm.prefill(text)
        return chunk

    def _native_run(self, item, hits) -> _Run:
        """The target's own chunk caches; their prefill is offline work, not TTFT."""
        asm = self.base.assembler
        chunks = [self._prefilled(h.text) for h in hits]
        started = time.perf_counter()
        question_ids = asm.question_ids(item.question)
        base = self.base
        positions = None
        if base.recompute_select in GUIDED_SELECT and base.recompute_ratio > 0 and chunks:
            # Chosen as a query would: the store's source model (or the retriever) over the same hits.
            positions = base._guided_positions(item.question, chunks, hits, asm)
        merge = base.ape_settings(native=True) == (1.0, 1.0)  # as a native `CachedContext.stream` serves it
        placed = asm.place(chunks, recompute_ratio=base.recompute_ratio, recompute_select=base.recompute_select,
                           question_ids=question_ids, first_k=base.recompute_first_k, positions=positions,
                           key_scales=base.rank_key_scales(hits, native=True),
                           with_question=question_ids if merge else None)
        return _Run(placed.cache, question_ids,
                    placed.context_ids.numel() - placed.prefix_tokens, time.perf_counter() - started, [],
                    (placed.prefix_tokens, placed.context_ids.numel()), placed.recomputed_tokens,
                    placed.question_logits)

    def _cached_run(self, ctx: CachedContext, item, hits) -> _Run:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # As `stream` serves it: with a recompute and the model's own attention, the question is read in
            # the recompute's forward (the same logits up to rounding, one pass over the weights fewer).
            prepared = ctx.prepare(item.question, hits, max_new_tokens=self.max_new_tokens, with_question=True)
        t = prepared.answer.timings
        setup = t.load + t.translate + t.assemble + t.choose + t.recompute + t.point
        return _Run(prepared.cache, prepared.question_ids, prepared.answer.context_tokens, setup,
                    list(prepared.answer.warnings), prepared.context_span, prepared.answer.recomputed_tokens,
                    prepared.first_logits, prepared.copy_prior)

    # ----------------------------------------------------------- measurement

    def gold_ids(self, answer: str) -> torch.Tensor:
        # A plain layout ends with "Answer:", so the answer starts after a space;
        # a chat layout ends with the assistant header and a newline.
        text = answer if self.base.assembler.layout.chat else " " + answer
        return self.lm.tokenize(text)[0]

    @torch.inference_mode()
    def teacher_forced(self, run: _Run, gold: torch.Tensor) -> torch.Tensor:
        """Log-probs of the `gold` ids after the question, from a copy of the run's cache."""
        if run.first_logits is None:
            ids = torch.cat([run.question_ids, gold[:-1]])
            logits = last_logits(self.lm.model, ids[None], copy.deepcopy(run.cache), positions=gold.numel())
        else:  # the cache holds the question already
            logits = run.first_logits[None]
            if gold.numel() > 1:
                rest = last_logits(self.lm.model, gold[None, :-1], copy.deepcopy(run.cache), positions=gold.numel() - 1)
                logits = torch.cat([logits, rest])
        return torch.log_softmax(logits.float(), -1)

    def _ape(self, name: str, run: _Run):
        """APE's context temperature and scale over a cached condition's context, as its `CachedContext` serves it."""
        from contextlib import nullcontext

        from cag.models.attention import context_temperature

        if run.context_span is None:
            return nullcontext()
        if name == NATIVE:  # the target's own chunks, whatever model built the store
            temperature, scale = self.base.ape_settings(native=True)
        elif (ctx := self.contexts.get(name.removeprefix("cache:"))) is not None:
            temperature, scale = ctx.ape_settings()
        else:
            return nullcontext()
        return context_temperature(self.lm.model, *run.context_span, temperature=temperature, scale=scale)

    def run(self, item) -> dict[str, ConditionResult]:
        """Every condition for `item`, on the same chunks."""
        self.lm  # load before timing anything
        hits = self.hits_for(item)
        return self.score(item, {**self.text_runs(item, hits), **self.cache_runs(item, hits)})

    def text_runs(self, item, hits) -> dict[str, _Run]:
        """The conditions that read the text: no context and direct context (they ignore the repair settings)."""
        return {NO_CONTEXT: self._text_run(item, hits, with_context=False),
                DIRECT: self._text_run(item, hits, with_context=True)}

    def cache_runs(self, item, hits) -> dict[str, _Run]:
        """The cached conditions under the contexts' current settings: native, then each mapper's.

        A mapper's condition that decodes with a copy prior gets a control beside it, ``copy_only:<method>``: the
        same rules over the same chunks' text, the pointer's words at equal mass, and a model that reads no context
        cache (no context's). What it finds, the decoding finds from the text alone; the rest is the cache's."""
        runs = {NATIVE: self._native_run(item, hits)}
        for method, ctx in self.contexts.items():
            runs[f"cache:{method}"] = run = self._cached_run(ctx, item, hits)
            if run.copy_prior is not None:
                control = self._text_run(item, hits, with_context=False)
                runs[f"{COPY_ONLY}:{method}"] = replace(control, copy_prior=run.copy_prior.evened())
        return runs

    def score(self, item, runs: dict[str, _Run], reference: torch.Tensor | None = None) -> dict[str, ConditionResult]:
        """Teacher-force the gold answer and generate from every run (generation extends each run's cache).

        KL and top-1 are against `reference`, direct context's teacher-forced log-probs
        (`teacher_forced` over the DIRECT run), else against DIRECT in `runs`.
        """
        gold = self.gold_ids(item.answers[0])
        log_probs = {}
        for name, run in runs.items():
            with self._ape(name, run):
                log_probs[name] = self.teacher_forced(run, gold)
        reference = log_probs[DIRECT] if reference is None else reference
        stops = stop_token_ids(self.lm.tokenizer)
        results = {}
        for name, run in runs.items():
            with self._ape(name, run):
                gen = generate(self.lm.model, self.lm.tokenizer, run.cache, run.question_ids,
                               max_new_tokens=self.max_new_tokens, stop_ids=stops, first_logits=run.first_logits,
                               copy_prior=run.copy_prior)
            is_direct = name == DIRECT
            results[name] = ConditionResult(
                condition=name, answer=gen.text.strip(),
                exact_match=metrics.exact_match(gen.text, item.answers),
                f1=metrics.token_f1(gen.text, item.answers),
                found=metrics.contains_answer(gen.text, item.answers),
                gold_log_likelihood=metrics.gold_log_likelihood(log_probs[name], gold),
                kl_from_direct=None if is_direct else metrics.kl_divergence(reference, log_probs[name]),
                top1_with_direct=None if is_direct else metrics.top1_agreement(reference, log_probs[name]),
                ttft_s=run.setup_s + gen.question_prefill_s,
                context_tokens=run.context_tokens,
                warnings=run.warnings,
                recomputed_tokens=run.recomputed_tokens,
            )
        return results
