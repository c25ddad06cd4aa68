"""When the rollout's clients retry: while the peer is down, full, slow or draining (e.g. restarting), for
calls that are idempotent, so that data is never dropped; never for a call that no retry can cure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from tauflow.core.status import TRANSIENT as PEER_NOT_THERE
from tauflow.core.status import error_reason

T = TypeVar("T")
FIRST_WAIT_S = 0.1

# A peer restarting, stopping or slow (tauflow.core.status.TRANSIENT), or full for now (a queue, a disk).
TRANSIENT = (*PEER_NOT_THERE, grpc.StatusCode.RESOURCE_EXHAUSTED)


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


def until_it_works(never_fits: NeverFits = over_message_limit, first_wait_s: float | None = None) -> AsyncRetrying:
    """Retries an idempotent call while ``transient``, waiting ``first_wait_s`` (default FIRST_WAIT_S) after
    the first failure, twice that after the next, and so on up to 5 s."""
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: transient(e, never_fits)),
        wait=wait_exponential(FIRST_WAIT_S if first_wait_s is None else first_wait_s, max=5.0),
        reraise=True,
    )


async def call_until_it_works(call: Callable[[], Awaitable[T]], never_fits: NeverFits = over_message_limit) -> T:
    """``call()`` retried as ``until_it_works`` does. The first attempt goes without tenacity, whose
    bookkeeping per attempt costs as much as the call itself for one put of a small group."""
    try:
        return await call()
    except grpc.aio.AioRpcError as e:
        if not transient(e, never_fits):
            raise
    await asyncio.sleep(FIRST_WAIT_S)
    async for attempt in until_it_works(never_fits, first_wait_s=2 * FIRST_WAIT_S):  # (the backoff goes on)
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity returns or raises")  # (for the type checker)
