"""ConfirmVersion is judged by the order versions were sent to the member, not by their numbers: a trainer
resumed from a checkpoint publishes an older number (``rebase``), and later the same numbers with other
weights. In process: the broadcast loop with a fake member and a fake process group."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tauflow.weights.broadcast as broadcast_module
from tauflow.weights.config import DeadlinesConfig, WeightsConfig
from tauflow.weights.errors import FailedPrecondition
from tauflow.weights.membership import MemberState
from tauflow.weights.sidecar import Sidecar
from tauflow.weightsync import GroupSpec, Stager


class FakeGroup:
    def __init__(self, store: Any, spec: GroupSpec, labels: dict[int, str]) -> None:
        self.spec, self.name = spec, spec.group_name

    def abort(self, reason: str) -> None:
        pass

    def destroy(self) -> None:
        pass


class FakeStore:
    store = None
    port = 1


class ConfirmingMember:
    """A rollout server that confirms each version ``delay_s`` after its last bucket (its engine's safe point),
    in the background, as the real one does; records the refusals."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sidecar: Sidecar | None = None
        self.refused: list[str] = []
        self.received: list[int] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def _confirm(self, request: Any) -> None:
        await asyncio.sleep(self.delay_s)
        assert self.sidecar is not None
        try:
            self.sidecar.membership.confirm(
                "r", request.policy_version, request.manifest_checksum, request.manifest_checksum
            )
        except Exception as e:  # noqa: BLE001 - recorded for the test
            self.refused.append(f"{request.policy_version}: {e}")

    async def update_bucket(self, request: Any, timeout_s: float) -> None:
        if request.bucket_index + 1 == request.bucket_count:
            self.received.append(request.policy_version)
            task = asyncio.get_running_loop().create_task(self._confirm(request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def init_group(self, spec: GroupSpec, timeout_s: float) -> None:
        pass

    async def destroy_group(self, group_name: str, timeout_s: float) -> None:
        pass

    async def probe(self, timeout_s: float) -> None:
        pass

    async def close(self) -> None:
        pass


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64, generator=torch.Generator().manual_seed(seed))}


async def wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_confirm_of_a_rebased_older_version_counts_while_a_newer_one_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault: the member confirmed 5; the trainer resumed from checkpoint 3 and published 3 (rebase), then
    the new 4 before the member's confirm of 3 arrived. Before the fix that confirm was refused ("older than
    version 5 it confirmed" — 3 was no longer the newest) and the member was dropped at the confirm deadline."""
    monkeypatch.setattr(broadcast_module, "WeightGroup", FakeGroup)
    monkeypatch.setattr(broadcast_module, "send_bucket", lambda *args, **kwargs: None)
    member = ConfirmingMember(delay_s=0.3)
    config = WeightsConfig(staging_roots=[str(tmp_path)], deadlines=DeadlinesConfig(confirm_s=3))
    sidecar = Sidecar(config, FakeStore(), lambda address: member)
    member.sidecar = sidecar
    stager = Stager(f"file://{tmp_path}/staged", bucket_bytes=128)
    loop = asyncio.create_task(sidecar.broadcast.run())
    try:
        sidecar.membership.join("r", "127.0.0.1:1", 1, ("gloo",), None, "")
        r = sidecar.membership.members["r"]
        for version in range(1, 6):
            await sidecar.retention.publish(stager.stage(weights(version), version), stager.uri)
        await wait_for(lambda: r.confirmed_version == 5, 5)

        await sidecar.retention.publish(stager.stage(weights(103), 3), stager.uri, rebase=True)
        await wait_for(lambda: member.received[-1] == 3, 5)
        new_4 = stager.stage(weights(104), 4)
        await sidecar.retention.publish(new_4, stager.uri)  # before the confirm of 3 arrives
        await wait_for(lambda: r.state is MemberState.FAILED or r.confirmed_checksum == new_4.checksum, 6)
        assert member.refused == []
        assert r.state is MemberState.ACTIVE and r.confirmed_version == 4, r.last_error
        await wait_for(lambda: sidecar.broadcast.confirmed_version == 4, 5)  # (the loop sees the confirm next)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        stager.close()


def test_a_late_confirm_of_a_version_sent_earlier_is_refused_by_send_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: ConfirmingMember(0))
    membership = sidecar.membership
    membership.join("r", "127.0.0.1:1", 1, ("gloo",), None, "")
    r = membership.members["r"]
    # 3 (weights A), 5, then a rebase: 3 (weights B), then 4
    for version, checksum in [(3, "3a"), (5, "5"), (3, "3b"), (4, "4b")]:
        sidecar.broadcast._record_sent(version, checksum, [r])
    membership.confirm("r", 4, "4b", "4b")
    caplog.set_level(logging.WARNING, logger="tauflow.weights.sidecar")
    # Late confirms of versions sent before 4: refused, and the member stays as it was. By number 5 is newer
    # than 4 (before the fix it was taken: the member counted as serving the weights from before the rebase),
    # and 3 with weights A is not a checksum mismatch (before the fix: DATA_LOSS, and the member was dropped).
    for version, checksum in [(5, "5"), (3, "3b"), (3, "3a")]:
        with pytest.raises(FailedPrecondition, match=f"version {version} is older than version 4 it confirmed"):
            membership.confirm("r", version, checksum, checksum)
        assert (r.state, r.confirmed_version, r.confirmed_checksum) == (MemberState.JOINING, 4, "4b")
    membership.confirm("r", 4, "4b", "4b")  # a repeat
    # Every refusal is logged with its reason, once per member and kind within WARN_EVERY_S.
    refusals = [rec for rec in caplog.records if rec.getMessage() == "ConfirmVersion refused"]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    assert (
        refusals[0].__dict__["reason"]
        == "version 5 is older than version 4 it confirmed (it was sent to 'r' before that one)"
    )
    with pytest.raises(FailedPrecondition, match="never broadcast"):
        membership.confirm("r", 9, "9", "9")
    assert [
        rec.__dict__["policy_version"] for rec in caplog.records if rec.getMessage() == "ConfirmVersion refused"
    ] == [5, 9]


