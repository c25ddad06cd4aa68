"""Protobuf ↔ the trainer's domain types: groups in (tauflow.api.common.v1), steps and checkpoints out
(tauflow.api.trainer.v1)."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration

from tauflow.api.common.v1 import common_pb2
from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.core.protobuf import timestamp as _timestamp
from tauflow.media import wire as media_wire
from tauflow.trainer.backend import StepResult
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.checkpoint import CheckpointInfo


def sample_from_proto(pb: common_pb2.Sample) -> Sample:
    """An empty ``loss_mask`` means every completion token trains; the behaviour version is
    min(token_versions) when they are set, else ``behaviour_version``."""
    return Sample(
        prompt_ids=list(pb.prompt_token_ids),
        completion_ids=list(pb.completion_token_ids),
        behaviour_logprobs=list(pb.behaviour_logprobs),
        loss_mask=list(pb.loss_mask) or None,
        reward=pb.reward.score,
        versions=list(pb.token_versions) or None,
        behaviour_version=pb.behaviour_version,
        sample_id=pb.sample_id,
        truncated=pb.finish_reason == common_pb2.FINISH_REASON_LENGTH,
    )


def group_from_proto(pb: common_pb2.Group) -> Group:
    baseline = pb.baseline_reward if pb.HasField("baseline_reward") else None
    parts = media_wire.from_proto(pb.prompt_parts, f"group {pb.group_id}: prompt_parts") if pb.prompt_parts else []
    return Group(pb.group_id, [sample_from_proto(s) for s in pb.samples], baseline_reward=baseline, prompt_parts=parts)


def step_to_proto(result: StepResult, groups_by_staleness: dict[int, int] | None = None) -> trainer_pb2.StepMetrics:
    duration = Duration()
    duration.FromNanoseconds(int(result.duration_s * 1e9))
    return trainer_pb2.StepMetrics(
        step=result.step,
        policy_version=result.policy_version,
        groups=result.groups,
        samples=result.samples,
        trained_tokens=result.trained_tokens,
        max_staleness=result.max_staleness,
        mean_staleness=result.mean_staleness,
        mean_reward=result.mean_reward,
        loss=result.loss,
        duration=duration,
        metrics={k: float(v) for k, v in result.metrics.items()},
        groups_by_staleness={max(0, k): v for k, v in (groups_by_staleness or {}).items()},
        committed_at=_timestamp(result.committed_at) if result.committed_at is not None else None,
    )


def checkpoint_to_proto(info: CheckpointInfo) -> trainer_pb2.CheckpointInfo:
    return trainer_pb2.CheckpointInfo(
        path=str(info.path),
        policy_version=info.policy_version,
        created_at=_timestamp(info.created_at),
        size_bytes=info.size_bytes,
        trained_groups=info.trained_groups,
    )
