"""What the frame's checksum costs a query: SHA-256 (frame version 1) against XXH3-128 (version 2).

    .venv/bin/python eval/bench_chunk_checksum.py            # eval/results/chunk_checksum/ (about 1 min)

The chunks are a 4K-token query's: the bench's essay (`eval/bench_ttft.py`) cut to `--tokens`
SmolLM2 tokens and built into a store as `cag bench` builds it (256-token chunks, int8, the
default). Every chunk's payload is framed both ways and decoded as the query path decodes it
(`KVChunk.from_bytes`, in full and for the source model's crux choice, its first 10 layers), the
two versions interleaved in each repeat; medians over `--repeats`. The checksum alone is timed on
the same bytes. Run it alone on the machine: both columns come from the same run, so compare the
ratio, not the seconds across hosts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import statistics
import struct
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import xxhash

from cag import kv
from cag.kv import KVChunk
from cag.models import registry
from eval.bench_ttft import cut_to_tokens, essay_text
from eval.harness import host_info
from stores.build import build_store
from stores.location import open_store

OUT = Path(__file__).resolve().parent / "results" / "chunk_checksum"
SOURCE = "smollm2-135m"


def version1(payload: bytes) -> bytes:
    """The frame cag wrote before version 2: a 32-byte SHA-256 where XXH3-128 is now."""
    return struct.pack("<8sQ32s", b"CAGKV\x00\x01\x00", len(payload), hashlib.sha256(payload).digest()) + payload


def timed(fn, frames: list[bytes]) -> float:
    t = time.perf_counter()
    for data in frames:
        fn(data)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--first-layers", type=int, default=10, help="the crux choice's partial decode")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    host = host_info()
    lm = registry.load(SOURCE, "auto")
    with tempfile.TemporaryDirectory(prefix="cag-checksum-") as tmp:
        print(f"building a {args.tokens}-token store with {SOURCE}", file=sys.stderr, flush=True)
        build_store([("essay", cut_to_tokens(essay_text(), lm.tokenizer, args.tokens))], Path(tmp) / "s", lm)
        store = open_store(Path(tmp) / "s").chunks()
        v2 = [store.get(k) for k in sorted(store.keys())]
        store.close()
    payloads = [d[kv._HEADER.size:] for d in v2]
    v1 = [version1(p) for p in payloads]
    assert all(d[:8] == b"CAGKV\x00\x02\x00" for d in v2), "the build wrote another frame version"
    cases = {
        "checksum": (lambda d: hashlib.sha256(memoryview(d)[48:]).digest(),
                     lambda d: xxhash.xxh3_128_digest(memoryview(d)[32:])),
        "decode": (KVChunk.from_bytes, KVChunk.from_bytes),
        f"decode first {args.first_layers} layers": (
            lambda d: KVChunk.from_bytes(d, first_layers=args.first_layers),
            lambda d: KVChunk.from_bytes(d, first_layers=args.first_layers)),
    }
    times = {case: {"v1": [], "v2": []} for case in cases}
    for rep in range(args.repeats + 1):  # the first round warms up
        for case, (f1, f2) in cases.items():
            a, b = timed(f1, v1), timed(f2, v2)
            if rep:
                times[case]["v1"].append(a)
                times[case]["v2"].append(b)
        print(f"repeat {rep}/{args.repeats}", file=sys.stderr, flush=True)
    rows = []
    for case, t in times.items():
        m1, m2 = statistics.median(t["v1"]), statistics.median(t["v2"])
        rows.append({"what": case, "sha256_v1_ms": 1e3 * m1, "xxh3_v2_ms": 1e3 * m2, "saved_ms": 1e3 * (m1 - m2),
                     "v1_all_ms": [1e3 * x for x in t["v1"]], "v2_all_ms": [1e3 * x for x in t["v2"]]})
    report = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": host,
              "platform": platform.platform(), "torch": torch.__version__, "source": SOURCE,
              "chunks": len(v2), "tokens": args.tokens, "bytes": sum(map(len, v2)), "repeats": args.repeats,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# The chunk frame's checksum: SHA-256 (version 1) against XXH3-128 (version 2)", "",
             f"Command: `{report['command']}`  ",
             f"Date: {report['date']}; host: {host['cpu']}, {host.get('cores', '?')} cores; torch {torch.__version__}.  ",
             f"A {args.tokens}-token query's chunks: {len(v2)} {SOURCE} chunks (int8, 256 tokens), "
             f"{report['bytes'] / 1e6:.1f} MB of frames; medians of {args.repeats} interleaved repeats, "
             "all chunks per repeat.", "",
             "| what, all of the query's chunks | SHA-256 frame (v1) ms | XXH3 frame (v2) ms | saved ms |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['sha256_v1_ms']:.1f} | {r['xxh3_v2_ms']:.1f} | {r['saved_ms']:.1f} |" for r in rows]
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
