"""Mixture-of-Translators: the routed mixture, its base, the bucketed KL, training and resume."""

import pytest
import torch
import torch.nn.functional as F

from mappers.base import MapperError, load_mapper
from mappers.fidelity import split_continuation
from mappers.fit import fit_mapper
from mappers.heterofold import HeteroFoldMapper
from mappers.linear import KINDS, flatten_heads, gather_features, unflatten_heads
from mappers.mot import MoTMapper, bucket_kl, native_buckets
from mappers.ridge import RidgeMapper
from mappers.token_alignment import align_tokens
from mappers.training import TrainingInterrupted

# train texts 5, held-out 3 (hash split of the first 8); mot_accumulate = 5 makes every
# step see all train items, so the training losses of different steps are comparable
SMALL = {"experts": 2, "expert_rank": 4, "mot_steps": 6, "mot_lr": 1e-2, "mot_accumulate": 5,
         "mot_eval_every": 2, "mot_patience": 0, "mot_checkpoint_every": 1,
         "calib_steps": 2, "calib_texts": 3, "calib_heldout_texts": 1, "calib_eval_every": 1,
         "calib_accumulate": 1, "calib_rank": 2, "calib_patience": 0, "calib_checkpoint_every": 1}
N_TEXTS = 8


def _random_mapper(klass, src, tgt, settings, seed=0, up_zero=False):
    """A mapper of `klass` with random (seeded) means and weights; MoT tensors too when it has them."""
    gen = torch.Generator().manual_seed(seed)
    m = klass(src.fingerprint, tgt.fingerprint, settings)
    L, Fdim, D = m.target.num_layers, m.num_features, m.num_outputs
    tensors = {}
    for kind in KINDS:
        m.x_mean[kind] = torch.randn(L, Fdim, generator=gen)
        m.y_mean[kind] = torch.randn(L, D, generator=gen)
    for name, shape in m._weight_names().items():
        t = torch.randn(shape, generator=gen) / shape[-2] ** 0.5
        tensors[name] = torch.zeros(shape) if up_zero and name.endswith(".up") else t
    m._set_weights(tensors)
    return m


def _by_hand(m, chunk, text, target, kind):
    """Translation of `kind` with one translator, written out: base + (xc D) U + μy."""
    ids, offsets = target.tokenize(text)
    alignment = align_tokens(chunk.offsets, offsets, window=int(m.settings["token_window"]))
    x = gather_features(getattr(chunk, kind).float(), m.layer_index, alignment, fill=m.x_mean[kind])
    xc = x - m.x_mean[kind][:, None, :]
    y = xc @ m.weight[kind] + (xc @ m.mot[f"{kind}.down"][:, 0]) @ m.mot[f"{kind}.up"][:, 0]
    y = y + m.y_mean[kind][:, None, :]
    y[:, ~alignment.has_source] = m.y_mean[kind][:, None, :]
    return unflatten_heads(y, m.target.num_kv_heads)


