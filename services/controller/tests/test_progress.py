"""What `tauflow run` shows: off a terminal (a log file, a pipe) plain lines every few seconds and at each news,
so that a log says how far the run is; on a terminal the live table."""

from __future__ import annotations

import errno
import io
import logging
import os

import pytest
from rich.console import Console

from tauflow.controller.config import RunConfig
from tauflow.controller.progress import LiveTable, PlainLines, Progress, RunConsole, progress_view

CONFIG = RunConfig(name="addition", model="m", dataset="d", steps=100, max_staleness=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_the_progress_is_plain_lines_every_few_seconds() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress()
    view = progress_view(Console(file=stream), CONFIG, progress, every_s=5.0, clock=clock)
    assert isinstance(view, PlainLines)  # a StringIO is no terminal, as a log file is not
    with view:
        progress.message = "starting queue"
        view.update(progress)
        progress.message = "starting reward"  # news: said at once
        view.update(progress)
        progress.message = ""
        progress.version, progress.steps, progress.reward, progress.staleness = 3, 3, 0.25, 1
        progress.tokens_per_s, progress.queue_depth = 1234.4, 16
        progress.max_staleness, progress.rollout_replicas = 0, 2  # tauflow set / scale on the live run
        clock.now = 1.0
        view.update(progress)  # nothing new within the 5 s
        clock.now = 5.0
        view.update(progress)
        progress.version, progress.accuracy = 4, 0.412
        clock.now = 6.0
        view.update(progress)
    lines = stream.getvalue().splitlines()
    starting = (
        "tauflow run addition: step 0/100, reward 0.000, accuracy -, staleness 0, 0 tokens/s, queue 0 groups, "
        "tau 2, 0 rollout replicas"
    )
    later = "1,234 tokens/s, queue 16 groups, tau 0, 2 rollout replicas"
    assert lines == [
        "tauflow run addition (max_staleness=2): 100 steps; progress every 5s",
        f"{starting}; starting queue",
        f"{starting}; starting reward",
        f"tauflow run addition: step 3/100, reward 0.250, accuracy -, staleness 1, {later}",
        # the run's end: its last state
        f"tauflow run addition: step 4/100, reward 0.250, accuracy 41.2%, staleness 1, {later}",
    ]


def test_on_a_terminal_the_progress_is_the_live_table() -> None:
    stream = io.StringIO()
    progress = Progress(version=7)
    view = progress_view(Console(file=stream, force_terminal=True, width=100), CONFIG, progress)
    assert isinstance(view, LiveTable)
    with view:
        view.update(progress)
    assert "tauflow run addition  (max_staleness=2)" in stream.getvalue() and "7 / 100" in stream.getvalue()


def test_a_progress_pipe_whose_reader_went_away_ends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # `tauflow run ... 2>&1 | head -n 3`: once head exited, the next line raised BrokenPipeError and the run
    # stopped every service, "failed"
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream, clock = os.fdopen(write_end, "w"), Clock()
    progress = Progress()
    try:
        with caplog.at_level(logging.WARNING), PlainLines(stream, CONFIG, every_s=5.0, clock=clock) as view:
            for step in range(3):
                progress.version, clock.now = step, clock.now + 6
                view.update(progress)  # (each would raise)
        stream.write("the final lines find a sink\n")
        stream.flush()
    finally:
        stream.close()
    warnings = [r for r in caplog.records if "progress output failed" in r.getMessage()]
    assert len(warnings) == 1  # once, not per line


def test_a_progress_stream_on_a_full_disk_skips_lines_and_goes_on() -> None:
    class FullDisk(io.StringIO):
        full = True

        def write(self, text: str) -> int:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    stream, clock = FullDisk(), Clock()
    progress = Progress()
    with PlainLines(stream, CONFIG, every_s=5.0, clock=clock) as view:
        view.update(progress)
        stream.full = False  # the space came back: lines again
        progress.version, clock.now = 7, 10.0
        view.update(progress)
    assert "step 7/100" in stream.getvalue()


def test_the_final_lines_to_a_pipe_whose_reader_went_away_leave_the_exit_code_to_the_run() -> None:
    # rich answers a BrokenPipeError with SystemExit(1): a run trained to its end exited 1 when `| head` had
    # exited before the summary line
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = os.fdopen(write_end, "w")
    try:
        console = RunConsole(file=stream, width=100)
        console.print("run addition: 100 steps")  # (raised SystemExit with rich's Console)
        assert console.quiet
        console.print("target reached")  # quiet now: nothing written, nothing raised
        stream.write("Python's own flush at exit finds a sink\n")
        stream.flush()
    finally:
        stream.close()
