"""What a hostile client may hold of a server's transport, bounded (docs/runtime.md, "Server"):

- a call refused for its token is answered before its request is read (a half-sent message of 48 MiB is
  neither buffered nor waited for);
- reflection streams: at most ``server.max_reflection_streams`` at once, each ended after
  ``server.reflection_idle_s`` without a request;
- connections: at most ``server.max_connections``, idle ones closed after ``server.max_connection_idle_s``,
  silent ones after ``server.handshake_timeout_s``; the open-files limit raised to its hard limit at start;
- /metrics: a slowly dripping connection holds its slot ``request_timeout_s`` at most;
- OpenTelemetry's "Failed to detach context" tracebacks: one short line per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core import telemetry
from tauflow.core.auth import refusal
from tauflow.core.config import ServerConfig
from tauflow.core.metrics import serve_metrics
from tauflow.core.server import GrpcServer, ServiceBinding, raise_open_files_limit

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
TOKEN = "run-token-0123456789abcdef"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Queue(queue_pb2_grpc.QueueServiceServicer):
    def __init__(self) -> None:
        self.version = 0

    async def SetTrainerVersion(self, request, context):
        self.version = request.policy_version
        return queue_pb2.SetTrainerVersionResponse(trainer_version=self.version)

    async def Stats(self, request, context):
        return queue_pb2.StatsResponse(trainer_version=self.version)

    async def Deliver(self, requests, context):  # (streaming, guarded)
        async for _ in requests:
            yield queue_pb2.DeliverResponse()


@contextlib.asynccontextmanager
async def _server(config: ServerConfig, **kwargs) -> AsyncIterator[tuple[GrpcServer, int]]:
    binding = ServiceBinding(QUEUE, Queue(), queue_pb2_grpc.add_QueueServiceServicer_to_server)
    server = GrpcServer([binding], config, **kwargs)
    port = await server.start()
    await server.set_serving(True)
    try:
        yield server, port
    finally:
        await server.drain()


# -- a raw HTTP/2 client that honours flow control (a gRPC client cannot stop before a message's last byte) --


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class RawConnection:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.cv = threading.Condition()
        self.conn_window = self.init_window = 65535
        self.windows: dict[int, int] = {}
        self.max_frame = 16384
        self.answered: dict[int, float] = {}  # stream -> when its first HEADERS or RST_STREAM came
        self.closed = False
        self.sock.sendall(PREFACE + _frame(4, 0, 0))
        threading.Thread(target=self._read, daemon=True).start()

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _read(self) -> None:
        try:
            while True:
                head = self._recv(9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv(length) if length else b""
                with self.cv:
                    if kind == 4 and not flags & 1:  # SETTINGS
                        for i in range(0, len(payload), 6):
                            key, value = struct.unpack(">HI", payload[i : i + 6])
                            if key == 4:
                                for s in self.windows:
                                    self.windows[s] += value - self.init_window
                                self.init_window = value
                            elif key == 5:
                                self.max_frame = value
                        self.sock.sendall(_frame(4, 1, 0))
                    elif kind == 8:  # WINDOW_UPDATE
                        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                        if sid == 0:
                            self.conn_window += increment
                        elif sid in self.windows:
                            self.windows[sid] += increment
                    elif kind == 6 and not flags & 1:  # PING
                        self.sock.sendall(_frame(6, 1, 0, payload))
                    elif kind in (1, 3) and sid:  # HEADERS, RST_STREAM
                        self.answered.setdefault(sid, time.monotonic())
                    self.cv.notify_all()
        except (OSError, EOFError, struct.error):
            with self.cv:
                self.closed = True
                self.cv.notify_all()

    def open(self, path: bytes, stream: int = 1) -> int:
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"x"),
                   (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
        block = b"".join(b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v for n, v in headers)
        with self.cv:
            self.windows[stream] = self.init_window
            self.sock.sendall(_frame(1, 0x4, stream, block))
        return stream

    def send(self, stream: int, data: bytes, stall_s: float) -> int:
        """Sends what the windows allow; returns how many bytes went once the server gave no more window for
        ``stall_s`` (or answered, or closed)."""
        sent = 0
        while sent < len(data):
            with self.cv:
                waited = time.monotonic()
                while min(self.conn_window, self.windows[stream]) <= 0:
                    if self.closed or stream in self.answered or time.monotonic() - waited > stall_s:
                        return sent
                    self.cv.wait(0.1)
                if stream in self.answered:
                    return sent
                n = min(len(data) - sent, self.conn_window, self.windows[stream], self.max_frame)
                self.sock.sendall(_frame(0, 0, stream, data[sent : sent + n]))
                self.conn_window -= n
                self.windows[stream] -= n
                sent += n
        return sent

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# -- item 2: a refused call is answered before its request is read ------------------------------------------


MESSAGE_BYTES = 48 << 20


async def _half_sent(port: int, path: bytes) -> tuple[int, float | None]:
    """A call of ``path`` whose 48 MiB message is sent but for its last byte: how much of it the server took,
    and after how long it answered (None: not within 3 s of taking all it would)."""

    def run() -> tuple[int, float | None]:
        conn = RawConnection(port)
        try:
            stream = conn.open(path)
            started = time.monotonic()
            body = b"\x00" + struct.pack(">I", MESSAGE_BYTES) + b"\x00" * (MESSAGE_BYTES - 1)
            sent = conn.send(stream, body, stall_s=3.0)
            deadline = time.monotonic() + 3.0
            with conn.cv:
                while stream not in conn.answered and time.monotonic() < deadline:
                    conn.cv.wait(0.1)
            answered = conn.answered.get(stream)
            return sent, None if answered is None else answered - started
        finally:
            conn.close()

    return await asyncio.to_thread(run)


async def test_a_control_call_without_the_token_is_refused_before_its_request_is_read() -> None:
    config = ServerConfig(port=0, drain_grace_s=0, max_message_bytes=64 << 20)
    async with _server(config, run_token=TOKEN) as (_, port):
        sent, answered = await _half_sent(port, b"/tauflow.api.queue.v1.QueueService/SetTrainerVersion")
        assert answered is not None and answered < 2.0, "the refusal waited for the request"
        assert sent < MESSAGE_BYTES // 2, f"the server took {sent >> 20} MiB of a refused call"
        # (an open method, for comparison, takes the message up to the limit: the bound is the token's)
        sent, _ = await _half_sent(port, b"/tauflow.api.queue.v1.QueueService/Stats")
        assert sent == MESSAGE_BYTES + 4
        # A call with the token still works; one without is UNAUTHENTICATED, unary or streaming.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            metadata = (("authorization", f"Bearer {TOKEN}"),)
            answer = await stub.SetTrainerVersion(
                queue_pb2.SetTrainerVersionRequest(policy_version=7), metadata=metadata
            )
            assert answer.trainer_version == 7
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(policy_version=9), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "control method" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Deliver(iter([queue_pb2.DeliverRequest()]), timeout=5):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await stub.Stats(queue_pb2.StatsRequest(), timeout=5)).trainer_version == 7


class _RefuseAll(grpc.aio.ServerInterceptor):
    """As the queue's external port refuses a call without a client token (BearerTokenAuth): ``refusal``."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.endswith("/Stats") or handler is None:
            return handler
        return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "no token")


