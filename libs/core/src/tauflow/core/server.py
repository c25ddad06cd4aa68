"""The asyncio gRPC server bootstrap every service uses.

It registers the service's servicers, the standard health service (every
service NOT_SERVING until the app says it is ready), ``info.v1.ServerInfoService``
(role, build version, contract revisions: ``tauflow.core.serverinfo``) and server reflection,
applies the message-size limits, and drains gracefully: on SIGTERM or SIGINT
health turns NOT_SERVING, new calls are refused, in-flight calls get
``drain_grace_s`` to finish, then the app's shutdown hooks run.

A service may serve a second face on its own port (``ServiceApp.extra_servers``,
e.g. the queue's authenticated external port): the same bootstrap with its own
bindings, server interceptors and optional TLS credentials, started, reported in
the ready file (``<name>_port``) and drained together with the main server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tauflow.api.info.v1 import info_pb2_grpc
from tauflow.core.config import ServerConfig
from tauflow.core.serverinfo import SERVICE as INFO_SERVICE
from tauflow.core.serverinfo import ServerInfoServicer, server_info

log = logging.getLogger(__name__)


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


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
    background: Sequence[Callable[[], Awaitable[None]]] = ()
    close: Callable[[], Awaitable[None] | None] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    on_serving: Callable[[int], None] | None = None  # told the bound port (e.g. to register with a peer)
    extra_servers: Sequence[ExtraServer] = ()


def tls_server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials from a PEM certificate chain and its private key (files, so that a mounted
    secret can hold them)."""
    pems = []
    for what, path in (("certificate", cert_file), ("private key", key_file)):
        try:
            pems.append(Path(path).read_bytes())
        except OSError as e:
            raise OSError(f"cannot read the TLS {what} {path}: {e.strerror}") from e
    return grpc.ssl_server_credentials([(pems[1], pems[0])])


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
    ) -> None:
        self.config = config
        self.credentials = credentials
        info = server_info(role, version, [b.descriptor for b in bindings])
        self.bindings = [
            *bindings,
            ServiceBinding(INFO_SERVICE, ServerInfoServicer(info), info_pb2_grpc.add_ServerInfoServiceServicer_to_server),
        ]
        self.server = grpc.aio.server(
            interceptors=list(interceptors) or None,  # a keyword: telemetry's instrumentation adds its own
            options=[
                *message_size_options(config.max_message_bytes),
                # Accept the keepalive pings our channels send (every 30 s, also when idle); gRPC's
                # default policy answers them with GOAWAY "too_many_pings".
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        self.health = health.aio.HealthServicer()
        for b in self.bindings:
            b.add_to_server(b.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [b.descriptor.full_name for b in self.bindings]
        reflection.enable_server_reflection(
            (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port: int | None = None

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.credentials is not None:
            self.port = self.server.add_secure_port(address, self.credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self.set_serving(False)
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *(b.descriptor.full_name for b in self.bindings)):
            await self.health.set(name, status)

    async def drain(self) -> None:
        await self.set_serving(False)
        await self.server.stop(self.config.drain_grace_s)


def write_ready_file(path: str | os.PathLike[str], info: dict[str, Any]) -> None:
    """Writes ``info`` as JSON atomically, so a launcher never reads half a file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


async def serve(
    app: ServiceApp,
    config: ServerConfig,
    *,
    ready_info: dict[str, Any] | None = None,
    ready_file: str | None = None,
) -> None:
    """Serves ``app`` until SIGTERM/SIGINT, then drains and closes it."""
    ready_info = ready_info or {}
    role, version = ready_info.get("service", ""), ready_info.get("version", "")
    server = GrpcServer(app.bindings, config, role=role, version=version)
    extras = {
        extra.name: GrpcServer(
            extra.bindings, extra.config, role=role, version=version,
            interceptors=extra.interceptors, credentials=extra.credentials,
        )
        for extra in app.extra_servers
    }
    port = await server.start()
    extra_ports = {f"{name}_port": await s.start() for name, s in extras.items()}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if app.on_serving is not None:
        app.on_serving(port)
    tasks = [asyncio.create_task(job(), name=getattr(job, "__name__", "background")) for job in app.background]
    servers = [server, *extras.values()]
    for s in servers:
        await s.set_serving(True)
    info = {"grpc_port": port, **extra_ports, "pid": os.getpid(), **ready_info, **app.info}
    log.info("serving", extra={"host": config.host, "port": port, **extra_ports})
    if ready_file:
        write_ready_file(ready_file, info)
    failed = asyncio.create_task(_first_failure(tasks))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([failed, stopped], return_when=asyncio.FIRST_COMPLETED)
    log.info("draining", extra={"grace_s": config.drain_grace_s})
    await asyncio.gather(*(s.drain() for s in servers))
    for t in (*tasks, failed, stopped):
        t.cancel()
    await asyncio.gather(*tasks, failed, stopped, return_exceptions=True)
    if app.close is not None:
        result = app.close()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")
    if failed.done() and not failed.cancelled() and failed.exception() is not None:
        raise failed.exception()  # a background job died: the process must exit non-zero


async def _first_failure(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Returns (by raising) when a background task fails; waits forever otherwise."""
    if not tasks:
        await asyncio.Event().wait()
    for coro in asyncio.as_completed(tasks):
        await coro  # a background job that returns normally is fine; one that raises stops the service
    await asyncio.Event().wait()
