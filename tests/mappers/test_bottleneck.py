"""The bottleneck mapper (all source layers' K and V through one shared per-token bottleneck),
fitted with the translation lab's closed form between tiny models of two families."""

from __future__ import annotations

import pytest
import torch

from eval.lab import data, variants
from mappers.base import MapperArtifactError, load_mapper
from mappers.bottleneck import BottleneckMapper, split_outputs


def _rows(source, target, texts):
    xs, ys = [], []
    for text in texts:
        chunk, native = source.prefill(text), target.prefill(text)
        index, ok = data.aligned(chunk, native)
        xs.append(data.source_kv_features(chunk)[index][ok])
        ys.append(data.target_rows(native)[ok])
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture(scope="module")
def basis(llama, gemma2tok, texts):
    """The lab's full eigenbasis of the tiny pair's rows (the last text held out) and its row count."""
    x, y = _rows(llama, gemma2tok, texts[:-1])
    hx, hy = _rows(llama, gemma2tok, texts[-1:])
    train, held = variants.Moments(x.shape[1], y.shape[1]), variants.Moments(x.shape[1], y.shape[1])
    train.add(x, y)
    held.add(hx, hy)
    return variants.Basis(train, held), train.n


@pytest.fixture(scope="module")
def fitted(basis, llama, gemma2tok):
    variant = variants.LinearVariant(*basis, gemma2tok.fingerprint.head_dim, rank=16, hidden=False,
                                     match=True, key_scale=1.1, native_layers=0)
    return variant, variants.to_mapper(variant, llama, gemma2tok)


def _item(source, target, text):
    chunk, native = source.prefill(text), target.prefill(text)
    index, ok = data.aligned(chunk, native)
    return {"xkv": data.source_kv_features(chunk)[index], "has_source": ok}


def test_runtime_mapper_equals_the_lab_variant_it_was_exported_from(fitted, llama, gemma2tok, texts):
    variant, mapper = fitted
    text = texts[0]
    keys, values = variant.translate(_item(llama, gemma2tok, text), gemma2tok)
    out = mapper.translate(llama.prefill(text), text, gemma2tok)
    # the runtime weights are rounded to fp16; standardisation and spread are folded in
    torch.testing.assert_close(out.keys, keys, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.values, values, rtol=2e-2, atol=2e-2)
    assert out.model.id == gemma2tok.fingerprint.id


