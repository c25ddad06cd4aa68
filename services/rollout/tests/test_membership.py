"""The rollout server's membership of the weight sidecar, against a fake sidecar: it re-joins a sidecar that
forgot it (restart) or dropped it (FAILED), after forgetting its weight group, and rides out an outage."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tauflow.rollout.membership import SidecarMembership
from tauflow.rollout.metrics import RolloutMetrics
from tauflow.rollout.ports import SidecarUnavailable


class FakeSidecar:
    def __init__(self) -> None:
        self.members: dict[str, str] = {}  # member id -> address, of joining/active members
        self.down = False
        self.refuse: Exception | None = None
        self.log: list[tuple[str, ...]] = []  # what happened, in order (the server's resets too)
        self.checks = 0  # is_member calls answered
        self.refused = 0  # calls refused while down

    async def is_member(self, member_id: str, address: str) -> bool:
        if self.down:
            self.refused += 1
            raise SidecarUnavailable("GetStatus: UNAVAILABLE")
        self.checks += 1
        return self.members.get(member_id) == address

    async def join(self, member_id: str, address: str, loaded_version: int) -> None:
        if self.down:
            self.refused += 1
            raise SidecarUnavailable("Join: UNAVAILABLE")
        if self.refuse is not None:
            raise self.refuse
        self.members[member_id] = address
        self.log.append(("join", member_id, address, str(loaded_version)))


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
def setup():
    sidecar, version, registry = FakeSidecar(), [3], CollectorRegistry()
    membership = SidecarMembership(
        sidecar,
        "rollout-0",
        "127.0.0.1:7000",
        lambda: version[0],
        lambda: sidecar.log.append(("forget",)),
        check_every_s=0.02,
        metrics=RolloutMetrics(registry),
    )
    return sidecar, membership, version, registry


async def test_rejoins_a_sidecar_that_forgot_or_dropped_it(setup) -> None:
    sidecar, membership, version, registry = setup
    task = asyncio.create_task(membership.run())
    try:
        await eventually(lambda: membership.joins == 1)
        assert sidecar.log == [("forget",), ("join", "rollout-0", "127.0.0.1:7000", "3")]
        checks = sidecar.checks
        await eventually(lambda: sidecar.checks >= checks + 3)
        assert membership.joins == 1  # still listed: no re-join

        version[0] = 5
        sidecar.members.clear()  # a restarted sidecar knows no member
        await eventually(lambda: membership.joins == 2)
        # the old group is forgotten before the join, and the join says which version is loaded
        assert sidecar.log[2:] == [("forget",), ("join", "rollout-0", "127.0.0.1:7000", "5")]

        sidecar.members["rollout-0"] = "127.0.0.1:9999"  # listed, but not at this server's address
        await eventually(lambda: membership.joins == 3)
        assert sidecar.members["rollout-0"] == "127.0.0.1:7000"
        assert registry.get_sample_value("tauflow_rollout_sidecar_joins_total") == 3
    finally:
        task.cancel()


async def test_rides_out_a_sidecar_outage_and_joins_when_it_is_back(setup) -> None:
    sidecar, membership, _, _ = setup
    sidecar.down = True
    task = asyncio.create_task(membership.run())
    try:
        await eventually(lambda: sidecar.refused >= 3)  # it keeps trying
        assert not task.done() and membership.joins == 0
        sidecar.down = False
        await eventually(lambda: membership.joins == 1)
        sidecar.down = True  # the sidecar goes away and comes back without its members
        refused = sidecar.refused
        await eventually(lambda: sidecar.refused > refused)
        sidecar.members.clear()
        sidecar.down = False
        await eventually(lambda: membership.joins == 2)
    finally:
        task.cancel()


async def test_a_refusal_that_no_retry_cures_stops_it(setup) -> None:
    sidecar, membership, _, _ = setup
    sidecar.refuse = ValueError("FAILED_PRECONDITION: member serves model 'a', the published weights are for 'b'")
    with pytest.raises(ValueError, match="model"):
        await asyncio.wait_for(membership.run(), 5)
