"""Launchers: how a run's services come to exist, and what the run knows of them.

A launcher starts a role with its settings and environment and returns it with its address
(``start``), restarts what died (``check``), stops everything in order (``stop``), and lists its
services for the metrics and the Prometheus targets (``services``). Three implement it:

- ``local`` (:class:`LocalLauncher`, here): every service a subprocess on loopback.
- ``ray`` (:class:`tauflow.controller.raylauncher.RayLauncher`): every service a subprocess of a Ray
  actor on a node of an existing Ray cluster.
- ``external`` (:class:`tauflow.controller.external.ExternalLauncher`): services deployed by someone
  else; the controller only connects.

The first two share :class:`ProcessLauncher`, the supervision: each service runs as ``python -m
tauflow.<role> --ready-file <run>/<name>.ready.json --config <run>/settings/<name>.json``; its settings
(``server.port=0`` and the run's) are in that file, readable by the run's user only, not on its command
line (which any local user can read, in ``/proc/<pid>/cmdline``); its ports are read back from the ready
file (no port races), its output goes to ``<run>/logs/<name>.log``. A service that exits
unexpectedly is restarted in place (same ports) with exponential backoff; one that keeps dying
(``max_restarts``) fails the run with a message that names it and quotes the end of its log. A restart is
not waited for: ``check`` starts the new process and returns, and a later ``check`` reports it once it
serves, so a role that takes its time (or hangs) starting delays the supervision of none of the others. A
restarted process that dies before it serves, or does not serve within ``start_timeout_s`` (then it is
killed), is one more death: restarted again with backoff, counted against ``max_restarts``; so is a restart
whose process could not even be started (:class:`SpawnFailed`: its settings file or log could not be written
on a full disk, the process could not be forked, or its Ray actor could not be placed or failed to start it). One that is alive but does not answer its gRPC health
check (stopped, hung) is logged and counted (``tauflow.controller.health``).

A role may run as several processes, each a service of its own name (:func:`instance_name`: ``rollout``,
``rollout-1``, ...). Rollout replicas are started without waiting for each to serve (``begin_start``, then
``poll_start``: at launch all at once, and when the run scales out), and stopped one by one
(``stop_service``: a removed replica drains). The ranks of a data-parallel trainer are a **gang** (``start_gang``): started
together with a fresh rendezvous address, and when one dies the others are killed and all restart
together, since no rank can go on without the others.

Every service is told who started it (``TAUFLOW_PARENT_PID``: the controller, or the Ray actor hosting it)
and stops by itself, draining as on SIGTERM, once that process is gone: a controller killed with SIGKILL
leaves no service behind (``tauflow.core.lifeline``). A new controller on the same ``out_dir`` (``tauflow
run --resume``) waits for the previous run's processes to be gone before it starts their successors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tauflow.controller.health import HealthProbe
from tauflow.controller.ports import HealthCheck
from tauflow.core.config import deep_merge, parse_value
from tauflow.core.lifeline import HARD_EXIT_MARGIN_S, PARENT_PID_ENV
from tauflow.core.net import free_port

log = logging.getLogger(__name__)

STAGE_GRACE_S = 5.0  # the least a stage of the stop has to drain when an earlier one used up the grace period
MAX_BACKOFF_S = 60.0  # the longest wait before a restart (1, 2, 4 ... s, then a minute each)


START_HEADER = "=== start "  # a process's first line in its role's log (log_header)
LOG_TAIL_BYTES = 64 * 1024  # what log_tail reads of a log's end


class LaunchFailed(RuntimeError):
    """The run's services cannot be launched (e.g. the Ray cluster cannot be reached)."""


class ServiceFailed(LaunchFailed):
    """A service died and could not be brought back, or never became ready."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"service '{name}' failed: {message}")
        self.name = name


class SpawnFailed(ServiceFailed):
    """A service's process could not be started at all (``reason``): writing its settings file or its log, or
    the fork, failed (e.g. ENOSPC on a full disk), or its Ray actor was not placed in time, died, or failed
    while starting it. At launch or scale-out it fails that start as any :class:`ServiceFailed`; in a restart
    it is one more failed start (:meth:`ProcessLauncher.check`)."""

    def __init__(self, name: str, reason: str) -> None:
        self.reason = reason
        super().__init__(name, reason)

    @classmethod
    def from_os_error(cls, name: str, error: OSError) -> SpawnFailed:
        return cls(name, f"could not start its process ({describe_os_error(error)})")


DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write refused for want of room: ENOSPC, or EDQUOT (the user's quota)."""
    return isinstance(error, OSError) and error.errno in DISK_FULL


