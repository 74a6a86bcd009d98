"""The KVChunk format: round trips and every decode error path."""

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from cag import kv
from cag.kv import (ChecksumError, ChunkFormatError, ForeignModelError, KVChunk, ModelFingerprint,
                    TruncatedChunkError, UnknownDtypeError, read_metadata, text_sha256)

FP = ModelFingerprint("llama", "c" * 64, "t" * 64, "w" * 64, num_layers=2, num_kv_heads=3, head_dim=4, name="fake")


def make_chunk(tokens: int = 5, model: ModelFingerprint = FP) -> KVChunk:
    g = torch.Generator().manual_seed(0)
    shape = (model.num_layers, model.num_kv_heads, tokens, model.head_dim)
    return KVChunk(torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                   torch.arange(tokens), torch.stack([torch.arange(tokens), torch.arange(tokens) + 1], 1),
                   text_sha256("hello"), model, {"chunk_tokens": 256, "sink_ids": [1]})


def frame(payload: bytes) -> bytes:
    return kv._frame(payload)


def payload_with(tensors=None, meta_overrides=None, drop=()):
    chunk = make_chunk()
    tensors = tensors or {"keys": chunk.keys.to(torch.bfloat16), "values": chunk.values.to(torch.bfloat16),
                          "token_ids": chunk.token_ids, "offsets": chunk.offsets}
    for name in drop:
        tensors.pop(name)
    meta = {"format_version": kv.FORMAT_VERSION, "dtype": "bfloat16", "text_hash": chunk.text_hash,
            "model": FP.to_dict(), "settings": chunk.settings}
    meta.update(meta_overrides or {})
    return st_save(tensors, metadata={"cag": json.dumps(meta)})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"])
def test_round_trip_keeps_everything(dtype):
    chunk = make_chunk()
    back = KVChunk.from_bytes(chunk.to_bytes(dtype), expect_model=FP)
    tol = 0 if "32" in dtype else 1e-2
    torch.testing.assert_close(back.keys.float(), chunk.keys, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(back.values.float(), chunk.values, atol=tol * 4, rtol=tol)
    assert torch.equal(back.token_ids, chunk.token_ids) and torch.equal(back.offsets, chunk.offsets)
    assert back.text_hash == chunk.text_hash and back.settings == chunk.settings
    assert back.model == FP and back.model.id == FP.id


def test_fp32_round_trip_is_exact_and_cast_on_decode():
    chunk = make_chunk()
    back = KVChunk.from_bytes(chunk.to_bytes("float32"))
    assert torch.equal(back.keys, chunk.keys) and back.keys.dtype == torch.float32
    half = KVChunk.from_bytes(chunk.to_bytes("bfloat16"), dtype=torch.float32)
    assert half.keys.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_first_layers_decode_those_layers_alone_and_go_no_further(dtype):
    """A decode of the first layers (the source model's crux choice needs no more) gives exactly
    those layers of the whole decode, still checks the whole frame, and is never stored or placed."""
    model = ModelFingerprint("llama", "c" * 64, "t" * 64, "w" * 64, num_layers=3, num_kv_heads=2, head_dim=4)
    data = make_chunk(model=model).to_bytes(dtype)
    whole = KVChunk.from_bytes(data, expect_model=model)
    first = KVChunk.from_bytes(data, expect_model=model, first_layers=2)
    assert first.partial and not whole.partial and first.keys.shape[0] == 2
    assert torch.equal(first.keys, whole.keys[:2]) and torch.equal(first.values, whole.values[:2])
    assert first.to(torch.float32).first_layers == 2
    with pytest.raises(ValueError, match="never stored"):
        first.to_bytes()
    for bad in (0, 4):
        with pytest.raises(ValueError, match="first_layers"):
            KVChunk.from_bytes(data, first_layers=bad)
    broken = bytearray(data)
    broken[-5] ^= 0xFF  # in the last tensor, not in the layers decoded: the checksum still refuses it
    with pytest.raises(ChecksumError):
        KVChunk.from_bytes(bytes(broken), first_layers=1)


def test_a_partial_chunk_serves_only_a_forward_that_short(tiny):
    """Placing it, or a forward deeper than its layers, is refused by the model's own check."""
    chunk = tiny.prefill("Zorblat keeps 417 maps in the tower.")
    first = KVChunk.from_bytes(chunk.to_bytes(), first_layers=1)
    tiny.check_chunk(first, layers=1)
    for layers in (None, 2):
        with pytest.raises(ValueError, match="first 1"):
            tiny.check_chunk(first, layers=layers)


def test_storage_size_scales_with_dtype():
    chunk = make_chunk(tokens=64)
    assert len(chunk.to_bytes("float32")) - len(chunk.to_bytes("bfloat16")) == chunk.keys.numel() * 2 * 2


def test_read_metadata_without_tensors():
    meta = read_metadata(make_chunk().to_bytes())
    assert meta["model"]["name"] == "fake" and meta["dtype"] == "bfloat16"


@pytest.mark.parametrize("cut", [0, 3, 20, 47, 48, 100, -1])
def test_truncated(cut):
    data = make_chunk().to_bytes()
    data = data[:cut] if cut >= 0 else data[:-1]
    with pytest.raises(TruncatedChunkError):
        KVChunk.from_bytes(data)


def test_bad_checksum():
    data = bytearray(make_chunk().to_bytes())
    data[-5] ^= 0xFF
    with pytest.raises(ChecksumError):
        KVChunk.from_bytes(bytes(data))


def version1_frame(payload: bytes) -> bytes:
    """A frame as cag wrote them before frame version 2: a 32-byte SHA-256 where XXH3-128 is now."""
    return struct.pack("<8sQ32s", b"CAGKV\x00\x01\x00", len(payload), hashlib.sha256(payload).digest()) + payload


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_version1_frames_are_read_as_they_were(dtype):
    """Stores written before the XXH3 frame keep working, unchanged: same tensors, same checks."""
    new = make_chunk().to_bytes(dtype)
    assert new[:8] == b"CAGKV\x00\x02\x00" and kv._unframe_at(new)[1] == kv._HEADER.size == 32
    payload = new[kv._HEADER.size:]
    old = version1_frame(payload)
    a, b = KVChunk.from_bytes(new), KVChunk.from_bytes(old)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)
    assert read_metadata(old) == read_metadata(new)
    corrupt = bytearray(old)
    corrupt[-5] ^= 0xFF
    with pytest.raises(ChecksumError):
        KVChunk.from_bytes(bytes(corrupt))
    for cut in (5, 40, len(old) - 1):
        with pytest.raises(TruncatedChunkError):
            KVChunk.from_bytes(old[:cut])


