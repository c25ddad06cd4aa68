"""tauflow-client against real servers: the queue's external port over TLS with a token, the rollout
service, the reward service; retries only for idempotent calls, a deadline on every call; trajectories
whose observations are masked out of the loss."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.api.queue.v1 import queue_pb2_grpc
from tauflow.api.retry import retryable_methods
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.client import (
    Completion,
    QueueClient,
    RewardClient,
    RolloutClient,
    TauflowError,
    Tls,
    Trajectory,
    make_group,
)
from tauflow.client.client import QUEUE, REWARD, ROLLOUT
from tauflow.core.testing import ServiceProcess
from tauflow.core.testing import make_group as wire_group

from .conftest import TOKENS

QueueFactory = Callable[..., ServiceProcess]


def _client(
    proc: ServiceProcess, tls_files: tuple[Path, Path], token: str = TOKENS["agent-a"], **kw: object
) -> QueueClient:
    return QueueClient(f"127.0.0.1:{proc.info['external_port']}", token, tls=Tls.from_file(tls_files[0]), **kw)


def _internal(proc: ServiceProcess) -> queue_pb2_grpc.QueueServiceStub:
    return queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(proc.address))


# -- trajectories ----------------------------------------------------------------------------------


def test_a_trajectory_masks_its_observations_and_keeps_the_behaviour_version() -> None:
    t = Trajectory([1, 2, 3])
    t.add_completion(Completion([4, 5], [-0.5, -1.0], [3, 3], "stop"))
    t.add_observation([6, 7, 8])  # the tool's output
    t.add_model([9], [-0.25], [4])  # the model goes on, after a weight update
    assert t.context == [1, 2, 3, 4, 5, 6, 7, 8, 9] and t.model_tokens == 3
    s = t.to_sample("0", reward=1.0, text="answer", metadata={"k": "v"})
    assert list(s.completion_token_ids) == [4, 5, 6, 7, 8, 9]
    assert list(s.loss_mask) == [True, True, False, False, False, True]
    assert list(s.behaviour_logprobs) == [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25]
    assert list(s.token_versions) == [3, 3, 3, 3, 3, 4] and s.behaviour_version == 3  # min(token_versions)
    assert (s.reward.score, s.reward.status, s.completion_text, dict(s.metadata)) == (
        1.0,
        common_pb2.REWARD_STATUS_OK,
        "answer",
        {"k": "v"},
    )
    assert s.finish_reason == common_pb2.FINISH_REASON_STOP
    single = Trajectory([1])
    single.add_model([2, 3], [-1.0, -1.0], [0, 0])
    plain = single.to_sample("1")
    assert list(plain.loss_mask) == [] and not plain.HasField("reward")  # no observation: every token trains


def test_a_trajectory_refuses_what_the_queue_would() -> None:
    with pytest.raises(ValueError, match="needs a prompt"):
        Trajectory([])
    t = Trajectory([1])
    with pytest.raises(ValueError, match="2 tokens, 1 log-probs, 2 versions"):
        t.add_model([2, 3], [-1.0], [0, 0])
    t.add_observation([4])
    with pytest.raises(ValueError, match="no model tokens"):
        t.to_sample("0")


def test_a_completion_from_the_wire() -> None:
    sample = common_pb2.Sample(
        completion_token_ids=[5, 6],
        behaviour_logprobs=[-1.0, -2.0],
        behaviour_version=7,
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        completion_text="ab",
    )
    c = Completion.from_proto(sample)
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason, c.text) == (
        [5, 6],
        [-1.0, -2.0],
        [7, 7],
        "length",
        "ab",
    )


# -- retries and deadlines -------------------------------------------------------------------------


def test_retry_classes_come_from_the_contracts() -> None:
    retried = set(retryable_methods([QUEUE, ROLLOUT, REWARD]))
    assert {(QUEUE.full_name, m) for m in ("Reserve", "ReleaseReservation", "Put", "Stats")} <= retried
    assert (REWARD.full_name, "Score") in retried
    assert (ROLLOUT.full_name, "Generate") not in retried and (QUEUE.full_name, "Get") not in retried


class Flaky(queue_pb2_grpc.QueueServiceServicer, rollout_pb2_grpc.RolloutServiceServicer):
    """Answers UNAVAILABLE, then CANCELLED (a server stopping as the call came), to the first two calls of Put
    and Generate; Stats takes 2 s."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.metadata: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def _flaky(self, name: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.metadata.append(dict(context.invocation_metadata()))
            n = self.calls[name]
        if n <= 2:
            context.abort(grpc.StatusCode.UNAVAILABLE if n == 1 else grpc.StatusCode.CANCELLED, "try again")

    def Put(self, request, context):
        self._flaky("Put", context)
        return q.PutResponse(outcome=q.PUT_OUTCOME_ACCEPTED)

    def Generate(self, request, context):
        self._flaky("Generate", context)
        return rollout_pb2.GenerateResponse()

    def Stats(self, request, context):
        time.sleep(2.0)
        return q.StatsResponse()


