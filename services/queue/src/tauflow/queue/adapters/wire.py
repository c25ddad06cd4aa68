"""The queue's fast paths over the protobuf wire format.

A group is opaque to the queue once validated, so the queue never encodes it
again:

- ``Put`` reads its request through a *view* whose ``group`` field is plain
  bytes (a message field is always length-delimited on the wire, so the view
  is exact) and stores those bytes as received.
- Validation decodes the group through ``GroupView``: common.v1's Group schema whole (upb, in C: UTF-8
  of every string, every nested message, maps, wire types), except that the Sample's packed arrays are
  ``repeated bytes``. Their bytes are then checked with numpy to be what the full decode accepts (whole
  varints of at most 4 bytes, whole floats) and what the queue accepts (lengths, finite log-probs,
  versions). So the queue accepts exactly what every consumer can decode (a group that no consumer can
  read would block training) without building a Python-visible array of every token. Anything the view
  cannot decide (an unpacked encoding, a packed field in several chunks, a long varint, media parts)
  falls back to the full decode and ``convert.group_to_record``, which also words the error messages:
  the fast path only ever accepts.
- ``Get`` writes its response by concatenating the stored group bytes with
  the small fields around them.

Per 1 MB group this removes tens of milliseconds of CPU (see bench/README.md):
validation takes 0.5 ms, where the full decode (and freeing it) took 2.4 ms.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.message import Message

from tauflow import media
from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.decoding import wire_bounds
from tauflow.core.protobuf import field_header, length_delimited, timestamp
from tauflow.queue.adapters import convert
from tauflow.queue.model import GetResult, GroupRecord

_F = descriptor_pb2.FieldDescriptorProto
_PACKED = (2, 3, 4, 5, 6)  # Sample fields the view reads as bytes


def _build_views() -> dict[str, type[Message]]:
    """``GroupView``: common.v1's Group schema whole (every field, type and UTF-8 check the full decode
    makes), except that the Sample's packed arrays are ``repeated bytes`` (one element per chunk on the
    wire); ``PutRequestView``: a PutRequest whose group is bytes; ``PutBatchRequestView``: a
    PutBatchRequest of those."""
    fdp = descriptor_pb2.FileDescriptorProto()
    common_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = f".{fdp.package}.", ".tauflow.queue.wire."
    fdp.name, fdp.package = "tauflow/queue/wire_views.proto", new.strip(".")

    def rename(messages: Any) -> None:
        for m in messages:
            for f in m.field:
                if f.type_name.startswith(old):
                    f.type_name = new + f.type_name[len(old) :]
            rename(m.nested_type)

    rename(fdp.message_type)
    sample = next(m for m in fdp.message_type if m.name == "Sample")
    for f in sample.field:
        if f.number in _PACKED:
            f.type, f.label = _F.TYPE_BYTES, _F.LABEL_REPEATED
            f.ClearField("options")
    put = fdp.message_type.add(name="PutRequestView")
    put.field.add(name="group", number=1, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL)
    put.field.add(name="ticket_id", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    batch = fdp.message_type.add(name="PutBatchRequestView")
    batch.field.add(
        name="puts", number=1, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED, type_name=f"{new}PutRequestView"
    )
    pool = descriptor_pool.DescriptorPool()
    for dep in common_pb2.DESCRIPTOR.dependencies:
        dep_proto = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(dep_proto)
        pool.Add(dep_proto)
    pool.Add(fdp)
    return {
        view: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tauflow.queue.wire.{name}"))
        for view, name in (
            ("GroupView", "Group"),
            ("PutRequestView", "PutRequestView"),
            ("PutBatchRequestView", "PutBatchRequestView"),
        )
    }


_VIEWS = _build_views()
GroupView = _VIEWS["GroupView"]
PutRequestView = _VIEWS["PutRequestView"]
PutBatchRequestView = _VIEWS["PutBatchRequestView"]
_MAX_TOKEN_VARINT = 4  # bytes: token ids below 2^28 (every vocabulary); longer ones take the full decode


class RawPutRequest(Protocol):
    """A PutRequest as Put reads it, through ``PutRequestView``: the group is the serialized bytes received."""

    group: bytes
    ticket_id: str


def _bytes_of(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8)


_SMALL_ARRAY = 1024  # bytes: below, bytes operations beat numpy's per-call cost; above, numpy wins
_CONTINUATION = bytes(range(0x80, 0x100))  # a byte that says "the varint goes on"
_SINGLE_BYTE = bytes(range(0x80))  # a byte that is a whole varint
# The largest float32 at most MAX_LOGPROB: a float32 passes the full decode's float64 comparison exactly when
# it is at most this (float32(1e-3) itself is above 1e-3).
_MAX_LOGPROB_F32 = np.float32(convert.MAX_LOGPROB)
if float(_MAX_LOGPROB_F32) > convert.MAX_LOGPROB:
    _MAX_LOGPROB_F32 = np.nextafter(_MAX_LOGPROB_F32, np.float32(-np.inf))
_LONG_VARINT = re.compile(b"[\\x80-\\xff]{%d}" % _MAX_TOKEN_VARINT)  # that many in a row: a longer varint


def _short_varint_count(raw: bytes) -> int | None:
    """Number of varints in a packed field, one terminal byte (< 0x80) each; None unless the bytes are
    whole varints of at most ``_MAX_TOKEN_VARINT`` bytes each (then every decoder reads them the same
    way)."""
    if not raw:
        return 0
    if raw[-1] >= 0x80:
        return None  # a varint cut off at the end: malformed
    if len(raw) <= _SMALL_ARRAY:  # plain bytes operations: no per-call cost of numpy
        return None if _LONG_VARINT.search(raw) else len(raw.translate(None, _CONTINUATION))
    more = _bytes_of(raw) >= 0x80
    window = more[: len(more) - _MAX_TOKEN_VARINT + 1].copy()  # `_MAX_TOKEN_VARINT` continuations in a row
    for k in range(1, _MAX_TOKEN_VARINT):
        window &= more[k : len(more) - _MAX_TOKEN_VARINT + 1 + k]
    return None if window.any() else len(more) - int(np.count_nonzero(more))


def _all_below(raw: bytes, bound: int) -> bool:
    """Whether every byte of ``raw`` is below ``bound``."""
    if len(raw) <= _SMALL_ARRAY:  # (bytes.translate deletes slowly: for short arrays only)
        return not raw.translate(None, bytes(range(bound)) if bound != 0x80 else _SINGLE_BYTE)
    return int(_bytes_of(raw).max()) < bound


def _one_chunk(chunks: Any) -> bytes | None:
    """A packed field's bytes, or None when it came in several chunks (the full decode joins them)."""
    return chunks[0] if len(chunks) == 1 else (b"" if not chunks else None)


