"""Protobuf <-> domain conversion for the sidecar. Imports the generated messages, never grpc."""

from __future__ import annotations

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.core.protobuf import duration, timestamp
from tauflow.weights.sidecar import Member, MemberState, Sidecar
from tauflow.weightsync import Phase, PhaseError
from tauflow.weightsync.wire import manifest_from_proto, manifest_to_proto  # noqa: F401 - re-exported

PHASES = {
    Phase.HANDOFF: pb.BROADCAST_PHASE_HANDOFF,
    Phase.GROUP_INIT: pb.BROADCAST_PHASE_GROUP_INIT,
    Phase.TRANSFER: pb.BROADCAST_PHASE_TRANSFER,
    Phase.CONFIRM: pb.BROADCAST_PHASE_CONFIRM,
    Phase.GROUP_DESTROY: pb.BROADCAST_PHASE_GROUP_DESTROY,
}
STATES = {
    MemberState.JOINING: pb.MEMBER_STATE_JOINING,
    MemberState.ACTIVE: pb.MEMBER_STATE_ACTIVE,
    MemberState.LEAVING: pb.MEMBER_STATE_LEAVING,
    MemberState.FAILED: pb.MEMBER_STATE_FAILED,
}


def phase_error_to_proto(err: PhaseError, at: float | None) -> pb.PhaseError:
    out = pb.PhaseError(
        phase=PHASES[err.phase],
        peer=err.peer,
        policy_version=err.policy_version or 0,
        membership_epoch=err.membership_epoch or 0,
        bucket_index=err.bucket_index or 0,
        message=str(err),
    )
    if err.timed_out and err.deadline_s is not None:
        out.deadline.CopyFrom(duration(err.deadline_s))
    if at is not None:
        out.occurred_at.CopyFrom(timestamp(at))
    return out


def phase_deadlines(s: Sidecar) -> list[pb.PhaseDeadline]:
    return [pb.PhaseDeadline(phase=PHASES[p], deadline=duration(d)) for p, d in s.settings.deadlines().items()]


def member_to_proto(m: Member) -> pb.Member:
    out = pb.Member(
        member_id=m.member_id,
        address=m.address,
        num_ranks=m.num_ranks,
        rank_offset=m.rank_offset if m.state in (MemberState.ACTIVE, MemberState.LEAVING) else 0,
        state=STATES[m.state],
        joined_at=timestamp(m.joined_at),
    )
    if m.confirmed_version is not None:
        out.confirmed_policy_version = m.confirmed_version
    if m.last_error is not None:
        out.last_error.CopyFrom(phase_error_to_proto(m.last_error, m.error_at))
    return out


def status_to_proto(s: Sidecar) -> pb.GetStatusResponse:
    out = pb.GetStatusResponse(
        membership_epoch=s.epoch,
        members=[member_to_proto(m) for m in s.members.values()],
        backend=s.settings.backend,
        phase_deadlines=phase_deadlines(s),
    )
    if s.latest is not None:
        out.latest_policy_version = s.latest.manifest.policy_version
    if s.confirmed_version is not None:
        out.confirmed_policy_version = s.confirmed_version
    p = s.progress
    if p is not None:
        out.broadcast.CopyFrom(pb.BroadcastProgress(
            policy_version=p.policy_version, membership_epoch=p.membership_epoch, phase=PHASES[p.phase],
            buckets_sent=p.buckets_sent, bucket_count=p.bucket_count, bytes_sent=p.bytes_sent,
            started_at=timestamp(p.started_at),
        ))
        if p.phase_deadline is not None:
            out.broadcast.phase_deadline.CopyFrom(timestamp(p.phase_deadline))
    if s.last_error is not None:
        out.last_error.CopyFrom(phase_error_to_proto(s.last_error, s.last_error_at))
    return out
