"""The local launcher with real services: ready files, health, restart in place, clean stop."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.controller.launcher import LocalLauncher, ServiceFailed, ServiceSpec


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_starts_restarts_in_place_and_stops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    launcher = LocalLauncher(tmp_path, max_restarts=2, backoff_s=0.1)
    tokens = tmp_path / "tokens"
    tokens.write_text("agent: 0123456789abcdef0123\n")
    try:
        queue = launcher.start(ServiceSpec("queue", {
            "wal.dir": str(tmp_path / "wal"), "external.enabled": True, "external.port": 0,
            "external.tokens_file": str(tokens),
        }))
        assert _serving(queue.address)
        address, external_port = queue.address, queue.info["external_port"]
        os.kill(queue.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        queue.proc.wait()  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        restarted: list[str] = []
        while not restarted and time.monotonic() < deadline:
            restarted = launcher.check()
            time.sleep(0.05)
        assert restarted == ["queue"]
        assert queue.address == address and _serving(address)  # same port: peers reconnect
        assert queue.info["external_port"] == external_port  # and so do the producers outside the run
        assert "=== start 1 of queue" in queue.log_file.read_text()
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}  # SIGTERM drains and exits cleanly


def test_a_service_that_keeps_dying_fails_the_run_with_its_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    launcher = LocalLauncher(tmp_path, max_restarts=0, backoff_s=0.1)
    with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code 2 while starting") as err:
        launcher.start(ServiceSpec("queue", {"no_such_key": 1}))
    assert "unknown config key 'no_such_key'" in str(err.value)
    launcher.stop()


def _kill_and_check(launcher: LocalLauncher, name: str) -> list[str]:
    svc = launcher.services[name]
    os.kill(svc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
    svc.proc.wait()  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        restarted = launcher.check()
        if restarted:
            return restarted
        time.sleep(0.05)
    return []


def test_the_restart_budget_counts_crashes_in_a_row_not_over_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    launcher = LocalLauncher(tmp_path, max_restarts=1, backoff_s=0.05, restart_window_s=1.0)
    try:
        launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        assert _kill_and_check(launcher, "queue") == ["queue"]
        time.sleep(1.2)  # up for longer than the window: the next crash is not part of a loop
        assert _kill_and_check(launcher, "queue") == ["queue"]
        launcher.restart_window_s = 3600.0
        with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code -9 after 1 restarts"):
            _kill_and_check(launcher, "queue")
    finally:
        launcher.stop()
