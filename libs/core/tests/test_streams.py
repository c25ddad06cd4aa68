"""OrderedStream against a real gRPC server: concurrent callers get their own answers, a failed stream fails
exactly the callers waiting on it, a silent one times out, and the next call opens a new stream."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from tauflow.core.streams import OrderedStream

_METHOD = "/test.Pipe/Echo"


class Pipe:
    """Answers each message with itself, in order; b"die" aborts the stream, b"mute" is never answered."""

    def __init__(self) -> None:
        self.streams = 0
        self.finished_ok = 0

    async def echo(self, requests, context):
        self.streams += 1
        async for message in requests:
            if message == b"die":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            if message == b"mute":
                await asyncio.sleep(3600)
            await asyncio.sleep(0.01 * (message[-1] % 3))  # answers take different times, and stay in order
            yield message
        self.finished_ok += 1


async def _serve(pipe: Pipe) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(pipe.echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Pipe", {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _client(address: str, lifetime_s: float = 600.0) -> tuple[grpc.aio.Channel, OrderedStream]:
    channel = grpc.aio.insecure_channel(address)
    call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)
    return channel, OrderedStream(lambda lifetime: call(timeout=lifetime), lifetime_s)


def test_concurrent_callers_share_one_stream_and_each_gets_its_own_answer() -> None:
    async def scenario() -> None:
        pipe = Pipe()
        server, address = await _serve(pipe)
        channel, stream = _client(address)
        try:
            messages = [f"m{i}".encode() for i in range(40)]
            answers = await asyncio.gather(*(stream.request(m, 10) for m in messages))
            assert answers == messages
            assert pipe.streams == 1
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_failed_stream_fails_its_waiters_and_the_next_request_opens_a_new_one() -> None:
    async def scenario() -> None:
        pipe = Pipe()
        server, address = await _serve(pipe)
        channel, stream = _client(address)
        try:
            assert await stream.request(b"a0", 10) == b"a0"
            results = await asyncio.gather(
                stream.request(b"a1", 10), stream.request(b"die", 10), stream.request(b"a2", 10), return_exceptions=True
            )
            assert results[0] == b"a1"  # answered before the stream broke
            for failed in results[1:]:
                assert isinstance(failed, grpc.aio.AioRpcError) and failed.code() == grpc.StatusCode.UNAVAILABLE
            assert await stream.request(b"a3", 10) == b"a3"
            assert pipe.streams == 2

            with pytest.raises(grpc.aio.AioRpcError) as err:  # no answer: the deadline, then a new stream
                await stream.request(b"mute", 0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await stream.request(b"a4", 10) == b"a4"
            assert pipe.streams == 3
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_stream_is_renewed_before_its_deadline_and_the_old_one_ends_cleanly() -> None:
    async def scenario() -> None:
        pipe = Pipe()
        server, address = await _serve(pipe)
        channel, stream = _client(address, lifetime_s=0.6)
        try:
            for i in range(4):  # each past half the lifetime of the stream before it
                assert await stream.request(f"r{i}".encode(), 10) == f"r{i}".encode()
                await asyncio.sleep(0.35)
            assert pipe.streams == 4
            assert pipe.finished_ok == 3  # the retired streams were closed for writing, not cut off
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_close_ends_the_retired_streams_too_and_leaves_no_task_pending() -> None:
    """A retired stream still waiting for an answer was left to the loop's end ("Task was destroyed but it
    is pending") and its caller waited on it until its own deadline."""

    async def scenario() -> None:
        pipe = Pipe()
        server, address = await _serve(pipe)
        channel, stream = _client(address, lifetime_s=0.6)
        try:
            unanswered = asyncio.ensure_future(stream.request(b"mute", 3600))
            await asyncio.sleep(0.35)  # past half the first stream's lifetime: the next request retires it
            assert await stream.request(b"r1", 10) == b"r1"
            assert pipe.streams == 2 and not unanswered.done()

            def readers() -> list[asyncio.Task]:  # (all_tasks: the tasks not done; the server's run on)
                return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "_Stream._read"]

            assert len(readers()) == 2  # the retired stream's and the current one's
            await stream.close()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(unanswered, 5)
            assert ended.value.code() == grpc.StatusCode.CANCELLED
            await asyncio.sleep(0)
            assert readers() == []
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


