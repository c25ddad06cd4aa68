"""The controller's client of the trainer (TrainerService): the steps it committed, its state, the dial, the start."""

from __future__ import annotations

from tauflow.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import POLL_TIMEOUT_S, peer_errors
from tauflow.controller.ports import TrainerStatus, TrainerStep
from tauflow.core.channel import create_channel

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]


class TrainerClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    async def list_steps(self, from_step: int) -> list[TrainerStep]:
        with peer_errors("trainer"):
            reply = await self._stub.ListSteps(
                trainer_pb2.ListStepsRequest(from_step=from_step), timeout=POLL_TIMEOUT_S
            )
        return [convert.trainer_step(m) for m in reply.steps]

    async def status(self) -> TrainerStatus:
        with peer_errors("trainer"):
            reply = await self._stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=POLL_TIMEOUT_S)
        return convert.trainer_status(reply)

    async def set_max_staleness(self, tau: int) -> None:
        with peer_errors("trainer"):  # idempotent by value: the channel retries it
            await self._stub.SetMaxStaleness(trainer_pb2.SetMaxStalenessRequest(max_staleness=tau))

    async def resume(self) -> None:
        with peer_errors("trainer"):  # idempotent: the channel retries it
            await self._stub.Resume(trainer_pb2.ResumeRequest(), timeout=POLL_TIMEOUT_S)

    async def close(self) -> None:
        await self._channel.close()
