"""The asyncio gRPC server bootstrap every service uses.

It registers the service's servicers, the standard health service (every
service NOT_SERVING until the app says it is ready), ``info.v1.ServerInfoService``
(role, build version, contract revisions: ``tauflow.core.serverinfo``) and server reflection
(``grpc.reflection.v1`` and ``v1alpha``), applies the message-size limits, and drains gracefully: on
SIGTERM or SIGINT health turns NOT_SERVING, new calls are refused, in-flight calls get
``drain_grace_s`` to finish, then the app's shutdown hooks run.

A port in use is an error (SO_REUSEPORT off: gRPC's default would let a second process share the port and
the kernel split the connections between them). A handler that raises an unexpected exception answers
INTERNAL with a neutral message, is logged with its traceback and counted
(``tauflow_server_unexpected_errors_total``): never gRPC's UNKNOWN carrying the exception's text. Every
such call is counted; its traceback is logged once per kind (method, exception type) per minute.

What a caller may hold is bounded (the queue's external port serves health, info and reflection without a
token): calls in progress (``server.max_concurrent_rpcs``), calls of one connection
(``server.max_concurrent_streams``), health Watch streams and health's service names
(``server.max_health_watches``, ``tauflow.core.health``); the drain ends open Watch streams. Health, info
and reflection decode their requests as the services do (``tauflow.core.decoding``): bytes that do not
decode answer INVALID_ARGUMENT.

grpcio's asyncio server shuts itself down for good on one request whose method path is not UTF-8 (before any
interceptor sees it); ``GrpcServer.keep_serving`` then ends the service (exit code 1), so that its launcher
restarts it (``tauflow_server_stopped_by_itself_total``). Compressed requests are refused (UNIMPLEMENTED) before they
are inflated: the message limit counts inflated bytes, and tauflow's clients never compress.

A service may serve a second face on its own port (``ServiceApp.extra_servers``,
e.g. the queue's authenticated external port): the same bootstrap with its own
bindings, server interceptors and optional TLS credentials, started, reported in
the ready file (``<name>_port``) and drained together with the main server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import logging
import os
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from tauflow.core import health
from tauflow.core.auth import RunTokenAuth
from tauflow.core.config import ServerConfig
from tauflow.core.decoding import add_handlers, checked_handlers, servicer_adder
from tauflow.core.files import write_atomic
from tauflow.core.metrics import ServerMetrics
from tauflow.core.net import is_loopback
from tauflow.core.runtoken import CONTROL_METHODS
from tauflow.core.serverinfo import SERVICE as INFO_SERVICE
from tauflow.core.serverinfo import ServerInfoServicer, server_info
from tauflow.core.status import bounded_details

log = logging.getLogger(__name__)

# grpcio-reflection ships only v1alpha; v1 is the same protocol (same messages, field for field) under a
# new name, which current grpcurl and buf curl try first. It is served, not listed: the default descriptor
# pool holds no v1 file, and a listed service that cannot be described breaks `grpcurl describe`.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES = (reflection.SERVICE_NAME, REFLECTION_V1)
INTERNAL_MESSAGE = "internal error; the server logged it"
TRACEBACK_INTERVAL_S = 60.0  # the catch-all logs one traceback per kind (method, exception type) this often
MAX_TRACEBACK_KINDS = 1024
_server_metrics: ServerMetrics | None = None


def server_metrics() -> ServerMetrics:
    """The process's ``tauflow_server_*`` metrics (on the default registry, created once)."""
    global _server_metrics
    if _server_metrics is None:
        _server_metrics = ServerMetrics()
    return _server_metrics


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def connection_options(config: ServerConfig) -> list[tuple[str, int]]:
    """What a server's connections may hold (gRPC's defaults bound none of it: a client that opened thousands of
    idle connections took every descriptor of the process, and its other port stopped accepting):"""
    return [
        # Client connections open at once on this port; one more is closed at once (its calls: UNAVAILABLE).
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        # A connection with no call in progress for this long gets GOAWAY (a channel reconnects at its next call;
        # keepalive pings do not count as calls).
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
        # A connection that has not completed its handshake (TLS, HTTP/2 preface) by then is closed (gRPC: 120 s).
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
    ]


