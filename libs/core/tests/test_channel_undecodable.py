"""An answer that does not decode as the method's response type, from a real server answering raw bytes:
grpc.aio hands the caller ``None`` with status OK for it; tauflow's asyncio channels (``create_channel``)
fail the call with INTERNAL naming the type instead, unary and streaming; ``OrderedStream`` fails its
waiters and drops the stream; the blocking channel raises INTERNAL by itself; ``tauflow status`` against
such a server prints a status error and exits non-zero."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.channel import create_channel, create_sync_channel
from tauflow.core.streams import OrderedStream

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
GARBAGE = b"\xff\xff"  # a varint cut short: no protobuf message decodes from it
STATS_TYPE = "tauflow.api.queue.v1.StatsResponse"


class Raw(grpc.GenericRpcHandler):
    """Every method, whatever its arity by name, answers ``answer`` as raw bytes (no serializer): unary
    methods once, ``.../PutStream`` and ``.../Deliver`` once per message, ``test.Raw/Watch`` twice,
    ``test.Raw/Upload`` once after reading every message."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.streams = 0

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return self.answer

        async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            self.streams += 1
            async for _ in requests:
                yield self.answer

        async def watch(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            for _ in range(2):
                yield self.answer

        async def upload(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            async for _ in requests:
                pass
            return self.answer

        if method.endswith(("/PutStream", "/Deliver")):
            return grpc.stream_stream_rpc_method_handler(bidi)
        if method == "/test.Raw/Watch":
            return grpc.unary_stream_rpc_method_handler(watch)
        if method == "/test.Raw/Upload":
            return grpc.stream_unary_rpc_method_handler(upload)
        return grpc.unary_unary_rpc_method_handler(unary)


async def _serve(handler: Raw) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _undecodable(e: BaseException, type_name: str = "") -> bool:
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.INTERNAL
        and e.details() == f"the answer did not decode as {type_name}"
        if type_name
        else isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.INTERNAL
        and "did not decode" in (e.details() or "")
    )


async def test_a_unary_answer_that_does_not_decode_is_internal_naming_the_type() -> None:
    server, address = await _serve(Raw(GARBAGE))
    channel = create_channel(address, [QUEUE])
    try:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Stats(queue_pb2.StatsRequest())
        assert _undecodable(caught.value, STATS_TYPE), caught.value
        call = stub.Stats(queue_pb2.StatsRequest())  # the call object says so too
        with pytest.raises(grpc.aio.AioRpcError):
            await call
        assert await call.code() == grpc.StatusCode.INTERNAL
    finally:
        await channel.close()
        await server.stop(0)


async def test_an_empty_answer_decodes_as_the_default_message_and_is_no_failure() -> None:
    server, address = await _serve(Raw(b""))
    channel = create_channel(address, [QUEUE])
    try:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        call = stub.Stats(queue_pb2.StatsRequest())
        answer = await call
        assert answer == queue_pb2.StatsResponse() and answer is not None
        assert await call.code() == grpc.StatusCode.OK
        good = queue_pb2.StatsResponse(trainer_version=7).SerializeToString()
        server2, address2 = await _serve(Raw(good))
        channel2 = create_channel(address2, [QUEUE])
        try:
            assert (
                await queue_pb2_grpc.QueueServiceStub(channel2).Stats(queue_pb2.StatsRequest())
            ).trainer_version == 7
        finally:
            await channel2.close()
            await server2.stop(0)
    finally:
        await channel.close()
        await server.stop(0)


async def test_streaming_answers_that_do_not_decode_are_internal() -> None:
    server, address = await _serve(Raw(GARBAGE))
    channel = create_channel(address, [QUEUE])
    decode = queue_pb2.StatsResponse.FromString
    try:
        watch = channel.unary_stream("/test.Raw/Watch", request_serializer=bytes, response_deserializer=decode)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in watch(b""):
                pass
        assert _undecodable(caught.value), caught.value
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await watch(b"").read()
        assert _undecodable(caught.value), caught.value

        upload = channel.stream_unary("/test.Raw/Upload", request_serializer=bytes, response_deserializer=decode)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await upload(iter([b"a", b"b"]))
        assert _undecodable(caught.value), caught.value

        stub = queue_pb2_grpc.QueueServiceStub(channel)  # a bidi call of the contract: the type is named
        call = stub.PutStream()
        await call.write(queue_pb2.PutStreamRequest())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert _undecodable(caught.value, "tauflow.api.queue.v1.PutStreamResponse"), caught.value
        call.cancel()
    finally:
        await channel.close()
        await server.stop(0)


async def _ordered_stream_fails_its_waiters(plain: bool) -> None:
    handler = Raw(GARBAGE)
    server, address = await _serve(handler)
    channel = grpc.aio.insecure_channel(address) if plain else create_channel(address, [QUEUE])
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    stream = OrderedStream(lambda lifetime_s: stub.PutStream(timeout=lifetime_s))
    try:
        results = await asyncio.gather(
            *(stream.request(queue_pb2.PutStreamRequest(), 5) for _ in range(3)), return_exceptions=True
        )
        for result in results:  # none of them got None
            assert isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.INTERNAL, result
            assert "did not decode" in (result.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the stream was dropped: the next opens a new one
            await stream.request(queue_pb2.PutStreamRequest(), 5)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert handler.streams == 2
    finally:
        await stream.close()
        await channel.close()
        await server.stop(0)


async def test_ordered_stream_over_a_tauflow_channel_fails_its_waiters_with_internal() -> None:
    await _ordered_stream_fails_its_waiters(plain=False)


async def test_ordered_stream_over_a_plain_channel_fails_its_waiters_with_internal() -> None:
    await _ordered_stream_fails_its_waiters(plain=True)  # grpc.aio's None reaches _Stream._read itself


async def test_the_blocking_channel_raises_internal_by_itself() -> None:
    server, address = await _serve(Raw(GARBAGE))
    channel = create_sync_channel(address, [QUEUE])
    try:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            await asyncio.to_thread(stub.Stats, queue_pb2.StatsRequest())
        assert caught.value.code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
    finally:
        channel.close()
        await server.stop(0)


async def test_tauflow_status_against_a_server_answering_garbage_prints_a_status_error() -> None:
    pytest.importorskip("tauflow.controller.cli")
    server, address = await _serve(Raw(GARBAGE))
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tauflow.controller.cli",
            "status",
            address,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300"},
        )
        async with asyncio.timeout(120):
            out, err = await proc.communicate()
        text = (out + err).decode()
        assert proc.returncode == 1, text
        assert "Traceback" not in text and "AttributeError" not in text, text
        assert "tauflow status: INTERNAL: the answer did not decode as tauflow.api.controller.v1." in text, text
    finally:
        await server.stop(0)