async def test_the_broadcast_loop_stops_when_cancelled_as_it_is_woken() -> None:
    """asyncio.wait_for on Python 3.11 swallows a cancellation that comes as the awaited event is set: the loop
    ran on, and the sidecar's stop (and this suite, once in a while under load) hung forever."""
    sidecar = Sidecar(WeightsConfig(), FakeStore(), lambda address: ConfirmingMember(0))
    running = asyncio.create_task(sidecar.broadcast.run())
    await asyncio.sleep(0.05)  # no work: it waits to be woken
    sidecar.broadcast.events.wake.set()
    running.cancel()  # in the same step: the wake-up and the cancellation race
    done, _ = await asyncio.wait([running], timeout=5)
    assert running in done


async def test_each_version_is_one_info_line_that_tells_its_hand_off_and_its_broadcast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """hostile4 (minor): the sidecar logged two INFO lines per version ("accepted version", "broadcast
    version"), ~437 KB/min on a fast tiny run. Now the broadcast's line also tells the hand-off (bytes, its
    duration, the version it superseded); "accepted version" is DEBUG."""
    monkeypatch.setattr(broadcast_module, "WeightGroup", FakeGroup)
    monkeypatch.setattr(broadcast_module, "send_bucket", lambda *args, **kwargs: None)
    caplog.set_level(logging.DEBUG, logger="tauflow.weights.sidecar")
    member = ConfirmingMember(delay_s=0.0)
    sidecar = Sidecar(WeightsConfig(staging_roots=[str(tmp_path)]), FakeStore(), lambda address: member)
    member.sidecar = sidecar
    stager = Stager(f"file://{tmp_path}/staged", bucket_bytes=128)
    loop = asyncio.create_task(sidecar.broadcast.run())
    try:
        for version in (1, 2, 3):  # no member yet: 2 supersedes 1, 3 supersedes 2
            await sidecar.retention.publish(stager.stage(weights(version), version), stager.uri)
        sidecar.membership.join("r", "127.0.0.1:1", 1, ("gloo",), None, "")
        await wait_for(lambda: sidecar.broadcast.confirmed_version == 3, 5)
        await sidecar.retention.publish(stager.stage(weights(4), 4), stager.uri)
        await wait_for(lambda: sidecar.broadcast.confirmed_version == 4, 5)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        stager.close()
    per_version = [rec for rec in caplog.records if hasattr(rec, "policy_version")]
    info = [(rec.getMessage(), rec.__dict__) for rec in per_version if rec.levelno == logging.INFO]
    assert [(message, fields["policy_version"]) for message, fields in info] == [
        ("broadcast version", 3),
        ("broadcast version", 4),
    ]
    latest = sidecar.retention.latest
    assert latest is not None
    nbytes = latest.manifest.total_bytes  # (every version's: one tensor of the same shape)
    for (_, fields), superseded in zip(info, (2, None), strict=True):
        assert fields["bytes"] == nbytes and fields["superseded"] == superseded and fields["members"] == 1
        assert fields["handoff_ms"] >= 0 and fields["seconds"] >= 0
    accepted = [rec.__dict__["policy_version"] for rec in per_version if rec.getMessage() == "accepted version"]
    assert accepted == [1, 2, 3, 4] and all(
        rec.levelno == logging.DEBUG for rec in per_version if rec.getMessage() == "accepted version"
    )
