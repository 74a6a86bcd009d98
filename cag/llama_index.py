"""LlamaIndex integration: `CachedContext` as a retriever, an LLM, a response
synthesizer and a query engine.

The point of `cag` is that the answering model never prefills the retrieved
text: it attends to stored, pre-computed KV caches of the chunks. LlamaIndex's
stock pipeline works against that at one place. `BaseSynthesizer.synthesize`
flattens the retrieved nodes to strings before it calls `get_response`, so by the
time an LLM sees them the chunk keys — the only thing that names a cache — are
gone, and the text would be prefilled again. The classes here keep the keys:

* `CachedContextRetriever` turns `Hit`s into `NodeWithScore`s whose metadata
  carries the chunk key, document id and span (the key and span hidden from LLM
  and embedding text, so prompts and re-embedding look as usual);
* `CachedContextSynthesizer` overrides `synthesize` itself, maps the nodes back to
  `Hit`s and answers from the caches, emitting the same callback events and
  instrumentation events as the base class, so tracing keeps working;
* `CachedContextLLM` is a `CustomLLM` over the context's target model: given
  ``nodes=`` it answers the prompt from their caches, otherwise it is a plain
  local LLM (chat goes through `CustomLLM.chat` → `complete`).

Bring your own retriever: nodes from any other retriever (no chunk key), and
nodes whose text a postprocessor changed, are found by content address instead
(`CachedContext.ensure_chunks`: the key a build gives the same text). A miss is
prefilled by the store's source model once and stored (write-through), so the next
query hits; ``metadata["cache"]`` reports the query's hit rate. An existing
LlamaIndex pipeline gains caching without rebuilding its index::

    engine = RetrieverQueryEngine(retriever=index.as_retriever(),
                                  response_synthesizer=make_synthesizer(ctx))
    # or: ctx.as_query_engine(retriever=index.as_retriever())

What cannot be answered from caches faithfully (``write_through=False``, or a store
whose chunks cannot be reproduced here: `ChunkWriteError`) takes the ordinary text
path (the text is prefilled) with a warning in the metadata, never a silent answer
from caches that do not match the text.

Only `llama_index.core` is imported at module import time; the runtime
(`cag.context`, `stores`, the model registry, torch) is imported where it is used.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import os
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import (
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.indices.prompt_helper import ChatPromptHelper, PromptHelper
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine.retriever_query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import (
    BaseNode,
    MetadataMode,
    NodeRelationship,
    NodeWithScore,
    QueryBundle,
    RelatedNodeInfo,
    TextNode,
)
from llama_index.core.types import RESPONSE_TEXT_TYPE

if TYPE_CHECKING:  # the runtime stays out of `import cag.llama_index`
    from llama_index.core.schema import Document

    from cag.context import Answer, CachedContext
    from stores.index import Hit

__all__ = [
    "CHUNK_KEY", "DOC_ID", "START", "END", "TEXT_HASH", "HIDDEN_METADATA_KEYS",
    "CachedContextRetriever", "CachedContextLLM", "CachedContextSynthesizer",
    "NodeCaches", "hit_to_node", "node_id_for", "nodes_to_hits", "resolve_nodes",
    "make_retriever", "make_llm", "make_synthesizer", "make_query_engine", "documents_to_context",
]

dispatcher = get_dispatcher(__name__)

# Node metadata written by the retriever and read back by the synthesizer and the LLM.
CHUNK_KEY = "chunk_key"
DOC_ID = "doc_id"
START = "start"
END = "end"
TEXT_HASH = "chunk_text_sha256"
# Bookkeeping, not content: kept out of the text an LLM or an embedder sees. The
# document id stays visible, as LlamaIndex readers' file names usually do.
HIDDEN_METADATA_KEYS: tuple[str, ...] = (CHUNK_KEY, START, END, TEXT_HASH)

# Fixed namespace for node ids (uuid5 of doc id, span and chunk key), so a chunk
# occurrence gets the same node id in every process and every run.
_NODE_NAMESPACE = uuid.UUID("6f0c9a8e-3c1e-5b7a-9d43-2a6c7e1b5f10")

_T = TypeVar("_T")


# ------------------------------------------------------------------ hits and nodes


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def node_id_for(hit: Hit) -> str:
    """A stable node id for one chunk occurrence.

    The chunk key alone is a content address: the same text in two documents (or
    twice in one) has one key. Node ids must differ there, because
    `BaseRetriever.retrieve` drops nodes with a repeated id, which would silently
    return fewer hits than the store did. So the id hashes document id, span and
    key. It is a UUID because some vector stores LlamaIndex writes to accept no
    other id format.
    """
    return str(uuid.uuid5(_NODE_NAMESPACE, f"{hit.doc_id}\x00{hit.start}\x00{hit.end}\x00{hit.key}"))


def hit_to_node(hit: Hit) -> NodeWithScore:
    """One search hit as a LlamaIndex node that still names its KV cache."""
    node = TextNode(
        id_=node_id_for(hit),
        text=hit.text,
        metadata={CHUNK_KEY: hit.key, DOC_ID: hit.doc_id, START: hit.start, END: hit.end,
                  TEXT_HASH: _text_hash(hit.text)},
        excluded_llm_metadata_keys=list(HIDDEN_METADATA_KEYS),
        excluded_embed_metadata_keys=list(HIDDEN_METADATA_KEYS),
        start_char_idx=hit.start,
        end_char_idx=hit.end,
        # ref_doc_id: what LlamaIndex uses for source attribution and evaluation
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=hit.doc_id)},
    )
    return NodeWithScore(node=node, score=hit.score)


def nodes_to_hits(nodes: Sequence[NodeWithScore | BaseNode]) -> tuple[list[Hit] | None, str | None]:
    """Map nodes back to `Hit`s, or say why they cannot be answered from the caches.

    Returns ``(hits, None)`` when every node names a chunk and still carries that
    chunk's text; otherwise ``(None, warning)``. It is all or nothing: answering
    from the cacheable part alone would silently drop context the caller passed.
    A node whose text differs from what the retriever returned (a postprocessor
    rewrote or trimmed it) is not cacheable: its KV cache encodes the old text.
    """
    hits: list[Hit] = []
    missing = edited = 0
    for item in nodes:
        hit, why = _keyed_hit(item)
        if hit is not None:
            hits.append(hit)
        elif why == "missing":
            missing += 1
        else:
            edited += 1
    if not missing and not edited:
        return hits, None
    reasons = []
    if missing:
        reasons.append(f"{missing} of {len(nodes)} nodes have no '{CHUNK_KEY}' metadata "
                       "(not from a CachedContextRetriever)")
    if edited:
        reasons.append(f"{edited} of {len(nodes)} nodes' text differs from their cached chunk "
                       "(changed after retrieval, e.g. by a node postprocessor)")
    return None, ("answered from the prefilled node text, not from KV caches: "
                  + "; ".join(reasons))


def _unpack(item: NodeWithScore | BaseNode) -> tuple[BaseNode, float | None]:
    return (item.node, item.score) if isinstance(item, NodeWithScore) else (item, None)


def _keyed_hit(item: NodeWithScore | BaseNode) -> tuple[Hit | None, str]:
    """The `Hit` a node from `CachedContextRetriever` names, or why it names none
    ("missing": no chunk key; "edited": its text is no longer its chunk's)."""
    from stores.index import Hit  # faiss/numpy: only when nodes are really mapped

    node, score = _unpack(item)
    meta = node.metadata or {}
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    if not meta.get(CHUNK_KEY) or meta.get(DOC_ID) is None:
        return None, "missing"
    if meta.get(TEXT_HASH) is not None and meta[TEXT_HASH] != _text_hash(text):
        return None, "edited"
    return Hit(key=str(meta[CHUNK_KEY]), score=float(score if score is not None else 0.0),
               doc_id=str(meta[DOC_ID]), text=text,
               start=int(meta.get(START, node.start_char_idx or 0)),
               end=int(meta.get(END, node.end_char_idx or len(text)))), ""


def _cache_stats(nodes: int, hits: int, prefilled: int, prefill_s: float = 0.0) -> dict[str, Any]:
    """``metadata["cache"]``: of the query's nodes, how many chunk caches were in the store
    (hits) and how many were prefilled now (write-through misses)."""
    return {"nodes": nodes, "hits": hits, "prefilled": prefilled,
            "hit_rate": hits / nodes if nodes else 0.0, "prefill_s": prefill_s}


@dataclass
class NodeCaches:
    """The nodes of one query mapped to cached chunks (`resolve_nodes`)."""

    hits: list[Hit] | None  # None: answer from the text (see `warning`)
    warning: str | None  # why the text path, when it is taken
    cache: dict[str, Any]  # `_cache_stats`
    notes: list[str] = field(default_factory=list)  # for the answer's warnings
    node_ids: dict[Any, str] = field(default_factory=dict)  # Hit -> the node id it came from


def resolve_nodes(ctx: CachedContext, nodes: Sequence[NodeWithScore | BaseNode], *,
                  write_through: bool = True) -> NodeCaches:
    """Map any retriever's nodes to `Hit`s over the store's chunk caches.

    Nodes from `CachedContextRetriever` name their chunk (a hit: that index lists only
    stored chunks) and are used as they are, with no store look-up. Every other node,
    and one whose text was changed after retrieval, is found by content address with
    `CachedContext.ensure_chunks`; a miss is prefilled once and stored (write-through),
    so the next query on that node hits. Its `Hit` carries the node's text, its
    ``ref_doc_id`` (or node id) as document and its character span.

    With ``write_through=False`` such nodes are not looked up and the whole query
    takes the text path (all or nothing: answering from the keyed part alone would
    silently drop context), as it does when the store's chunks cannot be reproduced
    here (`ChunkWriteError`).
    """
    from stores.index import Hit

    n = len(nodes)
    keyed = [_keyed_hit(item)[0] for item in nodes]
    if all(h is not None for h in keyed):
        return NodeCaches(keyed, None, _cache_stats(n, n, 0),  # type: ignore[arg-type]
                          node_ids={h: _unpack(item)[0].node_id for h, item in zip(keyed, nodes)})
    _, warning = nodes_to_hits(nodes)
    if not write_through:
        return NodeCaches(None, warning, _cache_stats(n, 0, 0))

    from cag.context import ChunkWriteError

    foreign = [i for i, h in enumerate(keyed) if h is None]
    texts = [_unpack(nodes[i])[0].get_content(metadata_mode=MetadataMode.NONE) for i in foreign]
    try:
        lookup = ctx.ensure_chunks(texts)
    except ChunkWriteError as exc:
        return NodeCaches(None, f"answered from the prefilled node text, not from KV caches: {exc}",
                          _cache_stats(n, 0, 0))
    hits: list[Hit] = []
    node_ids: dict[Any, str] = {}
    by_index = dict(zip(foreign, zip(lookup.keys, texts)))
    for i, item in enumerate(nodes):
        node, score = _unpack(item)
        hit = keyed[i]
        if hit is None:
            key, text = by_index[i]
            if key is None:  # no tokens, no chunk (named in lookup.notes)
                continue
            start = node.start_char_idx or 0
            end = node.end_char_idx if node.end_char_idx is not None else start + len(text)
            hit = Hit(key=key, score=float(score if score is not None else 0.0),
                      doc_id=str(node.ref_doc_id or node.node_id), text=text, start=start, end=end)
        hits.append(hit)
        node_ids.setdefault(hit, node.node_id)
    cache = _cache_stats(n, n - len(foreign) + lookup.found, lookup.prefilled, lookup.prefill_s)
    return NodeCaches(hits, None, cache, list(lookup.notes), node_ids)


def _answer_metadata(answer: Answer, resolved: NodeCaches | None = None) -> dict[str, Any]:
    """What a cached answer reports beside its text (response and completion metadata)."""
    ids = resolved.node_ids if resolved is not None else {}
    meta = {
        "mode": "cached",
        "timings": answer.timings.to_dict(),
        "context_tokens": answer.context_tokens,
        "warnings": list(answer.warnings) + (resolved.notes if resolved is not None else []),
        "mapper": answer.mapper,
        # the chunks the answer was given (the context may drop some: window, corrupt entries)
        "used_node_ids": [ids.get(hit) or node_id_for(hit) for hit in answer.sources],
    }
    if resolved is not None:
        meta["cache"] = dict(resolved.cache)
    return meta


def _text_metadata(warning: str | None, resolved: NodeCaches | None = None) -> dict[str, Any]:
    """The same keys for an answer that prefilled the text (no cache timings to report)."""
    meta = {"mode": "text", "timings": None, "context_tokens": None,
            "warnings": [warning] if warning else [], "mapper": None}
    if resolved is not None:
        meta["cache"] = dict(resolved.cache)
    return meta


def _context_str(nodes: Sequence[NodeWithScore | BaseNode]) -> list[str]:
    return [(n.node if isinstance(n, NodeWithScore) else n).get_content(metadata_mode=MetadataMode.LLM)
            for n in nodes]


# ---------------------------------------------------------------------- retriever


class CachedContextRetriever(BaseRetriever):
    """The context's vector search as a LlamaIndex retriever.

    `BaseRetriever.retrieve` wraps `_retrieve` in the RETRIEVE callback event and
    the retrieval instrumentation span and events, so only the search itself is here.
    """

    def __init__(self, ctx: CachedContext, top_k: int | None = None, *,
                 callback_manager: CallbackManager | None = None, verbose: bool = False) -> None:
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self._ctx = ctx
        self.top_k = top_k

    @property
    def ctx(self) -> CachedContext:
        return self._ctx

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self._ctx.retrieve(query_bundle.query_str, top_k=self.top_k)
        return [hit_to_node(hit) for hit in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        # Embedding + faiss search block; a worker thread keeps the event loop free.
        # `to_thread` copies the context, so spans and callback traces still nest.
        return await asyncio.to_thread(self._retrieve, query_bundle)


# ---------------------------------------------------------------------------- LLM


class CachedContextLLM(CustomLLM):
    """The context's target model as a LlamaIndex LLM.

    ``complete(question, nodes=[...])`` answers from the nodes' KV caches (the
    text is not prefilled); ``complete(prompt)`` is plain local generation. The
    completion callbacks (`llm_completion_callback`) give both the LLM callback
    event and the LLM instrumentation events; chat comes from `CustomLLM`
    (messages → prompt → `complete(formatted=True)`).
    """

    # Overrides; None asks the context when metadata is first needed. Not read at
    # construction: the context loads its target model to answer them, and building
    # a query engine should not load a model (the first query does).
    model_name: Optional[str] = Field(default=None, description="The target model's name; "
                                      "None: the context's target.")
    context_window: Optional[int] = Field(default=None, gt=0, description="The target's context "
                                          "window in tokens; None: the context's.")
    max_new_tokens: Optional[int] = Field(default=None, gt=0,
                                          description="Tokens to generate; None: the context's setting.")
    write_through: bool = Field(default=True, description="Nodes without a cag chunk key: find their "
                                "caches by content address, prefilling and storing misses (False: "
                                "prefill their text for this answer only).")

    _ctx: Any = PrivateAttr()

    def __init__(self, ctx: CachedContext, *, max_new_tokens: int | None = None,
                 model_name: str | None = None, context_window: int | None = None,
                 write_through: bool = True, **kwargs: Any) -> None:
        super().__init__(model_name=model_name, context_window=context_window,
                         max_new_tokens=max_new_tokens, write_through=write_through, **kwargs)
        self._ctx = ctx

    @classmethod
    def class_name(cls) -> str:
        return "CachedContextLLM"

    @property
    def ctx(self) -> CachedContext:
        return self._ctx

    @property
    def metadata(self) -> LLMMetadata:
        num_output = self.max_new_tokens or getattr(self._ctx, "max_new_tokens", None) or DEFAULT_NUM_OUTPUTS
        return LLMMetadata(context_window=self.context_window or self._ctx.context_window or DEFAULT_CONTEXT_WINDOW,
                           num_output=num_output, model_name=self.model_name or self._ctx.target_model_name,
                           is_chat_model=False)

    def _budget(self, kwargs: dict[str, Any]) -> int | None:
        return kwargs.get("max_new_tokens") or self.max_new_tokens

    def _plain_prompt(self, prompt: str, formatted: bool) -> str:
        if not formatted and self.completion_to_prompt is not None:
            return self.completion_to_prompt(prompt)
        return prompt

    def _resolve(self, kwargs: dict[str, Any]) -> NodeCaches | None:
        """The ``nodes`` mapped to caches, once: the synthesizer hands over what it resolved."""
        resolved = kwargs.get(_RESOLVED)
        if resolved is None and kwargs.get("nodes"):
            resolved = resolve_nodes(self._ctx, kwargs["nodes"], write_through=self.write_through)
        return resolved

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer `prompt`; from the caches of ``nodes`` when they are given."""
        budget = self._budget(kwargs)
        resolved = self._resolve(kwargs)
        if resolved is not None:
            if resolved.hits is not None:
                answer = self._ctx.answer(prompt, resolved.hits, max_new_tokens=budget)
                return CompletionResponse(text=answer.text, raw=answer,
                                          additional_kwargs=_answer_metadata(answer, resolved))
            prompt, formatted = _qa_prompt(DEFAULT_TEXT_QA_PROMPT, prompt, _context_str(kwargs["nodes"])), False
        text = self._ctx.complete_text(self._plain_prompt(prompt, formatted), max_new_tokens=budget)
        return CompletionResponse(text=text, additional_kwargs=_text_metadata(
            resolved.warning if resolved else None, resolved))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream the answer to `prompt`, piece by piece.

        The last response has an empty delta and carries what the non-streaming
        `complete` puts in `additional_kwargs` (timings, context tokens, warnings),
        which are only known once generation has finished.
        """
        budget = self._budget(kwargs)
        resolved = self._resolve(kwargs)
        if resolved is not None and resolved.hits is not None:
            return self._stream_cached(prompt, resolved, budget)
        if resolved is not None:
            prompt, formatted = _qa_prompt(DEFAULT_TEXT_QA_PROMPT, prompt, _context_str(kwargs["nodes"])), False
        pieces = self._ctx.stream_text(self._plain_prompt(prompt, formatted), max_new_tokens=budget)
        closing = _text_metadata(resolved.warning if resolved else None, resolved)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", additional_kwargs=closing)

        return gen()

    def _stream_cached(self, question: str, resolved: NodeCaches, budget: int | None) -> CompletionResponseGen:
        """Stream `ctx.stream` and close with the `Answer` of *this* stream.

        `ctx.last_answer` is shared by all threads using the context. This stream's
        answer is taken, in order of preference, from the generator's return value,
        or from `last_answer` as soon as it changes while the stream holds the
        model (the context sets it before the first piece, under its model lock),
        and only as a last resort from `last_answer` at the end.
        """
        ctx = self._ctx
        before = ctx.last_answer
        pieces = ctx.stream(question, resolved.hits, max_new_tokens=budget)

        def gen() -> CompletionResponseGen:
            text, mine = "", None
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as stop:
                    if stop.value is not None and hasattr(stop.value, "timings"):
                        mine = stop.value
                    break
                if mine is None and ctx.last_answer is not before:
                    mine = ctx.last_answer
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            answer = mine if mine is not None else ctx.last_answer
            yield CompletionResponse(text=answer.text, delta="", raw=answer,
                                     additional_kwargs=_answer_metadata(answer, resolved))

        return gen()


# The completion keyword the synthesizer passes its `NodeCaches` in, so that the nodes are
# looked up (and misses prefilled) once per query, not again inside the LLM.
_RESOLVED = "cag_node_caches"


def _qa_prompt(template: BasePromptTemplate, question: str, chunks: Sequence[str]) -> str:
    return template.format(context_str="\n\n".join(chunks), query_str=question)


# -------------------------------------------------------------------- synthesizer


class CachedContextSynthesizer(BaseSynthesizer):
    """Answers from the retrieved chunks' KV caches, keeping the chunk keys.

    `synthesize`/`asynthesize` are overridden (the base versions flatten nodes to
    text first); they emit what the base class emits: a dispatcher span, the
    synthesize start/end instrumentation events and the SYNTHESIZE callback event.
    The generation itself goes through `CachedContextLLM.complete`, so the LLM
    callback event and instrumentation events nest inside as they would for any
    synthesizer.

    Any retriever's nodes work (see `resolve_nodes`): a stock pipeline gains caching
    with ``RetrieverQueryEngine(retriever=its_retriever, response_synthesizer=this)``.

    Response metadata: ``mode`` ("cached" or "text"), ``timings`` (seconds, per
    stage), ``context_tokens``, ``warnings``, ``mapper``, ``used_node_ids`` (the
    nodes whose chunks the answer was given: the context may drop some, e.g. to
    fit the target's window, and says so in ``warnings``) and ``cache``: the
    query's ``nodes``, ``hits`` (chunk caches found in the store), ``prefilled``
    (misses prefilled and stored now), ``hit_rate`` (hits / nodes) and ``prefill_s``.
    When streaming, the metadata dict is filled in once the stream has been consumed.
    """

    def __init__(self, ctx: CachedContext, *, llm: CachedContextLLM | None = None,
                 callback_manager: CallbackManager | None = None, streaming: bool = False,
                 max_new_tokens: int | None = None, text_qa_template: BasePromptTemplate | None = None,
                 empty_response: str | None = None, write_through: bool = True) -> None:
        if llm is not None and not isinstance(llm, CachedContextLLM):
            # Another LLM would receive `nodes=` it does not understand, or ignore them.
            raise TypeError("CachedContextSynthesizer answers through a CachedContextLLM, "
                            f"not a {type(llm).__name__}")
        llm = llm or CachedContextLLM(ctx, max_new_tokens=max_new_tokens, write_through=write_through)
        # The base class sizes prompt helpers from `llm.metadata`, which would load the
        # target model now. This synthesizer never repacks text (the cached path has
        # no prompt to pack), so default helpers stand in for them.
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming,
                         empty_response=empty_response, prompt_helper=PromptHelper(),
                         chat_prompt_helper=ChatPromptHelper())
        self._ctx = ctx
        self._max_new_tokens = max_new_tokens
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT
        self._write_through = write_through

    @property
    def ctx(self) -> CachedContext:
        return self._ctx

    @property
    def streaming(self) -> bool:
        return self._streaming

    # -- PromptMixin: the text path's template is the one prompt there is

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    # -- the text path (BaseSynthesizer's abstract API)

    def _llm_kwargs(self, response_kwargs: dict[str, Any]) -> dict[str, Any]:
        budget = response_kwargs.get("max_new_tokens") or self._max_new_tokens
        return {"max_new_tokens": budget} if budget else {}

    def get_response(self, query_str: str, text_chunks: Sequence[str],
                     **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        """Answer from plain text chunks: the text is prefilled, no cache is used.

        Only reached when the nodes cannot be mapped to caches, or when someone
        calls it directly; the chunk keys are gone by the time text chunks exist.
        """
        prompt = _qa_prompt(self._text_qa_template, query_str, text_chunks)
        kwargs = self._llm_kwargs(response_kwargs)
        if self._streaming:
            return (r.delta or "" for r in self._llm.stream_complete(prompt, **kwargs) if r.delta)
        return self._llm.complete(prompt, **kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        if self._streaming:
            return _aiter_in_thread(self.get_response(query_str, text_chunks, **response_kwargs))
        return await asyncio.to_thread(self.get_response, query_str, text_chunks, **response_kwargs)

    # -- the cached path

    def _respond(self, query_str: str, nodes: list[NodeWithScore], source_nodes: list[NodeWithScore],
                 response_kwargs: dict[str, Any]) -> Response | StreamingResponse:
        resolved = resolve_nodes(self._ctx, nodes, write_through=self._write_through)
        if resolved.hits is None:
            response_str = self.get_response(query_str, _context_str(nodes), **response_kwargs)
            metadata = _text_metadata(resolved.warning, resolved)
            if isinstance(response_str, str):
                return Response(response_str, source_nodes=source_nodes, metadata=metadata)
            return StreamingResponse(response_str, source_nodes=source_nodes, metadata=metadata)

        kwargs = {**self._llm_kwargs(response_kwargs), _RESOLVED: resolved}
        if not self._streaming:
            completion = self._llm.complete(query_str, nodes=nodes, **kwargs)
            return Response(completion.text, source_nodes=source_nodes,
                            metadata=dict(completion.additional_kwargs))

        metadata: dict[str, Any] = {}
        stream = self._llm.stream_complete(query_str, nodes=nodes, **kwargs)

        def pieces() -> Generator[str, None, None]:
            for r in stream:
                if r.delta:
                    yield r.delta
                elif r.additional_kwargs:  # the closing response: timings and the rest
                    metadata.update(r.additional_kwargs)

        return StreamingResponse(pieces(), source_nodes=source_nodes, metadata=metadata)

    def _empty(self, asynchronous: bool) -> RESPONSE_TYPE:
        if not self._streaming:
            return Response(self._empty_response)
        if asynchronous:
            return AsyncStreamingResponse(response_gen=self._empty_response_agenerator())
        return StreamingResponse(response_gen=self._empty_response_generator())

    @dispatcher.span
    def synthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if len(nodes) == 0:  # as the base class: no context, no answer
            response = self._empty(asynchronous=False)
            dispatcher.event(SynthesizeEndEvent(query=query, response=response))
            return response
        if isinstance(query, str):
            query = QueryBundle(query_str=query)
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            source_nodes = list(nodes) + list(additional_source_nodes or [])
            response = self._respond(query.query_str, list(nodes), source_nodes, response_kwargs)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    async def asynthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query))
        if len(nodes) == 0:
            response = self._empty(asynchronous=True)
            dispatcher.event(SynthesizeEndEvent(query=query, response=response))
            return response
        if isinstance(query, str):
            query = QueryBundle(query_str=query)
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            source_nodes = list(nodes) + list(additional_source_nodes or [])
            # Generation blocks for seconds: run it in a worker thread (the context,
            # and with it the active span and callback trace, is copied there).
            result = await asyncio.to_thread(self._respond, query.query_str, list(nodes),
                                             source_nodes, response_kwargs)
            response: RESPONSE_TYPE = result
            if isinstance(result, StreamingResponse):
                response = AsyncStreamingResponse(_aiter_in_thread(result.response_gen),
                                                  source_nodes=result.source_nodes,
                                                  metadata=result.metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response


_DONE = object()


async def _aiter_in_thread(it: Iterable[_T]) -> AsyncGenerator[_T, None]:
    """An async generator over a blocking iterator, consumed by one worker thread.

    One thread for the whole stream, not one `to_thread` per step: `ctx.stream`
    holds the model's `RLock` while it runs, and an `RLock` must be released by
    the thread that took it. Closing the async generator early stops the worker,
    which closes the iterator in its own thread (releasing the lock there).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def put(kind: str, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            stop.set()

    def produce() -> None:
        iterator = iter(it)
        try:
            for item in iterator:
                if stop.is_set():
                    break
                put("item", item)
        except BaseException as exc:  # handed to the consumer
            put("error", exc)
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        put("done", None)

    context = contextvars.copy_context()  # spans and callback traces nest as in the caller
    threading.Thread(target=context.run, args=(produce,), name="cag-stream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


# ----------------------------------------------------------------------- builders


def make_retriever(ctx: CachedContext, top_k: int | None = None, *,
                   callback_manager: CallbackManager | None = None) -> CachedContextRetriever:
    """`ctx.as_retriever()`: None `top_k` means the context's own ``top_k``."""
    return CachedContextRetriever(ctx, top_k=top_k, callback_manager=callback_manager)


def make_llm(ctx: CachedContext, *, max_new_tokens: int | None = None,
             callback_manager: CallbackManager | None = None, write_through: bool = True) -> CachedContextLLM:
    """`ctx.as_llm()`: the target model as a LlamaIndex LLM (e.g. for ``Settings.llm``)."""
    kwargs: dict[str, Any] = {"callback_manager": callback_manager} if callback_manager else {}
    return CachedContextLLM(ctx, max_new_tokens=max_new_tokens, write_through=write_through, **kwargs)


def make_synthesizer(ctx: CachedContext, *, streaming: bool = False, max_new_tokens: int | None = None,
                     callback_manager: CallbackManager | None = None,
                     write_through: bool = True) -> CachedContextSynthesizer:
    """A response synthesizer that answers from the caches, over any retriever's nodes:
    ``RetrieverQueryEngine(retriever=your_retriever, response_synthesizer=make_synthesizer(ctx))``."""
    return CachedContextSynthesizer(ctx, streaming=streaming, max_new_tokens=max_new_tokens,
                                    callback_manager=callback_manager, write_through=write_through)


def make_query_engine(ctx: CachedContext, streaming: bool = False, top_k: int | None = None, *,
                      retriever: BaseRetriever | None = None, max_new_tokens: int | None = None,
                      node_postprocessors: list[BaseNodePostprocessor] | None = None,
                      callback_manager: CallbackManager | None = None,
                      write_through: bool = True) -> RetrieverQueryEngine:
    """`ctx.as_query_engine()`: a stock `RetrieverQueryEngine` with the cached synthesizer
    and the store's own retriever, or yours (``retriever=index.as_retriever()``: an
    existing index gains caching without being rebuilt; `top_k` is then the retriever's
    business), so postprocessors, callbacks and tracing compose as usual.

    Postprocessors that filter or re-rank keep the cached path; a node whose text one
    rewrites is found by its new text's content address (prefilled once on a miss).
    """
    if retriever is not None and top_k is not None:
        raise ValueError("top_k sets the store's own retriever; set your retriever's own "
                         "(e.g. index.as_retriever(similarity_top_k=...))")
    retriever = retriever or make_retriever(ctx, top_k=top_k, callback_manager=callback_manager)
    synthesizer = make_synthesizer(ctx, streaming=streaming, max_new_tokens=max_new_tokens,
                                   callback_manager=callback_manager, write_through=write_through)
    return RetrieverQueryEngine(retriever=retriever, response_synthesizer=synthesizer,
                                node_postprocessors=node_postprocessors,
                                callback_manager=callback_manager)


def documents_to_context(
    documents: Sequence[Document],
    store_dir: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    source_dtype: str = "bfloat16",  # as `cag build`
    chunk_tokens: int = 256,
    batch_size: int = 4,
    dtype: str = "bfloat16",
    embedder: Any = None,
    progress: bool = False,
    on_event: Callable[[Any], None] | None = None,
    **ctx_kwargs: Any,
) -> CachedContext:
    """Build (or incrementally update) a store from LlamaIndex `Document`s and open it.

    `source` is the model that prefills the chunks; it defaults to the context's
    ``target`` (a native chunk cache). `dtype` is the dtype the chunks are stored
    in; `source_dtype` the one the source model runs in. A callable `embedder`
    is handed to the context too (the store records only its id). The rest of the
    keyword arguments go to `CachedContext`.

    Document ids matter: the store tracks documents by id, and a `Document` gets a
    random id unless one is set (``Document(id_=...)``, or
    ``SimpleDirectoryReader(filename_as_id=True)``). With random ids every build
    replaces every document in the manifest (chunks are still reused by content).
    Document metadata is not stored; nodes carry the document id.
    """
    from cag.context import CachedContext
    from cag.models import registry
    from stores.build import build_store

    source = source or ctx_kwargs.get("target")
    if source is None:
        raise ValueError("documents_to_context needs a source model: pass source= or target=")
    model = registry.load(source, source_dtype)  # type: ignore[arg-type]
    build_store(list(documents), store_dir, model, chunk_tokens=chunk_tokens, batch_size=batch_size,
                dtype=dtype, embedder=embedder, progress=progress, on_event=on_event)
    if embedder is not None and not isinstance(embedder, str):
        # a callable embedder is not recorded in the store (only its id): the
        # context must be handed the same one to embed questions
        ctx_kwargs.setdefault("embedder", embedder)
    return CachedContext(store=store_dir, **ctx_kwargs)
