"""The colocated hand-off through the services (the weight sidecar's ``ipc`` backend), as processes on the
CPU, where a CUDA IPC handle is a shared-memory file and the code is the same: the trainer stages a version in
its own memory and publishes only its URI; the sidecar copies nothing and has the rollout server load it
(UpdateWeightsFromTensor), which then generates with exactly those weights. A buffer overwritten before it was
read, and a forged URI, are refused and change nothing."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import grpc
import pytest
import torch

from tauflow.api.rollout.v1 import rollout_pb2
from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.weightsync import shared_request
from tauflow.weightsync.ipc import DeviceStager
from tauflow.weightsync.wire import manifest_to_proto, shared_request_to_proto
from tests.integration.test_rollout_weights import TINY, eventually, stubs, tiny_weights

PROMPT, COMPLETION = [1, 2, 3, 4], [5, 6, 7, 8, 9]
PWNED = Path("/tmp/tauflow-ipc-pwned")  # what the forged URI would create


def logprobs_of(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The completion's log-probs under ``weights``, computed here with Hugging Face's model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    model.load_state_dict(weights)
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(COMPLETION)[:, None])[:, 0]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {PWNED}",))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_colocated_rollout_loads_the_trainers_buffer_and_refuses_a_torn_or_forged_one(
    service_process, tmp_path, device: str
) -> None:
    # On a GPU: the trainer's buffer is a CUDA IPC handle, opened again for the torn read, and the engine's
    # weights are on the same device.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY)).save_pretrained(tmp_path / "model")
    car = service_process("weights", {"backend": "ipc"})
    server = service_process(
        "rollout",
        {
            "model_path": tmp_path / "model",
            "weights_address": car.address,
            "weights_check_s": 0.5,
            "engine_options.device": device,
        },
    )
    rollout, sidecar = stubs(server.address, car.address)
    stager = DeviceStager(device, bucket_bytes=64 * 1024)
    atol = 1e-4 if device == "cpu" else 2e-3  # (a GPU's kernels sum in another order; versions differ by far more)

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in tiny_weights(version).items()}

    def publish(version: int) -> tuple[object, str]:
        manifest, uri = stager.stage(weights(version), version)
        sidecar.Publish(pb.PublishRequest(manifest=manifest_to_proto(manifest), staging_uri=uri))
        return manifest, uri

    def served() -> tuple[int, torch.Tensor]:
        request = rollout_pb2.ComputeLogprobsRequest(
            sequences=[rollout_pb2.ScoredSequence(prompt_token_ids=PROMPT, completion_token_ids=COMPLETION)]
        )
        response = rollout.ComputeLogprobs(request)
        return response.policy_version, torch.tensor(list(response.sequences[0].logprobs))

    assert sidecar.GetStatus(pb.GetStatusRequest()).backend == "ipc"
    with pytest.raises(grpc.RpcError) as refused:  # the ipc sidecar takes only the trainer's ipc:// URI
        manifest, _ = stager.stage(weights(9), 9)
        sidecar.Publish(pb.PublishRequest(manifest=manifest_to_proto(manifest), staging_uri="shm://somewhere"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "staging_uri" in refused.value.details()
    assert not sidecar.GetStatus(pb.GetStatusRequest()).HasField("latest_policy_version")

    m1, uri1 = publish(1)
    eventually("the rollout serves version 1", lambda: served()[0] == 1)
    torch.testing.assert_close(served()[1], logprobs_of(tiny_weights(1)), atol=atol, rtol=0)

    def confirmed() -> list[tuple[str, int]]:
        return [(m.member_id, m.confirmed_policy_version) for m in sidecar.GetStatus(pb.GetStatusRequest()).members]

    # (the rollout confirms after its load returns, from a task of its own: the sidecar learns it a moment later)
    eventually("the sidecar records the rollout's confirmation", lambda: confirmed() == [("rollout-0", 1)])

    # Version 3 is staged into version 1's buffer (the stager alternates two): version 1 read now is torn.
    stager.stage(weights(2), 2)
    stager.stage(weights(3), 3)
    stale = shared_request_to_proto(shared_request(m1, uri1))
    with pytest.raises(grpc.RpcError) as torn:
        rollout.UpdateWeightsFromTensor(stale)
    assert torn.value.code() == grpc.StatusCode.DATA_LOSS and "version 1" in torn.value.details()
    forged = shared_request_to_proto(shared_request(m1, "ipc://" + base64.b64encode(pickle.dumps(_Evil())).decode()))
    with pytest.raises(grpc.RpcError) as evil:
        rollout.UpdateWeightsFromTensor(forged)
    assert evil.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "staging_uri" in evil.value.details()
    assert not PWNED.exists()
    empty = rollout_pb2.UpdateWeightsFromTensorRequest(staging_uri=uri1, policy_version=5)
    with pytest.raises(grpc.RpcError) as invalid:
        rollout.UpdateWeightsFromTensor(empty)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "names" in invalid.value.details()
    version, logprobs = served()  # refused requests changed nothing
    assert version == 1
    torch.testing.assert_close(logprobs, logprobs_of(tiny_weights(1)), atol=atol, rtol=0)

    publish(4)
    eventually("the rollout serves version 4", lambda: served()[0] == 4)
    torch.testing.assert_close(served()[1], logprobs_of(tiny_weights(4)), atol=atol, rtol=0)
    assert "members loaded version from the shared buffer" in car.log_text()
