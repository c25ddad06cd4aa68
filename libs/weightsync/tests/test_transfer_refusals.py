"""A receiver's refused requests leave its weight group as it was: an InitWeightsUpdateGroup whose group never
forms (a store nobody serves, a sender that never joins), and buckets refused by the check a caller runs before
it does anything for them. One process: the sender (rank 0) on a thread, gloo on loopback."""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tauflow.weightsync import (
    BucketRequest,
    GroupSpec,
    PhaseError,
    ReceiveError,
    Stager,
    StoreHost,
    WeightGroup,
    WeightReceiver,
    bucket_requests,
    read_staged,
    send_bucket,
)

SPEC = GroupSpec("127.0.0.1", 0, "real-e5", 2, 0, "gloo", 5, 20.0)


def _unserved_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def joined() -> Iterator[tuple[StoreHost, WeightReceiver, WeightGroup]]:
    """A receiver in group ``real-e5`` (epoch 5), and the group's sender."""
    host = StoreHost("127.0.0.1", 0, timeout_s=30)
    spec = dataclasses.replace(SPEC, master_port=host.port)
    senders: list[WeightGroup] = []
    sender = threading.Thread(target=lambda: senders.append(WeightGroup(host.store, spec)))
    sender.start()
    receiver = WeightReceiver(label="rx")
    assert receiver.init_group(dataclasses.replace(spec, rank=1)) == 1
    sender.join(30)
    yield host, receiver, senders[0]
    receiver.reset()
    senders[0].destroy()


def _still_receives(receiver: WeightReceiver, sender: WeightGroup, tmp_path: Path, version: int) -> None:
    stager = Stager(f"file://{tmp_path}/staging-{version}", bucket_bytes=1 << 20)
    manifest = stager.stage({"w": torch.arange(4.0) * version}, version)
    data = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    read_staged(stager.uri, manifest, data, roots=[tmp_path])
    [request] = bucket_requests(manifest, group_name=sender.name, membership_epoch=sender.spec.membership_epoch)
    [bucket] = manifest.buckets
    send = threading.Thread(target=send_bucket, args=(sender, bucket, data), kwargs={"policy_version": version})
    send.start()
    received = receiver.receive_bucket(request)
    send.join(30)
    assert received is not None and torch.equal(received.tensors["w"], torch.arange(4.0) * version)


def test_an_init_whose_group_never_forms_keeps_the_group_held(
    joined: tuple[StoreHost, WeightReceiver, WeightGroup], tmp_path: Path
) -> None:
    host, receiver, sender = joined
    held = receiver.group
    hostile = [
        # a newer epoch on a store nobody serves
        GroupSpec("127.0.0.1", _unserved_port(), "evil", 2, 1, "gloo", 6, 1.0),
        # a newer epoch on the real store, whose sender never joins
        GroupSpec("127.0.0.1", host.port, "evil-2", 2, 1, "gloo", 6, 1.0),
    ]
    for spec in hostile:
        with pytest.raises(PhaseError):
            receiver.init_group(spec)
        assert receiver.group is held and held is not None and not held.destroyed
        assert (held.name, held.spec.membership_epoch) == ("real-e5", 5)
    _still_receives(receiver, sender, tmp_path, 1)


def test_a_bucket_is_checked_before_anything_is_done_for_it(
    joined: tuple[StoreHost, WeightReceiver, WeightGroup],
) -> None:
    _, receiver, sender = joined
    good = dict(names=["w"], dtypes=["float32"], shapes=[[4]], policy_version=1, bucket_count=1)

    cases = [
        (BucketRequest(**good, group_name="nope", membership_epoch=5, bucket_index=0), "precondition"),
        (BucketRequest(**good, group_name=sender.name, membership_epoch=4, bucket_index=0), "precondition"),
        (BucketRequest(**good, group_name=sender.name, membership_epoch=5, bucket_index=5), "invalid"),
        (
            BucketRequest(**{**good, "bucket_count": 2}, group_name=sender.name, membership_epoch=5, bucket_index=1),
            "precondition",
        ),
    ]
    for request, kind in cases:
        with pytest.raises(ReceiveError) as refused:
            receiver.check_bucket(request)
        assert refused.value.kind == kind
    receiver.check_bucket(BucketRequest(**good, group_name=sender.name, membership_epoch=5, bucket_index=0))
    assert receiver.receiving_version is None
