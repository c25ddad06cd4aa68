"""Protobuf <-> domain conversion for the sidecar's status. Imports the generated messages, never grpc;
the manifest's conversion is tauflow.weightsync.wire's."""

from __future__ import annotations

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.core.protobuf import duration, timestamp
from tauflow.weights.membership import Member, MemberState
from tauflow.weights.sidecar import Status
from tauflow.weightsync import Phase, PhaseError

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


def phase_deadlines(deadlines: dict[Phase, float]) -> list[pb.PhaseDeadline]:
    return [pb.PhaseDeadline(phase=PHASES[p], deadline=duration(d)) for p, d in deadlines.items()]


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


def status_to_proto(status: Status) -> pb.GetStatusResponse:
    out = pb.GetStatusResponse(
        membership_epoch=status.membership_epoch,
        members=[member_to_proto(m) for m in status.members],
        backend=status.backend,
        phase_deadlines=phase_deadlines(status.phase_deadlines),
    )
    if status.latest_version is not None:
        out.latest_policy_version = status.latest_version
    if status.confirmed_version is not None:
        out.confirmed_policy_version = status.confirmed_version
    progress = status.progress
    if progress is not None:
        out.broadcast.CopyFrom(
            pb.BroadcastProgress(
                policy_version=progress.policy_version,
                membership_epoch=progress.membership_epoch,
                phase=PHASES[progress.phase],
                buckets_sent=progress.buckets_sent,
                bucket_count=progress.bucket_count,
                bytes_sent=progress.bytes_sent,
                started_at=timestamp(progress.started_at),
            )
        )
        if progress.phase_deadline is not None:
            out.broadcast.phase_deadline.CopyFrom(timestamp(progress.phase_deadline))
    if status.last_error is not None:
        out.last_error.CopyFrom(phase_error_to_proto(status.last_error, status.last_error_at))
    return out
