"""A run whose trainer makes no step fails with a report instead of waiting forever."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tauflow.controller.config import RunConfig
from tauflow.controller.run import Run, RunStalled


class StuckTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer (fake, in-process) waiting for data that never comes: no steps, waiting at version 7."""

    async def ListSteps(self, request, context):  # type: ignore[no-untyped-def]
        return trainer_pb2.ListStepsResponse()

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        return trainer_pb2.GetStatusResponse(state=trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA, policy_version=7)


class EmptyQueue(queue_pb2_grpc.QueueServiceServicer):
    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        return queue_pb2.StatsResponse(depth_groups=0, reserved_groups=16)


def test_a_run_without_steps_fails_as_stalled_and_says_what_it_saw(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
                    Run(config).follow({"trainer": address, "queue": address, "rollout": address, "reward": address}),
                    timeout=30)
            return str(err.value)
        finally:
            await server.stop(0)

    message = asyncio.run(scenario())
    assert "no training step for 1s" in message
    assert "trainer TRAINER_STATE_WAITING_FOR_DATA at version 7" in message
    assert "queue depth 0 groups, 16 reserved" in message
