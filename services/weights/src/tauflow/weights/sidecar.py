"""The sidecar's domain, composed: the one object the servicer holds (its parts take the calls), and the
broadcast loop app.py runs (``sidecar.broadcast.run``).

* ``retention.py``: the versions held, Publish (idempotent per version) and GetManifest;
* ``membership.py``: members joining, leaving, confirming, dropped;
* ``broadcast.py``: the loop (group rebuild, transfer, confirm);
* ``events.py``: what they tell each other (a change of state, the last phase failure).

No grpc here: rollout servers are reached through the ``MemberClient`` port (``ports.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tauflow.weights.broadcast import Broadcast, Progress, phase_deadlines
from tauflow.weights.config import WeightsConfig
from tauflow.weights.events import Events
from tauflow.weights.membership import Member, Membership
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.ports import MemberClientFactory
from tauflow.weights.retention import Retention
from tauflow.weightsync import Phase, PhaseError, StoreHost


@dataclass(frozen=True)
class Status:
    """What GetStatus reports."""

    membership_epoch: int
    members: list[Member]
    backend: str
    phase_deadlines: dict[Phase, float]
    latest_version: int | None
    confirmed_version: int | None
    progress: Progress | None
    last_error: PhaseError | None
    last_error_at: float | None


class Sidecar:
    def __init__(
        self,
        config: WeightsConfig,
        store: StoreHost,
        clients: MemberClientFactory,
        metrics: WeightsMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = metrics or WeightsMetrics.null()
        self.events = Events(self.metrics, clock, self._refresh_gauges)
        self.retention = Retention(config, self.events, self.metrics)
        self.membership = Membership(config, self.retention, clients, self.events, self.metrics)
        self.broadcast = Broadcast(config, store, self.retention, self.membership, self.events, self.metrics)

    def _refresh_gauges(self) -> None:
        self.metrics.observe(
            latest=self.retention.latest_version,
            confirmed=self.broadcast.confirmed_version,
            epoch=self.membership.epoch,
            members=self.membership.counts(),
            retained_bytes=self.retention.retained_bytes(),
        )

    def phase_deadlines(self) -> dict[Phase, float]:
        return phase_deadlines(self.config.deadlines)

    def status(self) -> Status:
        return Status(
            membership_epoch=self.membership.epoch,
            members=list(self.membership.members.values()),
            backend=self.config.backend,
            phase_deadlines=self.phase_deadlines(),
            latest_version=self.retention.latest_version,
            confirmed_version=self.broadcast.confirmed_version,
            progress=self.broadcast.progress,
            last_error=self.events.last_error,
            last_error_at=self.events.last_error_at,
        )
