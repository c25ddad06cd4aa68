"""The members (rollout servers) of the sidecar: Join, Leave, ConfirmVersion, and dropping a failed one.

A member joins JOINING, becomes ACTIVE in the next group built, LEAVING when it leaves while in the
group (removed when the next group is built), FAILED when dropped after a failed phase (it must Join
again). The membership epoch counts the groups built; the ids of the current group's members, in rank
order, tell the broadcast loop when the group must be rebuilt.

A FAILED member is kept, with its error, for GetStatus, but the sidecar calls it no more: its channel is
closed (once its group is destroyed, when it was in one), and only the ``max_members`` latest failures
are kept (Joins at an unreachable address would otherwise grow the membership without bound).
"""

from __future__ import annotations

import enum
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tauflow.weights.config import WeightsConfig
from tauflow.weights.errors import DataLoss, FailedPrecondition, InvalidRequest, NotFound, ResourceExhausted
from tauflow.weights.events import Events, log
from tauflow.weights.metrics import WeightsMetrics
from tauflow.weights.ports import MemberClient, MemberClientFactory
from tauflow.weights.retention import Retention, Version
from tauflow.weightsync import Phase, PhaseError
from tauflow.weightsync.manifest import shown

KEEP_SENT = 8  # versions per member a late ConfirmVersion is checked against (the last ones sent to it)
MAX_RANKS_PER_MEMBER = 1024  # devices of one rollout server; a client's num_ranks sizes the next weight group
# The bounds of a member's request fields (the servicer checks them before any handler runs; README "Bounds").
MAX_MEMBER_ID_CHARS = 256  # a member_id (a rollout server's server_id)
MAX_ADDRESS_CHARS = 300  # host:port (a DNS name is at most 253 characters)
MAX_BACKENDS = 16  # backends a Join names (tauflow's rollout servers name 3)
MAX_BACKEND_CHARS = 32  # characters of one backend name ("gloo", "nccl", "ipc")
MAX_REASON_CHARS = 256  # a Leave's reason (logged)
_DIGITS = re.compile(r"\d+")
# host:port of a member's RolloutService: a DNS name or IPv4 address, or an IPv6 one in brackets
_HOST_PORT = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")


class MemberState(enum.Enum):
    JOINING = 1
    ACTIVE = 2
    LEAVING = 3
    FAILED = 4


@dataclass
class Member:
    member_id: str
    address: str
    num_ranks: int
    joined_at: float
    client: MemberClient
    state: MemberState = MemberState.JOINING
    rank_offset: int = 0
    confirmed_version: int | None = None
    confirmed_checksum: str | None = None
    # (version, checksum) of the versions broadcast to it, in the order they were sent, the last sent last.
    # Send order, not version numbers, says which of two versions is the newer for this member: a trainer resumed
    # from a checkpoint publishes an older number (rebase), and the same number with other weights.
    sent: OrderedDict[tuple[int, str], None] = field(default_factory=OrderedDict)
    last_error: PhaseError | None = None
    error_at: float | None = None
    unreachable: bool = False  # dropped because nothing answered at its address

    def has(self, version: Version) -> bool:
        return self.confirmed_version == version.manifest.policy_version and (
            self.confirmed_checksum is None or self.confirmed_checksum == version.manifest.checksum
        )

    def record_sent(self, version: int, checksum: str) -> None:
        """``version`` (with ``checksum``) is being broadcast to this member: it is now the last one sent."""
        key = (version, checksum)
        self.sent[key] = None
        self.sent.move_to_end(key)
        while len(self.sent) > KEEP_SENT:
            self.sent.popitem(last=False)  # the one sent longest ago

    def sent_position(self, version: int | None, checksum: str | None) -> int:
        """Where (version, checksum) is in the send order; -1 when not among the versions kept (a version
        loaded before it joined, or sent before all of them)."""
        for i, key in enumerate(self.sent):
            if key == (version, checksum):
                return i
        return -1