def test_only_idempotent_calls_are_retried_and_every_call_has_a_deadline() -> None:
    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    queue_pb2_grpc.add_QueueServiceServicer_to_server(servicer, server)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        with (
            QueueClient(address, "t0ken", timeout_s=5) as queue,
            RolloutClient(address, timeout_s=5) as rollout,
            QueueClient(address, "t0ken", timeout_s=0.5) as impatient,
        ):
            assert queue.put(wire_group("g1")).accepted  # Put is idempotent: retried through UNAVAILABLE, CANCELLED
            assert servicer.calls["Put"] == 3
            assert all(m["authorization"] == "Bearer t0ken" for m in servicer.metadata)  # on every attempt
            with pytest.raises(TauflowError) as refused:
                rollout.generate([1, 2], max_new_tokens=1)  # a new draw each time: never sent twice
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE and servicer.calls["Generate"] == 1
            assert "authorization" not in servicer.metadata[-1]  # the token goes to the queue only
            started = time.monotonic()
            with pytest.raises(TauflowError) as late:
                impatient.stats()
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and late.value.retryable
            assert TauflowError("Put", grpc.StatusCode.CANCELLED, "CANCELLED").retryable
            assert time.monotonic() - started < 1.5  # the client's 0.5 s, not the server's 2 s
    finally:
        server.stop(0)


# -- the queue's external port ---------------------------------------------------------------------


def test_the_external_port_over_tls_reserve_put_release_and_the_policy_version(
    queue_process: QueueFactory, tls_files: tuple[Path, Path]
) -> None:
    proc = queue_process()
    internal = _internal(proc)
    with _client(proc, tls_files) as queue:
        assert queue.policy_version() == 0
        internal.SetTrainerVersion(q.SetTrainerVersionRequest(policy_version=3), timeout=5)
        assert queue.policy_version() == 3 and queue.stats().groups_per_step == 2
        with queue.reservation(2) as ticket:
            assert (ticket.n_groups, ticket.min_policy_version) == (2, 3) and ticket.expires_at > time.time()
            group = wire_group("g1", version=3)
            assert queue.put(group, ticket).accepted
            assert not queue.put(group, ticket).accepted  # a retry is a duplicate, not a second group
            assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 1
        stats = internal.Stats(q.StatsRequest(), timeout=5)
        assert (stats.reserved_groups, stats.accepted_groups) == (0, 1)  # the unused room went back
        with pytest.raises(RuntimeError, match="generation failed"), queue.reservation(1):
            raise RuntimeError("generation failed")
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 0  # also when the block fails
        # No room (tau = 1, 2 groups per step, version 3: (3 + 1 + 1) x 2 = 10 groups at most, 1 accepted and
        # 9 reserved): no ticket, in time.
        for request_id, n in (("fill1", 4), ("fill2", 4), ("fill3", 1)):
            assert internal.Reserve(q.ReserveRequest(request_id=request_id, n_groups=n), timeout=5).granted
        assert queue.reserve(1, wait_s=0.3) is None
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no room for 1 group"), queue.reservation(1, wait_s=1.0, poll_s=0.4):
            pass
        assert 0.9 < time.monotonic() - started < 5
        # Malformed (the queue names the field) and refused tokens; none of it changed the queue.
        bad = wire_group("bad")
        del bad.samples[0].token_versions[1:]
        with pytest.raises(TauflowError) as invalid:
            queue.put(bad)
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT and not invalid.value.retryable
        assert "samples[0].token_versions has 1 entries for 8 completion tokens" in invalid.value.details
    with _client(proc, tls_files, token="not-a-token-of-the-queue") as stranger:
        with pytest.raises(TauflowError) as unknown:
            stranger.put(wire_group("g2"))
        assert unknown.value.code == grpc.StatusCode.UNAUTHENTICATED and not unknown.value.retryable
    plaintext = QueueClient(f"127.0.0.1:{proc.info['external_port']}", TOKENS["agent-a"], timeout_s=3)
    with pytest.raises(TauflowError) as no_tls:
        plaintext.stats()
    assert no_tls.value.code == grpc.StatusCode.UNAVAILABLE
    assert internal.Stats(q.StatsRequest(), timeout=5).accepted_groups == 1


