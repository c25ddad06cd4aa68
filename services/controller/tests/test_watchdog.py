"""The stall timeout counts only the time the controller watched: a controller paused longer than
stall_timeout_s (SIGSTOP, a frozen VM) ended a healthy run as "stalled" on waking."""

from __future__ import annotations

import asyncio
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
            start = time.monotonic()
            await asyncio.sleep(0.3)
            assert watchdog.unwatched_s(start) == 0.0  # ticking: never stopped
            time.sleep(0.5)  # noqa: ASYNC251 - the loop does not run (as under SIGSTOP)
            # before the tick that measures the gap: the open gap counts already
            assert 0.5 <= watchdog.unwatched_s(start) < 1.5
            await asyncio.sleep(0.1)
            assert len(watchdog.freezes) == 1 and 0.5 <= watchdog.unwatched_s(start) < 1.5
            assert watchdog.unwatched_s(time.monotonic() - 0.05) == 0.0  # none of it after its end
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_a_pause_of_the_controller_is_no_stall_of_the_run_but_the_time_around_it_is(tmp_path: Path) -> None:
    roles = ("queue", "reward", "weights", "trainer", "rollout")
    config = RunConfig(model="m", dataset="d", steps=2, out_dir=str(tmp_path), launcher="external",
                       external={role: "127.0.0.1:9" for role in roles}, stall_timeout_s=10)  # fmt: skip
    run = build_run(config, serve_metrics=False)
    now = time.monotonic()
    following = Following(progressed_at=now - 30)  # no progress seen for 30 s
    assert run._stalled(following)
    run._watchdog.ticked_at = now - 25  # ... of which the controller slept 25 s, a gap still open: 5 s watched
    assert not run._stalled(following)
    run._watchdog.ticked_at = now
    run._watchdog.freezes.append((now - 25, now - 3))  # a 22 s pause, measured: 8 s watched
    assert not run._stalled(following)
    following.progressed_at = now - 40  # 18 s watched: a stall, whatever the pause in it
    assert run._stalled(following)
