"""A weight group whose peer is gone ends its waits at once instead of at the group's timeout: ``abort`` ends a
send, ``destroy_group`` (or a newer group) ends a receive, an InitWeightsUpdateGroup never holds a receive up
and answers within its timeout. One process: the sender (rank 0) on a thread, gloo on loopback; the group's
timeout is 20 s, every wait below must end in a few."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.weightsync import (
    BucketRequest,
    GroupSpec,
    PhaseError,
    ReceivedVersion,
    Stager,
    StoreHost,
    WeightGroup,
    WeightReceiver,
    bucket_requests,
    connect_store,
    read_staged,
    send_bucket,
)
from tauflow.weightsync import group as group_module
from tauflow.weightsync.manifest import Manifest

TIMEOUT_S = 20.0
QUICK_S = 4.0  # what "at once" means here (loaded CI machines)


class Pair:
    """A sender (rank 0) and a receiver (rank 1) in group ``abort-e<epoch>`` on one store."""

    def __init__(self, host: StoreHost, receiver: WeightReceiver, epoch: int, timeout_s: float = TIMEOUT_S) -> None:
        self.spec = GroupSpec("127.0.0.1", host.port, f"abort-e{epoch}", 2, 0, "gloo", epoch, timeout_s)
        senders: list[WeightGroup] = []
        thread = threading.Thread(target=lambda: senders.append(WeightGroup(host.store, self.spec)))
        thread.start()
        receiver.init_group(dataclasses.replace(self.spec, rank=1))
        thread.join(30)
        self.sender = senders[0]


def wait_posted(group: Callable[[], WeightGroup | None]) -> None:
    """Until the group's collective is posted and waited for (a fixed sleep raced the thread's start under load)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        g = group()
        if g is not None and g.collectives_pending:
            return
        time.sleep(0.01)
    raise AssertionError("the collective was never posted")


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def staged(tmp_path: Path, version: int, value: float) -> tuple[Manifest, torch.Tensor]:
    stager = Stager(f"file://{tmp_path}/staging-{version}-{value}", bucket_bytes=1 << 20)
    manifest = stager.stage({"w": torch.full((256,), value)}, version)
    data = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    read_staged(stager.uri, manifest, data, roots=[tmp_path])
    return manifest, data


def request(manifest: Manifest, group: WeightGroup) -> BucketRequest:
    [req] = bucket_requests(manifest, group_name=group.name, membership_epoch=group.spec.membership_epoch)
    return req


def transfer(receiver: WeightReceiver, sender: WeightGroup, manifest: Manifest, data: torch.Tensor) -> ReceivedVersion:
    [bucket] = manifest.buckets
    thread, _ = in_thread(lambda: send_bucket(sender, bucket, data, policy_version=manifest.policy_version))
    version = receiver.receive_bucket(request(manifest, sender))
    thread.join(30)
    assert version is not None
    return version


@pytest.fixture
def host() -> Iterator[StoreHost]:
    yield StoreHost("127.0.0.1", 0, timeout_s=30)


def wait_abandoned_gone() -> None:
    deadline = time.monotonic() + QUICK_S
    while group_module.abandoned_groups():
        assert time.monotonic() < deadline, "an aborted collective never ended"
        time.sleep(0.05)


def test_destroy_ends_a_receive_waiting_in_the_group_and_the_served_version_stays_intact(
    host: StoreHost, tmp_path: Path
) -> None:
    """The sidecar gave a transfer up (another member died): its DestroyWeightsUpdateGroup must end the receive
    still waiting for the bucket — before the fix it waited for the receive's lock, i.e. the group's timeout.
    The version received again in the next group goes into the buffers the failed attempt used, not into those of
    the version being served (before the fix: overwritten)."""
    receiver = WeightReceiver(label="rx")
    first = Pair(host, receiver, 1)
    m1, d1 = staged(tmp_path, 1, 1.0)
    served = transfer(receiver, first.sender, m1, d1)

    m2, d2 = staged(tmp_path, 2, 2.0)
    receiving, out = in_thread(lambda: receiver.receive_bucket(request(m2, first.sender)))
    wait_posted(lambda: receiver.group)  # (the receive is posted; the sender never sends)
    started = time.monotonic()
    assert receiver.destroy_group(first.sender.name) is True
    assert time.monotonic() - started < QUICK_S
    receiving.join(QUICK_S)
    assert not receiving.is_alive() and out["seconds"] < QUICK_S + 0.3
    assert isinstance(out["error"], PhaseError) and "aborted" in str(out["error"])
    assert receiver.group is None and receiver.receiving_version is None

    # The sender's abandoned broadcast reaches the abandoned receive, not the next version's buffer.
    first.sender.broadcast([d2[: m2.buckets[0].size_bytes]], policy_version=2, bucket_index=0)
    first.sender.destroy()
    wait_abandoned_gone()

    second = Pair(host, receiver, 2)
    m2b, d2b = staged(tmp_path, 2, 3.0)
    got = transfer(receiver, second.sender, m2b, d2b)
    assert torch.equal(got.tensors["w"], torch.full((256,), 3.0))
    assert torch.equal(served.tensors["w"], torch.full((256,), 1.0))  # the served version's tensors
    receiver.reset()
    second.sender.destroy()


