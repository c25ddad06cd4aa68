"""The queue's fast paths over the protobuf wire format.

A group is opaque to the queue once validated, so the queue never encodes it
again:

- ``Put`` reads its request through a *view* whose ``group`` field is plain
  bytes (a message field is always length-delimited on the wire, so the view
  is exact) and stores those bytes as received.
- Validation first decodes the group in full (upb, in C: UTF-8 of every
  string, nested messages, packed varints), so the queue accepts exactly what
  every consumer can decode (a group that no consumer can read would block
  training). Then it reads the token arrays through a view whose packed
  repeated fields are bytes and checks them with numpy. Anything the view
  cannot read exactly (an unpacked encoding, a packed field split in two,
  non-canonical bytes) falls back to ``convert.group_to_record`` on the
  decoded group, which also writes the error messages: the fast path only
  ever accepts.
- ``Get`` writes its response by concatenating the stored group bytes with
  the small fields around them.

Per 1 MB group this removes tens of milliseconds of CPU (see bench/README.md);
the full decode costs about 2 ms.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.message import Message

from tauflow import media
from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.protobuf import timestamp
from tauflow.queue.adapters import convert
from tauflow.queue.model import GetResult, GroupRecord

_F = descriptor_pb2.FieldDescriptorProto
_PACKED = (2, 3, 4, 5, 6)  # Sample fields the view reads as bytes


def _build_views() -> dict[str, type[Message]]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="tauflow/queue/wire_views.proto", package="tauflow.queue.wire", syntax="proto3"
    )

    def message(name: str, fields: list[tuple[str, int, int, str]], repeated: tuple[str, ...] = ()) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, type_name in fields:
            label = _F.LABEL_REPEATED if fname in repeated else _F.LABEL_OPTIONAL
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    message("RewardView", [("score", 1, _F.TYPE_DOUBLE, "")])
    message(
        "SampleView",
        [
            ("sample_id", 1, _F.TYPE_STRING, ""),
            ("prompt_token_ids", 2, _F.TYPE_BYTES, ""),
            ("completion_token_ids", 3, _F.TYPE_BYTES, ""),
            ("behaviour_logprobs", 4, _F.TYPE_BYTES, ""),
            ("token_versions", 5, _F.TYPE_BYTES, ""),
            ("loss_mask", 6, _F.TYPE_BYTES, ""),
            ("behaviour_version", 7, _F.TYPE_UINT64, ""),
            ("reward", 8, _F.TYPE_MESSAGE, ".tauflow.queue.wire.RewardView"),
        ],
    )
    message(
        "GroupView",
        [
            ("group_id", 1, _F.TYPE_STRING, ""),
            ("samples", 3, _F.TYPE_MESSAGE, ".tauflow.queue.wire.SampleView"),
            ("prompt_parts", 9, _F.TYPE_BYTES, ""),
        ],
        repeated=("samples", "prompt_parts"),
    )
    message("PutRequestView", [("group", 1, _F.TYPE_BYTES, ""), ("ticket_id", 2, _F.TYPE_STRING, "")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tauflow.queue.wire.{name}"))
        for name in ("GroupView", "PutRequestView")
    }


_VIEWS = _build_views()
GroupView = _VIEWS["GroupView"]
PutRequestView = _VIEWS["PutRequestView"]


class RawPutRequest(Protocol):
    """A PutRequest as Put reads it, through ``PutRequestView``: the group is the serialized bytes received."""

    group: bytes
    ticket_id: str


def _bytes_of(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8)


def _varint_count(raw: bytes) -> int:
    """Number of varints in a packed field: one terminal byte (< 0x80) each."""
    return int(np.count_nonzero(_bytes_of(raw) < 0x80))


def group_record_fast(raw: bytes, max_group_bytes: int) -> GroupRecord | None:
    """Checks the token arrays of a serialized Group without decoding them; None means "use the full
    decode". The checks that do not read token arrays are ``convert.check_structure``'s."""
    if len(raw) > max_group_bytes:
        return None
    try:
        view = GroupView.FromString(raw)
    except Exception:  # noqa: BLE001 - the full decode reports it properly
        return None
    if view.ByteSize() != len(raw) or not view.group_id or not view.samples:
        return None
    behaviour: int | None = None
    newest = 0
    n_tokens = 0
    for s in view.samples:
        if any(f.field_number in _PACKED for f in unknown_fields.UnknownFieldSet(s)):
            return None  # an unpacked repeated field: only the full decode reads it right
        n = _varint_count(s.completion_token_ids)
        n_prompt = _varint_count(s.prompt_token_ids)
        if n == 0 or n_prompt == 0:
            return None
        logprobs = s.behaviour_logprobs  # each read of a bytes field copies it: read once
        if logprobs:
            if len(logprobs) != 4 * n:
                return None
            lp = np.frombuffer(logprobs, dtype="<f4")
            if not (np.isfinite(lp).all() and (lp <= convert.MAX_LOGPROB).all()):
                return None
        mask = s.loss_mask
        if mask and (len(mask) != n or _bytes_of(mask).max() > 1):
            return None
        versions = s.token_versions
        if versions:
            v = _bytes_of(versions)
            if len(versions) != n or v.max() >= 0x80:
                return None  # versions >= 128 are multi-byte varints: the full decode takes them
            oldest = int(v.min())
            if s.behaviour_version and s.behaviour_version != oldest:
                return None
            newest = max(newest, int(v.max()))
        else:
            oldest = s.behaviour_version
            newest = max(newest, oldest)
        behaviour = oldest if behaviour is None else min(behaviour, oldest)
        n_tokens += n_prompt + n
    assert behaviour is not None
    # a text part costs nothing to decode; count the parts and let check_media tell media from text
    return GroupRecord(
        view.group_id, raw, behaviour, n_tokens, newest_version=newest, media_parts=len(view.prompt_parts)
    )


