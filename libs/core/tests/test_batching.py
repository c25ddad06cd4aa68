"""CallBatcher: the requests of one turn go out as one call, each caller gets its own answer or the call's
error, and batches keep to their item and byte bounds."""

from __future__ import annotations

import asyncio

import pytest

from tauflow.core.batching import BatcherClosed, CallBatcher


class Recorder:
    def __init__(self, fail: Exception | None = None, delay_s: float = 0.0) -> None:
        self.calls: list[list[bytes]] = []
        self.fail = fail
        self.delay_s = delay_s

    async def __call__(self, items: list[bytes]) -> list[bytes]:
        self.calls.append(items)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [item.upper() for item in items]


async def test_the_requests_of_one_turn_go_out_as_one_call_in_order_each_with_its_answer() -> None:
    send = Recorder()
    batcher = CallBatcher(send, max_items=100, max_bytes=1000)
    answers = await asyncio.gather(*(batcher.request(f"g{i}".encode()) for i in range(16)))
    assert answers == [f"G{i}".encode() for i in range(16)]
    assert send.calls == [[f"g{i}".encode() for i in range(16)]]
    assert await batcher.request(b"late") == b"LATE" and send.calls[-1] == [b"late"]  # a later turn: a new call


async def test_batches_keep_to_their_bounds_and_an_item_over_the_byte_bound_goes_alone() -> None:
    send = Recorder()
    batcher = CallBatcher(send, max_items=3, max_bytes=10)
    items = [b"aaaa", b"bbbb", b"cc", b"dd", b"e" * 12, b"f", b"g"]
    assert await asyncio.gather(*(batcher.request(i) for i in items)) == [i.upper() for i in items]
    assert send.calls == [[b"aaaa", b"bbbb", b"cc"], [b"dd"], [b"e" * 12], [b"f", b"g"]]
    assert all(len(c) <= 3 for c in send.calls)


async def test_a_failed_call_fails_each_of_its_callers_and_a_cancelled_caller_leaves_the_rest_alone() -> None:
    batcher = CallBatcher(Recorder(fail=ValueError("down")), max_items=10, max_bytes=100)
    results = await asyncio.gather(*(batcher.request(b"x") for _ in range(3)), return_exceptions=True)
    assert [type(r) for r in results] == [ValueError] * 3

    send = Recorder(delay_s=0.05)
    batcher = CallBatcher(send, max_items=10, max_bytes=100)
    first = asyncio.ensure_future(batcher.request(b"a"))
    second = asyncio.ensure_future(batcher.request(b"b"))
    await asyncio.sleep(0.01)
    first.cancel()
    assert await second == b"B"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert send.calls == [[b"a", b"b"]]


async def test_closing_fails_the_callers_in_flight_and_refuses_new_requests() -> None:
    batcher = CallBatcher(Recorder(delay_s=10), max_items=10, max_bytes=100)
    waiting = asyncio.ensure_future(batcher.request(b"a"))
    await asyncio.sleep(0.01)
    await batcher.close()
    with pytest.raises(BatcherClosed):  # a failure the caller sees, not a cancellation it never asked for
        await waiting
    with pytest.raises(BatcherClosed):
        await batcher.request(b"b")
