"""The one error the clients raise: a refused or failed call, with its status code and reason."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, empty_pb2, unknown_fields

from tauflow.api.retry import RETRY_STATUS_CODES

_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO = "google.rpc.ErrorInfo"


class TauflowError(Exception):
    """A call that did not succeed. ``code`` is the gRPC status (UNAUTHENTICATED: a missing or unknown
    token; INVALID_ARGUMENT: a malformed request, the message names the field; RESOURCE_EXHAUSTED: a full
    queue or a group that never fits, told apart by ``reason``, or with no reason this client's own bound on
    the external port (reserved groups not yet put, Reserves waiting: the message names it; put or release
    first); DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED: the
    service did not answer in time, or was stopping as the call came); ``reason`` is the ``google.rpc.ErrorInfo`` reason the service
    attached ("" when none), e.g. ``ERROR_REASON_QUEUE_FULL``."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        super().__init__(f"{method}: {code.name}: {details}" + (f" ({reason})" if reason else ""))
        self.method = method
        self.code = code
        self.details = details
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed later: a full queue, or a service that is not reachable now, slow,
        or stopping (the channel already retried idempotent calls on UNAVAILABLE and CANCELLED)."""
        return (
            self.reason == "ERROR_REASON_QUEUE_FULL"
            or self.code.name in RETRY_STATUS_CODES
            or self.code == grpc.StatusCode.DEADLINE_EXCEEDED
        )

    @classmethod
    def of(cls, method: str, err: grpc.RpcError) -> TauflowError:
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        return cls(method, code, details or "", _reason(err))


def _fields(data: bytes) -> list[unknown_fields.UnknownField]:
    # Read a message without its class (google.rpc.Status and ErrorInfo are not in the stubs, and the
    # googleapis protos would be one more dependency): parse it as Empty and read the unknown fields.
    return list(unknown_fields.UnknownFieldSet(empty_pb2.Empty.FromString(data)))


def _reason(err: grpc.RpcError) -> str:
    """The ErrorInfo reason of the standard ``grpc-status-details-bin`` trailer (google.rpc.Status:
    details = 3; google.protobuf.Any: type_url = 1, value = 2; google.rpc.ErrorInfo: reason = 1)."""
    trailer = getattr(err, "trailing_metadata", None)
    try:
        for key, value in (trailer() if callable(trailer) else None) or ():
            if key != _DETAILS_KEY:
                continue
            for field in _fields(value):
                if field.field_number != 3:
                    continue
                detail = any_pb2.Any.FromString(field.data)
                if detail.type_url.rpartition("/")[2] == _ERROR_INFO:
                    for info in _fields(detail.value):
                        if info.field_number == 1:
                            return bytes(info.data).decode()
    except Exception:  # noqa: BLE001 - a malformed trailer is no reason
        return ""
    return ""
