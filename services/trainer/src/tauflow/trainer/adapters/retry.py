"""Riding out a peer's restart: the retry policy of the trainer's idempotent calls."""

from __future__ import annotations

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def until_it_works() -> AsyncRetrying:
    """Retries an idempotent call while its service is restarting: the trainer rides it out."""
    return AsyncRetrying(
        retry=retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in TRANSIENT),
        wait=wait_exponential(0.2, max=5.0),
        reraise=True,
    )
