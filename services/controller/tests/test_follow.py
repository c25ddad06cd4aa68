"""How the controller follows a run, against in-process fakes of the services' contracts: a stalled
run fails with a report instead of waiting forever; ``stop_at_target`` ends a run early; however the follow
ends, every channel it opened is closed."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.run import RunStalled


class StuckTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer (fake, in-process) waiting for data that never comes: no steps, waiting at version 7."""

    async def ListSteps(self, request, context):
        return trainer_pb2.ListStepsResponse()

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(
            state=trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA,
            policy_version=7,
            last_error="retrying a peer call that failed: DEADLINE_EXCEEDED: queue\nGet",
        )


class EmptyQueue(queue_pb2_grpc.QueueServiceServicer):
    async def Stats(self, request, context):
        return queue_pb2.StatsResponse(depth_groups=0, reserved_groups=16)


def _all_closed(channels) -> bool:
    return len(channels) >= 4 and all(channel.closed for channel in channels)


def follower(config: RunConfig):
    """The run that follows this test's fake services: it starts no rollout replica of its own (the local
    launcher would start a real server for model "m", which fails only after the hub lookups time out)."""
    run = build_run(config)
    run.scaler.target = 0
    return run


def test_a_run_without_steps_fails_as_stalled_and_says_what_it_saw(tmp_path, channels) -> None:
    async def scenario() -> str:
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(StuckTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(EmptyQueue(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=10, stall_timeout_s=1.0, out_dir=str(tmp_path))
        try:
            with pytest.raises(RunStalled) as err:
                await asyncio.wait_for(
                    follower(config).follow(
                        {
                            "trainer": address,
                            "queue": address,
                            "rollout": address,
                            "reward": address,
                            "weights": address,
                        }
                    ),
                    timeout=30,
                )
            return str(err.value)
        finally:
            await server.stop(0)

    message = asyncio.run(scenario())
    assert _all_closed(channels)  # the trainer's, queue's, rollout's and reward's, on the way out of a failure
    assert "no training step for 1s" in message
    assert "trainer TRAINER_STATE_WAITING_FOR_DATA at version 7" in message
    assert "queue depth 0 groups, 16 reserved" in message
    # what the trainer is retrying (a partition between it and the queue left it "TRAINING"), on one line
    assert "trainer: retrying a peer call that failed: DEADLINE_EXCEEDED: queue Get" in message


class SteppingTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer (fake) that commits one step per ListSteps call."""

    def __init__(self) -> None:
        self.version = 0

    async def ListSteps(self, request, context):
        self.version += 1
        return trainer_pb2.ListStepsResponse(
            steps=[trainer_pb2.StepMetrics(step=self.version, policy_version=self.version)]
        )


class AlwaysRight(rollout_pb2_grpc.RolloutServiceServicer, reward_pb2_grpc.RewardServiceServicer):
    """Rollout and reward (fakes): every held-out answer is right."""

    async def Generate(self, request, context):
        return rollout_pb2.GenerateResponse(samples=[common_pb2.Sample(sample_id="s")])

    async def Score(self, request, context):
        return reward_pb2.ScoreResponse(
            groups=[
                reward_pb2.GroupRewards(
                    group_id=g.group_id,
                    samples=[reward_pb2.SampleReward(reward=common_pb2.Reward(score=1.0)) for _ in g.samples],
                )
                for g in request.groups
            ]
        )


def test_stop_at_target_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path, channels) -> None:
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"id": "1", "prompt": "1+1=", "answer": "2"}\n')

    async def scenario():
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(SteppingTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(EmptyQueue(), server)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(AlwaysRight(), server)
        reward_pb2_grpc.add_RewardServiceServicer_to_server(AlwaysRight(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(
            model="m",
            dataset="d",
            steps=1000,
            target_accuracy=0.8,
            stop_at_target=True,
            eval={"dataset": str(heldout), "every_steps": 3},
            out_dir=str(tmp_path),
        )
        try:
            return await asyncio.wait_for(
                follower(config).follow(
                    {"trainer": address, "queue": address, "rollout": address, "reward": address, "weights": address}
                ),
                timeout=30,
            )
        finally:
            await server.stop(0)

    summary = asyncio.run(scenario())
    assert _all_closed(channels)
    assert summary.final_accuracy == 1.0
    assert summary.extra["stopped_at_target_version"] == summary.evals[0].policy_version
    assert len(summary.steps) < 10  # stopped, not run to 1000 steps


class PausedTrainer(SteppingTrainer):
    """A trainer (fake) started paused: it steps only once resumed, and records when that was."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events, self.paused = events, True

    async def ListSteps(self, request, context):
        if self.paused:
            return trainer_pb2.ListStepsResponse()
        return await super().ListSteps(request, context)

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(state=trainer_pb2.TRAINER_STATE_FINISHED, policy_version=self.version)

    async def Resume(self, request, context):
        self.events.append("resume")
        if self.events.count("resume") <= 3:  # (the channel's own retries, then the run's next passes)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        self.paused = False
        return trainer_pb2.ResumeResponse(policy_version=self.version)


class CountingRollout(AlwaysRight):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def Generate(self, request, context):
        self.events.append("generate")
        return await super().Generate(request, context)


def test_the_trainer_starts_paused_and_trains_once_the_first_evaluation_is_done(tmp_path, channels) -> None:
    # A step taken before the run's first evaluation made its baseline an evaluation of version 1 or later (a
    # recipe whose steps are quick: the trainer served after the rollout had filled the queue).
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"id": "1", "prompt": "1+1=", "answer": "2"}\n')
    events: list[str] = []
    config = RunConfig(model="m", dataset="d", steps=4, eval={"dataset": str(heldout), "every_steps": 2},
                       out_dir=str(tmp_path))  # fmt: skip
    run = follower(config)
    assert run._settings("trainer", {})["start_paused"] is True
    no_eval = RunConfig(model="m", dataset="d", steps=4, out_dir=str(tmp_path / "no-eval"))
    assert "start_paused" not in build_run(no_eval)._settings("trainer", {})  # nothing to wait for

    async def scenario():
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(PausedTrainer(events), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(EmptyQueue(), server)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(CountingRollout(events), server)
        reward_pb2_grpc.add_RewardServiceServicer_to_server(AlwaysRight(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        addresses = {"trainer": address, "queue": address, "rollout": address, "reward": address, "weights": address}
        try:
            return await asyncio.wait_for(run.follow(addresses), timeout=30)
        finally:
            await server.stop(0)

    summary = asyncio.run(scenario())
    assert _all_closed(channels)
    # evaluated first; then Resume, asked again until the trainer answered it (a failed call left it paused)
    assert events[:2] == ["generate", "resume"] and events.count("resume") >= 4, events
    assert summary.evals[0].policy_version == 0 and len(summary.steps) == 4
    # a trainer process (re)started from now on trains at once
    assert "start_paused" not in run._settings("trainer", {})


def test_the_prepare_command_gets_the_run_seed_and_tauflows_interpreter(tmp_path) -> None:
    import sys

    config = RunConfig(
        model="m",
        dataset="d",
        steps=1,
        seed=7,
        out_dir=str(tmp_path),
        prepare=["python", "prep.py", "--seed", "{seed}", "--out", "runs/s{seed}"],
    )
    assert build_run(config).prepare_command() == [sys.executable, "prep.py", "--seed", "7", "--out", "runs/s7"]


class AdvancingQueue(queue_pb2_grpc.QueueServiceServicer):
    """The trainer's version at the queue moves although no new step is listed: a resumed trainer
    re-training the steps after its checkpoint."""

    def __init__(self) -> None:
        self.version = 0

    async def Stats(self, request, context):
        self.version += 1
        return queue_pb2.StatsResponse(trainer_version=self.version)


def test_a_trainer_that_advances_without_new_listed_steps_is_not_stalled(tmp_path, channels) -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(StuckTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(AdvancingQueue(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=10, stall_timeout_s=1.0, out_dir=str(tmp_path))
        try:
            with pytest.raises(TimeoutError):  # still following after 3 stall timeouts
                await asyncio.wait_for(
                    follower(config).follow(
                        {
                            "trainer": address,
                            "queue": address,
                            "rollout": address,
                            "reward": address,
                            "weights": address,
                        }
                    ),
                    timeout=3,
                )
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    assert _all_closed(channels)  # a follow cancelled (StopRun, Ctrl-C) closes them too


def test_a_new_run_sets_the_previous_one_aside_and_resume_keeps_it(tmp_path) -> None:
    for name in ("checkpoints", "queue-wal"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state").write_text("run 1")
    config = RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path), resume=True)
    assert build_run(config).set_aside_previous_run() == []
    assert (tmp_path / "checkpoints" / "state").read_text() == "run 1"
    config = RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path))
    assert build_run(config).set_aside_previous_run() == ["checkpoints", "queue-wal"]
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "checkpoints.prev" / "state").read_text() == "run 1"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "state").write_text("run 2")
    build_run(config).set_aside_previous_run()  # one generation is kept
    assert (tmp_path / "checkpoints.prev" / "state").read_text() == "run 2"


class ResumedTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer (fake) resumed from its checkpoint at version 3, as after `tauflow run --resume`: its first
    step is step 3 (version 4); it commits one step per ListSteps call and lists, like the real one, every
    step kept whose number is at least ``from_step``."""

    def __init__(self, resumed_at: int, total: int) -> None:
        self.version, self.total = resumed_at, total
        self.history: list[trainer_pb2.StepMetrics] = []

    async def ListSteps(self, request, context):
        if self.version < self.total:
            self.history.append(trainer_pb2.StepMetrics(step=self.version, policy_version=self.version + 1))
            self.version += 1
        return trainer_pb2.ListStepsResponse(steps=[m for m in self.history if m.step >= request.from_step])

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(state=trainer_pb2.TRAINER_STATE_FINISHED, policy_version=self.version)


def test_a_resumed_run_lists_each_step_once_from_the_checkpoint_on(tmp_path, channels) -> None:
    async def scenario():
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(ResumedTrainer(resumed_at=3, total=8), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(EmptyQueue(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=8, out_dir=str(tmp_path), resume=True)
        try:
            return await asyncio.wait_for(
                follower(config).follow(
                    {"trainer": address, "queue": address, "rollout": address, "reward": address, "weights": address}
                ),
                timeout=30,
            )
        finally:
            await server.stop(0)

    summary = asyncio.run(scenario())
    assert _all_closed(channels)
    assert [s.policy_version for s in summary.steps] == [4, 5, 6, 7, 8]


def test_a_restart_under_way_is_not_a_stall(tmp_path) -> None:
    # A restart no longer blocks the launcher's check, so a trainer reloading a large model for longer than
    # stall_timeout_s (its start_timeout_s bounds that) made the run fail as stalled while it came back.
    from types import SimpleNamespace

    async def scenario() -> tuple[bool, str]:
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(StuckTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(EmptyQueue(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=10, stall_timeout_s=1.0, out_dir=str(tmp_path))
        run = follower(config)
        restarting = SimpleNamespace(restarting=True, role="trainer")
        run.launcher.services["trainer"] = restarting  # type: ignore[assignment]
        run.launcher.check = list  # type: ignore[method-assign]
        follow = asyncio.ensure_future(
            run.follow({r: address for r in ("trainer", "queue", "rollout", "reward", "weights")})
        )
        try:
            await asyncio.sleep(3.0)  # three stall budgets while the restart is under way
            still_following = not follow.done()
            restarting.restarting = False  # it serves, and makes no step: a stall again
            with pytest.raises(RunStalled) as err:
                await asyncio.wait_for(follow, timeout=30)
            return still_following, str(err.value)
        finally:
            follow.cancel()
            await server.stop(0)

    still_following, message = asyncio.run(scenario())
    assert still_following and "no training step for 1s" in message


class BusyQueue(EmptyQueue):
    """A queue (fake) whose call slots are full for its first Stats calls: RESOURCE_EXHAUSTED, as grpcio
    answers beyond max_concurrent_rpcs."""

    def __init__(self, busy: int) -> None:
        self.busy = busy

    async def Stats(self, request, context):
        if self.busy > 0:
            self.busy -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
        return await super().Stats(request, context)


def test_a_queue_that_refuses_a_poll_for_want_of_call_slots_does_not_end_the_run(tmp_path, channels) -> None:
    """One RESOURCE_EXHAUSTED from the queue's Stats (a flood had taken its call slots) ended `tauflow run`
    with a traceback, drained every service and left the summary "running"."""
    queue = BusyQueue(busy=3)

    class FinishingTrainer(SteppingTrainer):
        async def GetStatus(self, request, context):
            return trainer_pb2.GetStatusResponse(state=trainer_pb2.TRAINER_STATE_FINISHED, policy_version=self.version)

    async def scenario():
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(FinishingTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(queue, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=3, stall_timeout_s=30.0, out_dir=str(tmp_path))
        try:
            return await asyncio.wait_for(
                follower(config).follow(
                    {"trainer": address, "queue": address, "rollout": address, "reward": address, "weights": address}
                ),
                timeout=30,
            )
        finally:
            await server.stop(0)

    summary = asyncio.run(scenario())
    assert queue.busy == 0 and [s.policy_version for s in summary.steps][-1] >= 3


def test_a_run_ended_by_a_peers_error_says_so_in_its_summary(tmp_path) -> None:
    """A PeerError (or any exception) out of the follow left summary.json "running", with no message."""
    from tauflow.controller.ports import PeerError

    run = build_run(RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path)), serve_metrics=False)

    async def follow(addresses):
        raise PeerError("queue", "PERMISSION_DENIED", "not this token")

    run.launch = dict  # type: ignore[method-assign]
    run.follow = follow  # type: ignore[method-assign]
    with pytest.raises(PeerError):
        asyncio.run(run.execute())
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["status"] == "failed"
    assert written["message"] == "the controller stopped the run: PeerError: queue: PERMISSION_DENIED: not this token"


class NeverFinishingTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer (fake) that reaches the last step (2) and never finishes: its final checkpoint does not fit."""

    def __init__(self) -> None:
        self.version = 0

    async def ListSteps(self, request, context):
        if self.version >= 2:
            return trainer_pb2.ListStepsResponse()
        self.version += 1
        return trainer_pb2.ListStepsResponse(
            steps=[trainer_pb2.StepMetrics(step=self.version, policy_version=self.version)]
        )

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(
            state=trainer_pb2.TRAINER_STATE_TRAINING,
            policy_version=self.version,
            last_error="checkpoint not written: [Errno 28] No space left on device",
        )


class FullQueue(queue_pb2_grpc.QueueServiceServicer):
    async def Stats(self, request, context):
        return queue_pb2.StatsResponse(trainer_version=2, leased_groups=40, capacity_groups=40)


def test_a_trainer_that_never_finishes_after_its_last_step_is_a_stall_and_the_roles_stay_supervised(
    tmp_path, channels, monkeypatch
) -> None:
    # A final checkpoint on a full disk: a fixed 300 s, then a TimeoutError traceback; and no role that died
    # meanwhile was restarted (the trainer's acks waited on a dead queue).
    async def scenario() -> tuple[str, int]:
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(NeverFinishingTrainer(), server)
        queue_pb2_grpc.add_QueueServiceServicer_to_server(FullQueue(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = RunConfig(model="m", dataset="d", steps=2, stall_timeout_s=1.5, out_dir=str(tmp_path))
        run = follower(config)
        supervised = []
        real_supervise = run._supervise

        async def counting(peers, following):
            supervised.append(run.progress.version)
            await real_supervise(peers, following)

        monkeypatch.setattr(run, "_supervise", counting)
        try:
            with pytest.raises(RunStalled) as err:
                await asyncio.wait_for(
                    run.follow(dict.fromkeys(("trainer", "queue", "rollout", "reward", "weights"), address)), timeout=30
                )
            return str(err.value), sum(v >= 2 for v in supervised)
        finally:
            await server.stop(0)

    message, supervised_after_last_step = asyncio.run(scenario())
    assert message.startswith("the trainer has not finished after its last step for 2s")
    assert "trainer: checkpoint not written: [Errno 28] No space left on device" in message
    assert "the queue is full (capacity_groups 40)" in message and "40 leased" in message
    assert supervised_after_last_step >= 2  # (restarts go on while it waits)
    assert _all_closed(channels)