class _PassThrough(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(details, request_iterator)


def test_a_stream_whose_server_is_gone_leaves_no_task_pending() -> None:
    """Through an interceptor (every tauflow channel has them) a call's writes go through a task of grpc.aio's
    own; a server killed mid-stream left that task waiting for ever, logged when collected as "Task was
    destroyed but it is pending" and "aclose(): asynchronous generator is already running"."""

    async def scenario() -> None:
        server, address = await _serve(Pipe())
        channel = grpc.aio.insecure_channel(address, interceptors=[_PassThrough()])
        call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)
        stream = OrderedStream(lambda lifetime: call(timeout=lifetime))

        try:
            assert await stream.request(b"a0", 10) == b"a0"
            assert len(_writers()) == 1
            waiting = asyncio.ensure_future(stream.request(b"mute", 3600))
            await asyncio.sleep(0.1)
            await server.stop(None)  # gone, as a killed server is: no half-close, no status of its own
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(waiting, 10)
            for _ in range(50):  # (the reader ends the write side once it has failed the waiters)
                if not _writers():
                    break
                await asyncio.sleep(0.02)
            assert _writers() == []
        finally:
            await stream.close()
            await channel.close()

    asyncio.run(scenario())


def _writers() -> list[asyncio.Task]:
    """grpc.aio's writer tasks of intercepted stream calls still alive."""
    return [t for t in asyncio.all_tasks() if "_consume_request_iterator" in repr(t.get_coro())]


class _Wrapping(grpc.aio.StreamStreamClientInterceptor):
    """An interceptor that wraps the answers (as OpenTelemetry's does): grpc.aio puts its call one level down."""

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        call = await continuation(details, request_iterator)

        async def answers():
            async for answer in call:
                yield answer

        return answers()


@pytest.mark.parametrize("interceptor", [_PassThrough, _Wrapping])
def test_a_stream_to_a_server_that_is_down_leaves_no_task_pending(interceptor) -> None:
    """A call that fails before its headers go out (nothing listens) left grpc.aio's writer task waiting for
    them for ever (its trainer's queue client, with the queue stopped, logged it as destroyed but pending)."""

    async def scenario() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        channel = grpc.aio.insecure_channel(address, interceptors=[interceptor()])
        call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)
        stream = OrderedStream(lambda lifetime: call(timeout=lifetime))

        try:
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stream.request(b"a", 5)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            for _ in range(50):
                if not _writers():
                    break
                await asyncio.sleep(0.02)
            assert _writers() == []
        finally:
            await stream.close()
            await channel.close()

    asyncio.run(scenario())


class _FakeCall:
    """A call whose first write may hang (as grpc.aio's does until the call's metadata is sent) and that
    answers each message that really went out with itself."""

    def __init__(self, hang_first_write: bool) -> None:
        self.sent: asyncio.Queue[bytes] = asyncio.Queue()
        self.hang = hang_first_write
        self.cancelled = False

    async def write(self, message: bytes) -> None:
        if self.hang:
            self.hang = False
            await asyncio.sleep(3600)
        await self.sent.put(message)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        return await self.sent.get()

    def cancel(self) -> None:
        self.cancelled = True

    async def done_writing(self) -> None:
        pass


def test_a_caller_cancelled_mid_write_never_shifts_the_answers_of_the_others() -> None:
    async def scenario() -> None:
        calls: list[_FakeCall] = []

        def open_call(lifetime_s: float) -> _FakeCall:
            calls.append(_FakeCall(hang_first_write=not calls))
            return calls[-1]

        stream = OrderedStream(open_call)
        first = asyncio.create_task(stream.request(b"A", 10))
        await asyncio.sleep(0.05)
        first.cancel()  # while its write hangs: the message may or may not have gone out
        with pytest.raises(asyncio.CancelledError):
            await first
        answers = await asyncio.gather(stream.request(b"B", 5), stream.request(b"C", 5))
        assert answers == [b"B", b"C"]  # each its own answer, on a new stream
        assert len(calls) == 2 and calls[0].cancelled
        await stream.close()

    asyncio.run(scenario())


class _FailedSendCall(_FakeCall):
    """A call whose write failed in gRPC core as its server ended the stream (a queue draining): the call's
    status is then INTERNAL "Internal error from Core", no answer of the server's."""

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0.01)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Internal error from Core",
            'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object>,)',
        )


def test_a_write_that_failed_as_the_server_ended_the_stream_is_worth_retrying() -> None:
    """The trainer exited on it (INTERNAL is not retried) when its queue drained mid-Deliver."""

    async def scenario() -> None:
        stream = OrderedStream(lambda lifetime_s: _FailedSendCall(hang_first_write=False))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stream.request(b"A", 5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        await stream.close()

    asyncio.run(scenario())
