"""Fuzzes every WeightsService RPC of a real sidecar process (issue #11): generated and mutated requests get OK
or a documented code, never UNKNOWN or INTERNAL; a refused one changes no membership and no version."""

from __future__ import annotations

from pathlib import Path

import torch

from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.api.weights.v1 import weights_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.weightsync import Stager
from tauflow.weightsync.wire import manifest_to_proto
from tests.fuzz import C, Fuzzer, Method, budget

SERVICE = pb.DESCRIPTOR.services_by_name["WeightsService"]


def test_every_weights_rpc_survives_generated_and_mutated_requests(service_process, tmp_path: Path) -> None:
    car = service_process(
        "weights",
        {
            "deadlines.group_s": 1,
            "deadlines.confirm_s": 1,
            "deadlines.destroy_s": 1,
            "deadlines.rpc_margin_s": 0.5,
            "deadlines.handoff_s": 5,
            "max_members": 32,
            "max_retained_bytes": 1 << 20,
        },
    )
    stub = weights_pb2_grpc.WeightsServiceStub(
        create_sync_channel(car.address, [SERVICE], ChannelConfig(default_timeout_s=10))
    )
    stager = Stager(bucket_bytes=1024)
    manifest = manifest_to_proto(stager.stage({"a.weight": torch.ones(8, 8), "b.bias": torch.zeros(8)}, 1))

    def observe() -> tuple[object, ...]:
        # What a call changes at once; member states and epochs move in the background (broadcasts to the
        # fuzzed members fail), so they are left out.
        s = stub.GetStatus(pb.GetStatusRequest())
        latest = s.latest_policy_version if s.HasField("latest_policy_version") else None
        return latest, sorted((m.member_id, m.address, m.num_ranks) for m in s.members)

    publish = pb.PublishRequest(manifest=manifest, staging_uri=stager.uri)
    confirm = pb.ConfirmVersionRequest(
        member_id="m0", policy_version=1, manifest_checksum=manifest.checksum, membership_epoch=1
    )
    methods = [
        # Publish first, with no member yet: a published version is what later broadcasts (to fuzzed members) send.
        Method(
            "Publish",
            {C.FAILED_PRECONDITION, C.NOT_FOUND, C.DATA_LOSS, C.DEADLINE_EXCEEDED},
            [publish, pb.PublishRequest(manifest=manifest, staging_uri="file:///nonexistent")],
            timeout_s=10,
        ),
        Method("GetManifest", {C.NOT_FOUND}, [pb.GetManifestRequest(policy_version=1), pb.GetManifestRequest()]),
        Method(
            "Join",
            {C.FAILED_PRECONDITION},  # RESOURCE_EXHAUSTED (membership full) is in ALWAYS
            [
                pb.JoinRequest(
                    member_id="m0",
                    address="127.0.0.1:1",
                    num_ranks=1,
                    backends=["gloo"],
                    model=manifest.model,
                    loaded_policy_version=1,
                )
            ],
        ),
        Method("ConfirmVersion", {C.NOT_FOUND, C.FAILED_PRECONDITION, C.DATA_LOSS}, [confirm]),
        Method("Leave", set(), [pb.LeaveRequest(member_id="m0", reason="fuzz")]),
        Method("GetStatus", set(), [pb.GetStatusRequest()]),
    ]
    fuzzer = Fuzzer(car.address, SERVICE, observe, car.log_text)
    try:
        for method in methods:
            fuzzer.fuzz(method, budget(120))
        print(fuzzer.summary())
    finally:
        fuzzer.close()
        stager.close()
    assert car.proc.poll() is None
    assert "Traceback" not in car.log_text(), car.log_text()[-5000:]
