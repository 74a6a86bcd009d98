"""The translation lab's data and fitting machinery (eval/lab)."""

from __future__ import annotations

import pytest
import torch

from eval.lab import data, variants


def _moments(x, y, held_x, held_y):
    train, held = variants.Moments(x.shape[1], y.shape[1]), variants.Moments(x.shape[1], y.shape[1])
    train.add(x, y)
    held.add(held_x, held_y)
    return train, held


def _problem(n=400, f=12, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g) * torch.linspace(0.5, 3, f) + torch.linspace(-1, 1, f)
    w = torch.randn(f, d, generator=g)
    y = x @ w + 0.3 * torch.randn(n, d, generator=g) + 2.0
    return x, y


def test_full_rank_bottleneck_equals_unconstrained_ridge():
    x, y = _problem()
    train, held = _moments(x[:300], y[:300], x[300:], y[300:])
    basis = variants.Basis(train, held)
    lam = 0.1
    w_bottleneck = basis.u.double() @ basis.coefficients(x.shape[1], lam).double()
    # the ridge solved directly on the standardised, centred features
    z = (x[:300].double() - basis.mx) / basis.sd
    cxx = z.T @ z / 300
    cxy = z.T @ (y[:300].double() - basis.my) / 300
    w_ridge = torch.linalg.solve(cxx + lam * basis.tau * torch.eye(x.shape[1], dtype=torch.float64), cxy)
    torch.testing.assert_close(w_bottleneck, w_ridge, rtol=1e-4, atol=1e-5)


def test_heldout_sse_from_moments_equals_the_direct_sum():
    x, y = _problem(seed=1)
    train, held = _moments(x[:300], y[:300], x[300:], y[300:])
    basis = variants.Basis(train, held)
    for rank in (3, 12):
        coef = basis.coefficients(rank, 0.03)
        z = ((x[300:].double() - basis.mx) / basis.sd).float() @ basis.u[:, :rank]
        pred = z @ coef + basis.my.float()
        direct = ((y[300:] - pred) ** 2).sum(0)
        torch.testing.assert_close(basis.heldout_sse(coef), direct, rtol=1e-3, atol=1e-2)


def test_lower_rank_fits_worse_on_train_and_the_full_rank_recovers_the_signal():
    x, y = _problem(n=2000, seed=2)
    train, held = _moments(x[:1800], y[:1800], x[1800:], y[1800:])
    basis = variants.Basis(train, held)
    sse = [float(basis.heldout_sse(basis.coefficients(r, 1e-3)).sum()) for r in (2, 6, 12)]
    assert sse[0] > sse[1] > sse[2]
    r2 = 1 - sse[2] / float(basis.held_sst.sum())
    assert r2 > 0.9


def test_split_target_inverts_target_rows():
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)

    class Chunk:
        pass

    c = Chunk()
    c.keys, c.values = keys, values
    y = data.target_rows(c)
    assert y.shape == (5, 2 * 3 * 2 * 4)
    k2, v2 = data.split_target(y, 3, 2)
    torch.testing.assert_close(k2, keys)
    torch.testing.assert_close(v2, values)


def test_corpus_is_reproducible_from_its_records_and_disjoint_from_the_held_out_essays():
    a, b = data.training_corpus(synthetic_seeds=4), data.training_corpus(synthetic_seeds=4)
    assert [e["sha256"] for e in a] == [e["sha256"] for e in b]
    assert {e["source"] for e in a} == {"essay", "package", "calib-lookup", "calib-needle"}
    held = set(data.held_out_essays())
    assert held and not held & set(data.training_essays())
    assert not any(e["source"] == "essay" and e["name"] in held for e in a)
    # each package window records the distribution and version it came from
    pkg = next(e for e in a if e["source"] == "package")
    assert pkg["name"] and pkg["version"]
    # the lab's lookup items are planted only in held-out essays, tune and test never share an item
    tune, test, codes = (data.lookup_items(s, 3) for s in ("tune", "test", "codes"))
    assert not {i.id for i in tune} & {i.id for i in test}
    assert {i.meta["dataset"] for i in codes} == {"calib-lookup-code-needle"}
    with pytest.raises(ValueError, match="unknown lab split"):
        data.lookup_items("evaluation", 3)
    from eval.datasets import essay_text, normalize_ws
    held_text = " ".join(normalize_ws(essay_text(e)) for e in held)
    for item in tune + test + codes:
        words = item.documents[0].text.split(" ")
        assert " ".join(words[:8]) in held_text or " ".join(words[-8:]) in held_text


