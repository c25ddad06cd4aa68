"""What the training loop needs from the outside, as interfaces: the loop itself never imports grpc."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tauflow.trainer.batch import Group


@dataclass
class Batch:
    lease_id: str
    groups: list[Group]
    trace_contexts: list[str] = field(default_factory=list)  # W3C traceparent of each group's rollout
    max_staleness: int | None = None  # the τ the queue delivered it under; None: the queue did not say
    # groups of the lease that cannot be trained (id -> why: a sample's log-probs missing, an empty prompt):
    # not in ``groups``, consumed with the lease (acked), logged and counted (skipped_invalid_groups)
    invalid: dict[str, str] = field(default_factory=dict)


class QueuePort(Protocol):
    async def set_version(self, version: int, rebase: bool = False) -> None: ...

    async def get_batch(self, n_groups: int, consumer_version: int, wait_s: float, lease_s: float) -> Batch | None: ...

    async def ack(self, lease_id: str) -> None: ...

    async def nack(self, lease_id: str) -> None:
        """Gives a lease's groups back to the queue, untrained."""
        ...

    async def renew(self, lease_id: str, lease_s: float) -> None: ...


class TeacherPort(Protocol):
    """A teacher served by another deployment (a rollout server hosting it): on-policy distillation's
    per-token log-probs. Called from the backend's worker thread; blocks until they come."""

    def logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float
    ) -> list[list[float]]: ...


class PublisherPort(Protocol):
    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> None:
        """Hands ``version`` over; returns once ``tensors`` may change again."""

    async def latest_version(self) -> int | None:
        """The newest version the sidecar holds, None when it holds none (it restarted before any Publish);
        raises ConnectionError when it cannot be asked now."""
