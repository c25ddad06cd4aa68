"""The broadcast loop's group build, in process (fake members, a fake process group): membership changes
while a group is being built must not break the loop."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

import tauflow.weights.broadcast as broadcast_module
from tauflow.weights.config import WeightsConfig
from tauflow.weights.errors import FailedPrecondition, InvalidRequest, ResourceExhausted
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync import GroupSpec, Phase, PhaseError


class FakeGroup:
    """Stands in for the torch.distributed group (a TCPStore rendezvous needs the members' ranks)."""

    def __init__(self, store: Any, spec: GroupSpec, labels: dict[int, str]) -> None:
        self.spec, self.name = spec, spec.group_name

    def destroy(self) -> None:
        pass


class FakeStore:
    store = None
    port = 1


class FakeMember:
    def __init__(self, release: asyncio.Event, called: asyncio.Event) -> None:
        self.release, self.called = release, called

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None:
        self.called.set()
        await self.release.wait()

    async def update_bucket(self, request: Any, timeout_s: float) -> None:
        pass

    async def destroy_group(self, group_name: str, timeout_s: float) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_member_that_leaves_while_its_group_is_built_gets_a_rebuild_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(broadcast_module, "WeightGroup", FakeGroup)
    release, called = asyncio.Event(), asyncio.Event()
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: FakeMember(release, called))
    sidecar.membership.join("a", "127.0.0.1:1", 1, ("gloo",), None, "")
    building = asyncio.create_task(sidecar.broadcast._rebuild())
    await asyncio.wait_for(called.wait(), 5)
    sidecar.membership.leave("a", "stopping")  # JOINING, not yet in a group: removed at once
    release.set()
    # Before the fix the build said True with "a" gone, and the loop's next read of its members raised KeyError.
    assert await asyncio.wait_for(building, 5) is False
    assert sidecar.membership.group_ids == [] and sidecar.membership.group_outdated()
    # The next build, with the member that is there, succeeds.
    sidecar.membership.join("b", "127.0.0.1:2", 1, ("gloo",), None, "")
    assert await asyncio.wait_for(sidecar.broadcast._rebuild(), 5) is True
    assert sidecar.membership.group_ids == ["b"]
    members = [sidecar.membership.members[i] for i in sidecar.membership.group_ids]  # what the loop reads next
    assert [m.member_id for m in members] == ["b"]


def test_join_refuses_a_group_larger_than_max_group_ranks_and_changes_nothing() -> None:
    """A Join may not size the next group past ``max_group_ranks`` (thousands of ranks stalled a build);
    a refused Join leaves the membership as it was."""
    release, called = asyncio.Event(), asyncio.Event()
    config = WeightsConfig(max_group_ranks=1024)
    sidecar = Sidecar(config, FakeStore(), lambda address: FakeMember(release, called))
    membership = sidecar.membership
    membership.join("a", "127.0.0.1:1", 1000, ("gloo",), None, "")
    epoch = membership.epoch
    with pytest.raises(
        ResourceExhausted, match="num_ranks=25 would make 1025 member ranks, above max_group_ranks=1024"
    ):
        membership.join("b", "127.0.0.1:2", 25, ("gloo",), None, "")
    assert set(membership.members) == {"a"} and membership.epoch == epoch
    membership.join("b", "127.0.0.1:2", 24, ("gloo",), None, "")  # exactly at the bound
    assert set(membership.members) == {"a", "b"}


def test_join_refuses_an_address_that_is_not_host_port_and_changes_nothing() -> None:
    # Joins at "not a host!", "[::1" or 4,000 characters were members that could only fail later.
    release, called = asyncio.Event(), asyncio.Event()
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: FakeMember(release, called))
    membership = sidecar.membership
    for bad in ("not a host!", "[::1", "unix:", "dns:///%%%", "host:99999999", "host:0", "h" * 4000 + ":1", "h:"):
        with pytest.raises(InvalidRequest, match="address must be host:port"):
            membership.join("m", bad, 1, ("gloo",), None, "")
    assert not membership.members
    for good in (
        "127.0.0.1:50051",
        "rollout-0.rollout.svc.cluster.local:8000",
        "[::1]:1",
        "[fe80::1]:2",
        "rollout_1:80",
    ):
        membership.join(good, good, 1, ("gloo",), None, "")
    assert len(membership.members) == 5  # (the last a Compose service name)