def describe_os_error(error: OSError) -> str:
    """One line for a log or a failure message; a full disk said as such."""
    text = f"{type(error).__name__}: {error}"
    return f"disk full: {text}" if disk_full(error) else text


def instance_name(role: str, index: int) -> str:
    """The name of a role's ``index``-th process: the role itself for the first, ``<role>-<index>`` after."""
    return role if index == 0 else f"{role}-{index}"


@dataclass
class ServiceSpec:
    name: str  # unique in the run: the role, or instance_name(role, index) for a role with several processes
    settings: dict[str, Any] = field(default_factory=dict)  # key.sub -> value (its settings file)
    env: dict[str, str] = field(default_factory=dict)
    role: str = ""  # empty: the name
    index: int = 0  # the replica index or rank within the role
    module: str = ""  # python -m tauflow.<module>; empty: the role (a teacher is a rollout server)

    def __post_init__(self) -> None:
        self.role = self.role or self.name
        self.module = self.module or self.role


@dataclass(frozen=True)
class Rendezvous:
    """How a gang finds itself: the setting that names rank 0's ``host:port`` (a fresh port each start)."""

    key: str  # e.g. distributed.master_address


class Service(Protocol):
    """What the run, its metrics and the targets file read of a launched role."""

    @property
    def name(self) -> str: ...

    @property
    def address(self) -> str: ...  # host:port of its gRPC server

    @property
    def info(self) -> dict[str, Any]: ...  # its ready info: grpc_port, metrics_port, pid, host (absent: loopback)

    @property
    def starts(self) -> int: ...  # times it was (re)started; restarts = starts - 1

    @property
    def up(self) -> bool: ...

    @property
    def role(self) -> str: ...

    @property
    def index(self) -> int: ...  # replica index or rank within its role

    @property
    def started_wall(self) -> float: ...  # Unix time of its last (re)start; 0 before the first


class Launcher(Protocol):
    # Properties, read-only: a launcher's own kind of service (ManagedService, ExternalService) is a Service,
    # but a mutable attribute typed Mapping[str, Service] would not take it.
    @property
    def services(self) -> Mapping[str, Service]: ...

    @property
    def starts_services(self) -> bool: ...  # False: someone else's services (nothing to prepare, set aside or stop)

    @property
    def health(self) -> HealthProbe | None: ...  # the probe of live processes (local, ray); None: none

    def start(self, spec: ServiceSpec) -> Service: ...

    # Starting without waiting (a rollout replica the run scales out to): begin_start returns once the process
    # runs; poll_start says whether it serves yet (raising ServiceFailed when it died or timed out).
    def begin_start(self, spec: ServiceSpec) -> Service: ...

    def poll_start(self, name: str) -> bool: ...

    def start_gang(self, specs: list[ServiceSpec], rendezvous: Rendezvous) -> Sequence[Service]: ...

    def check(self) -> list[str]: ...

    def stop_service(self, name: str) -> int | None: ...

    def update_settings(self, role: str, settings: Mapping[str, Any]) -> None: ...

    def stop(
        self, order: Sequence[Sequence[str]] | None = None, grace_s: float | None = None
    ) -> dict[str, int | None]: ...

    def addresses(self) -> Mapping[str, str]: ...


