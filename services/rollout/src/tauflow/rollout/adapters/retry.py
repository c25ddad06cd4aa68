"""When the rollout's clients retry: while the peer is down, full, slow or draining (e.g. restarting), for
calls that are idempotent, so that data is never dropped; never for a call that no retry can cure."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from tauflow.core.status import error_reason

# CANCELLED: the server cancelled the call (a peer draining to stop cancels what it had in flight); our own
# cancellation raises asyncio.CancelledError instead, and is never retried.
TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


def over_message_limit(e: grpc.aio.AioRpcError) -> bool:
    """gRPC's own message-size limit refused the call (on either side; that status carries no reason)."""
    return (
        e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and not error_reason(e)
        and "larger than max" in (e.details() or "")
    )


NeverFits = Callable[[grpc.aio.AioRpcError], bool]


def transient(e: BaseException, never_fits: NeverFits = over_message_limit) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() in TRANSIENT and not never_fits(e)


def until_it_works(never_fits: NeverFits = over_message_limit) -> AsyncRetrying:
    """Retries an idempotent call while ``transient``."""
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: transient(e, never_fits)),
        wait=wait_exponential(0.1, max=5.0),
        reraise=True,
    )
