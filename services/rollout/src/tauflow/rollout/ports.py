"""What the rollout's domain needs from the services it calls, and the values and errors that cross to
them: the queue and the reward service (the producer's), and the weight sidecar (membership and weight
loading). app.py wires them with ``adapters/queue_client.py``, ``reward_client.py`` and ``weights_client.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tauflow.rollout.dataset import Prompt
from tauflow.rollout.engine.base import Completion
from tauflow.weightsync import ReceivedVersion

# -- the queue and the reward service ------------------------------------------------------------------


class GroupRejected(Exception):
    """The queue refused a group for good (``reason``, e.g. ``too_large``): sending it again cannot help."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Ticket:
    ticket_id: str
    n_groups: int
    min_policy_version: int


class Reward(Protocol):
    """A sample's reward as the reward port fills it in (the adapters' ``common.v1.Reward``, handed to the
    queue as is); the domain reads only its score. A plain number stands for one in test doubles."""

    @property
    def score(self) -> float: ...


@dataclass
class ProducedGroup:
    group_id: str
    prompt: Prompt
    completions: list[Completion]
    texts: list[str]
    rewards: list[Reward | float] = field(default_factory=list)  # filled by the reward port, one per completion
    producer_id: str = ""
    created_at: float = 0.0
    traceparent: str = ""  # W3C context of the group's `queue.put` span, stored with the group
    tracestate: str = ""
    baseline_reward: float | None = None
    """The reward of the prompt's greedy completion (REMAX's baseline), when the producer made one."""
    encoded: object = field(default=None, init=False, repr=False, compare=False)
    """The adapters' wire form of the group, kept between the reward call and the put (opaque here)."""

    @property
    def behaviour_version(self) -> int:
        """The oldest policy version of any token of the group (0 when it has none)."""
        return min((v for c in self.completions for v in c.versions), default=0)


class QueuePort(Protocol):
    async def reserve(self, request_id: str, n_groups: int, wait_s: float) -> Ticket | None: ...

    async def put(self, group: ProducedGroup, ticket_id: str) -> None:
        """Returns once the queue holds the group (retrying while it is unavailable or full); raises
        GroupRejected when the queue can never take it."""

    async def release(self, ticket_id: str, timeout_s: float | None = None) -> None:
        """Gives back the unused part of a ticket; best effort (an unreleased ticket expires by itself)."""

    async def release_producer(self, timeout_s: float | None = None) -> int | None:
        """Gives back every ticket this producer id holds, and has the queue answer its Reserves still
        waiting ungranted: at the start those of an earlier process (killed, its tickets would hold pacing
        room until their TTL), at the stop this process's own, a ticket granted to a Reserve it gave up on
        included. Returns how many tickets, or None when the queue could not be asked (best effort: an
        unreleased ticket expires by itself)."""


class RewardPort(Protocol):
    async def score(self, groups: Sequence[ProducedGroup]) -> None:
        """Fills ``rewards`` of every group."""


# -- the weight sidecar --------------------------------------------------------------------------------


class SidecarUnavailable(Exception):
    """The sidecar did not answer in time, is down, or has no room for a member: try again later."""


class UnknownVersion(LookupError):
    """The sidecar holds no manifest of the policy version asked for (never published, or no longer retained)."""


class SidecarPort(Protocol):
    async def is_member(self, member_id: str, address: str) -> bool:
        """Whether the sidecar lists ``member_id`` at ``address`` as joining or active (SidecarUnavailable
        when it cannot say now)."""

    async def join(self, member_id: str, address: str, loaded_version: int) -> None:
        """Joins as a member that serves ``loaded_version`` (SidecarUnavailable: try again later)."""

    async def checksum_algorithm(self, policy_version: int) -> str:
        """The checksum algorithm of the manifest of ``policy_version`` (UnknownVersion when the sidecar
        holds none, SidecarUnavailable when it cannot say now)."""

    async def confirm(self, member_id: str, version: ReceivedVersion, traceparent: str, tracestate: str) -> None:
        """Tells the sidecar that ``version`` is loaded; best effort (a failure is logged: the sidecar's
        confirm deadline deals with a member that never confirms)."""
