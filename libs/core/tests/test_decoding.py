"""The decode and bound checks of ``tauflow.core.decoding`` in front of streaming handlers of either style
(async generators, and coroutines that write with ``context.write``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tauflow.core.decoding import (
    checked_deserializer,
    checked_handlers,
    refusing_undecodable_requests,
    refusing_undecodable_stream,
)

Request = health_pb2.HealthCheckRequest
LIMITS = {"service": 8}
parse = checked_deserializer(Request)


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.written: list[Any] = []
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted

    async def write(self, message: Any) -> None:
        self.written.append(message)


async def _requests(*raws: bytes) -> AsyncIterator[Any]:
    for raw in raws:
        yield parse(raw)


async def gen_stream(request, context):
    yield request.service
    yield request.service


async def write_stream(request, context):
    await context.write(request.service)


async def gen_requests(requests, context):
    async for request in requests:
        yield request.service


async def write_requests(requests, context):
    async for request in requests:
        await context.write(request.service)


async def unary_requests(requests, context):
    return [r.service async for r in requests]


@pytest.mark.parametrize("behaviour", [gen_stream, write_stream])
async def test_a_server_streaming_handler_of_either_style_is_checked_before_it_runs(behaviour) -> None:
    handler = refusing_undecodable_stream(behaviour, LIMITS)
    good, bad, long = parse(Request(service="ok").SerializeToString()), parse(b"\xff"), Request(service="x" * 9)

    async def run(request: Any) -> tuple[list[Any], Context]:
        context = Context()
        if behaviour is gen_stream:
            return [a async for a in handler(request, context)], context
        await handler(request, context)
        return context.written, context

    answers, _ = await run(good)
    assert answers == (["ok", "ok"] if behaviour is gen_stream else ["ok"])
    for request, words in ((bad, "does not decode as grpc.health.v1.HealthCheckRequest"), (long, "service is 9")):
        with pytest.raises(Aborted):
            await run(request)
        context = Context()
        with pytest.raises(Aborted):
            if behaviour is gen_stream:
                [a async for a in handler(request, context)]
            else:
                await handler(request, context)
        assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert words in context.aborted[1] and not context.written


@pytest.mark.parametrize("behaviour", [gen_requests, write_requests, unary_requests])
async def test_a_stream_of_requests_ends_at_its_first_bad_request(behaviour) -> None:
    handler = refusing_undecodable_requests(behaviour, LIMITS)
    good = Request(service="a").SerializeToString()
    for bad in (b"\xff", Request(service="x" * 9).SerializeToString()):
        context = Context()
        with pytest.raises(Aborted):
            if behaviour is gen_requests:
                [a async for a in handler(_requests(good, bad, good), context)]
            else:
                await handler(_requests(good, bad, good), context)
        assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert context.written == (["a"] if behaviour is write_requests else [])
    context = Context()
    if behaviour is gen_requests:
        assert [a async for a in handler(_requests(good, good), context)] == ["a", "a"]
    elif behaviour is write_requests:
        await handler(_requests(good, good), context)
        assert context.written == ["a", "a"]
    else:
        assert await handler(_requests(good, good), context) == ["a", "a"]


def test_checked_handlers_cover_every_method_kind() -> None:
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]

    class Servicer:
        async def Check(self, request, context):
            return health_pb2.HealthCheckResponse()

        async def Watch(self, request, context):
            yield health_pb2.HealthCheckResponse()

        async def List(self, request, context):
            return health_pb2.HealthListResponse()

    handlers = checked_handlers(health, Servicer())
    assert handlers["Check"].unary_unary is not None and handlers["Watch"].unary_stream is not None
    assert handlers["Watch"].request_deserializer(b"\xff").message == "grpc.health.v1.HealthCheckRequest"
