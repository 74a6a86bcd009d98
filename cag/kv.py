"""The `KVChunk`: one chunk of text as a model's KV cache, stored without position.

A chunk holds, for every layer, the keys and values the model computed for the
chunk's tokens. Keys are *de-rotated* (RoPE undone), so a chunk can be placed at
any position later: the assembler re-rotates the keys where the chunk lands.

On disk a chunk is a small frame around a safetensors payload::

    b"CAGKV\\x00\\x02\\x00"   8 bytes   magic and frame version (2)
    payload length           8 bytes   little-endian unsigned
    xxh3_128(payload)        16 bytes  big-endian digest (the ``xxhash`` package)
    payload                  safetensors bytes (tensors + JSON metadata)

The frame lets a reader tell a truncated entry from a corrupted one before it
parses anything, and safetensors guarantees that decoding never executes code
(nothing is ever unpickled). The checksum guards against corruption (a bad disk,
a cut copy), not against an attacker, who could rewrite any checksum: so it is
XXH3, which hashes at tens of GB/s, not SHA-256 (1.8 GB/s here), whose 30 ms over
a 4K-token query's chunks was a tenth of a cached answer's time
(eval/results/chunk_checksum/). Frames of version 1 (``\\x00\\x01\\x00``: the same
layout with a 32-byte SHA-256) are read as they are, so a store written before
needs no rebuild; new chunks are written as version 2. Every decode validates the metadata, the dtypes and
the shapes, and, when the caller says which model it expects, the fingerprint.

Storage formats (the metadata's ``dtype``):

- ``bfloat16``, ``float16``, ``float32``: K/V stored as they are.
- ``int8`` and ``float8_e4m3fn``: 8-bit codes plus fp32 scales, in KIVI's layout
  (Liu et al. 2024). Keys are quantised *per channel*: one ``key_scale`` and one
  ``key_zero`` per (layer, kv-head, head-dim channel) over the chunk's tokens,
  because de-rotated keys have a few channels many times larger than the rest
  (up to 9x the median channel on SmolLM2-135M) and offset from zero; one scale
  per token would let those channels flatten every other channel of the token
  (4x the error on SmolLM2: eval/results/chunk_formats.md). Values have no such
  channels, so they are quantised *per token*: one ``value_scale`` per (layer,
  kv-head, token).

  Keys are affine (``k = code * key_scale + key_zero``, the zero the channel's
  mid-range), values symmetric (``v = code * value_scale``). A key channel is
  often offset (say, always in [40, 60]); symmetric codes would spend half their
  range on values it never takes. Value vectors are centred, and a zero per token
  would cost one more fp32 per (layer, head, token): 360 bytes a token on
  SmolLM2, which would put the format over the 12,288 bytes a token it must stay
  under. fp8 uses the same layout, so that a massive channel cannot saturate
  e4m3's +-448 and a small one does not sink into its subnormals.

  Scales are fp32: 2 x 4 bytes per key channel (amortised over the chunk's
  tokens) plus 4 bytes per (layer, head, token), 540 bytes a token on a full
  256-token SmolLM2 chunk against 11,520 for the codes, and no fp16 underflow or
  overflow to reason about. Decoding returns bf16 (or the dtype asked for).

  Error bounds (elementwise, against the tensors that were encoded, decoded in
  fp32): int8 is within half a step, ``scale / 2`` -- for keys (max - min) / 508 of
  the channel, for values absmax / 254 of the token's vector. fp8 is within
  ``|x - zero| / 16 + scale / 1024`` (3 mantissa bits; the second term is the
  subnormal step).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = 1
_MAGIC_PREFIX = b"CAGKV\x00"  # then the frame version, two bytes
_MAGIC = _MAGIC_PREFIX + b"\x02\x00"  # the frame version written
_HEADER = struct.Struct("<8sQ16s")  # magic, payload length, xxh3_128 (version 2)


def _sha256(payload) -> bytes:
    return hashlib.sha256(payload).digest()


# Frame versions read: magic -> (header layout, the checksum of the payload).
_FRAMES = {
    _MAGIC: (_HEADER, xxhash.xxh3_128_digest),
    _MAGIC_PREFIX + b"\x01\x00": (struct.Struct("<8sQ32s"), _sha256),  # before 2026-12-06's thirteenth session
}

# Storage dtypes a chunk may be written in. fp32 exists for exactness checks; bf16
# is the default (half the bytes, and the dtype the models run in on CPU).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# The 8-bit formats: name -> dtype of the stored codes (scales are SCALE_DTYPE).
QUANTIZED_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
STORAGE_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, **QUANTIZED_DTYPES}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32",
                  "i8": "int8", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                  "fp8_e4m3": "float8_e4m3fn"}

SCALE_DTYPE = torch.float32
# Largest code magnitude: int8 keeps -128 unused so the grid is symmetric.
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": float(torch.finfo(torch.float8_e4m3fn).max)}
# Decoding a quantised chunk gives this dtype unless the caller asks for another.
QUANTIZED_DECODE_DTYPE = torch.bfloat16
_KV_NAMES = ("keys", "values", "token_ids", "offsets")
_SCALE_NAMES = ("key_scale", "key_zero", "value_scale")


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
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ChunkFormatError(f"malformed model fingerprint: {exc!r}") from None

    def describe(self) -> str:
        return f"{self.name or self.family} ({self.family}, id {self.id})"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """Canonical storage-dtype name (a `STORAGE_DTYPES` key), or `UnknownDtypeError`.

    For the 8-bit formats a torch dtype names the codes: ``torch.int8`` is "int8".
    Code that needs a float dtype (compute, weights) should index `FLOAT_DTYPES`."""
    if not isinstance(dtype, (str, torch.dtype)):
        raise UnknownDtypeError(f"a chunk dtype is a name or a torch.dtype, got {type(dtype).__name__}")
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
    first_layers: None for a whole chunk; n when only the model's first n layers were
                  decoded (`from_bytes(first_layers=n)`: a forward cut short after them
                  needs no more). Such a chunk is never stored, placed or translated.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    offsets: torch.Tensor
    text_hash: str
    model: ModelFingerprint
    settings: dict[str, Any] = field(default_factory=dict)
    first_layers: int | None = None

    def __post_init__(self) -> None:
        _validate_tensors(self.keys, self.values, self.token_ids, self.offsets, self.model, self.first_layers)

    @property
    def partial(self) -> bool:
        """Whether this chunk holds only its model's first layers (`first_layers`)."""
        return self.first_layers is not None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V tensors in their current dtype."""
        return self.keys.numel() * self.keys.element_size() * 2

    def to(self, dtype: torch.dtype) -> "KVChunk":
        return KVChunk(self.keys.to(dtype), self.values.to(dtype), self.token_ids, self.offsets,
                       self.text_hash, self.model, dict(self.settings), self.first_layers)

    # ---------------------------------------------------------------- encoding

    def to_bytes(self, dtype: str | torch.dtype = "bfloat16") -> bytes:
        """Serialise to a checksummed safetensors frame, K/V stored in `dtype`
        (a float dtype, or one of the 8-bit formats of `QUANTIZED_DTYPES`)."""
        if self.partial:
            raise ValueError(f"this chunk holds only its model's first {self.first_layers} layers: never stored")
        dtype_name = normalize_dtype(dtype)
        keys, values = self.keys.detach().to("cpu"), self.values.detach().to("cpu")
        if dtype_name in QUANTIZED_DTYPES:
            tensors = _quantize(keys, values, dtype_name)
        else:
            store_dtype = STORAGE_DTYPES[dtype_name]
            tensors = {"keys": keys.to(store_dtype).contiguous(), "values": values.to(store_dtype).contiguous()}
        tensors["token_ids"] = self.token_ids.detach().to("cpu", torch.int64).contiguous()
        tensors["offsets"] = self.offsets.detach().to("cpu", torch.int64).contiguous()
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_name,
            "text_hash": self.text_hash,
            "model": self.model.to_dict(),
            "settings": self.settings,
        }
        payload = st_save(tensors, metadata={"cag": json.dumps(meta, sort_keys=True)})
        return _frame(payload)

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        expect_model: ModelFingerprint | None = None,
        dtype: torch.dtype | None = None,
        decode_dtype: torch.dtype | None = None,
        first_layers: int | None = None,
    ) -> "KVChunk":
        """Decode and validate a frame written by `to_bytes`.

        `expect_model`: refuse a chunk from any other model (`ForeignModelError`).
        `dtype`: cast K/V after decoding (e.g. ``torch.float32``); default keeps
        the storage dtype of a float chunk and gives bf16 for an 8-bit one.
        `decode_dtype`: the dtype an 8-bit chunk decodes to when `dtype` is None,
        while a float chunk keeps its own (and stays zero-copy). The query path
        passes the model's compute dtype: an 8-bit chunk is then decoded straight
        into it, not rounded to bf16 and converted again when it is placed.

        `first_layers`: decode only the model's first n layers (a partial chunk, for a
        forward cut short after them: the source model's crux choice runs 10 of
        SmolLM2's 30). The whole frame is still checked (length, checksum, header,
        every tensor's shape); only the decode and the per-code checks are skipped
        for the layers left out.

        The tensors of a float chunk decoded in its storage dtype are views on
        `data` (no copy): treat them as read-only, and clone one before writing
        to it in place.
        """
        data, start = _unframe_at(data)
        tensors, header = _load_payload(data, start)
        meta = _cag_metadata(header)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ChunkFormatError(f"unknown chunk format version {meta.get('format_version')!r}")
        dtype_name = meta.get("dtype")
        if not isinstance(dtype_name, str) or dtype_name not in STORAGE_DTYPES:
            raise UnknownDtypeError(f"chunk declares unknown dtype {dtype_name!r}")
        missing = set(_KV_NAMES) - tensors.keys()
        if missing:
            raise ChunkFormatError(f"chunk payload lacks tensors {sorted(missing)}")
        for name in ("keys", "values"):
            if tensors[name].dtype != STORAGE_DTYPES[dtype_name]:
                raise UnknownDtypeError(
                    f"{name} stored as {tensors[name].dtype}, metadata says {dtype_name}"
                )
        quantized = dtype_name in QUANTIZED_DTYPES
        expected = set(_KV_NAMES) | (set(_SCALE_NAMES) if quantized else set())
        missing = expected - tensors.keys()
        if missing:
            raise ChunkFormatError(f"{dtype_name} chunk payload lacks tensors {sorted(missing)}")
        extra = tensors.keys() - expected
        if extra:
            raise ChunkFormatError(f"chunk payload has unexpected tensors {sorted(extra)} for dtype {dtype_name}")
        model = ModelFingerprint.from_dict(meta.get("model") or {})
        if expect_model is not None and model.id != expect_model.id:
            raise ForeignModelError(
                f"chunk was computed by {model.describe()}, not by {expect_model.describe()}"
            )
        text_hash = meta.get("text_hash")
        if not isinstance(text_hash, str) or len(text_hash) != 64:
            raise ChunkFormatError("chunk metadata lacks a valid text hash")
        settings = meta.get("settings")
        if not isinstance(settings, dict):
            raise ChunkFormatError("chunk metadata lacks its settings")
        keys, values = tensors["keys"], tensors["values"]
        # Geometry of the whole chunk first (the scales' expected shapes come from the codes').
        _validate_tensors(keys, values, tensors["token_ids"], tensors["offsets"], model)
        if first_layers is not None:
            _validate_tensors(keys[:first_layers], values[:first_layers], tensors["token_ids"], tensors["offsets"],
                              model, first_layers)  # a count out of range is refused before any decode
            kept = set(_KV_NAMES[:2]) | (set(_SCALE_NAMES) if quantized else set())
            tensors = {name: t[:first_layers] if name in kept else t for name, t in tensors.items()}
            keys, values = tensors["keys"], tensors["values"]
        if quantized:
            keys, values = _dequantize(tensors, dtype_name, dtype or decode_dtype or QUANTIZED_DECODE_DTYPE)
        elif dtype is not None:
            keys, values = keys.to(dtype), values.to(dtype)
        return cls(keys, values, tensors["token_ids"], tensors["offsets"], text_hash, model, settings, first_layers)


# ------------------------------------------------------------------- 8-bit formats


def _quantize(keys: torch.Tensor, values: torch.Tensor, dtype_name: str) -> dict[str, torch.Tensor]:
    """Codes and scales of K/V ``[layers, heads, tokens, head_dim]`` (KIVI's layout,
    see the module docstring): keys affine per channel, values symmetric per token."""
    keys, values = keys.float(), values.float()
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise ChunkFormatError(f"cannot store non-finite K/V as {dtype_name}")
    code_max = _CODE_MAX[dtype_name]
    lo, hi = _min_max(keys, dim=2)
    # Halves first: hi - lo could overflow fp32 where hi + lo does not.
    key_zero, key_half = lo / 2 + hi / 2, hi / 2 - lo / 2
    value_half = values.abs().amax(dim=3, keepdim=True)
    key_scale, value_scale = key_half / code_max, value_half / code_max
    return {
        "keys": _encode(keys - key_zero, key_scale, dtype_name),
        "values": _encode(values, value_scale, dtype_name),
        "key_scale": key_scale.to(SCALE_DTYPE).contiguous(),
        "key_zero": key_zero.to(SCALE_DTYPE).contiguous(),
        "value_scale": value_scale.to(SCALE_DTYPE).contiguous(),
    }


def _min_max(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[dim] == 0:  # a chunk of no tokens: nothing to scale
        shape = list(x.shape)
        shape[dim] = 1
        return torch.zeros(shape), torch.zeros(shape)
    return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)


def _encode(centred: torch.Tensor, scale: torch.Tensor, dtype_name: str) -> torch.Tensor:
    # An all-constant (or all-zero) group has scale 0 and codes 0: x = zero exactly.
    ratio = centred / torch.where(scale > 0, scale, torch.ones_like(scale))
    code_max = _CODE_MAX[dtype_name]
    ratio = ratio.clamp(-code_max, code_max)  # rounding may step a hair past the edge
    if dtype_name == "int8":
        ratio = ratio.round()
    return ratio.to(QUANTIZED_DTYPES[dtype_name]).contiguous()


def _dequantize(tensors: Mapping[str, torch.Tensor], dtype_name: str,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated K/V of an 8-bit chunk, in `out_dtype`.

    Every scale is checked as strictly as the tensors: exact shape, fp32, finite,
    >= 0, and 0 only where every code of its group is 0 (a constant group). The
    checks are reductions over the 1-byte codes or over the small scales, and the
    decode runs layer by layer: this is on the query path, and full-size fp32
    temporaries cost more than the arithmetic (fresh pages for every one)."""
    key_codes, value_codes = tensors["keys"], tensors["values"]
    layers, heads, tokens, head_dim = key_codes.shape
    if dtype_name == "int8" and key_codes.numel() and min(int(key_codes.min()), int(value_codes.min())) < -127:
        raise ChunkFormatError("int8 codes hold -128, which the int8 format never writes")
    expected = {"key_scale": (layers, heads, 1, head_dim), "key_zero": (layers, heads, 1, head_dim),
                "value_scale": (layers, heads, tokens, 1)}
    for name, shape in expected.items():
        t = tensors[name]
        if t.dtype != SCALE_DTYPE:
            raise UnknownDtypeError(f"{name} stored as {t.dtype}; the {dtype_name} format stores scales "
                                    f"as {SCALE_DTYPE}")
        if tuple(t.shape) != shape:
            raise ChunkFormatError(f"{name} shape {tuple(t.shape)} != {shape}")
        if not bool(torch.isfinite(t).all()):
            raise ChunkFormatError(f"{name} holds non-finite numbers")
    for name, codes, reduce_dim in (("key_scale", key_codes, 2), ("value_scale", value_codes, 3)):
        scale = tensors[name]
        if bool((scale < 0).any()):
            raise ChunkFormatError(f"{name} holds negative scales")
        zero = scale == 0  # the full check over the codes only when some group has scale 0
        if codes.numel() and bool(zero.any()) and bool((zero & _nonzero(codes).any(reduce_dim, keepdim=True)).any()):
            raise ChunkFormatError(f"{name} is 0 for a group with nonzero codes")
    key_scale, key_zero, value_scale = tensors["key_scale"], tensors["key_zero"], tensors["value_scale"]
    keys = torch.empty(key_codes.shape, dtype=out_dtype)
    values = torch.empty(value_codes.shape, dtype=out_dtype)
    for layer in range(layers):
        keys[layer] = torch.addcmul(key_zero[layer], _codes_float(key_codes[layer]), key_scale[layer])
        values[layer] = _codes_float(value_codes[layer]) * value_scale[layer]
    for name, out in (("keys", keys), ("values", values)):
        # min/max propagate NaN (fp8's NaN codes) and show inf (scales past the range)
        if out.numel() and not all(bool(torch.isfinite(x)) for x in torch.aminmax(out)):
            raise ChunkFormatError(f"{name} of this {dtype_name} chunk decode to non-finite {out_dtype} values "
                                   f"(NaN codes, or scales past the range)")
    return keys, values


