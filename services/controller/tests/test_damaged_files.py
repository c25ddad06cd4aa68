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
