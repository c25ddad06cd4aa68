"""A long-lived bidirectional call used as a pipe of unary calls: the server answers every message with
exactly one message, in the order received (queue.v1's PutStream and Deliver). Concurrent callers share
one stream as if each made its own call, without paying a call's setup (a new HTTP/2 stream, its flow-
control window starting small, metadata, interceptors) per message.

A stream ends: its deadline, a broken connection, a restarted server. Every caller still waiting on it
then gets the stream's ``grpc.aio.AioRpcError`` (which the caller's retry policy judges as it would a
unary call's), and the next request opens a new stream. Streams are renewed before their deadline: after
half their lifetime new requests go to a fresh stream, and the old one is closed for writing, so the
server finishes it once it has answered what it holds.

Deadlines are ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns the result
of an awaitable that completes as its caller is cancelled, and the cancellation is lost (fixed in 3.12);
a loop that relies on being cancelled then runs on. tauflow uses ``asyncio.timeout`` everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

OpenCall = Callable[[float], Any]  # lifetime (s) -> a grpc.aio.StreamStreamCall


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.AioRpcError:
    """An AioRpcError made here (an answer that carries a status, or a stream that stopped answering), so
    that callers handle it exactly as a failed unary call."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class _Stream:
    def __init__(self, call: Any) -> None:
        self.call = call
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.opened = time.monotonic()
        self.failed: BaseException | None = None
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error: BaseException
        closed = False
        try:
            async for answer in self.call:
                if answer is None:  # grpc.aio's undecodable answer (tauflow.core.channel's channels raise instead)
                    raise rpc_error(grpc.StatusCode.INTERNAL, "the stream's answer did not decode")
                if not self.pending:  # an answer nobody asked for: the server broke the one-for-one rule
                    raise rpc_error(grpc.StatusCode.INTERNAL, "the stream answered a message that was never sent")
                waiter = self.pending.popleft()
                if not waiter.done():
                    waiter.set_result(answer)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the stream ended before answering every message")
        except grpc.aio.AioRpcError as e:
            # A write on a stream its server had just ended (a queue draining) fails in gRPC core, which sets
            # the call's status to INTERNAL "Internal error from Core": no answer of the server's, and the
            # message was not taken, so it is as worth retrying as a stream that ended.
            failed_send = e.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (e.debug_error_string() or "")
            error = _ended() if failed_send else e
        except asyncio.CancelledError:
            error, closed = rpc_error(grpc.StatusCode.CANCELLED, "the stream was closed"), True
        except Exception as e:  # noqa: BLE001 - e.g. an answer that does not decode: fail the waiters with it
            error = rpc_error(grpc.StatusCode.INTERNAL, f"the stream failed: {type(e).__name__}")
        self.fail(error)
        if not closed:  # (close() cancelled the call, and with it that task)
            # A call through interceptors takes its writes from an iterator of grpc.aio's own, whose task
            # waits for ever on a call that ended without a half-close (a server gone); cancelling an ended
            # call does not stop it, half-closing does. Left pending, it was logged as "Task was destroyed but
            # it is pending" and "aclose(): asynchronous generator is already running" when collected.
            self.call.cancel()  # (a call still open here broke the one-for-one rule: it is given up)
            with contextlib.suppress(Exception):
                await self.call.done_writing()
        _stop_writer(self.call)

    def fail(self, error: BaseException) -> None:
        self.failed = self.failed or error
        while self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_exception(self.failed)
                waiter.add_done_callback(_retrieved)  # (a caller that gave up never reads it)

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        _stop_writer(self.call)