def test_variant_names_parse_and_unknown_levers_are_refused():
    with pytest.raises(ValueError, match="do not combine"):
        variants.make("rrr352+match+tok+nat12", None, None, None)
    with pytest.raises(ValueError, match="unknown levers"):
        variants.make("pca256+bogus", None, None, None)
    with pytest.raises(ValueError, match="unknown variant base"):
        variants.make("lasso", None, None, None)


def test_a_shipped_map_takes_native_first_layers_and_nothing_else(monkeypatch):
    from types import SimpleNamespace

    import cag.mapping

    with pytest.raises(ValueError, match="only \\+nat"):
        variants.make("shipped-bottleneck+cal", None, None, None)
    target = SimpleNamespace(fingerprint=SimpleNamespace(num_layers=4))
    with pytest.raises(ValueError, match="4 target layers"):
        variants.make("shipped+nat5", None, None, target)
    translated = torch.ones(4, 2, 3, 8), 2 * torch.ones(4, 2, 3, 8)
    mapper = SimpleNamespace(method="bottleneck", artifact_id="x",
                             translate=lambda chunk, text, tgt: SimpleNamespace(keys=translated[0].clone(),
                                                                                values=translated[1].clone()))
    asked = []
    monkeypatch.setattr(cag.mapping, "resolve_mapper", lambda method, fp, tgt: asked.append(method) or mapper)
    source = SimpleNamespace(fingerprint=None, prefill=lambda text: None)
    item = {"text": "t", "native_keys": torch.zeros(4, 2, 3, 8), "native_values": -torch.ones(4, 2, 3, 8)}
    keys, values = variants.make("shipped-bottleneck+nat3", None, source, target).translate(item, target)
    assert asked == ["bottleneck"]
    assert torch.equal(keys[:3], item["native_keys"][:3]) and torch.equal(values[:3], item["native_values"][:3])
    assert torch.equal(keys[3:], translated[0][3:]) and torch.equal(values[3:], translated[1][3:])
    keys, _ = variants.make("shipped", None, source, target).translate(item, target)
    assert asked[-1] == "auto" and torch.equal(keys, translated[0])


def test_randomized_top_eigenpairs_match_the_full_decomposition():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 60, generator=g) * torch.logspace(1, -1, 60)
    a = x.T @ x / 500
    e, u = variants.top_eigen(a, 10)
    full_e, full_u = torch.linalg.eigh(a.double())
    torch.testing.assert_close(e.double(), full_e.flip(0)[:10], rtol=1e-3, atol=1e-5)
    # same subspace: projections agree
    p1, p2 = u @ u.T, full_u.flip(1)[:, :10].float() @ full_u.flip(1)[:, :10].float().T
    torch.testing.assert_close(p1, p2, atol=1e-3, rtol=1e-3)


def _rrr_problem(seed=4):
    """Features whose high-variance directions do not predict the targets: the case where
    reduced-rank regression and a PCA bottleneck of the same rank part ways."""
    g = torch.Generator().manual_seed(seed)
    n, f, d = 3000, 16, 8
    x = torch.randn(n, f, generator=g) * torch.cat([torch.full((8,), 4.0), torch.full((8,), 0.5)])
    w = torch.zeros(f, d)
    w[8:] = torch.randn(8, d, generator=g) * 4          # the targets depend on the quiet directions only
    y = x @ w + 0.1 * torch.randn(n, d, generator=g)
    return x, y


