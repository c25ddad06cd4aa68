"""Rollout replicas on a live run, and what the run's processes look like from outside.

``tauflow scale rollout N`` (ControllerService.ScaleRollout) sets a target; the controller's follow loop
carries it out (:meth:`RolloutScaler.reconcile`, with the run's supervision): new replicas take the
lowest free indices and are started without the loop waiting for them (each joins the weight sidecar and
loads the current version before it reserves: the rollout service's own start; the loop checks and counts
it once it serves); removed ones are those still starting, then the highest indices, stopped with SIGTERM
so that they drain (finish or release their tickets, put what they made, leave the sidecar). A replica that
cannot be started is logged and stopped, and the target falls back. With launcher
``external`` the deployment scales the replicas (ScaleRollout is refused, saying how); the controller
sees those that come and go through the weight sidecar's membership.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tauflow.controller.launcher import Launcher, Service, ServiceFailed, ServiceSpec
from tauflow.controller.ports import SidecarMember

log = logging.getLogger(__name__)

ROLLOUT = "rollout"


class ScalingRefused(RuntimeError):
    """This run's launcher does not start services (``external``): the deployment scales them."""


@dataclass(frozen=True)
class ServiceView:
    """One process of the run as ListServices and ``tauflow status`` show it."""

    name: str
    role: str
    index: int  # replica index or rank within the role
    replicas: int  # processes of the role now
    address: str
    health: str  # starting, serving, not_serving, restarting, failed, stopped
    restarts: int
    started_at: float | None = None  # Unix time of its last start
    last_checked_at: float | None = None
    last_error: str = ""
    handle: str = ""  # how the launcher knows it: a pid; empty with launcher external
    build_version: str = ""
    contracts: dict[str, int] = field(default_factory=dict)


class RolloutScaler:
    """The rollout replicas' target and the reconciliation of the launcher's replicas with it."""

    def __init__(self, replicas: int, limit: int) -> None:
        self.target = replicas
        self.limit = limit
        self.last_error = ""
        self.starting: set[str] = set()  # replicas begun and not yet serving

    def set_target(self, launcher: Launcher, replicas: int) -> int:
        """Sets the target (carried out by :meth:`reconcile`); returns the previous one."""
        if not 1 <= replicas <= self.limit:  # the argument first: a bad one is INVALID_ARGUMENT whatever the run
            raise ValueError(f"replicas={replicas} must be between 1 and {self.limit}")
        if not launcher.starts_services:
            raise ScalingRefused(
                "this run's launcher is 'external': its rollout servers are a deployment's, so scale the "
                "deployment (kubectl scale deployment/tauflow-rollout --replicas N, or docker compose up "
                "--scale rollout=N); each new server joins the queue and the weight sidecar on its own"
            )
        previous, self.target = self.target, replicas
        if previous != replicas:
            log.info("rollout target set", extra={"previous": previous, "replicas": replicas})
        return previous

    def reconcile(self, launcher: Launcher, spec: Callable[[int], ServiceSpec]) -> tuple[list[str], list[str]]:
        """Starts or stops replicas towards ``target``; returns (started, stopped): the replicas that serve
        since the last call, and those stopped (given up included). A new replica's start is begun here and
        not waited for (a model's load takes a while: the run's loop goes on meanwhile); a later call reports
        it once it serves. Stopping waits for the replica to drain. The run calls it from a thread."""
        started: list[str] = []
        stopped: list[str] = []
        if not launcher.starts_services:
            return started, stopped
        running = replicas_of(launcher.services.values(), ROLLOUT)
        # scaling in: those still starting go first, then the highest indices
        by_need = sorted(running, key=lambda svc: (svc.name not in self.starting, -svc.index))
        for svc in by_need[: max(len(running) - self.target, 0)]:
            launcher.stop_service(svc.name)
            self.starting.discard(svc.name)
            stopped.append(svc.name)
        for name in sorted(self.starting):  # begun by an earlier call: serving yet?
            try:
                if launcher.poll_start(name):
                    self.starting.discard(name)
                    started.append(name)
            except ServiceFailed as e:  # the one replica given up: the target one lower
                self._give_up(launcher, e, one_fewer=True)
                stopped.append(e.name)
        running = replicas_of(launcher.services.values(), ROLLOUT)
        indices = {svc.index for svc in running}
        free = (i for i in range(self.limit + 1) if i not in indices)
        for _ in range(self.target - len(running)):
            index = next(free)
            try:
                self.starting.add(launcher.begin_start(spec(index)).name)
            except ServiceFailed as e:  # no room for it (and so none for more): the target falls back to what runs
                self._give_up(launcher, e, one_fewer=False)
                stopped.append(e.name)
                break
        for name in started + stopped:
            log.info("rollout replica " + ("started" if name in started else "stopped"), extra={"service": name})
        return started, stopped

    def _give_up(self, launcher: Launcher, failure: ServiceFailed, one_fewer: bool) -> None:
        """A replica that could not start: stopped; the target one fewer (``one_fewer``: a target raised
        since it was begun stays raised), or what runs now (no room for one more)."""
        self.last_error = str(failure)
        self.starting.discard(failure.name)
        # given up, not supervised: check() would otherwise restart it, again and again, each restart
        # blocking the run's loop while the process fails to start
        if failure.name in launcher.services:
            launcher.stop_service(failure.name)
        self.target = max(self.target - 1 if one_fewer else len(replicas_of(launcher.services.values(), ROLLOUT)), 1)
        log.error("a rollout replica could not start; the target falls back", extra={"error": str(failure)})


