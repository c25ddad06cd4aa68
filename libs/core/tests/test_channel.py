"""The channel factory against a real server: retries only for idempotent RPCs, and default deadlines."""

from __future__ import annotations

import select
import socket
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.retry import is_retryable
from tauflow.core.channel import ChannelConfig, create_channel, create_sync_channel

SERVICE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]


def test_retry_classes_come_from_the_contract() -> None:
    retryable = {m.name for m in SERVICE.methods if is_retryable(m)}
    assert "Put" in retryable and "Ack" in retryable and "Stats" in retryable
    assert "Get" not in retryable  # each Get creates a lease: never sent twice


class FlakyQueue(queue_pb2_grpc.QueueServiceServicer):
    """Fails the first ``failures`` calls of each method: UNAVAILABLE, then CANCELLED (what grpcio answers to a
    call that arrives as its server stops)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def _count(self, name: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            n = self.calls[name]
        if n <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE if n == 1 else grpc.StatusCode.CANCELLED, "try again")

    def Put(self, request, context):
        self._count("Put", context)
        return queue_pb2.PutResponse(outcome=queue_pb2.PUT_OUTCOME_ACCEPTED)

    def Get(self, request, context):
        self._count("Get", context)
        return queue_pb2.GetResponse()

    def Stats(self, request, context):
        time.sleep(2.0)
        return queue_pb2.StatsResponse()


@pytest.fixture
def flaky():
    servicer = FlakyQueue(failures=2)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    queue_pb2_grpc.add_QueueServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_idempotent_calls_are_retried_and_others_are_not(flaky) -> None:
    servicer, address = flaky
    stub = queue_pb2_grpc.QueueServiceStub(create_sync_channel(address, [SERVICE]))
    stub.Put(queue_pb2.PutRequest())  # fails twice on the server, then succeeds: retried
    assert servicer.calls["Put"] == 3
    with pytest.raises(grpc.RpcError) as err:
        stub.Get(queue_pb2.GetRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["Get"] == 1  # not idempotent: sent once


def test_every_call_gets_a_default_deadline(flaky) -> None:
    _, address = flaky
    config = ChannelConfig(default_timeout_s=0.3)
    stub = queue_pb2_grpc.QueueServiceStub(create_sync_channel(address, [SERVICE], config))
    with pytest.raises(grpc.RpcError) as err:
        stub.Stats(queue_pb2.StatsRequest())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # An explicit deadline wins over the default.
    assert stub.Stats(queue_pb2.StatsRequest(), timeout=5) is not None


async def test_asyncio_channel_has_the_same_policy(flaky) -> None:
    servicer, address = flaky
    async with create_channel(address, [SERVICE], ChannelConfig(default_timeout_s=0.3)) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        await stub.Put(queue_pb2.PutRequest(), timeout=10)
        assert servicer.calls["Put"] == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Stats(queue_pb2.StatsRequest())
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


class SilentLinkProxy:
    """A TCP proxy whose open connections can be made to go silent (bytes no longer forwarded either way, the
    sockets left open: a peer gone without a FIN or RST, a NAT that lost its state) while new ones pass."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.links: list[dict[str, Any]] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            link = {"sockets": (client, server), "silent": False}
            self.links.append(link)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(link, a, b), daemon=True).start()

    def _pump(self, link: dict[str, Any], source: socket.socket, sink: socket.socket) -> None:
        while not self.closed.is_set():
            if link["silent"]:
                time.sleep(0.05)
                continue
            ready, _, _ = select.select([source], [], [], 0.05)
            if not ready or link["silent"]:
                continue
            try:
                data = source.recv(65536)
                if not data:
                    return
                sink.sendall(data)
            except OSError:
                return

    def silence_open_connections(self) -> None:
        for link in self.links:
            link["silent"] = True

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for link in self.links:
            for s in link["sockets"]:
                s.close()


class HangingQueue(queue_pb2_grpc.QueueServiceServicer):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.got = threading.Event()

    def Get(self, request, context):
        self.got.set()
        self.release.wait(60)
        return queue_pb2.GetResponse()


def test_a_connection_gone_silent_is_dropped_after_the_keepalive_ping_times_out() -> None:
    # gRPC times a keepalive ping out by grpc.http2.ping_timeout_ms (60 s by default), not by
    # keepalive_timeout_ms: without it, a call on a silent connection waited out its whole deadline.
    servicer = HangingQueue()
    server = grpc.server(
        futures.ThreadPoolExecutor(4),
        options=[  # as tauflow's servers: the client's frequent pings are welcome
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    queue_pb2_grpc.add_QueueServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = SilentLinkProxy(("127.0.0.1", port))
    try:
        config = ChannelConfig(keepalive_time_s=1.0, keepalive_timeout_s=1.0)
        stub = queue_pb2_grpc.QueueServiceStub(create_sync_channel(proxy.address, [SERVICE], config))
        call = stub.Get.future(queue_pb2.GetRequest(), timeout=40)
        assert servicer.got.wait(10)
        proxy.silence_open_connections()
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        # the ping's timeout ended the call (UNAVAILABLE), not its 40 s deadline
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    finally:
        servicer.release.set()
        proxy.close()
        server.stop(0)
