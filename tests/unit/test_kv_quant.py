"""The 8-bit chunk formats (int8 and fp8 e4m3, KIVI's layout): error bounds, strict
scale validation, bytes per token, and a fuzzed decoder.

Stated error bounds (elementwise, decoded in fp32, against the tensors encoded):
- int8: half a quantisation step. Keys, per (layer, head, channel) over the tokens:
  |k' - k| <= (max - min) / 508, so <= absmax / 254 (half of the 1/127 step).
  Values, per (layer, head, token): |v' - v| <= absmax / 254.
- fp8 e4m3: |x' - x| <= |x - zero| / 16 + scale / 1024, with zero the key channel's
  mid-range (0 for values) and scale its half-range / 448: 3 mantissa bits, then
  the subnormal step.
"""

from __future__ import annotations

import json
import struct
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cag import kv
from cag.kv import (ChunkError, ChunkFormatError, KVChunk, ModelFingerprint, TruncatedChunkError,
                    UnknownDtypeError, normalize_dtype, read_metadata, text_sha256)

FP = ModelFingerprint("llama", "c" * 64, "t" * 64, "w" * 64, num_layers=2, num_kv_heads=3, head_dim=16,
                      name="fake")
FORMATS = ("int8", "float8_e4m3fn")
FLOAT_EPS = 1e-6  # fp32 arithmetic of the encoder and decoder, relative to the group's magnitude


