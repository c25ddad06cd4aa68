"""Registers a servicer so that a request that does not decode in full (corrupt wire bytes, a string that is not
UTF-8, a malformed nested message) is answered INVALID_ARGUMENT naming the message type. With the generated
``add_*Servicer_to_server`` the decode error escapes into gRPC, which answers UNKNOWN with Python's text.

It also checks the generic bounds of every request before the handler sees it (:func:`check_bounds`): each
string and list is bounded, each Duration and Timestamp is one the well-known type allows; a breach is
INVALID_ARGUMENT naming the field.

Methods of every kind are handled: unary, server-streaming (checked before the handler runs), client and
bidirectional streaming (each request checked as the handler reads it: the first bad one ends the call)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from tauflow.core.protobuf import MAX_DURATION_SECONDS

MAX_STRING = 4096  # characters of any string field, unless the service names a field's own bound
MAX_ITEMS = 100_000  # elements of any repeated or map field, likewise
TIMESTAMP_SECONDS = (-62_135_596_800, 253_402_300_799)  # google.protobuf.Timestamp: years 1..9999


def check_bounds(
    msg: Message,
    limits: dict[str, int] | None = None,
    path: str = "",
    max_string: int = MAX_STRING,
    max_items: int = MAX_ITEMS,
) -> None:
    """Raises ValueError naming the field (``a.b[3].c``) of the first breach in ``msg``: a string longer than its
    bound, a repeated or map field with more elements, an invalid Duration or Timestamp. ``limits`` maps a
    field path without indices (``sampling.stop``, ``names``) to its own bound (characters or elements)."""
    _check(msg, limits or {}, path, _unindexed(path), max_string, max_items)


# What each field is, by descriptor, worked out once: a manifest of 100,000 tensors was checked at 23 µs each
# (its fields' options and paths worked out again for every element), 2.3 s of the sidecar's event loop.
_SCALARS, _MESSAGES, _MESSAGE, _STRING, _OTHER = range(5)


@functools.cache
def _kind(f: FieldDescriptor) -> tuple[int, bool, bool, bool]:
    """(kind, a map, its keys are strings, a map's values or a list's elements are strings)."""
    strings = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
    if f.is_repeated:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            scalar_values = value.message_type is None
            return (
                _SCALARS if scalar_values else _MESSAGES,
                True,
                key.type == FieldDescriptor.TYPE_STRING,
                scalar_values and value.type == FieldDescriptor.TYPE_STRING,
            )
        if f.message_type is None:
            return _SCALARS, False, False, f.type == FieldDescriptor.TYPE_STRING
        return _MESSAGES, False, False, False
    if f.message_type is not None:
        return _MESSAGE, False, False, False
    return (_STRING if f.type in strings else _OTHER), False, False, False


def _check(msg: Message, limits: dict[str, int], path: str, key: str, max_string: int, max_items: int) -> None:
    name = msg.DESCRIPTOR.full_name
    if name == "google.protobuf.Duration":
        s, n = msg.seconds, msg.nanos
        if abs(s) > MAX_DURATION_SECONDS or abs(n) > 999_999_999 or (s > 0 > n) or (s < 0 < n):
            raise ValueError(f"{path} is not a valid google.protobuf.Duration (seconds={s}, nanos={n})")
        return
    if name == "google.protobuf.Timestamp":
        s, n = msg.seconds, msg.nanos
        if not TIMESTAMP_SECONDS[0] <= s <= TIMESTAMP_SECONDS[1] or not 0 <= n <= 999_999_999:
            raise ValueError(f"{path} is not a valid google.protobuf.Timestamp (seconds={s}, nanos={n})")
        return
    for f, value in msg.ListFields():
        where = f"{path}.{f.name}" if path else f.name
        field_key = f"{key}.{f.name}" if key else f.name
        kind, is_map, string_keys, string_items = _kind(f)
        if kind == _STRING:
            _check_string(value, where, limits.get(field_key, max_string))
        elif kind == _MESSAGE:
            _check(value, limits, where, field_key, max_string, max_items)
        elif kind != _OTHER:  # a repeated or map field
            bound = limits.get(field_key, max_items)
            if len(value) > bound:
                raise ValueError(f"{where} has {len(value)} elements, over the limit of {bound}")
            if is_map and string_keys:
                for k in value:
                    _check_string(k, f"{where} key", limits.get(field_key + ".key", max_string))
            items = value.values() if is_map else value
            if kind == _SCALARS:
                if string_items:
                    if is_map:
                        bound = limits.get(field_key + ".value", max_string)
                        for v in items:
                            _check_string(v, f"{where} value", bound)
                    else:
                        bound = limits.get(field_key + "[]", max_string)
                        for i, v in enumerate(items):
                            if len(v) > bound:
                                _check_string(v, f"{where}[{i}]", bound)
                continue
            for i, v in enumerate(items):
                _check(v, limits, f"{where}[{i}]", field_key, max_string, max_items)


def _check_string(value: str | bytes, where: str, bound: int) -> None:
    if len(value) > bound:
        raise ValueError(f"{where} is {len(value)} long, over the limit of {bound}")


def _unindexed(path: str) -> str:
    out, depth = [], 0
    for ch in path:
        depth += ch == "["
        if not depth:
            out.append(ch)
        depth -= ch == "]"
    return "".join(out)


# The pre-decode walk: a request's repeated fields counted on its wire bytes, before upb decodes it whole (a
# 38 MiB request of 20 M empty elements costs GBs of memory and seconds of the event loop to decode). It refuses
# a subset of what a full decode and check_bounds refuse, naming the field check_bounds would name.
# Wire fields the walk reads (those of the messages it descends) before it refuses the request (~0.5 s of the
# event loop at most). A real request reads about one per element of its lists that hold more than
# _DESCENT_FLOOR bytes: the request's top-level lists, and those of its large elements.
MAX_WALK_TAGS = 1 << 20
# An element of a list is descended only from this many bytes on: a small one cannot hold the millions of
# elements the walk is for (what a small one breaches, check_bounds refuses after the decode).
_DESCENT_FLOOR = 1024
_HIGH_BYTES = bytes(range(0x80, 0x100))  # a varint's continuation bytes: the others end one varint each
_WIRE = {  # a scalar's wire type (not packed)
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT), 5),
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE), 1),
    **dict.fromkeys((FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE), 2),
}
_LIST, _MAP, _SUB = range(3)  # what the walk does with a field: count its elements, count its keys, descend
_MAX_PLAN_DEPTH = 32  # nesting the walk descends (deeper messages are left to the full decode)


class _Malformed(Exception):
    """The bytes are not wire format as the walk reads them: the full decode decides."""


@dataclass(frozen=True)
class _Field:
    name: str
    action: int
    bound: int  # elements (a list or a map), or 0
    wire: int  # the element's wire type (a packed list also comes as 2)
    width: int  # a packed element's bytes (4 or 8), 0 for a varint
    item_chars: int  # a list of strings: each one's bound in characters (0: none)
    sub: _Plan | None  # a message to descend (its elements, or the field itself)
    key_type: int  # a map's key type


@dataclass(frozen=True)
class _Plan:
    fields: dict[int, _Field]
    threshold: int  # an element of at most this many bytes is not descended (it cannot breach a bound inside,
    # or it is under _DESCENT_FLOOR)


def _plan(d: Any, key: str, limits: dict[str, int], max_string: int, max_items: int, depth: int = 0) -> _Plan | None:
    """What the walk looks at in a message of type ``d`` at the unindexed path ``key`` (None: nothing)."""
    if depth > _MAX_PLAN_DEPTH or d.full_name in ("google.protobuf.Duration", "google.protobuf.Timestamp"):
        return None
    fields: dict[int, _Field] = {}
    lows = []
    for f in d.fields:
        field_key = f"{key}.{f.name}" if key else f.name
        if f.is_repeated:
            bound = limits.get(field_key, max_items)
            lows.append(bound)
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                k = f.message_type.fields_by_name["key"]
                fields[f.number] = _Field(f.name, _MAP, bound, 2, 0, 0, None, k.type)
                continue
            if f.type == FieldDescriptor.TYPE_ENUM and getattr(f.enum_type, "is_closed", False):
                continue  # (a closed enum's unknown values are not elements)
            sub = None
            if f.message_type is not None:
                sub = _plan(f.message_type, field_key, limits, max_string, max_items, depth + 1)
                if sub is not None:
                    lows.append(sub.threshold)
            item_chars = 0
            if f.type == FieldDescriptor.TYPE_STRING:
                item_chars = limits.get(field_key + "[]", max_string)
                lows.append(4 * item_chars)
            wire = _WIRE.get(f.type, 0)
            width = {5: 4, 1: 8}.get(wire, 0)
            fields[f.number] = _Field(f.name, _LIST, bound, wire, width, item_chars, sub, 0)
        elif f.message_type is not None and (f.containing_oneof is None or len(f.containing_oneof.fields) == 1):
            # (a member of a oneof is not descended: a later member of its oneof clears it)
            sub = _plan(f.message_type, field_key, limits, max_string, max_items, depth + 1)
            if sub is not None:
                fields[f.number] = _Field(f.name, _SUB, 0, 2, 0, 0, sub, 0)
                lows.append(sub.threshold)
    if not fields:
        return None
    return _Plan(fields, max(min(lows), _DESCENT_FLOOR))


class _Breach(Exception):
    pass


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    b = raw[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = raw[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7
        if shift >= 70:
            raise _Malformed


class _Walk:
    def __init__(self, raw: bytes, name: str) -> None:
        self.raw = raw
        self.name = name
        self.tags = MAX_WALK_TAGS
        self.counts: dict[tuple[str, int], int] = {}
        self.keys: dict[tuple[str, int], set[Any]] = {}

    def spend(self) -> None:
        """Counts one field read; past ``MAX_WALK_TAGS`` the request is refused (no real request comes near)."""
        self.tags -= 1
        if self.tags < 0:
            raise _Breach(f"request has more than {MAX_WALK_TAGS} wire fields (of {self.name}), over the limit")

    def message(self, start: int, end: int, plan: _Plan, where: str) -> None:
        """Walks the fields in raw[start:end] of a message at ``where``; raises _Breach at the first breach."""
        raw, fields, counts = self.raw, plan.fields, self.counts
        pos = start
        while pos < end:
            self.spend()
            tag, pos = _varint(raw, pos)
            number, wt = tag >> 3, tag & 7
            if number == 0:
                raise _Malformed
            if wt == 0:
                _, pos = _varint(raw, pos)  # (at most 10 bytes: an over-long varint is left to the full decode)
                if pos > end:
                    raise _Malformed
                payload = -1
            elif wt == 2:
                n, pos = _varint(raw, pos)
                payload, pos = pos, pos + n
                if pos > end:
                    raise _Malformed
            elif wt == 1 or wt == 5:
                pos += 8 if wt == 1 else 4
                if pos > end:
                    raise _Malformed
                payload = -1
            elif wt == 3:
                pos = self.group(pos, end, number)
                continue
            else:
                raise _Malformed  # (an end of group with none open)
            f = fields.get(number)
            if f is None:
                continue
            if f.action == _SUB:
                if wt == 2:
                    self.message(payload, pos, f.sub, f"{where}.{f.name}" if where else f.name)  # type: ignore[arg-type]
                continue
            if f.action == _MAP:
                if wt == 2:
                    k = (where, number)
                    seen = self.keys.setdefault(k, set())
                    seen.add(self.map_key(payload, pos, f.key_type))
                    if len(seen) > f.bound:
                        raise _Breach(f"{_at(where, f)} has more than {f.bound} elements, over the limit of {f.bound}")
                continue
            k = (where, number)
            before = counts.get(k, 0)
            if wt == f.wire:
                counts[k] = before + 1
                if f.item_chars and pos - payload > 4 * f.item_chars:
                    chars = len(raw[payload:pos].decode("utf-8", "replace"))
                    if chars > f.item_chars:
                        raise _Breach(f"{_at(where, f)}[{before}] is {chars} long, over the limit of {f.item_chars}")
                if f.sub is not None and pos - payload > f.sub.threshold:
                    self.message(payload, pos, f.sub, f"{_at(where, f)}[{before}]")
            elif wt == 2 and f.wire != 2:  # a packed list of scalars
                n = pos - payload
                counts[k] = before + (n // f.width if f.width else len(raw[payload:pos].translate(None, _HIGH_BYTES)))
                if counts[k] > f.bound:
                    raise _Breach(f"{_at(where, f)} has at least {counts[k]} elements, over the limit of {f.bound}")
                continue
            else:
                continue
            if counts[k] > f.bound:
                raise _Breach(f"{_at(where, f)} has more than {f.bound} elements, over the limit of {f.bound}")
        if pos != end:
            raise _Malformed

    def group(self, pos: int, end: int, number: int) -> int:
        """Skips an (unknown) group whose start tag was just read; the position after its end tag."""
        raw, open_ = self.raw, [number]
        while open_:
            self.spend()
            if pos >= end:
                raise _Malformed
            tag, pos = _varint(raw, pos)
            number, wt = tag >> 3, tag & 7
            if wt == 0:
                _, pos = _varint(raw, pos)
            elif wt == 1 or wt == 5:
                pos += 8 if wt == 1 else 4
            elif wt == 2:
                n, pos = _varint(raw, pos)
                pos += n
            elif wt == 3:
                open_.append(number)
            elif wt == 4 and number == open_[-1]:
                open_.pop()
            else:
                raise _Malformed
        if pos > end:
            raise _Malformed
        return pos

    def map_key(self, start: int, end: int, key_type: int) -> Any:
        """The key of the map entry raw[start:end] as the full decode reads it (the last one, else the default)."""
        raw, pos = self.raw, start
        key: Any = None
        wire = _WIRE.get(key_type, 0)
        while pos < end:
            self.spend()
            tag, pos = _varint(raw, pos)
            number, wt = tag >> 3, tag & 7
            if number == 0:
                raise _Malformed
            if wt == 0:
                value, pos = _varint(raw, pos)
                if number == 1 and wire == 0:
                    key = value & 0xFFFFFFFF if key_type in _KEYS32 else value & 0xFFFFFFFFFFFFFFFF
                    key = bool(key) if key_type == FieldDescriptor.TYPE_BOOL else key
            elif wt == 2:
                n, pos = _varint(raw, pos)
                if number == 1 and wire == 2:
                    key = raw[pos : pos + n]
                pos += n
            elif wt == 1 or wt == 5:
                width = 8 if wt == 1 else 4
                if number == 1 and wire == wt:
                    key = raw[pos : pos + width]
                pos += width
            else:
                raise _Malformed  # (the full decode decides about a group in an entry)
        if pos != end:
            raise _Malformed
        if key is None:
            key = b"" if wire == 2 else (bytes(4 if wire == 5 else 8) if wire else 0)
            key = False if key_type == FieldDescriptor.TYPE_BOOL else key
        return key


def _at(where: str, f: _Field) -> str:
    return f"{where}.{f.name}" if where else f.name


_KEYS32 = (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_SINT32)


def wire_bounds(
    descriptor: Any, limits: dict[str, int] | None = None, max_string: int = MAX_STRING, max_items: int = MAX_ITEMS
) -> Callable[[bytes], str | None]:
    """A check of a serialized ``descriptor`` message before it is decoded: the message of the first breach of
    :func:`check_bounds` (same ``limits``) it finds on the wire bytes alone (a repeated or map field with more
    elements than its bound, a string of a list over its bound), else None. Its cost is bounded by the bounds
    (it stops at the first breach; payloads are skipped, and nested messages read only where a bound inside
    them could be passed) and by ``MAX_WALK_TAGS`` fields read, past which it refuses. It never refuses what a
    full decode and :func:`check_bounds` accept (but for that many fields); bytes it cannot read as wire
    format it leaves to the full decode."""
    plan = _plan(descriptor, "", limits or {}, max_string, max_items)

    def check(raw: bytes) -> str | None:
        if plan is None or len(raw) <= plan.threshold:
            return None
        walk = _Walk(raw, descriptor.full_name)
        try:
            walk.message(0, len(raw), plan, "")
        except _Breach as breach:
            return str(breach)
        except (_Malformed, IndexError, RecursionError):
            return None
        return None

    return check


def field_wire_bytes(raw: bytes, number: int) -> int | None:
    """The payload bytes of every occurrence of the length-delimited field ``number`` at the top level of the
    serialized message ``raw`` (a message field sent in parts is merged by the decode: its size as sent is
    their sum), or None where ``raw`` is not wire format as the walk reads it (the full decode decides). Its
    cost is one read per top-level field, ``MAX_WALK_TAGS`` at most: a field's payload is skipped, not read."""
    walk, pos, end, total = _Walk(raw, "request"), 0, len(raw), 0
    try:
        while pos < end:
            walk.spend()
            tag, pos = _varint(raw, pos)
            wt = tag & 7
            if tag >> 3 == 0:
                return None
            if wt == 0:
                _, pos = _varint(raw, pos)
            elif wt == 2:
                n, pos = _varint(raw, pos)
                if tag >> 3 == number:
                    total += n
                pos += n
            elif wt == 1 or wt == 5:
                pos += 8 if wt == 1 else 4
            elif wt == 3:
                pos = walk.group(pos, end, tag >> 3)
            else:
                return None
    except (_Breach, _Malformed, IndexError):
        return None
    return total if pos == end else None


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes did not parse as ``message`` (a full name); ``reason`` is protobuf's."""

    message: str
    reason: str


