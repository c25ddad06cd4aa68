"""The stall timeout counts only the time the controller watched: a controller paused longer than
stall_timeout_s (SIGSTOP, a frozen VM) ended a healthy run as "stalled" on waking."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.run import Following
from tauflow.controller.watchdog import LoopWatchdog


def test_the_watchdog_tells_when_the_loop_did_not_run() -> None:
    async def scenario() -> None:
        watchdog = LoopWatchdog(tick_s=0.02, frozen_s=0.2)
        task = asyncio.create_task(watchdog.run())
        try:
            await asyncio.sleep(0.3)
            assert watchdog.watching_since() == -math.inf  # ticking: never stopped
            frozen_at = time.monotonic()
            time.sleep(0.5)  # noqa: ASYNC251 - the loop does not run (as under SIGSTOP)
            woke = time.monotonic()
            # before the tick that measures the gap: watching from now
            assert watchdog.watching_since() >= woke
            await asyncio.sleep(0.1)
            assert frozen_at + 0.5 <= watchdog.resumed_at <= time.monotonic()
            assert watchdog.watching_since() == watchdog.resumed_at
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_a_pause_of_the_controller_is_no_stall_of_the_run(tmp_path: Path) -> None:
    roles = ("queue", "reward", "weights", "trainer", "rollout")
    config = RunConfig(model="m", dataset="d", steps=2, out_dir=str(tmp_path), launcher="external",
                       external={role: "127.0.0.1:9" for role in roles}, stall_timeout_s=10)  # fmt: skip
    run = build_run(config, serve_metrics=False)
    now = time.monotonic()
    following = Following(progressed_at=now - 30)  # no progress seen for 30 s
    assert run._stalled(following)
    run._watchdog.ticked_at = time.monotonic() - 25  # ... of which the controller slept 25 s: a gap still open
    assert not run._stalled(following)
    run._watchdog.ticked_at = time.monotonic()
    run._watchdog.resumed_at = time.monotonic() - 3  # awake again for 3 s: 3 s watched, not 30
    assert not run._stalled(following)
    run._watchdog.resumed_at = time.monotonic() - 11  # awake for 11 s without progress: a stall
    assert run._stalled(following)
