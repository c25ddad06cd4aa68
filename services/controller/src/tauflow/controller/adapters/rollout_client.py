"""The controller's client of the rollout service (RolloutService): greedy answers to held-out prompts."""

from __future__ import annotations

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import peer_errors
from tauflow.controller.ports import Completion
from tauflow.core.channel import create_channel

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
GREEDY = rollout_pb2.SamplingParams(n=1, temperature=0.0)


class RolloutClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    async def generate_greedy(self, prompt: str, timeout_s: float) -> Completion:
        with peer_errors("rollout"):
            reply = await self._stub.Generate(
                rollout_pb2.GenerateRequest(prompt_text=prompt, sampling=GREEDY), timeout=timeout_s
            )
        return convert.completion(reply)

    async def close(self) -> None:
        await self._channel.close()