def raise_open_files_limit() -> tuple[int, int]:
    """Raises this process's soft limit of open files (RLIMIT_NOFILE) to its hard limit, as far as the
    platform allows; returns (before, after). A server started with the common soft limit of 1024 ran out of
    descriptors at about 1000 connections; every server bounds its own (``server.max_connections``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft != hard:
        with contextlib.suppress(ValueError, OSError):  # (a sandbox may refuse: the limit stays as it was)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass(frozen=True)
class ServiceBinding:
    """One servicer and what the server needs to register it."""

    descriptor: ServiceDescriptor
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


@dataclass(frozen=True)
class ExtraServer:
    """A further gRPC server of the same process, on its own port: ``name`` keys its port in the ready
    file (``<name>_port``); it shares the process's state through the servicers in ``bindings``."""

    name: str
    bindings: Sequence[ServiceBinding]
    config: ServerConfig
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    credentials: grpc.ServerCredentials | None = None


@dataclass
class ServiceApp:
    """What a service's ``build`` returns: its servicers and their lifecycle.

    ``background`` coroutines run while the server serves and are cancelled on
    drain; ``close`` runs after the server stopped (flush logs, close files).
    """

    bindings: Sequence[ServiceBinding]
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()
    close: Callable[[], Awaitable[None] | None] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    on_serving: Callable[[int], None] | None = None  # told the bound port (e.g. to register with a peer)
    on_drain: Callable[[], None] | None = None  # told the drain begins (e.g. to end long-lived streams)
    extra_servers: Sequence[ExtraServer] = ()


def tls_server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials from a PEM certificate chain and its private key (files, so that a mounted
    secret can hold them). Both are checked here (they parse, the key is the certificate's, the key is
    not encrypted): gRPC would only fail to bind, saying nothing of why. Errors name the files, never
    their content."""
    pems = []
    for what, path in (("certificate", cert_file), ("private key", key_file)):
        try:
            pems.append(Path(path).read_bytes())
        except OSError as e:
            raise OSError(f"cannot read the TLS {what} {path}: {e.strerror}") from e
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=_no_password)
    except (ssl.SSLError, ValueError, TypeError) as e:
        reason = getattr(e, "reason", None)  # OpenSSL's, e.g. KEY_VALUES_MISMATCH
        why = reason.lower().replace("_", " ") if reason else "not a PEM certificate chain and its unencrypted key"
        raise ValueError(
            f"the TLS certificate {cert_file} and private key {key_file} cannot be used: {why}"
        ) from None  # (OpenSSL's messages name no content; the chained exception is left out all the same)
    return grpc.ssl_server_credentials([(pems[1], pems[0])])


def _no_password() -> bytes:
    raise ValueError("the private key is encrypted; gRPC needs it unencrypted")


class BoundedDetails:
    """A handler's context whose status messages are cut to ``tauflow.core.status.MAX_DETAILS_BYTES``: whatever a
    handler quotes of a request, its refusal keeps its code (every other use goes to the context itself)."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        await self._context.abort(code, bounded_details(details), trailing_metadata)
        raise AssertionError("unreachable")  # (abort raises)

    def set_details(self, details: str) -> None:
        self._context.set_details(bounded_details(details))


