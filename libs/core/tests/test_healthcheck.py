"""``python -m tauflow.core.healthcheck`` (the containers' health check) against the real server bootstrap."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.config import ServerConfig
from tauflow.core.healthcheck import main
from tauflow.core.server import GrpcServer, ServiceBinding

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]


@pytest.fixture
async def server() -> AsyncIterator[tuple[GrpcServer, str]]:
    binding = ServiceBinding(
        QUEUE, queue_pb2_grpc.QueueServiceServicer(), queue_pb2_grpc.add_QueueServiceServicer_to_server
    )
    srv = GrpcServer([binding], ServerConfig(host="127.0.0.1", port=0, drain_grace_s=0))
    port = await srv.start()  # NOT_SERVING until set_serving(True), as every service until it is ready
    yield srv, f"127.0.0.1:{port}"
    await srv.drain()


async def _check(*argv: str) -> int:
    # The check is a blocking client; the server runs on this test's event loop.
    return await asyncio.to_thread(main, list(argv))


async def test_exit_code_follows_the_servers_health_from_starting_to_ready_to_draining(server, capsys) -> None:
    srv, address = server
    assert await _check(address) == 1
    assert "server is NOT_SERVING" in capsys.readouterr().err
    await srv.set_serving(True)
    assert await _check(address) == 0
    assert await _check(address, "--service", QUEUE.full_name) == 0
    assert "SERVING" in capsys.readouterr().out
    await srv.set_serving(False)  # what drain does first, on SIGTERM
    assert await _check(address, "--service", QUEUE.full_name) == 1
    assert f"service '{QUEUE.full_name}' is NOT_SERVING" in capsys.readouterr().err


async def test_a_service_the_server_does_not_serve_is_unhealthy_and_named(server, capsys) -> None:
    srv, address = server
    await srv.set_serving(True)
    assert await _check(address, "--service", "tauflow.api.nothing.v1.Nothing") == 1
    err = capsys.readouterr().err
    assert "tauflow.api.nothing.v1.Nothing" in err and "NOT_FOUND" in err


def test_nobody_listening_is_unhealthy_at_once(capsys) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert main([f"127.0.0.1:{port}", "--timeout", "10"]) == 1
    assert time.monotonic() - started < 5  # refused: no waiting out the timeout
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_a_peer_that_never_answers_is_unhealthy_after_the_timeout(capsys) -> None:
    with socket.socket() as s:  # accepts TCP connections but never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen()
        started = time.monotonic()
        assert main([f"127.0.0.1:{s.getsockname()[1]}", "--timeout", "1"]) == 1
        elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 4
    assert "no answer within 1s" in capsys.readouterr().err


async def test_the_module_runs_as_a_command_with_docker_healthcheck_exit_codes(server) -> None:
    srv, address = server
    await srv.set_serving(True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tauflow.core.healthcheck",
        address,
        "--timeout",
        "5",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == f"{address}: server is SERVING"


def test_a_bad_argument_is_a_usage_error_not_a_verdict_on_the_service(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["127.0.0.1:1", "--timeout", "0"])
    assert exit_.value.code == 2
    assert "--timeout must be > 0" in capsys.readouterr().err
