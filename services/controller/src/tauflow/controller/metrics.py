"""The controller's Prometheus metrics (``tauflow_controller_*``): the run as the controller sees it.

Read from the run when Prometheus scrapes: each role's process (up, restarts) from the launcher, the
trainer's version and the held-out evaluations from what the controller followed. ``tauflow run`` serves
them on ``TAUFLOW_METRICS_HOST:TAUFLOW_METRICS_PORT`` (default 127.0.0.1 and a free port), records the
port in ``<out_dir>/controller.ready.json`` and writes ``<out_dir>/prometheus-targets.json``, a
Prometheus file_sd list of every role's /metrics endpoint (deploy/observability/prometheus.yml reads it).
``tauflow-controller`` serves them on its own metrics endpoint, like every service.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry

from tauflow.controller.health import HealthProbe
from tauflow.controller.launcher import Service, replace_file
from tauflow.core.metrics import MetricsServer, Reading, ScrapeCollector, serve_metrics

if TYPE_CHECKING:
    from tauflow.controller.run import Run  # run.py imports this module

log = logging.getLogger(__name__)

TARGETS_FILE = "prometheus-targets.json"
READY_FILE = "controller.ready.json"


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._run: Run | None = None
        collector = ScrapeCollector()
        gauge, counter = collector.gauge, collector.counter
        gauge(
            "tauflow_controller_service_up",
            "1 while the role's process runs and has served, 0 while it is dead or "
            "restarting (launcher external: while it answers health SERVING)",
            self._up,
            labels=["service"],
        )
        counter(
            "tauflow_controller_service_restarts_total",
            "Times the launcher restarted the role's process "
            "(launcher external: times the role served again after an outage)",
            self._restarts,
            labels=["service"],
        )
        gauge(
            "tauflow_controller_service_answering",
            "1 while the role answers its gRPC health check within the "
            "probe's deadline, 0 while its process is alive but does not (stopped, hung); launchers local "
            "and ray",
            self._answering,
            labels=["service"],
        )
        counter(
            "tauflow_controller_service_unanswered_total",
            "Times the role's live process stopped answering its gRPC health check (launchers local and ray)",
            self._unanswered,
            labels=["service"],
        )
        gauge(
            "tauflow_controller_policy_version",
            "Newest trainer version the controller has seen",
            lambda: None if self._run is None else self._run.progress.version,
        )
        gauge(
            "tauflow_controller_target_steps",
            "Optimizer steps the run trains for",
            lambda: None if self._run is None else self._run.config.steps,
        )
        gauge(
            "tauflow_controller_max_staleness_steps",
            "The run's staleness bound tau in force (-1: unbounded; tauflow set max-staleness changes it)",
            lambda: None if self._run is None else self._run.tau,
        )
        gauge(
            "tauflow_controller_rollout_replicas",
            "Rollout servers of the run: running, and the target (tauflow scale rollout sets it)",
            self._replicas,
            labels=["state"],
        )
        gauge(
            "tauflow_controller_heldout_accuracy_ratio",
            "Greedy held-out accuracy of the last evaluation",
            lambda: self._last_eval("accuracy"),
        )
        gauge(
            "tauflow_controller_heldout_policy_version",
            "Policy version the last evaluation's engine answered with",
            lambda: self._last_eval("engine_version"),
        )
        counter(
            "tauflow_controller_evaluations_total",
            "Held-out evaluations completed",
            lambda: None if self._run is None else len(self._run.summary.evals),
        )
        registry.register(collector)

    def watch(self, run: Run) -> None:
        """Report ``run`` from now on."""
        self._run = run

    def _services(self) -> dict[str, Service]:
        return {} if self._run is None else dict(self._run.launcher.services)

    def _up(self) -> Reading:
        return {(role,): 1 if svc.up else 0 for role, svc in self._services().items()}

    def _restarts(self) -> Reading:
        return {(role,): max(0, svc.starts - 1) for role, svc in self._services().items()}

    def _health(self) -> HealthProbe | None:
        return None if self._run is None else self._run.launcher.health

    def _answering(self) -> Reading:
        health = self._health()
        if health is None:
            return None
        return {(role,): 1 if health.answering(role) else 0 for role in self._services()}

    def _unanswered(self) -> Reading:
        health = self._health()
        if health is None:
            return None
        return {(role,): health.unanswered(role) for role in self._services()}

    def _replicas(self) -> Reading:
        if self._run is None:
            return None
        return {("running",): self._run.progress.rollout_replicas, ("target",): self._run.scaler.target}

    def _last_eval(self, field: str) -> Reading:
        if self._run is None or not self._run.summary.evals:
            return None
        return getattr(self._run.summary.evals[-1], field)


_lock = threading.Lock()
_metrics: ControllerMetrics | None = None


def controller_metrics() -> ControllerMetrics:
    """The process's controller metrics, on the default registry (created once)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = ControllerMetrics()
        return _metrics


def serve(out_dir: Path, control_address: str = "", token_file: str = "") -> MetricsServer:
    """Serves the process's metrics for ``tauflow run`` and records the port in ``out_dir``, with the address
    of the run's ControllerService (``control_address``: tauflow scale, set and status find the run there) and
    the path (not the content) of the run token's file."""
    host = os.environ.get("TAUFLOW_METRICS_HOST", "127.0.0.1")
    server = serve_metrics(host, int(os.environ.get("TAUFLOW_METRICS_PORT", "0")))
    info = {"service": "controller", "pid": os.getpid(), "metrics_host": host, "metrics_port": server.port}
    if control_address:
        info["control_address"] = control_address
    if token_file:
        info["token_file"] = token_file
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / READY_FILE, info)
    log.info("serving metrics", extra={"address": f"{host}:{server.port}"})
    return server


def write_targets(out_dir: Path, run_name: str, services: Mapping[str, Service], controller_port: int | None) -> None:
    """``<out_dir>/prometheus-targets.json``: every process's /metrics endpoint as a Prometheus file_sd list,
    labelled with ``job="tauflow-<role>"``, ``role``, ``run`` and ``instance_name`` (the process: ``rollout-1``
    is rollout replica 1, ``trainer-1`` the trainer's rank 1), rewritten when a process restarts, starts or
    stops. A role's
    host is its node's with the Ray launcher, loopback with the local one; roles deployed elsewhere
    (launcher external) are their deployment's to scrape and are not listed. Replaced whole or not at all:
    an OSError (a full disk) leaves the previous file as it was and no temporary file (the run logs it and
    writes the file again at its next pass: ``Run._write_targets``)."""
    groups = []
    endpoints = {
        role: (svc.info.get("host", "127.0.0.1"), svc.info.get("metrics_port"))
        for role, svc in services.items()
        if svc.info
    }
    if controller_port:
        endpoints["controller"] = ("127.0.0.1", controller_port)
    roles = {name: svc.role for name, svc in services.items()}
    for name, (host, port) in endpoints.items():
        if port:
            role = roles.get(name, name)
            labels = {"job": f"tauflow-{role}", "role": role, "run": run_name, "instance_name": name}
            groups.append({"targets": [f"{host}:{port}"], "labels": labels})
    _write_json(out_dir / TARGETS_FILE, groups)


def _write_json(path: Path, data: object) -> None:
    replace_file(path, json.dumps(data, indent=1).encode())  # Prometheus never reads half a file
