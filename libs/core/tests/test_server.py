"""The server bootstrap's second face: server interceptors, an extra server on its own port that shares
the process's state and is reported in the ready file, and TLS credentials from files."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.api.info.v1 import info_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ServerConfig
from tauflow.core.server import ExtraServer, GrpcServer, ServiceApp, ServiceBinding, serve, tls_server_credentials
from tauflow.core.serverinfo import SERVICE as INFO_SERVICE
from tauflow.core.serverinfo import fetch_server_info

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]


class Counter(queue_pb2_grpc.QueueServiceServicer):
    """State shared by both servers: SetTrainerVersion on one is what Stats answers on the other."""

    def __init__(self) -> None:
        self.version = 0

    async def SetTrainerVersion(self, request, context):  # type: ignore[no-untyped-def]
        self.version = request.policy_version
        return queue_pb2.SetTrainerVersionResponse(trainer_version=self.version)

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return queue_pb2.StatsResponse(trainer_version=self.version)


class DenyQueue(grpc.aio.ServerInterceptor):
    """Refuses every QueueService call; lets the rest (health, info) through. Counts what it saw."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        self.seen.append(details.method)
        if details.method.startswith(f"/{QUEUE.full_name}/"):
            async def deny(request, context):  # type: ignore[no-untyped-def]
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not on this port")

            return grpc.unary_unary_rpc_method_handler(deny)
        return await continuation(details)


def _binding(servicer: Counter) -> ServiceBinding:
    return ServiceBinding(QUEUE, servicer, queue_pb2_grpc.add_QueueServiceServicer_to_server)


async def test_an_interceptor_sees_every_call_and_can_refuse_one() -> None:
    deny = DenyQueue()
    server = GrpcServer([_binding(Counter())], ServerConfig(port=0), role="queue", version="0.1.0", interceptors=[deny])
    port = await server.start()
    await server.set_serving(True)
    try:
        async with create_channel(f"127.0.0.1:{port}", [QUEUE, HEALTH]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await queue_pb2_grpc.QueueServiceStub(channel).Stats(queue_pb2.StatsRequest())
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert deny.seen == [f"/{QUEUE.full_name}/Stats", "/grpc.health.v1.Health/Check"]
    finally:
        await server.drain()


async def test_an_extra_server_shares_the_state_answers_health_and_info_and_is_in_the_ready_file(
    tmp_path: Path,
) -> None:
    state = Counter()
    app = ServiceApp(
        bindings=[_binding(state)],
        extra_servers=[ExtraServer("external", [_binding(state)], ServerConfig(port=0))],
        info={"extra": "kept"},
    )
    ready = tmp_path / "ready.json"
    serving = asyncio.create_task(
        serve(app, ServerConfig(port=0, drain_grace_s=0.5), ready_info={"service": "queue", "version": "9.9"},
              ready_file=str(ready))
    )
    try:
        while not ready.exists():
            assert not serving.done(), serving.exception()
            await asyncio.sleep(0.02)
        info = json.loads(ready.read_text())
        assert info["grpc_port"] != info["external_port"] and info["extra"] == "kept"
        main, external = (f"127.0.0.1:{info[k]}" for k in ("grpc_port", "external_port"))
        async with create_channel(main, [QUEUE]) as a, create_channel(external, [QUEUE, HEALTH, INFO_SERVICE]) as b:
            await queue_pb2_grpc.QueueServiceStub(a).SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(policy_version=7))
            stats = await queue_pb2_grpc.QueueServiceStub(b).Stats(queue_pb2.StatsRequest())
            assert stats.trainer_version == 7  # one process, one state, two ports
            health = await health_pb2_grpc.HealthStub(b).Check(health_pb2.HealthCheckRequest(service=QUEUE.full_name))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            server_info = await fetch_server_info(b, external)
            assert (server_info.role, server_info.build_version) == ("queue", "9.9")
            assert isinstance(server_info, info_pb2.GetServerInfoResponse)
        os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler: drain both servers
        await asyncio.wait_for(serving, 10)
        async with grpc.aio.insecure_channel(external) as b:  # (no retries: the first refusal is the answer)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await queue_pb2_grpc.QueueServiceStub(b).Stats(queue_pb2.StatsRequest(), timeout=1)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        serving.cancel()


def test_tls_credentials_name_the_file_that_cannot_be_read(tmp_path: Path) -> None:
    key = tmp_path / "server.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(OSError, match=r"TLS certificate .*missing\.pem"):
        tls_server_credentials(str(tmp_path / "missing.pem"), str(key))
