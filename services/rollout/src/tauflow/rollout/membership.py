"""Membership of the weight sidecar, kept up.

The rollout server joins the sidecar once it serves (the sidecar calls back into it), then checks every
``check_every_s`` that the sidecar still lists it as a member (joining or active, at this address), and
joins again when it does not: a restarted sidecar has forgotten its members, and one that dropped this
server after a failed phase (state FAILED) sends it nothing until it joins again. Without this the
server would keep generating with its old weights and the run would stall.

Before a re-join the server forgets its weight group: the sidecar that built it is gone or has dropped
this server, and a restarted sidecar counts its membership epochs from 1 again, on a new store.

No grpc here: the sidecar is reached through ``ports.SidecarPort`` (``adapters/weights_client.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.ports import SidecarPort, SidecarUnavailable

log = logging.getLogger(__name__)


class SidecarMembership:
    def __init__(
        self,
        sidecar: SidecarPort,
        member_id: str,
        address: str,
        loaded_version: Callable[[], int],
        forget_group: Callable[[], None],
        check_every_s: float = 3.0,
        metrics: RolloutMetrics | None = None,
    ) -> None:
        self.sidecar = sidecar
        self.member_id = member_id
        self.address = address
        self.loaded_version = loaded_version
        self.forget_group = forget_group  # blocking (it waits for a receive in progress): run in a thread
        self.check_every_s = check_every_s
        self.metrics = metrics or RolloutMetrics.null()
        self.joins = 0

    async def run(self) -> None:
        """Joins, then keeps the membership up until cancelled. An error other than SidecarUnavailable
        (a model the sidecar refuses, …) ends it: the service stops and says why."""
        unavailable = False
        while True:
            try:
                if self.joins == 0 or not await self.sidecar.is_member(self.member_id, self.address):
                    await self._join()
                unavailable = False
            except SidecarUnavailable as e:
                if not unavailable:  # once per outage, not every check
                    log.warning("weight sidecar unavailable; checking again", extra={"error": str(e)})
                unavailable = True
            await asyncio.sleep(self.check_every_s)

    async def _join(self) -> None:
        if self.joins:
            log.warning(
                "the weight sidecar no longer lists this server (it restarted, or dropped it after a failed "
                "phase); joining again",
                extra={"member_id": self.member_id},
            )
        await asyncio.to_thread(self.forget_group)
        await self.sidecar.join(self.member_id, self.address, self.loaded_version())
        self.joins += 1
        self.metrics.sidecar_joins.inc()
        log.info("joined the weight sidecar", extra={"member_id": self.member_id, "joins": self.joins})
