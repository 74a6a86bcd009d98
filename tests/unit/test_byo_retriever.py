"""Bring your own retriever (#13.5): cag's synthesizer over any retriever's nodes, on tiny models.

A node's chunk cache is found by content address (the key a build gives the same
text); a miss is prefilled by the store's source model once and stored, so the
next query hits; ``response.metadata["cache"]`` reports each query's hit rate.
"""

from __future__ import annotations

import shutil
import threading

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from cag.context import CachedContext
from cag.llama_index import CHUNK_KEY, make_query_engine, make_synthesizer
from cag.models import registry
from cag.models.loaded import LoadedModel
from stores.base import chunk_key
from stores.build import build_store
from stores.diskcache_store import DiskCacheChunkStore
from stores.index import Hit
from stores.manifest import chunks_dir, open_current
from tests.stores.test_build import HashEmbedder, doc
from tests.unit.test_context import saved

NEW_TEXT = "Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris."


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    source = saved(root, "qwen2")
    docs = [(f"doc{i}", doc(i, paragraphs=2)) for i in range(3)]
    build_store(docs, root / "store", registry.load(str(source), "float32"), chunk_tokens=32,
                embedder=HashEmbedder())
    return root, source


@pytest.fixture
def store(built, tmp_path):
    """A copy of the tiny store per test: write-through adds entries to it."""
    root, _ = built
    shutil.copytree(root / "store", tmp_path / "store")
    return tmp_path / "store"


def make_ctx(store, source, **kw) -> CachedContext:
    kw.setdefault("min_retention", 0.0)  # tiny models have no measured fidelity: consent to the cached path
    return CachedContext(store=store, target=str(source), embedder=HashEmbedder(), dtype="float32",
                         max_new_tokens=5, **kw)


def entries(store) -> int:
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        return len(chunks)


def plain(text: str, doc_id: str = "their-doc", score: float = 0.5) -> NodeWithScore:
    """A node as another retriever returns it: text and a source document, no cag metadata."""
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo

    node = TextNode(text=text, relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=doc_id)})
    return NodeWithScore(node=node, score=score)


def test_a_node_whose_text_is_stored_hits(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    hits = ctx.retrieve("tower of Velmora", top_k=2)
    before = entries(store)
    response = make_synthesizer(ctx).synthesize("tower of Velmora?", [plain(h.text, h.doc_id, h.score)
                                                                      for h in hits])
    assert response.metadata["mode"] == "cached"
    assert response.metadata["cache"] == {"nodes": 2, "hits": 2, "prefilled": 0, "hit_rate": 1.0,
                                          "prefill_s": 0.0}
    assert entries(store) == before
    # found by content address: the very chunks the build stored, so the same answer
    assert ctx.ensure_chunks([h.text for h in hits]).keys == [h.key for h in hits]
    assert response.response == ctx.answer("tower of Velmora?", hits).text


def test_a_new_node_is_prefilled_once_then_hits(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    synth = make_synthesizer(ctx)
    before = entries(store)
    first = synth.synthesize("Who keeps maps?", [plain(NEW_TEXT)])
    assert first.metadata["mode"] == "cached" and first.metadata["cache"]["prefill_s"] > 0
    assert {k: first.metadata["cache"][k] for k in ("nodes", "hits", "prefilled", "hit_rate")} == {
        "nodes": 1, "hits": 0, "prefilled": 1, "hit_rate": 0.0}
    assert entries(store) == before + 1
    second = synth.synthesize("Who keeps maps?", [plain(NEW_TEXT)])
    assert second.metadata["cache"] == {"nodes": 1, "hits": 1, "prefilled": 0, "hit_rate": 1.0,
                                        "prefill_s": 0.0}
    assert entries(store) == before + 1
    assert second.response == first.response

    # what was stored is what a build stores for that text: the same key, the same bytes
    manifest, _ = open_current(store, HashEmbedder())
    key = chunk_key(manifest.source_fingerprint, manifest.chunker, NEW_TEXT)
    fresh = registry.load(str(source), "float32").prefill(NEW_TEXT, settings=manifest.chunker)
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        assert chunks.get(key) == fresh.to_bytes(manifest.chunker["dtype"])
    # and the answer is the context's own cached answer on a hit with that key
    hit = Hit(key, 0.5, "their-doc", NEW_TEXT, 0, len(NEW_TEXT))
    assert second.response == ctx.answer("Who keeps maps?", [hit]).text


def test_stock_vector_store_index_through_retriever_query_engine(built, store):
    """The bar: RetrieverQueryEngine(stock VectorStoreIndex retriever, cag's synthesizer)
    answers from caches; the second query on the same nodes reports a 100% hit rate."""
    _, source = built
    ctx = make_ctx(store, source)
    documents = [Document(text=doc(i, paragraphs=2), id_=f"their-{i}") for i in range(3)]
    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8),
                                            transformations=[SentenceSplitter(chunk_size=48, chunk_overlap=0)])
    engine = RetrieverQueryEngine(retriever=index.as_retriever(similarity_top_k=2),
                                  response_synthesizer=make_synthesizer(ctx))
    before = entries(store)
    first = engine.query("what does the archivist keep?")
    nodes = first.source_nodes
    assert len(nodes) == 2 and not any(CHUNK_KEY in n.node.metadata for n in nodes)
    assert first.metadata["mode"] == "cached"
    cache = first.metadata["cache"]
    assert cache["nodes"] == 2 and cache["hits"] + cache["prefilled"] == 2
    assert entries(store) == before + cache["prefilled"]
    assert first.metadata["used_node_ids"] == [n.node.node_id for n in
                                               sorted(nodes, key=lambda n: -(n.score or 0))]

    second = engine.query("what does the archivist keep?")
    assert [n.node.node_id for n in second.source_nodes] == [n.node.node_id for n in nodes]
    assert second.metadata["cache"]["hit_rate"] == 1.0 and second.metadata["cache"]["prefilled"] == 0
    assert entries(store) == before + cache["prefilled"]
    assert second.response == first.response

    # the helper builds the same engine
    helper = ctx.as_query_engine(retriever=index.as_retriever(similarity_top_k=2))
    assert isinstance(helper, RetrieverQueryEngine)
    assert helper.query("what does the archivist keep?").response == first.response
    with pytest.raises(ValueError, match="similarity_top_k"):
        make_query_engine(ctx, top_k=2, retriever=index.as_retriever())


