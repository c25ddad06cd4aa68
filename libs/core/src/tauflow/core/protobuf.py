"""Conversions every service needs between Python seconds and the protobuf well-known time types, and the
two pieces of the wire format used to splice serialized messages into a message without decoding them."""

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


MAX_DURATION_SECONDS = 315_576_000_000  # google.protobuf.Duration's own range: +-10,000 years


def duration_seconds(value: Duration, field: str) -> float:
    """Seconds of a Duration a client sent, refused (ValueError naming ``field``) unless it is a valid
    Duration (seconds within +-10,000 years, |nanos| < 1e9, both of one sign) and not negative; the
    caller bounds it from above."""
    s, n = value.seconds, value.nanos
    if abs(s) > MAX_DURATION_SECONDS or abs(n) > 999_999_999 or (s > 0 > n) or (s < 0 < n):
        raise ValueError(f"{field} is not a valid google.protobuf.Duration (seconds={s}, nanos={n})")
    if s < 0 or n < 0:
        raise ValueError(f"{field} must not be negative")
    return s + n / 1e9


def varint(value: int) -> bytes:
    """A non-negative integer as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_header(field_number: int, size: int) -> bytes:
    """The key and length of a length-delimited field of ``size`` bytes: what goes before its payload,
    which may then be spliced in as several pieces."""
    return varint(field_number << 3 | 2) + varint(size)


def length_delimited(field_number: int, payload: bytes) -> list[bytes]:
    """A length-delimited field (a message, bytes or string) as its parts: header, payload."""
    return [field_header(field_number, len(payload)), payload]
