"""Progress for long commands, always on stderr, so stdout stays for results.

`cag eval --json | jq` must see only JSON on stdout, and a run that takes ten
minutes must still say how far it is. A `Progress` draws a rich bar when stderr
is a terminal, and otherwise writes plain lines::

    cag eval: 12/50 questions, synthetic-kb, qwen2.5-0.5b, 1m32s elapsed, ~4m left

at most one every `interval_s` seconds (a log file or a CI job gets a readable
trace, not bar redraws: rich on a non-terminal only prints the final frame),
and always the last one, so the final count is never lost to the rate limit.

    with Progress("cag eval", total=50, unit="questions") as bar:
        for item in items:
            ...
            bar.advance(note=f"{dataset}, {target}")
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["Progress", "build_event_handler", "build_progress", "fit_progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """1m32s, 45s, 2h05m: short enough for a progress line."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _format_left(seconds: float) -> str:
    # an estimate: whole minutes are all it can honestly claim past the first one
    if seconds < 60:
        return f"~{max(1, int(round(seconds)))}s"
    if seconds < 3600:
        return f"~{int(round(seconds / 60))}m"
    return f"~{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


class Progress:
    """A progress reporter on stderr: a rich bar on a terminal, else rate-limited plain lines.

    `total` may be None when the amount of work is not known in advance (then no
    estimate of the time left is given). `completed` starts the count above zero
    (a resumed run); the estimate uses only the work done in this run.
    `rich=None` decides by ``stream.isatty()``; `clock` is for tests.
    """

    def __init__(self, label: str, total: int | None = None, *, unit: str = "", completed: int = 0,
                 interval_s: float = 2.0, stream: TextIO | None = None, rich: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.completed = self._start_count = completed
        self.note = ""
        self.interval_s = interval_s
        # resolved now, not at import: test runners and callers swap sys.stderr
        self.stream = stream if stream is not None else sys.stderr
        self.rich = self.stream.isatty() if rich is None else rich
        self._clock = clock
        self._started = clock()
        self._last_emit: float | None = None
        self._emitted_state: tuple | None = None
        self._bar: Any = None
        self._task: Any = None

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Progress":
        self._started = self._clock()
        if self.rich:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn(self.unit), TimeElapsedColumn(), TimeRemainingColumn(),
                                     # a note may hold brackets (paths, lists): not rich markup
                                     TextColumn("{task.fields[note]}", markup=False),
                                     console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.completed, note="")
        else:
            self._emit()
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Stop the bar, or write the last line if the rate limit held it back."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        else:
            self.flush()

    def flush(self) -> None:
        """Write the current line now if the rate limit held it back (plain lines only)."""
        if not self.rich and self._emitted_state != self._state():
            self._emit()

    # ------------------------------------------------------------------ updates

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """`n` more units done; `note` (kept until changed) says what is being worked on."""
        self.update(completed=self.completed + n, note=note)

    def update(self, *, completed: int | None = None, total: int | None = None, note: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        if self._bar is not None:
            self._bar.update(self._task, completed=self.completed, total=self.total, note=self.note)
            return
        if self.rich:  # not entered, or closed: nothing to draw on
            return
        now = self._clock()
        finished = self.total is not None and self.completed >= self.total
        if self._last_emit is None or now - self._last_emit >= self.interval_s or finished:
            if self._emitted_state != self._state():
                self._emit()

    def log(self, message: str) -> None:
        """A message of its own (a phase, a result), never rate-limited; above the bar if there is one."""
        if self._bar is not None:
            self._bar.console.print(message, highlight=False, markup=False, soft_wrap=True)
        else:
            print(f"{self.label}: {message}", file=self.stream, flush=True)

    # ------------------------------------------------------------------ lines

    def _state(self) -> tuple:
        return (self.completed, self.total, self.unit, self.note)

    def line(self) -> str:
        """The plain line for the current state."""
        count = f"{self.completed}/{self.total}" if self.total is not None else f"{self.completed}"
        parts = [f"{count} {self.unit}".rstrip()]
        if self.note:
            parts.append(self.note)
        elapsed = self._clock() - self._started
        parts.append(f"{format_duration(elapsed)} elapsed")
        done_here = self.completed - self._start_count
        if self.total is not None and 0 < done_here and self.completed < self.total and elapsed > 0:
            parts.append(f"{_format_left((self.total - self.completed) * elapsed / done_here)} left")
        return f"{self.label}: " + ", ".join(parts)

    def _emit(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_emit = self._clock()
        self._emitted_state = self._state()


def build_event_handler(bar: Progress) -> Callable[[Any], None]:
    """An ``on_event`` for `stores.build.build_store` that counts stored chunks on `bar`.

    The build announces no chunk total, so the count runs without one.
    """
    def handle(event: Any) -> None:
        tokens = f"{event.tokens_prefilled:,} tokens prefilled"
        if event.kind == "chunk_stored":
            bar.update(completed=event.chunks_stored, note=tokens)
        else:  # a step of the build finished: planned, indexed, published, collected
            bar.update(completed=event.chunks_stored, note=f"{tokens}, {event.kind}")
    return handle


@contextmanager
def build_progress(label: str, stream: TextIO | None = None) -> Iterator[dict[str, Any]]:
    """Keyword arguments for `stores.build.build_store` that report its progress on stderr.

    On a terminal, the build's own rich bars (they know the totals); elsewhere,
    plain lines from its events.
    """
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        yield {"progress": True}
        return
    with Progress(label, unit="chunks prefilled", stream=stream, rich=False) as bar:
        yield {"progress": False, "on_event": build_event_handler(bar)}


@contextmanager
def fit_progress(label: str, stream: TextIO | None = None) -> Iterator[dict[str, Any]]:
    """Keyword arguments for `mappers.fit.fit_mapper` that report its progress on stderr.

    On a terminal, the fit's own rich bars; elsewhere, plain lines counting the
    statistics batches, then the training steps (of the methods that train).
    """
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        yield {"progress": True}
        return
    with Progress(label, unit="statistics batches", stream=stream, rich=False) as bar:
        def phase(unit: str) -> None:
            if bar.unit != unit:  # the last count of the phase before is never lost to the rate limit
                bar.flush()
                bar.unit = unit

        def on_batch(index: int) -> None:  # index within this run: a resumed fit counts from 0
            phase("statistics batches")
            bar.update(completed=index + 1)

        def on_step(step: int) -> None:
            phase("training steps")
            bar.update(completed=step)
        yield {"progress": False, "on_batch": on_batch, "on_step": on_step}
