"""Notices when the controller's own event loop did not run: the process was paused (SIGSTOP, a frozen VM or
container) or starved. The run's stall timeout counts only the time the controller watched:
a controller stopped for 22 s with a 10 s stall timeout ended a healthy run as "stalled" on waking, though the
trainer had gone from version 5 to 132 meanwhile (its first poll, in flight across the pause, had passed its
deadline)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger(__name__)


class LoopWatchdog:
    """``run()`` ticks every ``tick_s``; a gap past ``frozen_s`` between ticks is time the loop did not run
    (a freeze). ``unwatched_s(since)``: how much of the time from ``since`` to now it did not run."""

    def __init__(self, tick_s: float = 1.0, frozen_s: float = 5.0) -> None:
        self.tick_s, self.frozen_s = tick_s, frozen_s
        self.ticked_at = time.monotonic()
        self.freezes: deque[tuple[float, float]] = deque(maxlen=1024)  # (from, to), monotonic

    async def run(self) -> None:
        self.ticked_at = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        gap = now - self.ticked_at
        if gap > self.frozen_s:
            self.freezes.append((self.ticked_at, now))
            log.warning(
                "the controller did not run for a while (paused, or starved); stall timeouts leave that time out",
                extra={"unwatched_s": round(gap, 1)},
            )
        self.ticked_at = now

    def unwatched_s(self, since: float) -> float:
        """Seconds from ``since`` to now that the loop did not run: the freezes measured, and one still open
        (the first callbacks after a pause may run before the tick that measures it)."""
        now = time.monotonic()
        spans = [*self.freezes, *([(self.ticked_at, now)] if now - self.ticked_at > self.frozen_s else [])]
        return sum(max(0.0, end - max(start, since)) for start, end in spans)