def test_a_frame_version_this_cag_does_not_read_is_named():
    data = bytearray(make_chunk().to_bytes())
    data[6] = 9
    with pytest.raises(ChunkFormatError, match="frame version 9"):
        KVChunk.from_bytes(bytes(data))


def test_not_a_chunk():
    with pytest.raises(ChunkFormatError, match="not a cag chunk"):
        KVChunk.from_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ChunkFormatError, match="is bytes"):
        KVChunk.from_bytes("a string")  # type: ignore[arg-type]
    with pytest.raises(ChunkFormatError, match="trailing"):
        KVChunk.from_bytes(make_chunk().to_bytes() + b"x")


def test_payload_not_safetensors():
    with pytest.raises(ChunkFormatError, match="safetensors"):
        KVChunk.from_bytes(frame(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"))


def test_other_model_refused():
    other = ModelFingerprint("qwen2", "c" * 64, "t" * 64, "v" * 64, 2, 3, 4, name="other")
    with pytest.raises(ForeignModelError, match="fake"):
        KVChunk.from_bytes(make_chunk().to_bytes(), expect_model=other)


def test_wrong_shapes():
    chunk = make_chunk()
    bad = {"keys": chunk.keys.to(torch.bfloat16), "values": chunk.values[:, :, :3].to(torch.bfloat16),
           "token_ids": chunk.token_ids, "offsets": chunk.offsets}
    with pytest.raises(ChunkFormatError, match="share one"):
        KVChunk.from_bytes(frame(payload_with(bad)))
    geometry = dict(bad, values=chunk.values.to(torch.bfloat16), keys=chunk.keys.to(torch.bfloat16))
    with pytest.raises(ChunkFormatError, match="geometry"):
        KVChunk.from_bytes(frame(payload_with(geometry, {"model": dict(FP.to_dict(), head_dim=8)})))
    ids = dict(geometry, token_ids=torch.arange(4))
    with pytest.raises(ChunkFormatError, match="token_ids"):
        KVChunk.from_bytes(frame(payload_with(ids)))
    with pytest.raises(ChunkFormatError, match="lacks tensors"):
        KVChunk.from_bytes(frame(payload_with(drop=("offsets",))))


def test_unknown_dtype():
    with pytest.raises(UnknownDtypeError):
        KVChunk.from_bytes(frame(payload_with(meta_overrides={"dtype": "int8"})))
    chunk = make_chunk()
    f64 = {"keys": chunk.keys.double(), "values": chunk.values.double(), "token_ids": chunk.token_ids,
           "offsets": chunk.offsets}
    with pytest.raises(UnknownDtypeError):
        KVChunk.from_bytes(frame(payload_with(f64)))
    with pytest.raises(UnknownDtypeError):
        chunk.to_bytes("int4")


def test_bad_metadata():
    with pytest.raises(ChunkFormatError, match="version"):
        KVChunk.from_bytes(frame(payload_with(meta_overrides={"format_version": 99})))
    with pytest.raises(ChunkFormatError, match="fingerprint"):
        KVChunk.from_bytes(frame(payload_with(meta_overrides={"model": {"family": "llama"}})))
    with pytest.raises(ChunkFormatError, match="text hash"):
        KVChunk.from_bytes(frame(payload_with(meta_overrides={"text_hash": None})))
    chunk = make_chunk()
    no_meta = st_save({"keys": chunk.keys, "values": chunk.values, "token_ids": chunk.token_ids,
                       "offsets": chunk.offsets})
    with pytest.raises(ChunkFormatError, match="metadata"):
        KVChunk.from_bytes(frame(no_meta))


def test_fingerprint_identity_ignores_display_name():
    renamed = ModelFingerprint(**dict(FP.to_dict(), name="renamed"))
    assert renamed.id == FP.id
    assert ModelFingerprint(**dict(FP.to_dict(), weights_hash="x" * 64)).id != FP.id
