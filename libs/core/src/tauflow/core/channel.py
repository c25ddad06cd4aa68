"""The one client channel factory.

Every call gets a deadline (the caller's, else ``default_timeout_s``); a control method's call gets the
process's run token (``authorization: Bearer``, tauflow.core.runtoken) unless the channel leads outside the run; keepalive
and message-size limits are set; and gRPC's own retry policy is enabled only
for the methods whose contract declares ``idempotency_level = IDEMPOTENT`` or
``NO_SIDE_EFFECTS``: a non-idempotent call is never sent twice.

An answer that does not decode as the method's response type fails the call with INTERNAL "the answer did
not decode as <type>" (``grpc.aio.AioRpcError``), unary and streaming alike: grpc.aio itself only logs
"Exception deserializing message!" and hands the caller ``None`` with status OK (the blocking channel
raises INTERNAL already). An empty answer decodes (as the default message) and is no failure.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor

from tauflow.api.retry import RETRY_STATUS_CODES, RetryPolicy, service_config_json
from tauflow.core.config import ChannelConfig
from tauflow.core.runtoken import token_for
from tauflow.core.server import message_size_options
from tauflow.core.streams import rpc_error


def retry_policy(config: ChannelConfig) -> RetryPolicy:
    return RetryPolicy(
        config.retry_max_attempts,
        config.retry_initial_backoff_s,
        config.retry_max_backoff_s,
        tuple(RETRY_STATUS_CODES if config.retry_status_codes is None else config.retry_status_codes),
    )


RECONNECT_BACKOFF_MAX_MS = 5_000


def channel_options(services: Sequence[ServiceDescriptor], config: ChannelConfig) -> list[tuple[str, Any]]:
    return [
        *message_size_options(config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # What times the keepalive ping out in this gRPC (keepalive_timeout_ms alone does not: a connection
        # that went silent without a FIN or RST held a channel READY for 60-90 s, every call on it failing).
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config_json(services, retry_policy(config))),
        # A restarted service is back in seconds: gRPC's default backoff grows to 120 s between attempts, so a
        # client could stay blind for minutes after an outage (seen in the chaos test).
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ]


class _DefaultDeadline:
    """Client interceptor (sync and asyncio) that gives every call a deadline, and, when the process has a run
    token, a control method's call that token and a call of ``runtoken.RUN_PREFERRED_METHODS`` the one derived
    from it (``runtoken.token_for``; read at each call: a token loaded after the channel was made is sent too)."""

    def __init__(self, timeout_s: float, send_run_token: bool = True) -> None:
        self.timeout_s = timeout_s
        self.send_run_token = send_run_token

    def _details(self, details: Any) -> Any:
        token = token_for(details.method) if self.send_run_token else ""
        if details.timeout is not None and not token:
            return details
        timeout = self.timeout_s if details.timeout is None else details.timeout
        metadata = details.metadata
        if token and not any(key == "authorization" for key, _ in metadata or ()):
            metadata = (*(metadata or ()), ("authorization", f"Bearer {token}"))
        if isinstance(details, grpc.aio.ClientCallDetails):
            if metadata is not None and not isinstance(metadata, grpc.aio.Metadata):
                metadata = grpc.aio.Metadata(*metadata)
            return details._replace(timeout=timeout, metadata=metadata)
        return _SyncCallDetails(
            details.method,
            timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )


class _SyncCallDetails(
    namedtuple("_SyncCallDetails", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


class _SyncDefaultDeadline(
    _DefaultDeadline,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def _answer_types(services: Sequence[ServiceDescriptor]) -> dict[str, str]:
    """``/package.Service/Method`` -> the full name of its response type, for every method of ``services``."""
    return {f"/{s.full_name}/{m.name}": m.output_type.full_name for s in services for m in s.methods}


class _Undecodable:
    """What an asyncio call's undecodable answer becomes: the error, naming the response type (from the
    channel's services, else protobuf's default pool)."""

    def __init__(self, answer_types: dict[str, str]) -> None:
        self.answer_types = answer_types

    def error(self, method: Any) -> grpc.aio.AioRpcError:
        path = method.decode() if isinstance(method, bytes) else str(method)
        name = self.answer_types.get(path)
        if name is None:
            try:
                found = descriptor_pool.Default().FindMethodByName(path.lstrip("/").replace("/", "."))
                name = found.output_type.full_name
            except (KeyError, TypeError):
                name = "the method's response type"
        return rpc_error(grpc.StatusCode.INTERNAL, f"the answer did not decode as {name}")


class _CheckedAnswers:
    """The answers of a streaming call, with one that did not decode (grpc.aio yields ``None`` for it) turned
    into the INTERNAL error: the call is cancelled then, its stream holding answers nobody can read. A plain
    iterator, not an async generator: an unfinished generator is finalized by the loop, with warnings when
    the loop is gone."""

    def __init__(self, call: Any, error: Callable[[], grpc.aio.AioRpcError]) -> None:
        self.call = call
        self.error = error
        self._answers: Any = None

    def __aiter__(self) -> _CheckedAnswers:
        return self

    async def __anext__(self) -> Any:
        if self._answers is None:
            self._answers = self.call.__aiter__()
        answer = await self._answers.__anext__()
        if answer is None:
            self.call.cancel()
            raise self.error()
        return answer


class _AioInterceptor(_DefaultDeadline):
    def __init__(self, timeout_s: float, send_run_token: bool, undecodable: _Undecodable) -> None:
        super().__init__(timeout_s, send_run_token)
        self.undecodable = undecodable

    async def _unary_answer(self, call: Any, details: Any) -> Any:
        if await call is None:  # (awaiting a call again gives the same answer: the caller's await still works)
            raise self.undecodable.error(details.method)
        return call

    def _stream_answers(self, call: Any, details: Any) -> _CheckedAnswers:
        return _CheckedAnswers(call, lambda: self.undecodable.error(details.method))


class _AioUnaryUnary(_AioInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await self._unary_answer(await continuation(self._details(details), request), details)


class _AioUnaryStream(_AioInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return self._stream_answers(await continuation(self._details(details), request), details)


class _AioStreamUnary(_AioInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await self._unary_answer(await continuation(self._details(details), request_iterator), details)


class _AioStreamStream(_AioInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return self._stream_answers(await continuation(self._details(details), request_iterator), details)


def create_channel(
    target: str,
    services: Sequence[ServiceDescriptor],
    config: ChannelConfig | None = None,
    *,
    send_run_token: bool = True,
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` for calling ``services``; ``send_run_token=False`` for a server
    outside the run, which must never see the run's token."""
    config = config or ChannelConfig()
    t, s, u = config.default_timeout_s, send_run_token, _Undecodable(_answer_types(services))
    return grpc.aio.insecure_channel(
        target,
        options=channel_options(services, config),
        interceptors=[
            _AioUnaryUnary(t, s, u),
            _AioUnaryStream(t, s, u),
            _AioStreamUnary(t, s, u),
            _AioStreamStream(t, s, u),
        ],
    )


def create_sync_channel(
    target: str,
    services: Sequence[ServiceDescriptor],
    config: ChannelConfig | None = None,
    *,
    send_run_token: bool = True,
) -> grpc.Channel:
    """A blocking channel, for scripts, tests and benchmarks; same policy as ``create_channel``."""
    config = config or ChannelConfig()
    channel = grpc.insecure_channel(target, options=channel_options(services, config))
    return grpc.intercept_channel(channel, _SyncDefaultDeadline(config.default_timeout_s, send_run_token))
