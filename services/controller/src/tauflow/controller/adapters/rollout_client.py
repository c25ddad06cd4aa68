"""The controller's client of the rollout service (RolloutService): greedy answers to held-out prompts."""

from __future__ import annotations

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.controller.adapters import convert
from tauflow.controller.adapters.errors import peer_errors
from tauflow.controller.ports import SERVER_DEFAULTS, ChatPrompt, Completion, GreedySampling, HeldOutPrompt
from tauflow.core.channel import create_channel
from tauflow.media import wire as media_wire

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
GREEDY = rollout_pb2.SamplingParams(n=1, temperature=0.0)


class RolloutClient:
    def __init__(self, address: str) -> None:
        self._channel = create_channel(address, [SERVICE])
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)

    async def generate_greedy(
        self, prompt: HeldOutPrompt, timeout_s: float, sampling: GreedySampling = SERVER_DEFAULTS
    ) -> Completion:
        """The greedy answer to a prompt: text, a chat (rollout revision 5), a multimodal prompt's parts (revision
        4), or token ids; it ends as training's completions do (``sampling``)."""
        request = rollout_pb2.GenerateRequest(sampling=GREEDY)
        request.sampling.stop.extend(sampling.stop)
        request.sampling.stop_token_ids.extend(sampling.stop_token_ids)
        request.sampling.max_new_tokens = sampling.max_new_tokens
        if isinstance(prompt, str):
            request.prompt_text = prompt
        elif isinstance(prompt, ChatPrompt):
            request.prompt_messages.extend(rollout_pb2.ChatMessage(**m) for m in prompt.messages)
        elif prompt and isinstance(prompt[0], int):
            request.prompt_token_ids.extend(prompt)
        else:
            request.prompt_parts.extend(media_wire.to_proto(prompt))  # type: ignore[arg-type]
        with peer_errors("rollout"):
            reply = await self._stub.Generate(request, timeout=timeout_s)
        return convert.completion(reply)

    async def close(self) -> None:
        await self._channel.close()
