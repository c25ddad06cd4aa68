"""A failed gRPC call as the domain sees it (ports.PeerError)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from tauflow.controller.ports import PeerError, PeerUnavailable

# The codes of a service that is not there for now (restarting, stopped, overloaded): worth asking again.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@contextmanager
def peer_errors(role: str) -> Iterator[None]:
    """Raises the failed call of ``role`` inside as PeerUnavailable (a transient code) or PeerError."""
    try:
        yield
    except grpc.aio.AioRpcError as e:
        error = PeerUnavailable if e.code() in TRANSIENT else PeerError
        raise error(role, e.code().name, e.details() or "") from e
