"""Whether each role answers: the launchers' gRPC health probe of the services they know.

A process that is alive is not always serving: a stopped (SIGSTOP), hung or swapped-out process keeps its
pid, so the process launchers' exit check cannot see it. Every ``every_s`` the launcher asks each role's
gRPC health (the ``HealthCheck`` port; app.py wires adapters/health_client.py: one deadline of ``timeout_s``
per call, all roles at once so one that hangs delays none of the others) and records what changed: a role that stops answering is logged
once (``service not answering health``, with the probe's answer) and counted
(``tauflow_controller_service_unanswered_total``); when it answers again, that is logged with how long it
was away. The probe restarts nothing: a role that never answers again ends the run through the run's
``stall_timeout_s``, as a hung role always did; a supervisor that kills for it is Kubernetes' liveness
probe (deploy/k8s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tauflow.controller.ports import HealthCheck

log = logging.getLogger(__name__)


def probe(check: HealthCheck, addresses: Mapping[str, str], timeout_s: float) -> dict[str, tuple[bool, str]]:
    """``{role: (serving, answer)}`` for each role's address, asked at once, each within ``timeout_s``."""
    if not addresses:
        return {}
    names = list(addresses)
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: check(addresses[name], timeout_s), names))
    return dict(zip(names, answers, strict=True))


@dataclass
class Answering:
    """What the probe knows of one role."""

    answering: bool = True
    since: float = 0.0  # monotonic time of the last change
    unanswered: int = 0  # times it stopped answering (the counter)
    answer: str = ""  # the probe's last answer


class HealthProbe:
    def __init__(self, check: HealthCheck, *, timeout_s: float = 3.0, every_s: float = 2.0) -> None:
        self.health_check = check
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.roles: dict[str, Answering] = {}
        self._probed_at = 0.0

    def check(self, addresses: Mapping[str, str], alive: Callable[[str], bool] = lambda name: True) -> list[str]:
        """Probes the roles at ``addresses`` (those whose process is up) once ``every_s`` has passed; returns
        the roles that stopped answering at this probe. A role whose process is found dead (``alive``) once
        the probe is answered is left to the exit check: its silence was its death, not a hang."""
        now = time.monotonic()
        if now - self._probed_at < self.every_s or not addresses:
            return []
        self._probed_at = now
        gone = []
        for name, (serving, answer) in probe(self.health_check, addresses, self.timeout_s).items():
            role = self.roles.setdefault(name, Answering(since=now))
            role.answer = answer
            if role.answering and not serving and alive(name):
                role.answering, role.since = False, now
                role.unanswered += 1
                gone.append(name)
                log.warning("service not answering health", extra={"service": name, "answer": answer})
            elif serving and not role.answering:
                log.warning(
                    "service answers health again", extra={"service": name, "after_s": round(now - role.since, 1)}
                )
                role.answering, role.since = True, now
        return gone

    def restarted(self, name: str) -> None:
        """A new process of ``name`` is ready: it answers (its predecessor's silence is not its own)."""
        role = self.roles.get(name)
        if role is not None and not role.answering:
            role.answering, role.since = True, time.monotonic()

    def answering(self, name: str) -> bool:
        role = self.roles.get(name)
        return role is None or role.answering

    def unanswered(self, name: str) -> int:
        role = self.roles.get(name)
        return 0 if role is None else role.unanswered
