"""`CachedContext`: answer questions from a store's chunk caches, without prefilling them.

    from cag import CachedContext
    ctx = CachedContext(store="kb-store", target="qwen2.5-0.5b")
    answer = ctx.answer("When is the reading room open?")
    answer.text, answer.sources, answer.timings

One query: retrieve chunk keys from the store's index → load their KV bytes →
translate them into the target's space (identity for the source model itself)
→ place them behind the target's shared prefix (optionally recomputing a
fraction) → prefill only the question → generate. `Timings` splits the time to
first token into those steps.

Settings are pydantic fields; the heavy objects (models, store handles, the
assembler, the translated-chunk LRU) are private attributes created on first use.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from cag.gate import DEFAULT_MIN_RETENTION, GateDecision, served_copy_prior, served_repair
from cag.kv import ChunkError, KVChunk
from cag.models import registry

# The answer keeps this many tokens of room after the question in the target's window.
_DEFAULT_MAX_NEW_TOKENS = 64


class EmptyStoreError(LookupError):
    """The store has no published version, or no documents."""


class ChunkWriteError(RuntimeError):
    """A missing chunk cannot be prefilled the way the store's build made its chunks."""


@dataclass
class Timings:
    """Seconds per step of one query; `first_token` is the time to first token (TTFT)."""

    retrieve: float = 0.0
    load: float = 0.0
    translate: float = 0.0
    assemble: float = 0.0
    choose: float = 0.0  # choosing outside the target what to recompute, or which chunks a plain translated path reads
    recompute: float = 0.0  # the target's recompute forward (and, for its own choices, the choice)
    point: float = 0.0  # the copy prior's pointer head read over the placed context (cag.copy_prior)
    question_prefill: float = 0.0
    first_token: float = 0.0
    decode: float = 0.0
    total: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class Answer:
    text: str
    sources: list[Any]  # stores.index.Hit, in the order they were placed
    timings: Timings
    context_tokens: int = 0
    recomputed_tokens: int = 0
    warnings: list[str] = field(default_factory=list)
    mapper: str = ""
    condition: str = "cached"  # "cached" | "direct" | "no_context"
    path: str = ""  # the serving path the gate chose: "native" | "translated" | "direct" (see cag.gate)
    gate: dict[str, Any] = field(default_factory=dict)  # the decision: reason, measured fidelity, rejected paths

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "condition": self.condition, "mapper": self.mapper, "path": self.path,
                "gate": self.gate,
                "context_tokens": self.context_tokens, "recomputed_tokens": self.recomputed_tokens,
                "warnings": list(self.warnings), "timings": self.timings.to_dict(),
                "sources": [{"key": h.key, "doc_id": h.doc_id, "score": h.score, "start": h.start,
                             "end": h.end, "text": h.text} for h in self.sources]}


@dataclass
class Prepared:
    """A placed cache waiting for its question (see `CachedContext.prepare`)."""

    cache: Any  # transformers DynamicCache
    question_ids: Any  # torch.Tensor
    answer: "Answer"  # sources, timings so far, warnings; text still empty
    started: float  # perf_counter at the start of the query
    context_span: tuple[int, int] | None = None  # [first, end) positions of the placed chunks (after the head)
    # `prepare(with_question=True)` with a recompute: the question was read in the recompute's forward, the
    # cache holds it, and these are its last token's logits (generation starts from them). None: prefill it.
    first_logits: Any = None
    copy_prior: Any = None  # cag.copy_prior.TextCopyPrior over the placed chunks' text, when decoding uses one


@dataclass
class ChunkLookup:
    """What `CachedContext.ensure_chunks` found for a list of texts (in their order)."""

    keys: list[str | None]  # each text's content address; None: it has no chunk (see notes)
    found: int = 0  # texts whose chunk was already in the chunk store
    prefilled: int = 0  # texts prefilled by the source model and stored now (write-through)
    prefill_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _within(make_manager, steps):
    """Run each step of a generator inside a fresh ``make_manager()``, released between steps:
    a consumer that pauses a stream must not leave a shared model's attention patched."""
    iterator = iter(steps)
    while True:
        with make_manager():
            try:
                step = next(iterator)
            except StopIteration:
                return
        yield step


def _timed(steps, answer: "Answer", t0: float):
    """Yield each step's text into `answer`, filling its question-prefill, TTFT, decode and total."""
    timings, decode_started = answer.timings, None
    for step in steps:
        if decode_started is None and step.token_id is not None:
            decode_started = time.perf_counter()
            timings.question_prefill = step.seconds
            timings.first_token = decode_started - t0
        answer.text += step.text
        yield step.text
    end = time.perf_counter()
    if decode_started is None:  # stopped at once
        timings.question_prefill = timings.first_token = end - t0
        decode_started = end
    timings.decode, timings.total = end - decode_started, end - t0


