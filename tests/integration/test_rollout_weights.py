"""A rollout server and the weight sidecar as processes: the server stays a member, joining again when a
restarted sidecar has forgotten it or a failed phase got it dropped, and so receives every next version."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.api.weights.v1 import weights_pb2 as pb
from tauflow.api.weights.v1 import weights_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.weightsync import Stager
from tauflow.weightsync.wire import manifest_to_proto

TINY = {
    "vocab_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def tiny_weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return dict(Qwen2ForCausalLM(Qwen2Config(**TINY)).state_dict())


def stubs(rollout: str, sidecar: str):
    config = ChannelConfig(default_timeout_s=10)
    r = create_sync_channel(rollout, [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]], config)
    w = create_sync_channel(sidecar, [pb.DESCRIPTOR.services_by_name["WeightsService"]], config)
    return rollout_pb2_grpc.RolloutServiceStub(r), weights_pb2_grpc.WeightsServiceStub(w)


def eventually(what: str, predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.1)


def test_the_rollout_rejoins_a_restarted_sidecar_and_one_that_dropped_it(service_process, tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY)).save_pretrained(tmp_path / "model")
    deadlines = {
        "deadlines.group_s": 3,
        "deadlines.confirm_s": 3,
        "deadlines.destroy_s": 2,
        "deadlines.rpc_margin_s": 1,
    }
    car = service_process("weights", deadlines)
    server = service_process(
        "rollout", {"model_path": tmp_path / "model", "weights_address": car.address, "weights_check_s": 0.5}
    )
    rollout, sidecar = stubs(server.address, car.address)
    stager = Stager(bucket_bytes=64 * 1024)

    def publish(version: int) -> None:
        manifest = stager.stage(tiny_weights(version), version)
        sidecar.Publish(pb.PublishRequest(manifest=manifest_to_proto(manifest), staging_uri=stager.uri))

    def serves() -> int:
        return rollout.GetStatus(rollout_pb2.GetStatusRequest()).engines[0].policy_version

    def member_state() -> int:
        members = sidecar.GetStatus(pb.GetStatusRequest()).members
        return next((m.state for m in members if m.member_id == "rollout-0"), pb.MEMBER_STATE_UNSPECIFIED)

    try:
        publish(1)
        eventually("the rollout serves version 1", lambda: serves() == 1)

        # The sidecar restarts (same address, as its supervisor does): it knows no member any more.
        car.kill(signal.SIGKILL)
        car.settings["server.port"] = car.info["grpc_port"]
        car.start()
        publish(2)
        eventually("the rollout re-joins the restarted sidecar and serves version 2", lambda: serves() == 2)

        # A failed phase: the server misses the transfer deadline (stopped), and the sidecar drops it.
        server.proc.send_signal(signal.SIGSTOP)
        try:
            publish(3)
            eventually("the sidecar drops the stopped member", lambda: member_state() == pb.MEMBER_STATE_FAILED)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        eventually("the dropped rollout re-joins and serves version 3", lambda: serves() == 3)
        assert member_state() == pb.MEMBER_STATE_ACTIVE
        publish(4)
        eventually("and version 4 after it", lambda: serves() == 4)
        assert "joining again" in server.log_text()
    finally:
        stager.close()