def test_a_full_queue_is_worth_retrying_a_group_too_large_is_not(
    queue_process: QueueFactory, tls_files: tuple[Path, Path]
) -> None:
    proc = queue_process({"capacity_groups": 1, "max_group_bytes": 4096})
    with _client(proc, tls_files) as queue:
        queue.put(wire_group("g1"))
        with pytest.raises(TauflowError) as full:
            queue.put(wire_group("g2"))
        assert (full.value.code, full.value.reason, full.value.retryable) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "ERROR_REASON_QUEUE_FULL",
            True,
        )
        with pytest.raises(TauflowError) as large:
            queue.put(wire_group("g3", payload_tokens=2000))
        assert (large.value.code, large.value.reason, large.value.retryable) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "ERROR_REASON_GROUP_TOO_LARGE",
            False,
        )


# -- sample, score, put: a multi-turn episode end to end ------------------------------------------


def test_a_multi_turn_group_sampled_scored_and_put_arrives_whole(
    rollout_and_reward: tuple[ServiceProcess, ServiceProcess],
    queue_process: QueueFactory,
    tls_files: tuple[Path, Path],
) -> None:
    rollout_proc, reward_proc = rollout_and_reward
    proc = queue_process()
    prompt = [1, 4, 5, 13, 6, 7]  # "<s>12+34" in examples/addition's vocabulary
    with (
        _client(proc, tls_files) as queue,
        RolloutClient(rollout_proc.address) as rollout,
        RewardClient(reward_proc.address) as reward,
    ):
        with queue.reservation(1) as ticket:
            firsts = rollout.generate(prompt, n=2, max_new_tokens=3, min_policy_version=ticket.min_policy_version)
            assert len(firsts) == 2
            trajectories, turns = [], []
            for first in firsts:
                assert 1 <= len(first.token_ids) <= 3 and first.versions == [0] * len(first.token_ids)
                assert len(first.logprobs) == len(first.token_ids) and all(lp <= 0 for lp in first.logprobs)
                t = Trajectory(prompt)
                t.add_completion(first)
                t.add_observation([8, 9])  # a tool's output
                [second] = rollout.generate(t.context, max_new_tokens=2, min_policy_version=ticket.min_policy_version)
                t.add_completion(second)
                trajectories.append(t)
                turns.append((len(first.token_ids), len(second.token_ids)))
            samples = [t.to_sample(str(i), text=text) for i, (t, text) in enumerate(zip(trajectories, ["46", "x"]))]
            # (baseline_reward: a greedy completion's reward, for a REMAX trainer: it travels with the group)
            group = make_group(samples, prompt_id="12+34", metadata={"answer": "46"}, baseline_reward=0.5)
            assert reward.score([group], reward_fn="exact_match") == "exact_match"
            assert [s.reward.score for s in group.samples] == [1.0, 0.0]
            assert all(s.reward.status == common_pb2.REWARD_STATUS_OK for s in group.samples)
            assert queue.put(group, ticket).accepted
        delivered = _internal(proc).Get(q.GetRequest(consumer_id="trainer", max_groups=1), timeout=5).groups
        assert len(delivered) == 1 and delivered[0].behaviour_version == 0
        got = delivered[0].group
        assert got.producer_id == "agent-a"  # the client the token names, set by the queue
        assert got.group_id == f"agent-a/{group.group_id}"  # namespaced by it
        got.producer_id, got.group_id = group.producer_id, group.group_id
        assert got == group  # everything else as sent: tokens, masks, versions, log-probs, rewards, baseline
        assert got.baseline_reward == 0.5
        for s, (first_len, second_len) in zip(got.samples, turns, strict=True):
            assert list(s.loss_mask) == [True] * first_len + [False, False] + [True] * second_len
            assert list(s.behaviour_logprobs)[first_len : first_len + 2] == [0.0, 0.0]
