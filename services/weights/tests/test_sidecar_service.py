"""The sidecar as a process, driven over gRPC, with FAKE rollout servers (fake_rollout.py) as members."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.api.weights.v1 import weights_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.core.testing import ServiceProcess
from tauflow.weightsync import Manifest, Stager
from tauflow.weightsync.staging import SHM_DIR
from tauflow.weightsync.wire import manifest_to_proto

FAKE = Path(__file__).with_name("fake_rollout.py")


def weights_stub(address: str) -> weights_pb2_grpc.WeightsServiceStub:
    channel = create_sync_channel(
        address, [pb.DESCRIPTOR.services_by_name["WeightsService"]], ChannelConfig(default_timeout_s=20)
    )
    return weights_pb2_grpc.WeightsServiceStub(channel)


class FakeRollout:
    """One fake_rollout.py process."""

    def __init__(
        self, member_id: str, sidecar: str, workdir: Path, env: dict[str, str] | None = None, port: int = 0
    ) -> None:
        self.member_id = member_id
        self.workdir = workdir
        ready = workdir / f"{member_id}.ready.json"
        self.log = workdir / f"{member_id}.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(FAKE),
                "--sidecar",
                sidecar,
                "--member-id",
                member_id,
                "--out",
                str(workdir),
                "--ready-file",
                str(ready),
                "--port",
                str(port),
            ],
            stdout=open(self.log, "wb"),  # noqa: SIM115 - open for the child's life
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"

    def received(self, version: int) -> dict:
        return torch.load(self.workdir / f"{self.member_id}-v{version}.pt")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(15)


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Callable[[str, str], FakeRollout]]:
    started: list[FakeRollout] = []

    def make(member_id: str, sidecar: str, env: dict[str, str] | None = None, port: int = 0) -> FakeRollout:
        f = FakeRollout(member_id, sidecar, tmp_path, env, port)
        started.append(f)
        return f

    yield make
    for f in started:
        f.stop()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def make(**settings: object) -> ServiceProcess:
        proc = ServiceProcess("weights", tmp_path, settings)
        started.append(proc)
        return proc.start()

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def stager() -> Iterator[Stager]:
    s = Stager(f"shm://tauflow-test-{uuid.uuid4().hex[:8]}", bucket_bytes=48_000, model="tiny")
    yield s
    s.close()


def state_dict(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "model.embed_tokens.weight": torch.randn(200, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(96, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).half(),
        "model.layers.0.mlp.gate_up_proj.weight": torch.randn(128, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.weight": torch.randn(200, 32, generator=g),
    }


def publish(stub, stager: Stager, version: int, **kw) -> tuple[pb.PublishResponse, Manifest]:
    manifest = stager.stage(state_dict(version), version)
    resp = stub.Publish(pb.PublishRequest(manifest=manifest_to_proto(manifest), staging_uri=stager.uri, **kw))
    return resp, manifest


def wait_status(stub, predicate, timeout_s: float = 40.0) -> pb.GetStatusResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.GetStatus(pb.GetStatusRequest())
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"status never matched:\n{status}"
        time.sleep(0.05)


def member(status: pb.GetStatusResponse, member_id: str) -> pb.Member | None:
    return next((m for m in status.members if m.member_id == member_id), None)


def confirmed(member_id: str, version: int) -> Callable[[pb.GetStatusResponse], bool]:
    def check(s: pb.GetStatusResponse) -> bool:
        m = member(s, member_id)
        return m is not None and m.HasField("confirmed_policy_version") and m.confirmed_policy_version == version

    return check


def assert_same_weights(fake: FakeRollout, version: int, manifest: Manifest) -> None:
    got = fake.received(version)
    assert got["loaded_checksum"] == manifest.checksum
    want = state_dict(version)
    assert list(got["tensors"]) == list(want)
    for name, t in want.items():
        r = got["tensors"][name]
        assert r.dtype == t.dtype and r.shape == t.shape, name
        assert torch.equal(r.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_versions_reach_members_as_they_join_leave_and_die(sidecar, fakes, stager) -> None:
    car = sidecar(
        **{"deadlines.group_s": 4, "deadlines.confirm_s": 4, "deadlines.destroy_s": 2, "deadlines.rpc_margin_s": 1}
    )
    stub = weights_stub(car.address)
    a, b = fakes("fake-a", car.address), fakes("fake-b", car.address)

    _, m1 = publish(stub, stager, 1)
    # (the sidecar's own confirmed version follows its members' on a later turn of its loop: waited for too)
    status = wait_status(
        stub, lambda s: confirmed("fake-a", 1)(s) and confirmed("fake-b", 1)(s) and s.confirmed_policy_version == 1
    )
    assert status.membership_epoch == 1
    assert {m.state for m in status.members} == {pb.MEMBER_STATE_ACTIVE}
    assert sorted(m.rank_offset for m in status.members) == [1, 2]
    assert_same_weights(a, 1, m1)
    assert_same_weights(b, 1, m1)

    # b dies between versions: the next version still reaches a, in a rebuilt group
    b.stop(signal.SIGKILL)
    _, m2 = publish(stub, stager, 2)
    status = wait_status(stub, confirmed("fake-a", 2))
    assert_same_weights(a, 2, m2)
    dead = member(status, "fake-b")
    assert dead is not None and dead.state == pb.MEMBER_STATE_FAILED
    assert dead.last_error.peer == "fake-b"
    assert dead.last_error.phase in (pb.BROADCAST_PHASE_TRANSFER, pb.BROADCAST_PHASE_GROUP_DESTROY)
    assert "fake-b" in dead.last_error.message and dead.last_error.policy_version == 2
    assert status.last_error.peer == "fake-b"
    assert status.membership_epoch == 2

    # a newcomer is brought to the newest version (catch-up broadcast) before anything else
    c = fakes("fake-c", car.address)
    status = wait_status(stub, confirmed("fake-c", 2))
    assert_same_weights(c, 2, m2)
    assert status.membership_epoch == 3
    assert member(status, "fake-c").state == pb.MEMBER_STATE_ACTIVE

    # c leaves (Leave on SIGTERM); the next version reaches a alone
    c.stop(signal.SIGTERM)
    resp, m3 = publish(stub, stager, 3)
    assert resp.handoff_duration.ToNanoseconds() > 0
    status = wait_status(stub, lambda s: confirmed("fake-a", 3)(s) and s.confirmed_policy_version == 3)
    assert_same_weights(a, 3, m3)
    assert member(status, "fake-c") is None
    assert status.membership_epoch == 4
    assert not (c.workdir / "fake-c-v3.pt").exists()
    assert {d.phase for d in status.phase_deadlines} >= {pb.BROADCAST_PHASE_TRANSFER, pb.BROADCAST_PHASE_CONFIRM}

    # A rolling restart: a leaves (SIGTERM) and its new process joins at once under the same id and port,
    # before any group was rebuilt. It is a new member to bring up to date, not the old one still leaving.
    port = int(a.address.rsplit(":", 1)[1])
    a.stop(signal.SIGTERM)
    (a.workdir / "fake-a-v3.pt").unlink()
    a2 = fakes("fake-a", car.address, port=port)
    assert a2.address == a.address
    status = wait_status(
        stub, lambda s: confirmed("fake-a", 3)(s) and member(s, "fake-a").state == pb.MEMBER_STATE_ACTIVE
    )
    assert_same_weights(a2, 3, m3)  # the catch-up broadcast reached the new process


def test_a_member_that_never_receives_is_dropped_by_the_transfer_deadline(sidecar, fakes, stager) -> None:
    car = sidecar(**{"deadlines.group_s": 2, "deadlines.confirm_s": 2, "deadlines.rpc_margin_s": 0.5})
    stub = weights_stub(car.address)
    a = fakes("fake-a", car.address)
    fakes("fake-stuck", car.address, env={"FAKE_ROLLOUT_STALL": "1"})
    started = time.monotonic()
    _, m1 = publish(stub, stager, 1)
    status = wait_status(stub, confirmed("fake-a", 1))
    assert time.monotonic() - started < 15
    assert_same_weights(a, 1, m1)
    stuck = member(status, "fake-stuck")
    assert stuck.state == pb.MEMBER_STATE_FAILED
    err = stuck.last_error
    assert (err.phase, err.peer, err.bucket_index) == (pb.BROADCAST_PHASE_TRANSFER, "fake-stuck", 0)
    assert err.message.startswith("transfer with peer fake-stuck missed its deadline of 2s"), err.message
    assert err.deadline.ToMilliseconds() == 2000


def test_a_member_killed_between_versions_holds_the_next_one_up_for_seconds_not_the_group_deadline(
    sidecar, fakes, stager
) -> None:
    """Before the fix the live member got the next version after the group's deadline (group_s, 60 s by
    default): the transfer started with the dead member, and its receive waited for a bucket that never came.
    Now the dead member is found before the transfer (its status does not answer) and the group rebuilt."""
    car = sidecar(**{"deadlines.group_s": 30})
    stub = weights_stub(car.address)
    a, b = fakes("fake-a", car.address), fakes("fake-b", car.address)
    publish(stub, stager, 1)
    wait_status(stub, lambda s: confirmed("fake-a", 1)(s) and confirmed("fake-b", 1)(s))
    b.stop(signal.SIGKILL)
    started = time.monotonic()
    _, m2 = publish(stub, stager, 2)
    status = wait_status(stub, confirmed("fake-a", 2), timeout_s=25)
    assert time.monotonic() - started < 10
    assert_same_weights(a, 2, m2)
    dead = member(status, "fake-b")
    assert dead.state == pb.MEMBER_STATE_FAILED and dead.last_error.phase == pb.BROADCAST_PHASE_TRANSFER
    assert "unreachable" in dead.last_error.message and dead.last_error.policy_version == 2


@pytest.mark.parametrize("fault", ["FAKE_ROLLOUT_EXIT", "FAKE_ROLLOUT_REFUSE"])
def test_a_member_that_fails_during_a_transfer_has_the_group_aborted_at_once(
    sidecar, fakes, stager, fault: str
) -> None:
    """A member that dies as the transfer starts (after the probe), or refuses the bucket without posting its
    receives: the group is aborted at once — the sidecar's send ends, the other member's receive is ended by the
    group's destroy — and the survivor gets the version in a rebuilt group. Before the fix both waited for the
    group's deadline (30 s here)."""
    car = sidecar(**{"deadlines.group_s": 30})
    stub = weights_stub(car.address)
    a = fakes("fake-a", car.address)
    fakes("fake-b", car.address, env={fault: "1"})
    started = time.monotonic()
    _, m1 = publish(stub, stager, 1)
    status = wait_status(stub, confirmed("fake-a", 1), timeout_s=25)
    assert time.monotonic() - started < 12
    assert_same_weights(a, 1, m1)
    bad = member(status, "fake-b")
    assert bad.state == pb.MEMBER_STATE_FAILED
    assert (bad.last_error.phase, bad.last_error.peer) == (pb.BROADCAST_PHASE_TRANSFER, "fake-b")
    assert member(status, "fake-a").state == pb.MEMBER_STATE_ACTIVE
    code = "UNAVAILABLE" if fault == "FAKE_ROLLOUT_EXIT" else "FAILED_PRECONDITION"
    assert code in bad.last_error.message


