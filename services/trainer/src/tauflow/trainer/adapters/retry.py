"""Riding out a peer's restart: the retry policy of the trainer's idempotent calls."""

from __future__ import annotations

import logging
import time

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

# The last failed peer call being retried, for GetStatus's last_error: a trainer cut off from its queue said
# "TRAINING" to the controller, whose stall report then hid the partition.
RECENT_S = 45.0  # (a retry's wait is at most 5 s, an attempt's deadline 30 s: older is over)
_last_failure: tuple[float, str] = (-RECENT_S, "")


def note_failure(code: str, details: str) -> None:
    global _last_failure
    _last_failure = (time.monotonic(), f"retrying a peer call that failed: {code}: {details[:200]}")


def recent_failure() -> str:
    """The peer call that failed last, if within RECENT_S; "" otherwise."""
    at, what = _last_failure
    return what if time.monotonic() - at < RECENT_S else ""


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
    note_failure(code, details)
    log.warning(
        "peer call failed (%s: %s); retrying",
        code,
        details[:200],
        extra={
            "attempt": state.attempt_number,
            "wait_s": round(state.next_action.sleep, 2) if state.next_action is not None else None,
        },
    )
