"""Streamed statistics and the ridge/latent solvers on synthetic data with a known map."""

import torch

from cag.kv import ModelFingerprint
from mappers.latent import LatentMapper, cca_latent
from mappers.ridge import RidgeMapper, ridge_path
from mappers.stats import MomentAccumulator


def fp(name, layers, heads, dim):
    return ModelFingerprint(family="llama", config_hash=name, tokenizer_hash="t", weights_hash="w",
                            num_layers=layers, num_kv_heads=heads, head_dim=dim, name=name)


def synthetic(L, n, F, D, noise, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, n, F, generator=g, dtype=torch.float64) * 2 + 0.5
    w = torch.randn(L, F, D, generator=g, dtype=torch.float64)
    b = torch.randn(L, D, generator=g, dtype=torch.float64)
    y = x @ w + b[:, None] + noise * torch.randn(L, n, D, generator=g, dtype=torch.float64)
    return x, y, w, b


def test_streamed_equals_one_shot():
    x, y, _, _ = synthetic(2, 300, 6, 4, 0.1, 0)
    one = MomentAccumulator(2, 6, 4)
    one.update(x, y)
    streamed = MomentAccumulator(2, 6, 4)
    for lo in range(0, 300, 37):
        streamed.update(x[:, lo:lo + 37].float(), y[:, lo:lo + 37].float())
    assert one.equal(streamed, rtol=1e-5, atol=1e-3)  # float32 inputs, float64 sums
    streamed64 = MomentAccumulator(2, 6, 4)
    for lo in range(0, 300, 50):
        streamed64.update(x[:, lo:lo + 50], y[:, lo:lo + 50])
    assert one.equal(streamed64, rtol=1e-10, atol=1e-8)
    # the streamed fit equals a one-shot closed form with centring
    ws, bs = ridge_path(streamed64, [1e-3])
    for l in range(2):
        xc = x[l] - x[l].mean(0)
        yc = y[l] - y[l].mean(0)
        cxx = xc.T @ xc
        lam = 1e-3 * torch.trace(cxx) / 6
        w = torch.linalg.solve(cxx + lam * torch.eye(6, dtype=torch.float64), xc.T @ yc)
        assert torch.allclose(ws[0, l], w, atol=1e-8)
        assert torch.allclose(bs[0, l], y[l].mean(0) - x[l].mean(0) @ w, atol=1e-8)


def test_sse_matches_direct():
    x, y, _, _ = synthetic(2, 100, 5, 3, 0.5, 1)
    acc = MomentAccumulator(2, 5, 3)
    acc.update(x, y)
    w = torch.randn(2, 5, 3, dtype=torch.float64)
    b = torch.randn(2, 3, dtype=torch.float64)
    direct = ((y - (x @ w + b[:, None])) ** 2).sum(1)
    assert torch.allclose(acc.sse(w, b), direct, rtol=1e-9)
    assert torch.allclose(acc.sst(), ((y - y.mean(1, keepdim=True)) ** 2).sum(1), rtol=1e-9)


def fit_ridge(x, y, xh, yh, heads, dim, lambdas):
    L, _, F = x.shape
    src, tgt = fp("s", 1, 1, F), fp("t", L, heads, dim)
    m = RidgeMapper(src, tgt, {"layer_radius": 0, "lambdas": lambdas})
    train, held = m.new_accumulators(), m.new_accumulators()
    for kind in ("keys", "values"):
        train[kind].update(x, y)
        held[kind].update(xh, yh)
    return m, m.fit_from_stats(train, held)


def test_ridge_recovers_known_map():
    x, y, w, b = synthetic(3, 2000, 8, 4, 0.01, 2)
    xh, yh, _, _ = synthetic(3, 500, 8, 4, 0.01, 3)
    # held-out from the same map
    g = torch.Generator().manual_seed(9)
    xh = torch.randn(3, 500, 8, generator=g, dtype=torch.float64)
    yh = xh @ w + b[:, None]
    m, report = fit_ridge(x, y, xh, yh, heads=2, dim=2, lambdas=[1e-6, 1e-2, 1.0, 100.0])
    assert torch.allclose(m.weight["keys"].double(), w, atol=2e-3)
    bias = m.y_mean["keys"].double() - torch.bmm(m.x_mean["keys"].double()[:, None], m.weight["keys"].double())[:, 0]
    assert torch.allclose(bias, b, atol=2e-3)
    assert report["keys"]["heldout_r2"] > 0.9999
    assert all(l == 1e-6 for row in report["keys"]["lambda"] for l in row)  # no noise: the least shrinkage


def test_lambda_selection_prefers_shrinkage_when_noisy():
    # few rows, many features, strong noise: the held-out error must pick a large λ
    g = torch.Generator().manual_seed(4)
    F, D = 40, 2
    w = 0.05 * torch.randn(1, F, D, generator=g, dtype=torch.float64)
    x = torch.randn(1, 45, F, generator=g, dtype=torch.float64)
    y = x @ w + 1.0 * torch.randn(1, 45, D, generator=g, dtype=torch.float64)
    xh = torch.randn(1, 2000, F, generator=g, dtype=torch.float64)
    yh = xh @ w + 1.0 * torch.randn(1, 2000, D, generator=g, dtype=torch.float64)
    grid = [1e-4, 1e-2, 1.0, 10.0, 100.0]
    _, report = fit_ridge(x, y, xh, yh, heads=1, dim=2, lambdas=grid)
    assert report["keys"]["lambda"][0][0] >= 10.0
    # and the chosen λ is the grid's held-out optimum (checked directly)
    acc_tr, acc_ho = MomentAccumulator(1, F, D), MomentAccumulator(1, F, D)
    acc_tr.update(x, y)
    acc_ho.update(xh, yh)
    ws, bs = ridge_path(acc_tr, grid)
    errs = [float(acc_ho.sse(ws[i], bs[i]).sum()) for i in range(len(grid))]
    assert grid[min(range(len(grid)), key=errs.__getitem__)] == report["keys"]["lambda"][0][0]


def test_latent_low_rank_map():
    # y depends on x only through a rank-2 projection: rank-2 latent recovers it
    g = torch.Generator().manual_seed(5)
    L, n, F, D = 2, 3000, 10, 6
    a = torch.randn(L, F, 2, generator=g, dtype=torch.float64)
    c = torch.randn(L, 2, D, generator=g, dtype=torch.float64)
    x = torch.randn(L, n, F, generator=g, dtype=torch.float64)
    y = x @ a @ c + 0.01 * torch.randn(L, n, D, generator=g, dtype=torch.float64)
    acc = MomentAccumulator(L, F, D)
    acc.update(x, y)
    enc, dec, bias, corr = cca_latent(acc, rank=2, lam=1e-6, target_reg=1e-6)
    assert enc.shape == (L, F, 2) and dec.shape == (L, 2, D)
    assert torch.allclose(enc @ dec, a @ c, atol=5e-3)
    assert bool((corr > 0.99).all())
    src, tgt = fp("s", 1, 1, F), fp("t", L, 2, 3)
    m = LatentMapper(src, tgt, {"layer_radius": 0, "rank": 2})
    tr, ho = m.new_accumulators(), m.new_accumulators()
    for kind in ("keys", "values"):
        tr[kind].update(x, y)
        ho[kind].update(x[:, :500], y[:, :500])
    report = m.fit_from_stats(tr, ho)
    assert report["keys"]["heldout_r2"] > 0.999