def test_batched_translation_equals_one_by_one_and_the_artifact_round_trips(fitted, llama, gemma2tok, texts,
                                                                            tmp_path):
    _, mapper = fitted
    chunks = [llama.prefill(t) for t in texts[:3]]
    batch = mapper.translate_batch(chunks, texts[:3], gemma2tok)
    for chunk, text, got in zip(chunks, texts[:3], batch):
        one = mapper.translate(chunk, text, gemma2tok)
        torch.testing.assert_close(got.keys, one.keys)
    mapper.save(tmp_path / "m")
    loaded = load_mapper(tmp_path / "m", source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert isinstance(loaded, BottleneckMapper)
    again = loaded.translate(chunks[0], texts[0], gemma2tok)
    torch.testing.assert_close(again.keys, batch[0].keys)


def test_spread_matching_restores_the_keys_spread_that_ridge_shrinks(fitted):
    variant, _ = fitted
    d = variant.scale.numel()
    # keys get their spread back (≥ 1 before the global key scale), values are left alone
    assert bool((variant.scale[: d // 2] / 1.1 >= 1 - 1e-4).all())
    assert bool((variant.scale[d // 2:] == 1).all())


def test_wrong_shapes_and_unfitted_mapper_are_refused(llama, gemma2tok, texts):
    m = BottleneckMapper(llama.fingerprint, gemma2tok.fingerprint, {"rank": 4})
    with pytest.raises(MapperArtifactError, match="not fitted"):
        m.translate(llama.prefill(texts[0]), texts[0], gemma2tok)
    with pytest.raises(MapperArtifactError, match="shape"):
        m._load_tensors({"proj": torch.zeros(3, 4), "bias": torch.zeros(4), "coef": torch.zeros(4, 5),
                         "y_mean": torch.zeros(5)})


def test_lookup_calibration_lowers_its_loss_on_a_tiny_pair_and_folds_into_the_map(gemma2tok, texts):
    from eval.lab import calibrate

    target = gemma2tok
    items = [{"text": t, "question": "What follows?", "answers": [t.split()[-1]]} for t in texts[:3]]

    def translate(item):  # a stand-in translation: the native chunk with flattened keys
        native = target.prefill(item["text"])
        return type(native)(native.keys * 0.3, native.values, native.token_ids, native.offsets, native.text_hash,
                            native.model, native.settings)

    log_scale, history = calibrate.fit_log_scales(target, items, translate, epochs=4, lr=0.1)
    assert history[-1] < history[0]
    assert log_scale.shape == (target.fingerprint.num_layers, target.fingerprint.num_kv_heads)
    # folding the scales into a linear map equals scaling its translated keys
    fp = target.fingerprint
    d = fp.num_layers * fp.num_kv_heads * fp.head_dim
    coef, y_mean = torch.randn(5, 2 * d), torch.randn(2 * d)
    z = torch.randn(7, 5)
    folded = calibrate.fold_into(coef, y_mean, log_scale, fp.head_dim)
    keys, values = split_outputs(z @ folded[0] + folded[1], fp.num_layers, fp.num_kv_heads)
    keys0, values0 = split_outputs(z @ coef + y_mean, fp.num_layers, fp.num_kv_heads)
    torch.testing.assert_close(keys, keys0 * torch.exp(log_scale)[:, :, None, None])
    torch.testing.assert_close(values, values0)


@pytest.mark.parametrize("window", [2, 3])
def test_token_residual_and_learned_key_scale_fold_into_the_runtime_mapper(fitted, llama, gemma2tok, texts, window):
    variant, _ = fitted
    fp = gemma2tok.fingerprint
    hd = fp.num_kv_heads * fp.head_dim
    g = torch.Generator().manual_seed(5)
    tok = object.__new__(variants.TokenResidualVariant)
    tok.base, tok.train_rows, tok.sse_drop, tok.window = variant, variant.train_rows, 0.1, window
    tok.w = 0.05 * torch.randn(fp.num_layers, 2 * window * hd, 2 * hd, generator=g)
    tok.mean_f = torch.randn(fp.num_layers, 2 * window * hd, generator=g)
    tok.mean_r = 0.1 * torch.randn(fp.num_layers, 2 * hd, generator=g)
    cal = object.__new__(variants.CalibratedVariant)
    cal.base, cal.train_rows = tok, tok.train_rows
    cal.log_scale, cal.history = 0.3 * torch.randn(fp.num_layers, fp.num_kv_heads, generator=g), [1.0, 0.5]
    mapper = variants.to_mapper(cal, llama, gemma2tok)
    assert mapper.token_residual and mapper.token_window == window
    text = texts[1]
    ids = gemma2tok.tokenize(text)[0]
    item = {**_item(llama, gemma2tok, text), "token_ids": ids}
    keys, values = cal.translate(item, gemma2tok)
    out = mapper.translate(llama.prefill(text), text, gemma2tok)
    torch.testing.assert_close(out.keys, keys, rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(out.values, values, rtol=2e-2, atol=3e-2)


def test_a_reduced_rank_variant_exports_to_the_runtime_mapper_it_scores_as(basis, llama, gemma2tok, texts):
    """The shipped map is a reduced-rank regression: its factors must reach the runtime intact."""
    fp = gemma2tok.fingerprint
    variant = variants.LinearVariant(*basis, fp.head_dim, rank=None, hidden=False,
                                     match=True, key_scale=1.0, native_layers=0, output_rank=8,
                                     num_layers=fp.num_layers)
    assert variant.proj.shape[1] == 8 and variant.coef.shape[0] == 8
    mapper = variants.to_mapper(variant, llama, gemma2tok)
    assert mapper.settings["rank"] == 8
    text = texts[0]
    keys, values = variant.translate(_item(llama, gemma2tok, text), gemma2tok)
    out = mapper.translate(llama.prefill(text), text, gemma2tok)
    torch.testing.assert_close(out.keys, keys, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.values, values, rtol=2e-2, atol=2e-2)


def test_a_retired_artifact_is_refused_with_its_replacement_named(fitted, llama, gemma2tok, tmp_path, monkeypatch):
    import json

    from cag import mapping

    _, mapper = fitted
    mapper.save(tmp_path / "old-copy")
    sha = json.loads((tmp_path / "old-copy" / "card.json").read_text())["weights_sha256"]
    assert mapping.resolve_mapper(str(tmp_path / "old-copy"), llama.fingerprint, gemma2tok).method == "bottleneck"
    entry = {"was": "a PCA bottleneck", "replacement": "llama__gemma__bottleneck", "why": "the refit finds more",
             "retired": "2026-12-02"}
    pair_method = f"{llama.fingerprint.name}__{gemma2tok.name}__mot"
    monkeypatch.setattr(mapping, "retired_artifacts",
                        lambda: {"by_weights_sha256": {sha: entry},
                                 "by_name": {"llama__gemma__pca": entry, pair_method: entry}})
    with pytest.raises(mapping.MapperRetiredError, match="retired .*Use llama__gemma__bottleneck"):
        mapping.resolve_mapper(str(tmp_path / "old-copy"), llama.fingerprint, gemma2tok)
    with pytest.raises(mapping.MapperNotFoundError, match="llama__gemma__bottleneck"):  # by name, a subclass
        mapping.resolve_mapper("llama__gemma__pca", llama.fingerprint, gemma2tok)
    # by method: no artifact of it for the pair, and the pair's artifact of it was retired
    with pytest.raises(mapping.MapperRetiredError, match=f"{pair_method} is retired .*Use llama__gemma__bottleneck"):
        mapping.resolve_mapper("mot", llama.fingerprint, gemma2tok)
    # a method that was never shipped for the pair is not called retired
    with pytest.raises(mapping.MapperNotFoundError) as err:
        mapping.resolve_mapper("latent", llama.fingerprint, gemma2tok)
    assert not isinstance(err.value, mapping.MapperRetiredError)


def test_the_shipped_retirement_list_reads_and_names_replacements_that_ship():
    from pathlib import Path

    from cag import mapping

    retired = mapping.retired_artifacts()
    pretrained = Path(mapping.__file__).resolve().parents[1] / "mappers" / "pretrained"
    entries = [*retired["by_weights_sha256"].values(), *retired["by_name"].values()]
    assert entries
    for entry in entries:
        assert (pretrained / entry["replacement"]).is_dir()
    for name in retired["by_name"]:
        assert not (pretrained / name).exists()  # retired means gone, not kept beside the replacement
    import json

    shipped = {json.loads(card.read_text())["weights_sha256"] for card in pretrained.glob("*/card.json")}
    assert not shipped & set(retired["by_weights_sha256"])


def test_artifact_id_tells_refits_apart_and_survives_a_round_trip(fitted, llama, gemma2tok, tmp_path):
    _, mapper = fitted
    mapper.save(tmp_path / "a")
    first = load_mapper(tmp_path / "a", source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert first.artifact_id == mapper.artifact_id
    # a refit with the same method, settings and provenance but other weights
    refit = load_mapper(tmp_path / "a", source=llama.fingerprint, target=gemma2tok.fingerprint)
    refit.set_weights(**{k: (v * 1.01 if k == "coef" else v) for k, v in refit.weights.items()})
    refit.save(tmp_path / "b")
    second = load_mapper(tmp_path / "b", source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert second.settings == first.settings and second.fitted_on == first.fitted_on
    assert second.artifact_id != first.artifact_id


def _with_key_correction(mapper, a, b):
    corrected = BottleneckMapper(mapper.source, mapper.target, {**mapper.settings, "key_correction_rank": a.shape[-1]})
    corrected.set_weights(**mapper.weights, key_a=a, key_b=b)
    return corrected


def test_key_correction_is_k_plus_k_a_b_on_the_keys_only_and_round_trips(fitted, llama, gemma2tok, texts, tmp_path):
    _, mapper = fitted
    fp = gemma2tok.fingerprint
    g = torch.Generator().manual_seed(0)
    a = torch.randn(fp.num_layers, fp.num_kv_heads, fp.head_dim, 2, generator=g)
    chunk, text = llama.prefill(texts[0]), texts[0]
    plain = mapper.translate(chunk, text, gemma2tok)
    # B = 0: the map itself (what the fit starts from)
    zero = _with_key_correction(mapper, a, torch.zeros(fp.num_layers, fp.num_kv_heads, 2, fp.head_dim))
    torch.testing.assert_close(zero.translate(chunk, text, gemma2tok).keys, plain.keys)
    b = 0.1 * torch.randn(fp.num_layers, fp.num_kv_heads, 2, fp.head_dim, generator=g)
    corrected = _with_key_correction(mapper, a, b)
    out = corrected.translate(chunk, text, gemma2tok)
    want = plain.keys + torch.einsum("lhtd,lhdr,lhre->lhte", plain.keys, a, b)
    torch.testing.assert_close(out.keys, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.values, plain.values)
    assert corrected.artifact_id != mapper.artifact_id
    corrected.save(tmp_path / "m")
    again = load_mapper(tmp_path / "m", source=llama.fingerprint, target=gemma2tok.fingerprint)
    torch.testing.assert_close(again.translate(chunk, text, gemma2tok).keys, out.keys)


def test_a_key_correction_of_the_wrong_shape_is_refused(fitted, gemma2tok):
    _, mapper = fitted
    fp = gemma2tok.fingerprint
    with pytest.raises(MapperArtifactError, match="key_b"):
        _with_key_correction(mapper, torch.zeros(fp.num_layers, fp.num_kv_heads, fp.head_dim, 2),
                             torch.zeros(fp.num_layers, fp.num_kv_heads, 3, fp.head_dim))


def _with_repair_correction(mapper, a2, b2):
    out = BottleneckMapper(mapper.source, mapper.target,
                           {**mapper.settings, "repair_key_correction_rank": a2.shape[-1]})
    out.set_weights(**mapper.weights, repair_key_a=a2, repair_key_b=b2)
    return out


def _corrections(fp, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(fp.num_layers, fp.num_kv_heads, fp.head_dim, rank, generator=g) / fp.head_dim ** 0.5,
            0.3 * torch.randn(fp.num_layers, fp.num_kv_heads, rank, fp.head_dim, generator=g))


def test_the_repair_paths_correction_maps_the_plain_paths_keys_exactly(fitted, llama, gemma2tok, texts, tmp_path):
    """Translations are kept as the plain path serves them (k + kAB); the +repair path's keys are
    k + kA₂B₂ of the same map, reached from them without translating again."""
    _, mapper = fitted
    fp = gemma2tok.fingerprint
    chunk, text = llama.prefill(texts[0]), texts[0]
    a, b = _corrections(fp, 2, 0)
    a2, b2 = _corrections(fp, 3, 1)
    plain_only = _with_key_correction(mapper, a, b)
    both = _with_repair_correction(plain_only, a2, b2)
    served = both.translate(chunk, text, gemma2tok)
    torch.testing.assert_close(served.keys, plain_only.translate(chunk, text, gemma2tok).keys)  # plain path as before
    want = _with_key_correction(mapper, a2, b2).translate(chunk, text, gemma2tok).keys
    torch.testing.assert_close(both.repair_keys(served.keys), want, rtol=1e-4, atol=1e-4)
    # no plain correction (as the fit translates): the repair correction alone
    raw = mapper.translate(chunk, text, gemma2tok).keys
    only_repair = _with_repair_correction(mapper, a2, b2)
    torch.testing.assert_close(only_repair.repair_keys(raw), want, rtol=1e-4, atol=1e-4)
    both.save(tmp_path / "m")
    again = load_mapper(tmp_path / "m", source=llama.fingerprint, target=gemma2tok.fingerprint)
    assert again.artifact_id == both.artifact_id != plain_only.artifact_id
    torch.testing.assert_close(again.repair_keys(served.keys), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(MapperArtifactError, match="repair_key_b has shape"):
        _with_repair_correction(mapper, a2[..., :2], b2)


def test_an_artifact_without_a_repair_correction_serves_its_translations_on_that_path(fitted):
    _, mapper = fitted
    keys = torch.randn(2, 1, 3, 4)
    assert mapper.repair_keys(keys) is keys


def test_a_served_path_fit_is_exported_beside_the_plain_correction_and_continued(fitted, gemma2tok):
    from eval.fit_key_correction import artifact_correction, fold_into

    _, mapper = fitted
    fp = gemma2tok.fingerprint
    a, b = _corrections(fp, 2, 0)
    a2, b2 = _corrections(fp, 2, 1)
    m = _with_key_correction(mapper, a, b)
    assert artifact_correction(m, repair=True)[0] is m.weights["key_a"]  # what the path served until now
    fold_into(m, {"a": a2, "b": b2}, repair=True)
    assert m.key_correction_rank == 2 and m.repair_key_correction_rank == 2
    torch.testing.assert_close(m.weights["key_a"], a)                  # the plain path keeps its own
    torch.testing.assert_close(artifact_correction(m, repair=True)[0], a2)
    torch.testing.assert_close(artifact_correction(m)[0], a)
    with pytest.raises(ValueError, match="plain path"):
        fold_into(m, {"a": a2, "b": b2, "u": a2, "v": b2, "c": b2}, repair=True)


def _placed(mapper, llama, target, texts, asm, token_window=0):
    """`fit_key_correction.translated_context`'s items, on the tiny pair: prompt head + two translated chunks."""
    from mappers.bottleneck import direct_features

    prefix = asm.prefix()
    items = []
    for i in range(3):
        chunks = mapper.translate_batch([llama.prefill(t) for t in texts[i:i + 2]], texts[i:i + 2], target)
        item = {"keys": torch.cat([prefix.keys, *[c.keys for c in chunks]], 2).float(),
                "values": torch.cat([prefix.values, *[c.values for c in chunks]], 2).float(),
                "scale": torch.ones(sum(c.keys.shape[2] for c in chunks)),
                "n_prefix": prefix.num_tokens, "question": f"What is item {i}?", "answer": texts[i].split()[3]}
        if token_window:
            mean_f = mapper.weights["tok_mean_f"]
            item["features"] = torch.cat([direct_features(target, c.token_ids, token_window) - mean_f[:, None]
                                          for c in chunks], 1)
        items.append(item)
    return items


def _assembler(target):
    from cag.assembler import Assembler
    from cag.prompt import layout_for

    return Assembler(target, layout_for(target.tokenizer))


def test_the_key_correction_fit_lowers_the_answer_nll_on_a_tiny_pair(fitted, llama, gemma2tok, texts):
    from eval.fit_key_correction import fit, initial_weights

    _, mapper = fitted
    asm = _assembler(gemma2tok)
    items = _placed(mapper, llama, gemma2tok, texts, asm)
    weights = initial_weights(gemma2tok, rank=2)
    _, history = fit(gemma2tok, asm, items, items, weights, epochs=3, lr=0.02, l2=0.0)
    assert history[0]["held_nll"] > history[-2]["held_nll"] + 0.01


def test_the_fit_scores_keys_scaled_by_their_chunks_rank_factor(fitted, llama, gemma2tok, texts):
    """A retrieved item's chunk keys carry the served rank decay (γ**rank, applied after the
    correction); the fit's NLL reads them scaled, exactly as if the keys had been scaled beforehand."""
    from eval.fit_key_correction import answer_nll, initial_weights

    _, mapper = fitted
    asm = _assembler(gemma2tok)
    item = _placed(mapper, llama, gemma2tok, texts, asm)[0]
    weights = {k: t.detach() for k, t in initial_weights(gemma2tok, rank=2).items()}
    n, t = item["n_prefix"], item["scale"].numel()
    decayed = {**item, "scale": torch.where(torch.arange(t) < t // 2, 1.0, 0.5)}
    prescaled = {**item, "keys": torch.cat([item["keys"][:, :, :n], item["keys"][:, :, n:] * decayed["scale"][:, None]], 2)}
    with torch.no_grad():
        plain, scaled, by_hand = (float(answer_nll(gemma2tok, asm, it, weights)) for it in (item, decayed, prescaled))
    assert abs(scaled - plain) > 1e-4          # the factor is read
    assert abs(scaled - by_hand) < 1e-4        # as a factor on the placed keys


def test_teaching_the_stop_scores_the_turns_end_token_after_the_answer(fitted, llama, gemma2tok, texts):
    """`--teach-stop`: the teacher-forced answer ends with the end-of-turn token, so the NLL is over one
    more token, and the fit lowers it; the token is the chat format's own marker (else EOS, never on a
    plain layout)."""
    from types import SimpleNamespace

    from eval.fit_key_correction import answer_nll, end_of_turn_id, fit, initial_weights

    _, mapper = fitted
    asm = _assembler(gemma2tok)
    items = _placed(mapper, llama, gemma2tok, texts, asm)
    stopping = [{**it, "end_id": 1} for it in items]
    weights = initial_weights(gemma2tok, rank=2)
    with torch.no_grad():
        assert float(answer_nll(gemma2tok, asm, stopping[0], weights)) != float(answer_nll(gemma2tok, asm, items[0], weights))
    _, history = fit(gemma2tok, asm, stopping, stopping, weights, epochs=4, lr=0.05, l2=0.0)
    assert history[0]["held_nll"] > history[-2]["held_nll"] + 0.01

    def lm(vocab, eos=0):
        return SimpleNamespace(tokenizer=SimpleNamespace(get_vocab=lambda: vocab, eos_token_id=eos))

    chat, plain = SimpleNamespace(layout=SimpleNamespace(chat=True)), SimpleNamespace(layout=SimpleNamespace(chat=False))
    assert end_of_turn_id(lm({"<|im_end|>": 7, "a": 1}), chat) == 7
    assert end_of_turn_id(lm({"<end_of_turn>": 106}), chat) == 106
    assert end_of_turn_id(lm({"a": 1}, eos=2), chat) == 2
    assert end_of_turn_id(lm({"<|im_end|>": 7}), plain) is None


def test_the_fits_crux_is_what_the_served_repair_path_recomputes(fitted, llama, gemma2tok, texts):
    """`--repair`: the crux K/V the fit holds fixed equal `Assembler.place`'s recompute of the same
    positions over the same translated chunks, their keys multiplied by the path's α."""
    from dataclasses import replace

    from eval.fit_key_correction import recomputed_crux

    _, mapper = fitted
    asm = _assembler(gemma2tok)
    chunks = mapper.translate_batch([llama.prefill(t) for t in texts[:2]], texts[:2], gemma2tok)
    n = asm.prefix().num_tokens
    positions = torch.tensor([n + 1, n + 2, n + 5, n + chunks[0].num_tokens + 3])
    at, keys, values = recomputed_crux(asm, chunks, positions, key_scale=0.5)
    placed = asm.place([replace(c, keys=c.keys * 0.5) for c in chunks], recompute_ratio=0.1,
                       recompute_select="retriever", positions=positions)
    assert placed.recomputed_tokens == 4 and torch.equal(at, positions)
    total, full = placed.context_ids.numel(), 0
    for i, layer in enumerate(placed.cache.layers):
        offset = total - layer.keys.shape[-2]          # a sliding layer keeps only its window's tail
        seen = positions >= offset
        full += int(offset == 0)
        torch.testing.assert_close(keys[i][:, seen], layer.keys[0][:, positions[seen] - offset].to(keys.dtype))
        torch.testing.assert_close(values[i][:, seen], layer.values[0][:, positions[seen] - offset].to(values.dtype))
    assert full > 0


def test_the_fit_on_the_repair_path_reads_the_crux_and_the_key_scale_and_lowers_the_nll(fitted, llama, gemma2tok,
                                                                                      texts):
    """A crux equal to the placed translations changes nothing; another one, or α, changes the NLL;
    the fit still lowers it with the crux held fixed."""
    from eval.fit_key_correction import answer_nll, fit, initial_weights

    _, mapper = fitted
    asm = _assembler(gemma2tok)
    items = _placed(mapper, llama, gemma2tok, texts, asm)
    n = items[0]["n_prefix"]
    at = torch.tensor([n + 2, n + 3, n + 4])
    own = gemma2tok.adapter.rotate(items[0]["keys"].to(gemma2tok.dtype), torch.arange(items[0]["keys"].shape[2]))
    same = {**items[0], "crux": (at, own[:, :, at], items[0]["values"][:, :, at])}
    other = {**items[0], "crux": (at, 3 * own[:, :, at], -items[0]["values"][:, :, at])}
    scaled = {**items[0], "key_scale": 0.5}
    weights = initial_weights(gemma2tok, rank=2)
    with torch.no_grad():
        plain, kept, moved, halved = (float(answer_nll(gemma2tok, asm, it, weights))
                                      for it in (items[0], same, other, scaled))
    assert abs(kept - plain) < 1e-4
    assert abs(moved - plain) > 1e-3 and abs(halved - plain) > 1e-4
    crux_items = [{**it, "crux": (at, 3 * own[:, :, at], -it["values"][:, :, at])} for it in items]
    _, history = fit(gemma2tok, asm, crux_items, crux_items, weights, epochs=4, lr=0.05, l2=0.0)
    assert history[0]["held_nll"] > history[-2]["held_nll"] + 0.01


def _with_token_residual(mapper, target, window, seed=3):
    fp = target.fingerprint
    hd = fp.num_kv_heads * fp.head_dim
    g = torch.Generator().manual_seed(seed)
    out = BottleneckMapper(mapper.source, mapper.target,
                           {**mapper.settings, "token_residual": True, "token_window": window})
    out.set_weights(**mapper.weights, tok_w=0.05 * torch.randn(fp.num_layers, 2 * window * hd, 2 * hd, generator=g),
                    tok_mean_f=torch.randn(fp.num_layers, 2 * window * hd, generator=g),
                    tok_mean_r=0.1 * torch.randn(fp.num_layers, 2 * hd, generator=g))
    return out


def test_the_token_part_lowers_the_nll_and_folds_into_the_token_residual(fitted, llama, gemma2tok, texts):
    """Keys and the target's direct path of tokens t, t-1 fitted together through the frozen target;
    what the fit scored is what the exported artifact translates."""
    from eval.fit_key_correction import fit, fold_into, initial_weights, token_delta
    from mappers.bottleneck import corrected_keys

    mapper = _with_token_residual(fitted[1], gemma2tok, window=2)
    asm = _assembler(gemma2tok)
    items = _placed(mapper, llama, gemma2tok, texts, asm, token_window=2)
    weights = initial_weights(gemma2tok, rank=2, token_rank=3, feature_width=items[0]["features"].shape[-1])
    w, history = fit(gemma2tok, asm, items, items, weights, epochs=3, lr=0.02, l2=0.0)
    assert history[0]["held_nll"] > history[-2]["held_nll"] + 0.01
    assert w["v"].abs().sum() > 0 and w["c"].abs().sum() > 0   # the token part moved, not only the keys
    fold_into(mapper, w)
    assert mapper.key_correction_rank == 2
    again = _placed(mapper, llama, gemma2tok, texts, asm)   # the exported map, translated by the runtime
    n = items[0]["n_prefix"]
    for scored, exported in zip(items, again):
        dk, dv = token_delta(scored["features"], w, gemma2tok.fingerprint.num_kv_heads)
        want_k = corrected_keys(scored["keys"][:, :, n:] + dk, w["a"], w["b"])
        torch.testing.assert_close(exported["keys"][:, :, n:], want_k, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(exported["values"][:, :, n:], scored["values"][:, :, n:] + dv, rtol=2e-2, atol=2e-2)


def test_translating_without_the_key_correction_leaves_the_artifact_id_unchanged(fitted):
    """`export` checks the correction against the artifact id it was fitted on; switching the correction
    off for the fit must not add a setting (a map without one was fitted as a different artifact)."""
    from eval.fit_key_correction import key_correction_off

    _, mapper = fitted
    before, settings = mapper.artifact_id, dict(mapper.settings)
    assert "key_correction_rank" not in settings
    with key_correction_off(mapper):
        assert mapper.settings["key_correction_rank"] == 0
    assert mapper.settings == settings and mapper.artifact_id == before


def test_a_token_residual_translates_training_rows_as_it_translates_the_whole_text(fitted, llama, gemma2tok, texts):
    """`translate_rows` (the lab's training rows: only aligned tokens, the token residual read over the
    whole text) gives exactly what `translate` gives at those positions."""
    variant, _ = fitted
    fp = gemma2tok.fingerprint
    hd = fp.num_kv_heads * fp.head_dim
    g = torch.Generator().manual_seed(7)
    tok = object.__new__(variants.TokenResidualVariant)
    tok.base, tok.train_rows, tok.sse_drop, tok.window = variant, variant.train_rows, 0.1, 2
    tok.w = 0.05 * torch.randn(fp.num_layers, 4 * hd, 2 * hd, generator=g)
    tok.mean_f = torch.randn(fp.num_layers, 4 * hd, generator=g)
    tok.mean_r = 0.1 * torch.randn(fp.num_layers, 2 * hd, generator=g)
    text = texts[1]
    ids = gemma2tok.tokenize(text)[0]
    item = {**_item(llama, gemma2tok, text), "token_ids": ids}
    pos = item["has_source"].nonzero().flatten()
    assert len(pos) > 0
    rows = {"xkv": item["xkv"][pos], "has_source": torch.ones(len(pos), dtype=torch.bool)}
    keys, values = tok.translate(item, gemma2tok)
    row_keys, row_values = tok.translate_rows(rows, gemma2tok, ids, pos)
    torch.testing.assert_close(row_keys, keys[:, :, pos])
    torch.testing.assert_close(row_values, values[:, :, pos])
