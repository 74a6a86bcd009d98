"""Fitting a mapper from calibration texts, with streamed statistics and resume.

``fit_mapper(source, target, method, texts, out_dir, ...)`` is the function the
CLI (``cag fit``) calls. For each batch of texts (each text is one chunk) it
prefills both models, aligns tokens and layers, and adds the aligned rows to
float64 moment accumulators (`mappers.stats`): a held-out fraction of the texts
goes to separate accumulators used to choose λ and report R². Every
`checkpoint_every` batches the accumulators and the list of texts already
consumed are written to ``out_dir/fit_state/`` (safetensors + JSON, atomically);
a later call with the same configuration resumes from there and skips those
texts. Then the method fits from the statistics, fidelity is measured on the
held-out texts (`mappers.fidelity`), and the artifact is written to `out_dir`.

The held-out split is decided per text by a hash of (seed, text), so it does
not change when a fit is resumed or texts are reordered. Duplicate texts are
counted once; blank texts are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from cag.kv import text_sha256
from mappers.base import Mapper, mapper_class
from mappers.fidelity import measure_fidelity
from mappers.linear import KINDS, LinearKVMapper

STATE_DIR = "fit_state"


def parse_settings(pairs: Sequence[str]) -> dict[str, Any]:
    """``["calib_steps=100", "recolor=false"]`` → settings; values are JSON (bare words stay strings)."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set wants KEY=VALUE, got {pair!r}")
        try:
            settings[key.strip()] = json.loads(raw)
        except ValueError:
            settings[key.strip()] = raw
    return settings


def is_heldout(text: str, fraction: float, seed: int = 0) -> bool:
    if fraction <= 0:
        return False
    h = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < fraction


