"""Protobuf <-> domain conversion for the queue, with the validation of incoming groups.

Imports the generated messages but never grpc: tested without a server.

The bounds below are the contract's (written in the comments of common.v1 and queue.v1): every string
and list a client sends has one, checked before anything is stored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from tauflow import media
from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2
from tauflow.core.decoding import TIMESTAMP_SECONDS
from tauflow.core.limits import MAX_ABS_REWARD
from tauflow.core.protobuf import timestamp
from tauflow.media import wire as media_wire
from tauflow.queue.model import MAX_ID_CHARS, GroupRecord, Lease, Stats, Ticket

MAX_SAMPLES = 4096  # samples in one group
MAX_METADATA_ENTRIES = 64  # entries of each metadata map, and of a reward's components
MAX_KEY_CHARS = 256  # a metadata key or a component name
MAX_TRACEPARENT_CHARS = 128  # W3C: 55 for version 00
MAX_TRACESTATE_CHARS = 512  # W3C: at most 32 list members of 256 characters; 512 is what is propagated
MAX_REWARD_MESSAGE_CHARS = 4096
MAX_LOGPROB = 1e-3  # log-probabilities are <= 0; a little float noise above 0 is allowed


class InvalidGroup(ValueError):
    """A malformed group; the message names the field."""


class GroupTooLarge(InvalidGroup):
    """A group over the per-group byte limit (RESOURCE_EXHAUSTED, like an oversized message)."""


# Control characters (NUL, newlines, escapes) in a group's or a sample's id: no producer means them, and those
# ids key the log, exports and dashboards. (A prompt id comes from a user's data set as it is: not checked.)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FINISH_REASONS = frozenset(common_pb2.FinishReason.values())
_REWARD_STATUSES = frozenset(common_pb2.RewardStatus.values())


def check_id(value: str, field: str, *, required: bool = True) -> None:
    """Raises InvalidGroup when ``value`` (the field ``field``) is empty (if required) or too long."""
    if required and not value:
        raise InvalidGroup(f"{field} must be set")
    if len(value) > MAX_ID_CHARS:
        raise InvalidGroup(f"{field} is {len(value)} characters, longer than {MAX_ID_CHARS}")


def _check_map(entries: Mapping[str, object], where: str) -> None:
    if len(entries) > MAX_METADATA_ENTRIES:
        raise InvalidGroup(f"{where} has {len(entries)} entries, more than {MAX_METADATA_ENTRIES}")
    for key in entries:
        if len(key) > MAX_KEY_CHARS:
            raise InvalidGroup(f"{where} has a key of {len(key)} characters, longer than {MAX_KEY_CHARS}")


def check_structure(group: common_pb2.Group) -> None:
    """The checks that do not read token arrays: ids, bounds, maps, trace context, reward parts.

    Cheap (per sample, not per token), so both the wire fast path and the full decode run it."""
    if not group.group_id:
        raise InvalidGroup("group.group_id must be set")
    if len(group.group_id) > MAX_ID_CHARS:
        raise InvalidGroup(f"group.group_id is longer than {MAX_ID_CHARS} characters")
    if _CONTROL.search(group.group_id):
        raise InvalidGroup("group.group_id holds a control character")
    if not group.samples:
        raise InvalidGroup(f"group {group.group_id}: group.samples is empty (a group has at least one sample)")
    where = f"group {group.group_id}"
    if len(group.samples) > MAX_SAMPLES:
        raise InvalidGroup(f"{where}: group.samples has {len(group.samples)} samples, more than {MAX_SAMPLES}")
    check_id(group.prompt_id, f"{where}: group.prompt_id", required=False)
    check_id(group.producer_id, f"{where}: group.producer_id", required=False)
    if len(group.trace_context.traceparent) > MAX_TRACEPARENT_CHARS:
        raise InvalidGroup(
            f"{where}: group.trace_context.traceparent is longer than {MAX_TRACEPARENT_CHARS} characters"
        )
    if len(group.trace_context.tracestate) > MAX_TRACESTATE_CHARS:
        raise InvalidGroup(f"{where}: group.trace_context.tracestate is longer than {MAX_TRACESTATE_CHARS} characters")
    _check_map(group.metadata, f"{where}: group.metadata")
    if group.HasField("created_at"):  # (what google.protobuf.Timestamp allows: years 1 to 9999)
        seconds, nanos = group.created_at.seconds, group.created_at.nanos
        if not TIMESTAMP_SECONDS[0] <= seconds <= TIMESTAMP_SECONDS[1] or not 0 <= nanos <= 999_999_999:
            raise InvalidGroup(f"{where}: group.created_at is not a valid google.protobuf.Timestamp")
    if group.HasField("baseline_reward") and not abs(group.baseline_reward) <= MAX_ABS_REWARD:
        raise InvalidGroup(f"{where}: group.baseline_reward is not finite, or beyond ±{MAX_ABS_REWARD:g}")
    if group.prompt_parts:
        prompt_parts(group, STRUCTURE_ONLY)
    seen_ids: set[str] = set()
    for i, s in enumerate(group.samples):
        sample_id, reward = s.sample_id, s.reward
        if (  # the common case at a glance: no map, short strings, a finite score (no path built)
            sample_id not in seen_ids
            and len(sample_id) <= MAX_ID_CHARS
            and not s.metadata
            and not reward.components
            and len(reward.message) <= MAX_REWARD_MESSAGE_CHARS
            and abs(reward.score) <= MAX_ABS_REWARD  # (False for NaN)
            and not _CONTROL.search(sample_id)
            and s.finish_reason in _FINISH_REASONS
            and reward.status in _REWARD_STATUSES
        ):
            seen_ids.add(sample_id)
            continue
        at = f"{where}: samples[{i}]"
        if len(s.sample_id) > MAX_ID_CHARS:
            raise InvalidGroup(f"{at}.sample_id is longer than {MAX_ID_CHARS} characters")
        if _CONTROL.search(s.sample_id):
            raise InvalidGroup(f"{at}.sample_id holds a control character")
        if s.sample_id in seen_ids:
            raise InvalidGroup(f"{at}.sample_id {s.sample_id!r} repeats within the group")
        if s.finish_reason not in _FINISH_REASONS:  # (an open enum keeps values no name matches)
            raise InvalidGroup(f"{at}.finish_reason {s.finish_reason} is not a FinishReason")
        if reward.status not in _REWARD_STATUSES:
            raise InvalidGroup(f"{at}.reward.status {reward.status} is not a RewardStatus")
        seen_ids.add(s.sample_id)
        _check_map(s.metadata, f"{at}.metadata")
        reward = s.reward
        if not abs(reward.score) <= MAX_ABS_REWARD:
            raise InvalidGroup(f"{at}.reward.score is not finite, or beyond ±{MAX_ABS_REWARD:g}")
        _check_map(reward.components, f"{at}.reward.components")
        for name, value in reward.components.items():
            if not math.isfinite(value):
                raise InvalidGroup(f"{at}.reward.components[{name[:64]!r}] is not finite")
        if len(reward.message) > MAX_REWARD_MESSAGE_CHARS:
            raise InvalidGroup(f"{at}.reward.message is longer than {MAX_REWARD_MESSAGE_CHARS} characters")


STRUCTURE_ONLY = media.MediaLimits()  # the contract's wire bounds; decoding is check_media's


def prompt_parts(group: common_pb2.Group, limits: media.MediaLimits, *, decode: bool = False) -> list[media.PromptPart]:
    """The group's prompt parts, checked: their structure and bounds, and with ``decode`` the full decode of
    every media part (against the sizes it gives). Errors name the part."""
    where = f"group {group.group_id}: group.prompt_parts"
    try:
        parts = media_wire.checked_parts(group.prompt_parts, where, limits)
        if decode:
            media.validate(parts, limits, where)
    except media.InvalidMedia as e:
        raise InvalidGroup(str(e)) from e
    return parts


def group_to_record(group: common_pb2.Group, max_group_bytes: int) -> GroupRecord:
    """Validates ``group`` and turns it into what the queue stores."""
    check_structure(group)
    behaviour = None
    newest = 0
    n_tokens = 0
    for i, s in enumerate(group.samples):
        where = f"group {group.group_id}: samples[{i}]"
        n = len(s.completion_token_ids)
        if not s.prompt_token_ids:
            raise InvalidGroup(f"{where}.prompt_token_ids is empty")
        if n == 0:
            raise InvalidGroup(f"{where}.completion_token_ids is empty")
        for name, ids in (("prompt_token_ids", s.prompt_token_ids), ("completion_token_ids", s.completion_token_ids)):
            if min(ids) < 0:  # (no embedding has a row for it: the trainer's lookup raised)
                raise InvalidGroup(f"{where}.{name} holds a negative token id")
        if len(s.behaviour_logprobs) != n:  # (required: the trainer's loss needs one per token)
            raise InvalidGroup(
                f"{where}.behaviour_logprobs has {len(s.behaviour_logprobs)} entries for {n} completion tokens"
            )
        for name, field in (
            ("token_versions", s.token_versions),
            ("loss_mask", s.loss_mask),
        ):
            if field and len(field) != n:
                raise InvalidGroup(f"{where}.{name} has {len(field)} entries for {n} completion tokens")
        # (no sum: fsum of [inf, -inf] raises instead of saying which field is wrong)
        if s.behaviour_logprobs and not all(math.isfinite(x) and x <= MAX_LOGPROB for x in s.behaviour_logprobs):
            raise InvalidGroup(f"{where}.behaviour_logprobs must be finite log-probabilities (<= 0)")
        if s.token_versions:
            oldest = min(s.token_versions)
            if s.behaviour_version and s.behaviour_version != oldest:
                raise InvalidGroup(
                    f"{where}.behaviour_version={s.behaviour_version} differs from min(token_versions)={oldest}"
                )
            newest = max(newest, max(s.token_versions))
        else:
            oldest = s.behaviour_version
            newest = max(newest, oldest)
        behaviour = oldest if behaviour is None else min(behaviour, oldest)
        n_tokens += len(s.prompt_token_ids) + n
    payload = group.SerializeToString()
    if len(payload) > max_group_bytes:
        raise GroupTooLarge(f"group {group.group_id} is {len(payload)} bytes, over the limit of {max_group_bytes}")
    assert behaviour is not None
    media_parts = sum(p.HasField("media") for p in group.prompt_parts)
    return GroupRecord(group.group_id, payload, behaviour, n_tokens, newest_version=newest, media_parts=media_parts)


def ticket_to_proto(ticket: Ticket) -> queue_pb2.Ticket:
    return queue_pb2.Ticket(
        ticket_id=ticket.ticket_id,
        n_groups=ticket.n_groups,
        min_policy_version=ticket.min_policy_version,
        expires_at=timestamp(ticket.expires_at),
    )


def lease_to_proto(lease: Lease) -> queue_pb2.Lease:
    return queue_pb2.Lease(lease_id=lease.lease_id, deadline=timestamp(lease.deadline))


def stats_to_proto(stats: Stats) -> queue_pb2.StatsResponse:
    return queue_pb2.StatsResponse(
        trainer_version=stats.trainer_version,
        max_staleness=stats.max_staleness,
        groups_per_step=stats.groups_per_step,
        depth_groups=stats.depth_groups,
        depth_bytes=stats.depth_bytes,
        leased_groups=stats.leased_groups,
        reserved_groups=stats.reserved_groups,
        accepted_groups=stats.accepted_groups,
        acked_groups=stats.acked_groups,
        evicted_groups=stats.evicted_groups,
        expired_leases=stats.expired_leases,
        capacity_groups=stats.capacity_groups,
        capacity_bytes=stats.capacity_bytes,
        wal_bytes=stats.wal_bytes,
    )
