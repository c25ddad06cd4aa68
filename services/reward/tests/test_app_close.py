"""The reward service's close: its workers end by SIGTERM, which skips their atexit, so the service sweeps the
case directories of dead processes as it ends (they stayed in TMPDIR until a later service's first case)."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from pathlib import Path

import pytest

from tauflow.reward.app import build
from tauflow.reward.config import RewardConfig


def test_the_service_removes_the_case_directories_of_dead_workers_as_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tauflow.reward.worker.not_dumpable", lambda: None)  # (this test process stays as it is)
    ended = subprocess.Popen(["true"])
    ended.wait()
    leftover = Path(tempfile.gettempdir()) / f"tauflow-code-{ended.pid}-closetest"  # a worker gone by SIGTERM
    (leftover / "tmpcase").mkdir(parents=True)
    app = asyncio.run(build(RewardConfig.model_validate({"pool": {"workers": 1}})))
    assert leftover.is_dir()
    assert app.close is not None
    app.close()
    assert not leftover.exists()
