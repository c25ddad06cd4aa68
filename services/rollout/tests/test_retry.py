"""The rollout's retries: an idempotent call is tried again while the peer is unavailable, full or slow,
never for an error no retry can cure, and the first attempt costs no retry bookkeeping."""

from __future__ import annotations

import grpc
import pytest

from tauflow.core.streams import rpc_error
from tauflow.rollout.adapters import retry
from tauflow.rollout.adapters.retry import call_until_it_works


class Flaky:
    def __init__(self, *errors: grpc.StatusCode) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise rpc_error(self.errors.pop(0), "no")
        return "ok"


@pytest.fixture(autouse=True)
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "FIRST_WAIT_S", 0.0)
    monkeypatch.setattr(retry, "wait_exponential", lambda *a, **kw: lambda state: 0.0)


async def test_a_transient_error_is_retried_until_the_call_works() -> None:
    call = Flaky(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert await call_until_it_works(call) == "ok"
    assert call.calls == 4


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION])
async def test_an_error_no_retry_cures_is_raised_at_once(code: grpc.StatusCode) -> None:
    call = Flaky(code)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_until_it_works(call)
    assert e.value.code() == code and call.calls == 1


async def test_a_message_over_the_limit_is_never_retried_after_any_attempt() -> None:
    class TooLarge(Flaky):
        async def __call__(self) -> str:
            self.calls += 1
            if self.calls == 1:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")

    call = TooLarge()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_until_it_works(call)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and call.calls == 2


async def test_a_peer_not_there_is_logged_at_most_every_30_s_and_a_full_queue_not_at_all(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a rollout cut off from its queue or reward for a minute wrote nothing to its log
    monkeypatch.setattr(retry, "_unreachable", retry.LogLimit(30.0))
    with caplog.at_level("WARNING", logger=retry.__name__):
        await call_until_it_works(Flaky(*[grpc.StatusCode.RESOURCE_EXHAUSTED] * 3))
        assert not caplog.records
        await call_until_it_works(Flaky(*[grpc.StatusCode.DEADLINE_EXCEEDED] * 4, grpc.StatusCode.UNAVAILABLE))
    assert len(caplog.records) == 1
    assert "peer call failed (DEADLINE_EXCEEDED: no); retrying" in caplog.records[0].getMessage()