class _TranslatedLRU:
    """Translated chunks kept in memory, bounded by bytes: a hot chunk is translated once."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, KVChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> KVChunk | None:
        with self._lock:
            chunk = self._items.get(key)
            if chunk is not None:
                self._items.move_to_end(key)
            return chunk

    def put(self, key: str, chunk: KVChunk) -> None:
        if chunk.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = chunk
            self._bytes += chunk.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes


class CachedContext(BaseModel):
    """Retrieval plus cache-augmented generation over a `cag` store (see module doc)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: Path | str = Field(description="The store built by `cag build`: a directory, or a "
                              "redis://host:port/NAME URL (stores.location).")
    target: str = Field("qwen2.5-0.5b", description="Answering model: short name, folder or HF id.")
    mapper: str = Field("auto", description="'auto', 'identity', a method name, or an artifact folder.")
    top_k: int = Field(4, ge=1, description="Chunks retrieved per question.")
    recompute_ratio: float = Field(0.0, ge=0.0, le=1.0, description="CacheBlend: fraction of context "
                                   "tokens the target recomputes (0 = none, 1 = direct context).")
    recompute_select: Literal["deviation", "question", "first_k", "source", "retriever", "source_retriever",
                              "source_chunk", "retriever_chunk"] = Field(
        "deviation", description="Which tokens are recomputed: 'deviation' (CacheBlend: K/V furthest from "
        "a fresh computation), 'question' (where the target's question attends over the placed cache), "
        "'first_k' (EPIC: the first recompute_first_k tokens of every chunk), 'source' (where the store's "
        "source model's contrastive question attention points, over its own chunks: for translated caches), "
        "'retriever' (sentences closest to the question by embedding); 'source_retriever' (both, by "
        "reciprocal rank fusion); 'source_chunk' / 'retriever_chunk': "
        "whole chunks by the same scores, while they fit in the ratio and at least one (prefill the crux). "
        "See cag.selection.")
    recompute_first_k: int = Field(16, ge=0, description="Tokens per chunk for recompute_select='first_k'.")
    translated_key_scale: float = Field(1.0, gt=0.0, le=1.0, description="Multiplies the keys of translated "
                                        "chunks (never recomputed ones): below 1 their logits flatten, so "
                                        "translated neighbours stop outdrawing a crux the target recomputed "
                                        "(see README, 'Chunk repair'). 1 = the mapper's keys as they are.")
    context_temperature: float | None = Field(None, gt=0.0, description="APE: the question's attention logits "
                                              "over the placed context are divided by T (full-attention layers). "
                                              "None: the target's calibrated default on the native path "
                                              "(cag.ape), 1 on a translated one.")
    context_scale: float | None = Field(None, gt=0.0, description="APE: the context's attention weight is "
                                        "scaled by S (log S added to its logits). None: as for T.")
    rank_key_decay: float | None = Field(None, gt=0.0, le=1.0, description="The keys of the chunk the "
                                         "retriever ranked i-th (0 = best) are multiplied by γ**i, so weaker "
                                         "chunks pull the question less, as they do in direct context, where "
                                         "the best chunk is read first. None: the path's calibrated default "
                                         "(cag.ape: the target's on the native path, the mapper card's on a "
                                         "translated one; 1 where none was calibrated).")
    copy_prior: float | None = Field(None, ge=0.0, le=1.0, description="Decoding on a cached path mixes "
                                     "the model's next token with what follows the answer's longest suffix in "
                                     "the placed chunks' text, with this weight (cag.copy_prior): a translated "
                                     "cache finds a fact and misspells it. 0 = the model alone. None: the weight "
                                     "the served path was measured with (its gate record; 0 where none). "
                                     "Direct context never uses it.")
    translated_focus_tokens: int | None = Field(None, ge=0, description="A plain translated path (no "
                                                "recompute) reads at most this many context tokens: the "
                                                "chunks whose best sentence the retriever finds most similar to "
                                                "the question, the best one always (cag.selection.focus). "
                                                "Translated keys lose lookups as the context grows (README, "
                                                "'Focus'). 0 = every chunk. None: the target's calibrated "
                                                "budget (cag/focus_tokens.json; every chunk where none).")
    pointer_sentences: int | None = Field(None, ge=0, description="On a plain translated path the first "
                                          "answer token's pointer (cag.copy_prior.pointer_starts) chooses only "
                                          "among the words of the k sentences the retriever finds closest to "
                                          "the question. 0 = anywhere. None: the target's calibrated k "
                                          "(cag/pointer_heads.json; 0 where none).")
    pointer_skips_question: bool | None = Field(None, description="On a plain translated path the first "
                                                "answer token's pointer gives no mass to the question's own words "
                                                "(an answer rarely starts with one; a translated cache's pointer "
                                                "often lands on the entity it was asked about). None: the target's "
                                                "calibrated choice (cag/pointer_heads.json; off where none).")
    max_new_tokens: int = Field(_DEFAULT_MAX_NEW_TOKENS, ge=1)
    chunk_order: Literal["score", "document"] = Field("score", description="Order of placed chunks.")
    max_context_tokens: int | None = Field(None, ge=1, description="Cap on placed context tokens "
                                           "(default: what the target's window leaves).")
    system_prompt: str | None = None
    dtype: Literal["auto", "bfloat16", "float32"] = Field("auto", description="Compute dtype of the target: "
                                                          "'auto' is bf16 where the CPU has native bf16, else fp32.")
    translation_cache_mb: float = Field(512.0, ge=0.0, description="LRU of translated chunks per target.")
    stored_translations: bool = Field(True, description="Read the translations a build stored for this "
                                      "mapper and target (`cag store translate`, `cag build --translate-for`) "
                                      "before translating a chunk at query time; a chunk without one, or with "
                                      "a damaged one, is translated as before.")
    min_retention: float = Field(DEFAULT_MIN_RETENTION, ge=0.0, le=1.0, description="Quality gate: the "
                                 "least share of direct context's found-rate (measured on calibration lookup "
                                 "items) a cached path must keep to be served; 0 serves any path (consent).")
    fallback: Literal["direct", "raise"] = Field("direct", description="When no cached path meets the gate: "
                                                 "'direct' prefills the retrieved text, 'raise' raises GateError.")
    embedder: Any = Field(None, exclude=True, description="Query embedder; default: the one the store "
                          "was built with (an id it records), or pass the same callable the build used.")

    _target_lm: Any = PrivateAttr(None)
    _mapper: Any = PrivateAttr(None)
    _assembler: Any = PrivateAttr(None)
    _chunks: Any = PrivateAttr(None)
    _location: Any = PrivateAttr(None)  # stores.location.open_store(store)
    _view: Any = PrivateAttr(None)  # (version, manifest, index)
    _lru: Any = PrivateAttr(None)
    _decision: Any = PrivateAttr(None)  # (source fingerprint id, GateDecision)
    _source_asm: Any = PrivateAttr(None)  # the store's source model's Assembler, for source-guided recompute
    _setup_lock: Any = PrivateAttr(default_factory=threading.RLock)
    _write_lock: Any = PrivateAttr(default_factory=threading.Lock)  # ensure_chunks: one miss prefilled once
    _last_answer: Answer | None = PrivateAttr(None)

    @property
    def last_answer(self) -> Answer | None:
        """The full `Answer` of the latest `stream` (or `answer`) call."""
        return self._last_answer

    # ------------------------------------------------------------ set-up

    @field_validator("store", mode="before")
    @classmethod
    def _path_or_url(cls, value: Any) -> Any:
        from stores.location import is_store_url

        # a URL stays a str: Path("redis://host/x") would fold its "//"
        return Path(value) if isinstance(value, (str, Path)) and not is_store_url(value) else value

    def _current_view(self):
        """The published (manifest, index), reopened when a build publishes a new version."""
        with self._setup_lock:
            if self._location is None:
                from stores.location import open_store

                self._location = open_store(self.store)
            number = self._location.current_version()
            if number is None:
                raise EmptyStoreError(f"no store at {self.store}: nothing published yet (run `cag build`)")
            if self._view is None or self._view[0] != number:
                manifest, index = self._location.open_current(self.embedder)
                self._view = (manifest.version, manifest, index)
            return self._view[1], self._view[2]

    def _ready_target(self):
        """The target model, its assembler and the chunk store (no mapper needed)."""
        with self._setup_lock:
            self._current_view()  # a store with nothing published fails here, clearly
            if self._target_lm is None:
                from cag.assembler import Assembler
                from cag.prompt import layout_for

                self._target_lm = registry.load(self.target, self.dtype)
                self._assembler = Assembler(self._target_lm, layout_for(self._target_lm.tokenizer,
                                                                        self.system_prompt))
                self._assembler.prefix()  # once per target, at set-up: not part of any query's TTFT
                self._chunks = self._location.chunks()
                self._lru = _TranslatedLRU(int(self.translation_cache_mb * 1e6))
            return self._target_lm, self._assembler

    def _ready(self):
        """Target, mapper and assembler; the mapper follows the store's source model."""
        with self._setup_lock:
            lm, asm = self._ready_target()
            manifest, _ = self._current_view()
            if self._mapper is None or self._mapper.source.id != manifest.source_fingerprint.id:
                from cag.mapping import resolve_mapper

                self._mapper = resolve_mapper(self.mapper, manifest.source_fingerprint, lm)
            return lm, self._mapper, asm

    @property
    def decision(self) -> GateDecision:
        """The gate's choice of serving path for this store's source and this target (see `cag.gate`)."""
        from cag.gate import candidates_for, choose_path, no_mapper
        from cag.mapping import MapperNotFoundError

        with self._setup_lock:
            lm, _ = self._ready_target()
            manifest, _ = self._current_view()
            source = manifest.source_fingerprint
            if self._decision is not None and self._decision[0] == source.id:
                return self._decision[1]
            try:
                mapper = self._ready()[1]
            except MapperNotFoundError as exc:
                if self.fallback == "raise":
                    raise
                decision = no_mapper(exc)
                self._decision = (source.id, decision)
                return decision
            candidates = candidates_for(mapper, lm.fingerprint.id, lm.name)
            if self.recompute_ratio > 0:
                # The caller chose a recompute: the gate judges the path as configured, and a
                # +repair record only speaks for the setting it was measured with.
                scale = 1.0 if mapper.method == "identity" else self.translated_key_scale
                candidates = [c for c in candidates if not c.path.endswith("+repair")
                              or c.repair_matches(self.recompute_ratio, self.recompute_select, scale)]
            decision = choose_path(candidates, self.min_retention, self.fallback)
            self._decision = (source.id, decision)
            return decision

    def _store_notes(self, lm) -> list[str]:
        """Warnings about the store itself: chunks made in a way the path was not measured on."""
        manifest, _ = self._current_view()
        notes = []
        prefix = manifest.chunker.get("prefill_prefix", "bos")
        if prefix != "head":
            notes.append(f"this store's chunks were prefilled after {prefix!r}, not the prompt head; "
                         "rebuild it into a new store to answer better (README, 'Shared head')")
        return notes

    @property
    def target_model(self):
        return self._ready_target()[0]

    @property
    def assembler(self):
        """The target's `Assembler` (shared prefix, prompt layout)."""
        return self._ready_target()[1]

    @property
    def active_mapper(self):
        """The mapper this context translates the store's chunks with."""
        return self._ready()[1]

    def ape_settings(self, native: bool | None = None) -> tuple[float, float]:
        """APE's (T, S) for this context's path: the fields where set, else the calibrated default (cag.ape).

        `native`: whether the placed chunks are the target's own (default: whether this
        context's mapper is the identity; the harness asks for the target's own chunks of
        a store another model built)."""
        from cag.ape import resolve

        if native is None:
            native = self._ready()[1].method == "identity"
        lm = self._ready_target()[0]
        return resolve(self.context_temperature, self.context_scale, fingerprint_id=lm.fingerprint.id,
                       native=native)

    def rank_decay(self, native: bool | None = None) -> float:
        """γ of `rank_key_decay` for this context's path: the field where set, else the calibrated default."""
        from cag.ape import resolve_rank_decay

        if self.rank_key_decay is not None:
            return self.rank_key_decay
        lm = self._ready_target()[0]
        # The mapper is resolved only when the path is translated or unknown: the harness asks for the
        # native default over another model's store, where this context's identity mapper cannot exist.
        mapper = None if native else self._ready()[1]
        if native is None:
            native = mapper.method == "identity"
        return resolve_rank_decay(None, fingerprint_id=lm.fingerprint.id, native=native,
                                  mapper_fidelity=None if native else getattr(mapper, "fidelity", None))

    def rank_key_scales(self, hits: list[Any], native: bool | None = None) -> list[float] | None:
        """Per-chunk key factors for placed `hits` (γ**rank by score), or None when γ = 1."""
        from cag.ape import rank_key_scales

        decay = self.rank_decay(native)
        return None if decay == 1.0 or not hits else rank_key_scales([h.score for h in hits], decay)

    @property
    def target_model_name(self) -> str:
        return self.target_model.name

    @property
    def context_window(self) -> int:
        return int(getattr(self.target_model.model.config, "max_position_embeddings", 4096))

    # --------------------------------------------------------------- retrieval

    def retrieve(self, question: str, top_k: int | None = None, *, doc_ids: list[str] | None = None) -> list[Any]:
        """The `top_k` best chunks for `question` (`stores.index.Hit`, best first); with `doc_ids`,
        only chunks of those documents."""
        _, index = self._current_view()
        return index.search(question, top_k or self.top_k, doc_ids=doc_ids)

    # ------------------------------------------------------------------ answers

    def answer(self, question: str, hits: list[Any] | None = None, *,
               max_new_tokens: int | None = None) -> Answer:
        """Answer from the cached chunks of `hits` (retrieved for `question` when None)."""
        for _ in self.stream(question, hits, max_new_tokens=max_new_tokens):
            pass
        return self._last_answer

    def prepare(self, question: str, hits: list[Any] | None = None, *,
                max_new_tokens: int | None = None, repair: dict | None = None,
                with_question: bool = False, copy_prior: float | None = None) -> "Prepared":
        """Everything before the question is read: retrieve, load, translate, place.

        Returns the placed cache and the question's ids; `stream` prefills the
        question against it and decodes. The evaluation harness uses this too, so
        every condition it measures goes through the same path as a query.
        `repair` (``{"ratio", "select"}``, optionally ``"translated_key_scale"``) overrides the
        recompute settings and the key scale: the gate's ``+repair`` paths pass what they were
        measured with.
        `with_question`: read the question in the recompute's forward where that is the same
        computation (a recompute runs and the question's attention is the model's own, no APE);
        `Prepared.first_logits` then holds its last token's logits. `stream` and the harness ask for it.
        `copy_prior`: the copy prior's weight (None: the context's `copy_prior`, 0 if that is None too).
        """
        t0 = time.perf_counter()
        timings = Timings()
        notes: list[str] = []
        from cag.assembler import GUIDED_SELECT  # loaded with the target by _ready

        hits = self._retrieved(question, hits, timings, t0)
        lm, mapper, asm = self._ready()
        if not hits:
            notes.append("no chunks were retrieved for this question; answering without context")
        hits = self._order(hits)
        ratio, select, key_scale = self.recompute_ratio, self.recompute_select, self.translated_key_scale
        if repair is not None:  # the gate's +repair path: recompute and scale as it was measured
            ratio, select = float(repair["ratio"]), str(repair["select"])
            key_scale = float(repair.get("translated_key_scale", 1.0))
        if mapper.method != "identity" and ratio == 0 and len(hits) > 1:
            hits = self._focused(question, hits, lm, timings, notes)  # before translating: the rest is never read
        chunks, used = self._target_chunks(hits, timings, notes)
        question_ids = asm.question_ids(question)
        reserve = question_ids.numel() + (max_new_tokens or self.max_new_tokens)
        chunks, used = self._fit_window(chunks, used, reserve, notes)
        if mapper.method != "identity":
            # New chunks, never in place: the LRU keeps the mapper's plain translations.
            if ratio > 0:  # a +repair path serves the keys its artifact fitted on that path, if any
                chunks = [replace(c, keys=mapper.repair_keys(c.keys)) for c in chunks]
            if key_scale != 1.0:  # rotation is linear, so scaling commutes with it
                chunks = [replace(c, keys=c.keys * key_scale) for c in chunks]
        positions = None
        if select in GUIDED_SELECT and ratio > 0 and chunks:
            t = time.perf_counter()
            positions = self._guided_positions(question, chunks, used, asm, ratio=ratio, select=select)
            timings.choose = time.perf_counter() - t
        with asm.model_lock:
            placed = asm.place(chunks, recompute_ratio=ratio, recompute_select=select, question_ids=question_ids,
                               first_k=self.recompute_first_k, positions=positions,
                               key_scales=self.rank_key_scales(used),
                               # APE's temperature and scale apply to a question prefilled apart only
                               with_question=question_ids if with_question and self.ape_settings() == (1.0, 1.0)
                               else None)
        timings.assemble, timings.recompute = placed.assemble_s, placed.recompute_s
        for note in notes:
            warnings.warn(note, stacklevel=3)
        path = "native" if mapper.method == "identity" else "translated"
        answer = Answer("", used, timings, context_tokens=placed.context_ids.numel() - placed.prefix_tokens,
                        recomputed_tokens=placed.recomputed_tokens, warnings=notes, mapper=mapper.method,
                        path=path + ("+repair" if placed.recomputed_tokens else ""))
        weight = copy_prior if copy_prior is not None else (self.copy_prior or 0.0)
        copy_prior = None
        if weight > 0:
            from cag.copy_prior import TextCopyPrior, pointer_head, pointer_rules, pointer_starts, question_words
            from cag.generate import stop_token_ids

            texts, first, first_weight, sentences = [h.text for h in used], None, None, None
            pointer, rules = pointer_head(lm.fingerprint.id), pointer_rules(lm.fingerprint.id)
            # The pointer head and its rules were chosen on the plain translated path: not on the target's own
            # chunks (they start right) nor where a recompute changed what the question reads.
            t = time.perf_counter()
            plain = path == "translated" and not placed.recomputed_tokens and bool(chunks)
            if pointer is not None and plain:
                layer, head, first_weight = pointer
                k = self.pointer_sentences if self.pointer_sentences is not None else rules.sentences
                skip = self.pointer_skips_question if self.pointer_skips_question is not None else rules.skip_question
                sentences = self._best_sentences(question, used, k, rules.wrapped) if k else None  # no forward
                with asm.model_lock:
                    first = pointer_starts(asm, chunks, texts, question_ids, layer, head, chat=asm.layout.chat,
                                           sentences=sentences, skip=question_words(question) if skip else frozenset())
            copy_prior = TextCopyPrior(texts, lm.tokenizer, weight, stop_ids=sorted(stop_token_ids(lm.tokenizer)),
                                       first=first, first_weight=first_weight, chat=asm.layout.chat,
                                       code_start=plain and rules.code_start, anchor_pointer=plain and rules.anchor,
                                       end_stops=plain and rules.end_stops,
                                       sentence_stops=sentences if rules.sentence_stops else None)
            if first is not None:  # the head's read and its starts' spelling: before the first token, so TTFT
                timings.point = time.perf_counter() - t
        return Prepared(placed.cache, question_ids, answer, t0, (placed.prefix_tokens, placed.context_ids.numel()),
                        placed.question_logits, copy_prior)

    def stream(self, question: str, hits: list[Any] | None = None, *,
               max_new_tokens: int | None = None) -> Generator[str, None, Answer]:
        """Yield the answer's text as it is generated; `last_answer` has sources and timings.

        The target model is held (a lock) while the generator runs: consume it to
        the end, or close it, before the next query in another thread can start.
        """
        from cag.generate import stream_tokens, stop_token_ids
        from cag.models.attention import context_temperature

        decision = self.decision
        if decision.path == "direct":
            answer = yield from self._stream_direct(question, hits, max_new_tokens, decision)
            return answer
        lm, _, asm = self._ready()
        max_new = max_new_tokens or self.max_new_tokens
        with asm.model_lock:
            # With a recompute the question is read in its forward (one pass over the weights, not two).
            prepared = self.prepare(question, hits, max_new_tokens=max_new, repair=served_repair(decision),
                                    with_question=True, copy_prior=self._copy_prior(decision))
            answer, t0 = prepared.answer, prepared.started
            self._gate_answer(answer, decision, lm)
            self._last_answer = answer
            temperature, scale = self.ape_settings()

            def ape():
                return context_temperature(lm.model, *prepared.context_span, temperature=temperature, scale=scale)
            steps = _within(ape, stream_tokens(lm.model, lm.tokenizer, prepared.cache, prepared.question_ids,
                                               max_new_tokens=max_new, stop_ids=stop_token_ids(lm.tokenizer),
                                               first_logits=prepared.first_logits,
                                               copy_prior=prepared.copy_prior))
            yield from _timed(steps, answer, t0)
        return answer  # the generator's value: this stream's own Answer, whatever other threads did

    def focus_budget(self) -> int:
        """The plain translated path's context budget in target tokens: the field where set, else the target's
        calibrated one (0: every chunk)."""
        from cag.selection import focus_tokens

        if self.translated_focus_tokens is not None:
            return self.translated_focus_tokens
        return focus_tokens(self._ready_target()[0].fingerprint.id)

    def _focused(self, question: str, hits: list[Any], lm, timings: Timings, notes: list[str]) -> list[Any]:
        """The hits a plain translated path reads: `cag.selection.focus` within `focus_budget`, in their order."""
        from cag import selection

        budget = self.focus_budget()
        if budget == 0:
            return hits
        t = time.perf_counter()
        sizes = [lm.tokenize(h.text)[0].numel() for h in hits]
        if sum(sizes) <= budget:  # it fits: no sentence vectors read
            timings.choose += time.perf_counter() - t
            return hits
        _, index = self._current_view()
        keep = selection.focus(index.embed, [h.text for h in hits], sizes, question, budget,
                               sentence_vectors=[index.sentence_vectors(h.key) for h in hits])
        timings.choose += time.perf_counter() - t
        if len(keep) < len(hits):
            notes.append(f"translated path: read {len(keep)} of {len(hits)} chunks ({sum(sizes[i] for i in keep)} "
                         f"of {sum(sizes)} tokens), those whose sentences are closest to the question: translated "
                         f"caches lose lookups over longer context (translated_focus_tokens={budget}; 0 reads all)")
        return [hits[i] for i in keep]

    def _best_sentences(self, question: str, used: list[Any], k: int,
                        wrapped: bool = False) -> list[list[tuple[int, int]]]:
        """Per used chunk, the spans of the `k` sentences the retriever finds closest to the question (the index's
        sentence vectors: no model forward); `wrapped`: each read whole across line wraps."""
        from cag import selection

        _, index = self._current_view()
        texts = [h.text for h in used]
        scores = selection.retriever_sentence_scores(index.embed, texts, question,
                                                     [index.sentence_vectors(h.key) for h in used])
        return selection.best_sentences(texts, scores, k, wrapped=wrapped)

    def _copy_prior(self, decision: GateDecision) -> float:
        """The copy prior's weight to decode with: the caller's, else the one the served path was measured with."""
        return self.copy_prior if self.copy_prior is not None else served_copy_prior(decision)

    def _gate_answer(self, answer: Answer, decision: GateDecision, lm) -> None:
        """Label a prepared answer with the gate's path (prepare it with `served_repair(decision)`)."""
        answer.path, answer.gate = decision.path, decision.to_dict()
        notes = self._store_notes(lm)
        if decision.path != "direct" and self._copy_prior(decision) != decision.fidelity.copy_prior:
            notes.append(f"copy prior {self._copy_prior(decision):g}: the gate measured the {decision.path} path "
                         f"with {decision.fidelity.copy_prior:g}, so its record does not speak for this setting")
        if self.min_retention <= 0.0 and decision.path != "direct":
            fid = decision.fidelity
            notes.append(f"quality gate off: serving the {decision.path} path, which measured "
                         + (f"found-rate retention {fid.found_retention:.2f} (n={fid.n})" if fid.measured
                            else "no lookup fidelity") + " on calibration items")
        for note in notes:
            warnings.warn(note, stacklevel=4)
        answer.warnings.extend(notes)

    def _stream_direct(self, question, hits, max_new_tokens, decision: GateDecision):
        """The gate's fallback: the target prefills the retrieved text, streamed as it decodes."""
        from cag.generate import stream_tokens, stop_token_ids

        warnings.warn(decision.reason, stacklevel=4)
        t0 = time.perf_counter()
        timings = Timings()
        hits = self._retrieved(question, hits, timings, t0)
        lm, asm = self._ready_target()
        hits = self._order(hits)
        context_ids = [lm.tokenize(h.text)[0] for h in hits]
        answer = Answer("", hits, timings, context_tokens=sum(c.numel() for c in context_ids),
                        warnings=[decision.reason], condition="direct", path="direct", gate=decision.to_dict())
        self._last_answer = answer
        with asm.model_lock:
            started = time.perf_counter()
            cache = asm.direct_cache(context_ids)  # the text's K/V first, then the question reads them
            answer.timings.assemble = time.perf_counter() - started
            steps = stream_tokens(lm.model, lm.tokenizer, cache, asm.question_ids(question),
                                  max_new_tokens=max_new_tokens or self.max_new_tokens,
                                  stop_ids=stop_token_ids(lm.tokenizer))
            yield from _timed(steps, answer, t0)
        return answer

    def _source_assembler(self):
        """The store's source model and its Assembler (loaded once; the target itself when native)."""
        from cag.assembler import Assembler
        from cag.models.prompt import layout_for

        with self._setup_lock:
            manifest, _ = self._current_view()
            fp = manifest.source_fingerprint
            if self._source_asm is None or self._source_asm.target.fingerprint.id != fp.id:
                lm = self._target_lm if fp.id == self._target_lm.fingerprint.id else registry.load(
                    fp.name, self.dtype)
                if lm.fingerprint.id != fp.id:
                    raise ValueError(f"source-guided recompute needs the store's source model {fp.describe()}; "
                                     f"loading {fp.name!r} gave {lm.fingerprint.describe()}")
                self._source_asm = Assembler(lm, layout_for(lm.tokenizer))
            return self._source_asm

    def _guided_positions(self, question: str, chunks: list[KVChunk], used: list[Any], asm, *,
                          ratio: float | None = None, select: str | None = None):
        """Context positions to recompute, chosen by the source model or the retriever (cag.selection)."""
        from cag import selection

        spans = self._guided_spans(question, chunks, used, ratio=ratio, select=select)
        return selection.spans_to_positions(chunks, spans, asm.prefix_ids.numel())

    def _guided_spans(self, question: str, chunks: list[KVChunk], used: list[Any], *,
                      ratio: float | None = None, select: str | None = None) -> list[list[tuple[int, int]]]:
        """The character spans of each used chunk's text that `_guided_positions` recomputes."""
        from cag import selection

        ratio = self.recompute_ratio if ratio is None else ratio
        select = self.recompute_select if select is None else select
        budget = round(ratio * sum(c.num_tokens for c in chunks))
        texts = [h.text for h in used]
        if select == "retriever":
            _, index = self._current_view()
            spans = selection.retriever_spans(index.embed, chunks, texts, question, budget,
                                              sentence_vectors=[index.sentence_vectors(h.key) for h in used])
        elif select == "retriever_chunk":
            spans = selection.retriever_chunks([h.score for h in used], chunks, texts, budget)
        else:
            manifest, index = self._current_view()
            heads = selection.retrieval_heads(manifest.source_fingerprint.id)
            # The source forward stops after the deepest retrieval head: decode no layer past it.
            upto = max(layer for layer, _ in heads) + 1 if heads else None
            source_chunks = [KVChunk.from_bytes(self._chunks.get(h.key), expect_model=manifest.source_fingerprint,
                                                first_layers=upto) for h in used]
            if select == "source_retriever":
                spans = selection.source_retriever_spans(
                    self._source_assembler(), source_chunks, chunks, texts, question, budget, index.embed,
                    sentence_vectors=[index.sentence_vectors(h.key) for h in used], heads=heads)
            else:
                choose = selection.source_guided_chunks if select == "source_chunk" else selection.source_guided_spans
                spans = choose(self._source_assembler(), source_chunks, chunks, texts, question, budget, heads=heads)
        return spans

    def document_hits(self, doc_ids: list[str]) -> list[Any]:
        """Every chunk of the given documents, in document order (whole-document context)."""
        from stores.index import Hit

        _, index = self._current_view()
        wanted = set(doc_ids)
        rows = sorted((r for r in index.rows if r.doc_id in wanted),
                      key=lambda r: (doc_ids.index(r.doc_id), r.start))
        return [Hit(r.key, 1.0, r.doc_id, r.text, r.start, r.end) for r in rows]

    def ensure_chunks(self, texts: list[str]) -> ChunkLookup:
        """Find each text's chunk by content address; prefill and store the missing ones.

        For chunks another pipeline split (e.g. a LlamaIndex retriever's nodes): the
        key is `stores.base.chunk_key` over the store's source model, its chunker
        settings (``manifest.chunker``) and the text, the address a build gives the
        same text, so a text the build stored is found whoever split it. A miss is
        prefilled by the store's source model after the build's prefix and put into
        the chunk store (write-through), so the next query finds it. Misses are
        prefilled once even when threads race (one lock), and the model's forwards
        take its model lock. Under the gate's direct fallback nothing is prefilled:
        that target reads the text itself, and a source model would load for nothing.
        Raises `ChunkWriteError` when the store's chunks cannot be reproduced here.
        Write-through chunks are in no manifest: a later build's gc removes them.
        """
        from stores.base import chunk_key

        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("ensure_chunks takes a list of texts (str)")
        manifest, _ = self._current_view()
        self._ready_target()  # the chunk store
        fp, settings = manifest.source_fingerprint, dict(manifest.chunker)
        keys: list[str | None] = [chunk_key(fp, settings, t) for t in texts]
        lookup = ChunkLookup(keys)
        if not texts:
            return lookup
        direct = self.decision.path == "direct"
        with self._write_lock:
            stored = {k: self._chunks.contains(k) for k in set(keys)}
            lookup.found = sum(stored[k] for k in keys)
            todo = list(dict.fromkeys(t for t, k in zip(texts, keys) if not stored[k]))  # each once
            if not todo:
                return lookup
            if direct:
                lookup.notes.append(f"{len(todo)} chunk(s) not in the store were not prefilled: "
                                    "the gate serves direct context for this target")
                return lookup
            t0 = time.perf_counter()
            lm, lock = self._write_source(manifest)
            empty = {t for t in todo if lm.tokenize(t)[0].numel() == 0}
            todo = [t for t in todo if t not in empty]
            with lock:
                for i in range(0, len(todo), 4):  # batches as the build's default
                    batch = todo[i:i + 4]
                    for text, chunk in zip(batch, lm.prefill_batch(batch, settings=settings)):
                        self._chunks.put(chunk_key(fp, settings, text), chunk.to_bytes(settings["dtype"]))
            lookup.prefilled = len(todo)
            lookup.prefill_s = time.perf_counter() - t0
        if empty:
            lookup.keys = [None if t in empty else k for t, k in zip(texts, keys)]
            lookup.notes.append(f"{sum(t in empty for t in texts)} text(s) have no tokens and no chunk")
        return lookup

    def _write_source(self, manifest):
        """The store's source model, prefilling after the build's prefix, and the lock its forwards take."""
        lm, asm = self._ready_target()
        fp, prefix = manifest.source_fingerprint, manifest.chunker.get("prefill_prefix", "bos")
        if prefix not in ("head", "bos"):
            raise ChunkWriteError(f"this store's chunks were prefilled after a {prefix!r} prefix, "
                                  "which cannot be reproduced for new chunks")
        if "dtype" not in manifest.chunker:
            raise ChunkWriteError("this store's manifest does not say which dtype its chunks are stored in")
        if fp.id != lm.fingerprint.id:
            try:
                asm = self._source_assembler()
            except (ValueError, OSError, registry.ModelError) as exc:
                raise ChunkWriteError(f"cannot load the store's source model {fp.describe()} to prefill "
                                      f"new chunks: {exc}") from exc
            lm = asm.target
        if lm.prefill_prefix != prefix:
            lm = lm.with_prefill_prefix(prefix)
        want = manifest.chunker.get("sink_ids")
        if want is not None and list(want) != list(lm.sink_ids):
            raise ChunkWriteError(f"this store's chunks were prefilled after tokens {want}; "
                                  f"{lm.name} gives {list(lm.sink_ids)} for {prefix!r}")
        return lm, asm.model_lock

    def _order(self, hits: list[Any]) -> list[Any]:
        if self.chunk_order == "document":
            return sorted(hits, key=lambda h: (h.doc_id, h.start))
        return sorted(hits, key=lambda h: -h.score)

    def _target_chunks(self, hits, timings: Timings, notes: list[str]) -> tuple[list[KVChunk], list[Any]]:
        """Load and translate the hits' chunks (LRU, then stored translations); corrupt ones are skipped and named."""
        from stores.errors import StoreIntegrityError

        from stores.translations import read_translation

        lm, mapper, _ = self._ready()
        manifest, _ = self._current_view()
        cache_id = f"{mapper.method}:{getattr(mapper, 'artifact_id', '')}:{lm.fingerprint.id}"
        stored = self.stored_translations and mapper.method != "identity"
        out: dict[int, KVChunk] = {}
        to_translate: list[tuple[int, KVChunk]] = []
        t = time.perf_counter()
        for i, hit in enumerate(hits):
            cached = self._lru.get(f"{cache_id}:{hit.key}")
            if cached is not None:
                out[i] = cached
                continue
            if stored:  # translated at build time: loaded like a native chunk
                try:
                    chunk = read_translation(self._chunks, hit.key, hit.text, mapper.artifact_id, lm.fingerprint,
                                             decode_dtype=lm.dtype)
                except (ChunkError, StoreIntegrityError) as exc:
                    notes.append(f"stored translation of chunk {hit.key[:12]}… of {hit.doc_id!r} refused "
                                 f"({exc}); translating its source chunk instead")
                    chunk = None
                if chunk is not None:
                    out[i] = chunk
                    self._lru.put(f"{cache_id}:{hit.key}", chunk)
                    continue
            try:
                data = self._chunks.get(hit.key)
                if data is None:
                    raise ChunkError("missing from the chunk store")
                # 8-bit chunks decode straight into the dtype the target (and any mapper) computes in
                chunk = KVChunk.from_bytes(data, expect_model=manifest.source_fingerprint, decode_dtype=lm.dtype)
            except (ChunkError, StoreIntegrityError) as exc:
                notes.append(f"skipped chunk {hit.key[:12]}… of {hit.doc_id!r}: {exc}")
                continue
            to_translate.append((i, chunk))
        timings.load = time.perf_counter() - t
        t = time.perf_counter()
        if to_translate:
            translated = mapper.translate_batch([c for _, c in to_translate],
                                                [hits[i].text for i, _ in to_translate], lm)
            for (i, _), chunk in zip(to_translate, translated):
                out[i] = chunk
                self._lru.put(f"{cache_id}:{hits[i].key}", chunk)
        timings.translate = time.perf_counter() - t
        order = sorted(out)
        return [out[i] for i in order], [hits[i] for i in order]

    def _fit_window(self, chunks: list[KVChunk], used: list[Any], reserve: int,
                    notes: list[str]) -> tuple[list[KVChunk], list[Any]]:
        """Drop the lowest-scoring chunks until the context fits the target's window."""
        asm = self._assembler
        budget = self.context_window - asm.prefix_ids.numel() - reserve
        if self.max_context_tokens is not None:
            budget = min(budget, self.max_context_tokens)
        total = sum(c.num_tokens for c in chunks)
        if total <= budget:
            return chunks, used
        keep = set(range(len(chunks)))
        for i in sorted(keep, key=lambda i: used[i].score):
            if total <= budget:
                break
            keep.discard(i)
            total -= chunks[i].num_tokens
        dropped = len(chunks) - len(keep)
        notes.append(f"context of {sum(c.num_tokens for c in chunks)} tokens exceeds the budget of "
                     f"{budget}; dropped the {dropped} lowest-scoring chunk(s)")
        idx = sorted(keep)
        return [chunks[i] for i in idx], [used[i] for i in idx]

    # ------------------------------------------------------- reference answers

    def answer_direct(self, question: str, hits: list[Any] | None = None, *,
                      max_new_tokens: int | None = None) -> Answer:
        """The comparison: the target prefills the retrieved text itself (direct context)."""
        return self._answer_from_text(question, hits, max_new_tokens, with_context=True)

    def answer_without_context(self, question: str, *, max_new_tokens: int | None = None) -> Answer:
        return self._answer_from_text(question, [], max_new_tokens, with_context=False)

    def _retrieved(self, question: str, hits, timings: Timings, t0: float) -> list[Any]:
        """`hits` as given, or retrieved now for `question` (timed into `timings.retrieve`)."""
        if hits is None:
            hits = self.retrieve(question)
            timings.retrieve = time.perf_counter() - t0
        return hits

    def _answer_from_text(self, question, hits, max_new_tokens, *, with_context: bool) -> Answer:
        import torch

        from cag.generate import generate, stop_token_ids

        t0 = time.perf_counter()
        timings = Timings()
        hits = self._retrieved(question, hits, timings, t0)
        lm, asm = self._ready_target()
        hits = self._order(hits) if with_context else []
        context_ids = [lm.tokenize(h.text)[0] for h in hits]
        with asm.model_lock, torch.inference_mode():
            started = time.perf_counter()
            cache = asm.direct_cache(context_ids)  # the text's K/V first, then the question reads them
            context_s = time.perf_counter() - started
            gen = generate(lm.model, lm.tokenizer, cache, asm.question_ids(question),
                           max_new_tokens=max_new_tokens or self.max_new_tokens, stop_ids=stop_token_ids(lm.tokenizer))
        end = time.perf_counter()
        timings.assemble = context_s  # the prefill of the text: direct context's set-up
        timings.question_prefill = gen.question_prefill_s
        timings.first_token = timings.retrieve + context_s + gen.question_prefill_s
        timings.decode, timings.total = gen.decode_s, end - t0
        return Answer(gen.text, hits, timings, context_tokens=sum(c.numel() for c in context_ids),
                      condition="direct" if with_context else "no_context", mapper="",
                      path="direct" if with_context else "no_context")

    # ------------------------------------------------------------- plain LLM

    def complete_text(self, prompt: str, *, max_new_tokens: int | None = None) -> str:
        """The target as a plain local LLM: no retrieval, no cache (LlamaIndex's LLM path)."""
        return "".join(self.stream_text(prompt, max_new_tokens=max_new_tokens))

    def stream_text(self, prompt: str, *, max_new_tokens: int | None = None) -> Iterator[str]:
        from transformers import DynamicCache

        from cag.generate import stream_tokens, stop_token_ids

        lm, asm = self._ready_target()
        tok = lm.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = (tok.bos_token or "") + prompt
        ids, _ = lm.tokenize(text)
        with asm.model_lock:
            for step in stream_tokens(lm.model, tok, DynamicCache(config=lm.model.config), ids,
                                      max_new_tokens=max_new_tokens or self.max_new_tokens,
                                      stop_ids=stop_token_ids(tok)):
                yield step.text

    # ------------------------------------------------------------ integrations

    def as_retriever(self, **kwargs):
        from cag.llama_index import make_retriever

        return make_retriever(self, **kwargs)

    def as_llm(self, **kwargs):
        from cag.llama_index import make_llm

        return make_llm(self, **kwargs)

    def as_query_engine(self, **kwargs):
        from cag.llama_index import make_query_engine

        return make_query_engine(self, **kwargs)

    @classmethod
    def from_documents(cls, documents, store: str | Path, **kwargs) -> "CachedContext":
        """Build (or update) a store from LlamaIndex `Document`s, then open it.

        See `cag.llama_index.documents_to_context` for the keywords (source model,
        chunk size, embedder); the rest are `CachedContext` settings.
        """
        from cag.llama_index import documents_to_context

        return documents_to_context(documents, store, **kwargs)

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.close()
            self._chunks = None
        if self._location is not None:
            self._location.close()
            self._location = None