def test_streaming_reports_the_cache_at_the_end(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    response = make_synthesizer(ctx, streaming=True).synthesize("maps?", [plain(NEW_TEXT)])
    assert response.metadata == {}
    text = "".join(response.response_gen)
    assert response.metadata["cache"]["prefilled"] == 1 and response.metadata["mode"] == "cached"
    assert text == make_synthesizer(ctx).synthesize("maps?", [plain(NEW_TEXT)]).response


def test_cag_and_foreign_nodes_mix(built, store):
    _, source = built
    ctx = make_ctx(store, source, top_k=1)
    ours = ctx.as_retriever().retrieve("tower")
    response = make_synthesizer(ctx).synthesize("tower?", [*ours, plain(NEW_TEXT)])
    assert response.metadata["mode"] == "cached"
    assert {k: response.metadata["cache"][k] for k in ("nodes", "hits", "prefilled")} == {
        "nodes": 2, "hits": 1, "prefilled": 1}
    assert len(response.metadata["used_node_ids"]) == 2


def test_concurrent_misses_prefill_once(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    ctx.target_model  # loaded before the race
    before = entries(store)
    barrier, results = threading.Barrier(2), []

    def run():
        barrier.wait()
        results.append(ctx.ensure_chunks([NEW_TEXT]))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted((r.found, r.prefilled) for r in results) == [(0, 1), (1, 0)]
    assert results[0].keys == results[1].keys and entries(store) == before + 1


def test_empty_and_repeated_texts(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    lookup = ctx.ensure_chunks([NEW_TEXT, "", NEW_TEXT])
    assert lookup.keys[1] is None and lookup.keys[0] == lookup.keys[2] is not None
    assert (lookup.found, lookup.prefilled) == (0, 1) and "no tokens" in lookup.notes[0]
    with pytest.raises(TypeError, match="list of texts"):
        ctx.ensure_chunks(NEW_TEXT)  # a str is not a list of texts
    response = make_synthesizer(ctx).synthesize("maps?", [plain(NEW_TEXT), plain("")])
    assert response.metadata["cache"]["hits"] == 1 and len(response.metadata["used_node_ids"]) == 1
    assert any("no tokens" in w for w in response.metadata["warnings"])


def test_write_through_off_prefills_the_text_for_this_answer_only(built, store):
    _, source = built
    ctx = make_ctx(store, source)
    before = entries(store)
    response = make_synthesizer(ctx, write_through=False).synthesize("maps?", [plain(NEW_TEXT)])
    assert response.metadata["mode"] == "text" and "no 'chunk_key'" in response.metadata["warnings"][0]
    assert response.metadata["cache"]["hit_rate"] == 0.0 and entries(store) == before


def test_under_the_direct_fallback_nothing_is_prefilled(built, store):
    _, source = built
    ctx = make_ctx(store, source, min_retention=0.6)  # unmeasured tiny pair: the gate serves direct context
    before = entries(store)
    with pytest.warns(UserWarning):
        response = make_synthesizer(ctx).synthesize("maps?", [plain(NEW_TEXT)])
    assert response.metadata["cache"]["prefilled"] == 0 and entries(store) == before
    assert any("were not prefilled" in w for w in response.metadata["warnings"])


def test_a_store_whose_prefix_cannot_be_reproduced_takes_the_text_path(built, tmp_path):
    _, source = built
    model = registry.load(str(source), "float32")
    custom = LoadedModel.from_pretrained(model.model, model.tokenizer, name=model.name,
                                         weights_hash=model.fingerprint.weights_hash, sink_ids=[1, 5])
    build_store([("d", doc(7, paragraphs=1))], tmp_path / "store", custom, chunk_tokens=32,
                embedder=HashEmbedder())
    ctx = make_ctx(tmp_path / "store", source)
    response = make_synthesizer(ctx).synthesize("maps?", [plain(NEW_TEXT)])
    assert response.metadata["mode"] == "text"
    assert "'custom' prefix" in response.metadata["warnings"][0]
    assert entries(tmp_path / "store") == len(open_current(tmp_path / "store", HashEmbedder())[0].chunk_keys())
