"""APE defaults: calibrated (T, S) per weight fingerprint, used on the native path unless the caller sets them."""

from __future__ import annotations

import json

import pytest

import cag.ape as ape
import cag.models.attention as attention
from tests.unit.test_context import ctx_for, kb  # noqa: F401  (the fixture)


@pytest.fixture
def defaults(tmp_path, monkeypatch):
    """Point cag.ape at a defaults file of the test's own."""
    path = tmp_path / "ape_defaults.json"

    def write(entries: dict) -> None:
        path.write_text(json.dumps(entries))
        ape._defaults.cache_clear()

    monkeypatch.setattr(ape, "DEFAULTS_FILE", path)
    write({})
    yield write
    ape._defaults.cache_clear()


@pytest.fixture
def seen(monkeypatch):
    """The (T, S) of every APE context a query opens, in order."""
    calls = []
    original = attention.context_temperature

    def spy(model, start, end, temperature=1.0, scale=1.0):
        calls.append((temperature, scale))
        return original(model, start, end, temperature=temperature, scale=scale)

    monkeypatch.setattr(attention, "context_temperature", spy)
    return calls


def test_resolve_prefers_the_caller_then_the_calibration_then_one(defaults):
    defaults({"fp-a": {"temperature": 0.9, "scale": 0.8}})
    assert ape.resolve(None, None, fingerprint_id="fp-a", native=True) == (0.9, 0.8)
    assert ape.resolve(1.1, None, fingerprint_id="fp-a", native=True) == (1.1, 0.8)
    assert ape.resolve(None, None, fingerprint_id="fp-a", native=False) == (1.0, 1.0)  # never calibrated there
    assert ape.resolve(None, None, fingerprint_id="fp-other", native=True) == (1.0, 1.0)
    assert ape.resolve(0.7, 1.3, fingerprint_id="fp-other", native=False) == (0.7, 1.3)


def test_a_missing_defaults_file_means_no_calibration(tmp_path, monkeypatch):
    monkeypatch.setattr(ape, "DEFAULTS_FILE", tmp_path / "absent.json")
    ape._defaults.cache_clear()
    assert ape.calibrated("anything") is None


def test_the_shipped_defaults_name_real_grid_points():
    ape._defaults.cache_clear()
    for fingerprint, entry in ape._defaults(ape.DEFAULTS_FILE).items():
        assert entry["temperature"] > 0 and entry["scale"] > 0 and entry["n"] >= 50, fingerprint
        assert 0 < entry.get("rank_key_decay", 1.0) <= 1, fingerprint


def test_a_query_on_the_native_path_uses_the_calibrated_default(kb, defaults, seen):  # noqa: F811
    ctx = ctx_for(kb, mapper="identity")
    fingerprint = ctx.target_model.fingerprint.id
    defaults({fingerprint: {"temperature": 0.5, "scale": 2.0}})
    calibrated = ctx.answer("tower of Velmora")
    assert ctx.ape_settings() == (0.5, 2.0) and seen and set(seen) == {(0.5, 2.0)}
    explicit = ctx_for(kb, mapper="identity", context_temperature=0.5, context_scale=2.0)
    assert explicit.answer("tower of Velmora").text == calibrated.text
    seen.clear()
    neutral = ctx_for(kb, mapper="identity", context_temperature=1.0, context_scale=1.0)
    neutral.answer("tower of Velmora")
    assert set(seen) == {(1.0, 1.0)}


def test_cag_query_passes_the_temperature_and_scale_it_is_given(kb, monkeypatch, seen):  # noqa: F811
    from typer.testing import CliRunner

    from cag.cli import app

    root, source = kb
    from cag import context
    from tests.stores.test_build import HashEmbedder

    class WithTestEmbedder(context.CachedContext):  # the store was built with a test embedder the CLI can't name
        def __init__(self, **kw):
            super().__init__(embedder=HashEmbedder(), dtype="float32", **kw)

    monkeypatch.setattr(context, "CachedContext", WithTestEmbedder)
    result = CliRunner().invoke(app, ["query", "tower of Velmora", "--store", str(root / "store"), "--target",
                                      str(source), "--mapper", "identity", "--min-retention", "0",
                                      "--max-new-tokens", "3", "--context-temperature", "0.7",
                                      "--context-scale", "1.5", "--json"])
    assert result.exit_code == 0, result.output
    assert seen and set(seen) == {(0.7, 1.5)}
    refused = CliRunner().invoke(app, ["query", "q", "--store", str(root / "store"), "--context-scale", "0"])
    assert refused.exit_code != 0


def test_the_harness_gives_the_target_own_chunks_the_native_default_on_another_model_store(kb, defaults):  # noqa: F811
    ctx = ctx_for(kb, mapper="identity")
    defaults({ctx.target_model.fingerprint.id: {"temperature": 0.5, "scale": 2.0}})
    assert ctx.ape_settings(native=True) == (0.5, 2.0)
    assert ctx.ape_settings(native=False) == (1.0, 1.0)
