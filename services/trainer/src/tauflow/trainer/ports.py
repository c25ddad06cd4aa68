"""What the training loop needs from the outside, as interfaces: the loop itself never imports grpc."""

from __future__ import annotations

from collections.abc import Mapping
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


class QueuePort(Protocol):
    async def set_version(self, version: int, rebase: bool = False) -> None: ...

    async def get_batch(self, n_groups: int, consumer_version: int, wait_s: float, lease_s: float) -> Batch | None: ...

    async def ack(self, lease_id: str) -> None: ...

    async def renew(self, lease_id: str, lease_s: float) -> None: ...


class PublisherPort(Protocol):
    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> None:
        """Hands ``version`` over; returns once ``tensors`` may change again."""
