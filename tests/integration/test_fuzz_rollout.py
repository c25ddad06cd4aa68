"""Fuzzes every RolloutService RPC of a real rollout server (the tiny model of the embedded task) (issue #11):
generated and mutated requests get OK or a documented code, never UNKNOWN or INTERNAL; a refused one changes
neither the served version nor the weight group. InitWeightsUpdateGroup comes last: a request that names a
store nobody serves waits out its own timeout on a thread of its own (another build meanwhile is refused:
RESOURCE_EXHAUSTED), which bucket receives and Destroy still queue on.
The weight RPCs are fuzzed again on a server joined to a weight sidecar, which it asks about versions."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from google.protobuf.duration_pb2 import Duration

from tauflow.api.common.v1 import common_pb2
from tauflow.api.rollout.v1 import rollout_pb2 as pb
from tauflow.api.rollout.v1 import rollout_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.weightsync.ipc import share
from tests.fuzz import C, Fuzzer, Method, budget
from tests.runs import ADDITION, tiny_addition

SERVICE = pb.DESCRIPTOR.services_by_name["RolloutService"]


def test_every_rollout_rpc_survives_generated_and_mutated_requests(service_process, tmp_path: Path) -> None:
    model, _ = tiny_addition(tmp_path, problems=10)
    sys.path.insert(0, str(ADDITION))
    import task

    server = service_process("rollout", {"model_path": model, "max_n": 8, "max_wait_s": 1})
    stub = rollout_pb2_grpc.RolloutServiceStub(
        create_sync_channel(server.address, [SERVICE], ChannelConfig(default_timeout_s=10))
    )

    def observe() -> tuple[object, ...]:
        s = stub.GetStatus(pb.GetStatusRequest())
        e = s.engines[0]
        return (
            s.membership_epoch,
            s.weights_group_name,
            e.state,
            e.policy_version,
            e.weight_update_in_progress,
            e.last_error,
        )

    sampling = pb.SamplingParams(n=2, max_new_tokens=4, seed=1, temperature=0.7)
    tiny_temperature = pb.SamplingParams(n=2, max_new_tokens=4, temperature=1e-40)  # logits / T: inf, NaN
    init = pb.InitWeightsUpdateGroupRequest(
        master_address="127.0.0.1",
        master_port=1,
        rank_offset=1,
        world_size=2,
        group_name="g1",
        backend="gloo",
        membership_epoch=1,
        timeout=Duration(seconds=1),
    )
    update = pb.UpdateWeightsFromDistributedRequest(
        names=["model.embed_tokens.weight"],
        dtypes=["float32"],
        shapes=[pb.TensorShape(dims=[16, 32])],
        group_name="g1",
        policy_version=1,
        membership_epoch=1,
        bucket_index=0,
        bucket_count=1,
        manifest_checksum="ab",
        trace_context=common_pb2.TraceContext(traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01"),
    )
    # A real shared buffer (the colocated hand-off's) whose bytes are not the manifest's: DATA_LOSS, or a
    # mutation's INVALID_ARGUMENT; never a load.
    shared = torch.zeros(16 * 32 * 4, dtype=torch.uint8)
    from_tensor = pb.UpdateWeightsFromTensorRequest(
        names=["model.embed_tokens.weight"],
        dtypes=["float32"],
        shapes=[pb.TensorShape(dims=[16, 32])],
        staging_uri=share(shared),
        policy_version=1,
        membership_epoch=1,
        manifest_checksum="ab",
        trace_context=common_pb2.TraceContext(traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01"),
    )
    methods = [
        Method("GetStatus", set(), [pb.GetStatusRequest()]),
        # DEADLINE_EXCEEDED: waiting for a min_policy_version the server never reaches (it has no sidecar).
        Method(
            "Generate",
            {C.UNAVAILABLE, C.DEADLINE_EXCEEDED},
            [
                pb.GenerateRequest(request_id="r", prompt_token_ids=task.prompt_ids(1, 2), sampling=sampling),
                pb.GenerateRequest(prompt_text="12+34=", sampling=sampling),
                pb.GenerateRequest(prompt_token_ids=task.prompt_ids(1, 2), sampling=tiny_temperature),
            ],
            timeout_s=3,
            waits=True,
        ),
        Method(
            "ComputeLogprobs",
            {C.UNAVAILABLE, C.DEADLINE_EXCEEDED},
            [
                pb.ComputeLogprobsRequest(
                    sequences=[
                        pb.ScoredSequence(prompt_token_ids=task.prompt_ids(1, 2), completion_token_ids=[5, 6, 2])
                    ],
                    temperature=0.7,
                ),
                pb.ComputeLogprobsRequest(
                    sequences=[pb.ScoredSequence(prompt_token_ids=[1, 2], completion_token_ids=[5])],
                    temperature=1e-40,
                ),
            ],
            timeout_s=3,
        ),
        Method(
            "DestroyWeightsUpdateGroup", {C.DEADLINE_EXCEEDED}, [pb.DestroyWeightsUpdateGroupRequest(group_name="g1")]
        ),
        Method(
            "UpdateWeightsFromDistributed",
            {C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED, C.ABORTED, C.UNAVAILABLE, C.DATA_LOSS},
            [update],
        ),
        Method("UpdateWeightsFromTensor", {C.DATA_LOSS, C.UNAVAILABLE, C.DEADLINE_EXCEEDED}, [from_tensor]),
        Method(
            "InitWeightsUpdateGroup",
            {
                C.ALREADY_EXISTS,
                C.FAILED_PRECONDITION,
                C.DEADLINE_EXCEEDED,
                C.UNAVAILABLE,
                C.ABORTED,
                C.RESOURCE_EXHAUSTED,
            },
            [init],
            timeout_s=3,
            waits=True,
        ),
    ]
    fuzzer = Fuzzer(server.address, SERVICE, observe, server.log_text)
    try:
        for method in methods:
            fuzzer.fuzz(method, budget(40 if method.name == "InitWeightsUpdateGroup" else 120))
        print(fuzzer.summary())
    finally:
        fuzzer.close()
    assert server.proc.poll() is None
    assert "Traceback" not in server.log_text(), server.log_text()[-5000:]


def test_weight_rpcs_of_a_server_joined_to_a_sidecar_survive_generated_and_mutated_requests(
    service_process, tmp_path: Path
) -> None:
    # With a sidecar, a bucket makes the server ask it for the version's manifest: a refused bucket must not
    # (no group, another epoch, out of order, past bucket_count), and the sidecar's NOT_FOUND is no INTERNAL.
    model, _ = tiny_addition(tmp_path, problems=10)
    car = service_process("weights")
    server = service_process("rollout", {"model_path": model, "weights_address": car.address, "max_wait_s": 1})
    stub = rollout_pb2_grpc.RolloutServiceStub(
        create_sync_channel(server.address, [SERVICE], ChannelConfig(default_timeout_s=10))
    )

    def observe() -> tuple[object, ...]:
        s = stub.GetStatus(pb.GetStatusRequest())
        e = s.engines[0]
        return s.membership_epoch, s.weights_group_name, e.policy_version, e.weight_update_in_progress, e.last_error

    update = pb.UpdateWeightsFromDistributedRequest(
        names=["model.embed_tokens.weight"],
        dtypes=["float32"],
        shapes=[pb.TensorShape(dims=[16, 32])],
        group_name="g1",
        policy_version=7,
        membership_epoch=1,
        bucket_index=0,
        bucket_count=1,
        manifest_checksum="ab",
    )
    methods = [
        Method(
            "UpdateWeightsFromDistributed",
            {C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED, C.ABORTED, C.UNAVAILABLE, C.DATA_LOSS},
            [update, pb.UpdateWeightsFromDistributedRequest(bucket_index=5, bucket_count=1, group_name="g1")],
        ),
        Method(
            "DestroyWeightsUpdateGroup", {C.DEADLINE_EXCEEDED}, [pb.DestroyWeightsUpdateGroupRequest(group_name="g1")]
        ),
    ]
    fuzzer = Fuzzer(server.address, SERVICE, observe, server.log_text)
    try:
        for method in methods:
            fuzzer.fuzz(method, budget(60))
        print(fuzzer.summary())
    finally:
        fuzzer.close()
    assert server.proc.poll() is None
    assert "Traceback" not in server.log_text(), server.log_text()[-5000:]