@dataclass(frozen=True)
class OutOfBounds:
    """A request refused before it was decoded (:func:`wire_bounds`): ``reason`` names the field, as
    :func:`check_bounds` does."""

    reason: str


def checked_deserializer(message_class: Any, limits: dict[str, int] | None = None) -> Callable[[bytes], Any]:
    """``message_class.FromString`` that returns an :class:`Undecodable` instead of raising. With ``limits``
    (those the handler's :func:`check_bounds` uses; ``{}`` for the generic bounds), the wire bytes are first
    walked (:func:`wire_bounds`), and a request out of its bounds is an :class:`OutOfBounds`, never decoded."""
    walk = None if limits is None else wire_bounds(message_class.DESCRIPTOR, limits)

    def parse(raw: bytes) -> Any:
        if walk is not None and (reason := walk(raw)) is not None:
            return OutOfBounds(reason)
        try:
            return message_class.FromString(raw)
        except Exception as e:  # noqa: BLE001 - upb's DecodeError, or whatever else hostile bytes provoke
            # protobuf's message ends with the reason ("... 'pkg.Type': String field had bad UTF-8"); it
            # quotes no request bytes.
            return Undecodable(message_class.DESCRIPTOR.full_name, str(e).rpartition(": ")[2][:200])

    return parse


