"""Rollout domain objects <-> protobuf messages (no grpc here)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from tauflow.api.common.v1 import common_pb2
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.media import wire as media_wire
from tauflow.rollout.engine.base import Completion, EngineState, EngineStats, FinishReason, SamplingParams
from tauflow.rollout.ports import ProducedGroup

_FINISH_REASON = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_ENGINE_STATE = {
    EngineState.STARTING: rollout_pb2.ENGINE_STATE_STARTING,
    EngineState.WAITING_FOR_WEIGHTS: rollout_pb2.ENGINE_STATE_WAITING_FOR_WEIGHTS,
    EngineState.SERVING: rollout_pb2.ENGINE_STATE_SERVING,
    EngineState.DRAINING: rollout_pb2.ENGINE_STATE_DRAINING,
    EngineState.FAILED: rollout_pb2.ENGINE_STATE_FAILED,
}


def sample_to_proto(index: int, prompt_ids: list[int], c: Completion, text: str = "") -> common_pb2.Sample:
    return common_pb2.Sample(
        sample_id=str(index),
        prompt_token_ids=prompt_ids,
        completion_token_ids=c.token_ids,
        behaviour_logprobs=c.logprobs,
        token_versions=c.versions,
        behaviour_version=c.behaviour_version or 0,  # the contract: min(token_versions) when those are set
        finish_reason=_FINISH_REASON[c.finish_reason],
        completion_text=text,
    )


def group_to_proto(g: ProducedGroup) -> common_pb2.Group:
    """The group as the reward service and the queue take it. Its samples are encoded once and kept with
    the group (``g.encoded``), since the reward call and the put send the same ones; what changes between
    the two (rewards, the REMAX baseline, the trace context) is set anew each time. Callers copy the
    message into their request and must not change it."""
    group = g.encoded
    if not isinstance(group, common_pb2.Group):
        created = Timestamp()
        created.FromNanoseconds(int(g.created_at * 1e9))
        group = common_pb2.Group(
            group_id=g.group_id,
            prompt_id=g.prompt.prompt_id,
            samples=[
                sample_to_proto(i, g.prompt.token_ids, c, t) for i, (c, t) in enumerate(zip(g.completions, g.texts))
            ],
            producer_id=g.producer_id,
            created_at=created,
            metadata=g.prompt.metadata,
        )
        group.prompt_parts.extend(media_wire.to_proto(g.prompt.parts))
        g.encoded = group
    for i, sample in enumerate(group.samples):
        if i < len(g.rewards):
            sample.reward.CopyFrom(g.rewards[i])
        else:
            sample.ClearField("reward")
    if g.baseline_reward is not None:
        group.baseline_reward = g.baseline_reward
    else:
        group.ClearField("baseline_reward")
    group.trace_context.traceparent = g.traceparent
    group.trace_context.tracestate = g.tracestate
    return group


def sampling_from_proto(p: rollout_pb2.SamplingParams, default_max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=p.max_new_tokens or default_max_new_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        n=p.n or 1,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
    )


def engine_status_to_proto(stats: EngineStats, receiving_version: int | None) -> rollout_pb2.EngineStatus:
    engine = rollout_pb2.EngineStatus(
        engine_id=stats.engine_id,
        backend=stats.backend,
        model=stats.model,
        state=_ENGINE_STATE[stats.state],
        policy_version=stats.policy_version,
        in_flight_requests=stats.in_flight_requests,
        running_sequences=stats.running_sequences,
        waiting_sequences=stats.waiting_sequences,
        last_error=stats.last_error or "",
        num_ranks=1,
    )
    if receiving_version is not None:
        engine.weight_update_in_progress = True
        engine.receiving_policy_version = receiving_version
    return engine
