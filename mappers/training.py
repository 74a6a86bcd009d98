"""The one gradient loop of `mappers/`: Adam over a few tensors, on a CPU, resumable.

HeteroFold's output-aware calibration and Mixture-of-Translators' training both
run here. The loop knows nothing about models; a method hands it

- ``params``: named leaf tensors to train (everything else stays frozen);
- ``step_loss(step, micro)``: the loss of micro-batch ``micro`` of optimisation
  step ``step``. **The items a step uses must depend only on ``(step, micro)``**
  (e.g. ``items[(step * accumulate + micro) % n]``): that is what makes a resumed
  run equal an uninterrupted one, step for step;
- ``heldout_loss()`` (optional): a float on held-out calibration text, evaluated
  before the first step and every ``eval_every`` steps, for early stopping.

What it adds: gradient accumulation, a time budget, early stopping that
restores the best parameters seen, a rich progress bar with the loss, and a
checkpoint (parameters, Adam moments, best parameters, history) written
atomically every ``checkpoint_seconds`` into ``checkpoint_dir`` as one
safetensors file whose metadata carries the progress, so tensors and progress
can never disagree. A call with the same ``config_id`` resumes from it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CHECKPOINT_NAME = "train_state.safetensors"


@dataclass
class TrainConfig:
    steps: int = 200
    lr: float = 1e-3
    accumulate: int = 1
    eval_every: int = 20
    # evaluations without a new best before stopping (0: never stop early)
    patience: int = 4
    # wall-clock budget of this fit, resumed runs included (None: no budget)
    max_seconds: float | None = None
    checkpoint_seconds: float = 120.0
    # also checkpoint every N steps (0: by time only); tests use it
    checkpoint_every: int = 0
    grad_clip: float | None = 1.0

    @classmethod
    def from_settings(cls, settings: dict[str, Any], **defaults: Any) -> "TrainConfig":
        """Build from a mapper's settings dict (keys named as the fields)."""
        fields = {k: settings[k] for k in cls.__dataclass_fields__ if k in settings}
        return cls(**{**defaults, **fields})


class TrainingInterrupted(RuntimeError):
    """Raised by an `on_step` hook to simulate a crash (tests)."""