def _stop_writer(call: Any) -> None:
    """Cancels grpc.aio's own writer task of an intercepted call (see _Stream._read) where it still waits:
    one whose call failed before its headers went out (a server down) waits for them for ever, and neither
    cancelling the ended call nor half-closing it reaches that task. Through grpc.aio's private attributes
    (the interceptors' task, a wrapping response iterator's call), so anything unexpected is left as it is."""
    with contextlib.suppress(Exception):
        for _ in range(8):  # (one level per interceptor that wraps the call)
            writer = getattr(call, "_async_request_poller", None)
            if writer is not None:
                if not writer.done():
                    writer.cancel()
                return
            task = getattr(call, "_interceptors_task", None)
            if task is not None:
                if not task.done():
                    return
                call = task.result()
            else:
                call = call._call


class OrderedStream:
    """Requests on one shared bidirectional call; ``open_call(lifetime_s)`` starts a new one (with that
    deadline)."""

    def __init__(self, open_call: OpenCall, lifetime_s: float = 600.0) -> None:
        self.open_call = open_call
        self.lifetime_s = lifetime_s
        self._stream: _Stream | None = None
        self._lock = asyncio.Lock()  # the order of writes is the order of answers
        self._retiring: set[asyncio.Future[None]] = set()
        # Every stream whose reader still runs, the retired ones included: held here so that no reader is
        # collected while it waits (asyncio keeps only weak references to tasks), and closed by ``close``, so
        # that none is left pending when the loop ends ("Task was destroyed but it is pending").
        self._open: set[_Stream] = set()

    def _current(self) -> _Stream:
        stream = self._stream
        if stream is not None and stream.failed is None and stream.reader.done() is False:
            if time.monotonic() - stream.opened < self.lifetime_s / 2:
                return stream
            self._retire(stream)
        self._stream = fresh = _Stream(self.open_call(self.lifetime_s))
        self._open.add(fresh)
        fresh.reader.add_done_callback(lambda _: self._open.discard(fresh))
        return fresh

    def _retire(self, stream: _Stream) -> None:
        async def finish() -> None:  # the server ends the stream once it has answered everything sent
            with contextlib.suppress(Exception):
                await stream.call.done_writing()

        task = asyncio.ensure_future(finish())
        self._retiring.add(task)  # (a task only the loop refers to may be collected before it runs)
        task.add_done_callback(self._retiring.discard)

    async def request(self, message: Any, timeout_s: float) -> Any:
        """Sends ``message`` and returns its answer; raises grpc.aio.AioRpcError as a unary call would
        (DEADLINE_EXCEEDED when no answer came within ``timeout_s``: that stream is then given up)."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            stream = self._current()
            answer: asyncio.Future[Any] = loop.create_future()
            stream.pending.append(answer)
            try:  # (a server that stops reading holds the write back: it too has the deadline)
                async with asyncio.timeout(timeout_s):  # (not wait_for: see the module's docstring)
                    await stream.call.write(message)
            except TimeoutError:
                stream.fail(
                    rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"the stream took no message in {timeout_s:.3g} s")
                )
                stream.close()
            except Exception as e:  # noqa: BLE001 - AioRpcError, or InvalidStateError once the call is over
                stream.fail(e if isinstance(e, grpc.aio.AioRpcError) else _ended())
                stream.close()
            except BaseException:  # cancelled mid-write: whether the message went out is unknown, so every
                # later answer could land on the wrong caller. The stream is given up instead.
                stream.fail(rpc_error(grpc.StatusCode.CANCELLED, "a write on the stream was cancelled"))
                stream.close()
                if self._stream is stream:
                    self._stream = None
                raise
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(answer)
        except TimeoutError:
            stream.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer on the stream in {timeout_s:.3g} s"))
            stream.close()  # what it still holds is answered on no stream: the callers retry or expire it
            if self._stream is stream:
                self._stream = None
            return await answer  # (raises the error just set, or the answer that raced it)

    async def close(self) -> None:
        """Closes every stream, the retired ones still answering too, and waits for their readers."""
        streams, self._stream = list(self._open), None
        for stream in streams:
            stream.close()
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*(s.reader for s in streams), *self._retiring, return_exceptions=True)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _ended() -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, "the stream ended before the message could be sent")