async def _refuse(request: Any, context: grpc.aio.ServicerContext, limits: dict[str, int] | None) -> None:
    """Aborts the call with INVALID_ARGUMENT when ``request`` did not decode or is out of its bounds."""
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request does not decode as {request.message}: {request.reason}"
        )
    if isinstance(request, OutOfBounds):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
    try:
        check_bounds(request, limits)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def refusing_undecodable(behaviour: Callable[..., Any], limits: dict[str, int] | None = None) -> Callable[..., Any]:
    """The handler ``behaviour`` behind checks that answer INVALID_ARGUMENT for an :class:`Undecodable` and for a
    request out of its bounds (:func:`check_bounds` with ``limits``)."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(request, context, limits)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


def refusing_undecodable_stream(
    behaviour: Callable[..., Any], limits: dict[str, int] | None = None
) -> Callable[..., Any]:
    """:func:`refusing_undecodable` for a server-streaming handler (one request, a stream of answers): an async
    generator stays one (its answers are passed on), a coroutine that writes with ``context.write`` stays one."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse(request, context, limits)
            async for answer in behaviour(request, context):
                yield answer

        return stream

    async def write(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(request, context, limits)
        return await behaviour(request, context)

    return write


def refusing_undecodable_requests(
    behaviour: Callable[..., Any], limits: dict[str, int] | None = None
) -> Callable[..., Any]:
    """The same checks for a handler of a stream of requests (client or bidirectional streaming): each request
    is checked as the handler reads it, and the first that fails ends the call with INVALID_ARGUMENT."""

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            await _refuse(request, context, limits)
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for answer in behaviour(checked(requests, context), context):
                yield answer

        return stream

    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        result = behaviour(checked(requests, context), context)
        return await result if inspect.isawaitable(result) else result

    return call


_KINDS = {  # (client streaming, server streaming) -> the handler's factory and its checks
    (False, False): (grpc.unary_unary_rpc_method_handler, refusing_undecodable),
    (False, True): (grpc.unary_stream_rpc_method_handler, refusing_undecodable_stream),
    (True, False): (grpc.stream_unary_rpc_method_handler, refusing_undecodable_requests),
    (True, True): (grpc.stream_stream_rpc_method_handler, refusing_undecodable_requests),
}


def checked_handlers(
    service: ServiceDescriptor, servicer: Any, limits: dict[str, dict[str, int]] | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers of ``servicer`` for ``service``, by method name, each request decoded by
    :func:`checked_deserializer` and bounded by :func:`check_bounds` (``limits``: per method name, the field
    bounds that differ from the defaults), whatever the method's kind (unary or streaming)."""
    limits = limits or {}
    handlers = {}
    for m in service.methods:
        make, refusing = _KINDS[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(
            refusing(getattr(servicer, m.name), limits.get(m.name)),
            request_deserializer=checked_deserializer(
                message_factory.GetMessageClass(m.input_type), limits.get(m.name) or {}
            ),
            response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString,
        )
    return handlers


def servicer_adder(
    service: ServiceDescriptor, limits: dict[str, dict[str, int]] | None = None
) -> Callable[[Any, grpc.aio.Server], None]:
    """A drop-in for the generated ``add_<Service>Servicer_to_server``, whose requests are decoded by
    :func:`checked_deserializer` and bounded by :func:`check_bounds` (:func:`checked_handlers`)."""

    def add(servicer: Any, server: grpc.aio.Server) -> None:
        add_handlers(server, service.full_name, checked_handlers(service, servicer, limits))

    return add


def add_handlers(server: grpc.aio.Server, name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Registers ``handlers`` (by method name) as the service ``name`` (a full name) of ``server``."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
