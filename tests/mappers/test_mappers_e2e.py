"""Ridge and latent mappers between tiny models of different families and tokenizers."""

import json

import pytest
import torch

from cag.kv import KVChunk
from mappers.base import (MapperArtifactError, MapperMismatchError, TextMismatchError,
                          available_methods, load_mapper, mapper_class)
from mappers.fit import accumulate_statistics, fit_mapper, split_texts
from mappers.identity import IdentityMapper
from mappers.ridge import RidgeMapper

METHODS = ["ridge", "latent"]


@pytest.fixture(scope="module", params=METHODS)
def fitted(request, llama, gemma2tok, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    settings = {"rank": 8} if request.param == "latent" else None
    mapper = fit_mapper(llama, gemma2tok, request.param, texts, out, settings=settings,
                        heldout_fraction=0.25, batch_size=3, progress=False, fidelity_texts=2)
    return mapper, out


def test_registry():
    assert available_methods() == ["bottleneck", "heterofold", "identity", "latent", "mot", "ridge"]
    with pytest.raises(Exception, match="unknown mapper method"):
        mapper_class("nope")


def test_fit_translate_generate(fitted, llama, gemma2tok, texts):
    mapper, out = fitted
    text = texts[0]
    chunk = llama.prefill(text)
    tr = mapper.translate(chunk, text, gemma2tok)
    ids, offsets = gemma2tok.tokenize(text)
    fp = gemma2tok.fingerprint
    assert tr.model.id == fp.id
    assert tr.keys.shape == (fp.num_layers, fp.num_kv_heads, ids.numel(), fp.head_dim)
    assert tr.values.shape == tr.keys.shape
    assert torch.equal(tr.token_ids, ids) and torch.equal(tr.offsets, offsets)
    assert tr.text_hash == chunk.text_hash
    assert torch.isfinite(tr.keys).all() and torch.isfinite(tr.values).all()
    assert ids.numel() != chunk.num_tokens or not torch.equal(ids, chunk.token_ids)
    # round trip through bytes, as a store would
    tr = KVChunk.from_bytes(tr.to_bytes("float32"), expect_model=fp)
    prefix = gemma2tok.prefix_chunk()
    cache = gemma2tok.build_cache([prefix, tr])
    question = gemma2tok.tokenize(" The fox")[0]
    input_ids = torch.cat([gemma2tok.context_ids([prefix, tr]), question])[None]
    gen = gemma2tok.model.generate(input_ids=input_ids, past_key_values=cache, max_new_tokens=4,
                                   do_sample=False, pad_token_id=gemma2tok.tokenizer.pad_token_id)
    assert gen.shape[1] == input_ids.shape[1] + 4
    # batched translation equals one by one
    batch = mapper.translate_batch([chunk, llama.prefill(texts[1])], [text, texts[1]], gemma2tok)
    assert torch.allclose(batch[0].keys, tr.keys, atol=1e-2)


def test_card_and_fidelity(fitted):
    mapper, out = fitted
    card = json.loads((out / "card.json").read_text())
    assert card["method"] == mapper.method
    assert card["source"]["family"] == "llama" and card["target"]["family"] == "gemma3"
    assert card["fitted_on"]["train_tokens"] > 100 and card["fitted_on"]["texts_sha256"]
    assert card["fit_seconds"] > 0
    held = card["fidelity"]["heldout"]
    for key in ("key_r2_per_layer", "value_r2_per_layer", "attn_cos_per_layer", "kl", "top1",
                "kl_no_context", "key_spread_ratio_per_layer"):
        assert key in held
    assert len(held["key_r2_per_layer"]) == 4
    assert all(-1.0 <= c <= 1.0 for c in held["attn_cos_per_layer"])
    assert held["kl"] >= -1e-6
    assert not (out / "fit_state").exists()
    stats = card["fidelity"]["stats"]["keys"]
    assert stats["heldout_r2"] > 0.0  # better than predicting the mean


def test_save_load_round_trip(fitted, llama, gemma2tok, texts, tmp_path):
    mapper, out = fitted
    loaded = load_mapper(out, source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert type(loaded) is type(mapper) and loaded.settings == mapper.settings
    assert loaded.fidelity == json.loads(json.dumps(mapper.fidelity))
    chunk = llama.prefill(texts[2])
    a = mapper.translate(chunk, texts[2], gemma2tok)
    b = loaded.translate(chunk, texts[2], gemma2tok)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    again = loaded.save(tmp_path / "again")
    assert load_mapper(again).artifact_id == mapper.artifact_id
    # class-bound load checks the method
    with pytest.raises(MapperArtifactError):
        (RidgeMapper if mapper.method == "latent" else mapper_class("latent")).load(out)


def test_corrupted_artifacts(fitted, tmp_path):
    mapper, _ = fitted
    folder = mapper.save(tmp_path / "m")
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(MapperArtifactError, match="checksum"):
        load_mapper(folder)
    weights.unlink()
    with pytest.raises(MapperArtifactError, match="missing"):
        load_mapper(folder)
    with pytest.raises(MapperArtifactError, match="not a mapper"):
        load_mapper(tmp_path / "nowhere")
    (folder / "card.json").write_text("{not json")
    with pytest.raises(MapperArtifactError):
        load_mapper(folder)


def test_wrong_pair_and_source(fitted, llama, qwen, gemma2tok, texts):
    mapper, out = fitted
    text = texts[0]
    with pytest.raises(MapperMismatchError, match="chunk was computed by"):
        mapper.translate(qwen.prefill(text), text, gemma2tok)
    with pytest.raises(MapperMismatchError, match="translates into"):
        mapper.translate(llama.prefill(text), text, qwen)
    with pytest.raises(TextMismatchError):
        mapper.translate(llama.prefill(text), texts[1], gemma2tok)
    with pytest.raises(MapperMismatchError):
        load_mapper(out, source=qwen.fingerprint)
    with pytest.raises(MapperMismatchError):
        load_mapper(out, target=llama.fingerprint)


def test_identity(llama, qwen, texts, tmp_path):
    m = IdentityMapper(llama.fingerprint)
    chunk = llama.prefill(texts[0])
    assert m.translate(chunk, texts[0], llama) is chunk
    with pytest.raises(MapperMismatchError):
        IdentityMapper(llama.fingerprint, qwen.fingerprint)
    with pytest.raises(MapperMismatchError):
        m.translate(qwen.prefill(texts[0]), texts[0], llama)
    loaded = load_mapper(m.save(tmp_path / "id"))
    assert isinstance(loaded, IdentityMapper) and loaded.source == llama.fingerprint


class Interrupt(Exception):
    pass


def test_resume_after_interruption(llama, gemma2tok, texts, tmp_path):
    mapper = RidgeMapper(llama.fingerprint, gemma2tok.fingerprint)
    ref = accumulate_statistics(llama, gemma2tok, mapper, texts, tmp_path / "ref",
                                heldout_fraction=0.25, batch_size=2, checkpoint_every=1, progress=False)

    def boom(i):
        if i == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        accumulate_statistics(llama, gemma2tok, mapper, texts, tmp_path / "run", heldout_fraction=0.25,
                              batch_size=2, checkpoint_every=1, progress=False, on_batch=boom)
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert 0 < len(progress["done"]) < len(texts)
    seen = []
    resumed = accumulate_statistics(llama, gemma2tok, mapper, texts, tmp_path / "run",
                                    heldout_fraction=0.25, batch_size=2, checkpoint_every=1,
                                    progress=False, on_batch=seen.append)
    assert len(seen) == (len(texts) - len(progress["done"]) + 1) // 2  # only the rest was prefilled
    for split in ("train", "heldout"):
        for kind in ("keys", "values"):
            a, b = getattr(ref, split)[kind], getattr(resumed, split)[kind]
            assert a.count == b.count > 0
            assert a.equal(b, rtol=1e-9, atol=1e-9)
    # another configuration does not resume from this state
    other = RidgeMapper(llama.fingerprint, gemma2tok.fingerprint, {"layer_radius": 0})
    fresh = accumulate_statistics(llama, gemma2tok, other, texts[:2], tmp_path / "run",
                                  heldout_fraction=0.0, progress=False)
    assert len(fresh.done) == 2


def test_split_is_deterministic(texts):
    a = split_texts(texts, 0.25)
    b = split_texts(list(reversed(texts)), 0.25)
    assert set(a[0]) == set(b[0]) and set(a[1]) == set(b[1]) and a[1]


def test_no_source_tokens_get_target_mean(fitted, llama, gemma2tok, texts):
    from mappers.linear import unflatten_heads
    from mappers.token_alignment import align_tokens

    mapper, _ = fitted
    text = texts[5]
    chunk = llama.prefill(text)
    tr = mapper.translate(chunk, text, gemma2tok)
    has = align_tokens(chunk.offsets, tr.offsets).has_source
    assert (~has).any()  # this pair really has target tokens with no admissible source
    mean = unflatten_heads(mapper.y_mean["keys"][:, None, :].to(mapper.compute_dtype).float(),
                           gemma2tok.fingerprint.num_kv_heads)
    assert torch.allclose(tr.keys[:, :, ~has], mean.expand(-1, -1, int((~has).sum()), -1))


def test_token_window_and_fp32(llama, gemma2tok, texts, tmp_path):
    settings = {"token_window": 2, "layer_radius": 0, "compute_dtype": "float32"}
    mapper = fit_mapper(llama, gemma2tok, "ridge", texts, tmp_path, settings=settings,
                        heldout_fraction=0.25, progress=False, fidelity_texts=0)
    assert mapper.num_features == 2 * 1 * llama.fingerprint.num_kv_heads * llama.fingerprint.head_dim
    tr = mapper.translate(llama.prefill(texts[3]), texts[3], gemma2tok)
    assert tr.keys.dtype == torch.float32 and tr.keys.shape[0] == gemma2tok.fingerprint.num_layers
    assert load_mapper(tmp_path).num_features == mapper.num_features


def test_identity_fit_and_harness_sanity(qwen, texts, tmp_path):
    """The native chunk cache through the fidelity harness: R² 1, cosine 1, KL ~0, top-1 1."""
    m = fit_mapper(qwen, qwen, "identity", texts, tmp_path, heldout_fraction=0.25, progress=False,
                   fidelity_texts=2)
    held = m.fidelity["heldout"]
    assert held["key_r2"] > 0.9999 and held["value_r2"] > 0.9999
    assert held["attn_cos"] > 0.9999
    assert abs(held["kl"]) < 1e-3 and held["top1"] == 1.0
    assert held["kl_no_context"] > held["kl"]
    assert isinstance(load_mapper(tmp_path), IdentityMapper)