def test_join_keeps_nothing_of_its_backends_and_its_refusal_quotes_a_bounded_part() -> None:
    """hostile4 #4: each member kept its Join's backends as sent (50000 strings of 4 KiB: ~205 MB per member), and
    the FAILED_PRECONDITION of backends that lack the sidecar's quoted all of them (past gRPC's 16 KiB of metadata
    the caller got RESOURCE_EXHAUSTED). The servicer bounds the list; the domain keeps none of it whatever it gets."""
    import tracemalloc

    release, called = asyncio.Event(), asyncio.Event()
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: FakeMember(release, called))
    membership = sidecar.membership
    with pytest.raises(FailedPrecondition) as refused:
        membership.join("m" * 4096, "127.0.0.1:1", 1, ["nccl"] * 3000, None, "x" * 4096)
    assert "… (4096 characters)" in str(refused.value) and "(3000 in all)" in str(refused.value)
    assert len(str(refused.value)) < 1024 and not membership.members
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        backends = [str(i).rjust(4096, "y") for i in range(2000)] + ["gloo"]  # 8 MB, each string its own
        membership.join("big", "127.0.0.1:2", 1, backends, None, "")
        del backends
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert membership.members["big"].state.name == "JOINING"
    assert kept < 1_000_000, kept  # was the 8 MB of the list's strings


async def test_a_join_from_a_process_restarted_on_the_same_port_is_a_new_member_not_a_repeat() -> None:
    """A member killed and restarted on the same address before the sidecar noticed joins with older
    weights than it confirmed: it is in no group, so it must be brought up to date, not ignored (a stalled
    run, before the fix: its data could never be made, so no new version came to reach it)."""
    release, called = asyncio.Event(), asyncio.Event()
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: FakeMember(release, called))
    membership = sidecar.membership
    membership.join("r", "127.0.0.1:1", 1, ("gloo",), 0, "")
    membership.members["r"].confirmed_version = 49  # (as ConfirmVersion records it after a broadcast)
    epoch = membership.epoch
    assert membership.join("r", "127.0.0.1:1", 1, ("gloo",), 49, "") == epoch + 1  # a repeat: nothing changes
    assert membership.members["r"].confirmed_version == 49
    assert membership.join("r", "127.0.0.1:1", 1, ("gloo",), 0, "") == epoch + 1  # the restarted process
    assert membership.members["r"].confirmed_version == 0  # re-added: the next broadcast brings it up to date


class ClosingMember:
    """A member whose client records that it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_failed_members_are_closed_and_only_the_latest_max_members_kept() -> None:
    """Before the fix a dropped member kept its channel open and stayed listed for ever: Joins at an
    unreachable address grew the membership (and GetStatus) without bound; max_members counted only live ones."""
    clients: dict[str, ClosingMember] = {}
    now = [0.0]
    sidecar = Sidecar(
        WeightsConfig(max_members=2),
        FakeStore(),
        lambda address: clients.setdefault(address, ClosingMember()),
        clock=lambda: now[0],
    )
    membership = sidecar.membership
    for i in range(5):
        membership.join(f"m{i}", f"127.0.0.1:{i + 1}", 1, ("gloo",), None, "")
        now[0] += 1
        membership.drop(membership.members[f"m{i}"], PhaseError(Phase.GROUP_INIT, f"m{i}", "unreachable"))
    await asyncio.sleep(0)  # (the clients close in the background)
    assert all(c.closed for c in clients.values())
    assert set(membership.members) == {"m3", "m4"}  # the two latest failures, with their errors, for GetStatus
    assert membership.counts()["failed"] == 2
    # A member of the current group is dropped with its client open: the group's destroy is still sent to it.
    membership.join("g", "127.0.0.1:9", 1, ("gloo",), None, "")
    membership.group_ids = ["g"]
    now[0] += 1
    membership.drop(membership.members["g"], PhaseError(Phase.TRANSFER, "g", "unreachable"))
    await asyncio.sleep(0)
    assert not clients["127.0.0.1:9"].closed and "g" in membership.members
    membership.forget_group()  # (as the broadcast loop destroys the group: then it settles its members)
    membership.settle_destroyed([membership.members["g"]])
    await asyncio.sleep(0)
    assert clients["127.0.0.1:9"].closed
    assert set(membership.members) == {"m4", "g"}


class SharedMember:
    """A member of an ``ipc`` sidecar: records what it is asked to load; ``fail`` makes it refuse."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.requests: list[Any] = []
        self.fail = fail

    async def update_from_shared(self, request: Any, timeout_s: float) -> None:
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None:
        raise AssertionError("an ipc sidecar builds no group")

    async def update_bucket(self, request: Any, timeout_s: float) -> None:
        raise AssertionError("an ipc sidecar broadcasts no bucket")

    async def destroy_group(self, group_name: str, timeout_s: float) -> None:
        raise AssertionError("an ipc sidecar destroys no group")

    async def close(self) -> None:
        pass


