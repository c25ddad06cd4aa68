"""The run's supervision of a restarted process that does not answer: the run goes on and asks again (a
restarted role that hung, or died again at once, ended the controller with a traceback and left its summary
"running"), and a real check of a process that does not answer gives up within its deadline."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tauflow.controller.adapters.compat import check_peer
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.ports import PeerUnavailable
from tauflow.controller.run import Following


def test_a_restarted_process_that_does_not_answer_is_asked_again_and_the_run_goes_on(tmp_path: Path) -> None:
    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)), serve_metrics=False)
    restarts = [["queue"], [], []]
    launcher = SimpleNamespace(
        services={"queue": SimpleNamespace(role="queue", address="127.0.0.1:1", index=0)},
        starts_services=True,
        check=lambda: restarts.pop(0),
    )
    run.launcher = launcher  # type: ignore[assignment]
    run.scaler.reconcile = lambda *args: ([], [])  # type: ignore[method-assign]
    run._write_targets = lambda: None  # type: ignore[method-assign]
    answers: list[str] = ["hangs", "serves"]
    asked: list[float] = []

    async def checker(role: str, address: str, records: dict[str, Any], name: str = "", follower: bool = False,
                      timeout_s: float = 30.0) -> dict[str, Any]:  # fmt: skip
        asked.append(timeout_s)
        if answers.pop(0) == "hangs":
            raise PeerUnavailable(role, "DEADLINE_EXCEEDED")
        return records.setdefault(name or role, {"checks": 1})

    run.check_peer = checker

    async def three_passes() -> None:
        following = Following(progressed_at=time.monotonic())
        for _ in range(3):
            await run._supervise(None, following)  # type: ignore[arg-type]

    asyncio.run(three_passes())
    assert asked == [5.0, 5.0]  # asked again on the next pass, then no more; never the 30 s default
    assert run.summary.services["queue"] == {"checks": 1} and not run._unchecked


def test_the_check_of_a_process_that_does_not_answer_ends_at_its_deadline() -> None:
    with socket.socket() as listener:  # accepts connections (the kernel does) but never answers: a hung process
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match="queue: DEADLINE_EXCEEDED"):
            asyncio.run(check_peer("queue", address, {}, timeout_s=1.0))
        assert time.monotonic() - started < 5
