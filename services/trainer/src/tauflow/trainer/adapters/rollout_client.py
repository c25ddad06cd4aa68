"""The trainer's side of a rollout server that hosts a teacher (implements ports.TeacherPort): the
teacher's log-probs of the student's sampled tokens, for on-policy distillation, by ComputeLogprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import grpc

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.trainer.adapters.retry import until_it_works

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
MAX_SEQUENCES = 4096  # per call: the contract's bound
MAX_TOKENS = 200_000  # per call: under a rollout server's default max_score_tokens (262,144)
CALL_TIMEOUT_S = 300.0
GIVE_UP_AFTER_S = 600.0  # a teacher server down this long fails the step (the trainer restarts and retries it)


class RolloutTeacher:
    """A teacher behind a rollout server. ``logprobs`` is called from the backend's worker thread: the calls
    run on the service's event loop (``loop``), split into calls within the contract's bounds, each retried
    while the teacher's server is unavailable (ComputeLogprobs has no side effects), for GIVE_UP_AFTER_S at
    most; a call past its own deadline is not sent again (the same work would time out again)."""

    def __init__(self, address: str, channel: ChannelConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.address = address
        self.channel = create_channel(address, [SERVICE], channel)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.loop = loop

    def logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float
    ) -> list[list[float]]:
        return asyncio.run_coroutine_threadsafe(self._logprobs(sequences, temperature), self.loop).result()

    async def _logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float
    ) -> list[list[float]]:
        out: list[list[float]] = []
        for chunk in _chunks(sequences):
            request = rollout_pb2.ComputeLogprobsRequest(
                sequences=[
                    rollout_pb2.ScoredSequence(prompt_token_ids=list(p), completion_token_ids=list(c)) for p, c in chunk
                ],
                temperature=temperature,
            )
            async for attempt in until_it_works((grpc.StatusCode.UNAVAILABLE,), GIVE_UP_AFTER_S):
                with attempt:
                    response = await self.stub.ComputeLogprobs(request, timeout=CALL_TIMEOUT_S)
            if len(response.sequences) != len(chunk):
                raise RuntimeError(
                    f"the teacher at {self.address} scored {len(response.sequences)} of {len(chunk)} sequences"
                )
            out.extend(list(s.logprobs) for s in response.sequences)
        return out

    async def close(self) -> None:
        await self.channel.close()


def _chunks(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> Iterator[list[tuple[Sequence[int], Sequence[int]]]]:
    chunk: list[tuple[Sequence[int], Sequence[int]]] = []
    tokens = 0
    for p, c in sequences:
        size = len(p) + len(c)
        if chunk and (len(chunk) == MAX_SEQUENCES or tokens + size > MAX_TOKENS):
            yield chunk
            chunk, tokens = [], 0
        chunk.append((p, c))
        tokens += size
    if chunk:
        yield chunk
