"""Protobuf <-> domain conversion for the queue, with the validation of incoming groups.

Imports the generated messages but never grpc: tested without a server.
"""

from __future__ import annotations

import math

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.protobuf import timestamp
from tauflow.queue import state

MAX_ID_CHARS = 256


class InvalidGroup(ValueError):
    """A malformed group; the message names the field."""


class GroupTooLarge(InvalidGroup):
    """A group over the per-group byte limit (RESOURCE_EXHAUSTED, like an oversized message)."""


def group_to_record(group: common_pb2.Group, max_group_bytes: int) -> state.GroupRecord:
    """Validates ``group`` and turns it into what the queue stores."""
    if not group.group_id:
        raise InvalidGroup("group.group_id must be set")
    if len(group.group_id) > MAX_ID_CHARS:
        raise InvalidGroup(f"group.group_id is longer than {MAX_ID_CHARS} characters")
    if not group.samples:
        raise InvalidGroup(f"group {group.group_id}: group.samples is empty (a group has at least one sample)")
    behaviour = None
    n_tokens = 0
    seen_ids: set[str] = set()
    for i, s in enumerate(group.samples):
        where = f"group {group.group_id}: samples[{i}]"
        if s.sample_id in seen_ids:
            raise InvalidGroup(f"{where}.sample_id {s.sample_id!r} repeats within the group")
        seen_ids.add(s.sample_id)
        n = len(s.completion_token_ids)
        if not s.prompt_token_ids:
            raise InvalidGroup(f"{where}.prompt_token_ids is empty")
        if n == 0:
            raise InvalidGroup(f"{where}.completion_token_ids is empty")
        for name, field in (
            ("behaviour_logprobs", s.behaviour_logprobs),
            ("token_versions", s.token_versions),
            ("loss_mask", s.loss_mask),
        ):
            if field and len(field) != n:
                raise InvalidGroup(
                    f"{where}.{name} has {len(field)} entries for {n} completion tokens"
                )
        if s.behaviour_logprobs:
            total = math.fsum(s.behaviour_logprobs)
            if not math.isfinite(total) or max(s.behaviour_logprobs) > 1e-3:
                raise InvalidGroup(f"{where}.behaviour_logprobs must be finite log-probabilities (<= 0)")
        if s.token_versions:
            oldest = min(s.token_versions)
            if s.behaviour_version and s.behaviour_version != oldest:
                raise InvalidGroup(
                    f"{where}.behaviour_version={s.behaviour_version} differs from "
                    f"min(token_versions)={oldest}"
                )
        else:
            oldest = s.behaviour_version
        if not math.isfinite(s.reward.score):
            raise InvalidGroup(f"{where}.reward.score is not finite")
        behaviour = oldest if behaviour is None else min(behaviour, oldest)
        n_tokens += len(s.prompt_token_ids) + n
    payload = group.SerializeToString()
    if len(payload) > max_group_bytes:
        raise GroupTooLarge(
            f"group {group.group_id} is {len(payload)} bytes, over the limit of {max_group_bytes}"
        )
    assert behaviour is not None
    return state.GroupRecord(group.group_id, payload, behaviour, n_tokens)


def ticket_to_proto(ticket: state.Ticket) -> queue_pb2.Ticket:
    return queue_pb2.Ticket(
        ticket_id=ticket.ticket_id,
        n_groups=ticket.n_groups,
        min_policy_version=ticket.min_policy_version,
        expires_at=timestamp(ticket.expires_at),
    )


def lease_to_proto(lease: state.Lease) -> queue_pb2.Lease:
    return queue_pb2.Lease(lease_id=lease.lease_id, deadline=timestamp(lease.deadline))


def stats_to_proto(s: state.Stats) -> queue_pb2.StatsResponse:
    return queue_pb2.StatsResponse(
        trainer_version=s.trainer_version,
        max_staleness=s.max_staleness,
        groups_per_step=s.groups_per_step,
        depth_groups=s.depth_groups,
        depth_bytes=s.depth_bytes,
        leased_groups=s.leased_groups,
        reserved_groups=s.reserved_groups,
        accepted_groups=s.accepted_groups,
        acked_groups=s.acked_groups,
        evicted_groups=s.evicted_groups,
        expired_leases=s.expired_leases,
        capacity_groups=s.capacity_groups,
        capacity_bytes=s.capacity_bytes,
        wal_bytes=s.wal_bytes,
    )
