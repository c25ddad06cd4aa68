"""When the rollout's clients retry: while the peer is down, full, slow or draining (e.g. restarting), for
calls that are idempotent, so that data is never dropped; never for a call that no retry can cure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from tauflow.core.logs import LogLimit
from tauflow.core.status import TRANSIENT as PEER_NOT_THERE
from tauflow.core.status import error_reason

log = logging.getLogger(__name__)

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


# A rollout cut off from its queue or reward for a minute said nothing; a full queue (the pacing's
# RESOURCE_EXHAUSTED) is no failure and is not logged.
_unreachable = LogLimit(30.0)


def log_if_unreachable(e: BaseException | None) -> None:
    """A line, at most every 30 s, while a peer is not there (down, restarting, silent past the deadline)."""
    if not isinstance(e, grpc.aio.AioRpcError) or e.code() not in PEER_NOT_THERE:
        return
    if count := _unreachable.due():
        log.warning(
            "peer call failed (%s: %s); retrying (%d such failures since the last line)",
            e.code().name,
            (e.details() or "")[:200],
            count,
        )


def _before_sleep(state: RetryCallState) -> None:
    log_if_unreachable(state.outcome.exception() if state.outcome is not None else None)


def until_it_works(never_fits: NeverFits = over_message_limit, first_wait_s: float | None = None) -> AsyncRetrying:
    """Retries an idempotent call while ``transient``, waiting ``first_wait_s`` (default FIRST_WAIT_S) after
    the first failure, twice that after the next, and so on up to 5 s."""
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: transient(e, never_fits)),
        wait=wait_exponential(FIRST_WAIT_S if first_wait_s is None else first_wait_s, max=5.0),
        reraise=True,
        before_sleep=_before_sleep,
    )


async def call_until_it_works(call: Callable[[], Awaitable[T]], never_fits: NeverFits = over_message_limit) -> T:
    """``call()`` retried as ``until_it_works`` does. The first attempt goes without tenacity, whose
    bookkeeping per attempt costs as much as the call itself for one put of a small group."""
    try:
        return await call()
    except grpc.aio.AioRpcError as e:
        if not transient(e, never_fits):
            raise
        log_if_unreachable(e)
    await asyncio.sleep(FIRST_WAIT_S)
    async for attempt in until_it_works(never_fits, first_wait_s=2 * FIRST_WAIT_S):  # (the backoff goes on)
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity returns or raises")  # (for the type checker)