def realistic_kv(tokens: int = 48, model: ModelFingerprint = FP, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V shaped like a real de-rotated cache: channels of very different sizes,
    two massive offset channels per head (x50, as RoPE's low frequencies give), and
    values whose size varies from token to token."""
    g = torch.Generator().manual_seed(seed)
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim
    channel = torch.exp(torch.empty(L, H, 1, D).uniform_(-2.0, 0.7, generator=g))
    keys = torch.randn(L, H, tokens, D, generator=g) * channel + 0.3 * torch.randn(L, H, 1, D, generator=g)
    keys[..., D - 2] = 50.0 + 5.0 * torch.randn(L, H, tokens, generator=g)   # massive, always positive
    keys[..., D - 1] = -50.0 * (1 + torch.rand(L, H, tokens, generator=g))    # massive, negative, wide
    values = torch.randn(L, H, tokens, D, generator=g) * torch.exp(torch.randn(L, H, tokens, 1, generator=g))
    return keys, values


def make_chunk(tokens: int = 48, model: ModelFingerprint = FP, seed: int = 0, keys=None, values=None) -> KVChunk:
    if keys is None:
        keys, values = realistic_kv(tokens, model, seed)
    tokens = keys.shape[2]
    return KVChunk(keys, values, torch.arange(tokens), torch.stack([torch.arange(tokens), torch.arange(tokens) + 1], 1),
                   text_sha256("hello"), model, {"chunk_tokens": 256, "sink_ids": [1]})


def frame(payload: bytes) -> bytes:
    return kv._frame(payload)


def payload_of(data: bytes) -> bytes:
    return data[kv._HEADER.size:]


def reframe(data: bytes, edit) -> bytes:
    """Decode a frame's safetensors payload, let `edit` change its tensors, and frame
    it again with a correct checksum: whatever is refused, the validator refused."""
    payload = payload_of(data)
    tensors = dict(st_load(payload))
    edit(tensors)
    meta = read_metadata(payload)
    return frame(st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"cag": json.dumps(meta)}))


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("alias, name", [("int8", "int8"), ("i8", "int8"), (torch.int8, "int8"),
                                         ("float8_e4m3fn", "float8_e4m3fn"), ("fp8", "float8_e4m3fn"),
                                         ("e4m3", "float8_e4m3fn"), (torch.float8_e4m3fn, "float8_e4m3fn"),
                                         ("bf16", "bfloat16")])
def test_dtype_names(alias, name):
    assert normalize_dtype(alias) == name
    assert name in kv.STORAGE_DTYPES
    assert (name in kv.QUANTIZED_DTYPES) != (name in kv.FLOAT_DTYPES)


def test_unknown_names_refused():
    for bad in ("int4", "float8_e5m2", torch.float8_e5m2, torch.int16, 8, None):
        with pytest.raises(UnknownDtypeError):
            normalize_dtype(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_within_stated_bound(fmt):
    chunk = make_chunk()
    back = KVChunk.from_bytes(chunk.to_bytes(fmt), expect_model=FP, dtype=torch.float32)
    k, v = chunk.keys, chunk.values
    lo, hi = k.amin(2, keepdim=True), k.amax(2, keepdim=True)
    zero, k_half = (hi + lo) / 2, (hi - lo) / 2
    v_half = v.abs().amax(3, keepdim=True)
    k_err, v_err = (back.keys - k).abs(), (back.values - v).abs()
    if fmt == "int8":
        k_bound, v_bound = k_half / 254, v_half / 254
        # the phrasing: within 1/127 of each key channel's absmax, with room to spare
        assert bool((k_err <= k.abs().amax(2, keepdim=True) / 254 * (1 + 1e-4)).all())
    else:
        k_bound = (k - zero).abs() / 16 + k_half / 448 / 1024
        v_bound = v.abs() / 16 + v_half / 448 / 1024
    assert bool((k_err <= k_bound + FLOAT_EPS * k.abs().amax(2, keepdim=True)).all()), float((k_err - k_bound).max())
    assert bool((v_err <= v_bound + FLOAT_EPS * v_half).all()), float((v_err - v_bound).max())
    # The bounds are not vacuous: small channels next to the x50 ones keep their detail.
    small = k[..., :4]
    rel = (back.keys[..., :4] - small).norm() / small.norm()
    assert rel < (0.01 if fmt == "int8" else 0.06)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoded_dtype_shape_and_fields(fmt):
    chunk = make_chunk()
    data = chunk.to_bytes(fmt)
    assert read_metadata(data)["dtype"] == fmt
    back = KVChunk.from_bytes(data, expect_model=FP)
    assert back.keys.dtype == back.values.dtype == torch.bfloat16  # what every caller computes in
    assert back.keys.shape == back.values.shape == chunk.keys.shape
    for dtype in (torch.float32, torch.float16):
        assert KVChunk.from_bytes(data, dtype=dtype).keys.dtype == dtype
    assert back.token_ids.dtype == back.offsets.dtype == torch.int64
    assert torch.equal(back.token_ids, chunk.token_ids) and torch.equal(back.offsets, chunk.offsets)
    assert back.text_hash == chunk.text_hash and back.settings == chunk.settings and back.model == FP
    raw = st_load(payload_of(data))
    assert raw["keys"].dtype == kv.QUANTIZED_DTYPES[fmt]
    assert {n: tuple(raw[n].shape) for n in kv._SCALE_NAMES} == {
        "key_scale": (2, 3, 1, 16), "key_zero": (2, 3, 1, 16), "value_scale": (2, 3, 48, 1)}
    assert all(raw[n].dtype == torch.float32 for n in kv._SCALE_NAMES)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_dtype_decodes_8bit_chunks_straight_into_it_and_leaves_float_chunks_alone(fmt):
    chunk = make_chunk()
    data = chunk.to_bytes(fmt)
    direct = KVChunk.from_bytes(data, decode_dtype=torch.float32)
    assert direct.keys.dtype == direct.values.dtype == torch.float32
    # the same numbers as asking for fp32 outright: the codes times the scales, never rounded to bf16
    asked = KVChunk.from_bytes(data, dtype=torch.float32)
    assert torch.equal(direct.keys, asked.keys) and torch.equal(direct.values, asked.values)
    assert KVChunk.from_bytes(data, dtype=torch.float16, decode_dtype=torch.float32).keys.dtype == torch.float16
    stored = KVChunk.from_bytes(chunk.to_bytes("bfloat16"), decode_dtype=torch.float32)
    assert stored.keys.dtype == torch.bfloat16  # a float chunk keeps its storage dtype (zero-copy)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_constant_groups_decode_exactly(fmt):
    keys, values = realistic_kv(tokens=8)
    keys[0, 1, :, 3] = 0.0      # an all-zero key channel
    keys[1, 0, :, 5] = 2.5      # a constant one: scale 0, its zero is the constant
    values[0, 2, 4] = 0.0       # an all-zero value vector
    back = KVChunk.from_bytes(make_chunk(keys=keys, values=values).to_bytes(fmt), dtype=torch.float32)
    assert torch.isfinite(back.keys).all() and torch.isfinite(back.values).all()
    assert torch.equal(back.keys[0, 1, :, 3], torch.zeros(8))
    assert torch.equal(back.keys[1, 0, :, 5], torch.full((8,), 2.5))
    assert torch.equal(back.values[0, 2, 4], torch.zeros(16))
    raw = st_load(payload_of(make_chunk(keys=keys, values=values).to_bytes(fmt)))
    assert raw["key_scale"][0, 1, 0, 3] == 0 and raw["value_scale"][0, 2, 4, 0] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_chunk_round_trips(fmt):
    keys = torch.zeros(2, 3, 0, 16)
    back = KVChunk.from_bytes(make_chunk(keys=keys, values=keys.clone()).to_bytes(fmt))
    assert back.keys.shape == (2, 3, 0, 16) and back.num_tokens == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_kv_is_refused_on_encode(fmt):
    keys, values = realistic_kv(tokens=4)
    keys[0, 0, 0, 0] = float("nan")
    with pytest.raises(ChunkFormatError, match="non-finite"):
        make_chunk(keys=keys, values=values).to_bytes(fmt)
    keys[0, 0, 0, 0], values[1, 1, 1, 1] = 0.0, float("inf")
    with pytest.raises(ChunkFormatError, match="non-finite"):
        make_chunk(keys=keys, values=values).to_bytes(fmt)


# ------------------------------------------------------------ corrupt scales


def _set(name, fn):
    def edit(t):
        t[name] = fn(t[name].clone())
    return edit


def _poke(name, index, value):
    def fn(x):
        x[index] = value
        return x
    return _set(name, fn)


CORRUPTIONS = {
    "key_scale without its token axis": (_set("key_scale", lambda x: x[:, :, 0]), ChunkFormatError, "shape"),
    "value_scale one token short": (_set("value_scale", lambda x: x[:, :, 1:]), ChunkFormatError, "shape"),
    "value_scale transposed": (_set("value_scale", lambda x: x.transpose(2, 3).contiguous()), ChunkFormatError,
                               "shape"),
    "key_scale NaN": (_poke("key_scale", (0, 0, 0, 2), float("nan")), ChunkFormatError, "non-finite"),
    "key_zero NaN": (_poke("key_zero", (1, 2, 0, 0), float("nan")), ChunkFormatError, "non-finite"),
    "value_scale inf": (_poke("value_scale", (1, 1, 7, 0), float("inf")), ChunkFormatError, "non-finite"),
    "key_scale negative": (_poke("key_scale", (0, 1, 0, 0), -0.5), ChunkFormatError, "negative"),
    "value_scale negative": (_poke("value_scale", (0, 0, 0, 0), -1e-3), ChunkFormatError, "negative"),
    "key_scale zero, codes not": (_poke("key_scale", (1, 0, 0, 1), 0.0), ChunkFormatError, "nonzero codes"),
    "value_scale zero, codes not": (_poke("value_scale", (0, 2, 3, 0), 0.0), ChunkFormatError, "nonzero codes"),
    "key_scale in fp16": (_set("key_scale", lambda x: x.half()), UnknownDtypeError, "float16"),
    "value_scale in bf16": (_set("value_scale", lambda x: x.bfloat16()), UnknownDtypeError, "bfloat16"),
    "key_scale so large it overflows": (_poke("key_scale", (0, 0, 0, 0), 3e38), ChunkFormatError, "range"),
    "value_scale missing": (lambda t: t.pop("value_scale"), ChunkFormatError, "lacks"),
    "key_zero missing": (lambda t: t.pop("key_zero"), ChunkFormatError, "lacks"),
    "an extra tensor": (lambda t: t.update(extra=torch.zeros(1)), ChunkFormatError, "unexpected"),
    "codes in another dtype": (_set("keys", lambda x: x.view(torch.uint8)), UnknownDtypeError, "metadata says"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_reframing_alone_is_accepted(fmt):
    """The corruption tests below re-frame a payload; unmodified, that decodes."""
    data = make_chunk().to_bytes(fmt)
    back = KVChunk.from_bytes(reframe(data, lambda t: None), dtype=torch.float32)
    torch.testing.assert_close(back.keys, KVChunk.from_bytes(data, dtype=torch.float32).keys, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_scales_are_refused(fmt, case):
    edit, error, match = CORRUPTIONS[case]
    with pytest.raises(error, match=match):
        KVChunk.from_bytes(reframe(make_chunk().to_bytes(fmt), edit))


def test_codes_outside_the_format_are_refused():
    # int8 writes codes in [-127, 127]; -128 can only come from a damaged or foreign writer
    int8 = make_chunk().to_bytes("int8")
    with pytest.raises(ChunkFormatError, match="-128"):
        KVChunk.from_bytes(reframe(int8, _poke("values", (0, 0, 0, 0), -128)))
    # e4m3fn's only non-finite code is NaN (0x7f / 0xff)
    fp8 = make_chunk().to_bytes("float8_e4m3fn")
    nan = torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)[0]
    for name in ("keys", "values"):
        with pytest.raises(ChunkFormatError, match=f"{name} of this float8_e4m3fn chunk decode to non-finite"):
            KVChunk.from_bytes(reframe(fp8, _poke(name, (1, 1, 1, 1), nan)))


def test_scales_on_a_float_chunk_are_refused():
    bf16 = make_chunk().to_bytes("bfloat16")
    with pytest.raises(ChunkFormatError, match="unexpected"):
        KVChunk.from_bytes(reframe(bf16, lambda t: t.update(key_scale=torch.ones(2, 3, 1, 16))))


# ------------------------------------------------------------------ bytes per token


def tensor_bytes(data: bytes) -> int:
    """Bytes of tensor data in a frame: the payload after its safetensors header."""
    payload = payload_of(data)
    (header_len,) = struct.unpack("<Q", payload[:8])
    return len(payload) - 8 - header_len


def test_bytes_per_token_of_a_tiny_llama_chunk():
    from tests.tiny import tiny_loaded

    lm = tiny_loaded("llama")
    chunk = lm.prefill("Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris. " * 3)
    L, H, T, D = chunk.keys.shape
    ids = T * 8 + T * 2 * 8  # token_ids and offsets, int64
    bf16 = 2 * L * H * T * D * 2 + ids
    # codes 1 byte each, fp32 key scale and zero per channel, fp32 value scale per token
    int8 = 2 * L * H * T * D * 1 + 4 * (2 * L * H * D) + 4 * (L * H * T) + ids
    assert tensor_bytes(chunk.to_bytes("bfloat16")) == bf16
    assert tensor_bytes(chunk.to_bytes("int8")) == int8
    assert tensor_bytes(chunk.to_bytes("float8_e4m3fn")) == int8
    # tiny heads (D=16) pay 4 bytes of value scale per 16 codes: a bit over half
    ratio = len(chunk.to_bytes("int8")) / len(chunk.to_bytes("bfloat16"))
    assert 0.5 < ratio < 0.7, ratio


def test_a_smollm2_shaped_chunk_is_under_the_bar():
    """SmolLM2-135M's geometry (30 layers, 3 kv-heads, head_dim 64), a full chunk of
    256 tokens: the whole frame, header included, within 12,288 bytes a token."""
    smol = ModelFingerprint("llama", "c" * 64, "t" * 64, "w" * 64, 30, 3, 64, name="smol-shaped")
    chunk = make_chunk(tokens=256, model=smol)
    per_token = {fmt: len(chunk.to_bytes(fmt)) / 256 for fmt in ("bfloat16", *FORMATS)}
    codes, scales, ids = 2 * 30 * 3 * 64, 4 * 2 * 30 * 3 * 64 / 256 + 4 * 30 * 3, 24
    assert codes + scales + ids == 12084
    for fmt in FORMATS:
        assert 12084 <= per_token[fmt] <= 12288, per_token
    assert 23064 <= per_token["bfloat16"] < 23100
    assert per_token["int8"] / per_token["bfloat16"] < 0.53


# ------------------------------------------------------------------ fuzzed decoder


@lru_cache(maxsize=None)
def real_frames() -> dict[str, bytes]:
    """Chunks of a tiny llama's real prefill, in every format the fuzzer attacks."""
    from tests.tiny import tiny_loaded

    chunk = tiny_loaded("llama").prefill("Cache-augmented generation reuses the keys and values of documents.")
    return {fmt: chunk.to_bytes(fmt) for fmt in ("bfloat16", *FORMATS)}


FUZZ = settings(max_examples=200, deadline=5000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
frames = st.sampled_from(("bfloat16", *FORMATS))


def decode_or_chunk_error(data: bytes) -> KVChunk | None:
    """Decoding either succeeds or raises a ChunkError; anything else fails the test."""
    try:
        return KVChunk.from_bytes(data)
    except ChunkError:
        return None


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes(blob):
    for data in (blob, kv._MAGIC + blob, frame(blob)):
        with pytest.raises(ChunkError):
            KVChunk.from_bytes(data)


@FUZZ
@given(frames, st.data())
def test_fuzz_truncations(fmt, data):
    full = real_frames()[fmt]
    cut = data.draw(st.integers(0, len(full) - 1))
    with pytest.raises(TruncatedChunkError):
        KVChunk.from_bytes(full[:cut])


@FUZZ
@given(frames, st.lists(st.integers(0, 10**9), min_size=1, max_size=8))
def test_fuzz_bit_flips_of_frames(fmt, flips):
    data = bytearray(real_frames()[fmt])
    for f in flips:
        data[(f // 8) % len(data)] ^= 1 << (f % 8)
    if bytes(data) == real_frames()[fmt]:  # flips that cancel out
        return
    with pytest.raises(ChunkError):
        KVChunk.from_bytes(bytes(data))


@FUZZ
@given(frames, st.data())
def test_fuzz_bit_flips_behind_a_valid_checksum(fmt, data):
    """Flips in the payload, re-framed with its right checksum: the parser and the
    validator must catch what the checksum no longer does. A flip in tensor data
    may still decode; then it must be a valid chunk (finite K/V for 8-bit ones)."""
    payload = bytearray(payload_of(real_frames()[fmt]))
    (header_len,) = struct.unpack("<Q", payload[:8])
    # half the flips land in the length field or the JSON header, where parsing happens
    where = st.one_of(st.integers(0, 8 + header_len - 1), st.integers(0, len(payload) - 1))
    for pos in data.draw(st.lists(where, min_size=1, max_size=4)):
        payload[pos] ^= 1 << data.draw(st.integers(0, 7))
    chunk = decode_or_chunk_error(frame(bytes(payload)))
    if chunk is not None and fmt in FORMATS:
        assert chunk.keys.dtype == torch.bfloat16
        assert torch.isfinite(chunk.keys).all() and torch.isfinite(chunk.values).all()
