"""The fast query path equals the one it replaced, bit for bit, on the tiny models.

Each test keeps the replaced code as a reference, written as it was (concatenations,
the rotary module called per rotation, `safetensors.torch.load` on a copied payload),
and compares: cached cos/sin tables, rotation in place, assembly into one buffer,
zero-copy chunk decoding, and translation batched over the chunks of one query.
"""

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from transformers import DynamicCache

from cag import kv
from cag.assembler import Assembler
from cag.kv import ChunkError, ChunkFormatError, KVChunk
from cag.prompt import layout_for
from tests.tiny import tiny_loaded

TEXTS = ["Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris.",
         "Cache-augmented generation reuses the keys and values of documents.",
         "Paragraphs end with blank lines.\n\nNew paragraphs begin after them."]
QUESTION = "How many maps does Zorblat keep?"


# ------------------------------------------------------------------ the replaced code


def reference_rotate(adapter, keys, positions, inverse=False):
    """`FamilyAdapter._rotate` as it was: the rotary module per call, all of a group at once."""
    out = torch.empty_like(keys)
    for rope_key, layers in adapter.rope_groups.items():
        cos, sin = adapter._cos_sin(positions, rope_key)
        if inverse:
            norm = cos * cos + sin * sin
            cos, sin = cos / norm, -sin / norm
        index = torch.tensor(layers)
        group = keys.index_select(0, index).float()
        _, rotated = adapter._apply_rope(cos[:, None], group, cos, sin)
        out.index_copy_(0, index, rotated.to(keys.dtype))
    return out


def reference_cache(lm, parts):
    """`Assembler.place` (no recompute) / `LoadedModel.build_cache` as they were."""
    keys = torch.cat([c.keys for c in parts], dim=2).to(lm.dtype)
    values = torch.cat([c.values for c in parts], dim=2).to(lm.dtype)
    keys = reference_rotate(lm.adapter, keys, torch.arange(keys.shape[2]))
    cache = DynamicCache(config=lm.model.config)
    for i in range(lm.adapter.num_layers):
        cache.layers[i].update(keys[i][None], values[i][None])
    return cache


def assert_same_cache(got: DynamicCache, want: DynamicCache):
    assert len(got.layers) == len(want.layers)
    for a, b in zip(got.layers, want.layers):
        assert type(a) is type(b)
        assert a.get_seq_length() == b.get_seq_length()
        assert getattr(a, "cumulative_length", None) == getattr(b, "cumulative_length", None)
        assert a.keys.dtype == b.keys.dtype
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def question_logits(lm, cache, q):
    with torch.inference_mode():
        return lm.model(input_ids=q[None], past_key_values=cache).logits[0]


def bf16(family: str):
    lm = tiny_loaded(family)
    lm.model.to(torch.bfloat16)
    return lm


@pytest.fixture(params=["fp32", "bf16"])
def lm(request, tiny):
    """Each tiny family in fp32 (the shared model) and in bf16 (its own copy)."""
    return tiny if request.param == "fp32" else bf16(tiny.adapter.family)


# ------------------------------------------------------------------ cos/sin tables


def test_cached_cos_sin_equal_the_rotary_module(tiny):
    adapter = tiny.adapter
    adapter._tables.clear()
    for rope_key in adapter.rope_groups:
        for positions in (torch.arange(5), torch.arange(3, 40), torch.tensor([7, 0, 7, 2]),
                          torch.arange(4090, 4096), torch.arange(0)):
            cos, sin = adapter.cos_sin(positions, rope_key)
            want_cos, want_sin = adapter._cos_sin(positions, rope_key)
            assert cos.dtype == want_cos.dtype == torch.float32
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_cos_sin_table_is_computed_once_and_grown_on_demand(tiny, monkeypatch):
    adapter = tiny.adapter
    adapter._tables.clear()
    calls = []
    real = adapter._cos_sin
    monkeypatch.setattr(adapter, "_cos_sin", lambda p, k: calls.append(p.numel()) or real(p, k))
    key = next(iter(adapter.rope_groups))
    for _ in range(3):
        adapter.cos_sin(torch.arange(100), key)
    assert len(calls) == 1  # one table, read three times
    size = calls[0]
    assert size >= 100
    cos, _ = adapter.cos_sin(torch.tensor([size + 4]), key)  # past the table: regrown once
    assert len(calls) == 2 and calls[1] >= size + 5
    assert torch.equal(cos, real(torch.tensor([size + 4]), key)[0])
    adapter.cos_sin(torch.arange(size + 5), key)
    assert len(calls) == 2
    adapter._tables.clear()