def test_one_translator_is_that_translator(llama, gemma2tok, texts):
    m = _random_mapper(MoTMapper, llama, gemma2tok, {"experts": 1, "expert_rank": 3, "compute_dtype": "float32"})
    assert m.mot["keys.down"].shape[1] == 1 and m.mot["keys.up"].abs().sum() > 0
    text = texts[2]
    chunk = llama.prefill(text)
    tr = m.translate(chunk, text, gemma2tok)
    for kind in KINDS:
        assert torch.allclose(getattr(tr, kind), _by_hand(m, chunk, text, gemma2tok, kind), atol=1e-4, rtol=1e-4)
    # a mixture of identical translators is that translator, whatever the router says
    two = _random_mapper(MoTMapper, llama, gemma2tok, {"experts": 2, "expert_rank": 3, "compute_dtype": "float32"},
                         seed=1)
    two._set_weights({**{f"{k}.weight": m.weight[k] for k in KINDS},
                      **{f"{k}.{n}": torch.cat([m.mot[f"{k}.{n}"]] * 2, dim=1) for k in KINDS for n in ("down", "up")}})
    two.x_mean, two.y_mean = m.x_mean, m.y_mean
    tr2 = two.translate(chunk, text, gemma2tok)
    assert torch.allclose(tr2.keys, tr.keys, atol=1e-4, rtol=1e-4)
    assert torch.allclose(tr2.values, tr.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("base_class", [RidgeMapper, HeteroFoldMapper])
def test_zero_up_translates_as_its_base(base_class, llama, gemma2tok, texts):
    mot = _random_mapper(MoTMapper, llama, gemma2tok, {}, seed=3, up_zero=True)
    base = base_class(llama.fingerprint, gemma2tok.fingerprint)
    base.x_mean, base.y_mean = dict(mot.x_mean), dict(mot.y_mean)
    base._set_weights({f"{k}.weight": mot.weight[k] for k in KINDS})
    assert mot.mot["keys.router"].abs().sum() > 0           # the router is live, the mixture still adds 0
    chunks = [llama.prefill(t) for t in texts[:3]]
    for a, b in zip(mot.translate_batch(chunks, texts[:3], gemma2tok),
                    base.translate_batch(chunks, texts[:3], gemma2tok)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_bucket_kl_bounds_the_full_kl():
    gen = torch.Generator().manual_seed(0)
    V = 50
    native = 3.0 * torch.randn(7, V, generator=gen)
    other = 3.0 * torch.randn(7, V, generator=gen)
    lp, lq = F.log_softmax(native, -1), F.log_softmax(other, -1)
    full = (lp.exp() * (lp - lq)).sum(-1)
    exact = bucket_kl(*native_buckets(native, V), other)
    assert torch.allclose(exact, full, atol=1e-5)
    assert torch.allclose(bucket_kl(*native_buckets(native, 10 * V), other), full, atol=1e-5)
    previous = torch.zeros(7)
    for k in (1, 5, 20, 49):
        ids, top, rest = native_buckets(native, k)
        assert torch.allclose(torch.cat([top, rest[:, None]], -1).logsumexp(-1), torch.zeros(7), atol=1e-5)
        kl = bucket_kl(ids, top, rest, other)
        assert (kl >= -1e-6).all() and (kl <= full + 1e-5).all()
        assert (kl >= previous - 1e-5).all()                 # finer buckets: a tighter bound
        previous = kl
    # its gradient is finite even without a rest bucket
    logits = other.clone().requires_grad_(True)
    bucket_kl(*native_buckets(native, V), logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_budget_cuts_experts_then_rank(llama, gemma2tok):
    m = MoTMapper(llama.fingerprint, gemma2tok.fingerprint, {"experts": 4, "expert_rank": 16})
    full = m.artifact_bytes(4, 16)
    assert (m.settings["experts"], m.settings["expert_rank"]) == (4, 16)
    cut = MoTMapper(llama.fingerprint, gemma2tok.fingerprint,
                    {"experts": 4, "expert_rank": 16, "max_artifact_mb": (m.artifact_bytes(1, 8) + 1) / 1e6})
    assert (cut.settings["experts"], cut.settings["expert_rank"]) == (1, 8)
    assert cut.artifact_bytes(1, 8) < full
    with pytest.raises(MapperError, match="max_artifact_mb"):
        MoTMapper(llama.fingerprint, gemma2tok.fingerprint, {"max_artifact_mb": m.artifact_bytes(1, 1) / 2e6})


def _fit(llama, gemma2tok, texts, out, on_step=None):
    return fit_mapper(llama, gemma2tok, "mot", texts[:N_TEXTS], out, settings=SMALL, heldout_fraction=0.25,
                      progress=False, fidelity_texts=1, on_step=on_step)


@pytest.fixture(scope="module")
def reference(llama, gemma2tok, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("mot")
    calls = []
    flags = [p.requires_grad for p in gemma2tok.model.parameters()]
    mapper = _fit(llama, gemma2tok, texts, out, on_step=calls.append)
    return mapper, out, len(calls), flags


def test_fit_trains_saves_and_reloads(reference, llama, gemma2tok, texts):
    mapper, out, _, flags = reference
    report = mapper.fidelity["calibration"]
    mot = report["mot"]
    assert report["experts"] == 2 and report["expert_rank"] == 4 and "heterofold" in report
    assert mot["steps"] == SMALL["mot_steps"] and mot["items"] == {"train": 5, "heldout": 3}
    assert mot["last_loss"] < mot["first_loss"]
    assert mot["best_heldout"] < mot["history"][0]["heldout"]
    assert mapper.mot["keys.up"].abs().sum() > 0 and mapper.mot["values.up"].abs().sum() > 0
    # the frozen target: flags as before, no gradient anywhere
    assert [p.requires_grad for p in gemma2tok.model.parameters()] == flags
    assert all(p.grad is None for p in gemma2tok.model.parameters())
    assert all(p.grad is None for p in llama.model.parameters())
    assert not (out / "fit_state").exists()
    loaded = load_mapper(out, source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert isinstance(loaded, MoTMapper) and loaded.settings == mapper.settings
    text = texts[N_TEXTS]
    chunk = llama.prefill(text)
    a, b = mapper.translate(chunk, text, gemma2tok), loaded.translate(chunk, text, gemma2tok)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert "kl" in mapper.fidelity["heldout"]


def test_native_context_replays_the_native_run(reference, llama, gemma2tok, texts):
    """With the target's own K/V as the translation, KL and trajectory losses vanish:
    sink, rotation positions, cache and the stored native run all line up."""
    m = load_mapper(reference[1])
    text = texts[N_TEXTS + 1]
    [item] = m._items(llama, gemma2tok, [text], 1)
    native = gemma2tok.prefill(split_continuation(text, m.settings["continuation_fraction"])[0])
    assert item["T"] == native.num_tokens > 8                 # longer than the sliding window
    translated = {k: v.detach() for k, v in m.mot.items()}
    prefix = m._prefix(gemma2tok)

    def loss(name):
        m.settings.update({"loss_lm": 0.0, "loss_kl": 0.0, "loss_trajectory": 0.0, name: 1.0})
        with torch.no_grad():  # the target's parameters require grad outside a fit
            return float(m._loss(item, translated, gemma2tok, prefix))

    names = ("loss_kl", "loss_trajectory")
    assert all(loss(name) > 1e-4 for name in names)           # the translation is not the target's own
    for kind in KINDS:
        item["base"][kind] = flatten_heads(getattr(native, kind).float())
    item["has"] = torch.zeros_like(item["has"])                # mixture off: exactly the native K/V
    assert all(loss(name) < 1e-5 for name in names)


def test_interrupted_fit_resumes_to_the_same_tensors(reference, llama, gemma2tok, texts, tmp_path):
    mapper, _, calls, flags = reference
    mot_steps = SMALL["mot_steps"]
    stop_at = calls - mot_steps + 3                  # the 3rd MoT step (HeteroFold's steps come first)
    seen = []

    def crash(step):
        seen.append(step)
        if len(seen) == stop_at:
            raise TrainingInterrupted(f"simulated crash after step {step}")

    with pytest.raises(TrainingInterrupted):
        _fit(llama, gemma2tok, texts, tmp_path, on_step=crash)
    assert seen[-1] == 3
    assert (tmp_path / "fit_state" / "mot" / "train_state.safetensors").exists()
    assert [p.requires_grad for p in gemma2tok.model.parameters()] == flags
    assert all(p.grad is None for p in gemma2tok.model.parameters())
    resumed_steps = []
    resumed = _fit(llama, gemma2tok, texts, tmp_path, on_step=resumed_steps.append)
    assert resumed_steps == list(range(4, mot_steps + 1))    # only the MoT steps left
    want, got = mapper.tensors(), resumed.tensors()
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_base_artifact_replaces_the_heterofold_stage(llama, qwen, gemma2tok, texts, tmp_path):
    """A fitted HeteroFold artifact serves as MoT's base; another pair or alignment is refused."""
    hf_settings = {k: v for k, v in SMALL.items() if k.startswith("calib_")}
    hf = fit_mapper(llama, gemma2tok, "heterofold", texts[:N_TEXTS], tmp_path / "hf", settings=hf_settings,
                    heldout_fraction=0.25, progress=False, fidelity_texts=0)
    mot = fit_mapper(llama, gemma2tok, "mot", texts[:N_TEXTS], tmp_path / "mot",
                     settings={**SMALL, "base_artifact": str(tmp_path / "hf")}, heldout_fraction=0.25,
                     progress=False, fidelity_texts=0)
    assert mot.fidelity["calibration"]["heterofold"]["artifact_id"] == hf.artifact_id
    for kind in ("keys", "values"):
        assert torch.equal(mot.weight[kind], hf.weight[kind])
        assert torch.equal(mot.y_mean[kind], hf.y_mean[kind])
    with pytest.raises(MapperError, match="layer_radius"):
        fit_mapper(llama, gemma2tok, "mot", texts[:N_TEXTS], tmp_path / "mot2",
                   settings={**SMALL, "base_artifact": str(tmp_path / "hf"), "layer_radius": 0},
                   heldout_fraction=0.25, progress=False, fidelity_texts=0)
    with pytest.raises(MapperError):
        fit_mapper(qwen, gemma2tok, "mot", texts[:N_TEXTS], tmp_path / "mot3",
                   settings={**SMALL, "base_artifact": str(tmp_path / "hf")}, heldout_fraction=0.25,
                   progress=False, fidelity_texts=0)
