"""Protobuf <-> the controller's domain objects (ports.py)."""

from __future__ import annotations

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.trainer.v1 import trainer_pb2
from tauflow.controller.ports import Completion, QueueStats, ToScore, TrainerStatus, TrainerStep


def trainer_step(m: trainer_pb2.StepMetrics) -> TrainerStep:
    return TrainerStep(
        step=m.step,
        policy_version=m.policy_version,
        mean_reward=m.mean_reward,
        max_staleness=m.max_staleness,
        mean_staleness=m.mean_staleness,
        loss=m.loss,
        trained_tokens=m.trained_tokens,
        groups=m.groups,
        metrics=dict(m.metrics),
        groups_by_staleness=dict(m.groups_by_staleness),
        committed_at=m.committed_at.ToNanoseconds() / 1e9 if m.HasField("committed_at") else None,
    )


def trainer_status(reply: trainer_pb2.GetStatusResponse) -> TrainerStatus:
    return TrainerStatus(
        trainer_pb2.TrainerState.Name(reply.state),
        reply.policy_version,
        reply.state == trainer_pb2.TRAINER_STATE_FINISHED,
        "".join(c if c.isprintable() else " " for c in reply.last_error[:300]),  # (shown on a terminal)
    )


def queue_stats(reply: queue_pb2.StatsResponse) -> QueueStats:
    return QueueStats(
        reply.depth_groups, reply.reserved_groups, reply.trainer_version, reply.leased_groups, reply.capacity_groups
    )


def completion(reply: rollout_pb2.GenerateResponse) -> Completion:
    return Completion(tuple(s.behaviour_version for s in reply.samples), reply.samples)


def group(item: ToScore) -> common_pb2.Group:
    """A held-out completion as the reward service scores it: its samples, and the row's metadata."""
    return common_pb2.Group(group_id=item.group_id, samples=item.completion.samples, metadata=item.metadata)
