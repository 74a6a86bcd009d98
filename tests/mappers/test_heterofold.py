"""HeteroFold: recoloring, folding, calibration, and the training loop it runs on."""

import pytest
import torch

from mappers.base import load_mapper
from mappers.fit import fit_mapper
from mappers.heterofold import HeteroFoldMapper, gaussian_transport
from mappers.linear import KINDS, unflatten_heads
from mappers.ridge import RidgeMapper
from mappers.stats import MomentAccumulator
from mappers.training import TrainConfig, TrainingInterrupted, train

SMALL = {"calib_steps": 12, "calib_texts": 6, "calib_heldout_texts": 2, "calib_eval_every": 4,
         "calib_accumulate": 2, "calib_rank": 4, "calib_lr": 1e-2, "calib_patience": 0}


def _random_cov(d, gen):
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    return a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)


def test_gaussian_transport_matches_target_moments():
    gen = torch.Generator().manual_seed(0)
    d, n = 6, 200_000
    src_cov, tgt_cov = _random_cov(d, gen), _random_cov(d, gen)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(src_cov).T
    a = gaussian_transport(src_cov, tgt_cov, eps=0.0)
    assert torch.allclose(a, a.T)                                      # symmetric
    assert torch.linalg.eigvalsh(a).min() > 0                           # positive definite
    assert torch.allclose(a.T @ src_cov @ a, tgt_cov, atol=1e-8)       # exact in the moments
    y = x @ a
    emp = torch.cov(y.T)
    assert torch.allclose(emp, tgt_cov, rtol=0.05, atol=0.02)           # and on samples


def test_recolor_restores_each_heads_covariance(llama, gemma2tok):
    # Statistics of a noisy linear relation: ridge shrinks, recoloring restores.
    gen = torch.Generator().manual_seed(1)
    mapper = HeteroFoldMapper(llama.fingerprint, gemma2tok.fingerprint, {"lambdas": [3.0]})
    acc = {k: MomentAccumulator(mapper.target.num_layers, mapper.num_features, mapper.num_outputs) for k in KINDS}
    L, Fdim, D = mapper.target.num_layers, mapper.num_features, mapper.num_outputs
    true_w = torch.randn(L, Fdim, D, generator=gen) / Fdim ** 0.5
    for _ in range(4):
        x = torch.randn(L, 500, Fdim, generator=gen)
        y = torch.bmm(x, true_w) + 0.7 * torch.randn(L, 500, D, generator=gen)
        for kind in KINDS:
            acc[kind].update(x, y)
    ridge = RidgeMapper(llama.fingerprint, gemma2tok.fingerprint, {"lambdas": [3.0]})
    ridge.fit_from_stats(acc, acc)
    report = mapper.fit_from_stats(acc, acc)
    cxx, _, cyy = acc["keys"].centered()
    for w_name, w in (("ridge", ridge.weight["keys"]), ("heterofold", mapper.weight["keys"])):
        pred = w.double().transpose(1, 2) @ cxx @ w.double()
        ratio = torch.diagonal(pred, dim1=1, dim2=2).sum(-1) / torch.diagonal(cyy, dim1=1, dim2=2).sum(-1)
        if w_name == "ridge":
            assert (ratio < 0.9).all()
        else:
            assert torch.allclose(pred, cyy, rtol=1e-3, atol=1e-3 * float(cyy.abs().max()))
    assert report["keys"]["recolor"]["spread_after"] == pytest.approx(1.0, abs=1e-3)
    assert report["keys"]["recolor"]["spread_before"] < 0.95


