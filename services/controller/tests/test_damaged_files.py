"""Files a previous run left damaged (a crash mid-write, a hand edit): read as absent, or refused with a
message, never a traceback. A ready file holding {"pid": 1e400} ended `--resume` with OverflowError; a
controller.ready.json holding [] or null ended `tauflow status|set|scale` with AttributeError."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tauflow.controller.adapters.controller_client import READY_FILE, ControlError, control_address, live_runs
from tauflow.controller.launcher import LocalLauncher


@pytest.mark.parametrize("text", ['{"pid": 1e400}', '{"pid": -1e400}', '{"pid": "x"}', "[]", "null", "{"])
def test_a_damaged_ready_file_of_a_previous_process_is_read_as_no_process(tmp_path: Path, text: str) -> None:
    ready = tmp_path / "queue.ready.json"
    ready.write_text(text)
    svc = SimpleNamespace(name="queue", ready_file=ready, spec=SimpleNamespace(module="queue"))
    LocalLauncher(tmp_path)._wait_for_previous(svc)  # type: ignore[arg-type]  # returns at once


@pytest.mark.parametrize("text", ["[]", "null", '"x"', "{", '{"control_address": 5}', '{"pid": 1e400}'])
def test_a_damaged_controller_ready_file_is_refused_with_a_message(tmp_path: Path, text: str) -> None:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / READY_FILE).write_text(text)
    with pytest.raises(ControlError, match=str(run)):
        control_address(str(run))
    assert live_runs(tmp_path / "runs") == []


def test_a_run_whose_controller_has_ended_is_said_to_have_ended(tmp_path: Path) -> None:
    # its ready file stays: `tauflow status` printed gRPC's "connection refused" for every finished run
    import json
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / READY_FILE).write_text(json.dumps({"pid": int(gone.stdout), "control_address": "127.0.0.1:1"}))
    (run / "summary.json").write_text(json.dumps({"status": "below_target"}))
    with pytest.raises(ControlError, match=r"is not running: its controller \(pid \d+\) has ended \(below_target; see"):
        control_address(str(run))
    (run / READY_FILE).write_text(json.dumps({"pid": 1, "control_address": "127.0.0.1:1"}))  # alive: its address
    assert control_address(str(run)) == "127.0.0.1:1"
    # with run.lock, its holder decides, not a pid (which another pid namespace, a container, cannot see)
    import fcntl
    import os

    (run / "run.lock").write_text("1\n")
    with pytest.raises(ControlError, match="has ended"):
        control_address(str(run))  # pid 1 runs, but nobody holds the lock: ended
    (run / READY_FILE).write_text(json.dumps({"pid": int(gone.stdout), "control_address": "127.0.0.1:1"}))
    fd = os.open(run / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert control_address(str(run)) == "127.0.0.1:1"  # held: the run goes on, whatever the pid says
    finally:
        os.close(fd)
