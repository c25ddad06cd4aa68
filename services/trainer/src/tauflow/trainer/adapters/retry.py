"""Riding out a peer's restart: the retry policy of the trainer's idempotent calls."""

from __future__ import annotations

import logging

import grpc
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    stop_never,
    wait_exponential,
)

from tauflow.core.status import TRANSIENT

log = logging.getLogger(__name__)


def until_it_works(
    codes: tuple[grpc.StatusCode, ...] = TRANSIENT, give_up_after_s: float | None = None
) -> AsyncRetrying:
    """Retries an idempotent call while its service is restarting (``codes``): the trainer rides it out, for
    ever or for ``give_up_after_s``."""
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in codes),
        wait=wait_exponential(0.2, max=5.0),
        stop=stop_after_delay(give_up_after_s) if give_up_after_s is not None else stop_never,
        reraise=True,
        before_sleep=log_retry,  # (a wait that lasts is seen in the log)
    )


def log_retry(state: RetryCallState) -> None:
    """One line per retry: the peer's status and its message (tenacity's own is a five-line repr of the error,
    naming the function "<unknown>" when used as a context manager)."""
    error = state.outcome.exception() if state.outcome is not None else None
    code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
    details = (error.details() or "") if isinstance(error, grpc.aio.AioRpcError) else str(error)
    log.warning(
        "peer call failed (%s: %s); retrying",
        code,
        details[:200],
        extra={
            "attempt": state.attempt_number,
            "wait_s": round(state.next_action.sleep, 2) if state.next_action is not None else None,
        },
    )