def test_folded_map_equals_unfolded_chain(llama, gemma2tok):
    gen = torch.Generator().manual_seed(2)
    mapper = HeteroFoldMapper(llama.fingerprint, gemma2tok.fingerprint)
    L, Fdim, D, r = mapper.target.num_layers, mapper.num_features, mapper.num_outputs, 3
    base_w = {k: torch.randn(L, Fdim, D, generator=gen) for k in KINDS}
    mapper.weight = {k: v.clone() for k, v in base_w.items()}
    mapper.x_mean = {k: torch.randn(L, Fdim, generator=gen) for k in KINDS}
    mapper.y_mean = {k: torch.randn(L, D, generator=gen) for k in KINDS}
    y_mean0 = {k: v.clone() for k, v in mapper.y_mean.items()}
    params = {}
    for k in KINDS:
        params[f"{k}.scale"] = 1 + 0.1 * torch.randn(L, D, generator=gen)
        params[f"{k}.u"] = torch.randn(L, D, r, generator=gen)
        params[f"{k}.v"] = 0.1 * torch.randn(L, r, D, generator=gen)
        params[f"{k}.bias"] = torch.randn(L, D, generator=gen)
    x = torch.randn(L, 7, Fdim, generator=gen)
    # unfolded: the calibration's own forward on the recoloured base prediction
    base = {k: torch.bmm(x - mapper.x_mean[k][:, None], base_w[k]) for k in KINDS}
    item = {"base": base, "has_source": torch.ones(7, dtype=torch.bool)}
    unfolded = mapper._corrected(item, params)
    mapper._fold(params)
    for k in KINDS:
        folded = torch.bmm(x - mapper.x_mean[k][:, None], mapper.weight[k]) + mapper.y_mean[k][:, None]
        assert torch.allclose(unflatten_heads(folded, mapper.target.num_kv_heads), unfolded[k],
                              rtol=1e-4, atol=1e-3)
        assert not torch.equal(mapper.y_mean[k], y_mean0[k])


@pytest.fixture(scope="module")
def fitted_hf(llama, gemma2tok, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("heterofold")
    mapper = fit_mapper(llama, gemma2tok, "heterofold", texts, out, settings=SMALL, heldout_fraction=0.25,
                        batch_size=4, progress=False, fidelity_texts=2)
    return mapper, out


def test_calibration_lowers_its_loss_and_ships_as_ridge_tensors(fitted_hf, llama, gemma2tok, texts):
    mapper, out = fitted_hf
    cal = mapper.fidelity["calibration"]
    history = [h["heldout"] for h in cal["history"]]
    assert cal["best_heldout"] < history[0]  # the step-0 evaluation is the uncalibrated map
    assert cal["last_loss"] < cal["first_loss"]
    reloaded = load_mapper(out)
    assert isinstance(reloaded, HeteroFoldMapper)
    ridge_names = set(RidgeMapper(llama.fingerprint, gemma2tok.fingerprint)._weight_names())
    assert set(reloaded._weight_names()) == ridge_names
    chunk = llama.prefill(texts[0])
    a = mapper.translate(chunk, texts[0], gemma2tok)
    b = reloaded.translate(chunk, texts[0], gemma2tok)
    assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)


def test_calibration_resumes_step_for_step(llama, gemma2tok, texts, tmp_path):
    settings = {**SMALL, "calib_checkpoint_every": 1}
    whole = fit_mapper(llama, gemma2tok, "heterofold", texts, tmp_path / "whole", settings=settings,
                       heldout_fraction=0.25, progress=False, fidelity_texts=0)

    def crash(step):
        if step == 5:
            raise TrainingInterrupted("simulated crash")

    with pytest.raises(TrainingInterrupted):
        fit_mapper(llama, gemma2tok, "heterofold", texts, tmp_path / "resumed", settings=settings,
                   heldout_fraction=0.25, progress=False, fidelity_texts=0, on_step=crash)
    resumed = fit_mapper(llama, gemma2tok, "heterofold", texts, tmp_path / "resumed", settings=settings,
                         heldout_fraction=0.25, progress=False, fidelity_texts=0)
    assert resumed.fidelity["calibration"]["steps"] == whole.fidelity["calibration"]["steps"]
    for kind in KINDS:
        assert torch.equal(resumed.weight[kind], whole.weight[kind])
        assert torch.equal(resumed.y_mean[kind], whole.y_mean[kind])


# ------------------------------------------------------------ the training loop


