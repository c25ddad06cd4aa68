"""`launcher: external` end to end: the test deploys the five services itself (its own subprocesses, configured
from the run config as a deployment would be), and `tauflow run --launcher external` only connects: it
prepares nothing, starts nothing, follows the training to its last step, and leaves every service running."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
from tauflow.controller.config import ROLES, RunConfig
from tauflow.core.config import load_config
from tests.runs import run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "addition"

STEPS = 6


def test_a_run_over_services_deployed_elsewhere_trains_and_leaves_them_running(tmp_path: Path, service_process) -> None:
    model, dataset = tiny_addition(tmp_path)
    out = tmp_path / "run"
    sets = [
        # A prepare step that fails: the services are deployed with their model already, nothing is prepared.
        'prepare=[python, -c, "raise SystemExit(5)"]',
        f"out_dir={out}",
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={STEPS}",
        "groups_per_step=4",
        "group_size=4",
        "max_staleness=1",
        "services.rollout.groups_per_ticket=2",
        "services.trainer.checkpoint_every_steps=100",
    ]
    # The deployment: each role configured with what the run derives for it.
    config = load_config(RunConfig, path=RECIPE / "config.yaml", overrides=sets)
    run = build_run(config)
    services, addresses = {}, {}
    for role in ROLES:
        services[role] = service_process(role, run._settings(role, addresses))
        addresses[role] = services[role].address

    cmd = run_command(
        RECIPE,
        [*sets, *(f"external.{role}={address}" for role, address in addresses.items())],
        "--launcher",
        "external",
    )
    done = subprocess.run(
        cmd,
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"][-1]["policy_version"] == STEPS
    assert summary["staleness_violations"] == 0
    # Started nothing: no service log or ready file of the controller's, and the Prometheus targets are
    # the controller's own (the deployment scrapes its services).
    assert not any((out / "logs" / f"{role}.log").exists() or (out / f"{role}.ready.json").exists() for role in ROLES)
    targets = json.loads((out / "prometheus-targets.json").read_text())
    assert [t["labels"]["role"] for t in targets] == ["controller"]
    # Stopped nothing: every service still runs and serves.
    for role, svc in services.items():
        assert svc.proc.poll() is None, role
        with grpc.insecure_channel(svc.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, role
