"""What the parts of the sidecar tell each other: a change of state, the last phase failure, background closes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tauflow.weights.metrics import WeightsMetrics
from tauflow.weightsync import PhaseError

log = logging.getLogger("tauflow.weights.sidecar")  # the logger name the sidecar's log lines always had

WARN_EVERY_S = 30.0  # a warning that repeats (a caller retrying a refused call) is logged at most this often
_WARN_KEYS = 1024  # keys remembered (callers name them: bounded)


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
        self._warned: dict[object, tuple[float, int]] = {}  # key -> (when last logged, repeats not logged since)

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

    def warn_limited(self, key: object, message: str, extra: dict[str, object]) -> None:
        """Logs a WARNING, at most once per ``WARN_EVERY_S`` per ``key``; the next one logged says how many
        were left out meanwhile (``repeats``)."""
        now = time.monotonic()
        last = self._warned.get(key)
        if last is not None and now - last[0] < WARN_EVERY_S:
            self._warned[key] = (last[0], last[1] + 1)
            return
        if last is None and len(self._warned) >= _WARN_KEYS:
            self._warned = {k: v for k, v in self._warned.items() if now - v[0] < WARN_EVERY_S}
            if len(self._warned) >= _WARN_KEYS:
                self._warned.clear()
        self._warned[key] = (now, 0)
        log.warning(message, extra={**extra, "repeats": last[1] if last else 0})
