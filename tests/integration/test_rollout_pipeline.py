"""Rollout, reward and queue as three processes: the rollout loop fills the queue with scored groups."""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from tauflow.api.queue.v1 import queue_pb2 as q
from tests.conftest import queue_stub

ADDITION = Path(__file__).resolve().parents[2] / "examples" / "addition"
sys.path.insert(0, str(ADDITION))
import task  # noqa: E402


def test_rollout_loop_reserves_generates_scores_and_puts(service_process, tmp_path) -> None:  # type: ignore[no-untyped-def]
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
            "model_path": model, "dataset": tmp_path / "train.jsonl", "group_size": 3, "groups_per_ticket": 2,
            "sampling.max_new_tokens": task.MAX_NEW_TOKENS, "queue_address": queue.address,
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