@dataclass
class ManagedService:
    spec: ServiceSpec
    run_dir: Path
    proc: Any = None  # its process: a subprocess.Popen, or a RayProcess (pid, poll, wait, send_signal)
    info: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    starts: int = 0  # processes started, restarts included (never reset: the restarts metric)
    next_restart_at: float = 0.0
    started_at: float = 0.0  # on the launcher's clock
    started_wall: float = 0.0  # Unix time
    ready_by: float = 0.0  # begun (begin_start, or a restart) and not yet serving: the time it must serve by
    restarting: bool = False  # a restart (check's) under way: its new process does not serve yet

    gang: str = ""  # the gang it belongs to (restarted with it); "" when it stands alone

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def address(self) -> str:
        return f"{self.info.get('host', '127.0.0.1')}:{self.info['grpc_port']}"

    @property
    def up(self) -> bool:  # (a restarted process is not up before it serves: its info is its predecessor's)
        return self.proc is not None and not self.restarting and self.proc.poll() is None and bool(self.info)

    @property
    def ready_file(self) -> Path:
        return self.run_dir / f"{self.name}.ready.json"

    @property
    def settings_file(self) -> Path:
        return self.run_dir / "settings" / f"{self.name}.json"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "logs" / f"{self.name}.log"

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` of the log written by the newest process (from its ``=== start`` header on: a
        failure message must not begin with the previous process's traceback), read from the log's end."""
        try:
            with open(self.log_file, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = fh.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        starts = [i for i, line in enumerate(text) if line.startswith(START_HEADER)]
        if starts:
            text = text[starts[-1] + 1 :]
        return "\n".join(text[-lines:])


class ProcessLauncher:
    """The supervision shared by the launchers that start the service processes themselves.

    Subclasses say how a process starts (``_spawn``: sets ``svc.proc``), how its ready info is read
    (``_read_ready``) and how its process group is killed (``_kill``). ``health_check`` (app.py wires the
    gRPC one) lets it probe the live processes; without one it probes nothing. ``clock`` is the time the
    restart budget is counted in (a test moves it on).
    """

    starts_services = True

    def __init__(
        self,
        run_dir: Path,
        *,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        backoff_s: float = 1.0,
        start_timeout_s: float = 120.0,
        stop_grace_s: float = 15.0,
        health_check: HealthCheck | None = None,
        health_timeout_s: float = 3.0,
        health_every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.clock = clock
        self.health = (
            HealthProbe(health_check, timeout_s=health_timeout_s, every_s=health_every_s) if health_check else None
        )
        self.services: dict[str, ManagedService] = {}
        self._gangs: dict[str, Rendezvous] = {}  # gang (its rank 0's name) -> how it finds itself
        # Set by stop: a start or restart still under way in a thread of the run's (it was cancelled) must not
        # leave a process behind the stop.
        self.stopping = False
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    # -- what a subclass provides ---------------------------------------------------------

    def _spawn(self, svc: ManagedService) -> None:
        raise NotImplementedError

    def _read_ready(self, svc: ManagedService) -> dict[str, Any] | None:
        raise NotImplementedError

    def _kill(self, svc: ManagedService) -> None:
        raise NotImplementedError

    def _exit_reason(self, svc: ManagedService, code: int) -> str:
        return f"exited with code {code}"

    def _release(self) -> None:
        """After stop: give back what the launcher holds besides the processes."""

    def _forget(self, svc: ManagedService) -> None:
        """After stop_service: give back what the launcher holds for ``svc`` besides its process."""

    def _rendezvous_host(self, svc: ManagedService) -> str:
        """The host a gang's rank 0 (``svc``) serves its rendezvous on, seen from the other ranks."""
        return "127.0.0.1"

    def _free_port(self, svc: ManagedService) -> int:
        """A port free now on ``svc``'s host, for its rendezvous."""
        return free_port(self._rendezvous_host(svc))

    # -- starting ------------------------------------------------------------------------

    def start(self, spec: ServiceSpec) -> ManagedService:
        """Starts one service and waits for its ready file (it serves gRPC health then)."""
        svc = self._register(spec)
        self._spawn_checked(svc)
        self._wait_ready(svc)
        return svc

    def begin_start(self, spec: ServiceSpec) -> ManagedService:
        """Starts one service without waiting for it to serve (:meth:`poll_start` says when it does), so that
        the run's loop goes on meanwhile; :meth:`check` leaves it alone until then."""
        svc = self._register(spec)
        self._spawn_checked(svc)
        svc.ready_by = time.monotonic() + self.start_timeout_s
        return svc

    def poll_start(self, name: str) -> bool:
        """Whether the service :meth:`begin_start` started serves now (its ready file read); raises
        ServiceFailed when it died, or did not serve within ``start_timeout_s``."""
        svc = self.services[name]
        if svc.ready_by and not self._ready_now(svc, svc.ready_by):
            return False
        svc.ready_by = 0.0
        return True

    def _register(self, spec: ServiceSpec) -> ManagedService:
        self._refuse_when_stopping(spec.name)
        svc = self.services.get(spec.name) or ManagedService(spec, self.run_dir)
        svc.spec = spec
        self.services[spec.name] = svc
        return svc

    def start_gang(self, specs: list[ServiceSpec], rendezvous: Rendezvous) -> list[ManagedService]:
        """Starts the processes of a gang together (each waits in its rendezvous for the others), rank 0
        first in ``specs``, and waits until every one is ready. One that fails takes the others down."""
        gang = specs[0].name
        members = []
        for spec in specs:
            svc = self.services.get(spec.name) or ManagedService(spec, self.run_dir, gang=gang)
            svc.spec, svc.gang = spec, gang
            self.services[spec.name] = svc
            members.append(svc)
        self._gangs[gang] = rendezvous
        self._start_together(members, rendezvous)
        return members

    def _refuse_when_stopping(self, name: str) -> None:
        if self.stopping:
            raise ServiceFailed(name, "the run is stopping: nothing more starts")

    def _start_together(self, members: list[ManagedService], rendezvous: Rendezvous) -> None:
        self._spawn_together(members, rendezvous)
        try:
            for svc in members:
                self._wait_ready(svc)
        except ServiceFailed:
            self._kill_alive(members)
            raise

    def _spawn_together(self, members: list[ManagedService], rendezvous: Rendezvous) -> None:
        """Starts the processes of a gang with a fresh rendezvous address, without waiting for them."""
        self._refuse_when_stopping(members[0].name)
        address = f"{self._rendezvous_host(members[0])}:{self._free_port(members[0])}"
        for svc in members:
            svc.spec.settings[rendezvous.key] = address
        try:
            for svc in members:
                self._spawn_checked(svc)
        except ServiceFailed:
            self._kill_alive(members)
            raise

    def _spawn_checked(self, svc: ManagedService) -> None:
        """``_spawn``, with an OSError (a settings file or log that cannot be written, a fork refused) said as
        :class:`SpawnFailed`: a failed start of ``svc``, not a crash of the controller."""
        try:
            self._spawn(svc)
        except OSError as e:
            raise SpawnFailed.from_os_error(svc.name, e) from e

    def _kill_alive(self, members: list[ManagedService]) -> None:
        for svc in members:
            if svc.proc is not None and svc.proc.poll() is None:
                self._kill(svc)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    svc.proc.wait(self.stop_grace_s)

    def _settings(self, svc: ManagedService) -> dict[str, Any]:
        """Its settings: free ports at the first start, the same ports at every restart."""
        settings = {"server.port": 0, "metrics.port": 0, **svc.spec.settings}
        for key, port in svc.info.get("pinned", {}).items():
            if port:
                settings[key] = port
        return settings

    def _started(self, svc: ManagedService) -> None:
        svc.started_at, svc.started_wall = self.clock(), time.time()
        svc.starts += 1
        log.info("started", extra={"service": svc.name, "pid": svc.proc.pid})

    def _wait_ready(self, svc: ManagedService) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready_now(svc, deadline):
            time.sleep(0.05)

    def _ready_now(self, svc: ManagedService, deadline: float) -> bool:
        """Whether ``svc`` serves now (its ready file read, its ports pinned); raises ServiceFailed when it
        died while starting or ``deadline`` (monotonic) has passed."""
        assert svc.proc is not None
        if self.stopping:  # a launch still under way when the run was stopped: its process may have been
            self._kill_alive([svc])  # spawned after stop() looked (nothing else would ever stop it)
            raise ServiceFailed(svc.name, "the run is stopping: nothing more starts")
        info = self._read_ready(svc)
        if info is None:
            failure = self._start_failure(svc, deadline)
            if failure:
                raise ServiceFailed(svc.name, f"{failure}:\n{_settings_named(svc.log_tail(), svc.spec.role)}")
            return False
        self._pin(svc, info)
        return True

    def _start_failure(self, svc: ManagedService, deadline: float, doing: str = "starting") -> str:
        """Why ``svc``, not serving yet, failed to start (``doing``): it died, or ``deadline`` (monotonic)
        has passed; "" while it may still serve."""
        code = svc.proc.poll()
        if code is not None:
            return f"{self._exit_reason(svc, code)} while {doing}"
        if time.monotonic() > deadline:
            return f"not ready after {self.start_timeout_s:.0f}s" + ("" if doing == "starting" else f" while {doing}")
        return ""

    def _pin(self, svc: ManagedService, info: dict[str, Any]) -> None:
        """``svc`` serves: its ready info. A restarted service comes back on the same ports, so its peers'
        channels reconnect (and Prometheus keeps scraping the same target)."""
        pinned = {"server.port": info["grpc_port"], "metrics.port": info.get("metrics_port")}
        if info.get("external_port"):  # the queue's external port (its producers outside the run reconnect there)
            pinned["external.port"] = info["external_port"]
        svc.info = {**info, "pinned": pinned}

    # -- supervising ---------------------------------------------------------------------

    def check(self) -> list[str]:
        """Restarts services that died; returns the names restarted (once their new processes serve). Raises
        ServiceFailed when one died more than ``max_restarts`` times in a row; a service that stayed up for
        ``restart_window_s`` since its last start has its count reset (one crash a day is not a crash loop).
        A gang restarts as one: the death of any member kills the others. Then probes the health of those
        that are up (every ``health_every_s``).

        Nothing here waits for a process to serve: a restart starts the new process and returns, and a later
        call reports it once it serves, so one role's slow (or hung) start delays no other role's restart.
        A restarted process that dies before it serves, or does not serve within ``start_timeout_s`` (it is
        killed then, with the rest of its gang), is one more death: restarted again after the backoff, and
        counted against ``max_restarts``."""
        restarted: list[str] = []
        if self.stopping:
            return restarted
        now = self.clock()
        for unit in self._units():
            first = unit[0]
            if any(svc.ready_by and not svc.restarting for svc in unit):  # begun (begin_start): poll_start judges
                continue
            if any(svc.restarting for svc in unit):
                failed = self._restart_failure(unit)
                if failed is None:
                    if not any(svc.ready_by for svc in unit):  # every process of the unit serves: it is back
                        self._restarted(unit)
                        restarted += [svc.name for svc in unit]
                    continue
                dead, reason = failed
                self._kill_alive(unit)  # (a hung one, and the rest of its gang)
                for svc in unit:
                    svc.restarting, svc.ready_by = False, 0.0
                if self.stopping:
                    return restarted
                delay = self._schedule_restart(unit, dead, f"{reason},", now)
                log.warning(
                    "a restarted service failed before it served; restarting",
                    extra={"service": dead.name, "reason": reason, "in_s": delay},
                )
                continue
            died = [(svc, code) for svc in unit if svc.proc is not None and (code := svc.proc.poll()) is not None]
            if not died:
                continue
            dead, code = died[0]
            if first.next_restart_at == 0.0:  # (not yet scheduled: a death seen now)
                if now - first.started_at >= self.restart_window_s:
                    for svc in unit:
                        svc.restarts = 0
                delay = self._schedule_restart(unit, dead, self._exit_reason(dead, code), now)
                log.warning("service died; restarting", extra={"service": dead.name, "code": code, "in_s": delay})
            if now >= first.next_restart_at:
                self._begin_restart(unit, now)
                if self.stopping:
                    return restarted
        if self.health is not None:
            self.health.check(
                {name: svc.address for name, svc in self.services.items() if svc.up},
                alive=lambda name: self.services[name].up,
            )
        return restarted

    def _schedule_restart(self, unit: list[ManagedService], dead: ManagedService, reason: str, now: float) -> float:
        """``dead`` (of ``unit``) died (``reason``): its restart is due after the backoff (returned), the rest
        of its gang killed now; raises ServiceFailed when the unit has had its ``max_restarts`` in a row."""
        first = unit[0]
        if first.restarts >= self.max_restarts:
            raise ServiceFailed(
                dead.name,
                f"{reason} after {first.restarts} restarts (max_restarts {self.max_restarts}):\n{dead.log_tail()}",
            )
        # (capped: with max_restarts of 10 or more the doubling passed stall_timeout_s, and the run ended
        # "stalled" while its controller was still waiting to restart the role)
        delay = min(self.backoff_s * 2 ** min(first.restarts, 32), MAX_BACKOFF_S)
        first.next_restart_at = now + delay
        if len(unit) > 1:  # a gang goes on only whole: its other members stop now
            self._kill_alive(unit)
        return delay

    def _begin_restart(self, unit: list[ManagedService], now: float) -> None:
        """Starts the unit's new processes (a gang's together, with a fresh rendezvous) without waiting for
        them to serve: :meth:`check` polls them (``restarting``) until they do, or fail to. One that cannot
        even be started (:class:`SpawnFailed`: e.g. its settings file on a full disk) is a failed start like
        one that dies before it serves: the unit's restart is due again after the next backoff, and counted
        against ``max_restarts`` (ServiceFailed once they are spent)."""
        first = unit[0]
        for svc in unit:
            svc.restarts += 1
        first.next_restart_at = 0.0
        try:
            if len(unit) > 1:
                self._spawn_together(unit, self._gangs[first.gang])  # (kills the members it started, on failure)
            else:
                self._spawn_checked(first)
        except SpawnFailed as e:
            if self.stopping:
                return
            failed = self.services.get(e.name, first)
            delay = self._schedule_restart(unit, failed, f"{e.reason} while restarting,", now)
            log.warning(
                "a restart could not start its process; restarting",
                extra={"service": failed.name, "reason": e.reason, "in_s": delay,
                       "restarts": first.restarts, "max_restarts": self.max_restarts},
            )  # fmt: skip
            return
        ready_by = time.monotonic() + self.start_timeout_s
        for svc in unit:
            svc.restarting, svc.ready_by = True, ready_by
        if self.stopping:  # stop() may have looked at the services before these were spawned: none is left behind
            self._kill_alive(unit)

    def _restart_failure(self, unit: list[ManagedService]) -> tuple[ManagedService, str] | None:
        """A restart under way: reads the ready info of each new process that serves now; returns the one that
        failed (died, or did not serve in time) and why, or None while none has."""
        for svc in unit:
            assert svc.proc is not None
            if svc.ready_by:
                info = self._read_ready(svc)
                if info is not None:
                    self._pin(svc, info)
                    svc.ready_by = 0.0
                elif failure := self._start_failure(svc, svc.ready_by, "restarting"):
                    return svc, failure
            elif (code := svc.proc.poll()) is not None:  # (a gang's member that served, dead before the others)
                return svc, f"{self._exit_reason(svc, code)} while its gang restarted"
        return None

    def _restarted(self, unit: list[ManagedService]) -> None:
        for svc in unit:
            svc.restarting = False
            log.info("restarted", extra={"service": svc.name, "restarts": svc.restarts})
            if self.health is not None:
                self.health.restarted(svc.name)

    def _units(self) -> list[list[ManagedService]]:
        """The services as they restart: each gang (rank 0 first), and every other service alone."""
        units: dict[str, list[ManagedService]] = {}
        for svc in list(self.services.values()):
            units.setdefault(svc.gang or f"\0{svc.name}", []).append(svc)
        return list(units.values())

    # -- stopping ------------------------------------------------------------------------

    def stop_service(self, name: str) -> int | None:
        """Stops one service for good (a rollout replica scaled in): SIGTERM, so that it drains, then
        SIGKILL after the grace period; it is no longer supervised. Returns its exit code."""
        svc = self.services.pop(name)
        if svc.proc is None:
            return None
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
        try:
            code = svc.proc.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            self._kill(svc)
            code = svc.proc.wait(self.stop_grace_s)
            log.warning("killed after the grace period", extra={"service": name})
        log.info("stopped", extra={"service": name, "code": code})
        self._forget(svc)
        return code

    def update_settings(self, role: str, settings: Mapping[str, Any]) -> None:
        """Changes settings of ``role``'s processes from their next (re)start on (e.g. a live τ)."""
        for svc in list(self.services.values()):
            if svc.role == role:
                svc.spec.settings.update(settings)

    def stop(self, order: Sequence[Sequence[str]] | None = None, grace_s: float | None = None) -> dict[str, int | None]:
        """Stops every service in stages: ``order`` lists them (each a list of roles); a stage's processes
        get SIGTERM (graceful drain) together once the stage before has exited, and SIGKILL whatever of any
        stage is left at the end of ``grace_s`` (default: ``stop_grace_s``; 0: at once), one period for the
        whole stop; a stage that begins after it still has STAGE_GRACE_S (or ``grace_s`` if shorter) to
        drain. Services of no named role stop last. Without ``order``: one stage, all at once. Returns exit
        codes (None: a process that outlived its SIGKILL's wait)."""
        self.stopping = True
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        if order is None:
            stages = [list(reversed(self.services))]
        else:
            stages = [[svc.name for role in stage for svc in list(self.services.values()) if svc.role == role]
                      for stage in order]  # fmt: skip
            named = {name for stage in stages for name in stage}
            stages.append([name for name in reversed(self.services) if name not in named])
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        try:
            for stage in stages:
                begun = time.monotonic()
                codes.update(self._stop_stage(stage, max(deadline, begun + min(grace_s, STAGE_GRACE_S))))
            return codes
        finally:
            self._release()

    def _stop_stage(self, names: list[str], deadline: float) -> dict[str, int | None]:
        for name in names:
            svc = self.services.get(name)
            if svc and svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name in names:
            svc = self.services.get(name)
            if not svc or not svc.proc:
                continue
            try:
                codes[name] = svc.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(svc)
                log.warning("killed after the grace period", extra={"service": name})
                try:
                    codes[name] = svc.proc.wait(self.stop_grace_s)
                except subprocess.TimeoutExpired:  # (the next stages stop all the same)
                    codes[name] = None
                    log.warning("still running after SIGKILL", extra={"service": name})
        return codes

    def addresses(self) -> Mapping[str, str]:
        return {name: svc.address for name, svc in self.services.items() if svc.info}


class LocalLauncher(ProcessLauncher):
    """``launcher: local``: every service a subprocess of the controller, on loopback."""

    # How long a process of a previous controller on this out_dir may take to stop: it notices within a
    # second that its controller is gone, drains (10 s by default) and exits hard after a margin.
    previous_wait_s = 15.0 + HARD_EXIT_MARGIN_S

    def _spawn(self, svc: ManagedService) -> None:
        if svc.starts == 0:
            self._wait_for_previous(svc)
        svc.ready_file.unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **svc.spec.env}
        settings, env = service_env(svc.spec.module, self._settings(svc), env)
        write_settings(svc.settings_file, settings)
        command = service_command(sys.executable, svc.spec.module, svc.ready_file, svc.settings_file)
        svc.proc = spawn_service(command, env, svc.log_file, log_header(svc.name, svc.restarts))
        self._started(svc)

    def _read_ready(self, svc: ManagedService) -> dict[str, Any] | None:
        return json.loads(svc.ready_file.read_text()) if svc.ready_file.exists() else None

    def _kill(self, svc: ManagedService) -> None:
        os.killpg(svc.proc.pid, signal.SIGKILL)

    def _wait_for_previous(self, svc: ManagedService) -> None:
        """The previous controller's process of this role (its ready file names it) may still be draining
        after that controller died: two queues on one log, or two trainers on one checkpoint folder,
        would lose what the run had. Waits until it is gone; one that stays fails the start, naming it."""
        try:
            pid = int(json.loads(svc.ready_file.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError, OverflowError):  # (a damaged file: {"pid": 1e400})
            return
        if not is_service_process(pid, svc.spec.module):
            return
        log.warning(
            "a previous process of this service is still running; waiting for it to stop",
            extra={"service": svc.name, "pid": pid},
        )
        deadline = time.monotonic() + self.previous_wait_s
        while is_service_process(pid, svc.spec.module):
            if time.monotonic() > deadline:
                raise ServiceFailed(
                    svc.name,
                    f"its process {pid} from a previous run in {self.run_dir} still runs "
                    f"after {self.previous_wait_s:g}s: is another tauflow run using this out_dir?",
                )
            time.sleep(0.1)


# -- one service process: the local launcher and each Ray actor start it the same way ----------------


def service_command(python: str, role: str, ready_file: Path | str, settings_file: Path | str) -> list[str]:
    """The command line of a service process: its settings are in ``settings_file`` (:func:`write_settings`),
    never on the command line, which every local user can read."""
    return [python, "-m", f"tauflow.{role}", "--ready-file", str(ready_file), "--config", str(settings_file)]


def nested(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``key.sub -> value`` settings as the nested mapping a config file holds, merged in order as the
    service merges ``--set key.sub=value`` overrides (tauflow.core.config)."""
    data: dict[str, Any] = {}
    for key, value in settings.items():
        layer: Any = _plain(value)
        for part in reversed(str(key).split(".")):
            layer = {part: layer}
        data = deep_merge(data, layer)
    return data


def write_settings(path: Path | str, settings: Mapping[str, Any]) -> None:
    """Writes a service's settings as its ``--config`` file (JSON), readable and writable by this user only:
    they may hold secrets (an engine's API key, a reward function's token). Replaced at once: a process
    restarting reads the whole file or the previous one.

    On a full disk (ENOSPC, EDQUOT) a file already there that holds exactly these settings is kept and used
    (a restart with the settings of the previous one); otherwise the error is raised, nothing left behind:
    the start fails (:class:`SpawnFailed`)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # (ASCII: the service reads the file in its locale's encoding)
    text = json.dumps(nested(settings), ensure_ascii=True, indent=1, default=str)
    try:
        replace_file(path, text.encode("ascii"), mode=0o600)
    except OSError as e:
        if not disk_full(e) or not _holds(path, text):
            raise
        log.warning(
            "disk full: a settings file was not rewritten; the one there holds the same settings and is used",
            extra={"file": str(path), "error": describe_os_error(e)},
        )


def _holds(path: Path, text: str) -> bool:
    """Whether ``path`` is this user's file of exactly ``text``, readable by this user only."""
    try:
        st = path.stat()
        return st.st_uid == os.getuid() and st.st_mode & 0o077 == 0 and path.read_text(encoding="ascii") == text
    except (OSError, UnicodeDecodeError):
        return False


def read_json_file(path: Path | str, max_bytes: int) -> Any:
    """The JSON document in ``path``, read no further than ``max_bytes`` + 1. Raises OSError (FileNotFoundError:
    no file), or ValueError for a document over ``max_bytes``, not UTF-8, not JSON, or nested beyond the
    parser's depth (a RecursionError, which a damaged file must not raise past its reader)."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"over {max_bytes} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def replace_file(path: Path | str, data: bytes, *, mode: int | None = None, durable: bool = False) -> None:
    """Replaces ``path`` with ``data`` at once: written to a new file of its own in the same folder (``mode``;
    None: as ``open`` makes one, by the umask), fsynced, then renamed over ``path``; ``durable``: its folder
    fsynced too. A reader sees the old file or the new one, never half of either; when any step fails (a full
    disk) the old file stays as it was, the error is raised, and no temporary file is left behind."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as out:
            if mode is not None:
                os.fchmod(out.fileno(), mode)  # (exactly: the umask may have taken more)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def service_env(
    role: str, settings: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A service's config file (nested settings) and environment, so that the run's ``settings`` win over the
    controller's ``TAUFLOW_<ROLE>_*`` variables, as they did when they came last on the command line, and
    the environment still sets what the run does not: a variable the run's settings cover is left out; one
    holding a section under which the run sets keys (``TAUFLOW_TRAINER_BACKEND='{kind: megatron}'`` beside
    ``backend.model_path``) is merged into the file beneath the run's settings (the service reads its
    environment over its file, which would otherwise drop the section or the run's keys in it)."""
    prefix = f"TAUFLOW_{role.upper()}_"
    data = nested(settings)
    merged = data
    out = {}
    for name, value in sorted(env.items()):
        if name.startswith(prefix) and len(name) > len(prefix):
            path = name[len(prefix) :].lower().split("__")
            if _covered(data, path):
                continue  # the run's setting wins
            if isinstance(_lookup(data, path), dict):
                layer: Any = parse_value(value)
                for part in reversed(path):
                    layer = {part: layer}
                merged = deep_merge(layer, merged)  # (the run's settings on top)
                continue
        out[name] = value
    return merged, out


def _covered(data: Any, path: list[str]) -> bool:
    """Whether ``data`` sets the value at ``path``, or a value (not a section) above it."""
    for part in path:
        if not isinstance(data, dict):
            return True
        if part not in data:
            return False
        data = data[part]
    return not isinstance(data, dict)


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (a path as its text)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _lookup(data: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def log_header(role: str, restarts: int, where: str = "") -> str:
    return f"\n{START_HEADER}{restarts} of {role} at {time.ctime()}{where} ===\n"


def spawn_service(
    command: list[str], env: Mapping[str, str], log_file: Path | str, header: str, cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """Starts a service process in its own session (its group is killed as one), its output appended to
    ``log_file``; it stops by itself once the process that started it (this one) is gone."""
    with open(log_file, "ab", buffering=0) as out:
        try:
            out.write(header.encode())
        except OSError as e:  # (a full disk: the service starts all the same; its own output waits for room)
            log.warning("could not write a service's start to its log", extra={"log": str(log_file),
                        "error": describe_os_error(e)})  # fmt: skip
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, PARENT_PID_ENV: str(os.getpid())},
            cwd=cwd,
            start_new_session=True,
        )


def is_service_process(pid: int, role: str) -> bool:
    """Whether ``pid`` is a live ``tauflow.<role>`` process on this machine (not a pid reused by another)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z" and (
            f"tauflow.{role}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
    except (OSError, IndexError):
        return False


_SETTINGS_FILE = re.compile(r"\(from config file [^()\n]*/settings/[\w.-]+\.json\)")


def _settings_named(text: str, role: str) -> str:
    """A role's config error names the settings file the controller wrote for it; the user wrote
    ``services.<role>.*`` (or a run key the controller passes on): say that instead."""
    return _SETTINGS_FILE.sub(f"(from services.{role} of the run config, or a run key passed on to it)", text)
