"""The external launcher against real gRPC health servers (stand-ins for deployed services): it waits for
SERVING within a deadline and names the role, the address and the last answer when it does not come; it
reports a role that serves again after an outage as restarted; it stops nothing."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tauflow.controller.adapters.health_client import check_health
from tauflow.controller.external import ExternalLauncher
from tauflow.controller.launcher import ServiceFailed, ServiceSpec

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServer:
    """A gRPC server with only the health service, on a port of its own (kept across restarts)."""

    def __init__(self, port: int = 0) -> None:
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.health.set("", NOT_SERVING)
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0).wait()


def test_a_role_that_never_serves_fails_naming_role_address_and_last_answer() -> None:
    server = HealthServer()
    try:
        started = time.monotonic()
        with pytest.raises(
            ServiceFailed,
            match=rf"service 'queue' failed: not SERVING at {server.address} "
            r"\(external.queue\) within 1s; last answer: .*server is NOT_SERVING",
        ):
            ExternalLauncher({"queue": server.address}, check_health, start_timeout_s=1.0).start(ServiceSpec("queue"))
        assert time.monotonic() - started < 5  # the deadline holds
    finally:
        server.stop()
    with pytest.raises(ServiceFailed, match=rf"not SERVING at {server.address} .*UNAVAILABLE"):  # nothing listens
        ExternalLauncher({"queue": server.address}, check_health, start_timeout_s=0.5).start(ServiceSpec("queue"))


def test_waits_for_serving_reports_a_role_back_after_an_outage_and_stops_nothing() -> None:
    server = HealthServer()
    launcher = ExternalLauncher({"reward": server.address}, check_health, start_timeout_s=30, check_every_s=0.0)
    threading.Timer(1.0, server.health.set, ("", SERVING)).start()  # ready a moment after the controller asks
    svc = launcher.start(ServiceSpec("reward", {"default_reward_fn": "exact_match"}))
    assert svc.address == server.address and svc.up and svc.starts == 1
    assert launcher.addresses() == {"reward": server.address}
    assert launcher.check() == []  # serving all along: nothing to report
    server.stop()  # its deployment replaces it...
    assert launcher.check() == [] and not svc.up
    server = HealthServer(server.port)  # ...on the same address, ready after a while
    assert launcher.check() == [] and not svc.up
    server.health.set("", SERVING)
    try:
        assert launcher.check() == ["reward"] and svc.up and svc.starts == 2  # back: reported once
        assert launcher.check() == []
        assert launcher.stop() == {}
        with grpc.insecure_channel(server.address) as channel:  # still serving: the controller stopped nothing
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == SERVING
    finally:
        server.stop()
