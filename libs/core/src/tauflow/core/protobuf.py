"""Conversions every service needs between Python seconds and the protobuf well-known time types."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp


def timestamp(seconds: float) -> Timestamp:
    """A Timestamp from Unix seconds."""
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def seconds(value: Duration | Timestamp) -> float:
    """Seconds of a Duration, or Unix seconds of a Timestamp."""
    return value.seconds + value.nanos / 1e9
