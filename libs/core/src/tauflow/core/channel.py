"""The one client channel factory.

Every call gets a deadline (the caller's, else ``default_timeout_s``); a control method's call gets the
process's run token (``authorization: Bearer``, tauflow.core.runtoken) unless the channel leads outside the run; keepalive
and message-size limits are set; and gRPC's own retry policy is enabled only
for the methods whose contract declares ``idempotency_level = IDEMPOTENT`` or
``NO_SIDE_EFFECTS``: a non-idempotent call is never sent twice.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from tauflow.api.retry import RETRY_STATUS_CODES, RetryPolicy, service_config_json
from tauflow.core.config import ChannelConfig
from tauflow.core.runtoken import control_method, run_token
from tauflow.core.server import message_size_options


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
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config_json(services, retry_policy(config))),
        # A restarted service is back in seconds: gRPC's default backoff grows to 120 s between attempts, so a
        # client could stay blind for minutes after an outage (seen in the chaos test).
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ]


class _DefaultDeadline:
    """Client interceptor (sync and asyncio) that gives every call a deadline, and a control method's call the
    run token when the process has one (read at each call: a token loaded after the channel was made is sent
    too)."""

    def __init__(self, timeout_s: float, send_run_token: bool = True) -> None:
        self.timeout_s = timeout_s
        self.send_run_token = send_run_token

    def _details(self, details: Any) -> Any:
        token = run_token() if self.send_run_token and control_method(details.method) else ""
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


class _AioUnaryUnary(_DefaultDeadline, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_DefaultDeadline, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_DefaultDeadline, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_DefaultDeadline, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


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
    t, s = config.default_timeout_s, send_run_token
    return grpc.aio.insecure_channel(
        target,
        options=channel_options(services, config),
        interceptors=[_AioUnaryUnary(t, s), _AioUnaryStream(t, s), _AioStreamUnary(t, s), _AioStreamStream(t, s)],
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