def test_reduced_rank_regression_of_full_output_rank_is_the_ridge_map():
    x, y = _rrr_problem()
    train, held = _moments(x[:2500], y[:2500], x[2500:], y[2500:])
    basis = variants.Basis(train, held)
    coef = basis.coefficients(x.shape[1], 0.01)
    weights = torch.rand(y.shape[1]) + 0.5
    full, proj, out = variants.reduce_rank(basis, coef, y.shape[1], weights)
    torch.testing.assert_close(full, coef, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(proj @ out, basis.u @ coef, rtol=1e-4, atol=1e-4)


def test_reduced_rank_regression_beats_a_pca_bottleneck_of_the_same_rank():
    x, y = _rrr_problem()
    train, held = _moments(x[:2500], y[:2500], x[2500:], y[2500:])
    basis = variants.Basis(train, held)
    r = 4
    rrr, _, _ = variants.reduce_rank(basis, basis.coefficients(x.shape[1], 1e-3), r, torch.ones(y.shape[1]))
    pca = basis.coefficients(r, 1e-3)
    sse_rrr, sse_pca = float(basis.heldout_sse(rrr).sum()), float(basis.heldout_sse(pca).sum())
    assert sse_rrr < 0.5 * sse_pca
    # and no rank-r map does better on the training rows than the projection of the ridge fit:
    # a random rank-r projection of the same ridge map fits worse
    q = torch.linalg.qr(torch.randn(y.shape[1], r, generator=torch.Generator().manual_seed(0)))[0]
    coef = basis.coefficients(x.shape[1], 1e-3)
    random_r = coef @ q @ q.T

    def train_err(c):
        return float((basis.e[:, None] * (coef - c) ** 2).sum())
    assert train_err(rrr) < train_err(random_r)


def test_output_weights_give_each_layers_keys_and_values_equal_weight():
    class B:
        pass

    b = B()
    b.train_var = torch.cat([torch.full((4,), 100.0), torch.full((4,), 1.0), torch.full((4,), 0.01), torch.full((4,), 4.0)])
    w = variants.output_weights(b, num_layers=2)      # layout: keys of layers 0, 1, then values of 0, 1
    totals = (w ** 2 * b.train_var).reshape(4, 4).sum(-1)
    torch.testing.assert_close(totals, torch.full((4,), 4.0))


def test_query_weighted_output_weights_follow_the_query_energy_and_keep_each_blocks_total():
    class B:
        pass

    b = B()
    b.train_var = torch.cat([torch.full((4,), 100.0), torch.full((4,), 1.0), torch.full((4,), 0.01), torch.full((4,), 4.0)])
    energy = torch.tensor([1.0, 1.0, 9.0, 9.0, 4.0, 4.0, 4.0, 4.0])  # keys of layers 0, 1
    w = variants.output_weights(b, num_layers=2, key_energy=energy)
    totals = (w ** 2 * b.train_var).reshape(4, 4).sum(-1)
    torch.testing.assert_close(totals, torch.full((4,), 4.0))
    torch.testing.assert_close(w[2] / w[0], torch.tensor(3.0))                 # √(9 / 1) within layer 0's keys
    torch.testing.assert_close(w[4:8], torch.full((4,), float(w[4])))          # uniform energy: as unweighted
    torch.testing.assert_close(w[8:], variants.output_weights(b, num_layers=2)[8:])  # values untouched
    with pytest.raises(ValueError, match="needs rrr"):
        variants.make("pca64+qw", None, None, None)


def test_query_energy_is_the_question_queries_pair_energy_per_kv_head(tiny, tmp_path, monkeypatch):
    from cag.assembler import Assembler
    from cag.models.attention import capture_attention
    from cag.prompt import layout_for
    from eval.datasets import Document, QAItem

    items = [QAItem(id=f"q{i}", question=f"Where is the tower number {i}?", answers=("x",),
                    documents=(Document(id=f"d{i}", text=f"The tower number {i} stands by the river."),))
             for i in range(2)]
    monkeypatch.setattr(variants.data, "lookup_items", lambda split, n: items[:n])
    energy = variants.query_energy(tmp_path, tiny, n=2)
    fp = tiny.fingerprint
    assert energy.shape == (fp.num_layers * fp.num_kv_heads * fp.head_dim,)
    e = energy.reshape(fp.num_layers, fp.num_kv_heads, fp.head_dim)
    torch.testing.assert_close(e[..., : fp.head_dim // 2], e[..., fp.head_dim // 2:])  # a rotary pair shares it
    # layer 0, KV head 0, by hand: the mean over its query heads and question tokens of q_c² + q_{c+D/2}², halved
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    qs = []
    for item in items:
        store: dict = {}
        ids = asm.direct_ids([tiny.tokenize(item.documents[0].text)[0]], item.question)
        with torch.inference_mode(), capture_attention(tiny.model, store):
            tiny.model.model(input_ids=ids[None])
        group = store[0][0].shape[0] // fp.num_kv_heads
        qs.append(store[0][0][:group, -asm.question_ids(item.question).numel():].reshape(-1, fp.head_dim))
    q = torch.cat(qs).double()
    half = fp.head_dim // 2
    want = ((q[:, :half] ** 2 + q[:, half:] ** 2).mean(0) / 2).float()
    torch.testing.assert_close(e[0, 0, :half], want, rtol=1e-4, atol=1e-6)
    assert (tmp_path / "stats" / "query_energy-tune2.safetensors").exists()      # cached for the next variant


def test_wide_basis_fits_the_same_reduced_rank_map_as_the_eigenbasis():
    """The Cholesky path (hidden states beside K/V: too wide to eigendecompose in minutes)
    gives the same ridge, held-out error, spread and reduced-rank map as the eigenbasis."""
    x, y = _rrr_problem(seed=5)
    train, held = _moments(x[:2500], y[:2500], x[2500:], y[2500:])
    basis, wide = variants.Basis(train, held), variants.WideBasis(train, held)
    lam = 0.03
    eig_coef, wide_coef = basis.coefficients(x.shape[1], lam), wide.coefficients(x.shape[1], lam)
    torch.testing.assert_close(basis.to_features(eig_coef), wide_coef, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(basis.heldout_sse(eig_coef), wide.heldout_sse(wide_coef), rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(basis.predicted_var(eig_coef), wide.predicted_var(wide_coef), rtol=1e-3, atol=1e-3)
    weights = torch.rand(y.shape[1]) + 0.5
    _, proj_e, out_e = variants.reduce_rank(basis, eig_coef, 3, weights)
    _, proj_w, out_w = variants.reduce_rank(wide, wide_coef, 3, weights)
    torch.testing.assert_close(proj_e @ out_e, proj_w @ out_w, rtol=1e-3, atol=1e-3)
    import pytest

    with pytest.raises(ValueError, match="full-rank ridge only"):
        wide.coefficients(4, lam)


def test_mlp_lever_parses_and_refuses_native_layers():
    with pytest.raises(ValueError, match="do not combine"):
        variants.make("rrr352+match+mlp512+nat12", None, None, None)


def _mlp_rows(n=1200, layers=2, r=6, fdim=4, d_out=4, seed=0):
    """Rows whose residual is products of independent zero-mean inputs: uncorrelated with every input,
    so the best linear map of them is 0 (the linear variant itself); a tenth of the rows are held out."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, r, generator=g)
    f = torch.randn(layers, n, fdim, generator=g)
    res = torch.stack([torch.stack([z[:, 0] * f[i, :, 0], z[:, 1] * f[i, :, 1],
                                    z[:, 2] * z[:, 3], f[i, :, 2] * f[i, :, 3]], -1) for i in range(layers)])
    return {"z": z, "f": f.half(), "r": res[..., :d_out].half(), "held": torch.arange(n) % 10 == 0}


def test_mlp_starts_as_the_linear_variant_and_lowers_the_heldout_error_of_a_nonlinear_residual():
    from eval.lab import nonlinear

    rows = _mlp_rows()
    state, history = nonlinear.fit_mlp(rows, hidden=32, epochs=6, batch=64, lr=1e-2, log=lambda s: None)
    net = nonlinear.PerLayerMLP(2, 10, 32, 4)
    assert torch.equal(net(torch.randn(2, 5, 10)), torch.zeros(2, 5, 4))   # W2 = 0: adds nothing at first
    assert history[0]["epoch"] == 0
    best = min(h["heldout"] for h in history)
    assert best < 0.5 * history[0]["heldout"]          # it learns what no linear map of the inputs can
    assert set(state) >= {"w1", "b1", "w2", "b2", "x_mean", "x_sd"}


def test_lab_results_read_alike_plain_or_gzipped_and_the_report_lists_each_variant_once(tmp_path, monkeypatch):
    import gzip
    import json

    from eval import translation_lab

    folder = tmp_path / "a__b"
    folder.mkdir()
    (folder / "plain.json").write_text(json.dumps({"variant": "plain"}))
    (folder / "packed.json.gz").write_bytes(gzip.compress(json.dumps({"variant": "packed"}).encode()))
    assert translation_lab.read_result(folder / "plain.json") == {"variant": "plain"}
    assert translation_lab.read_result(folder / "packed.json") == {"variant": "packed"}
    assert translation_lab.read_result(folder / "missing.json") is None
    seen = []
    monkeypatch.setattr(translation_lab, "RESULTS", tmp_path)
    monkeypatch.setattr("eval.lab.score.table", lambda rows, s, t: seen.extend(rows) or "table\n")
    translation_lab.main(["--source", "a", "--target", "b", "report"])
    assert sorted(r["variant"] for r in seen) == ["packed", "plain"]
    assert (tmp_path / "a__b.md").read_text() == "table\n"


def test_the_refit_recipe_follows_the_card_in_order():
    from eval.lab import recipe

    assert recipe.lab_variant({"rank": 352, "token_residual": True, "token_window": 2}) == "rrr352+match+tok+cal"
    assert recipe.lab_variant({"rank": 288, "token_residual": True, "token_window": 1}) == "rrr288+match+tok1+cal"
    assert recipe.lab_variant({"rank": 512, "token_residual": False}) == "rrr512+match+cal"
    with pytest.raises(ValueError, match="not a bottleneck"):
        recipe.recipe({"method": "mot"})
    card = {"method": "bottleneck", "source": {"name": "smollm2-135m"}, "target": {"name": "qwen2.5-0.5b"},
            "settings": {"rank": 352, "token_residual": True, "token_window": 2},
            "fitted_on": {"spread_matched": True,
                          "key_correction": {"command": "python eval/fit_key_correction.py --target qwen2.5-0.5b "
                                                        "--lookups 384 --tag .plain"},
                          "repair_key_correction": {"command": "python eval/fit_key_correction.py --target "
                                                               "qwen2.5-0.5b --repair 0.1 --tag .crux"}},
            "fidelity": {"lookup": {"command": "python eval/gate_fidelity.py --sources smollm2-135m --targets "
                                               "qwen2.5-0.5b --methods mot bottleneck --out old"},
                         "lookup_repair": [{"command": "python eval/gate_fidelity.py --methods bottleneck "
                                                       "--repair 0.13 --out old2"}],
                         "rank_key_decay": {"command": "python eval/calibrate_rank_decay.py --targets qwen2.5-0.5b "
                                                       "gemma3-270m --mapper bottleneck"}}}
    steps = [" ".join(s) for s in recipe.recipe(card)]
    lab = "python eval/translation_lab.py --source smollm2-135m --target qwen2.5-0.5b"
    kc = "python eval/fit_key_correction.py --source smollm2-135m --target qwen2.5-0.5b"
    assert steps == [
        f"{lab} build --tokens 300000",
        f"{lab} run --variants rrr352+match+tok+cal --n 40",
        f"{lab} export --variant rrr352+match+tok+cal",
        f"{kc} --lookups 384 --tag .plain", f"{kc} --lookups 384 --tag .plain --export",       # the plain path's first
        f"{kc} --repair 0.1 --tag .crux", f"{kc} --repair 0.1 --tag .crux --export",
        f"{lab} run --variants shipped-bottleneck --n 40 --tag @refit",
        f"{kc} --record-lab eval/results/lab/smollm2-135m__qwen2.5-0.5b/shipped-bottleneck@refit.json",
        "python eval/gate_fidelity.py --sources smollm2-135m --targets qwen2.5-0.5b --methods bottleneck --out "
        "eval/results/gate-refit/smollm2-135m__qwen2.5-0.5b --cards-only",                     # fresh folder
        "python eval/gate_fidelity.py --methods bottleneck --repair 0.13 --out "
        "eval/results/gate-refit/smollm2-135m__qwen2.5-0.5b-repair1 --cards-only",
        "python eval/calibrate_rank_decay.py --targets qwen2.5-0.5b --mapper bottleneck",      # this pair's only
    ]


def test_every_shipped_bottleneck_card_has_a_recipe_of_its_own_rank():
    import json
    from pathlib import Path

    from eval.lab import recipe

    cards = sorted(Path(__file__).resolve().parents[2].glob("mappers/pretrained/*__bottleneck/card.json"))
    assert len(cards) == 6
    for path in cards:
        card = json.loads(path.read_text())
        steps = recipe.recipe(card)
        export = next(s for s in steps if "export" in s and "--variant" in s)
        assert export[export.index("--variant") + 1].startswith(f"rrr{card['settings']['rank']}+")
        assert any("--record-lab" in s for s in steps) and any("gate_fidelity.py" in " ".join(s) for s in steps)
        assert (card["source"]["name"], card["target"]["name"]) in recipe.LAB_TOKENS
    # a correction continued over three fits is replayed fit by fit, each exported before the next starts
    steps = [" ".join(s) for s in recipe.card_recipe(cards[0].parent.parent / "qwen2.5-0.5b__gemma3-270m__bottleneck")]
    fits = [s for s in steps if "fit_key_correction.py" in s and "--record-lab" not in s]
    assert len(fits) == 6 and all(b == a + " --export" for a, b in zip(fits[::2], fits[1::2]))
    assert ".lookups96 " in fits[2] + " " and fits[-1].endswith(".lookups96-essays --export")