class Membership:
    def __init__(
        self,
        config: WeightsConfig,
        retention: Retention,
        clients: MemberClientFactory,
        events: Events,
        metrics: WeightsMetrics,
    ) -> None:
        self.config = config
        self.retention = retention
        self.clients = clients
        self.events = events
        self.metrics = metrics
        self.members: dict[str, Member] = {}
        self.epoch = 0
        self.group_ids: list[str] = []  # the members of the current group, in rank order
        self.group_broken = False  # a member of the current group failed or rejoined: rebuild it

    def eligible(self) -> list[Member]:
        """The members the next group is built of, in rank order."""
        return sorted(
            (m for m in self.members.values() if m.state in (MemberState.JOINING, MemberState.ACTIVE)),
            key=lambda m: (m.joined_at, m.member_id),
        )

    def group_outdated(self) -> bool:
        return self.group_broken or self.group_ids != [m.member_id for m in self.eligible()]

    def counts(self) -> dict[str, int]:
        counts = {state: 0 for state in MemberState}
        for m in self.members.values():
            counts[m.state] += 1
        return {state.name.lower(): n for state, n in counts.items()}

    # -- the group's roster, as the broadcast loop rebuilds it --

    def forget_group(self) -> list[str]:
        """The current group is being destroyed: returns the ids of its members."""
        ids, self.group_ids, self.group_broken = self.group_ids, [], False
        return ids

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def settle_destroyed(self, old_members: list[Member]) -> None:
        """After the old group's destroy: members that left are removed, active ones join the next group."""
        for m in old_members:
            if m.state is MemberState.LEAVING:
                del self.members[m.member_id]
                self.events.spawn(m.client.close())
            elif m.state is MemberState.ACTIVE:
                m.state = MemberState.JOINING
            elif m.state is MemberState.FAILED:
                self.events.spawn(m.client.close())
        self._forget_old_failures()

    def drop(self, m: Member, err: PhaseError) -> None:
        """A member that failed a phase leaves the membership; it must Join again."""
        m.state = MemberState.FAILED
        m.last_error = err
        m.error_at = self.events.clock()
        self.events.record(err)
        if m.member_id in self.group_ids:
            self.group_broken = True  # (its client is closed once the group's destroy has been sent to it)
        else:
            self.events.spawn(m.client.close())
        self._forget_old_failures()
        self.events.notify()

    def _forget_old_failures(self) -> None:
        """Removes the oldest FAILED members beyond ``max_members`` (but those of the current group: its
        destroy is still to be sent to them)."""
        failed = [
            m for m in self.members.values() if m.state is MemberState.FAILED and m.member_id not in self.group_ids
        ]
        failed.sort(key=lambda m: m.error_at or 0.0)
        for m in failed[: max(len(failed) - self.config.max_members, 0)]:
            del self.members[m.member_id]

    def join(
        self,
        member_id: str,
        address: str,
        num_ranks: int,
        backends: Sequence[str],
        loaded_version: int | None,
        model: str,
    ) -> int:
        """Adds (or re-adds) a member; returns the epoch from which it takes part. Of ``backends`` and ``model``
        nothing is kept: they are checked against the sidecar's backend and the published model, here."""
        backend = self.config.backend
        if not member_id or not address:
            raise InvalidRequest("member_id and address must be set")
        if not _HOST_PORT.fullmatch(address) or not 1 <= int(address.rsplit(":", 1)[1]) <= 65535:
            raise InvalidRequest(f"address must be host:port (a port in 1..65535), not {shown(address)}")
        if not 1 <= num_ranks <= MAX_RANKS_PER_MEMBER:
            raise InvalidRequest(f"num_ranks must be in 1..{MAX_RANKS_PER_MEMBER}, not {num_ranks}")
        if backend not in backends:
            offered = ", ".join(shown(b, MAX_BACKEND_CHARS) for b in backends[:MAX_BACKENDS])
            more = f", … ({len(backends)} in all)" if len(backends) > MAX_BACKENDS else ""
            raise FailedPrecondition(
                f"member {shown(member_id)} supports backends [{offered}{more}], the sidecar uses {backend!r}"
            )
        latest = self.retention.latest
        if model and latest is not None and latest.manifest.model and model != latest.manifest.model:
            raise FailedPrecondition(
                f"member {shown(member_id)} serves model {shown(model, 256)}, the published weights are for "
                f"{shown(latest.manifest.model, 256)}"
            )
        old = self.members.get(member_id)
        # A Join repeated by a live member changes nothing. A LEAVING member said it was going: a Join under its
        # id is its restarted process (a rolling restart reuses the id and the port), a new member to bring up
        # to date, which must not be mistaken for the old one (it would never get a broadcast). So is a Join
        # whose loaded version is not the one the member confirmed: a process killed and restarted on the same
        # port before the sidecar noticed, which serves older weights and is in no group (left as it was, it
        # would wait for a broadcast that only its data could bring about).
        repeated = loaded_version is None or old is None or loaded_version == old.confirmed_version
        if (
            old is not None
            and old.state in (MemberState.JOINING, MemberState.ACTIVE)
            and old.address == address
            and repeated
        ):
            return self.epoch if old.state is MemberState.ACTIVE else self.epoch + 1
        live = [m for m in self.members.values() if m.state is not MemberState.FAILED and m.member_id != member_id]
        if len(live) >= self.config.max_members:
            raise ResourceExhausted(f"the membership is at its maximum of {self.config.max_members} members")
        ranks = sum(m.num_ranks for m in live) + num_ranks
        if ranks > self.config.max_group_ranks:
            raise ResourceExhausted(
                f"num_ranks={num_ranks} would make {ranks} member ranks, above max_group_ranks={self.config.max_group_ranks}"
            )
        if old is not None:
            self.events.spawn(old.client.close())
            if old.member_id in self.group_ids:
                self.group_broken = True
        self.members[member_id] = Member(
            member_id,
            address,
            num_ranks,
            self.events.clock(),
            self.clients(address),
            confirmed_version=_known(loaded_version, latest.manifest.policy_version if latest is not None else 0),
        )
        log.info("member joined", extra={"member_id": member_id, "address": address, "num_ranks": num_ranks})
        self.events.notify()
        return self.epoch + 1

    def leave(self, member_id: str, reason: str = "") -> int:
        if not member_id:
            raise InvalidRequest("member_id must be set")
        m = self.members.get(member_id)
        if m is None:
            return self.epoch
        log.info("member leaves", extra={"member_id": member_id, "reason": reason})
        if m.member_id in self.group_ids and m.state is MemberState.ACTIVE:
            m.state = MemberState.LEAVING  # removed when the next group is built
        else:
            del self.members[member_id]
            self.events.spawn(m.client.close())
        self.events.notify()
        return self.epoch

    def confirm(
        self, member_id: str, version: int, manifest_checksum: str, loaded_checksum: str, load_s: float | None = None
    ) -> int | None:
        """Records that a member swapped ``version`` in; returns the newest accepted version.

        A confirm is judged by the order the versions were sent to the member, not by their numbers: it is
        refused (stale) only when the member already confirmed a version sent to it after this one. After a
        rebase the sidecar sends an older number (or the same number with other weights) than the member
        confirmed, and that version's confirm must count."""
        try:
            return self._confirm(member_id, version, manifest_checksum, loaded_checksum, load_s)
        except (InvalidRequest, NotFound, FailedPrecondition) as e:
            self.events.warn_limited(
                ("confirm", member_id[:128], _DIGITS.sub("N", str(e)[:160])),  # (per member and kind of refusal)
                "ConfirmVersion refused",
                {"member_id": member_id[:128], "policy_version": version, "reason": str(e)},
            )
            raise

    def _confirm(
        self, member_id: str, version: int, manifest_checksum: str, loaded_checksum: str, load_s: float | None
    ) -> int | None:
        if not member_id:
            raise InvalidRequest("member_id must be set")
        m = self.members.get(member_id)
        if m is None:
            raise NotFound(f"{shown(member_id)} is not a member (Join first)")
        if m.state is MemberState.FAILED:
            raise NotFound(f"{shown(member_id)} was dropped ({m.last_error}); Join again")
        latest = self.retention.latest_version
        sent = [checksum for v, checksum in m.sent if v == version]  # oldest first
        if not sent:
            raise FailedPrecondition(f"version {version} was never broadcast to {shown(member_id)}")
        key = (version, manifest_checksum)
        if (m.confirmed_version, m.confirmed_checksum) == key and manifest_checksum in sent:
            return latest  # a repeat
        if manifest_checksum not in sent or (loaded_checksum and loaded_checksum != manifest_checksum):
            err = PhaseError(
                Phase.CONFIRM,
                member_id,
                f"checksum mismatch: the manifest of version {version} has {sent[-1]}, the member reports "
                f"manifest_checksum {shown(manifest_checksum)} and loaded_checksum {shown(loaded_checksum)}",
                policy_version=version,
                membership_epoch=self.epoch,
            )
            self.drop(m, err)
            raise DataLoss(str(err))
        if m.sent_position(version, manifest_checksum) < m.sent_position(m.confirmed_version, m.confirmed_checksum):
            raise FailedPrecondition(
                f"version {version} is older than version {m.confirmed_version} it confirmed (it was sent to "
                f"{shown(member_id)} before that one)"
            )
        m.confirmed_version = version
        m.confirmed_checksum = manifest_checksum
        if load_s is not None:
            self.metrics.load_seconds.observe(load_s)
        self.events.notify()
        return latest


def _known(loaded_version: int | None, newest: int) -> int | None:
    """The version a joining member is taken to have loaded. One above the newest published version (above 0, the
    initial checkpoint's, before any Publish) is none this sidecar made: a stale claim (a member that served a
    version a resumed trainer has since re-based away, or a sidecar restarted) or a made-up one (2^64 - 1 was
    shown as its confirmed version). It is taken as unknown, as an unset one: the member gets the newest version
    at the next broadcast, which it needs either way (its weights are not the newest's)."""
    if loaded_version is None or loaded_version > newest:
        return None
    return loaded_version
