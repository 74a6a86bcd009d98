"""The translation lab's aligned dataset: built once on disk, read by every variant.

What is on disk (``<lab>/<source>__<target>/``, never committed):

- ``corpus.json``: every context text's provenance (which essay window, which
  package's description at which version, which synthetic seed), so the set can
  be rebuilt from its recorded sources;
- ``shards/NNNN.safetensors``: aligned rows, one per target token of a context:
  ``xkv`` the source's de-rotated keys and values of *all* its layers at the aligned
  source token (``[rows, Ls·2·Hs·Ds]``), ``xh`` the source's hidden states after every
  second layer (``[rows, Ls/2·d_model]``), ``y`` the target's de-rotated keys then
  values of all its layers (``[rows, 2·Lt·Ht·Dt]``), all fp16; plus ``ctx`` (which
  context each row comes from). A shard is written atomically, so a build that is
  killed resumes at the next shard;
- ``items/<split>/<id>.safetensors`` + ``.json``: lookup items (a needle planted in
  a held-out essay window), with the source's chunk features and the target's
  native chunk, so scoring a variant needs no source prefill and no target
  prefill of the context.

Every chunk is prefilled exactly as the store and the target prefill chunks:
``LoadedModel.prefill`` after the model's prompt head (``prefill_prefix="head"``).

Token alignment is the project's own (`mappers.token_alignment.align_tokens`,
window 1): a target token takes the features of the last source token that has
seen no text beyond it. Target tokens without such a source token are left out of
the rows (the runtime predicts the mean for them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cag.kv import KVChunk
from mappers.bottleneck import all_layer_features, split_outputs
from mappers.token_alignment import align_tokens

LAB_ROOT = Path(os.environ.get("CAG_LAB", Path.home() / ".cache" / "cag" / "lab"))
WINDOW_WORDS = 700          # ≈ 900-1,000 target tokens: the 512-2,048 band
HELD_OUT_ESSAYS = 3         # the last calibration essays: haystacks of the held-out lookup items only
HIDDEN_EVERY = 2            # hidden states after layers 2, 4, ... (the first probe's choice)


def lab_dir(source: str, target: str) -> Path:
    return LAB_ROOT / f"{source}__{target}"


# ------------------------------------------------------------------ corpus

def _windows(text: str, words: int = WINDOW_WORDS) -> list[str]:
    toks = " ".join(text.split()).split(" ")
    return [" ".join(toks[i:i + words]) for i in range(0, len(toks), words) if len(toks[i:i + words]) >= 150]


def package_descriptions(min_words: int = 300) -> list[dict]:
    """Long descriptions of the Python distributions installed here (their METADATA body).

    Prose that installs by package name: the record keeps name and version, so the
    same text comes back from the same lock file."""
    from importlib.metadata import distributions

    out = {}
    for dist in distributions():
        meta = dist.metadata
        name, version = meta.get("Name"), meta.get("Version")
        body = meta.get_payload() if hasattr(meta, "get_payload") else None
        body = body or meta.get("Description") or ""
        if not name or len(body.split()) < min_words or name.lower() in out:
            continue
        out[name.lower()] = {"package": name, "version": version, "text": body}
    return [out[k] for k in sorted(out)]


def training_essays() -> list[str]:
    from eval.datasets import calibration_essays

    return calibration_essays()[:-HELD_OUT_ESSAYS]


def held_out_essays() -> list[str]:
    from eval.datasets import calibration_essays

    return calibration_essays()[-HELD_OUT_ESSAYS:]


def training_corpus(synthetic_seeds: int = 40) -> list[dict]:
    """Context texts with provenance, interleaved by source so any prefix of the list is a mix."""
    import random

    from eval.calibration_lookup import calibration_lookup, calibration_needles
    from eval.datasets import essay_text

    essays = [{"source": "essay", "name": name, "window": i, "text": w}
              for name in training_essays() for i, w in enumerate(_windows(essay_text(name)))]
    packages = [{"source": "package", "name": p["package"], "version": p["version"], "window": i, "text": w}
                for p in package_descriptions() for i, w in enumerate(_windows(p["text"]))]
    synthetic = []
    for seed in range(100, 100 + synthetic_seeds):  # seeds the gate (0) and the router never read
        docs = [d.text for d in calibration_lookup(seed=seed, n_docs=24, n_questions=1)[0].documents]
        random.Random(seed).shuffle(docs)
        for j in range(0, len(docs), 8):
            synthetic.append({"source": "calib-lookup", "seed": seed, "docs": [j, j + 8],
                              "text": " ".join(docs[j:j + 8])})
    needles = [{"source": "calib-needle", "seed": seed, "index": k, "text": item.documents[0].text}
               for seed in range(100, 100 + synthetic_seeds // 4)
               for k, item in enumerate(calibration_needles(seed=seed, n=6, essays=training_essays()))]
    streams = [essays, packages, synthetic, needles]
    mixed, i = [], 0
    while any(streams):
        stream = streams[i % len(streams)]
        if stream:
            mixed.append(stream.pop(0))
        i += 1
    for k, entry in enumerate(mixed):
        entry["id"] = k
        entry["sha256"] = hashlib.sha256(entry["text"].encode()).hexdigest()
    return mixed


# ---------------------------------------------------------------- features

@torch.inference_mode()
def source_hidden(source, text: str) -> torch.Tensor:
    """``[Ts, Ls/2 · d]``: the source's residual stream after every second layer, chunk tokens only."""
    ids, _ = source.tokenize(text)
    sink = torch.tensor(source.sink_ids, dtype=torch.long)
    out = source.model.model(input_ids=torch.cat([sink, ids])[None], output_hidden_states=True)
    picked = out.hidden_states[HIDDEN_EVERY::HIDDEN_EVERY]
    return torch.cat([h[0, sink.numel():] for h in picked], dim=-1).float()


