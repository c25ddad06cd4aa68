"""Fuzzes every ControllerService RPC of a real controller process (issue #11): generated and mutated requests get
OK or a documented code, never UNKNOWN or INTERNAL; a refused one changes nothing. The control methods are
fuzzed with the run token, and refused UNAUTHENTICATED without it. The controller runs with the
external launcher towards roles that are not there, so it serves while its run waits for them (no model needed);
StopRun, which ends the run by contract, is fuzzed last."""

from __future__ import annotations

import socket
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.api.controller.v1 import controller_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tests.fuzz import C, Fuzzer, Method, budget

SERVICE = pb.DESCRIPTOR.services_by_name["ControllerService"]
ROLES = ("queue", "reward", "weights", "trainer", "rollout")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_controller_rpc_survives_generated_and_mutated_requests(service_process, tmp_path: Path) -> None:
    settings: dict[str, object] = {
        "run.launcher": "external",
        "run.model": str(tmp_path / "model"),
        "run.dataset": str(tmp_path / "d.jsonl"),
        "run.steps": 2,
        "run.out_dir": str(tmp_path / "run"),
        "run.start_timeout_s": 3600,
    }
    for role in ROLES:
        settings[f"run.external.{role}"] = f"127.0.0.1:{_closed_port()}"
    controller = service_process("controller", settings)
    stub = controller_pb2_grpc.ControllerServiceStub(
        create_sync_channel(controller.address, [SERVICE], ChannelConfig(default_timeout_s=10))
    )

    def observe() -> tuple[object, ...]:
        run = stub.GetRun(pb.GetRunRequest()).run
        return run.state, run.policy_version, run.max_staleness, run.message

    # The run waits for its roles (it is not training): a live τ is FAILED_PRECONDITION, and so is scaling
    # with launcher external (the deployment scales); a τ or a replica count out of bounds is INVALID_ARGUMENT.
    refused = {C.FAILED_PRECONDITION}
    methods = [
        Method("GetRun", set(), [pb.GetRunRequest()]),
        Method("ListServices", set(), [pb.ListServicesRequest(), pb.ListServicesRequest(kind=pb.SERVICE_KIND_ROLLOUT)]),
        Method("SetMaxStaleness", refused, [pb.SetMaxStalenessRequest(max_staleness=1)]),
        Method("ScaleRollout", refused, [pb.ScaleRolloutRequest(replicas=2)]),
        Method("StopRun", set(), [pb.StopRunRequest(reason="fuzz", grace_period=Duration(seconds=1))]),
    ]
    # Without the run token (tauflow.core.auth) a control method is refused before it reads anything.
    stranger = Fuzzer(controller.address, SERVICE, observe, controller.log_text)
    try:
        for method in methods[2:]:
            before = observe()
            assert stranger.call(method, method.valid[0].SerializeToString())[0] == C.UNAUTHENTICATED
            assert observe() == before
    finally:
        stranger.close()
    token = (tmp_path / "run" / "run.token").read_text().strip()
    fuzzer = Fuzzer(controller.address, SERVICE, observe, controller.log_text, token=token)
    try:
        for method in methods[:-1]:
            fuzzer.fuzz(method, budget(80))
        # StopRun ends the run by contract: first only requests it refuses, then anything.
        bad = pb.StopRunRequest(grace_period=Duration(seconds=1, nanos=-1))
        assert fuzzer.call(methods[-1], bad.SerializeToString())[0] == C.INVALID_ARGUMENT
        assert observe()[0] == pb.RUN_STATE_STARTING  # (waiting for its roles)
        fuzzer.fuzz(methods[-1], budget(40))
        fuzzer.fuzz(methods[0], budget(20))  # and it still answers afterwards
        print(fuzzer.summary())
    finally:
        fuzzer.close()
