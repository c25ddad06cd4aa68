"""The controller's client of the rollout service (RolloutService): greedy answers to held-out prompts."""

from __future__ import annotations

from tauflow import media
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import peer_errors
from tauflow.controller.ports import Completion
from tauflow.core.channel import create_channel
from tauflow.media import wire as media_wire

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
GREEDY = rollout_pb2.SamplingParams(n=1, temperature=0.0)


class RolloutClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    async def generate_greedy(self, prompt: str | list[media.PromptPart], timeout_s: float) -> Completion:
        """The greedy answer to a text prompt, or to a multimodal prompt's parts (rollout revision 4)."""
        request = rollout_pb2.GenerateRequest(sampling=GREEDY)
        if isinstance(prompt, str):
            request.prompt_text = prompt
        else:
            request.prompt_parts.extend(media_wire.to_proto(prompt))
        with peer_errors("rollout"):
            reply = await self._stub.Generate(request, timeout=timeout_s)
        return convert.completion(reply)

    async def close(self) -> None:
        await self._channel.close()