def decode_view(raw: bytes) -> Any | None:
    """``raw`` through ``GroupView``; None when it does not decode (the full decode then says why)."""
    try:
        return GroupView.FromString(raw)
    except Exception:  # noqa: BLE001 - the full decode reports it properly
        return None


def group_record_fast(raw: bytes, max_group_bytes: int, view: Any | None = None) -> GroupRecord | None:
    """Checks the token arrays of a serialized Group without decoding them into numbers; None means
    "use the full decode". The checks that do not read token arrays are ``convert.check_structure``'s,
    which runs on the view as on a decoded group (same fields, same names).

    Exact, not approximate: the view decodes every field as the full decode does except the packed
    arrays, whose bytes are checked here with numpy to be what the full decode would accept (whole
    varints, whole floats). Whatever this cannot decide (an unpacked or chunked array, a long varint,
    media parts) goes to the full decode, which also words the errors: the fast path only ever accepts."""
    if len(raw) > max_group_bytes:
        return None
    view = decode_view(raw) if view is None else view
    if view is None or not view.group_id or not view.samples or view.prompt_parts:
        return None
    # One pass over the samples gathers their arrays; the numeric checks then run once per group, over the
    # arrays joined (numpy's per-call cost, paid per sample, was most of the time of a small group).
    n_tokens = 0
    logprob_chunks: list[bytes] = []
    mask_chunks: list[bytes] = []
    version_chunks: list[bytes] = []
    version_samples: list[int] = []  # the samples that carry token versions, in order
    stated = []  # each sample's behaviour_version
    for i, s in enumerate(view.samples):
        if any(f.field_number in _PACKED for f in unknown_fields.UnknownFieldSet(s)):
            return None  # an unpacked repeated field: only the full decode reads it right
        prompt = _one_chunk(s.prompt_token_ids)
        completion = _one_chunk(s.completion_token_ids)
        logprobs = _one_chunk(s.behaviour_logprobs)
        versions = _one_chunk(s.token_versions)
        mask = _one_chunk(s.loss_mask)
        if prompt is None or completion is None or logprobs is None or versions is None or mask is None:
            return None
        n = _short_varint_count(completion)
        n_prompt = _short_varint_count(prompt)
        if not n or not n_prompt:
            return None
        if len(logprobs) != 4 * n or (mask and len(mask) != n) or (versions and len(versions) != n):
            return None  # (one byte per flag and per version: see below)
        logprob_chunks.append(logprobs)
        mask_chunks.append(mask)
        if versions:
            version_chunks.append(versions)
            version_samples.append(i)
        stated.append(s.behaviour_version)
        n_tokens += n_prompt + n
    if logprob_chunks:
        lp = np.frombuffer(b"".join(logprob_chunks), dtype="<f4")
        if not (np.isfinite(lp).all() and (lp <= _MAX_LOGPROB_F32).all()):
            return None
    if not _all_below(b"".join(mask_chunks), 2):
        return None  # a flag other than 0 or 1 (a longer varint): the full decode reads it
    oldest = list(stated)  # a sample's behaviour version: its oldest token's, else the one stated
    newest = max(stated)
    if version_chunks:
        joined = b"".join(version_chunks)
        if not _all_below(joined, 0x80):
            return None  # versions >= 128 are multi-byte varints: the full decode takes them
        v = _bytes_of(joined)
        starts = np.cumsum([0] + [len(c) for c in version_chunks[:-1]])
        lows, highs = np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)
        for i, low in zip(version_samples, lows.tolist(), strict=True):
            if stated[i] and stated[i] != low:
                return None
            oldest[i] = low
        newest = max(newest, int(highs.max()))
    return GroupRecord(view.group_id, raw, min(oldest), n_tokens, newest_version=newest, media_parts=0)


