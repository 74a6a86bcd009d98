"""The `Mapper` interface, its errors, its artifact format and the method registry.

A mapper translates a source model's `KVChunk` into the target model's KV space.

**Why `translate` takes the text.** A `KVChunk` stores its text's hash, not the
text. The target's tokens of the chunk (its `token_ids` and `offsets`) and the
alignment of those tokens to the source's both need the text itself, so the
caller, who has it (the store keeps documents, the retriever returns them),
passes it: ``translate(chunk, text, target)``. The text is checked against the
chunk's hash, so a wrong text is an error rather than a silent misalignment.
The target `LoadedModel` is passed (not only its fingerprint) because its
tokenizer is needed; it is checked against the mapper's target fingerprint.

**Artifact.** A folder::

    card.json            method, settings, both fingerprints, fit provenance,
                         fit time, measured fidelity, sha256 of the weights file
    weights.safetensors  the method's tensors (absent for `identity`)

Nothing is ever pickled; `load` validates the card, the checksum, the tensors'
names and shapes, and (when asked) the expected source and target.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file

from cag.kv import FLOAT_DTYPES, KVChunk, ModelFingerprint, normalize_dtype, text_sha256

ARTIFACT_FORMAT = "cag-mapper"
ARTIFACT_VERSION = 1
CARD_NAME = "card.json"
WEIGHTS_NAME = "weights.safetensors"


class MapperError(ValueError):
    """Base of every mapper error."""


class MapperMismatchError(MapperError):
    """A chunk from another source model, or a target other than the mapper's."""


class TextMismatchError(MapperError):
    """The text passed with a chunk is not the text the chunk was computed from."""


class MapperArtifactError(MapperError):
    """A mapper folder whose card or weights are missing, malformed or inconsistent."""


class UnknownMethodError(MapperError):
    """A method name no registered mapper answers to."""


MAPPERS: dict[str, type["Mapper"]] = {}


def register_mapper(cls: type["Mapper"]) -> type["Mapper"]:
    """Class decorator: make `cls` available under ``cls.method``."""
    MAPPERS[cls.method] = cls
    return cls


def mapper_class(method: str) -> type["Mapper"]:
    _import_builtin_methods()
    try:
        return MAPPERS[method]
    except KeyError:
        raise UnknownMethodError(f"unknown mapper method {method!r}; known: {sorted(MAPPERS)}") from None


def available_methods() -> list[str]:
    _import_builtin_methods()
    return sorted(MAPPERS)


def _import_builtin_methods() -> None:
    from mappers import bottleneck, heterofold, identity, latent, mot, ridge  # noqa: F401  (registration side effect)


def runtime_dtype(compute_dtype: str) -> torch.dtype:
    """What a mapper computes in: its artifact's ``compute_dtype``, except bf16 on a host whose
    models run in fp32 (no native bf16 arithmetic; `cag.models.registry.compute_dtype`).

    There torch emulates bf16 matmuls: MoT (bf16) translated 4,094 tokens in 25.5 s that way
    on the 2-core AVX2 host, about 20x its fp32 time (eval/results/ttft.md). fp32 only removes
    rounding that no fit depends on."""
    from cag.models.registry import compute_dtype as host_dtype

    dtype = FLOAT_DTYPES[normalize_dtype(compute_dtype)]
    if dtype == torch.bfloat16 and host_dtype() != "bfloat16":
        return torch.float32
    return dtype