def decode_group(raw: bytes) -> common_pb2.Group:
    """The full decode of a serialized Group, as every consumer decodes it."""
    try:
        return common_pb2.Group.FromString(raw)
    except Exception as e:  # upb raises DecodeError; say what it is, not where in Python
        raise convert.InvalidGroup(
            "group does not decode as tauflow.api.common.v1.Group (malformed wire bytes, a string that is "
            "not UTF-8, or a malformed nested message)"
        ) from e


def group_record(raw: bytes, max_group_bytes: int) -> GroupRecord:
    """The stored form of a serialized Group: accepted only if it decodes in full and validates."""
    if len(raw) > max_group_bytes:  # before decoding it: an oversized group costs no decode
        raise convert.GroupTooLarge(f"the group is {len(raw)} bytes, over the limit of {max_group_bytes}")
    group = decode_group(raw)
    record = group_record_fast(raw, max_group_bytes)
    if record is not None:
        convert.check_structure(group)
        return record
    record = convert.group_to_record(group, max_group_bytes)
    record.payload = raw  # keep the producer's bytes: the full decode only validated them
    return record


def check_media(raw: bytes, limits: media.MediaLimits) -> media.PartCounts:
    """The full decode of every media part of an accepted-looking group (``group_record`` checked the rest);
    slow for a large video, so Put runs it off the event loop. Returns what the parts weigh."""
    return media.counts(convert.prompt_parts(decode_group(raw), limits, decode=True))


def invalid_reason(raw: bytes, max_group_bytes: int) -> str | None:
    """Why a stored group could not be delivered (it does not decode or validate); None if it can.
    Recovery runs it over groups written by an earlier build that validated less."""
    try:
        group_record(raw, max_group_bytes)
    except convert.InvalidGroup as e:
        return str(e)
    return None


# -- encoding a GetResponse from stored bytes ------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> list[bytes]:
    return [_varint(field_number << 3 | 2), _varint(len(payload)), payload]


# Upper bounds of what encode_get_response adds around the stored group bytes (every varint at its
# longest): the lease, evicted_stale and trainer_version once, and per group the two field headers
# plus behaviour_version, staleness, redeliveries and accepted_at. Get budgets its batch with them.
RESPONSE_HEAD_BYTES = 128
DELIVERY_OVERHEAD_BYTES = 64


def deliverable_group_bytes(max_message_bytes: int) -> int:
    """The largest group that a Get response of at most ``max_message_bytes`` can carry alone."""
    return max_message_bytes - RESPONSE_HEAD_BYTES - DELIVERY_OVERHEAD_BYTES


def group_limit(max_group_bytes: int, max_message_bytes: int) -> int:
    """The largest group Put accepts: a group must fit a Get response on its own, or it could be
    accepted and never delivered."""
    return min(max_group_bytes, deliverable_group_bytes(max_message_bytes))


_GROUP_FIELD = queue_pb2.DeliveredGroup.DESCRIPTOR.fields_by_name["group"].number
_GROUPS_FIELD = queue_pb2.GetResponse.DESCRIPTOR.fields_by_name["groups"].number


def encode_get_response(result: GetResult, trainer_version: int) -> bytes:
    """The serialized GetResponse, with each stored group spliced in as is."""
    head = queue_pb2.GetResponse(evicted_stale=result.evicted_stale, trainer_version=trainer_version)
    if result.lease is not None:
        head.lease.CopyFrom(convert.lease_to_proto(result.lease))
    if result.max_staleness is not None:
        head.max_staleness = result.max_staleness
    parts = [head.SerializeToString()]
    for d in result.deliveries:
        rest = queue_pb2.DeliveredGroup(
            behaviour_version=d.group.behaviour_version,
            staleness=d.staleness,
            redeliveries=d.redeliveries,
            accepted_at=timestamp(d.group.accepted_at),
        ).SerializeToString()
        inner = _length_delimited(_GROUP_FIELD, d.group.payload)
        size = sum(len(p) for p in inner) + len(rest)
        parts += [_varint(_GROUPS_FIELD << 3 | 2), _varint(size), *inner, rest]
    return b"".join(parts)