async def test_an_ipc_sidecar_has_each_member_load_the_trainers_buffer_and_copies_nothing() -> None:
    import torch

    from tauflow.weights.errors import InvalidRequest
    from tauflow.weights.ports import MemberCallFailed
    from tauflow.weightsync.ipc import DeviceStager

    members = {"127.0.0.1:1": SharedMember(), "127.0.0.1:2": SharedMember()}
    sidecar = Sidecar(WeightsConfig(backend="ipc"), FakeStore(), members.__getitem__)
    stager = DeviceStager("cpu")
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5)}
    manifest, uri = stager.stage(weights, 1)
    with pytest.raises(InvalidRequest, match="the ipc backend takes an ipc:// URI"):
        await sidecar.retention.publish(manifest, "shm://tauflow-weights-1")
    assert sidecar.retention.latest is None  # refused: nothing accepted
    await sidecar.retention.publish(manifest, uri)
    assert sidecar.retention.latest.buffer is None and sidecar.retention.retained_bytes() == 0
    with pytest.raises(FailedPrecondition, match="the sidecar uses 'ipc'"):
        sidecar.membership.join("x", "127.0.0.1:9", 1, ("gloo", "nccl"), None, "")
    sidecar.membership.join("a", "127.0.0.1:1", 1, ("gloo", "ipc"), None, "")
    sidecar.membership.join("b", "127.0.0.1:2", 1, ("ipc",), None, "")

    async def confirm_when_asked() -> None:
        while not all(m.requests for m in members.values()):
            await asyncio.sleep(0.01)
        for member_id in ("a", "b"):
            sidecar.membership.confirm(member_id, 1, manifest.checksum, manifest.checksum)

    confirming = asyncio.create_task(confirm_when_asked())
    assert await asyncio.wait_for(sidecar.broadcast._broadcast_latest(), 10) is True
    await confirming
    assert sidecar.broadcast.confirmed_version == 1 and sidecar.membership.epoch == 1
    for m in members.values():
        (request,) = m.requests
        assert request.staging_uri == uri and request.policy_version == 1 and request.membership_epoch == 1
        assert request.manifest_checksum == manifest.checksum and request.checksum_algorithm == "sum64x2"
        assert list(request.names) == ["w", "b"] and [list(s) for s in request.shapes] == [[2, 3], [5]]

    # A member that finds the buffer overwritten (DATA_LOSS) is dropped; the other stays.
    members["127.0.0.1:2"].fail = MemberCallFailed("UpdateWeightsFromTensor", "127.0.0.1:2", "DATA_LOSS", "torn")
    await sidecar.retention.publish(*stager.stage(weights, 2))
    assert await asyncio.wait_for(sidecar.broadcast._broadcast_latest(), 10) is False
    states = {i: m.state.name for i, m in sidecar.membership.members.items()}
    assert states == {"a": "ACTIVE", "b": "FAILED"}
    assert "DATA_LOSS" in str(sidecar.membership.members["b"].last_error)


@pytest.mark.parametrize("published_meanwhile", [[2, 3], [2]])
async def test_an_ipc_member_that_finds_the_buffer_overwritten_by_a_newer_version_is_not_dropped(
    published_meanwhile: list[int],
) -> None:
    """At τ >= 1 the trainer may stage a version into the buffer a member is still reading (its stager alternates
    two: version 3 goes where 1 was): that member's DATA_LOSS is nobody's fault, and the loop sends the newest.
    With only version 2 published meanwhile (the other buffer) the DATA_LOSS is a real fault: dropped."""
    import torch

    from tauflow.weights.errors import InvalidRequest
    from tauflow.weights.ports import MemberCallFailed
    from tauflow.weightsync.ipc import DeviceStager

    sidecar = Sidecar(WeightsConfig(backend="ipc"), FakeStore(), lambda address: member)
    stager = DeviceStager("cpu")
    weights = {"w": torch.ones(4)}

    class Overtaken(SharedMember):
        async def update_from_shared(self, request: Any, timeout_s: float) -> None:
            self.requests.append(request)
            if request.policy_version == 1:  # the trainer publishes while this member reads version 1
                for version in published_meanwhile:
                    await sidecar.retention.publish(*stager.stage(weights, version))
                raise MemberCallFailed("UpdateWeightsFromTensor", "127.0.0.1:1", "DATA_LOSS", "overwritten")

    member = Overtaken()
    manifest, uri = stager.stage(weights, 1)
    xxh = dataclasses.replace(manifest, checksum_algorithm="xxh3-64")
    with pytest.raises(InvalidRequest, match="manifest.checksum_algorithm"):
        await sidecar.retention.publish(xxh, uri)
    await sidecar.retention.publish(manifest, uri)
    sidecar.membership.join("a", "127.0.0.1:1", 1, ("ipc",), None, "")
    assert await asyncio.wait_for(sidecar.broadcast._broadcast_latest(), 10) is False
    if published_meanwhile == [2]:
        assert sidecar.membership.members["a"].state.name == "FAILED"
        return
    assert sidecar.membership.members["a"].state.name == "ACTIVE"  # not dropped

    async def confirm_when_asked() -> None:
        while len(member.requests) < 2:
            await asyncio.sleep(0.01)
        latest = sidecar.retention.latest
        sidecar.membership.confirm("a", 3, latest.manifest.checksum, latest.manifest.checksum)

    confirming = asyncio.create_task(confirm_when_asked())
    assert await asyncio.wait_for(sidecar.broadcast._broadcast_latest(), 10) is True  # the newest, at once
    await confirming
    assert [r.policy_version for r in member.requests] == [1, 3] and sidecar.broadcast.confirmed_version == 3
