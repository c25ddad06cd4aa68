"""What the controller's tests share: a count of the gRPC channels the controller opens and closes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self

import pytest

from tauflow.controller.adapters import compat, queue_client, reward_client, rollout_client, trainer_client

CHANNEL_OPENERS = (trainer_client, queue_client, rollout_client, reward_client, compat)


class CountedChannel:
    """A grpc.aio channel that records whether it was closed."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def close(self, grace: float | None = None) -> None:
        self.closed = True
        await self._channel.close(grace)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@pytest.fixture
def channels(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CountedChannel]]:
    """Every channel the controller's adapters open, from now on."""
    opened: list[CountedChannel] = []
    for module in CHANNEL_OPENERS:
        create = module.create_channel

        def counted(*args: Any, _create: Any = create, **kwargs: Any) -> CountedChannel:
            opened.append(CountedChannel(_create(*args, **kwargs)))
            return opened[-1]

        monkeypatch.setattr(module, "create_channel", counted)
    yield opened