def _quadratic(seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(5, generator=gen)
    data = torch.randn(16, 5, generator=gen)
    w = torch.zeros(5, requires_grad=True)

    def step_loss(step, micro):
        row = data[(step * 2 + micro) % 16]
        return ((w - target - 0.1 * row) ** 2).sum()

    return w, step_loss, target


def test_train_lowers_loss_and_restores_best():
    w, step_loss, target = _quadratic()
    held = lambda: float(((w.detach() - target) ** 2).sum())
    report = train({"w": w}, step_loss, config=TrainConfig(steps=60, lr=0.1, accumulate=2, eval_every=5,
                                                            patience=0), heldout_loss=held, progress=False)
    assert report["last_loss"] < report["first_loss"]
    assert report["best_heldout"] == pytest.approx(held())  # the parameters kept are the best seen
    assert report["best_heldout"] < report["history"][0]["heldout"]


def test_train_resume_equals_uninterrupted(tmp_path):
    config = TrainConfig(steps=20, lr=0.05, accumulate=2, eval_every=4, patience=0, checkpoint_every=1)
    w1, loss1, target = _quadratic()
    train({"w": w1}, loss1, config=config, heldout_loss=lambda: float(((w1 - target) ** 2).sum()),
          checkpoint_dir=tmp_path / "a", config_id="x", progress=False)
    w2, loss2, _ = _quadratic()

    def crash(step):
        if step == 7:
            raise TrainingInterrupted("crash")

    with pytest.raises(TrainingInterrupted):
        train({"w": w2}, loss2, config=config, heldout_loss=lambda: float(((w2 - target) ** 2).sum()),
              checkpoint_dir=tmp_path / "b", config_id="x", progress=False, on_step=crash)
    w3, loss3, _ = _quadratic()
    report = train({"w": w3}, loss3, config=config, heldout_loss=lambda: float(((w3 - target) ** 2).sum()),
                   checkpoint_dir=tmp_path / "b", config_id="x", progress=False)
    assert report["steps"] == 20
    assert torch.equal(w3.detach(), w1.detach())
    # another configuration id does not resume
    w4, loss4, _ = _quadratic()
    r4 = train({"w": w4}, loss4, config=TrainConfig(steps=3, lr=0.05, eval_every=0, patience=0),
               checkpoint_dir=tmp_path / "b", config_id="y", progress=False)
    assert r4["steps"] == 3


def test_train_early_stops_and_time_budget():
    w, step_loss, target = _quadratic()
    # a held-out loss that only gets worse: stops after `patience` evaluations
    calls = []

    def worse():
        calls.append(1)
        return float(len(calls))

    report = train({"w": w}, step_loss, config=TrainConfig(steps=100, lr=0.1, eval_every=2, patience=2),
                   heldout_loss=worse, progress=False)
    assert report["stop"] == "early" and report["steps"] == 4
    assert torch.equal(w.detach(), torch.zeros(5))  # best = the first evaluation, before any step
    w2, loss2, _ = _quadratic()
    r = train({"w": w2}, loss2, config=TrainConfig(steps=10_000, lr=0.1, max_seconds=0.0), progress=False)
    assert r["stop"] == "time" and r["steps"] == 0


def test_train_refuses_non_leaf_and_non_finite():
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        train({"w": w * 2}, lambda s, m: w.sum(), config=TrainConfig(steps=1), progress=False)
    with pytest.raises(FloatingPointError):
        train({"w": w}, lambda s, m: (w * float("nan")).sum(), config=TrainConfig(steps=1), progress=False)


# --------------------------------------------------- target-token features (direct path)


@pytest.mark.parametrize("fixture", ["llama", "qwen", "gemma2tok"])
def test_direct_path_is_exact_at_layer_zero(fixture, request, texts):
    """Layer 0's K/V of a token depend on that token alone: the direct path reproduces them."""
    from mappers.linear import direct_path

    lm = request.getfixturevalue(fixture)
    chunk = lm.prefill(texts[3])
    for kind in KINDS:
        direct = direct_path(lm, chunk.token_ids, kind)
        own = getattr(chunk, kind)[0].permute(1, 0, 2).reshape(chunk.num_tokens, -1).float()
        torch.testing.assert_close(direct[0], own, atol=1e-4, rtol=1e-4)


def test_target_token_window_adds_features_and_fits(llama, gemma2tok, texts, tmp_path):
    mapper = fit_mapper(llama, gemma2tok, "ridge", texts, tmp_path, settings={"target_token_window": 2},
                        heldout_fraction=0.25, progress=False, fidelity_texts=1)
    plain = RidgeMapper(llama.fingerprint, gemma2tok.fingerprint)
    assert mapper.num_features == plain.num_features + 2 * mapper.num_outputs
    reloaded = load_mapper(tmp_path)
    chunk = llama.prefill(texts[0])
    tr = reloaded.translate(chunk, texts[0], gemma2tok)
    assert torch.isfinite(tr.keys).all() and tr.keys.shape[2] == gemma2tok.tokenize(texts[0])[0].numel()


def test_quote_continuation_repeats_a_span_of_the_context():
    from mappers.heterofold import quote_continuation

    context = " ".join(f"w{i}" for i in range(60))
    quote = quote_continuation(context, "fallback")
    span = quote.removeprefix(" As it says: ")
    assert span in context and len(span.split()) == 16
    assert quote_continuation(context, "fallback") == quote            # deterministic
    assert quote_continuation("too short", "fallback") == "fallback"
