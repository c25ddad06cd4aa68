"""The bounds of what any caller may hold on a server (no token is needed for health on the queue's external
port): health's service names and Watch streams, calls in progress, streams per connection; and a Watch
stream that ends when the server drains, so that it never holds a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.config import ServerConfig
from tauflow.core.server import GrpcServer, ServiceBinding

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, not shared with the test's others


class Parked(queue_pb2_grpc.QueueServiceServicer):
    """Stats waits until released: a long poll, as the queue's Get and Reserve are."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0

    async def Stats(self, request, context):
        self.waiting += 1
        try:
            await self.release.wait()
        finally:
            self.waiting -= 1
        return queue_pb2.StatsResponse(trainer_version=3)


async def _server(config: ServerConfig, servicer: object | None = None) -> tuple[GrpcServer, str]:
    binding = ServiceBinding(
        QUEUE, servicer or queue_pb2_grpc.QueueServiceServicer(), queue_pb2_grpc.add_QueueServiceServicer_to_server
    )
    server = GrpcServer([binding], config)
    port = await server.start()
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpcServer, str]]:
    server, address = await _server(ServerConfig(port=0, max_health_watches=2, drain_grace_s=0))
    yield server, address
    await server.drain()


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_service_name_over_its_bound_is_refused_by_check_and_watch(served) -> None:
    _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        huge = health_pb2.HealthCheckRequest(service="s" * (1 << 20))  # the probe's were 64 MiB, kept per stream
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(huge, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "service" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Watch(huge, timeout=5).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "service" in e.value.details()
        # at the bound: answered as any unknown name
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="s" * 256), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="s" * 256), timeout=5)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watch.cancel()
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=QUEUE.full_name), timeout=5)).status == SERVING
        listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
        assert {name: s.status for name, s in listed.statuses.items()}[QUEUE.full_name] == SERVING


async def test_watch_streams_are_bounded_and_a_closed_one_frees_its_place(served) -> None:
    server, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
        assert [(await w.read()).status for w in watches] == [SERVING, SERVING]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Watch(health_pb2.HealthCheckRequest()).read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_health_watches" in e.value.details()
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING  # Check still answers
        watches[0].cancel()
        await _until(lambda: server.health.watches == 1)
        again = stub.Watch(health_pb2.HealthCheckRequest())
        assert (await again.read()).status == SERVING
        await server.set_serving(False)
        assert [(await w.read()).status for w in (watches[1], again)] == [NOT_SERVING, NOT_SERVING]
        for w in (watches[1], again):
            w.cancel()


async def test_calls_in_progress_are_bounded_per_server() -> None:
    parked = Parked()
    server, address = await _server(ServerConfig(port=0, max_concurrent_rpcs=3, drain_grace_s=0), parked)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            polls = [asyncio.ensure_future(stub.Stats(queue_pb2.StatsRequest(), timeout=10)) for _ in range(3)]
            await _until(lambda: parked.waiting == 3)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            parked.release.set()
            assert [(await p).trainer_version for p in polls] == [3, 3, 3]
            assert (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status == SERVING
    finally:
        await server.drain()


async def test_calls_of_one_connection_are_bounded_and_the_next_waits() -> None:
    parked = Parked()
    server, address = await _server(ServerConfig(port=0, max_concurrent_streams=2, drain_grace_s=0), parked)
    try:
        async with (
            grpc.aio.insecure_channel(address, options=LOCAL) as one,
            grpc.aio.insecure_channel(address, options=LOCAL) as other,
        ):
            stub = queue_pb2_grpc.QueueServiceStub(one)
            polls = [asyncio.ensure_future(stub.Stats(queue_pb2.StatsRequest(), timeout=10)) for _ in range(3)]
            await asyncio.sleep(0.5)
            assert parked.waiting == 2  # the third waits on its client's side for a stream
            assert (await health_pb2_grpc.HealthStub(other).Check(health_pb2.HealthCheckRequest())).status == SERVING
            parked.release.set()
            assert [(await p).trainer_version for p in polls] == [3, 3, 3]
    finally:
        await server.drain()


async def test_the_defaults_hold_hundreds_of_long_polls() -> None:
    """Many rollout replicas' long polls (Get, Reserve) on one queue, each replica its own connection."""
    parked = Parked()
    server, address = await _server(ServerConfig(port=0, drain_grace_s=0), parked)
    try:
        channels = [grpc.aio.insecure_channel(address, options=LOCAL) for _ in range(4)]
        polls = [
            asyncio.ensure_future(queue_pb2_grpc.QueueServiceStub(channels[i % 4]).Stats(queue_pb2.StatsRequest()))
            for i in range(600)
        ]
        await _until(lambda: parked.waiting == 600, timeout_s=30)
        parked.release.set()
        assert {(await p).trainer_version for p in polls} == {3}
        for c in channels:
            await c.close()
    finally:
        await server.drain()


async def test_the_drain_ends_open_watch_streams_after_telling_them_not_serving() -> None:
    server, address = await _server(ServerConfig(port=0, drain_grace_s=10))
    async with grpc.aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())  # no deadline
        assert (await watch.read()).status == SERVING
        start = time.monotonic()
        await server.drain()
        took = time.monotonic() - start
        assert (await watch.read()).status == NOT_SERVING
        assert await watch.read() == grpc.aio.EOF
        assert await watch.code() == grpc.StatusCode.OK
    assert took < 3, f"the drain took {took:.1f} s: the Watch stream held it for the grace"
