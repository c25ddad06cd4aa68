"""GetStatus's last_error says which peer call the trainer is retrying: cut off from its queue it said
"TRAINING", and the controller's stall report hid the partition."""

from __future__ import annotations

import grpc
import pytest
from tenacity import RetryCallState

from tauflow.core.streams import rpc_error
from tauflow.trainer.adapters import retry


def test_a_retried_call_is_the_last_error_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(retry, "_last_failure", (-retry.RECENT_S, ""))
    assert retry.recent_failure() == ""
    state = RetryCallState(None, None, (), {})
    state.set_exception((grpc.aio.AioRpcError, rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), None))
    retry.log_retry(state)
    assert retry.recent_failure() == "retrying a peer call that failed: DEADLINE_EXCEEDED: Deadline Exceeded"
    clock[0] += retry.RECENT_S
    assert retry.recent_failure() == ""  # the calls work again (or nobody retries): nothing to say
