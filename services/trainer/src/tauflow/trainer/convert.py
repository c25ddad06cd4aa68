"""Wire messages (tauflow.api.common.v1) to the trainer's domain types; no gRPC here."""

from __future__ import annotations

from tauflow.api.common.v1 import common_pb2
from tauflow.trainer.batch import Group, Sample


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
    )


def group_from_proto(pb: common_pb2.Group) -> Group:
    return Group(pb.group_id, [sample_from_proto(s) for s in pb.samples])
