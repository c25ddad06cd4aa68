"""Staging files of stagers that died (a trainer SIGKILLed) are removed by the next stager; live ones are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tauflow.weightsync import Stager, read_staged, remove_stale_staging
from tauflow.weightsync.errors import StagingError
from tauflow.weightsync.staging import OWN_PREFIX, SHM_DIR

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")

TRAINER = """
import sys, time, torch
from tauflow.weightsync import Stager
s = Stager()
s.stage({"w": torch.ones(1024)}, 1)
print(s.path, flush=True)
time.sleep(120)
"""


class Trainer:
    """A process that stages a version with a default Stager and then waits (until killed)."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        self.path = Path(self.proc.stdout.readline().strip())
        assert self.path.name.startswith(OWN_PREFIX) and self.path.exists()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    started: list[Trainer] = []
    yield started
    for t in started:
        t.kill()
        t.path.unlink(missing_ok=True)


def test_the_staging_file_of_a_killed_trainer_is_removed_by_the_next_stager(trainers: list[Trainer]) -> None:
    dead, alive = Trainer(), Trainer()
    trainers += [dead, alive]
    dead.kill()
    assert dead.path.exists()  # SIGKILL: nothing removed it
    other = SHM_DIR / f"tauflow-test-{uuid.uuid4().hex[:8]}"  # not a name a stager picks: never touched
    other.write_bytes(b"x")
    try:
        stager = Stager()
        try:
            assert not dead.path.exists()
            assert alive.path.exists()  # its process holds the lock
            assert other.exists()
            assert stager.path.exists() and stager.path.name.startswith(f"{OWN_PREFIX}{os.getpid()}-")
            manifest = stager.stage({"w": torch.zeros(8)}, 1)
            assert stager.path.stat().st_size == manifest.total_bytes
        finally:
            stager.close()
        assert not stager.path.exists()
    finally:
        other.unlink()


def test_a_stager_in_use_in_this_process_is_never_taken_for_a_dead_one() -> None:
    first = Stager()
    try:
        first.stage({"w": torch.ones(4)}, 1)  # writes go through a copy of the locked descriptor
        assert first.path not in remove_stale_staging()
        second = Stager()
        assert first.path.exists()
        second.close()
    finally:
        first.close()
    # closed: removed at once, and nothing is left for the next stager to clean
    assert not first.path.exists()


def test_an_unlocked_file_of_the_pattern_is_stale() -> None:
    leftover = SHM_DIR / f"{OWN_PREFIX}999999999-{uuid.uuid4().hex[:8]}"
    leftover.write_bytes(b"old version")
    assert leftover in remove_stale_staging()
    assert not leftover.exists()


def test_a_stager_names_its_file_where_tauflow_staging_dir_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAUFLOW_STAGING_DIR", str(tmp_path))
    stager = Stager()
    try:
        assert stager.uri.startswith(f"file://{tmp_path}/tauflow-weights-")
        manifest = stager.stage({"w": torch.ones(4)}, 1)
        assert stager.path.stat().st_size == manifest.total_bytes
    finally:
        stager.close()


def test_a_version_that_does_not_fit_is_refused_before_a_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stager = Stager(f"file://{tmp_path}/staged")
    monkeypatch.setattr(os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=1, f_frsize=4096))
    with pytest.raises(StagingError, match="0 MiB free and this version needs 0 MiB more.*TAUFLOW_STAGING_DIR"):
        stager.stage({"w": torch.ones(1 << 16)}, 1)
    assert stager.path.stat().st_size == 0  # nothing written, not even the file's length


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_staging_uri_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """A FIFO with no writer blocked the open, and with it the sidecar's thread, for ever (past the hand-off
    deadline); a directory failed on the first read with an error no caller maps."""
    manifest = Stager(f"file://{tmp_path}/staged").stage({"w": torch.ones(4)}, 1)
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    outcome: list[BaseException | str] = []

    def read() -> None:
        try:
            outcome.append(
                read_staged(
                    f"file://{path}", manifest, torch.empty(manifest.total_bytes, dtype=torch.uint8), roots=[tmp_path]
                )
            )
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        reader.join(5)
        assert outcome, "read_staged blocked"
        assert isinstance(outcome[0], StagingError) and "not a regular file" in str(outcome[0])
    finally:
        if reader.is_alive():  # (a writer that comes and goes releases a blocked open)
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