async def test_refusal_answers_any_kind_of_method_without_reading_its_request() -> None:
    config = ServerConfig(port=0, drain_grace_s=0, max_message_bytes=64 << 20)
    async with _server(config, interceptors=[_RefuseAll()]) as (_, port):
        queue = b"/tauflow.api.queue.v1.QueueService/"
        # unary, bidi, bidi, response-streaming
        for method in (
            queue + b"SetTrainerVersion",
            queue + b"Deliver",
            queue + b"PutStream",
            b"/grpc.health.v1.Health/Watch",
        ):
            sent, answered = await _half_sent(port, method)
            assert answered is not None and answered < 2.0, method
            assert sent < MESSAGE_BYTES // 2, (method, sent)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = queue_pb2_grpc.QueueServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and refused.value.details() == "no token"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await stub.Stats(queue_pb2.StatsRequest(), timeout=5)  # what it admits works


# -- item 3: reflection streams, bounded and ended when idle ---------------------------------------------


def _reflection(channel: grpc.aio.Channel):
    return channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )


async def test_reflection_streams_are_bounded_and_an_idle_one_is_ended() -> None:
    config = ServerConfig(port=0, drain_grace_s=0, max_reflection_streams=2, reflection_idle_s=1.0)
    async with _server(config) as (server, port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = _reflection(channel)
        idle = [info(timeout=30) for _ in range(2)]  # they send nothing
        for call in idle:
            await call.wait_for_connection()
        deadline = time.monotonic() + 5
        while server.reflection.streams < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        # (refused as it opens: a request sent on it could race the refusal, and the client then saw its own
        # failed send, INTERNAL, instead of the server's answer)
        refused = info(timeout=5)
        assert await refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_reflection_streams" in (await refused.details() or "")
        # The idle ones end by themselves, and the slots are free again.
        started = time.monotonic()
        for call in idle:
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "server.reflection_idle_s" in (await call.details())
        assert time.monotonic() - started < 3.0
        assert server.reflection.streams == 0
        # A stream that keeps asking is served for longer than the idle time.
        call = info(timeout=10)
        for _ in range(3):
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            answer = await call.read()
            assert "tauflow.api.queue.v1.QueueService" in {s.name for s in answer.list_services_response.service}
            await asyncio.sleep(0.6)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


# -- item 5: connections ---------------------------------------------------------------------------------


def _raw_sockets(port: int, n: int, preface: bool) -> list[socket.socket]:
    sockets = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if preface:
            s.sendall(PREFACE + _frame(4, 0, 0))
        sockets.append(s)
    return sockets


def _closed_by_server(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the server closed (end of file or a reset, after what it sent)."""
    closed = 0
    for s in sockets:
        s.setblocking(False)
        try:
            while s.recv(65536):
                pass
            closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


async def _wait_closed(sockets: list[socket.socket], expected: int, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while (closed := _closed_by_server(sockets)) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return closed


async def _check(port: int) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await queue_pb2_grpc.QueueServiceStub(channel).Stats(queue_pb2.StatsRequest(), timeout=3)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_connections_past_max_connections_are_closed_and_the_port_serves_once_they_go() -> None:
    async with _server(ServerConfig(port=0, drain_grace_s=0, max_connections=5)) as (_, port):
        sockets = await asyncio.to_thread(_raw_sockets, port, 20, True)
        try:
            assert await _wait_closed(sockets, 15, within_s=5) >= 15
            assert await _check(port) == grpc.StatusCode.UNAVAILABLE  # (a hostile client can still fill this port)
        finally:
            for s in sockets:
                s.close()
        deadline = time.monotonic() + 10
        while await _check(port) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the port did not serve again once the connections closed"


async def test_an_idle_connection_is_closed_and_a_silent_one_is_closed_after_the_handshake_timeout() -> None:
    config = ServerConfig(port=0, drain_grace_s=0, max_connection_idle_s=1, handshake_timeout_s=0.5)
    async with _server(config) as (_, port):
        idle = await asyncio.to_thread(_raw_sockets, port, 10, True)  # a preface and SETTINGS, no call
        silent = await asyncio.to_thread(_raw_sockets, port, 10, False)  # nothing at all
        try:
            assert await _wait_closed(silent, 10, within_s=4) == 10
            assert await _wait_closed(idle, 10, within_s=6) == 10
            assert await _check(port) == grpc.StatusCode.OK
        finally:
            for s in idle + silent:
                s.close()


def test_connection_settings_have_bounds() -> None:
    for key, value in (
        ("max_connections", 0),
        ("max_connection_idle_s", 0),
        ("handshake_timeout_s", 0),
        ("handshake_timeout_s", 3600),
        ("max_reflection_streams", -1),
        ("reflection_idle_s", 0),
    ):
        with pytest.raises(ValueError, match=key):
            ServerConfig(**{key: value})


@pytest.fixture
def low_open_files_limit() -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip("needs a finite hard limit of open files above 256")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_open_files_limit_is_raised_to_the_hard_limit(low_open_files_limit: int) -> None:
    assert raise_open_files_limit() == (256, low_open_files_limit)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low_open_files_limit


async def test_serve_raises_the_open_files_limit(low_open_files_limit: int, tmp_path) -> None:
    from tauflow.core.server import ServiceApp, serve

    binding = ServiceBinding(QUEUE, Queue(), queue_pb2_grpc.add_QueueServiceServicer_to_server)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(ServiceApp([binding]), ServerConfig(port=0, drain_grace_s=0), started=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low_open_files_limit
    finally:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)  # (serve's own handler: it drains and returns)
        await asyncio.wait_for(task, 10)


# -- item 9: /metrics under slowly dripping connections ----------------------------------------------------


def test_slowly_dripping_connections_hold_a_metrics_slot_for_request_timeout_s_at_most() -> None:
    server = serve_metrics("127.0.0.1", 0, idle_timeout_s=5.0, request_timeout_s=1.0, max_connections=4)
    stop = threading.Event()
    sockets = []

    def drip(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.sendall(b"GET /metrics HTTP/1.1\r\nX: ")
            while not stop.wait(0.2):  # a byte well within the idle timeout, for ever
                s.sendall(b"a")

    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sockets.append(s)
            threading.Thread(target=drip, args=(s,), daemon=True).start()
        time.sleep(0.3)
        deadline, scraped = time.monotonic() + 4.0, None
        started = time.monotonic()
        while scraped is None and time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2) as answer,
            ):
                scraped = answer.status
            time.sleep(0.1)
        assert scraped == 200, "every scrape was refused while the slow connections held the slots"
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        for s in sockets:
            s.close()
        server.close()


# -- item 8: OpenTelemetry's detach tracebacks ---------------------------------------------------------------


def test_failed_to_detach_context_is_one_short_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry import context

    telemetry.quiet_detach_errors(every_s=60.0)
    caplog.set_level(logging.INFO)
    try:
        for _ in range(50):
            token = context.attach(context.get_current())
            # Detached in another context than its own: what the aio instrumentation does for a dropped stream.
            threading.Thread(target=context.detach, args=(token,)).start()
            time.sleep(0.001)
        time.sleep(0.2)
        lines = [r for r in caplog.records if r.name == "opentelemetry.context"]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].exc_info is None and lines[0].levelno == logging.WARNING
        assert "failed to detach a trace context" in lines[0].getMessage()
        logging.getLogger("opentelemetry.context").error("something else")  # other lines pass as they are
        assert caplog.records[-1].getMessage() == "something else"
    finally:
        logging.getLogger("opentelemetry.context").filters.clear()


def test_setup_telemetry_installs_the_detach_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_configured", True)  # (no instrumentation of this test process)
    logger = logging.getLogger("opentelemetry.context")
    logger.filters.clear()
    try:
        telemetry.setup_telemetry("test", "0")
        telemetry.setup_telemetry("test", "0")
        assert [type(f) for f in logger.filters] == [telemetry.DetachErrors]
    finally:
        logger.filters.clear()
