"""Fuzzes every TrainerService RPC of a real trainer process (issue #11): generated and mutated requests get OK or a
documented code, never UNKNOWN or INTERNAL; a refused one changes neither state, version, bound nor checkpoint.
Pause and Resume change the trainer's state by contract: they are fuzzed last, Pause before Resume."""

from __future__ import annotations

from pathlib import Path

from tauflow.api.trainer.v1 import trainer_pb2 as pb
from tauflow.api.trainer.v1 import trainer_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tests.fuzz import C, Fuzzer, Method, budget
from tests.runs import tiny_addition

SERVICE = pb.DESCRIPTOR.services_by_name["TrainerService"]


def test_every_trainer_rpc_survives_generated_and_mutated_requests(service_process, tmp_path: Path) -> None:
    model, _ = tiny_addition(tmp_path, problems=10)
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": 1})
    trainer = service_process(
        "trainer",
        {
            "backend.model_path": model,
            "queue_address": queue.address,
            "checkpoint_dir": tmp_path / "checkpoints",
            "groups_per_step": 2,
            "get_wait_s": 0.5,
        },
    )
    stub = trainer_pb2_grpc.TrainerServiceStub(
        create_sync_channel(trainer.address, [SERVICE], ChannelConfig(default_timeout_s=10))
    )

    def observe() -> tuple[object, ...]:
        s = stub.GetStatus(pb.GetStatusRequest())
        return s.state, s.policy_version, s.max_staleness, s.last_checkpoint.path, s.last_error

    methods = [
        Method("GetStatus", set(), [pb.GetStatusRequest()]),
        Method("ListSteps", set(), [pb.ListStepsRequest(from_step=0, max_steps=10)]),
        Method(
            "SetMaxStaleness",
            set(),
            [pb.SetMaxStalenessRequest(max_staleness=1), pb.SetMaxStalenessRequest(max_staleness=-1)],
        ),
        Method(
            "SaveCheckpoint",
            {C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED},
            [pb.SaveCheckpointRequest(), pb.SaveCheckpointRequest(directory=str(tmp_path / "elsewhere"))],
            timeout_s=20,
        ),
        Method("Pause", {C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED}, [pb.PauseRequest(reason="fuzz")]),
        Method("Resume", {C.FAILED_PRECONDITION}, [pb.ResumeRequest()]),
    ]
    fuzzer = Fuzzer(trainer.address, SERVICE, observe, trainer.log_text)
    try:
        for method in methods:
            fuzzer.fuzz(method, budget(60 if method.name == "SaveCheckpoint" else 120))
        print(fuzzer.summary())
    finally:
        fuzzer.close()
    assert trainer.proc.poll() is None
    assert "Traceback" not in trainer.log_text(), trainer.log_text()[-5000:]
