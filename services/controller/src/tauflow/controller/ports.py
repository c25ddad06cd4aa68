"""What the controller needs of the outside, as interfaces; app.py wires the gRPC clients of adapters/.

The run follows four services (the trainer's steps and state, the queue's counters, greedy answers from the
rollout engine and their scores from the reward service), checks each role's build and contracts when it
is up (``CheckPeer``), and the launchers ask a role's gRPC health (``HealthCheck``). A call that fails
raises :class:`PeerError`; :class:`PeerUnavailable` when the service did not answer (it may be restarting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from tauflow.media import PromptPart


class PeerError(RuntimeError):
    """A call to a service failed; ``code`` is the gRPC status code's name."""

    def __init__(self, role: str, code: str, details: str = "") -> None:
        super().__init__(f"{role}: {code}" + (f": {details}" if details else ""))
        self.role, self.code, self.details = role, code, details


class PeerUnavailable(PeerError):
    """The service did not answer in time, was stopping (tauflow.core.status.TRANSIENT) or had no call slot free
    (RESOURCE_EXHAUSTED): ask again later."""


@dataclass(frozen=True)
class ChatPrompt:
    """A held-out prompt as a chat: the rollout server applies the model's chat template."""

    messages: list[dict[str, str]]


# A held-out prompt in the form its data set row gave: text, a chat, multimodal parts, or token ids.
HeldOutPrompt = str | ChatPrompt | list[PromptPart] | list[int]


@dataclass(frozen=True)
class GreedySampling:
    """How held-out answers end: the training's stop strings, stop token ids and length (0: the server's)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 0


SERVER_DEFAULTS = GreedySampling()


@dataclass(frozen=True)
class TrainerStep:
    """One optimizer step as the trainer lists it."""

    step: int
    policy_version: int
    mean_reward: float
    max_staleness: int
    mean_staleness: float
    loss: float
    trained_tokens: int
    groups: int
    metrics: dict[str, float]
    groups_by_staleness: dict[int, int]
    committed_at: float | None  # Unix time the trainer committed it; None where it did not say


@dataclass(frozen=True)
class TrainerStatus:
    state: str  # the TrainerState's name, e.g. TRAINER_STATE_WAITING_FOR_DATA
    policy_version: int
    finished: bool  # its last step is committed and checkpointed, its leases acked
    last_error: str = ""  # its last failure, or the peer call it is retrying ("" when none)


@dataclass(frozen=True)
class QueueStats:
    depth_groups: int
    reserved_groups: int
    trainer_version: int  # the version the trainer last reported to the queue
    leased_groups: int = 0  # held by the trainer: acked only once a checkpoint holds their steps
    capacity_groups: int = 0  # 0: not known


@dataclass(frozen=True)
class Completion:
    """The rollout engine's greedy answer to one prompt."""

    behaviour_versions: tuple[int, ...]  # the policy version of each of its samples
    samples: Any  # the samples as the engine sent them: the reward service scores them unchanged


@dataclass(frozen=True)
class ToScore:
    """A held-out prompt's completion, with the reward's metadata (the answer it should give, and more)."""

    group_id: str
    metadata: dict[str, str]
    completion: Completion


@dataclass(frozen=True)
class SidecarMember:
    """A rollout server as the weight sidecar lists it (how the controller sees replicas it did not start)."""

    member_id: str
    address: str
    confirmed_version: int | None


class TrainerPort(Protocol):
    async def list_steps(self, from_step: int) -> list[TrainerStep]: ...

    async def status(self) -> TrainerStatus: ...

    async def set_max_staleness(self, tau: int) -> None: ...

    async def resume(self) -> None: ...  # a trainer started paused (start_paused) takes its steps; idempotent

    async def close(self) -> None: ...


class QueuePort(Protocol):
    async def stats(self) -> QueueStats: ...

    async def set_max_staleness(self, tau: int) -> None: ...

    async def close(self) -> None: ...


class WeightsPort(Protocol):
    async def members(self) -> list[SidecarMember]: ...

    async def close(self) -> None: ...


class RolloutPort(Protocol):
    async def generate_greedy(
        self, prompt: HeldOutPrompt, timeout_s: float, sampling: GreedySampling = SERVER_DEFAULTS
    ) -> Completion: ...

    async def close(self) -> None: ...


class RewardPort(Protocol):
    async def score(self, groups: Sequence[ToScore], reward_fn: str, timeout_s: float) -> list[float]:
        """The score of every sample, group after group."""
        ...

    async def close(self) -> None: ...


@dataclass
class Peers:
    """The clients of one follow of the run, closed together (``async with``). The rollout role may have
    several servers, each with its own client (``rollouts``); ``rollout`` is the first's."""

    trainer: TrainerPort
    queue: QueuePort
    rollout: RolloutPort
    reward: RewardPort
    weights: WeightsPort
    rollout_at: Callable[[str], RolloutPort]  # a client of the rollout server at an address
    replicas: dict[str, RolloutPort] = field(default_factory=dict)  # address -> client, beside ``rollout``

    async def rollouts(self, addresses: Sequence[str]) -> list[RolloutPort]:
        """Clients of the rollout servers at ``addresses`` (made once each; those of servers gone are closed)."""
        for address in [a for a in self.replicas if a not in addresses]:
            await self.replicas.pop(address).close()
        return [self.replicas.setdefault(a, self.rollout_at(a)) for a in addresses] or [self.rollout]

    async def close(self) -> None:
        clients: list[TrainerPort | QueuePort | RolloutPort | RewardPort | WeightsPort] = [
            self.trainer,
            self.queue,
            self.rollout,
            self.reward,
            self.weights,
            *self.replicas.values(),
        ]
        for client in clients:
            await client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Connect(Protocol):
    def __call__(self, addresses: Mapping[str, str]) -> Peers:
        """Clients of the roles at ``addresses`` (role -> host:port)."""
        ...


class CheckPeer(Protocol):
    async def __call__(
        self,
        role: str,
        address: str,
        records: dict[str, dict[str, Any]],
        name: str = "",
        follower: bool = False,
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        """Asks the service of ``role`` at ``address`` what it is, records it in ``records[name or role]``,
        and raises a LaunchFailed when this controller cannot talk to it (a ``follower``, a trainer rank
        other than 0, serves no contract of its role: its role alone is checked); PeerUnavailable when it
        does not answer within ``timeout_s``."""
        ...


class HealthCheck(Protocol):
    def __call__(self, address: str, timeout_s: float) -> tuple[bool, str]:
        """``(serving, answer)``: whether the server at ``address`` answers SERVING within ``timeout_s``."""
        ...