class CatchAll(grpc.aio.ServerInterceptor):
    """Turns an unexpected exception of any handler, unary or streaming, into INTERNAL with a neutral
    message, logged with its traceback and counted. ``context.abort`` (which raises ``AbortError``) and
    cancellation pass through untouched, so an aborted call keeps its code. Every handler gets its context as
    :class:`BoundedDetails`, so that no status message outgrows what clients accept.

    Every such call is counted; the traceback of a kind (method and exception type) is logged once per
    ``traceback_interval_s``, so that a caller who can provoke the bug at will cannot flood the log: the
    next one logged says how many of its kind were left out since (``suppressed``)."""

    def __init__(self, metrics: ServerMetrics, traceback_interval_s: float = TRACEBACK_INTERVAL_S) -> None:
        self.metrics = metrics
        self.traceback_interval_s = traceback_interval_s
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (last logged, left out since)

    async def intercept_service(self, continuation, details):
        method = details.method.lstrip("/")
        try:
            handler = await continuation(details)
        except Exception:  # noqa: BLE001 - a later interceptor failed: the call cannot be routed
            self._record(method)
            return grpc.unary_unary_rpc_method_handler(self._abort_internal)
        if handler is None:
            return None  # UNIMPLEMENTED; ``method`` (the caller's choice) is never a label of an unknown method
        for kind, make in _HANDLER_KINDS.items():
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return make(
                    self._guard(behaviour, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _guard(self, behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request, context):
                context = BoundedDetails(context)
                try:
                    async for item in behaviour(request, context):
                        yield item
                except (grpc.aio.AbortError, asyncio.CancelledError) as e:
                    await _close_requests(request)
                    del request  # (see _release_frames)
                    _release_frames(e)
                    raise
                except Exception as e:  # noqa: BLE001 - the catch-all: any bug becomes INTERNAL, logged
                    await _close_requests(request)
                    del request
                    try:
                        if _unsent(e) or _caller_gone(context):
                            await self._end_quietly(method, context, e)
                        await self._failed(method, context, e)
                    finally:
                        _release_frames(e)

            return stream
        if inspect.iscoroutinefunction(behaviour):

            async def call(request, context):
                context = BoundedDetails(context)
                try:
                    return await behaviour(request, context)
                except (grpc.aio.AbortError, asyncio.CancelledError) as e:
                    del request  # (see _release_frames)
                    _release_frames(e)
                    raise
                except Exception as e:  # noqa: BLE001 - the catch-all: any bug becomes INTERNAL, logged
                    del request
                    try:
                        if _unsent(e) or _caller_gone(context):  # (no one there to answer, it seems)
                            await self._end_quietly(method, context, e)
                        await self._failed(method, context, e)
                    finally:
                        _release_frames(e)

            return call
        return behaviour  # a synchronous handler (none in tauflow): gRPC's own handling applies

    def _record(self, method: str, error: BaseException | None = None) -> None:
        """Counts ``error`` (default: the exception being handled), and logs it with its traceback unless its
        kind was logged less than ``traceback_interval_s`` ago."""
        self.metrics.unexpected_errors.labels(method).inc()
        error = error if error is not None else sys.exc_info()[1]
        kind = (method, type(error).__qualname__ if error is not None else "")
        now = time.monotonic()
        if kind not in self._logged and len(self._logged) >= MAX_TRACEBACK_KINDS:
            # (bounded: a later interceptor that fails for any method name the caller chooses)
            self._logged = {k: v for k, v in self._logged.items() if now - v[0] < self.traceback_interval_s}
            if len(self._logged) >= MAX_TRACEBACK_KINDS:
                kind = ("", "")  # every further kind shares one allowance until some expire
        logged, left_out = self._logged.get(kind, (None, 0))
        if logged is not None and now - logged < self.traceback_interval_s:
            self._logged[kind] = (logged, left_out + 1)
            return
        self._logged[kind] = (now, 0)
        log.error(
            "unexpected error in a handler; answered INTERNAL",
            exc_info=error,
            extra={"method": method, "suppressed": left_out},
        )

    async def _end_quietly(self, method: str, context: grpc.aio.ServicerContext, error: Exception) -> None:
        """A handler failed once its caller seemed gone (its deadline passed, gRPC cancelled the handler): an
        abort gRPC can no longer send is then no bug, and the call ends as cancelled, neither logged nor
        counted (it was logged with two tracebacks, counted, and aborted again: "Abort already called!"). Should
        the abort be sent after all (the caller was there), the error is recorded as any other."""
        try:
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        except grpc.aio.AbortError:
            self._record(method, error)
            raise
        except Exception:  # noqa: BLE001 - the call is over: there is no one to answer
            raise asyncio.CancelledError from None

    async def _failed(self, method: str, context: grpc.aio.ServicerContext, error: Exception) -> None:
        if isinstance(error, NotImplementedError):  # the generated base class's method: not built, not a bug
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this method is not implemented by this server")
        self._record(method)
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)

    @staticmethod
    async def _abort_internal(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _release_frames(error: BaseException) -> None:
    """Lets go of the frames ``error`` went through, and those of the exceptions it chains (once logged).
    grpcio keeps a call's last exception (an abort's too) in a reference cycle that only Python's cycle
    collector frees, and those frames held the handler's request: twenty refused 205 MB requests held 2.6 GB
    of a server until a collection. The tracebacks are dropped, not their frames cleared: on Python 3.11 and
    3.12 clearing a frame closes a coroutine suspended in it (a long-lived task whose error reached the
    handler through a future would have been ended)."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


async def _close_requests(request: Any) -> None:
    """Ends a streaming call's request iterator, whose generator held the last message read until it was
    collected (see _release_frames); a single request is left as it is."""
    if hasattr(request, "__aiter__"):
        with contextlib.suppress(Exception):
            await request.__aiter__().aclose()


# gRPC's error for an answer (or an abort's status) it could not send: the caller closed its connection, or
# never opened its flow-control window. A private type of grpcio's (tested: test_server.py); where it is absent
# nothing matches.
_SEND_FAILED: tuple[type[BaseException], ...]
try:
    from grpc._cython.cygrpc import ExecuteBatchError

    _SEND_FAILED = (ExecuteBatchError,)
except ImportError:  # pragma: no cover - a grpcio without it
    _SEND_FAILED = ()


def _unsent(error: BaseException) -> bool:
    """Whether a handler failed because gRPC could not send what it wrote (an abort's status, a message): its
    caller seems gone, and the call ends quietly (CatchAll._end_quietly). Taken as a bug, it was logged,
    counted, and aborted again ("Abort already called!", logged by gRPC with a traceback for each: 2,871 of
    them from one client that asked without a token and left)."""
    return isinstance(error, _SEND_FAILED)


def _caller_gone(context: Any) -> bool:
    """Whether the caller seems to have given up: gRPC cancelled the handler's task (a handler's own
    asyncio.timeout takes its cancel back; context.cancelled() says False for a passed deadline), or the
    call's deadline passed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        return True
    with contextlib.suppress(Exception):  # (a context that cannot say: taken as live)
        remaining = context.time_remaining()
        return remaining is not None and remaining <= 0
    return False


_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class BoundedReflection(reflection.aio.ReflectionServicer):
    """grpcio-reflection's servicer, bounded: at most ``max_streams`` streams at once (one more is refused
    RESOURCE_EXHAUSTED, naming ``server.max_reflection_streams``), and a stream that sends no request for
    ``idle_s`` is ended DEADLINE_EXCEEDED (``server.reflection_idle_s``). Its streams were unbounded and never
    ended: a client that opened thousands and sent nothing held every call slot of the server
    (``max_concurrent_rpcs``), and the run's own calls were refused RESOURCE_EXHAUSTED. A tool (grpcurl, buf
    curl) sends its requests one after another and closes the stream."""

    def __init__(self, service_names: Sequence[str], *, max_streams: int, idle_s: float) -> None:
        super().__init__(tuple(service_names))
        self.max_streams = max_streams
        self.idle_s = idle_s
        self.streams = 0  # reflection streams open now

    async def ServerReflectionInfo(self, request_iterator: Any, context: Any) -> Any:
        if self.streams >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.streams} reflection streams are open, this server's limit (server.max_reflection_streams); "
                "retry once one has ended",
            )
        self.streams += 1
        try:
            answers = super().ServerReflectionInfo(self._until_idle(request_iterator, context), context)
            async for answer in answers:
                yield answer
        finally:
            self.streams -= 1

    async def _until_idle(self, requests: Any, context: Any) -> Any:
        it = requests.__aiter__()
        while True:
            try:
                async with asyncio.timeout(self.idle_s):
                    request = await it.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no reflection request for {self.idle_s:g} s (server.reflection_idle_s): the stream is ended",
                )
            yield request


