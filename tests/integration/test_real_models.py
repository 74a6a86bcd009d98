"""The registry on the real packaged models.

Uses the real CAG_HOME (the user cache dir unless $CAG_HOME is set), so the
conversion done by `make setup` (`cag models install`) is reused; on a machine
without it the first test converts the three models (about 2 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cag.cli import app
from cag.models import registry as reg

pytestmark = pytest.mark.integration

# family, layers, KV heads, head dim, hidden size
GEOMETRY = {
    "smollm2-135m": ("llama", 30, 3, 64, 576),
    "qwen2.5-0.5b": ("qwen2", 24, 2, 64, 896),
    "gemma3-270m": ("gemma3", 18, 1, 256, 640),
}


@pytest.mark.parametrize("name", list(reg.REGISTRY))
def test_install_is_recorded(name):
    spec = reg.REGISTRY[name]
    path = reg.install(name)
    assert path.name == spec.install_dirname and path.parent == reg.models_dir()
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    assert not list(path.glob("*.gguf"))
    marker = reg.read_marker(path)
    assert marker["name"] == name and marker["family"] == spec.family
    assert marker["gguf_sha256"] == spec.sha256
    assert marker["packages"] == dict(spec.packages)
    assert reg.install(name) == path  # idempotent
    assert reg.resolve(name) == path
    assert reg.weights_hash(name) == spec.sha256


@pytest.mark.parametrize("name", list(reg.REGISTRY))
def test_load_family_and_geometry(name):
    import torch

    family, layers, kv_heads, head_dim, hidden = GEOMETRY[name]
    # The self-check itself is exercised by `cag models verify` below and by the
    # self-check's own tests; here only what the registry hands back is checked.
    loaded = reg.load(name, selfcheck=False)
    # "auto" runs in bf16 only where the CPU has native bf16 arithmetic.
    assert loaded.dtype == getattr(torch, reg.compute_dtype())
    assert loaded.adapter.family == family
    assert (loaded.adapter.num_layers, loaded.adapter.num_kv_heads,
            loaded.adapter.head_dim) == (layers, kv_heads, head_dim)
    config = loaded.model.config.get_text_config()
    assert config.hidden_size == hidden
    assert loaded.fingerprint.weights_hash == reg.REGISTRY[name].sha256
    assert reg.load(name, selfcheck=False) is loaded  # once per process
    ids = loaded.tokenizer("The lighthouse keeper", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = loaded.model(ids).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()


def test_bfloat16_is_a_separate_cast_copy():
    import torch

    fp32 = reg.load("smollm2-135m", "float32", selfcheck=False)
    bf16 = reg.load("smollm2-135m", "bfloat16", selfcheck=False)
    assert bf16 is not fp32
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32


def test_cli_models_list_json():
    result = CliRunner().invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [r["name"] for r in rows] == list(reg.REGISTRY)
    for r in rows:
        assert r["installed"] and r["packages_ok"] and os.path.isdir(r["path"])
        assert r["family"] == GEOMETRY[r["name"]][0]


def test_cli_models_verify_smollm2_json():
    proc = subprocess.run(
        [sys.executable, "-m", "cag.cli", "models", "verify", "smollm2-135m", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    row = json.loads(line)
    assert row["model"] == "smollm2-135m" and row["passed"] is True
    assert row["failures"] == []
    assert row["load_s"] > 0 and row["peak_rss_mb"] > 100


def test_cli_unknown_model_fails_cleanly():
    result = CliRunner().invoke(app, ["models", "verify", "no-such-model"])
    assert result.exit_code == 1
    assert "known short names" in result.stderr and "Traceback" not in result.output
