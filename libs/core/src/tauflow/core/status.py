"""Machine-readable reasons on error statuses: a ``google.rpc.ErrorInfo`` in the standard
``grpc-status-details-bin`` trailer (AIP-193), so that a client can tell apart two failures that
share a status code (a full queue, worth retrying, from a group that can never fit) without
parsing the message."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"
# The answers of a peer that is restarting, stopping or slow, after which an idempotent call may be sent again:
# the channel's own retry codes (tauflow.api.retry.RETRY_STATUS_CODES: UNAVAILABLE, and CANCELLED from a
# server that stopped as the call came) and a deadline that passed. Our own cancellation is
# asyncio.CancelledError, never one of these.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


# A status message travels in the trailers, which clients bound (gRPC: 8 KiB soft, 16 KiB hard), percent-encoded
# where not ASCII, and again inside an ErrorInfo trailer: one that quoted what a client sent (100,000 stop ids,
# a tensor shape, a list of backends) turned a refusal into the client's RESOURCE_EXHAUSTED "metadata size
# exceeds hard limit", the field unnamed.
MAX_DETAILS_BYTES = 1024


def bounded_details(message: str) -> str:
    """``message``, cut to :data:`MAX_DETAILS_BYTES` of UTF-8 when longer (the cut says how long it was)."""
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    return f"{data[: MAX_DETAILS_BYTES - 48].decode('utf-8', 'ignore')}… (cut: {len(data)} bytes in all)"


def error_info_trailer(code: grpc.StatusCode, message: str, reason: str, domain: str) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata for ``context.abort(code, message, trailing_metadata=...)``."""
    status = status_pb2.Status(code=code.value[0], message=bounded_details(message))
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
    return ((DETAILS_KEY, status.SerializeToString()),)


def error_reason(err: grpc.RpcError) -> str:
    """The ErrorInfo reason an error status carries; "" when it carries none."""
    trailer = getattr(err, "trailing_metadata", None)
    for key, value in (trailer() if trailer is not None else None) or ():
        if key != DETAILS_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # noqa: BLE001 - a malformed trailer is no reason
            return ""
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info.reason
    return ""