def decode_group(raw: bytes) -> common_pb2.Group:
    """The full decode of a serialized Group, as every consumer decodes it."""
    try:
        return common_pb2.Group.FromString(raw)
    except Exception as e:  # upb raises DecodeError; say what it is, not where in Python
        raise convert.InvalidGroup(
            "group does not decode as tauflow.api.common.v1.Group (malformed wire bytes, a string that is "
            "not UTF-8, or a malformed nested message)"
        ) from e


# A group's samples counted before it is decoded (tauflow.core.decoding.wire_bounds): only their number, the
# queue's bound; every other bound is checked on the decoded group. 20 M empty samples fit in 38 MiB and took
# GBs and seconds to decode before their refusal.
_count_samples = wire_bounds(
    common_pb2.Group.DESCRIPTOR, {"samples": convert.MAX_SAMPLES}, max_string=1 << 62, max_items=1 << 62
)


def too_many_samples(raw: bytes) -> str | None:
    """Why the serialized Group ``raw`` holds more samples than the queue takes (``group.samples has more
    than ...``), read on its wire bytes; None when it does not (or does not decode: the full decode says)."""
    breach = _count_samples(raw)
    if breach is None:
        return None
    return f"group.{breach}" if breach.startswith("samples ") else f"group: {breach}"


def group_record(raw: bytes, max_group_bytes: int) -> GroupRecord:
    """The stored form of a serialized Group: accepted only if it decodes in full and validates."""
    if len(raw) > max_group_bytes:  # before decoding it: an oversized group costs no decode
        raise convert.GroupTooLarge(f"the group is {len(raw)} bytes, over the limit of {max_group_bytes}")
    if (too_many := too_many_samples(raw)) is not None:  # (nor one of millions of samples)
        raise convert.InvalidGroup(too_many)
    view = decode_view(raw)
    record = group_record_fast(raw, max_group_bytes, view)
    if record is not None and view is not None:
        convert.check_structure(view)  # (a view has the Group's fields, by the same names)
        return record
    group = decode_group(raw)
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


def get_response_parts(result: GetResult, trainer_version: int) -> list[bytes]:
    """The serialized GetResponse in pieces, each stored group spliced in as is: ``Get`` joins them,
    ``Deliver`` wraps them (``delivery``), so that a group's bytes are copied once into the answer."""
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
        inner = length_delimited(_GROUP_FIELD, d.group.payload)
        size = sum(len(p) for p in inner) + len(rest)
        parts += [field_header(_GROUPS_FIELD, size), *inner, rest]
    return parts


def encode_get_response(result: GetResult, trainer_version: int) -> bytes:
    """The serialized GetResponse, with each stored group spliced in as is."""
    return b"".join(get_response_parts(result, trainer_version))


_BATCH_FIELD = queue_pb2.DeliverResponse.DESCRIPTOR.fields_by_name["batch"].number


def delivery(get_response: list[bytes]) -> bytes:
    """A serialized DeliverResponse around a GetResponse's pieces (``get_response_parts``)."""
    size = sum(len(p) for p in get_response)
    return b"".join([field_header(_BATCH_FIELD, size), *get_response])