def source_kv_features(chunk: KVChunk) -> torch.Tensor:
    """``[Ts, Ls·2·Hs·Ds]``: every source layer's de-rotated keys, then every layer's values."""
    return all_layer_features(chunk)


def target_rows(native: KVChunk) -> torch.Tensor:
    """``[Tt, 2·Lt·Ht·Dt]``: the target's de-rotated keys of all layers, then values."""
    return all_layer_features(native)


split_target = split_outputs  # inverse of `target_rows`


def aligned(source_chunk: KVChunk, native: KVChunk):
    al = align_tokens(source_chunk.offsets, native.offsets, window=1)
    return al.index[:, 0], al.has_source


# ------------------------------------------------------------------- build

def _save_atomic(tensors: dict, path: Path, meta: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={k: json.dumps(v) for k, v in (meta or {}).items()})
    os.replace(tmp, path)


def build_shards(source, target, corpus: list[dict], out: Path, *, max_tokens: int,
                 per_shard: int = 8) -> dict:
    """Prefill both models over `corpus` until `max_tokens` target rows exist; resumable."""
    from cag.progress import Progress

    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    (out / "corpus.json").write_text(json.dumps([{k: v for k, v in c.items() if k != "text"} for c in corpus],
                                                indent=1))
    groups = [corpus[i:i + per_shard] for i in range(0, len(corpus), per_shard)]
    rows = 0
    with Progress("lab build", total=max_tokens, unit="rows", interval_s=20) as bar:
        for g, group in enumerate(groups):
            path = shards / f"{g:04d}.safetensors"
            if path.exists():
                n = int(json.loads(load_meta(path)["rows"]))
                rows += n
                bar.advance(n)
            else:
                xkv, xh, ys, ctx = [], [], [], []
                for entry in group:
                    chunk = source.prefill(entry["text"])
                    native = target.prefill(entry["text"])
                    index, ok = aligned(chunk, native)
                    xkv.append(source_kv_features(chunk)[index][ok].half())
                    xh.append(source_hidden(source, entry["text"])[index][ok].half())
                    ys.append(target_rows(native)[ok].half())
                    ctx.append(torch.full((int(ok.sum()),), entry["id"], dtype=torch.int32))
                n = sum(int(c.numel()) for c in ctx)
                _save_atomic({"xkv": torch.cat(xkv), "xh": torch.cat(xh), "y": torch.cat(ys), "ctx": torch.cat(ctx)},
                             path, {"rows": n, "contexts": [e["id"] for e in group]})
                rows += n
                bar.advance(n)
            if rows >= max_tokens:
                break
    return {"rows": rows, "shards": len(list(shards.glob("*.safetensors")))}


def load_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return fh.metadata() or {}


def shard_paths(out: Path) -> list[Path]:
    return sorted((out / "shards").glob("*.safetensors"))


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


# ------------------------------------------------------------ lookup items

SPLITS = ("test", "tune", "codes")


def lookup_items(split: str, n: int) -> list:
    """Needles planted in the held-out essays: ``tune`` (choosing scales and ranks) and
    ``test`` (the lab's report) never share a seed; ``codes`` asks for answers that must be copied
    exactly (register codes, call signs, invented names: `calibration_code_needles`), as the
    evaluation needles do and ``test``'s common words and numbers do not."""
    from eval.calibration_lookup import NEEDLE_MATERIALS

    if split not in SPLITS:
        raise ValueError(f"unknown lab split {split!r}; one of {SPLITS}")
    material, seed = {"tune": ("facts", 11), "test": ("facts", 12), "codes": ("codes", 13)}[split]
    return NEEDLE_MATERIALS[material](seed=seed, n=n, essays=held_out_essays())


def build_items(source, target, split: str, n: int, out: Path) -> list[Path]:
    """Per item: source features and the target's native chunk (fp32), question and answers."""
    from cag.progress import Progress

    folder = out / "items" / split
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    items = lookup_items(split, n)
    with Progress(f"lab items {split}", total=len(items), unit="items", interval_s=20) as bar:
        for item in items:
            path = folder / f"{item.id}.safetensors"
            if not path.exists():
                text = item.documents[0].text
                chunk = source.prefill(text)
                native = target.prefill(text)
                index, ok = aligned(chunk, native)
                _save_atomic({"xkv": source_kv_features(chunk)[index].half(),
                              "xh": source_hidden(source, text)[index].half(),
                              "has_source": ok, "native_keys": native.keys.float(),
                              "native_values": native.values.float(),
                              "token_ids": native.token_ids, "offsets": native.offsets},
                             path, {"question": item.question, "answers": list(item.answers), "text": text,
                                    "meta": item.meta, "text_hash": native.text_hash})
            paths.append(path)
            bar.advance(1)
    return paths


def progress_note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
