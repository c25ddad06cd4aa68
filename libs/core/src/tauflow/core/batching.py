"""Requests made together, sent as one call: a client's per-item calls (one put per group) coalesced into
batch calls (one PutBatch per burst), so that a burst pays one call's fixed cost instead of one per item.

Each caller awaits its own answer, as if it had made its own call: ``await batcher.request(item)``. The
items requested in one turn of the event loop (e.g. by the coroutines of one ``asyncio.gather``) go out
together on the next turn, in the order requested, in batches of at most ``max_items`` items and
``max_bytes`` bytes. A batch call that fails fails each of its callers with its error (each retries as it
would have retried its own call); a caller cancelled meanwhile leaves its item in the batch, and its answer
is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

A = TypeVar("A")


class CallBatcher(Generic[A]):
    def __init__(
        self, send: Callable[[list[bytes]], Awaitable[Sequence[A]]], *, max_items: int, max_bytes: int
    ) -> None:
        """``send(items)`` makes one batch call and returns one answer per item, in order."""
        if max_items < 1 or max_bytes < 1:
            raise ValueError("max_items and max_bytes must be positive")
        self._send = send
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._pending: list[tuple[bytes, asyncio.Future[A]]] = []
        self._pending_bytes = 0
        self._flush_scheduled = False
        self._calls: set[asyncio.Task[None]] = set()
        self._closed = False

    async def request(self, item: bytes) -> A:
        """The answer to ``item`` (an item over ``max_bytes`` goes alone)."""
        if self._closed:
            raise BatcherClosed("the client is closed")
        loop = asyncio.get_running_loop()
        if self._pending and (len(self._pending) >= self.max_items or self._pending_bytes + len(item) > self.max_bytes):
            self._flush()  # the batch is full: it goes now, this item starts the next
        answer: asyncio.Future[A] = loop.create_future()
        self._pending.append((item, answer))
        self._pending_bytes += len(item)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._next_turn)
        return await answer

    def _next_turn(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def _flush(self) -> None:
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        if not batch:
            return
        call = asyncio.get_running_loop().create_task(self._call(batch))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[tuple[bytes, asyncio.Future[A]]]) -> None:
        try:
            answers = await self._send([item for item, _ in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} items was answered with {len(answers)} answers")
        except Exception as e:  # noqa: BLE001 - each caller gets the call's error
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(e)
            return
        except BaseException:  # the batcher closes: its callers learn it (they were not cancelled)
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(BatcherClosed("the client closed while the call was in flight"))
            raise
        for (_, answer), value in zip(batch, answers, strict=True):
            if not answer.done():  # (a caller cancelled meanwhile)
                answer.set_result(value)

    async def close(self) -> None:
        """Refuses new requests and ends the calls in flight; their callers, and those whose batch had not
        gone out yet, get BatcherClosed."""
        self._closed = True
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        for _, answer in batch:
            if not answer.done():
                answer.set_exception(BatcherClosed("the client closed before the call went out"))
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)


class BatcherClosed(RuntimeError):
    """The batcher was closed: no call was or will be made for the request (not worth retrying)."""