def replicas_of(services: Sequence[Service] | Any, role: str) -> list[Service]:
    """The processes of ``role`` among ``services``, by index."""
    return sorted((svc for svc in services if svc.role == role), key=lambda svc: svc.index)


def health_of(launcher: Launcher, svc: Service) -> str:
    """A process's health as ListServices says it (ServiceHealth, lower case)."""
    if not launcher.starts_services:
        return "serving" if svc.up else "not_serving"
    if not svc.info:
        return "starting"
    if not svc.up:
        return "restarting"
    if launcher.health is not None and not launcher.health.answering(svc.name):
        return "not_serving"
    return "serving"


def address_of(launcher: Launcher, svc: Service) -> str:
    """A process's gRPC address; "" while a started process has not yet said its port (its ready file)."""
    return svc.address if svc.info or not launcher.starts_services else ""


def list_services(
    launcher: Launcher, records: dict[str, dict[str, Any]], members: Sequence[SidecarMember]
) -> list[ServiceView]:
    """Every process the launcher knows, and (launcher external) every rollout server the sidecar lists
    that it does not know: sorted by name."""
    services = list(launcher.services.values())
    counts: dict[str, int] = {}
    for svc in services:
        counts[svc.role] = counts.get(svc.role, 0) + 1
    known = {address_of(launcher, svc) for svc in services}
    extra = [m for m in members if m.address not in known]
    if extra:
        counts[ROLLOUT] = counts.get(ROLLOUT, 0) - sum(1 for s in services if s.role == ROLLOUT) + len(extra)
    views = []
    for svc in services:
        record = records.get(svc.name, {})
        views.append(
            ServiceView(
                name=svc.name,
                role=svc.role,
                index=svc.index,
                replicas=counts[svc.role],
                address=address_of(launcher, svc),
                health=health_of(launcher, svc),
                restarts=max(0, svc.starts - 1),
                started_at=svc.started_wall or None,
                handle=str(svc.info.get("pid", "")) if launcher.starts_services else "",
                build_version=record.get("build_version", ""),
                contracts=dict(record.get("contracts", {})),
            )
        )
    for index, member in enumerate(extra):
        views.append(
            ServiceView(member.member_id, ROLLOUT, index, counts[ROLLOUT], member.address, "serving", 0, time.time())
        )
    return sorted(views, key=lambda v: v.name)
