"""A failed gRPC call as the domain sees it (ports.PeerError)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from tauflow.controller.ports import PeerError, PeerUnavailable
from tauflow.core.status import TRANSIENT  # a service that is not there for now: worth asking again

# What the controller asks again later: a peer not there for now, or one whose call slots are full (gRPC's
# max_concurrent_rpcs answers RESOURCE_EXHAUSTED; the controller's requests are small, so it is never their
# size). One RESOURCE_EXHAUSTED to the run's poll of the queue ended the run.
ASK_AGAIN = (*TRANSIENT, grpc.StatusCode.RESOURCE_EXHAUSTED)

# The deadline of the run's polls (the trainer's steps and state, the queue's counters) and of the check of a
# restarted process: a hung peer (SIGSTOP, a stuck disk) must not hold the run's loop, which also restarts
# what died, for the channel's default 30 s at every pass.
POLL_TIMEOUT_S = 5.0


@contextmanager
def peer_errors(role: str) -> Iterator[None]:
    """Raises the failed call of ``role`` inside as PeerUnavailable (a transient code) or PeerError."""
    try:
        yield
    except grpc.aio.AioRpcError as e:
        # (an answer over the channel's message limit is RESOURCE_EXHAUSTED too, and never fits: not asked again)
        too_large = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")
        error = PeerUnavailable if e.code() in ASK_AGAIN and not too_large else PeerError
        raise error(role, e.code().name, e.details() or "") from e
    except grpc.aio.UsageError as e:  # (a channel closed under a call: the run is ending; INTERNAL was answered)
        raise PeerUnavailable(role, grpc.StatusCode.UNAVAILABLE.name, "the channel to it is closed") from e