def test_dynamic_rope_is_not_cached(tiny, monkeypatch):
    adapter = tiny.adapter
    monkeypatch.setattr(adapter, "_static_rope", False)
    adapter._tables.clear()
    key = next(iter(adapter.rope_groups))
    adapter.cos_sin(torch.arange(10), key)
    assert not adapter._tables


# ------------------------------------------------------------------ rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_in_place_equals_the_old_rotation(tiny, dtype):
    adapter = tiny.adapter
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(adapter.num_layers, adapter.num_kv_heads, 37, adapter.head_dim, generator=g).to(dtype)
    for positions in (torch.arange(37), torch.arange(100, 137)):
        for inverse in (False, True):
            want = reference_rotate(adapter, keys, positions, inverse)
            fn = adapter.derotate if inverse else adapter.rotate
            assert torch.equal(fn(keys, positions), want)
            inplace = keys.clone()
            assert fn(inplace, positions, out=inplace) is inplace
            assert torch.equal(inplace, want)
    with pytest.raises(ValueError, match="out must be"):
        adapter.rotate(keys, torch.arange(37), out=keys[:, :, :5])


# ------------------------------------------------------------------ assembly


def foreign_precision_chunk(lm, chunk: KVChunk) -> KVChunk:
    """The chunk in fp32 with low bits set, as a mapper hands it over: placing it must
    round it to the model's dtype exactly as the concatenation did."""
    g = torch.Generator().manual_seed(1)
    noise = 1e-3 * torch.randn(chunk.keys.shape, generator=g)
    return KVChunk(chunk.keys.float() + noise, chunk.values.float() - noise, chunk.token_ids, chunk.offsets,
                   chunk.text_hash, chunk.model, dict(chunk.settings))


def test_place_equals_the_old_assembly(lm):
    asm = Assembler(lm, layout_for(lm.tokenizer))
    chunks = [lm.prefill(t) for t in TEXTS]
    chunks[1] = foreign_precision_chunk(lm, chunks[1])
    placed = asm.place(chunks)
    want = reference_cache(lm, [asm.prefix(), *chunks])
    assert_same_cache(placed.cache, want)
    if "sliding_attention" in lm.adapter.layer_types:  # the tiny window is shorter than the context
        assert min(layer.keys.shape[-2] for layer in placed.cache.layers) < placed.context_ids.numel()
    q = asm.question_ids(QUESTION)
    assert torch.equal(question_logits(lm, placed.cache, q), question_logits(lm, want, q))


def test_context_attention_places_as_before(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(t) for t in TEXTS]
    parts = [asm.prefix(), *chunks]
    keys = reference_rotate(tiny.adapter, torch.cat([c.keys for c in parts], 2), torch.arange(
        sum(c.num_tokens for c in parts)))
    values = torch.cat([c.values for c in parts], 2)
    q = asm.question_ids(QUESTION)
    want = asm.question_mass(keys, values, keys.shape[2], q)
    assert torch.equal(asm.context_attention(chunks, q), want)


def test_build_cache_equals_the_old_one(lm):
    chunks = [lm.prefix_chunk(), *[lm.prefill(t) for t in TEXTS]]
    chunks[2] = foreign_precision_chunk(lm, chunks[2])
    assert_same_cache(lm.build_cache(chunks), reference_cache(lm, chunks))


# ------------------------------------------------------------------ zero-copy decoding


def payload_of(frame: bytes) -> bytes:
    return frame[kv._HEADER.size:]


def copying_decode(frame: bytes) -> dict[str, torch.Tensor]:
    """What the decoder parsed before: `safetensors.torch.load` on the sliced payload."""
    return st_load(payload_of(frame))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn"])
def test_zero_copy_load_equals_the_copying_load(tiny, fmt):
    chunk = tiny.prefill(TEXTS[0])
    frame = chunk.to_bytes(fmt)
    tensors, header = kv._load_payload(frame, kv._HEADER.size)
    want = copying_decode(frame)
    assert tensors.keys() == want.keys()
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape
        assert torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    assert header["__metadata__"] == json.loads(payload_of(frame)[8:8 + struct.unpack("<Q", payload_of(frame)[:8])[0]])[
        "__metadata__"]
    decoded = KVChunk.from_bytes(frame, expect_model=tiny.fingerprint)
    if fmt in ("float32", "bfloat16", "float16"):
        # no copy: the tensors lie inside the frame's own bytes
        base = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
        for t in (decoded.keys, decoded.values, decoded.token_ids, decoded.offsets):
            assert base <= t.data_ptr() < base + len(frame)
        assert torch.equal(decoded.keys, want["keys"]) and torch.equal(decoded.values, want["values"])