def _add_reflection(servicer: Any, server: grpc.aio.Server) -> None:
    """The v1alpha servicer under its name and under the v1 name (wire-identical messages). Its requests are
    decoded and bounded as every service's (``tauflow.core.decoding``): bytes that do not decode end the stream
    with INVALID_ARGUMENT, not with the servicer's DecodeError (INTERNAL, and a traceback logged per call)."""
    handlers = checked_handlers(REFLECTION, servicer)
    for name in REFLECTION_SERVICES:
        add_handlers(server, name, handlers)


def _bind_check(host: str, port: int, key: str) -> None:
    """Raises OSError naming the port when something already listens on it. gRPC's own failure says only
    "failed to bind" (and logs a multi-line error first); a plain bind tells why."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port} ({key}): {e.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no clash
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(f"cannot listen on {host}:{port} ({key}): the port is in use") from None
                if e.errno != errno.EAFNOSUPPORT:  # (an IPv6 address on a host without IPv6: gRPC skips it too)
                    raise OSError(f"cannot listen on {host}:{port} ({key}): {e.strerror}") from None


class GrpcServer:
    def __init__(
        self,
        bindings: Sequence[ServiceBinding],
        config: ServerConfig,
        *,
        role: str = "",
        version: str = "",
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        key: str = "server",
        run_token: str = "",
    ) -> None:
        self.config = config
        self.credentials = credentials
        self.key = key  # the config section, named in errors ("server.port")
        info = server_info(role, version, [b.descriptor for b in bindings])
        self.bindings = [
            *bindings,
            # (undecodable requests: INVALID_ARGUMENT, as the services' own; not the generated adder's UNKNOWN)
            ServiceBinding(INFO_SERVICE, ServerInfoServicer(info), servicer_adder(INFO_SERVICE)),
        ]
        self.catch_all = CatchAll(server_metrics())
        if run_token:
            interceptors = [RunTokenAuth(run_token), *interceptors]
        elif (
            key == "server"  # (an extra server, e.g. the queue's external port, is guarded by its own interceptors)
            and not is_loopback(config.host)
            and any(b.descriptor.full_name in CONTROL_METHODS for b in bindings)
        ):
            log.warning(
                "no run token (auth.token_file): the control methods are open to any caller that reaches the port",
                extra={"key": f"{key}.host", "host": config.host},
            )
        self.interceptors = [self.catch_all, *interceptors]
        self.draining = False
        self.server = self._build()
        self.port: int | None = None

    def _build(self) -> grpc.aio.Server:
        """A gRPC server with every binding, health, info and reflection (a new one each time: ``keep_serving``)."""
        config = self.config
        server = grpc.aio.server(
            # First, so that it guards what the others return too. A keyword: telemetry's instrumentation
            # adds its own.
            interceptors=self.interceptors,
            # Calls in progress at once, streams and long polls included: one more is refused RESOURCE_EXHAUSTED.
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            options=[
                *message_size_options(config.max_message_bytes),
                *connection_options(config),
                # Streams one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a
                # client's further calls wait for one to end (gRPC's default is unbounded).
                ("grpc.max_concurrent_streams", config.max_concurrent_streams),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a port shared with another process
                # Accept the keepalive pings our channels send (every 30 s, also when idle); gRPC's
                # default policy answers them with GOAWAY "too_many_pings".
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
                # Uncompressed messages only (a compressed one is refused before it is inflated): the message
                # limit counts inflated bytes, so 250 KB of gzip on the wire held 250 MB each, before any
                # token or field was checked. tauflow's clients never compress.
                ("grpc.compression_enabled_algorithms_bitset", 1),
            ],
        )
        # Bounded (tauflow.core.health): its service names, its Watch streams, which end when the server drains.
        self.health = health.HealthServicer(config.max_health_watches)
        for b in self.bindings:
            b.add_to_server(b.servicer, server)
        servicer_adder(health.SERVICE, health.LIMITS)(self.health, server)
        names = [b.descriptor.full_name for b in self.bindings]
        # Bounded as health Watch is: its streams at once (server.max_reflection_streams), and each ended once
        # idle (server.reflection_idle_s): 10,000 idle reflection streams held every call slot of a server.
        self.reflection = BoundedReflection(
            (*names, health.SERVICE.full_name, reflection.SERVICE_NAME),
            max_streams=config.max_reflection_streams,
            idle_s=config.reflection_idle_s,
        )
        _add_reflection(self.reflection, server)
        return server

    async def keep_serving(self) -> None:
        """Returns when the server drains; raises when the gRPC server stops by itself. grpcio's asyncio server
        shuts down for good on one request whose method path is not UTF-8 (a single packet, before any
        interceptor or token check), and the process went on without a port: nothing restarted it and the run
        stalled. Raising ends the service (exit code 1), so that its launcher restarts it. (Serving again in
        the same process was tried: grpcio's state after that shutdown made the new server fail to serve, or
        the process crash, now and then.)"""
        try:
            await self.server.wait_for_termination()
            why = "it stopped"
        except Exception as e:  # noqa: BLE001 - grpcio's main loop raised (UnicodeDecodeError)
            why = f"{type(e).__name__}: {e}"[:300]
        if self.draining:
            return
        server_metrics().stopped_by_itself.labels(self.key).inc()
        raise RuntimeError(
            f"the gRPC server on port {self.port} ({self.key}) stopped by itself ({why}): "
            "exiting so that the launcher restarts this process"
        )

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        _bind_check(self.config.host, self.config.port, f"{self.key}.port")
        self.port = await self._bind(address)
        await self.set_serving(False)
        await self.server.start()
        return self.port

    async def _bind(self, address: str) -> int:
        try:
            if self.credentials is not None:
                port = self.server.add_secure_port(address, self.credentials)
            else:
                port = self.server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind to address ..."
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {address} ({self.key}.port): the port is in use or the host is not local")
        return int(port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *(b.descriptor.full_name for b in self.bindings)):
            self.health.set(name, status)

    async def drain(self) -> None:
        self.draining = True
        await self.set_serving(False)
        self.health.close()  # open Watch streams send NOT_SERVING and end: none holds the drain for its grace
        await self.server.stop(self.config.drain_grace_s)


def write_ready_file(path: str | os.PathLike[str], info: dict[str, Any]) -> None:
    """Writes ``info`` as JSON atomically, so a launcher never reads half a file."""
    write_atomic(path, json.dumps(info))


async def serve(
    app: ServiceApp,
    config: ServerConfig,
    *,
    ready_info: dict[str, Any] | None = None,
    ready_file: str | None = None,
    started: Callable[[], None] | None = None,
    run_token: str = "",
) -> None:
    """Serves ``app`` until SIGTERM/SIGINT, then drains and closes it. ``started`` is called once every
    server serves and the ready file is written: an exception before it is a failure to start. With
    ``run_token``, the main server's control methods need it (tauflow.core.auth); the extra servers have
    their own interceptors."""
    ready_info = ready_info or {}
    role, version = ready_info.get("service", ""), ready_info.get("version", "")
    before, after = raise_open_files_limit()
    if after != before:
        log.debug("open files limit raised", extra={"before": before, "after": after})
    server = GrpcServer(app.bindings, config, role=role, version=version, run_token=run_token)
    extras = {
        extra.name: GrpcServer(
            extra.bindings,
            extra.config,
            role=role,
            version=version,
            interceptors=extra.interceptors,
            credentials=extra.credentials,
            key=extra.name,
        )
        for extra in app.extra_servers
    }
    try:
        port = await server.start()
        extra_ports = {f"{name}_port": await s.start() for name, s in extras.items()}
    except BaseException:
        # Stopped now: a gRPC server left to the garbage collector after the loop closed prints a traceback.
        await asyncio.gather(*(s.server.stop(None) for s in (server, *extras.values())), return_exceptions=True)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if app.on_serving is not None:
        app.on_serving(port)
    tasks = [asyncio.create_task(job(), name=getattr(job, "__name__", "background")) for job in app.background]
    from tauflow.core.lifeline import watch_parent  # TAUFLOW_PARENT_PID: drain as on SIGTERM once the launcher is gone

    tasks.append(asyncio.create_task(watch_parent(stop, config.drain_grace_s), name="lifeline"))
    servers = [server, *extras.values()]
    tasks += [asyncio.create_task(s.keep_serving(), name=f"{s.key} server") for s in servers]
    for s in servers:
        await s.set_serving(True)
    info = {"grpc_port": port, **extra_ports, "pid": os.getpid(), **ready_info, **app.info}
    log.info("serving", extra={"host": config.host, "port": port, **extra_ports})
    if ready_file:
        write_ready_file(ready_file, info)
    if started is not None:
        started()
    failed = asyncio.create_task(_first_failure(tasks))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([failed, stopped], return_when=asyncio.FIRST_COMPLETED)
    log.info("draining", extra={"grace_s": config.drain_grace_s})
    if app.on_drain is not None:
        app.on_drain()
    await asyncio.gather(*(s.drain() for s in servers))
    for t in (*tasks, failed, stopped):
        t.cancel()
    await asyncio.gather(*tasks, failed, stopped, return_exceptions=True)
    if app.close is not None:
        result = app.close()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")
    if failed.done() and not failed.cancelled() and (error := failed.exception()) is not None:
        raise error  # a background job died: the process must exit non-zero


async def _first_failure(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Returns (by raising) when a background task fails; waits forever otherwise."""
    if not tasks:
        await asyncio.Event().wait()
    for coro in asyncio.as_completed(tasks):
        await coro  # a background job that returns normally is fine; one that raises stops the service
    await asyncio.Event().wait()
