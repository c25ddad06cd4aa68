"""Rollout, reward and queue as processes: the rollout loop fills the queue with scored groups, gives its unfilled
tickets back when it stops, and tells a group that never fits from a full queue."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.config import ChannelConfig
from tauflow.core.testing import queue_stub
from tauflow.rollout.adapters.queue_client import GrpcQueue
from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion, FinishReason
from tauflow.rollout.ports import GroupRejected, ProducedGroup

ADDITION = Path(__file__).resolve().parents[2] / "examples" / "addition"
sys.path.insert(0, str(ADDITION))
import task


def test_rollout_loop_reserves_generates_scores_and_puts(service_process, tmp_path) -> None:
    model = tmp_path / "model"
    task.build_model(model, hidden=32, layers=1, heads=2)
    task.build_tokenizer(model)
    train, _ = task.problems()
    task.write_jsonl(tmp_path / "train.jsonl", train[:50])

    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": 0, "groups_per_step": 4})
    reward = service_process("reward", {"pool.workers": 1})
    service_process(
        "rollout",
        {
            "model_path": model,
            "dataset": tmp_path / "train.jsonl",
            "group_size": 3,
            "groups_per_ticket": 2,
            "sampling.max_new_tokens": task.MAX_NEW_TOKENS,
            "queue_address": queue.address,
            "reward_address": reward.address,
        },
    )
    stub = queue_stub(queue.address)
    resp = stub.Get(q.GetRequest(consumer_id="t", max_groups=4, min_groups=4, wait=Duration(seconds=60)), timeout=90)
    assert len(resp.groups) == 4
    for delivered in resp.groups:
        group = delivered.group
        a, b = (int(x) for x in group.prompt_id.split("+"))
        assert group.metadata["answer"] == str(a + b)
        assert len(group.samples) == 3 and delivered.staleness == 0
        for s in group.samples:
            assert list(s.prompt_token_ids) == task.prompt_ids(a, b)
            n = len(s.completion_token_ids)
            assert 1 <= n <= task.MAX_NEW_TOKENS
            assert len(s.behaviour_logprobs) == n and all(lp <= 0 for lp in s.behaviour_logprobs)
            assert list(s.token_versions) == [0] * n
            want = task.answer_ids(a, b)
            assert s.reward.score == (1.0 if list(s.completion_token_ids)[: len(want)] == want else 0.0)
            assert s.reward.status == 1  # REWARD_STATUS_OK: scored by exact_match against the answer
    # tau = 0: with the trainer still at version 0, the producer may not run ahead of one step.
    stats = stub.Stats(q.StatsRequest())
    assert stats.accepted_groups + stats.reserved_groups <= 4


def test_a_stopped_rollout_releases_its_unfilled_tickets(service_process, tmp_path) -> None:
    model = tmp_path / "model"
    task.build_model(model, hidden=32, layers=1, heads=2)
    task.build_tokenizer(model)
    train, _ = task.problems()
    task.write_jsonl(tmp_path / "train.jsonl", train[:20])
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": 0, "groups_per_step": 4})
    stub = queue_stub(queue.address)
    # Tickets will ask for version 1; the server serves 0 and has no sidecar: it holds them, unfilled.
    stub.SetTrainerVersion(q.SetTrainerVersionRequest(policy_version=1))
    rollout = service_process(
        "rollout",
        {
            "model_path": model,
            "dataset": tmp_path / "train.jsonl",
            "group_size": 2,
            "groups_per_ticket": 2,
            "queue_address": queue.address,
        },
    )
    deadline = time.monotonic() + 60
    while stub.Stats(q.StatsRequest()).reserved_groups < 4:  # two tickets in flight
        assert time.monotonic() < deadline, rollout.log_text()
        time.sleep(0.1)
    assert rollout.kill(signal.SIGTERM) == 0
    # released on the way out, not after the queue's reservation TTL (600 s)
    assert stub.Stats(q.StatsRequest()).reserved_groups == 0, rollout.log_text()


def _produced(group_id: str, tokens: int) -> ProducedGroup:
    completion = Completion(list(range(4, 4 + tokens)), [-0.5] * tokens, [0] * tokens, FinishReason.LENGTH)
    return ProducedGroup(
        group_id, Prompt(group_id, [1, 2, 3]), [completion], [""], producer_id="r0", created_at=time.time()
    )


class CountingPuts:
    """Wraps the queue client's one put attempt (in a batch, on the stream, or unary), counting the attempts."""

    def __init__(self, client: GrpcQueue) -> None:
        self.attempt = client._put_once
        self.puts = 0
        client._put_once = self  # type: ignore[method-assign]

    async def __call__(self, *args):
        self.puts += 1
        return await self.attempt(*args)


async def eventually(predicate, timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("batching", "streaming"), [(True, True), (False, True), (False, False)], ids=["PutBatch", "PutStream", "unary Put"]
)
def test_put_gives_up_on_a_group_that_never_fits_and_waits_out_a_full_queue(
    service_process, batching: bool, streaming: bool
) -> None:
    queue = service_process(
        "queue", {"wal.dir": "wal", "max_staleness": -1, "capacity_groups": 1, "max_group_bytes": 4000}
    )
    stub = queue_stub(queue.address)

    async def scenario() -> None:
        client = GrpcQueue(queue.address, "r0", ChannelConfig(default_timeout_s=10))
        client.batching = batching  # (False: as against a queue older than queue.v1 revision 5)
        client.streaming = streaming  # (False: as against a queue older than queue.v1 revision 4)
        stub_calls = CountingPuts(client)
        try:
            started = time.monotonic()
            with pytest.raises(GroupRejected) as rejected:  # not retried like a full queue
                await asyncio.wait_for(client.put(_produced("long", 2000), ""), 10)
            assert rejected.value.reason == "too_large" and time.monotonic() - started < 3
            # refused for good otherwise (here an id the queue does not store): dropped too, not raised, which
            # ended the rollout service restart after restart (a reward beyond the queue's bound did so)
            with pytest.raises(GroupRejected) as rejected:
                await asyncio.wait_for(client.put(_produced("bad\x1bid", 8), ""), 10)
            assert rejected.value.reason == "invalid" and "control character" in str(rejected.value)
            await client.put(_produced("first", 8), "")
            before = stub_calls.puts
            second = asyncio.create_task(client.put(_produced("second", 8), ""))  # the queue is full
            await eventually(lambda: stub_calls.puts >= before + 3)  # refused, and retried twice
            assert not second.done()  # retried, never dropped
            got = await asyncio.to_thread(stub.Get, q.GetRequest(consumer_id="t", max_groups=1))
            await asyncio.to_thread(stub.Ack, q.AckRequest(lease_id=got.lease.lease_id))
            await asyncio.wait_for(second, 15)
        finally:
            await client.close()

    asyncio.run(scenario())
    assert stub.Stats(q.StatsRequest()).depth_groups == 1
