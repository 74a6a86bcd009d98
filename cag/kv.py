"""The `KVChunk`: one chunk of text as a model's KV cache, stored without position.

A chunk holds, for every layer, the keys and values the model computed for the
chunk's tokens. Keys are *de-rotated* (RoPE undone), so a chunk can be placed at
any position later: the assembler re-rotates the keys where the chunk lands.

On disk a chunk is a small frame around a safetensors payload::

    b"CAGKV\\x00\\x01\\x00"   8 bytes   magic and frame version
    payload length           8 bytes   little-endian unsigned
    sha256(payload)          32 bytes
    payload                  safetensors bytes (tensors + JSON metadata)

The frame lets a reader tell a truncated entry from a corrupted one before it
parses anything, and safetensors guarantees that decoding never executes code
(nothing is ever unpickled). Every decode validates the metadata, the dtypes and
the shapes, and, when the caller says which model it expects, the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = 1
_MAGIC = b"CAGKV\x00\x01\x00"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256

# Storage dtypes a chunk may be written in. fp32 exists for exactness checks; bf16
# is the default (half the bytes, and the dtype the models run in on CPU).
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


# --------------------------------------------------------------------------- errors


class ChunkError(ValueError):
    """Base of every error raised while decoding or validating a `KVChunk`."""


class TruncatedChunkError(ChunkError):
    """Fewer bytes than the frame declares: a partial write or a cut copy."""


class ChecksumError(ChunkError):
    """The payload does not hash to the checksum in the frame: corrupted bytes."""


class ChunkFormatError(ChunkError):
    """Not a chunk frame, or a payload whose metadata, tensors or shapes are wrong."""


class UnknownDtypeError(ChunkError):
    """A storage dtype this version does not read (or was asked to write)."""


class ForeignModelError(ChunkError):
    """The chunk was computed by another model than the one that wants to use it."""


# ------------------------------------------------------------------- fingerprints


@dataclass(frozen=True)
class ModelFingerprint:
    """What a KV cache depends on: the architecture, the tokenizer and the weights.

    `num_layers`, `num_kv_heads` and `head_dim` are the cache geometry; they are
    implied by the config hash but kept explicit so that a decoder can check a
    chunk's shapes without loading the model.
    """

    family: str
    config_hash: str
    tokenizer_hash: str
    weights_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    name: str = ""  # informative only (e.g. "qwen2.5-0.5b"); not part of the identity

    @property
    def id(self) -> str:
        """Short stable identity: two fingerprints are the same model iff ids match."""
        ident = "|".join(
            [self.family, self.config_hash, self.tokenizer_hash, self.weights_hash,
             str(self.num_layers), str(self.num_kv_heads), str(self.head_dim)]
        )
        return hashlib.sha256(ident.encode()).hexdigest()[:20]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelFingerprint":
        try:
            return cls(
                family=str(data["family"]),
                config_hash=str(data["config_hash"]),
                tokenizer_hash=str(data["tokenizer_hash"]),
                weights_hash=str(data["weights_hash"]),
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                name=str(data.get("name", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ChunkFormatError(f"malformed model fingerprint: {exc!r}") from None

    def describe(self) -> str:
        return f"{self.name or self.family} ({self.family}, id {self.id})"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """Canonical storage-dtype name, or `UnknownDtypeError`."""
    if isinstance(dtype, torch.dtype):
        for name, value in STORAGE_DTYPES.items():
            if value == dtype:
                return name
        raise UnknownDtypeError(f"unsupported chunk dtype {dtype}; use one of {sorted(STORAGE_DTYPES)}")
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in STORAGE_DTYPES:
        raise UnknownDtypeError(f"unsupported chunk dtype {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
    return name


# -------------------------------------------------------------------------- chunk


@dataclass
class KVChunk:
    """A chunk's KV cache in one model's space, keys without position.

    keys, values: ``[num_layers, num_kv_heads, num_tokens, head_dim]``.
    token_ids:    ``[num_tokens]`` int64, the model's tokens of `text`.
    offsets:      ``[num_tokens, 2]`` int64, character span of each token in the text
                  (end exclusive); the text itself is not stored, only its hash.
    settings:     how the chunk was made (chunker settings, the sink prefix it was
                  prefilled after, ...); JSON-serialisable, part of its identity.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    offsets: torch.Tensor
    text_hash: str
    model: ModelFingerprint
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate_tensors(self.keys, self.values, self.token_ids, self.offsets, self.model)

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V tensors in their current dtype."""
        return self.keys.numel() * self.keys.element_size() * 2

    def to(self, dtype: torch.dtype) -> "KVChunk":
        return KVChunk(self.keys.to(dtype), self.values.to(dtype), self.token_ids, self.offsets,
                       self.text_hash, self.model, dict(self.settings))

    # ---------------------------------------------------------------- encoding

    def to_bytes(self, dtype: str | torch.dtype = "bfloat16") -> bytes:
        """Serialise to a checksummed safetensors frame, K/V stored in `dtype`."""
        dtype_name = normalize_dtype(dtype)
        store_dtype = STORAGE_DTYPES[dtype_name]
        tensors = {
            "keys": self.keys.detach().to("cpu", store_dtype).contiguous(),
            "values": self.values.detach().to("cpu", store_dtype).contiguous(),
            "token_ids": self.token_ids.detach().to("cpu", torch.int64).contiguous(),
            "offsets": self.offsets.detach().to("cpu", torch.int64).contiguous(),
        }
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_name,
            "text_hash": self.text_hash,
            "model": self.model.to_dict(),
            "settings": self.settings,
        }
        payload = st_save(tensors, metadata={"cag": json.dumps(meta, sort_keys=True)})
        return _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        expect_model: ModelFingerprint | None = None,
        dtype: torch.dtype | None = None,
    ) -> "KVChunk":
        """Decode and validate a frame written by `to_bytes`.

        `expect_model`: refuse a chunk from any other model (`ForeignModelError`).
        `dtype`: cast K/V after decoding (e.g. ``torch.float32``); default keeps
        the storage dtype.
        """
        payload = _unframe(data)
        try:
            tensors = st_load(payload)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise ChunkFormatError(f"payload is not valid safetensors: {exc}") from None
        meta = read_metadata(payload)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ChunkFormatError(f"unknown chunk format version {meta.get('format_version')!r}")
        dtype_name = meta.get("dtype")
        if dtype_name not in STORAGE_DTYPES:
            raise UnknownDtypeError(f"chunk declares unknown dtype {dtype_name!r}")
        missing = {"keys", "values", "token_ids", "offsets"} - tensors.keys()
        if missing:
            raise ChunkFormatError(f"chunk payload lacks tensors {sorted(missing)}")
        for name in ("keys", "values"):
            if tensors[name].dtype != STORAGE_DTYPES[dtype_name]:
                raise UnknownDtypeError(
                    f"{name} stored as {tensors[name].dtype}, metadata says {dtype_name}"
                )
        model = ModelFingerprint.from_dict(meta.get("model") or {})
        if expect_model is not None and model.id != expect_model.id:
            raise ForeignModelError(
                f"chunk was computed by {model.describe()}, not by {expect_model.describe()}"
            )
        keys, values = tensors["keys"], tensors["values"]
        if dtype is not None:
            keys, values = keys.to(dtype), values.to(dtype)
        text_hash = meta.get("text_hash")
        if not isinstance(text_hash, str) or len(text_hash) != 64:
            raise ChunkFormatError("chunk metadata lacks a valid text hash")
        settings = meta.get("settings")
        if not isinstance(settings, dict):
            raise ChunkFormatError("chunk metadata lacks its settings")
        return cls(keys, values, tensors["token_ids"], tensors["offsets"], text_hash, model, settings)


def read_metadata(data: bytes) -> dict[str, Any]:
    """The JSON metadata of a chunk (frame or bare payload) without decoding tensors.

    Used by store verification and listings, which need the fingerprint and
    settings of many chunks but not their tensors.
    """
    payload = _unframe(data) if data[:8] == _MAGIC else data
    if len(payload) < 8:
        raise TruncatedChunkError("payload shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", payload[:8])
    if header_len > len(payload) - 8:
        raise ChunkFormatError("safetensors header runs past the payload")
    try:
        header = json.loads(payload[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"]["cag"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkFormatError(f"chunk metadata unreadable: {exc!r}") from None
    if not isinstance(meta, dict):
        raise ChunkFormatError("chunk metadata is not an object")
    return meta


def _unframe(data: bytes) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ChunkFormatError(f"a chunk is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        if _MAGIC.startswith(data[: len(_MAGIC)]):
            raise TruncatedChunkError(f"chunk has {len(data)} bytes, less than its {_HEADER.size}-byte frame header")
        raise ChunkFormatError("not a cag chunk (no frame header)")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ChunkFormatError("not a cag chunk (bad magic; another format or a newer frame version)")
    payload = data[_HEADER.size :]
    if len(payload) < length:
        raise TruncatedChunkError(f"chunk payload has {len(payload)} of {length} bytes")
    if len(payload) > length:
        raise ChunkFormatError(f"chunk has {len(payload) - length} trailing bytes after its payload")
    if hashlib.sha256(payload).digest() != digest:
        raise ChecksumError("chunk payload does not match its checksum (corrupted bytes)")
    return payload


def _validate_tensors(keys, values, token_ids, offsets, model: ModelFingerprint) -> None:
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ChunkFormatError(
            f"keys and values must share one [layers, kv_heads, tokens, head_dim] shape, "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    layers, heads, tokens, head_dim = keys.shape
    expected = (model.num_layers, model.num_kv_heads, model.head_dim)
    if (layers, heads, head_dim) != expected:
        raise ChunkFormatError(
            f"chunk geometry (layers, kv_heads, head_dim) = {(layers, heads, head_dim)} "
            f"does not match its model's {expected}"
        )
    if token_ids.shape != (tokens,):
        raise ChunkFormatError(f"token_ids shape {tuple(token_ids.shape)} != ({tokens},)")
    if offsets.shape != (tokens, 2):
        raise ChunkFormatError(f"offsets shape {tuple(offsets.shape)} != ({tokens}, 2)")
    if token_ids.dtype.is_floating_point or offsets.dtype.is_floating_point:
        raise ChunkFormatError("token_ids and offsets must be integer tensors")
