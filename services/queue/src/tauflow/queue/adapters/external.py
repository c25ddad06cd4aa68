"""The external port: producers outside tauflow put groups through a second gRPC server of the queue.

It serves the producer's half of QueueService (Reserve, ReleaseReservation, Put, Stats) on the same
state as the internal server; Get, Ack, Nack, RenewLease, SetTrainerVersion and SetMaxStaleness are not
registered there (UNIMPLEMENTED), so a client of this port can neither consume nor steer the training.
Every call but gRPC health, ServerInfo and server reflection (they reveal nothing that the published
contracts do not) needs ``authorization: Bearer <token>`` metadata with a token
of the tokens file; the client it names is recorded on what it does: the ``producer_id`` of its groups
and reservations, and the per-client metrics. Clients cannot interfere with each other: group ids and
request ids are namespaced by the client's name (``<client>/<id>``: one client's ``episode-1`` is not
another's), and a ticket can be used or released only by the client that reserved it.
Decisions: docs/external-sources.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.auth import refusal
from tauflow.core.logs import LogLimit
from tauflow.core.net import is_loopback
from tauflow.core.runtoken import bearer_token
from tauflow.core.server import ExtraServer, ServiceBinding, tls_server_credentials
from tauflow.core.serverinfo import SERVICE as INFO_SERVICE
from tauflow.queue.adapters import wire
from tauflow.queue.adapters.servicer import SERVICE, QueueServicer, add_queue_servicer_to_server
from tauflow.queue.config import ExternalConfig
from tauflow.queue.metrics import QueueMetrics
from tauflow.queue.model import MAX_ID_CHARS
from tauflow.queue.tokens import UNKNOWN_CLIENT, TokenTable

log = logging.getLogger(__name__)

PRODUCER_METHODS = ("Reserve", "ReleaseReservation", "Put", "Stats")
# Answered without a token: probes (Kubernetes' gRPC probes send none) and the version check a client
# makes before it trusts a server.
PUBLIC_SERVICES = frozenset(
    {
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        INFO_SERVICE.full_name,
        # reflection (both protocols) tells what the published contracts tell
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
)
CLIENT: ContextVar[str] = ContextVar("tauflow_queue_external_client", default="")
_WARN_EVERY_S = 10.0


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Admits a call whose bearer token names a client of ``tokens``; answers UNAUTHENTICATED otherwise.
    An admitted unary call runs with ``CLIENT`` set to the client's name, and its refusals are counted
    per client."""

    def __init__(self, tokens: TokenTable, metrics: QueueMetrics) -> None:
        self.tokens = tokens
        self.metrics = metrics
        self._warnings = LogLimit(_WARN_EVERY_S)  # a client with a wrong token must not flood the log

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        service, _, method = details.method.lstrip("/").rpartition("/")
        if service in PUBLIC_SERVICES:
            return await continuation(details)
        # Bounded label values: a caller chooses the method path, not the metric's cardinality.
        label = method if service == SERVICE.full_name and method in PRODUCER_METHODS else "other"
        token, why = bearer_token(details.invocation_metadata)
        client = self.tokens.lookup(token) if token else None
        handler = await continuation(details)
        if client is None:
            why = why or "the bearer token is not one of the queue's client tokens"
            self.metrics.external_rejected.labels(UNKNOWN_CLIENT, label, "UNAUTHENTICATED").inc()
            self._warn(details.method, why)
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, why)
        if handler is None:
            self.metrics.external_rejected.labels(client, "other", "UNIMPLEMENTED").inc()
            return None  # gRPC answers UNIMPLEMENTED: the external port serves producers only
        if handler.request_streaming or handler.response_streaming:
            return handler  # (server reflection) admitted; nothing to record
        return grpc.unary_unary_rpc_method_handler(
            self._as_client(handler.unary_unary, client, label),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _as_client(
        self, behaviour: Callable[[Any, Any], Awaitable[Any]], client: str, method: str
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            reset = CLIENT.set(client)
            try:
                return await behaviour(request, context)
            except BaseException:
                code = context.code()
                if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
                    self.metrics.external_rejected.labels(client, method, code.name).inc()
                raise
            finally:
                CLIENT.reset(reset)

        return call

    def _warn(self, method: str, why: str) -> None:
        if refused := self._warnings.due():
            log.warning("external call refused", extra={"method": method, "why": why, "refused": refused})


class ProducerServicer:
    """The external port's QueueService: the producer's methods, on the internal servicer's state,
    recording the authenticated client (``CLIENT``)."""

    def __init__(self, queue: QueueServicer, metrics: QueueMetrics) -> None:
        self.queue = queue
        self.metrics = metrics

    async def Reserve(
        self, request: queue_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.ReserveResponse:
        client = CLIENT.get()
        request.producer_id = client
        if request.request_id:  # (an empty one stays empty: INVALID_ARGUMENT as on the internal port)
            await _refuse_unless_it_fits(context, "request_id", request.request_id, client)
            request.request_id = f"{client}/{request.request_id}"
        return await self.queue.Reserve(request, context, external=True)  # held to external.* (per client)

    async def ReleaseReservation(
        self, request: queue_pb2.ReleaseReservationRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.ReleaseReservationResponse:
        return await self.queue.ReleaseReservation(request, context, owner=CLIENT.get())

    async def Put(self, request: wire.RawPutRequest, context: grpc.aio.ServicerContext) -> queue_pb2.PutResponse:
        client = CLIENT.get()
        if request.group:  # (an empty one is refused as on the internal port)
            try:
                request.group = with_client_identity(request.group, client)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        response = await self.queue.Put(request, context, owner=client)
        if response.outcome == queue_pb2.PUT_OUTCOME_ACCEPTED:
            self.metrics.external_put_groups.labels(client).inc()
        return response

    async def Stats(
        self, request: queue_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.StatsResponse:
        return await self.queue.Stats(request, context)


def room_for_id(client: str) -> int:
    """How many characters a client's id may have: the queue's bound less the ``<client>/`` it is namespaced by."""
    return MAX_ID_CHARS - len(client) - 1


def _too_long(field: str, value: str, client: str) -> str:
    return (f"{field} is {len(value)} characters, longer than {room_for_id(client)} (the limit of {MAX_ID_CHARS} "
            f"less the client's prefix {client + '/'!r})")  # fmt: skip


async def _refuse_unless_it_fits(context: grpc.aio.ServicerContext, field: str, value: str, client: str) -> None:
    if len(value) > room_for_id(client):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _too_long(field, value, client))


def with_client_identity(raw: bytes, client: str) -> bytes:
    """The serialized Group ``raw`` as ``client`` put it: its group_id namespaced (``<client>/<id>``) and
    its producer_id set to the client. A group of more samples than the queue takes is refused (ValueError)
    before it is decoded. Bytes that do not decode are returned as they are, for Put to
    refuse them like any other malformed group (the queue decodes every group in full anyway)."""
    if (too_many := wire.too_many_samples(raw)) is not None:  # (counted on the wire: 20 M samples are not decoded)
        raise ValueError(too_many)
    try:
        group = common_pb2.Group.FromString(raw)
    except Exception:  # noqa: BLE001 - refused by Put with the field named
        return raw
    if group.group_id:  # (an empty one stays empty: refused as on the internal port)
        if len(group.group_id) > room_for_id(client):
            raise ValueError(_too_long("group.group_id", group.group_id, client))
        group.group_id = f"{client}/{group.group_id}"
    group.producer_id = client
    return group.SerializeToString()


def external_server(config: ExternalConfig, queue: QueueServicer, metrics: QueueMetrics) -> ExtraServer:
    """The external port as a second server of the queue process (``external_port`` in the ready file)."""
    tokens = TokenTable(config.tokens_file)
    for client in tokens.clients:
        metrics.external_put_groups.labels(client)  # every known client's series exists from the start
    credentials = None
    if config.tls_cert_file:
        credentials = tls_server_credentials(config.tls_cert_file, config.tls_key_file)
    elif not is_loopback(config.host):
        log.warning(
            "the external port listens beyond loopback without TLS: bearer tokens travel in clear text",
            extra={"host": config.host},
        )
    log.info("external port", extra={"clients": tokens.clients, "tls": credentials is not None})
    binding = ServiceBinding(
        SERVICE,
        ProducerServicer(queue, metrics),
        functools.partial(add_queue_servicer_to_server, methods=PRODUCER_METHODS),
    )
    return ExtraServer("external", [binding], config, [BearerTokenAuth(tokens, metrics)], credentials)