def test_a_member_left_waiting_in_an_aborted_group_gets_the_version_in_the_next_one(sidecar, fakes, stager) -> None:
    """fake-b leaves its group between versions (its connections close) but still answers: the sidecar's send
    fails at it before anything reaches fake-a, whose receive would wait for the group's deadline. fake-b's
    refusal aborts the group; fake-a's call is left, and the group's destroy ends its receive at once."""
    car = sidecar(**{"deadlines.group_s": 30})
    stub = weights_stub(car.address)
    a = fakes("fake-a", car.address)
    fakes("fake-b", car.address, env={"FAKE_ROLLOUT_FORGET_GROUP": "1"})
    publish(stub, stager, 1)
    wait_status(stub, lambda s: confirmed("fake-a", 1)(s) and confirmed("fake-b", 1)(s))
    time.sleep(0.5)  # (fake-b has left its group by now)
    started = time.monotonic()
    _, m2 = publish(stub, stager, 2)
    status = wait_status(stub, confirmed("fake-a", 2), timeout_s=25)
    assert time.monotonic() - started < 12
    assert_same_weights(a, 2, m2)
    assert member(status, "fake-b").state == pb.MEMBER_STATE_FAILED
    assert member(status, "fake-a").state == pb.MEMBER_STATE_ACTIVE
    # (fake-a's call is left waiting, then cancelled, where its receive outlasts the abort's grace: "member calls
    # left waiting in an aborted group" in the log. Under load the abort's closed connections may end that
    # receive first, a failure of its own. Either way the time above says no receive waited out the group's 30 s.)