def reframe(payload: bytes) -> bytes:
    return kv._frame(payload)


def edited_payload(edit) -> bytes:
    """A valid payload whose JSON header `edit` changes (the data section kept)."""
    chunk = tiny_loaded("llama").prefill(TEXTS[1])
    payload = payload_of(chunk.to_bytes("bfloat16"))
    (n,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload[8 + n:]


def _set(name, field, value):
    def edit(header):
        header[name][field] = value
    return edit


def _swap_offsets(header):
    header["keys"]["data_offsets"], header["values"]["data_offsets"] = (header["values"]["data_offsets"],
                                                                         header["keys"]["data_offsets"])


MALFORMED = {
    "overlap": _set("values", "data_offsets", [0, 8]),
    "gap": lambda h: h["offsets"].update(data_offsets=[h["offsets"]["data_offsets"][0] + 2,
                                                       h["offsets"]["data_offsets"][1] + 2]),
    "short tensor": lambda h: h["keys"].update(shape=[h["keys"]["shape"][0] - 1, *h["keys"]["shape"][1:]]),
    "negative dim": lambda h: h["keys"].update(shape=[-1, *h["keys"]["shape"][1:]]),
    "float dim": lambda h: h["keys"].update(shape=[float(h["keys"]["shape"][0]), *h["keys"]["shape"][1:]]),
    "bool offset": _set("token_ids", "data_offsets", [True, 9]),
    "unknown dtype": _set("keys", "dtype", "F4"),
    "no offsets": lambda h: h["keys"].pop("data_offsets"),
    "not a map": lambda h: h.update(keys=[1, 2]),
    "metadata not strings": lambda h: h["__metadata__"].update(n=3),
    "extra data": lambda h: h.pop("offsets"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payloads_are_refused_as_safetensors_refuses_them(case):
    payload = edited_payload(MALFORMED[case])
    with pytest.raises(Exception):  # the library's own parser refuses these bytes too
        st_load(payload)
    with pytest.raises(ChunkFormatError):
        KVChunk.from_bytes(reframe(payload))


def test_swapped_offsets_decode_as_safetensors_decodes_them():
    """Offsets in another order than the names are valid safetensors: the same tensors come out."""
    payload = edited_payload(_swap_offsets)
    want = st_load(payload)
    got, _ = kv._load_payload(payload, 0)
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)


def test_checksum_still_guards_the_zero_copy_load(tiny):
    frame = bytearray(tiny.prefill(TEXTS[0]).to_bytes("bfloat16"))
    frame[-3] ^= 0x10
    with pytest.raises(kv.ChecksumError):
        KVChunk.from_bytes(bytes(frame))
    with pytest.raises(ChunkError):
        KVChunk.from_bytes(memoryview(bytes(frame)))


# ------------------------------------------------------------------ batched translation


def reference_translate(mapper, chunks, texts, target):
    """`LinearKVMapper._translate_batch` as it was: one chunk at a time."""
    from mappers.linear import KINDS, unflatten_heads

    out, dtype = [], mapper.compute_dtype
    for chunk, text in zip(chunks, texts):
        ids, offsets = target.tokenize(text)
        alignment = mapper.align(chunk.offsets, offsets)
        kv_ = {}
        for kind in KINDS:
            x = mapper.features(kind, chunk, alignment, target, ids, dtype=dtype, fill=mapper.x_mean[kind])
            y = mapper.project(kind, x - mapper.x_mean[kind].to(dtype)[:, None, :])
            y = y + mapper.y_mean[kind].to(dtype)[:, None, :]
            if not bool(alignment.has_source.all()):
                y[:, ~alignment.has_source] = mapper.y_mean[kind].to(dtype)[:, None, :]
            kv_[kind] = unflatten_heads(y, mapper.target.num_kv_heads).to(torch.float32)
        out.append(mapper._target_chunk(kv_["keys"], kv_["values"], ids, offsets, chunk, target))
    return out


def random_mapper(method, source, target, settings):
    from mappers.base import mapper_class

    mapper = mapper_class(method)(source.fingerprint, target.fingerprint, settings)
    g = torch.Generator().manual_seed(3)
    names = mapper._weight_names()
    lt, f, d = target.adapter.num_layers, mapper.num_features, mapper.num_outputs
    shapes = {**{f"{k}.x_mean": (lt, f) for k in ("keys", "values")},
              **{f"{k}.y_mean": (lt, d) for k in ("keys", "values")}, **names}
    mapper._load_tensors({n: torch.randn(s, generator=g) / max(s[-2] if len(s) > 2 else 1, 1) ** 0.5
                          for n, s in shapes.items()})
    return mapper


@pytest.mark.parametrize("method,settings", [
    ("ridge", {"compute_dtype": "float32"}),
    ("ridge", {}),  # bf16, the shipped compute dtype
    ("latent", {"rank": 4}),
    ("mot", {"experts": 2, "expert_rank": 4, "token_window": 2}),
    ("ridge", {"target_token_window": 2}),
])
def test_batched_translation_equals_one_chunk_at_a_time(method, settings):
    source, target = tiny_loaded("llama"), tiny_loaded("gemma3")
    mapper = random_mapper(method, source, target, settings)
    chunks = [source.prefill(t) for t in TEXTS]
    got = mapper.translate_batch(chunks, TEXTS, target)
    want = reference_translate(mapper, chunks, TEXTS, target)
    fp32 = mapper.compute_dtype == torch.float32
    for a, b in zip(got, want):
        assert a.keys.dtype == b.keys.dtype == torch.float32 and a.keys.is_contiguous()
        assert torch.equal(a.token_ids, b.token_ids) and a.settings == b.settings
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            if fp32:  # float rounding of one matmul over more rows (no difference seen on this CPU)
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
            else:  # bf16 results: at most one bf16 step apart where the matmul rounds differently
                torch.testing.assert_close(x, y, rtol=2 ** -7, atol=1e-6)
    assert mapper.translate_batch([], [], target) == []


def test_filled_cache_holds_the_placed_tensors_without_a_copy(tiny):
    g = torch.Generator().manual_seed(0)
    shape = (tiny.adapter.num_layers, tiny.adapter.num_kv_heads, 20, tiny.adapter.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    cache = tiny.adapter.fill_cache(keys, values)
    want = DynamicCache(config=tiny.model.config)
    for i in range(tiny.adapter.num_layers):
        want.layers[i].update(keys[i][None], values[i][None])
    assert_same_cache(cache, want)
    for i, layer in enumerate(cache.layers):
        assert layer.keys.untyped_storage().data_ptr() == keys.untyped_storage().data_ptr()
    # a second forward extends the cache as it extends one the model filled itself
    q = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(tiny.model(input_ids=q, past_key_values=cache).logits,
                           tiny.model(input_ids=q, past_key_values=want).logits)
    assert_same_cache(cache, want)


# ------------------------------------------------------------------ grouped heads under a mask


def test_loaded_models_read_grouped_heads_in_place(tiny):
    from cag.models.attention import GQA_SDPA

    assert tiny.model.config._attn_implementation == GQA_SDPA


@pytest.mark.parametrize("what", ["question over a context", "recompute"])
def test_grouped_heads_in_place_equal_transformers_sdpa(lm, what, monkeypatch):
    """The question's forward over a placed context (a mask, several query tokens): `gqa_sdpa_attention`
    gives transformers' sdpa logits and cache, and really takes its own path (no K/V head copied).
    The recompute (with the question in its forward) calls torch's kernel itself under either name."""
    import transformers.integrations.sdpa_attention as sdpa_module

    from cag.models.attention import GQA_SDPA

    asm = Assembler(lm, layout_for(lm.tokenizer))
    chunks = [lm.prefill(t) for t in TEXTS]
    q = asm.question_ids(QUESTION)
    repeats = []
    real_repeat = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda h, n: repeats.append(n) or real_repeat(h, n))

    def run(impl):
        lm.model.set_attn_implementation(impl)
        try:
            with torch.inference_mode():
                if what == "recompute":
                    placed = asm.place(chunks, recompute_ratio=0.5, recompute_select="deviation",
                                       with_question=q)
                    return placed.question_logits[None], placed.cache
                placed = asm.place(chunks)
                return lm.model(input_ids=q[None], past_key_values=placed.cache).logits[0], placed.cache
        finally:
            lm.model.set_attn_implementation(GQA_SDPA)

    want_logits, want_cache = run("sdpa")
    copied = len(repeats)
    got_logits, got_cache = run(GQA_SDPA)
    if what == "question over a context":  # transformers copied the heads; ours did not
        assert copied > 0 and len(repeats) == copied
    assert torch.equal(got_logits, want_logits)
    assert_same_cache(got_cache, want_cache)
