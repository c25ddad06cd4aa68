"""The controller's metrics: each role's health and restarts read from the launcher, the run's progress, the
file_sd targets file and the ready file of `tauflow run`'s endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from tauflow.controller.health import Answering, HealthProbe
from tauflow.controller.launcher import ManagedService, ServiceSpec
from tauflow.controller.metrics import ControllerMetrics, serve, write_targets


def _service(tmp_path: Path, name: str, alive: bool, starts: int, metrics_port: int) -> ManagedService:
    svc = ManagedService(ServiceSpec(name), tmp_path, starts=starts)
    svc.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)" if alive else "pass"])
    if not alive:
        svc.proc.wait()
    svc.info = {"grpc_port": 1, "metrics_port": metrics_port}
    return svc


def test_up_and_restarts_per_role_and_the_runs_progress(tmp_path: Path) -> None:
    services = {
        "queue": _service(tmp_path, "queue", True, 1, 9101),
        "trainer": _service(tmp_path, "trainer", False, 3, 9102),
    }
    health = HealthProbe(lambda address, timeout_s: (True, "SERVING"))
    health.roles["queue"] = Answering(answering=False, unanswered=2)  # stopped now, and once before
    try:
        run = SimpleNamespace(
            launcher=SimpleNamespace(services=services, health=health),
            progress=SimpleNamespace(version=7, rollout_replicas=2),
            config=SimpleNamespace(steps=20, max_staleness=1),
            tau=0,  # changed live from the config's 1
            scaler=SimpleNamespace(target=3),
            summary=SimpleNamespace(evals=[SimpleNamespace(accuracy=0.4, engine_version=6)]),
        )
        registry = CollectorRegistry()
        ControllerMetrics(registry).watch(run)
        v = registry.get_sample_value
        assert v("tauflow_controller_service_up", {"service": "queue"}) == 1
        assert v("tauflow_controller_service_up", {"service": "trainer"}) == 0
        assert v("tauflow_controller_service_restarts_total", {"service": "queue"}) == 0
        assert v("tauflow_controller_service_restarts_total", {"service": "trainer"}) == 2
        assert v("tauflow_controller_service_answering", {"service": "queue"}) == 0
        assert v("tauflow_controller_service_answering", {"service": "trainer"}) == 1  # never probed: no news
        assert v("tauflow_controller_service_unanswered_total", {"service": "queue"}) == 2
        assert v("tauflow_controller_service_unanswered_total", {"service": "trainer"}) == 0
        assert v("tauflow_controller_policy_version") == 7
        assert v("tauflow_controller_target_steps") == 20
        assert v("tauflow_controller_heldout_accuracy_ratio") == 0.4
        assert v("tauflow_controller_heldout_policy_version") == 6
        assert v("tauflow_controller_evaluations_total") == 1
        assert v("tauflow_controller_max_staleness_steps") == 0  # the τ in force, not the config's
        assert v("tauflow_controller_rollout_replicas", {"state": "running"}) == 2
        assert v("tauflow_controller_rollout_replicas", {"state": "target"}) == 3

        write_targets(tmp_path, "r1", services, controller_port=9100)
        targets = json.loads((tmp_path / "prometheus-targets.json").read_text())
        by_role = {t["labels"]["role"]: t for t in targets}
        assert by_role["queue"]["targets"] == ["127.0.0.1:9101"]
        assert by_role["controller"]["labels"] == {
            "job": "tauflow-controller",
            "role": "controller",
            "run": "r1",
            "instance_name": "controller",
        }
        assert set(by_role) == {"queue", "trainer", "controller"}
    finally:
        for svc in services.values():
            svc.proc.kill()
            svc.proc.wait()


def test_tauflow_run_serves_its_metrics_and_records_the_port(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TAUFLOW_METRICS_PORT", "0")
    server = serve(tmp_path)
    try:
        info = json.loads((tmp_path / "controller.ready.json").read_text())
        assert info["metrics_port"] == server.port and info["service"] == "controller"
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read()
    finally:
        server.close()


def test_a_restarted_role_keeps_its_metrics_port_and_counts_the_restart(tmp_path: Path) -> None:
    import os
    import signal
    import time

    from tauflow.controller.launcher import LocalLauncher

    launcher = LocalLauncher(tmp_path, max_restarts=2, backoff_s=0.1)
    registry = CollectorRegistry()
    ControllerMetrics(registry).watch(SimpleNamespace(launcher=launcher))
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        port = queue.info["metrics_port"]
        assert registry.get_sample_value("tauflow_controller_service_up", {"service": "queue"}) == 1
        os.kill(queue.proc.pid, signal.SIGKILL)
        queue.proc.wait()
        assert registry.get_sample_value("tauflow_controller_service_up", {"service": "queue"}) == 0
        deadline = time.monotonic() + 30
        while not launcher.check():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert queue.info["metrics_port"] == port  # Prometheus keeps scraping the same target
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert registry.get_sample_value("tauflow_controller_service_restarts_total", {"service": "queue"}) == 1
        assert registry.get_sample_value("tauflow_controller_service_up", {"service": "queue"}) == 1
    finally:
        launcher.stop()
