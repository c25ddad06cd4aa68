"""What ``tauflow run`` shows while the run goes on: on a terminal, a live table redrawn as the run moves;
anywhere else (a log file, a pipe, CI), a plain line every few seconds and at each news (a role starting,
an evaluation), so that a log says how far the run is."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Self

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tauflow.controller.config import RunConfig
from tauflow.controller.launcher import describe_os_error

PLAIN_EVERY_S = 5.0
# The stream's reader is gone for good (`| head` exited, a tee or log shipper killed, a terminal closed):
# what is written there from now on goes to /dev/null. Other errors (a full disk) skip one write only.
_GONE = {errno.EPIPE, errno.ENXIO, errno.EBADF}  # (EIO too, on a terminal: below)

log = logging.getLogger(__name__)


def _isatty(stream: IO[str]) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False


def _output_failed(stream: IO[str], error: OSError, warned: bool) -> bool:
    """The run's progress is for looking at, never a reason to stop the run: a healthy run ended "failed" when
    the reader of its output pipe exited (BrokenPipeError). Returns True once warned."""
    if not warned:
        log.warning("progress output failed; the run goes on without it", extra={"error": describe_os_error(error)})
    gone = error.errno in _GONE or (error.errno == errno.EIO and _isatty(stream))  # (a log file's EIO may pass)
    if gone:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())  # (the final lines, and Python's own flush at exit, find a sink)
            os.close(devnull)
    return True


class RunConsole(Console):
    """rich's Console, save that a reader gone away ends nothing: rich's own answer to a BrokenPipeError is
    ``SystemExit(1)``, so a run that had trained to its end exited 1 when its pipe's reader left before the
    final lines. Here the console goes quiet (and its stream to /dev/null) instead; the exit code stays the
    run's."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        _output_failed(self.file, BrokenPipeError(errno.EPIPE, "Broken pipe"), warned=False)


@dataclass
class Progress:
    """What the run shows; updated after every poll."""

    version: int = 0
    steps: int = 0
    reward: float = 0.0
    accuracy: float | None = None
    staleness: int = 0
    tokens_per_s: float = 0.0
    queue_depth: int = 0
    message: str = ""
    max_staleness: int | None = None  # the τ in force (tauflow set max-staleness changes it); None: the config's
    rollout_replicas: int = 0  # rollout servers running (tauflow scale rollout changes it)


def _accuracy(progress: Progress) -> str:
    return "-" if progress.accuracy is None else f"{progress.accuracy:.1%}"


def _tau(config: RunConfig, progress: Progress) -> int:
    return config.max_staleness if progress.max_staleness is None else progress.max_staleness


class LiveTable:
    """The terminal's view: one table, redrawn (rich)."""

    def __init__(self, console: Console, config: RunConfig, progress: Progress) -> None:
        self.config = config
        self._warned = False
        self._live = Live(self._table(progress), console=console, refresh_per_second=4, transient=False)

    def _table(self, progress: Progress) -> Table:
        table = Table(title=f"tauflow run {self.config.name}  (max_staleness={_tau(self.config, progress)})")
        table.show_header = False
        table.add_row("step", f"{progress.version} / {self.config.steps}")
        table.add_row("batch reward", f"{progress.reward:.3f}")
        table.add_row("held-out accuracy", _accuracy(progress))
        table.add_row("staleness (last batch, max)", str(progress.staleness))
        table.add_row("trained tokens/s", f"{progress.tokens_per_s:,.0f}")
        table.add_row("queue depth (groups)", str(progress.queue_depth))
        table.add_row("rollout replicas", str(progress.rollout_replicas))
        if progress.message:
            table.add_row("", progress.message)
        return table

    def update(self, progress: Progress) -> None:
        try:
            self._live.update(self._table(progress))
        except OSError as e:
            self._warned = _output_failed(self._live.console.file, e, self._warned)

    def __enter__(self) -> Self:
        try:
            self._live.start(refresh=True)
        except OSError as e:
            self._warned = _output_failed(self._live.console.file, e, self._warned)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._live.stop()
        except OSError as e:
            self._warned = _output_failed(self._live.console.file, e, self._warned)


class PlainLines:
    """The view off a terminal: a line at most every ``every_s``, one at each new message, and the last
    state when the run ends."""

    def __init__(
        self,
        stream: IO[str],
        config: RunConfig,
        *,
        every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.config, self.every_s, self.clock = stream, config, every_s, clock
        self._written_at: float | None = None
        self._message = ""
        self._last: Progress | None = None
        self._warned = False

    def _emit(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()  # a log file shows it now, not when a buffer fills
        except OSError as e:
            self._warned = _output_failed(self.stream, e, self._warned)

    def line(self, progress: Progress) -> str:
        text = (
            f"tauflow run {self.config.name}: step {progress.version}/{self.config.steps}, "
            f"reward {progress.reward:.3f}, accuracy {_accuracy(progress)}, staleness {progress.staleness}, "
            f"{progress.tokens_per_s:,.0f} tokens/s, queue {progress.queue_depth} groups, "
            f"tau {_tau(self.config, progress)}, {progress.rollout_replicas} rollout replicas"
        )
        return f"{text}; {progress.message}" if progress.message else text

    def _write(self, progress: Progress) -> None:
        self._emit(self.line(progress) + "\n")
        self._written_at = self.clock()

    def update(self, progress: Progress) -> None:
        news = bool(progress.message) and progress.message != self._message
        self._message, self._last = progress.message, progress
        if news or self._written_at is None or self.clock() - self._written_at >= self.every_s:
            self._write(progress)

    def __enter__(self) -> Self:
        self._emit(
            f"tauflow run {self.config.name} (max_staleness={self.config.max_staleness}): "
            f"{self.config.steps} steps; progress every {self.every_s:g}s\n"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._last is not None:
            self._write(self._last)


def progress_view(
    console: Console,
    config: RunConfig,
    progress: Progress,
    *,
    every_s: float = PLAIN_EVERY_S,
    clock: Callable[[], float] = time.monotonic,
) -> LiveTable | PlainLines:
    """The live table where ``console`` is a terminal, plain lines on its stream otherwise."""
    if console.is_terminal:
        return LiveTable(console, config, progress)
    return PlainLines(console.file, config, every_s=every_s, clock=clock)
