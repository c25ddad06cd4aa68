"""``launcher: external``: the services are deployed by someone else (Kubernetes, compose); the controller
starts nothing and stops nothing.

``start`` waits until the role's address (``external.<role>``) answers gRPC health ``SERVING``, within
``start_timeout_s``, and fails naming the role, the address and the last answer otherwise. The settings
the controller derives for a role are not applied: the deployment configures its services, and must agree
with the run config (``steps``, ``max_staleness``, ``groups_per_step``, model, ...). ``check`` asks every
role's health: a role that was not serving and serves again (its deployment restarted it) is reported as
restarted, as the process launchers report theirs, so the run treats it the same way; the launcher itself
restarts nothing, and a role that stays away ends the run through its stall timeout. ``stop`` stops
nothing: at the end the trainer has finished, and the services stay up until their deployment removes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tauflow.controller.health import probe
from tauflow.controller.launcher import Rendezvous, ServiceFailed, ServiceSpec
from tauflow.controller.ports import HealthCheck

log = logging.getLogger(__name__)


@dataclass
class ExternalService:
    name: str
    address: str
    info: dict[str, Any] = field(default_factory=dict)  # nothing known: its metrics are its deployment's to scrape
    starts: int = 0  # 1 at start, +1 each time it serves again after an outage
    up: bool = False
    started_wall: float = 0.0  # Unix time it was (last) found serving

    @property
    def role(self) -> str:
        return self.name

    @property
    def index(self) -> int:
        return 0


class ExternalLauncher:
    starts_services = False
    health = None  # no probe of live processes: ``check`` asks every role's health itself (``up``)

    def __init__(
        self,
        addresses: Mapping[str, str],
        health_check: HealthCheck,
        *,
        start_timeout_s: float = 120.0,
        health_timeout_s: float = 2.0,
        check_every_s: float = 2.0,
    ) -> None:
        self._addresses = dict(addresses)
        self.health_check = health_check  # app.py wires the gRPC one
        self.start_timeout_s = start_timeout_s
        self.health_timeout_s = health_timeout_s  # the deadline of each health check
        self.check_every_s = check_every_s
        self.services: dict[str, ExternalService] = {}
        self._checked_at = 0.0
        self.stopping = False  # set by stop: a launch still waiting for a role gives up

    def start(self, spec: ServiceSpec) -> ExternalService:
        """Waits until the role's address serves; starts nothing."""
        address = self._addresses.get(spec.name, "")
        if not address:
            raise ServiceFailed(spec.name, f"launcher 'external' has no address for it: set external.{spec.name}")
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.stopping:
                raise ServiceFailed(spec.name, "the run is stopping: nothing more connects")
            serving, answer = self.health_check(address, self.health_timeout_s)
            if serving:
                break
            if time.monotonic() > deadline:
                raise ServiceFailed(
                    spec.name,
                    f"not SERVING at {address} (external.{spec.name}) within "
                    f"{self.start_timeout_s:.0f}s; last answer: {answer}",
                )
            time.sleep(0.5)
        svc = self.services.setdefault(spec.name, ExternalService(spec.name, address))
        svc.up, svc.starts, svc.started_wall = True, svc.starts + 1, time.time()
        log.info("connected", extra={"service": spec.name, "address": address})
        return svc

    def check(self) -> list[str]:
        """Roles that serve again after not serving (their deployment restarted them); every
        ``check_every_s`` at most."""
        if time.monotonic() - self._checked_at < self.check_every_s or not self.services:
            return []
        self._checked_at = time.monotonic()
        answers = probe(
            self.health_check, {name: svc.address for name, svc in self.services.items()}, self.health_timeout_s
        )
        back = []
        for svc, (serving, answer) in zip(self.services.values(), answers.values(), strict=True):
            if serving and not svc.up:
                svc.starts, svc.started_wall = svc.starts + 1, time.time()
                back.append(svc.name)
                log.warning("serving again", extra={"service": svc.name, "address": svc.address})
            elif svc.up and not serving:
                log.warning("not serving", extra={"service": svc.name, "answer": answer})
            svc.up = serving
        return back

    def begin_start(self, spec: ServiceSpec) -> ExternalService:
        """As :meth:`start` (connecting is all there is: the run never scales an external deployment)."""
        return self.start(spec)

    def poll_start(self, name: str) -> bool:
        return name in self.services

    def start_gang(self, specs: list[ServiceSpec], rendezvous: Rendezvous) -> list[ExternalService]:
        """A gang is its deployment's to start (e.g. a trainer's ranks): connects to its first (rank 0)."""
        return [self.start(specs[0])]

    def stop_service(self, name: str) -> int | None:
        raise ServiceFailed(name, "launcher 'external' stops nothing: the service is its deployment's")

    def update_settings(self, role: str, settings: Mapping[str, Any]) -> None:
        """Nothing to keep: the deployment configures its services (the run re-applies a live τ itself)."""

    def stop(self, order: Sequence[Sequence[str]] | None = None, grace_s: float | None = None) -> dict[str, int | None]:
        """Stops nothing: the services are their deployment's (a launch still waiting for one gives up)."""
        self.stopping = True
        return {}

    def addresses(self) -> Mapping[str, str]:
        return {name: svc.address for name, svc in self.services.items()}