def test_publish_and_membership_input_errors(sidecar, stager, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    car = sidecar(max_retained_bytes=100_000, staging_roots=json.dumps([str(staging), str(SHM_DIR)]))
    stub = weights_stub(car.address)

    def code_of(call, *args) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as e:
            call(*args)
        return e.value.code(), e.value.details()

    C = grpc.StatusCode
    manifest = stager.stage(state_dict(5), 5)
    good = manifest_to_proto(manifest)
    assert code_of(stub.Publish, pb.PublishRequest(staging_uri=stager.uri))[0] == C.INVALID_ARGUMENT
    dup = pb.WeightManifest()
    dup.CopyFrom(good)
    dup.buckets[0].tensors[1].name = dup.buckets[0].tensors[0].name
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=dup, staging_uri=stager.uri))
    assert code == C.INVALID_ARGUMENT and "duplicate tensor name" in msg
    bad_size = pb.WeightManifest()
    bad_size.CopyFrom(good)
    bad_size.buckets[0].tensors[0].size_bytes += 2
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=bad_size, staging_uri=stager.uri))
    assert code == C.INVALID_ARGUMENT and "does not match dtype" in msg
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=good, staging_uri="s3://bucket/key"))
    assert code == C.INVALID_ARGUMENT and "unknown scheme" in msg
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=good, staging_uri=f"file://{staging}/absent"))
    assert code == C.NOT_FOUND and "does not exist" in msg
    # Only files in the staging roots: not any file the sidecar can read (whether it exists or not)
    outside = tmp_path / "outside.yaml"
    outside.write_bytes(bytes(manifest.total_bytes))
    for uri in (f"file://{outside}", f"file://{tmp_path}/absent", f"file://{staging}/../{outside.name}"):
        code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=good, staging_uri=uri))
        assert code == C.INVALID_ARGUMENT and msg.startswith("Publish: staging_uri"), (uri, msg)
    (staging / "link").symlink_to(outside)
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=good, staging_uri=f"file://{staging}/link"))
    assert code == C.INVALID_ARGUMENT and "symbolic link" in msg
    wrong = pb.WeightManifest()
    wrong.CopyFrom(good)
    wrong.checksum = "0" * 16
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=wrong, staging_uri=stager.uri))
    assert code == C.DATA_LOSS and "does not match" in msg
    assert good.checksum not in msg  # the staged bytes' own checksum is never told (it named any file's)
    assert not stub.GetStatus(pb.GetStatusRequest()).HasField("latest_policy_version")

    first = stub.Publish(pb.PublishRequest(manifest=good, staging_uri=stager.uri))
    assert first.policy_version == 5 and not first.HasField("superseded_policy_version")
    assert stub.Publish(pb.PublishRequest(manifest=good, staging_uri=stager.uri)) == first  # idempotent
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=wrong, staging_uri=stager.uri))
    assert code == C.FAILED_PRECONDITION and "was accepted with checksum" in msg
    older, _ = (stager.stage(state_dict(4), 4), None)
    code, msg = code_of(stub.Publish, pb.PublishRequest(manifest=manifest_to_proto(older), staging_uri=stager.uri))
    assert code == C.FAILED_PRECONDITION and "older than the newest accepted version 5" in msg
    rebased = stub.Publish(pb.PublishRequest(manifest=manifest_to_proto(older), staging_uri=stager.uri, rebase=True))
    assert rebased.policy_version == 4
    publish(stub, stager, 6)
    resp, _ = publish(stub, stager, 7)
    assert resp.superseded_policy_version == 6  # no member: 6 was never broadcast, 7 replaces it
    assert stub.GetManifest(pb.GetManifestRequest()).manifest.policy_version == 7
    code, _ = code_of(stub.GetManifest, pb.GetManifestRequest(policy_version=6))
    assert code == C.NOT_FOUND
    big = Stager(f"file://{staging}/big")
    code, msg = code_of(
        stub.Publish,
        pb.PublishRequest(manifest=manifest_to_proto(big.stage({"w": torch.zeros(40_000)}, 8)), staging_uri=big.uri),
    )
    assert code == C.RESOURCE_EXHAUSTED and "max_retained_bytes" in msg

    code, msg = code_of(stub.Join, pb.JoinRequest(member_id="", address="x:1", num_ranks=1, backends=["gloo"]))
    assert code == C.INVALID_ARGUMENT
    code, msg = code_of(stub.Join, pb.JoinRequest(member_id="m", address="x:1", num_ranks=1, backends=["nccl"]))
    assert code == C.FAILED_PRECONDITION and "gloo" in msg
    code, msg = code_of(
        stub.Join, pb.JoinRequest(member_id="m", address="x:1", num_ranks=1, backends=["gloo"], model="other")
    )
    assert code == C.FAILED_PRECONDITION and "model" in msg
    code, _ = code_of(stub.ConfirmVersion, pb.ConfirmVersionRequest(member_id="nobody", policy_version=7))
    assert code == C.NOT_FOUND
    assert code_of(stub.Leave, pb.LeaveRequest())[0] == C.INVALID_ARGUMENT
    assert stub.Leave(pb.LeaveRequest(member_id="nobody")).membership_epoch == 0
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.latest_policy_version == 7 and status.backend == "gloo" and not status.members