def split_texts(texts: Sequence[str], fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out), deterministic per text; at least one of each when possible."""
    unique = [t for t in dict.fromkeys(texts) if t.strip()]  # blank texts have no chunk
    held = [t for t in unique if is_heldout(t, fraction, seed)]
    train = [t for t in unique if not is_heldout(t, fraction, seed)]
    if fraction > 0 and not held and len(train) >= 2:
        held, train = train[-1:], train[:-1]
    if not train and len(held) >= 2:
        train, held = held[:1], held[1:]
    return train, held


class FitState:
    """Accumulators plus the set of consumed texts; saved to and resumed from a folder."""

    def __init__(self, mapper: LinearKVMapper, config_id: str) -> None:
        self.config_id = config_id
        self.train = mapper.new_accumulators()
        self.heldout = mapper.new_accumulators()
        self.done: set[str] = set()
        self.tokens = {"train": 0, "heldout": 0}

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for split, accs in (("train", self.train), ("heldout", self.heldout)):
            for kind, acc in accs.items():
                tensors.update(acc.state_dict(f"{split}.{kind}."))
        tmp = folder / "accumulators.safetensors.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / "accumulators.safetensors")
        meta = {"config_id": self.config_id, "done": sorted(self.done), "tokens": self.tokens}
        tmp_meta = folder / "progress.json.tmp"
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_meta, folder / "progress.json")  # last: progress never runs ahead of the stats

    @classmethod
    def resume(cls, mapper: LinearKVMapper, config_id: str, folder: Path) -> "FitState":
        state = cls(mapper, config_id)
        meta_path, st_path = folder / "progress.json", folder / "accumulators.safetensors"
        if not (meta_path.exists() and st_path.exists()):
            return state
        meta = json.loads(meta_path.read_text())
        if meta.get("config_id") != config_id:
            return state  # another configuration: start afresh
        tensors = load_file(str(st_path))
        for split, accs in (("train", state.train), ("heldout", state.heldout)):
            for kind, acc in accs.items():
                acc.load_state_dict(tensors, f"{split}.{kind}.")
        state.done = set(meta.get("done", []))
        state.tokens = dict(meta.get("tokens", state.tokens))
        return state


# The settings that change the streamed statistics; the others (ridge grid,
# training settings) only change what is fitted from them, so a fit that changes
# those still resumes its statistics.
STATISTICS_SETTINGS = ("layer_radius", "token_window", "target_token_window")


def _config_id(mapper: Mapper, heldout_fraction: float, seed: int) -> str:
    settings = {k: mapper.settings.get(k) for k in STATISTICS_SETTINGS}
    ident = json.dumps({"settings": settings, "source": mapper.source.id,
                        "target": mapper.target.id, "heldout_fraction": heldout_fraction, "seed": seed},
                       sort_keys=True, default=str)
    return hashlib.sha256(ident.encode()).hexdigest()


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # stderr: `cag fit --json` keeps stdout for its result
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tokens]} tok"), TimeRemainingColumn(), disable=not enabled,
                    console=Console(stderr=True))


def accumulate_statistics(source, target, mapper: LinearKVMapper, texts: Sequence[str],
                          state_dir: str | os.PathLike, *, heldout_fraction: float = 0.1,
                          batch_size: int = 4, checkpoint_every: int = 8, seed: int = 0,
                          progress: bool = True,
                          on_batch: Callable[[int], None] | None = None) -> FitState:
    """Stream aligned rows of `texts` into the mapper's accumulators, resumably.

    `on_batch(i)` is called after batch i has been added (tests use it to
    simulate an interruption).
    """
    folder = Path(state_dir)
    state = FitState.resume(mapper, _config_id(mapper, heldout_fraction, seed), folder)
    train, held = split_texts(texts, heldout_fraction, seed)
    held_set = set(held)
    todo = [t for t in train + held if text_sha256(t) not in state.done]
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    with _progress(progress) as bar:
        task = bar.add_task(f"fit {mapper.method}", total=len(train) + len(held),
                            completed=len(state.done), tokens=sum(state.tokens.values()))
        for b, batch in enumerate(batches):
            chunks = source.prefill_batch(batch)
            natives = target.prefill_batch(batch)
            for text, chunk, native in zip(batch, chunks, natives):
                split = "heldout" if text in held_set else "train"
                accs = state.heldout if split == "heldout" else state.train
                for kind, (x, y) in mapper.training_rows(chunk, native, target).items():
                    accs[kind].update(x, y)
                state.tokens[split] += int(native.num_tokens)
                state.done.add(text_sha256(text))
            bar.update(task, advance=len(batch), tokens=sum(state.tokens.values()))
            if (b + 1) % checkpoint_every == 0:
                state.save(folder)
            if on_batch is not None:
                on_batch(b)
    state.save(folder)
    return state


def fit_mapper(source, target, method: str, texts: Sequence[str], out_dir: str | os.PathLike, *,
               settings: dict[str, Any] | None = None, heldout_fraction: float = 0.1,
               batch_size: int = 4, checkpoint_every: int = 8, corpus_name: str = "",
               fidelity_texts: int = 8, continuation_fraction: float = 0.25, seed: int = 0,
               progress: bool = True, keep_state: bool = False,
               on_batch: Callable[[int], None] | None = None,
               on_step: Callable[[int], None] | None = None) -> Mapper:
    """Fit `method` from `source` to `target` (`LoadedModel`s) on `texts`; write the artifact to `out_dir`.

    Returns the fitted mapper (already saved). Resumes from ``out_dir/fit_state``
    when a previous call with the same configuration was interrupted: the
    statistics, and then the training of a calibrated method, step for step.
    `on_batch(i)` / `on_step(s)` are called after each statistics batch and each
    training step (tests raise there to simulate a crash).
    """
    start = time.perf_counter()
    out = Path(out_dir)
    klass = mapper_class(method)
    mapper = klass(source.fingerprint, target.fingerprint, settings)
    train, held = split_texts(texts, heldout_fraction, seed)
    fitted_on = {
        "corpus": corpus_name,
        "texts": len(train) + len(held),
        "train_texts": len(train),
        "heldout_texts": len(held),
        "texts_sha256": hashlib.sha256("".join(sorted(text_sha256(t) for t in train + held)).encode()).hexdigest(),
        "heldout_fraction": heldout_fraction,
        "seed": seed,
        # Chunks are prefilled after a prefix (the prompt head, or bare BOS); a map is
        # only valid for chunks made the same way, so the card records it.
        "prefill_prefix": {"source": source.prefill_prefix, "target": target.prefill_prefix},
    }
    fidelity: dict[str, Any] = {}
    if isinstance(mapper, LinearKVMapper):
        state = accumulate_statistics(source, target, mapper, texts, out / STATE_DIR,
                                      heldout_fraction=heldout_fraction, batch_size=batch_size,
                                      checkpoint_every=checkpoint_every, seed=seed,
                                      progress=progress, on_batch=on_batch)
        fitted_on["train_tokens"] = state.train[KINDS[0]].count
        fitted_on["heldout_tokens"] = state.heldout[KINDS[0]].count
        fidelity["stats"] = mapper.fit_from_stats(state.train, state.heldout)
        # Methods trained with the target in the loop (HeteroFold's calibration,
        # Mixture-of-Translators) start from the closed form fitted above.
        calibrate = getattr(mapper, "calibrate", None)
        if calibrate is not None:
            fidelity["calibration"] = calibrate(source, target, train, held, state_dir=out / STATE_DIR,
                                                progress=progress, on_step=on_step)
        mapper.round_to_storage()
    mapper.fitted_on = fitted_on
    fit_done = time.perf_counter()
    if fidelity_texts and held:
        fidelity["heldout"] = measure_fidelity(mapper, source, target, held[:fidelity_texts],
                                               continuation_fraction=continuation_fraction)
    mapper.fit_seconds = round(fit_done - start, 3)
    fidelity["measure_seconds"] = round(time.perf_counter() - fit_done, 3)
    mapper.fidelity = fidelity
    mapper.save(out)
    if not keep_state and (out / STATE_DIR).exists():
        shutil.rmtree(out / STATE_DIR)
    return mapper