def test_a_version_received_again_after_a_failed_attempt_leaves_the_served_versions_tensors(
    host: StoreHost, tmp_path: Path
) -> None:
    """The tensors of the version served stay valid until the version after next arrives. Before the fix each
    attempt at a version took the other set of buffers: the second attempt at version 2 wrote over version 1's."""
    receiver = WeightReceiver(label="rx")
    first = Pair(host, receiver, 1, timeout_s=1.0)
    m1, d1 = staged(tmp_path, 1, 1.0)
    served = transfer(receiver, first.sender, m1, d1)
    m2, d2 = staged(tmp_path, 2, 2.0)
    with pytest.raises(PhaseError):  # the sender never sends: the receive misses the group's deadline
        receiver.receive_bucket(request(m2, first.sender))
    first.sender.destroy()
    second = Pair(host, receiver, 2)
    got = transfer(receiver, second.sender, m2, d2)
    assert torch.equal(got.tensors["w"], torch.full((256,), 2.0))
    assert torch.equal(served.tensors["w"], torch.full((256,), 1.0))
    receiver.reset()
    second.sender.destroy()


def test_abort_ends_a_send_waiting_for_a_receiver_that_never_posts(host: StoreHost, tmp_path: Path) -> None:
    """The sidecar's send of a bucket to a member that will never post its receives (it refused the bucket, or
    died): a member's failure aborts the group, and the send ends at once, as every later one on the group."""
    receiver = WeightReceiver(label="rx")
    pair = Pair(host, receiver, 1)
    manifest, data = staged(tmp_path, 1, 1.0)
    [bucket] = manifest.buckets
    sending, out = in_thread(lambda: send_bucket(pair.sender, bucket, data, policy_version=1))
    wait_posted(lambda: pair.sender)
    pair.sender.abort("member rx failed")
    sending.join(QUICK_S)
    assert not sending.is_alive() and out["seconds"] < QUICK_S + 0.3
    err = out["error"]
    assert isinstance(err, PhaseError) and "was aborted: member rx failed" in str(err)
    assert err.policy_version == 1 and err.ranks == ()  # (nobody is named for the abort)
    started = time.monotonic()
    with pytest.raises(PhaseError, match="aborted"):
        send_bucket(pair.sender, bucket, data, policy_version=1)
    pair.sender.destroy()  # a collective still runs: never blocks
    assert time.monotonic() - started < 1.0
    assert group_module.abandoned_groups() == 1
    transfer_done = receiver.receive_bucket(request(manifest, pair.sender))  # the abandoned send completes
    assert transfer_done is not None
    wait_abandoned_gone()
    receiver.reset()


def test_an_init_on_a_store_nobody_serves_fails_within_its_timeout_and_holds_no_receive_up(
    host: StoreHost, tmp_path: Path
) -> None:
    """Before the fix the build ran under the receive's lock: a version sent meanwhile in the group held waited
    for the whole failed build, which took up to twice its timeout (torch's store client tries twice)."""
    receiver = WeightReceiver(label="rx")
    pair = Pair(host, receiver, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unserved = int(s.getsockname()[1])
    timeout_s = 3.0
    spec = GroupSpec("127.0.0.1", unserved, "elsewhere-e2", 2, 1, "gloo", 2, timeout_s)
    building, built = in_thread(lambda: receiver.init_group(spec))
    time.sleep(0.2)
    manifest, data = staged(tmp_path, 1, 1.0)
    got = transfer(receiver, pair.sender, manifest, data)  # not held up by the build
    assert building.is_alive(), "the receive waited for the build"
    assert torch.equal(got.tensors["w"], torch.full((256,), 1.0))
    building.join(timeout_s + 5)
    assert isinstance(built.get("error"), PhaseError) and built["error"].timed_out
    assert built["seconds"] < timeout_s + 1.0, built["seconds"]
    assert receiver.group is not None and receiver.group.name == pair.sender.name  # kept
    receiver.reset()
    pair.sender.destroy()


def test_connect_store_answers_within_its_timeout_when_the_store_never_answers() -> None:
    """A listener that accepts but never answers: torch's store client waited for it without any bound."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = int(listener.getsockname()[1])
        connecting, out = in_thread(lambda: connect_store("127.0.0.1", port, 1.0, label="rx"))
        connecting.join(5)
        assert not connecting.is_alive(), "connect_store never returned"
        err = out["error"]
        assert isinstance(err, PhaseError) and err.timed_out and out["seconds"] < 2.5
        assert "rx: cannot connect" in str(err) and f"store 127.0.0.1:{port}" in str(err)


def test_a_build_that_hangs_past_its_timeout_is_left_behind_and_a_group_it_forms_later_is_shut_down(
    host: StoreHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gloo, given a peer address an outsider planted in the store, hung in its connect for minutes past the
    timeout it was given: the rollout's one build slot stayed taken and every later build was refused."""
    release = threading.Event()
    shut_down = threading.Event()

    class LateGroup:
        def shutdown(self) -> None:
            shut_down.set()

    def hanging_backend(spec: GroupSpec, store: Any) -> LateGroup:
        release.wait(30)
        return LateGroup()

    monkeypatch.setattr(group_module, "_make_backend", hanging_backend)
    monkeypatch.setattr(group_module, "BUILD_GRACE_S", 0.5)
    spec = GroupSpec("127.0.0.1", host.port, "hung-e1", 2, 1, "gloo", 1, 1.0)
    started = time.monotonic()
    with pytest.raises(PhaseError) as refused:
        WeightGroup(host.store, spec)
    assert refused.value.timed_out and "left behind" in str(refused.value)
    assert time.monotonic() - started < 1.5 + QUICK_S
    release.set()  # the build returns after all: its group is not kept open
    assert shut_down.wait(10)
