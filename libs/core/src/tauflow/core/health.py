"""The standard health service (``grpc.health.v1.Health``) of every tauflow server, bounded.

grpcio-health-checking's servicer keeps every ``Watch`` stream open for as long as its client wants, holds its
request (a ``service`` name of any length up to the message limit) all that time, takes any number of them,
and never ends them, not even when the server drains. This one:

- refuses a ``service`` name over :data:`MAX_SERVICE_NAME` characters (INVALID_ARGUMENT naming the field;
  the bound is applied where the server registers it, ``tauflow.core.decoding``), for ``Check`` and ``Watch``;
- serves at most ``max_watches`` ``Watch`` streams at once (``server.max_health_watches``): one more is
  refused RESOURCE_EXHAUSTED (``Check`` is what probes use, and it holds nothing);
- answers ``List`` (every service's status: the server's own few, never a caller's names);
- ends every open ``Watch`` stream once the server drains (:meth:`HealthServicer.close`), right after telling
  it NOT_SERVING, so that an open stream never holds a restart for the drain grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
MAX_SERVICE_NAME = 256  # characters of HealthCheckRequest.service (a service's full name is far shorter)
LIMITS = {"Check": {"service": MAX_SERVICE_NAME}, "Watch": {"service": MAX_SERVICE_NAME}}

Status: TypeAlias = "health_pb2.HealthCheckResponse.ServingStatus.ValueType"


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, max_watches: int) -> None:
        self.max_watches = max_watches
        self.watches = 0  # Watch streams open now
        self._status: dict[str, Status] = {}
        self._changed = asyncio.Event()  # set (and replaced) on every change of a status, and on close
        self._closed = False

    def set(self, service: str, status: Status) -> None:
        """Sets ``service``'s status ("" is the server's); its watchers are told. Ignored once closed."""
        if self._closed or self._status.get(service) == status:
            return
        self._status[service] = status
        self._notify()

    def close(self) -> None:
        """The server drains: every service is NOT_SERVING from now on, and each Watch stream, once it has
        sent that, ends (OK); a Watch that starts now sends the status and ends at once."""
        for service in self._status:
            self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._closed = True
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this server has no such service")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext):
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in self._status.items()}
        )

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if self.watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watches} health Watch streams are open, this server's limit (server.max_health_watches); "
                "use Check",
            )
        self.watches += 1
        try:
            last = None
            while True:
                changed = self._changed  # (before the status is read: a change while the answer is sent wakes us)
                status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                if self._closed:
                    return
                await changed.wait()
        finally:
            self.watches -= 1
