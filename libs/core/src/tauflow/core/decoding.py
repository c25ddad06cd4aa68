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


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes did not parse as ``message`` (a full name); ``reason`` is protobuf's."""

    message: str
    reason: str


def checked_deserializer(message_class: Any) -> Callable[[bytes], Any]:
    """``message_class.FromString`` that returns an :class:`Undecodable` instead of raising."""

    def parse(raw: bytes) -> Any:
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
            request_deserializer=checked_deserializer(message_factory.GetMessageClass(m.input_type)),
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
