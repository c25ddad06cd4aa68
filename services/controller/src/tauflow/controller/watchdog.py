"""Notices when the controller's own event loop did not run: the process was paused (SIGSTOP, a frozen VM or
container, a laptop's suspend) or starved. The run's stall timeout counts only the time the controller watched:
a controller stopped for 22 s with a 10 s stall timeout ended a healthy run as "stalled" on waking, though the
trainer had gone from version 5 to 132 meanwhile (its first poll, in flight across the pause, had passed its
deadline)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

log = logging.getLogger(__name__)


class LoopWatchdog:
    """``run()`` ticks every ``tick_s``; a gap past ``frozen_s`` between ticks is time the loop did not run.
    ``watching_since()`` is when the loop last began watching again (``-inf`` if it never stopped)."""

    def __init__(self, tick_s: float = 1.0, frozen_s: float = 5.0) -> None:
        self.tick_s, self.frozen_s = tick_s, frozen_s
        self.ticked_at = time.monotonic()
        self.resumed_at = -math.inf

    async def run(self) -> None:
        self.ticked_at = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        gap = now - self.ticked_at
        if gap > self.frozen_s:
            self.resumed_at = now
            log.warning(
                "the controller did not run for a while (paused, or starved); stall timeouts count from now",
                extra={"unwatched_s": round(gap, 1)},
            )
        self.ticked_at = now

    def watching_since(self) -> float:
        """The monotonic time from which the loop has watched without a gap; now, while a gap is still open
        (the first callbacks after a pause may run before the tick that measures it)."""
        now = time.monotonic()
        if now - self.ticked_at > self.frozen_s:
            return now
        return self.resumed_at