def test_every_request_field_has_a_bound_and_a_refusal_changes_nothing(sidecar, stager) -> None:
    """hostile4 #3 and #4: a manifest shape of many huge dimensions answered INTERNAL (Python would not print the
    product) after holding the event loop for seconds, or RESOURCE_EXHAUSTED (a 400 KB message echoing it); a
    Join's 3000 backends turned its FAILED_PRECONDITION into RESOURCE_EXHAUSTED, and 50000 of 4 KiB were kept."""
    car = sidecar()
    stub = weights_stub(car.address)
    C = grpc.StatusCode

    def refusal(call, request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
        return e.value.code(), e.value.details()

    good = manifest_to_proto(stager.stage(state_dict(1), 1))

    def publish_with(path: str, value: object) -> pb.PublishRequest:
        m = pb.WeightManifest()
        m.CopyFrom(good)
        target, field = m.buckets[0].tensors[0], path
        if path.startswith("manifest."):
            target, field = m, path.removeprefix("manifest.")
        if isinstance(value, list):
            getattr(target, field)[:] = value
        else:
            setattr(target, field, value)
        return pb.PublishRequest(manifest=m, staging_uri=stager.uri)

    refused = {
        # (counted on the wire bytes before the decode, which stops at the bound: "at least")
        "manifest.buckets[0].tensors[0].shape has at least 300 elements, over the limit of 8": publish_with(
            "shape", [2**62] * 300
        ),
        "manifest.buckets[0].tensors[0].shape has at least 30000 elements": publish_with("shape", [2**62] * 30_000),
        "manifest.buckets[0].tensors[0].shape has at least 100000 elements": publish_with("shape", [-1] * 100_000),
        "manifest.buckets[0].tensors[0].shape has 9 elements": publish_with("shape", [1] * 9),
        "tensors[0]): shape must have at most 8 dimensions, each in 0..2^40-1 (dimension 1 is -3)": publish_with(
            "shape", [2, -3]
        ),
        "(dimension 0 is 1099511627776)": publish_with("shape", [2**40]),
        "manifest.buckets[0].tensors[0].name is 1025 long, over the limit of 1024": publish_with("name", "n" * 1025),
        "manifest.buckets[0].tensors[0].dtype is 65 long": publish_with("dtype", "d" * 65),
        "manifest.checksum is 129 long, over the limit of 128": publish_with("manifest.checksum", "a" * 129),
        "manifest.checksum_algorithm is 65 long": publish_with("manifest.checksum_algorithm", "x" * 65),
    }
    for expected, request in refused.items():
        started = time.monotonic()
        code, message = refusal(stub.Publish, request)
        assert code == C.INVALID_ARGUMENT and expected in message, (expected, code, message[:300])
        assert len(message) < 1024 and time.monotonic() - started < 5

    join = {"address": "127.0.0.1:1", "num_ranks": 1, "backends": ["gloo", "nccl", "ipc"], "member_id": "m"}
    for field, value, expected in [
        ("backends", ["nccl"] * 3000, "backends has more than 16 elements, over the limit of 16"),
        ("backends", ["y" * 4096] * 4, "backends[0] is 4096 long, over the limit of 32"),
        ("member_id", "x" * 4096, "member_id is 4096 long, over the limit of 256"),
        ("address", "a" * 301, "address is 301 long, over the limit of 300"),
    ]:
        code, message = refusal(stub.Join, pb.JoinRequest(**{**join, field: value}))
        assert code == C.INVALID_ARGUMENT and message == expected, (code, message[:300])
    # Within its bounds, a Join whose backends lack the sidecar's is FAILED_PRECONDITION with a short message.
    code, message = refusal(stub.Join, pb.JoinRequest(**{**join, "member_id": "x" * 256, "backends": ["n" * 32] * 16}))
    assert code == C.FAILED_PRECONDITION and "… (256 characters)" in message and len(message) < 2048, message
    for call, request, expected in [
        (stub.Leave, pb.LeaveRequest(member_id="x" * 257), "member_id is 257 long"),
        (stub.Leave, pb.LeaveRequest(member_id="m", reason="r" * 257), "reason is 257 long"),
        (stub.ConfirmVersion, pb.ConfirmVersionRequest(member_id="x" * 257), "member_id is 257 long"),
        (
            stub.ConfirmVersion,
            pb.ConfirmVersionRequest(member_id="m", manifest_checksum="a" * 129),
            "manifest_checksum",
        ),
        (stub.ConfirmVersion, pb.ConfirmVersionRequest(member_id="m", loaded_checksum="a" * 129), "loaded_checksum"),
    ]:
        code, message = refusal(call, request)
        assert code == C.INVALID_ARGUMENT and expected in message, (code, message)

    status = stub.GetStatus(pb.GetStatusRequest())
    assert not status.HasField("latest_policy_version") and not status.members  # nothing was taken
    # Within their bounds the requests are taken: a rollout server's Join (as tauflow's sends it), a Publish.
    assert stub.Join(pb.JoinRequest(**{**join, "member_id": "rollout-0", "loaded_policy_version": 0, "model": "tiny"}))
    assert stub.Publish(pb.PublishRequest(manifest=good, staging_uri=stager.uri)).policy_version == 1
    assert "Exceeds the limit" not in car.log_text() and "Traceback" not in car.log_text()


def test_a_manifest_of_many_tensors_is_refused_before_it_is_converted(sidecar, stager) -> None:
    """hostile5 #7: 1000 buckets of 10,000 empty tensors (each list within the generic 100,000) held the sidecar
    41 s, GetStatus included, before "unknown checksum_algorithm ''": 10 M dataclasses were built first."""
    car = sidecar()
    stub = weights_stub(car.address)
    many = pb.WeightManifest(
        checksum_algorithm="xxh3-64", checksum="ab", buckets=[pb.Bucket(tensors=[pb.TensorSpec()] * 60_000)] * 20
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(pb.PublishRequest(manifest=many, staging_uri=stager.uri), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # (the request's wire walk, tauflow.core.decoding, may refuse it first, by its count of fields)
    assert any(
        why in e.value.details()
        for why in ("manifest.buckets hold 1200000 tensors in all, over the limit of 500000", "wire fields")
    ), e.value.details()
    assert time.monotonic() - started < 30
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert not status.HasField("latest_policy_version")  # nothing was taken


def test_the_cheap_manifest_checks_run_on_the_wire_form_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum fields and the bucket count are checked before ``manifest_from_proto`` builds an object per
    tensor (of 10 M tensors: 30 s before the refusal)."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from tauflow.weights.adapters import servicer as weights_servicer
    from tauflow.weights.metrics import WeightsMetrics

    def converted(_m: pb.WeightManifest) -> Manifest:
        raise AssertionError("the manifest was converted before its cheap checks")

    monkeypatch.setattr(weights_servicer, "manifest_from_proto", converted)

    class Refused(Exception):
        pass

    class Context:
        async def abort(self, code: grpc.StatusCode, message: str) -> None:
            raise Refused(code, message)

    servicer = weights_servicer.WeightsServicer(None, WeightsMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    bucket = pb.Bucket(tensors=[pb.TensorSpec(name="t")])
    for manifest, expected in [
        (pb.WeightManifest(checksum_algorithm="", checksum="ab", buckets=[bucket]), "unknown checksum_algorithm ''"),
        (pb.WeightManifest(checksum_algorithm="xxh3-64", checksum="XY", buckets=[bucket]), "lower-case hex"),
        (pb.WeightManifest(checksum_algorithm="xxh3-64", checksum="ab"), "manifest has no buckets"),
        (
            pb.WeightManifest(
                checksum_algorithm="xxh3-64",
                checksum="ab",
                buckets=[pb.Bucket(tensors=[pb.TensorSpec()] * 250_001)] * 2,
            ),
            "manifest.buckets hold 500002 tensors in all, over the limit of 500000",
        ),
    ]:
        with pytest.raises(Refused) as e:
            asyncio.run(servicer.Publish(pb.PublishRequest(manifest=manifest), Context()))
        assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and expected in e.value.args[1], e.value.args


def test_a_join_above_the_newest_published_version_is_taken_as_unknown(sidecar, stager) -> None:
    """hostile5 (minor): Join(loaded_policy_version=2^64-1) was kept, and GetStatus showed it as the member's
    confirmed version: a version never published. The contract calls it the version the server has loaded; one
    above the newest published version (above 0, the initial checkpoint's, before any Publish) is none this sidecar
    made, and it is taken as unknown: the member gets the newest version at the next broadcast."""
    car = sidecar()
    stub = weights_stub(car.address)
    join = {"address": "127.0.0.1:1", "num_ranks": 1, "backends": ["gloo", "nccl", "ipc"], "model": "tiny"}
    stub.Join(pb.JoinRequest(**join, member_id="m-huge", loaded_policy_version=2**64 - 1), timeout=10)
    stub.Join(pb.JoinRequest(**join, member_id="m-0", loaded_policy_version=0), timeout=10)
    members = {m.member_id: m for m in stub.GetStatus(pb.GetStatusRequest(), timeout=10).members}
    assert not members["m-huge"].HasField("confirmed_policy_version")
    assert members["m-0"].HasField("confirmed_policy_version") and members["m-0"].confirmed_policy_version == 0