# Every e4m3fn code as fp32, by torch's own cast. Looking codes up is 2-3x faster on
# CPU than casting them (torch 2.13 has no vectorised fp8 cast).
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _codes_float(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype == torch.float8_e4m3fn:
        index = codes.view(torch.uint8).flatten().int()
        return _FP8_VALUES.index_select(0, index).view(codes.shape)
    return codes.float()


def _nonzero(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype == torch.float8_e4m3fn:  # no comparisons on fp8; +0 and -0 are 0x00 and 0x80
        return (codes.view(torch.uint8) & 0x7F) != 0
    return codes != 0


def read_metadata(data: bytes) -> dict[str, Any]:
    """The JSON metadata of a chunk (frame or bare payload) without decoding tensors.

    Used by store verification and listings, which need the fingerprint and
    settings of many chunks but not their tensors.
    """
    data, start = _unframe_at(data) if data[:8] in _FRAMES else (data, 0)
    header, _ = _read_header(memoryview(data)[start:])
    return _cag_metadata(header)


def _cag_metadata(header: dict) -> dict[str, Any]:
    try:
        meta = json.loads(header["__metadata__"]["cag"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ChunkFormatError(f"chunk metadata unreadable: {exc!r}") from None
    if not isinstance(meta, dict):
        raise ChunkFormatError("chunk metadata is not an object")
    return meta


# torch warns (once) that a tensor made on a bytes object could write to immutable
# memory; the decoded chunk's tensors are read-only by contract (`KVChunk.from_bytes`).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"cag\.kv")

# safetensors' dtype names (its `Dtype` enum) of the types torch holds.
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _read_header(payload: memoryview) -> tuple[dict, int]:
    """The JSON header of a safetensors payload and where its data section starts."""
    if len(payload) < 8:
        raise TruncatedChunkError("payload shorter than a safetensors header")
    (header_len,) = struct.unpack_from("<Q", payload)
    if header_len > len(payload) - 8:
        raise ChunkFormatError("safetensors header runs past the payload")
    try:
        header = json.loads(bytes(payload[8 : 8 + header_len]))
    except (ValueError, RecursionError) as exc:
        raise ChunkFormatError(f"safetensors header unreadable: {exc!r}") from None
    if not isinstance(header, dict):
        raise ChunkFormatError("safetensors header is not an object")
    return header, 8 + header_len


def _load_payload(data: bytes, start: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of the safetensors payload at ``data[start:]`` as views on `data`, and its header.

    Zero-copy: ``safetensors.torch.load`` copies every tensor out of the bytes (and
    the payload had to be sliced out of the frame first); on the query path those two
    copies cost as much as the checksum (eval/results/query_path.md). The header is
    checked as safetensors' own parser checks it (`Metadata::validate`): known dtypes,
    non-negative integer shapes, data offsets that tile the data section exactly in
    order, and each tensor's byte length equal to its shape times its item size. The
    tensors share `data`'s (immutable) memory, as the tensors of
    ``safetensors.torch.load`` share the bytes objects it makes; nothing writes to them.
    """
    if sys.byteorder != "little":  # safetensors is little-endian; let the library swap bytes
        payload = bytes(memoryview(data)[start:])
        try:
            return st_load(payload), _read_header(memoryview(payload))[0]
        except Exception as exc:  # the parser's only input is these bytes: anything it raises means bad bytes
            raise ChunkFormatError(f"payload is not valid safetensors: {exc!r}") from None
    payload = memoryview(data)[start:]
    header, body = _read_header(payload)
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ChunkFormatError("safetensors __metadata__ is not a map of strings")
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [d for d in info["shape"] if _is_size(d)]
            begin, end = info["data_offsets"]
            if len(shape) != len(info["shape"]) or not (_is_size(begin) and _is_size(end)):
                raise ValueError("sizes and offsets must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise ChunkFormatError(f"payload is not valid safetensors: tensor {name!r}: {exc!r}") from None
        entries.append((begin, end, name, dtype, shape))
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for begin, end, name, dtype, shape in sorted(entries, key=lambda e: (e[0], e[1])):
        count = math.prod(shape)
        if begin != offset or end - begin != count * dtype.itemsize:
            raise ChunkFormatError(f"payload is not valid safetensors: tensor {name!r} has data offsets "
                                   f"[{begin}, {end}] where [{offset}, {offset + count * dtype.itemsize}] was due")
        offset = end
        if count == 0:  # frombuffer refuses an empty view
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=start + body + begin).view(shape)
    if body + offset != len(payload):
        raise ChunkFormatError(f"payload is not valid safetensors: its tensors cover {body + offset} of "
                               f"{len(payload)} bytes")
    return tensors, header


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _frame(payload: bytes) -> bytes:
    """A payload in the frame written now (version 2: length and XXH3-128)."""
    return _HEADER.pack(_MAGIC, len(payload), xxhash.xxh3_128_digest(payload)) + payload


def _unframe_at(data: bytes) -> tuple[bytes, int]:
    """Check a frame (length, checksum) and return its bytes and where the payload starts.

    The payload is hashed and later parsed where it lies in `data`: slicing it out
    would copy every byte of it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ChunkFormatError(f"a chunk is bytes, got {type(data).__name__}")
    data = bytes(data)  # no copy for bytes; the tensors may then share immutable memory only
    frame = _FRAMES.get(data[: len(_MAGIC)])
    if frame is None:
        if len(data) < len(_MAGIC) and any(magic.startswith(data) for magic in _FRAMES):
            raise TruncatedChunkError(f"chunk has {len(data)} bytes, less than its frame header")
        if data[: len(_MAGIC_PREFIX)] == _MAGIC_PREFIX:
            raise ChunkFormatError(f"a cag chunk of frame version {data[6]}, which this version does not read (it "
                                   f"reads {sorted(magic[6] for magic in _FRAMES)}; written by a newer cag?)")
        raise ChunkFormatError("not a cag chunk (no frame header)")
    header, checksum = frame
    if len(data) < header.size:
        raise TruncatedChunkError(f"chunk has {len(data)} bytes, less than its {header.size}-byte frame header")
    _, length, digest = header.unpack_from(data)
    size = len(data) - header.size
    if size < length:
        raise TruncatedChunkError(f"chunk payload has {size} of {length} bytes")
    if size > length:
        raise ChunkFormatError(f"chunk has {size - length} trailing bytes after its payload")
    if checksum(memoryview(data)[header.size :]) != digest:
        raise ChecksumError("chunk payload does not match its checksum (corrupted bytes)")
    return data, header.size


def _validate_tensors(keys, values, token_ids, offsets, model: ModelFingerprint,
                      first_layers: int | None = None) -> None:
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ChunkFormatError(
            f"keys and values must share one [layers, kv_heads, tokens, head_dim] shape, "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if first_layers is not None and not 1 <= first_layers <= model.num_layers:
        raise ValueError(f"first_layers must be in [1, {model.num_layers}], got {first_layers}")
    layers, heads, tokens, head_dim = keys.shape
    expected = (first_layers or model.num_layers, model.num_kv_heads, model.head_dim)
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
