"""Reasons on error statuses: what error_info_trailer writes, error_reason reads back; anything else reads as ""."""

from __future__ import annotations

import grpc

from tauflow.core.status import DETAILS_KEY, error_info_trailer, error_reason


class Failed(grpc.RpcError):
    def __init__(self, trailer: tuple[tuple[str, bytes], ...] | None) -> None:
        self._trailer = trailer

    def trailing_metadata(self):
        return self._trailer


def test_the_reason_round_trips_through_the_status_details_trailer() -> None:
    trailer = error_info_trailer(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "ERROR_REASON_QUEUE_FULL", "d")
    assert [key for key, _ in trailer] == [DETAILS_KEY]
    assert error_reason(Failed((("other", b"x"), *trailer))) == "ERROR_REASON_QUEUE_FULL"


def test_no_or_malformed_details_give_no_reason() -> None:
    assert error_reason(Failed(None)) == ""
    assert error_reason(Failed((("other", b"x"),))) == ""
    assert error_reason(Failed(((DETAILS_KEY, b"\xff\xff"),))) == ""
    assert error_reason(grpc.RpcError()) == ""  # an error without trailers at all
