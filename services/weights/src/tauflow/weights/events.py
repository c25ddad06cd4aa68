"""What the parts of the sidecar tell each other: a change of state, the last phase failure, background closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tauflow.weights.metrics import WeightsMetrics
from tauflow.weightsync import PhaseError

log = logging.getLogger("tauflow.weights.sidecar")  # the logger name the sidecar's log lines always had


class Events:
    """Shared by retention, membership and broadcast; ``clock`` is the sidecar's wall clock (GetStatus's times)."""

    def __init__(self, metrics: WeightsMetrics, clock: Callable[[], float], refresh_gauges: Callable[[], None]) -> None:
        self.metrics = metrics
        self.clock = clock
        self.refresh_gauges = refresh_gauges
        self.wake = asyncio.Event()  # the broadcast loop waits on it for work
        self.changed = asyncio.Event()  # replaced at every change: a waiter for confirmations sees each one
        self.last_error: PhaseError | None = None
        self.last_error_at: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def notify(self) -> None:
        """Something changed: wake the loop, end waits for confirmations, refresh the gauges."""
        self.wake.set()
        self.changed.set()
        self.changed = asyncio.Event()
        self.refresh_gauges()

    def record(self, err: PhaseError) -> None:
        self.last_error = err
        self.last_error_at = self.clock()
        self.metrics.phase_failures.labels(err.phase.value).inc()
        log.warning("%s", err, extra={"phase": err.phase.value, "peer": err.peer})

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs ``coro`` in the background (a member's client closing), keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
