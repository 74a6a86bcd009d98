"""The LlamaIndex integration against a fake `CachedContext` (no models, fast).

What matters most: the chunk keys the retriever found reach `CachedContext.answer`
as `Hit`s (the text is never flattened and prefilled on the cached path), and the
callbacks and instrumentation events of a stock LlamaIndex pipeline still fire.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from llama_index.core.base.llms.types import ChatMessage, CompletionResponse
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import Document, MetadataMode, NodeWithScore, TextNode

from cag import llama_index as li
from cag.llama_index import (CHUNK_KEY, DOC_ID, END, START, CachedContextRetriever,
                             CachedContextSynthesizer, make_llm, make_query_engine, make_retriever,
                             nodes_to_hits)
from stores.index import Hit

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------ the fake


@dataclass
class FakeTimings:
    retrieve: float = 0.01
    load: float = 0.02
    translate: float = 0.0
    assemble: float = 0.03
    recompute: float = 0.0
    question_prefill: float = 0.04
    first_token: float = 0.05
    total: float = 0.2

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class FakeAnswer:
    text: str
    sources: list[Hit]
    timings: FakeTimings = field(default_factory=FakeTimings)
    context_tokens: int = 0
    warnings: list[str] = field(default_factory=list)
    mapper: str = "identity"


HITS = [
    Hit(key="k-alpha", score=0.9, doc_id="a.txt", text="Alpha is the first letter.", start=0, end=26),
    Hit(key="k-beta", score=0.7, doc_id="b.txt", text="Beta comes second.", start=10, end=28),
    # the same chunk text (so the same content address) in another document
    Hit(key="k-alpha", score=0.6, doc_id="c.txt", text="Alpha is the first letter.", start=5, end=31),
]


class FakeContext:
    """The `CachedContext` surface the integration uses; records every call."""

    def __init__(self, hits: list[Hit] = HITS, pieces: tuple[str, ...] = ("Alpha ", "is ", "first.")) -> None:
        self.hits = list(hits)
        self.pieces = pieces
        self.calls: list[tuple[str, Any]] = []
        self.top_k = 3
        self.max_new_tokens = 32
        self.last_answer: FakeAnswer | None = None
        self.model_lock = threading.RLock()
        self.model_loaded = False

    # the real ones load the target model: the integration must not ask before a query
    @property
    def target_model_name(self) -> str:
        self.model_loaded = True
        return "fake-target"

    @property
    def context_window(self) -> int:
        self.model_loaded = True
        return 2048

    def retrieve(self, question: str, top_k: int | None = None) -> list[Hit]:
        self.calls.append(("retrieve", (question, top_k)))
        return self.hits[: top_k or self.top_k]

    def _answer(self, question: str, hits: list[Hit]) -> FakeAnswer:
        keys = ",".join(h.key for h in hits)
        return FakeAnswer(text=f"cached answer to {question!r} from [{keys}]", sources=list(hits),
                          context_tokens=7 * len(hits), warnings=["fake warning"])

    def answer(self, question: str, hits: list[Hit] | None = None, *, max_new_tokens: int | None = None) -> FakeAnswer:
        self.calls.append(("answer", (question, hits, max_new_tokens)))
        if hits is None:
            hits = self.retrieve(question)
        self.last_answer = self._answer(question, hits)
        return self.last_answer

    def stream(self, question: str, hits: list[Hit] | None = None, *,
               max_new_tokens: int | None = None) -> Iterator[str]:
        """As the real one: the model's RLock is held while generating, and
        `last_answer` is set before the first piece and filled in as it goes."""
        self.calls.append(("stream", (question, hits, max_new_tokens)))

        def gen() -> Iterator[str]:
            with self.model_lock:
                answer = self._answer(question, hits or [])
                answer.text = ""
                self.last_answer = answer
                for piece in self.pieces:
                    answer.text += piece
                    yield piece

        return gen()

    def complete_text(self, prompt: str, *, max_new_tokens: int | None = None) -> str:
        self.calls.append(("complete_text", (prompt, max_new_tokens)))
        return f"plain: {prompt[-20:]}"

    def stream_text(self, prompt: str, *, max_new_tokens: int | None = None) -> Iterator[str]:
        self.calls.append(("stream_text", (prompt, max_new_tokens)))
        return iter(["plain ", "stream"])

    def called(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]


@pytest.fixture
def fake() -> FakeContext:
    return FakeContext()


def foreign_nodes() -> list[NodeWithScore]:
    """Nodes as another retriever returns them: text, no chunk keys."""
    return [NodeWithScore(node=TextNode(text="Gamma is third."), score=0.5),
            NodeWithScore(node=TextNode(text="Delta is fourth."), score=0.4)]


# ---------------------------------------------------------------------- retriever


def test_retriever_nodes_carry_the_chunk_and_hide_bookkeeping(fake):
    nodes = make_retriever(fake, top_k=3).retrieve("which letter?")
    assert fake.called("retrieve") == [("which letter?", 3)]
    assert [n.score for n in nodes] == [h.score for h in HITS]
    for nws, hit in zip(nodes, HITS):
        node = nws.node
        assert node.metadata[CHUNK_KEY] == hit.key
        assert (node.metadata[DOC_ID], node.metadata[START], node.metadata[END]) == (hit.doc_id, hit.start, hit.end)
        for hidden in (CHUNK_KEY, START, END):
            assert hidden in node.excluded_llm_metadata_keys
            assert hidden in node.excluded_embed_metadata_keys
        assert DOC_ID not in node.excluded_llm_metadata_keys
        llm_text = node.get_content(metadata_mode=MetadataMode.LLM)
        assert hit.text in llm_text and hit.doc_id in llm_text and hit.key not in llm_text
        assert hit.key not in node.get_content(metadata_mode=MetadataMode.EMBED)
        assert node.ref_doc_id == hit.doc_id
        assert (node.start_char_idx, node.end_char_idx) == (hit.start, hit.end)


def test_node_ids_are_stable_and_distinct_per_document(fake):
    first = [n.node.node_id for n in make_retriever(fake).retrieve("q")]
    again = [n.node.node_id for n in make_retriever(FakeContext()).retrieve("other question")]
    assert first == again  # same chunk occurrence → same id, in any run
    # same key (same text) in two documents: two nodes, neither deduplicated away
    assert HITS[0].key == HITS[2].key and len(set(first)) == 3


def test_retriever_default_top_k_is_the_contexts(fake):
    assert len(CachedContextRetriever(fake).retrieve("q")) == 3
    assert fake.called("retrieve") == [("q", None)]


def test_async_retrieve(fake):
    nodes = asyncio.run(make_retriever(fake, top_k=2).aretrieve("q"))
    assert [n.node.metadata[CHUNK_KEY] for n in nodes] == ["k-alpha", "k-beta"]


def test_nodes_round_trip_to_hits(fake):
    hits, warning = nodes_to_hits(make_retriever(fake).retrieve("q"))
    assert warning is None and hits == HITS


def test_foreign_or_edited_nodes_are_not_cacheable(fake):
    hits, warning = nodes_to_hits([*make_retriever(fake).retrieve("q"), *foreign_nodes()])
    assert hits is None and "2 of 5 nodes have no 'chunk_key'" in warning
    edited = make_retriever(fake).retrieve("q")
    edited[1].node.set_content("Beta comes second, reworded.")
    hits, warning = nodes_to_hits(edited)
    assert hits is None and "text differs" in warning


# --------------------------------------------------------------------- query engine


def test_query_engine_answers_from_the_retrieved_keys(fake):
    engine = make_query_engine(fake, top_k=2)
    assert isinstance(engine, RetrieverQueryEngine)
    response = engine.query("which letter comes first?")
    assert isinstance(response, Response)
    # the hits' keys reached answer() as Hits, not as flattened text
    [(question, hits, _)] = fake.called("answer")
    assert question == "which letter comes first?"
    assert hits == HITS[:2] and all(isinstance(h, Hit) for h in hits)
    assert not fake.called("complete_text") and not fake.called("stream_text")
    assert response.response == "cached answer to 'which letter comes first?' from [k-alpha,k-beta]"
    assert [n.node.metadata[CHUNK_KEY] for n in response.source_nodes] == ["k-alpha", "k-beta"]
    meta = response.metadata
    assert meta["mode"] == "cached" and meta["mapper"] == "identity"
    assert meta["context_tokens"] == 14 and meta["warnings"] == ["fake warning"]
    assert meta["timings"]["total"] == pytest.approx(0.2)


def test_max_new_tokens_reaches_the_context(fake):
    make_query_engine(fake, max_new_tokens=5).query("q")
    [(_, _, budget)] = fake.called("answer")
    assert budget == 5


def test_streaming_query_engine_yields_the_pieces(fake):
    response = make_query_engine(fake, streaming=True).query("q")
    assert isinstance(response, StreamingResponse)
    assert response.metadata == {}  # known once the stream is consumed
    assert list(response.response_gen) == ["Alpha ", "is ", "first."]
    [(question, hits, _)] = fake.called("stream")
    assert question == "q" and hits == HITS
    assert not fake.called("answer") and not fake.called("complete_text")
    assert response.metadata["mode"] == "cached" and response.metadata["context_tokens"] == 21
    assert len(response.source_nodes) == 3


def test_async_query_engine(fake):
    response = asyncio.run(make_query_engine(fake).aquery("q"))
    assert isinstance(response, Response) and response.response.startswith("cached answer")
    assert fake.called("answer")[0][1] == HITS


def test_async_streaming_query_engine(fake):
    async def run() -> tuple[AsyncStreamingResponse, list[str]]:
        response = await make_query_engine(fake, streaming=True).aquery("q")
        return response, [piece async for piece in response.async_response_gen()]

    response, pieces = asyncio.run(run())
    assert isinstance(response, AsyncStreamingResponse)
    assert pieces == ["Alpha ", "is ", "first."]
    assert response.metadata["mode"] == "cached"


def test_empty_retrieval_gives_the_empty_response():
    response = make_query_engine(FakeContext(hits=[])).query("q")
    assert str(response) == "Empty Response"


class _Rewrite(BaseNodePostprocessor):
    def _postprocess_nodes(self, nodes, query_bundle=None):
        for n in nodes:
            n.node.set_content(n.node.get_content() + " (rewritten)")
        return nodes


class _KeepFirst(BaseNodePostprocessor):
    def _postprocess_nodes(self, nodes, query_bundle=None):
        return nodes[:1]


def test_filtering_postprocessor_keeps_the_cached_path(fake):
    response = make_query_engine(fake, node_postprocessors=[_KeepFirst()]).query("q")
    assert fake.called("answer")[0][1] == HITS[:1] and response.metadata["mode"] == "cached"


def test_rewriting_postprocessor_falls_back_to_text_with_a_warning(fake):
    response = make_query_engine(fake, node_postprocessors=[_Rewrite()], write_through=False).query("q")
    assert not fake.called("answer")
    [(prompt, _)] = fake.called("complete_text")
    assert "(rewritten)" in prompt
    assert response.metadata["mode"] == "text" and "text differs" in response.metadata["warnings"][0]


def test_synthesizer_with_foreign_nodes_uses_the_text_path(fake):
    synth = CachedContextSynthesizer(fake, write_through=False)
    response = synth.synthesize("what is gamma?", foreign_nodes())
    assert not fake.called("answer")
    [(prompt, _)] = fake.called("complete_text")
    assert "Gamma is third." in prompt and "Delta is fourth." in prompt and "what is gamma?" in prompt
    assert response.metadata["mode"] == "text"
    assert "no 'chunk_key'" in response.metadata["warnings"][0]


def test_synthesizer_streaming_text_path(fake):
    response = CachedContextSynthesizer(fake, streaming=True, write_through=False).synthesize("q", foreign_nodes())
    assert isinstance(response, StreamingResponse)
    assert "".join(response.response_gen) == "plain stream"
    assert fake.called("stream_text") and not fake.called("stream")


def test_get_response_is_the_text_path(fake):
    text = CachedContextSynthesizer(fake).get_response("q?", ["chunk one", "chunk two"])
    [(prompt, _)] = fake.called("complete_text")
    assert text.startswith("plain: ") and "chunk one" in prompt and "chunk two" in prompt
    assert asyncio.run(CachedContextSynthesizer(fake).aget_response("q?", ["x"])).startswith("plain: ")


def test_synthesizer_prompts_are_updatable(fake):
    from llama_index.core.prompts import PromptTemplate

    synth = CachedContextSynthesizer(fake)
    assert "text_qa_template" in synth.get_prompts()
    synth.update_prompts({"text_qa_template": PromptTemplate("CTX={context_str} Q={query_str}")})
    synth.get_response("q", ["c"])
    assert fake.called("complete_text")[0][0] == "CTX=c Q=q"


def test_synthesizer_refuses_another_llm(fake):
    from llama_index.core.llms import MockLLM

    with pytest.raises(TypeError, match="CachedContextLLM"):
        CachedContextSynthesizer(fake, llm=MockLLM())


# ---------------------------------------------------------------------------- LLM


def test_llm_metadata(fake):
    meta = make_llm(fake).metadata
    assert (meta.model_name, meta.context_window, meta.num_output, meta.is_chat_model) == (
        "fake-target", 2048, 32, False)
    assert make_llm(fake, max_new_tokens=8).metadata.num_output == 8


def test_llm_complete_with_nodes_answers_from_caches(fake):
    nodes = make_retriever(fake).retrieve("q")
    response = make_llm(fake).complete("which letter?", nodes=nodes)
    assert isinstance(response, CompletionResponse)
    assert fake.called("answer")[0][:2] == ("which letter?", HITS)
    assert not fake.called("complete_text")
    assert response.text.startswith("cached answer") and response.raw is fake.last_answer
    assert response.additional_kwargs["mode"] == "cached"


def test_llm_complete_without_nodes_is_plain(fake):
    response = make_llm(fake).complete("Say hi.")
    assert fake.called("complete_text") == [("Say hi.", None)] and not fake.called("answer")
    assert response.text == "plain: Say hi."


def test_llm_complete_with_foreign_nodes_prefills_their_text(fake):
    response = make_llm(fake, write_through=False).complete("what is gamma?", nodes=foreign_nodes())
    [(prompt, _)] = fake.called("complete_text")
    assert "Gamma is third." in prompt and "what is gamma?" in prompt
    assert "no 'chunk_key'" in response.additional_kwargs["warnings"][0]


def test_llm_stream_complete(fake):
    llm = make_llm(fake)
    nodes = make_retriever(fake).retrieve("q")
    responses = list(llm.stream_complete("q", nodes=nodes))
    assert [r.delta for r in responses] == ["Alpha ", "is ", "first.", ""]
    assert responses[-1].text == "Alpha is first." and responses[-1].additional_kwargs["mode"] == "cached"
    assert fake.called("stream")[0][1] == HITS
    plain = list(llm.stream_complete("hello"))
    assert "".join(r.delta for r in plain) == "plain stream" and fake.called("stream_text")


def test_chat_goes_through_complete(fake):
    llm = make_llm(fake)
    reply = llm.chat([ChatMessage(role="user", content="Hello there")])
    [(prompt, _)] = fake.called("complete_text")
    assert "Hello there" in prompt and reply.message.content.startswith("plain: ")
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Hi")]))
    assert streamed[-1].message.content == "plain stream"
    assert asyncio.run(llm.achat([ChatMessage(role="user", content="Hey")])).message.content.startswith("plain")


def test_llm_serializes_without_the_context(fake):
    llm = make_llm(fake, max_new_tokens=9)
    settings = llm.to_dict()
    assert settings["max_new_tokens"] == 9 and "ctx" not in settings and "_ctx" not in settings
    payload = llm.to_payload()  # what callbacks and instrumentation events carry
    assert payload["model_name"] == "fake-target" and payload["class_name"] == "CachedContextLLM"


# -------------------------------------------------------- callbacks, instrumentation


def test_callback_events_are_recorded(fake):
    debug = LlamaDebugHandler()
    engine = make_query_engine(fake, callback_manager=CallbackManager([debug]))
    engine.query("q")
    for kind in (CBEventType.QUERY, CBEventType.RETRIEVE, CBEventType.SYNTHESIZE, CBEventType.LLM):
        pairs = debug.get_event_pairs(kind)
        assert len(pairs) == 1, kind
        start, end = pairs[0]
        assert start.event_type == kind and end.event_type == kind
    [[_, synth_end]] = debug.get_event_pairs(CBEventType.SYNTHESIZE)
    assert str(synth_end.payload["response"]).startswith("cached answer")


def test_streaming_callbacks_close_the_llm_event_at_the_end_of_the_stream(fake):
    debug = LlamaDebugHandler()
    response = make_query_engine(fake, streaming=True, callback_manager=CallbackManager([debug])).query("q")
    assert debug.get_event_pairs(CBEventType.SYNTHESIZE)
    "".join(response.response_gen)
    assert len(debug.get_event_pairs(CBEventType.LLM)) == 1


class _Recorder(BaseEventHandler):
    events: list = []

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)


@pytest.fixture
def recorder():
    root = get_dispatcher()
    handler = _Recorder(events=[])
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


def test_instrumentation_events_arrive(fake, recorder):
    make_query_engine(fake).query("q")
    names = [e.class_name() for e in recorder.events]
    for name in ("QueryStartEvent", "RetrievalStartEvent", "RetrievalEndEvent", "SynthesizeStartEvent",
                 "LLMCompletionStartEvent", "LLMCompletionEndEvent", "SynthesizeEndEvent", "QueryEndEvent"):
        assert name in names, name
    assert names.index("SynthesizeStartEvent") < names.index("LLMCompletionStartEvent") \
        < names.index("SynthesizeEndEvent")
    end = next(e for e in recorder.events if e.class_name() == "SynthesizeEndEvent")
    assert str(end.response).startswith("cached answer")
    # the synthesize events sit in a span of the synthesizer (the query's trace nests)
    start = next(e for e in recorder.events if e.class_name() == "SynthesizeStartEvent")
    assert start.span_id and "CachedContextSynthesizer.synthesize" in start.span_id


def test_async_instrumentation_events_arrive(fake, recorder):
    asyncio.run(make_query_engine(fake).aquery("q"))
    names = [e.class_name() for e in recorder.events]
    assert "SynthesizeStartEvent" in names and "SynthesizeEndEvent" in names
    assert "LLMCompletionEndEvent" in names


# ---------------------------------------------------------------- build and import


def test_documents_to_context_builds_then_opens(monkeypatch, tmp_path):
    from cag.models import registry
    import stores.build

    seen: dict[str, Any] = {}
    monkeypatch.setattr(registry, "load", lambda name, dtype="float32", **kw: seen.setdefault("load", (name, dtype)))
    monkeypatch.setattr(stores.build, "build_store",
                        lambda docs, store_dir, source, **kw: seen.setdefault("build", (docs, store_dir, source, kw)))

    class OpenedContext:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

    monkeypatch.setitem(sys.modules, "cag.context", types.SimpleNamespace(CachedContext=OpenedContext))
    docs = [Document(id_="a.txt", text="Alpha."), Document(id_="b.txt", text="Beta.")]
    ctx = li.documents_to_context(docs, tmp_path / "store", target="smollm2-135m", top_k=2, chunk_tokens=64)
    assert seen["load"] == ("smollm2-135m", "bfloat16")
    built_docs, store_dir, source, kw = seen["build"]
    assert built_docs == docs and store_dir == tmp_path / "store" and source == seen["load"]
    assert kw["chunk_tokens"] == 64
    assert ctx.kw == {"store": tmp_path / "store", "target": "smollm2-135m", "top_k": 2}
    with pytest.raises(ValueError, match="source model"):
        li.documents_to_context(docs, tmp_path / "s2")


def test_import_is_light():
    code = ("import sys, cag.llama_index; "
            "heavy = [m for m in ('torch', 'transformers', 'faiss', 'cag.context', 'stores.index') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_building_the_pipeline_does_not_load_the_model(fake):
    make_query_engine(fake, streaming=True)
    make_retriever(fake)
    llm = make_llm(fake)
    assert not fake.model_loaded
    assert llm.metadata.model_name == "fake-target" and fake.model_loaded


def test_streamed_metadata_is_this_streams_even_when_another_stream_ran_since(fake):
    engine = make_query_engine(fake, streaming=True, top_k=1)
    first = engine.query("first?")
    gen = first.response_gen
    assert next(gen) == "Alpha "  # `first` now holds the model, mid-stream
    second = engine.query("second?")
    "".join(second.response_gen)  # (an RLock: the same thread may enter again)
    assert fake.last_answer.sources == HITS[:1]
    "".join(gen)
    assert first.metadata["used_node_ids"] == [li.node_id_for(HITS[0])]
    assert fake.called("stream")[0][0] == "first?"
    assert first.metadata is not second.metadata


def test_a_streams_return_value_is_its_answer(fake):
    answer = FakeAnswer(text="returned", sources=HITS[1:2], context_tokens=99)

    def stream(question, hits=None, *, max_new_tokens=None):
        yield "x"
        return answer

    fake.stream = stream
    final = list(make_llm(fake).stream_complete("q", nodes=make_retriever(fake).retrieve("q")))[-1]
    assert final.raw is answer and final.additional_kwargs["context_tokens"] == 99


def test_async_stream_keeps_the_model_lock_in_one_thread(fake):
    """An RLock taken by one thread cannot be released by another: the async stream
    must consume the sync generator from a single thread."""
    async def run() -> list[str]:
        response = await make_query_engine(fake, streaming=True).aquery("q")
        return [piece async for piece in response.async_response_gen()]

    assert asyncio.run(run()) == ["Alpha ", "is ", "first."]
    assert fake.model_lock.acquire(blocking=False)  # released, not leaked
    fake.model_lock.release()


# ------------------------------------------- the real CachedContext, on a tiny model


from tests.unit.test_context import ctx_for, kb  # noqa: E402,F401  (kb: the tiny store fixture)


def test_real_cached_context_end_to_end(kb):  # noqa: F811
    """The contract with the real `CachedContext` (tiny random qwen2, hash embedder):
    the query engine's answer is `ctx.answer` on the retrieved hits, streamed or not,
    sync or async (the async stream must release the model lock it took)."""
    from tests.stores.test_build import doc

    ctx = ctx_for(kb, top_k=2)
    question = doc(2, paragraphs=1)[:60]
    hits = ctx.retrieve(question)
    expected = ctx.answer(question, hits)

    response = ctx.as_query_engine().query(question)
    assert response.response == expected.text and response.metadata["mode"] == "cached"
    assert [n.node.metadata[CHUNK_KEY] for n in response.source_nodes] == [h.key for h in hits]
    assert response.metadata["used_node_ids"] == [li.node_id_for(h) for h in expected.sources]

    streamed = ctx.as_query_engine(streaming=True).query(question)
    assert "".join(streamed.response_gen) == expected.text
    assert streamed.metadata["context_tokens"] == expected.context_tokens

    async def run() -> str:
        r = await ctx.as_query_engine(streaming=True).aquery(question)
        return "".join([piece async for piece in r.async_response_gen()])

    assert asyncio.run(run()) == expected.text
    assert ctx.answer(question, hits).text == expected.text  # the model lock was released
