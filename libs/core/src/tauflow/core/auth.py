"""The run token's check on a server (``RunTokenAuth``); the token itself, its file and the methods it guards
are ``tauflow.core.runtoken`` (read there what the token is for). Decisions: docs/reliability.md, "The run
token".
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from tauflow.core.logs import LogLimit
from tauflow.core.runtoken import CONTROL_METHODS, bearer_token, digest

log = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0


class RunTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses a control method's call (``CONTROL_METHODS``) UNAUTHENTICATED unless it carries the run token;
    other calls pass untouched."""

    def __init__(self, token: str, guarded: Mapping[str, frozenset[str]] = CONTROL_METHODS) -> None:
        self._digest = digest(token)
        self.guarded = guarded
        self._warnings = LogLimit(_WARN_EVERY_S)  # a caller with a wrong token must not flood the log

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        service, _, method = details.method.lstrip("/").rpartition("/")
        handler = await continuation(details)
        if handler is None or method not in self.guarded.get(service, ()):
            return handler
        token, why = bearer_token(details.invocation_metadata)
        if token and hmac.compare_digest(digest(token), self._digest):
            return handler
        why = why or "the bearer token is not the run's token"
        self._warn(details.method, why)
        return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, f"{method} is a control method: {why}")

    def _warn(self, method: str, why: str) -> None:
        if refused := self._warnings.due():
            log.warning("control call refused", extra={"method": method, "why": why, "refused": refused})


def refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code`` without reading the request: always request-streaming (response-streaming
    too where ``handler`` is), whatever the method's kind. A unary handler would have grpc-aio receive the whole
    message first (up to ``max_message_bytes``), and a caller who never sent its last byte held that memory for
    ever; a streaming one is called as soon as the headers arrive, and its abort ends the call."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        # (a response-streaming handler must be an async generator, or grpc.aio answers UNKNOWN)
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)