def train(params: dict[str, torch.Tensor], step_loss: Callable[[int, int], torch.Tensor], *,
          config: TrainConfig, heldout_loss: Callable[[], float] | None = None,
          checkpoint_dir: str | os.PathLike | None = None, config_id: str = "",
          progress: bool = True, description: str = "train",
          on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train `params` in place; returns a report (losses, best step, stop reason, seconds).

    `on_step(step)` is called after each completed optimiser step (and after any
    checkpoint it triggers).
    """
    names = sorted(params)
    tensors = [params[n] for n in names]
    for name, t in zip(names, tensors):
        if not t.is_leaf or not t.requires_grad:
            raise ValueError(f"parameter {name!r} must be a leaf tensor with requires_grad=True")
    optimizer = torch.optim.Adam(tensors, lr=config.lr, foreach=False)
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    state = _State(best={n: t.detach().clone() for n, t in zip(names, tensors)})
    if folder is not None:
        _resume(folder / CHECKPOINT_NAME, config_id, names, tensors, optimizer, state)

    def evaluate() -> None:
        if heldout_loss is None:
            return
        with torch.no_grad():
            value = float(heldout_loss())
        state.history.append({"step": state.step, "heldout": value})
        if state.best_loss is None or value < state.best_loss:
            state.best_loss, state.best_step, state.bad_evals = value, state.step, 0
            state.best = {n: t.detach().clone() for n, t in zip(names, tensors)}
        else:
            state.bad_evals += 1

    started = time.perf_counter() - state.elapsed
    last_checkpoint = time.perf_counter()
    if state.step == 0 and not state.history:
        evaluate()
    stop = "steps"
    with _progress(progress) as bar:
        task = bar.add_task(description, total=config.steps, completed=state.step, loss=float("nan"),
                            best=state.best_loss if state.best_loss is not None else float("nan"))
        while state.step < config.steps:
            if config.patience and state.bad_evals >= config.patience:
                stop = "early"
                break
            if config.max_seconds is not None and time.perf_counter() - started >= config.max_seconds:
                stop = "time"
                break
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for micro in range(config.accumulate):
                loss = step_loss(state.step, micro) / config.accumulate
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{description}: non-finite loss at step {state.step}")
                loss.backward()
                total += float(loss.detach())
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(tensors, config.grad_clip)
            optimizer.step()
            state.step += 1
            state.losses.append(total)
            if config.eval_every and state.step % config.eval_every == 0:
                evaluate()
            bar.update(task, completed=state.step, loss=total,
                       best=state.best_loss if state.best_loss is not None else float("nan"))
            due = (config.checkpoint_every and state.step % config.checkpoint_every == 0) or \
                time.perf_counter() - last_checkpoint >= config.checkpoint_seconds
            if folder is not None and due:
                state.elapsed = time.perf_counter() - started
                _save(folder / CHECKPOINT_NAME, config_id, names, tensors, optimizer, state)
                last_checkpoint = time.perf_counter()
            if on_step is not None:
                on_step(state.step)
    if heldout_loss is not None and (not state.history or state.history[-1]["step"] != state.step):
        evaluate()
    if heldout_loss is not None:
        with torch.no_grad():  # early stopping keeps the best parameters seen, not the last
            for n, t in zip(names, tensors):
                t.copy_(state.best[n])
    state.elapsed = time.perf_counter() - started
    if folder is not None:
        _save(folder / CHECKPOINT_NAME, config_id, names, tensors, optimizer, state)
    return {"steps": state.step, "stop": stop, "seconds": round(state.elapsed, 2),
            "best_step": state.best_step, "best_heldout": state.best_loss,
            "first_loss": state.losses[0] if state.losses else None,
            "last_loss": state.losses[-1] if state.losses else None,
            "history": state.history, "config": asdict(config)}


@dataclass
class _State:
    best: dict[str, torch.Tensor]
    step: int = 0
    elapsed: float = 0.0
    best_loss: float | None = None
    best_step: int | None = None
    bad_evals: int = 0

    def __post_init__(self) -> None:
        self.losses: list[float] = []
        self.history: list[dict[str, Any]] = []


def _save(path: Path, config_id: str, names, tensors, optimizer, state: _State) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    adam = optimizer.state_dict()["state"]
    for i, (name, t) in enumerate(zip(names, tensors)):
        out[f"param.{name}"] = t.detach().clone()
        out[f"best.{name}"] = state.best[name].clone()
        if i in adam:
            out[f"adam.exp_avg.{name}"] = adam[i]["exp_avg"].clone()
            out[f"adam.exp_avg_sq.{name}"] = adam[i]["exp_avg_sq"].clone()
            out[f"adam.step.{name}"] = torch.as_tensor(adam[i]["step"], dtype=torch.float32).reshape(1)
    meta = {"config_id": config_id, "step": state.step, "elapsed": state.elapsed,
            "best_loss": state.best_loss, "best_step": state.best_step, "bad_evals": state.bad_evals,
            "losses": state.losses, "history": state.history}
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp), metadata={"progress": json.dumps(meta)})
    os.replace(tmp, path)


def _resume(path: Path, config_id: str, names, tensors, optimizer, state: _State) -> None:
    if not path.exists():
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads((fh.metadata() or {}).get("progress", "{}"))
    if meta.get("config_id") != config_id:
        return  # another configuration: start afresh
    saved = load_file(str(path))
    with torch.no_grad():
        for name, t in zip(names, tensors):
            if saved[f"param.{name}"].shape != t.shape:
                return
        for name, t in zip(names, tensors):
            t.copy_(saved[f"param.{name}"])
            state.best[name] = saved[f"best.{name}"].clone()
    adam_state = {}
    for i, name in enumerate(names):
        if f"adam.exp_avg.{name}" in saved:
            adam_state[i] = {"step": saved[f"adam.step.{name}"][0].clone(),
                             "exp_avg": saved[f"adam.exp_avg.{name}"].clone(),
                             "exp_avg_sq": saved[f"adam.exp_avg_sq.{name}"].clone()}
    sd = optimizer.state_dict()
    sd["state"] = adam_state
    optimizer.load_state_dict(sd)
    state.step, state.elapsed = int(meta["step"]), float(meta["elapsed"])
    state.best_loss, state.best_step = meta.get("best_loss"), meta.get("best_step")
    state.bad_evals = int(meta.get("bad_evals", 0))
    state.losses = list(meta.get("losses", []))
    state.history = list(meta.get("history", []))


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # stderr: `cag fit --json` keeps stdout for its result
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f} · best held-out {task.fields[best]:.4f}"),
                    TimeRemainingColumn(), disable=not enabled, console=Console(stderr=True))