class Mapper(ABC):
    """Source-space `KVChunk` → target-space `KVChunk` (keys still de-rotated)."""

    method: ClassVar[str] = ""

    def __init__(self, source: ModelFingerprint, target: ModelFingerprint,
                 settings: dict[str, Any] | None = None) -> None:
        self.source = source
        self.target = target
        self.settings: dict[str, Any] = dict(settings or {})
        self.fitted_on: dict[str, Any] = {}
        # the saved weights' digest, once saved or loaded: part of `artifact_id`, so a refit that
        # keeps method, settings and provenance still gets an id of its own
        self.weights_sha256: str | None = None
        self.fit_seconds: float | None = None
        self.fidelity: dict[str, Any] = {}

    # ------------------------------------------------------------ translation

    def check_pair(self, chunk: KVChunk, target) -> None:
        if chunk.partial:
            raise ValueError(f"a chunk decoded for its first {chunk.first_layers} layers only cannot be translated")
        if chunk.model.id != self.source.id:
            raise MapperMismatchError(
                f"{self.method} mapper translates from {self.source.describe()}, "
                f"but the chunk was computed by {chunk.model.describe()}"
            )
        fp = getattr(target, "fingerprint", target)
        if fp.id != self.target.id:
            raise MapperMismatchError(
                f"{self.method} mapper translates into {self.target.describe()}, "
                f"not into {fp.describe()}"
            )

    def translate(self, chunk: KVChunk, text: str, target) -> KVChunk:
        """Translate one chunk; `text` is the chunk's text, `target` the target `LoadedModel`."""
        return self.translate_batch([chunk], [text], target)[0]

    def translate_batch(self, chunks: Sequence[KVChunk], texts: Sequence[str], target) -> list[KVChunk]:
        """Translate several chunks (each with its text) for one target."""
        if len(chunks) != len(texts):
            raise ValueError(f"{len(chunks)} chunks but {len(texts)} texts")
        for chunk, text in zip(chunks, texts):
            self.check_pair(chunk, target)
            if text_sha256(text) != chunk.text_hash:
                raise TextMismatchError("the text passed does not hash to the chunk's text hash")
        return self._translate_batch(list(chunks), list(texts), target)

    def repair_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys of translated chunks (``[L, H, T, D]``, as `translate_batch` gives them) for the ``+repair``
        path, where the target recomputes a few context tokens among them: a method whose artifact carries
        keys fitted on that path changes them here; the others serve what they translate."""
        return keys

    @abstractmethod
    def _translate_batch(self, chunks: list[KVChunk], texts: list[str], target) -> list[KVChunk]:
        """Checked inputs → translated chunks."""

    def _target_chunk(self, keys, values, ids, offsets, chunk: KVChunk, target) -> KVChunk:
        settings = {**chunk.settings, **target.chunk_settings(),
                    "translated": {"method": self.method, "source": self.source.id,
                                   "mapper": self.artifact_id}}
        return KVChunk(keys.contiguous(), values.contiguous(), ids, offsets, chunk.text_hash,
                       self.target, settings)

    # ---------------------------------------------------------------- artifact

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights to save (name → tensor); empty for methods without weights."""
        return {}

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Install and validate loaded weights (raise `MapperArtifactError`)."""
        if tensors:
            raise MapperArtifactError(f"{self.method} mapper has no weights, got {sorted(tensors)}")

    @property
    def artifact_id(self) -> str:
        fields = {"method": self.method, "source": self.source.id, "target": self.target.id,
                  "settings": self.settings, "fitted_on": self.fitted_on}
        if self.weights_sha256 is not None:
            fields["weights_sha256"] = self.weights_sha256
        ident = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def card(self) -> dict[str, Any]:
        return {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "method": self.method,
            "settings": self.settings,
            "source": self.source.to_dict(),
            "target": self.target.to_dict(),
            "fitted_on": self.fitted_on,
            "fit_seconds": self.fit_seconds,
            "fidelity": self.fidelity,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact folder (weights first, card last, each atomically)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        card = self.card()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.tensors().items()}
        if tensors:
            tmp = folder / (WEIGHTS_NAME + ".tmp")
            save_file(tensors, str(tmp), metadata={"method": self.method})
            os.replace(tmp, folder / WEIGHTS_NAME)
            card["weights_sha256"] = _sha256_file(folder / WEIGHTS_NAME)
            card["weights_bytes"] = (folder / WEIGHTS_NAME).stat().st_size
        else:
            card["weights_sha256"] = None
        write_card(folder, card)
        self.weights_sha256 = card["weights_sha256"]
        return folder

    @staticmethod
    def read_card(path: str | os.PathLike) -> dict[str, Any]:
        card_path = Path(path) / CARD_NAME
        try:
            card = json.loads(card_path.read_text())
        except FileNotFoundError:
            raise MapperArtifactError(f"{path}: no {CARD_NAME}; not a mapper artifact") from None
        except ValueError as exc:
            raise MapperArtifactError(f"{card_path}: unreadable JSON ({exc})") from None
        if not isinstance(card, dict) or card.get("format") != ARTIFACT_FORMAT:
            raise MapperArtifactError(f"{card_path}: not a {ARTIFACT_FORMAT} card")
        if card.get("version") != ARTIFACT_VERSION:
            raise MapperArtifactError(f"{card_path}: unknown artifact version {card.get('version')!r}")
        return card

    @classmethod
    def load(cls, path: str | os.PathLike, *, source: ModelFingerprint | None = None,
             target: ModelFingerprint | None = None) -> "Mapper":
        """Load and validate an artifact; `source`/`target`: refuse any other pair."""
        return load_mapper(path, source=source, target=target,
                           method=None if cls is Mapper else cls.method)


def load_mapper(path: str | os.PathLike, *, source: ModelFingerprint | None = None,
                target: ModelFingerprint | None = None, method: str | None = None) -> Mapper:
    """Load any mapper artifact (its class is named by the card's method)."""
    folder = Path(path)
    card = Mapper.read_card(folder)
    if method is not None and card.get("method") != method:
        raise MapperArtifactError(f"{folder}: a {card.get('method')!r} mapper, not {method!r}")
    try:
        klass = mapper_class(str(card.get("method")))
    except UnknownMethodError as exc:
        raise MapperArtifactError(f"{folder}: {exc}") from None
    try:
        src = ModelFingerprint.from_dict(card["source"])
        tgt = ModelFingerprint.from_dict(card["target"])
        settings = dict(card.get("settings") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise MapperArtifactError(f"{folder}: malformed card ({exc!r})") from None
    if source is not None and src.id != source.id:
        raise MapperMismatchError(f"{folder} translates from {src.describe()}, not {source.describe()}")
    if target is not None and tgt.id != target.id:
        raise MapperMismatchError(f"{folder} translates into {tgt.describe()}, not {target.describe()}")
    tensors: dict[str, torch.Tensor] = {}
    digest = card.get("weights_sha256")
    weights = folder / WEIGHTS_NAME
    if digest is not None:
        if not weights.exists():
            raise MapperArtifactError(f"{folder}: card names weights but {WEIGHTS_NAME} is missing")
        if _sha256_file(weights) != digest:
            raise MapperArtifactError(f"{weights}: checksum does not match the card (corrupted or swapped)")
        try:
            tensors = load_file(str(weights))
        except Exception as exc:  # safetensors raises several types
            raise MapperArtifactError(f"{weights}: not valid safetensors ({exc})") from None
    mapper = klass(src, tgt, settings)
    mapper._load_tensors(tensors)
    mapper.fitted_on = dict(card.get("fitted_on") or {})
    mapper.fit_seconds = card.get("fit_seconds")
    mapper.fidelity = dict(card.get("fidelity") or {})
    mapper.weights_sha256 = digest
    return mapper


def write_card(folder: str | os.PathLike, card: dict[str, Any]) -> None:
    """Write an artifact's card atomically (a reader sees the old card or the new, never half)."""
    fd, tmp_card = tempfile.mkstemp(dir=folder, prefix=".card.")
    with os.fdopen(fd, "w") as fh:
        json.dump(card, fh, indent=2, sort_keys=True, default=float)
    os.chmod(tmp_card, 0o644)
    os.replace(tmp_card, Path(folder) / CARD_NAME)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
