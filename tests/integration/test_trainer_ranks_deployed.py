"""The trainer's ranks as Kubernetes runs them (deploy/k8s/overlays/cpu-ranks), on loopback: each rank is
its own process with the environment its pod gets from the rendered manifests (the ConfigMaps, and its
rank from the StatefulSet's pod index), rank 1 with no access to the checkpoints (on Kubernetes they are
on rank 0's volume only), and `tauflow run --launcher external` drives the training. Then both ranks are
killed and started again, as their pods would be: rank 0 resumes from its checkpoint, rank 1 gets the
state from rank 0, and the training goes on where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
from tauflow.controller.config import ROLES, RunConfig
from tauflow.core.config import load_config
from tauflow.core.net import free_port
from tauflow.core.testing import ServiceProcess
from tests.deploy import DEPLOY, container_environment, render
from tests.runs import run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "addition"
FIRST_STEPS, STEPS = 4, 8


def rank_environments(port: int) -> list[dict[str, str]]:
    """Each rank's environment from the rendered overlay, the rendezvous Service's name and port replaced by
    loopback and ``port`` (as cluster DNS would resolve it to rank 0's pod)."""
    docs = render(DEPLOY / "k8s" / "overlays" / "cpu-ranks")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}

    def trainer_container(name: str) -> dict[str, Any]:
        (container,) = [c for c in workloads[name]["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
        return container

    envs = [container_environment(docs, trainer_container("trainer"), 0)]
    followers = workloads["trainer-rank"]["spec"]
    first = followers.get("ordinals", {}).get("start", 0)
    envs += [
        container_environment(docs, trainer_container("trainer-rank"), first + i) for i in range(followers["replicas"])
    ]
    for env in envs:
        key = "TAUFLOW_TRAINER_DISTRIBUTED__MASTER_ADDRESS"
        assert env[key] == "trainer-ranks:29400"  # tests/contract/test_deploy.py: the Service publishing rank 0
        env[key] = f"127.0.0.1:{port}"
    return envs


def start_ranks(
    tmp_path: Path, settings: dict[str, object], envs: list[dict[str, str]], tag: str
) -> list[ServiceProcess]:
    """Every rank at once (each waits in the rendezvous for the others), each in a folder of its own."""
    ranks = []
    for rank, env in enumerate(envs):
        folder = tmp_path / f"{tag}-rank{rank}"
        folder.mkdir()
        own = dict(settings)
        if rank > 0:
            own["checkpoint_dir"] = str(tmp_path / "no-such-volume" / "checkpoints")  # rank 0's are not here
        ranks.append(ServiceProcess("trainer", folder, own, env))
    errors: list[BaseException] = []

    def start(proc: ServiceProcess) -> None:
        try:
            proc.start(timeout_s=120)
        except BaseException as e:  # noqa: BLE001 - reported below, from the test's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(proc,)) for proc in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return ranks


def drive(sets: list[str], addresses: dict[str, str], steps: int, out: Path) -> dict[str, Any]:
    cmd = run_command(
        RECIPE,
        [
            *sets,
            f"steps={steps}",
            f"out_dir={out}",
            *(f"external.{role}={address}" for role, address in addresses.items()),
        ],
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
    return json.loads((out / "summary.json").read_text())


def test_two_ranks_deployed_as_the_cpu_ranks_overlay_says_train_and_resume_after_both_pods_restart(
    tmp_path: Path, service_process
) -> None:
    envs = rank_environments(free_port())
    assert [env["TAUFLOW_TRAINER_DISTRIBUTED__WORLD_SIZE"] for env in envs] == ["2", "2"]
    assert "TAUFLOW_TRAINER_DISTRIBUTED__RANK" not in envs[0] and envs[1]["TAUFLOW_TRAINER_DISTRIBUTED__RANK"] == "1"

    model, dataset = tiny_addition(tmp_path)
    sets = [
        'prepare=[python, -c, "raise SystemExit(5)"]',
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        "groups_per_step=4",
        "group_size=4",
        "max_staleness=1",
        "services.rollout.groups_per_ticket=2",
        "services.trainer.checkpoint_every_steps=2",
    ]

    def role_settings(role: str, steps: int, addresses: dict[str, str]) -> dict[str, object]:
        config = load_config(
            RunConfig,
            path=RECIPE / "config.yaml",
            overrides=[*sets, f"steps={steps}", f"out_dir={tmp_path / 'layout'}"],
        )
        return build_run(config)._settings(role, addresses)

    services, addresses = {}, {}
    for role in ROLES:
        if role != "trainer":
            services[role] = service_process(role, role_settings(role, STEPS, addresses))
            addresses[role] = services[role].address
    trainer_settings = role_settings("trainer", FIRST_STEPS, addresses)
    ranks = start_ranks(tmp_path, trainer_settings, envs, "first")
    try:
        assert [(r.info["rank"], r.info["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
        assert ranks[0].info["resumed_from"] is None
        first = drive(sets, {**addresses, "trainer": ranks[0].address}, FIRST_STEPS, tmp_path / "run1")
        assert first["status"] == "completed" and first["steps"][-1]["policy_version"] == FIRST_STEPS
        assert first["staleness_violations"] == 0

        # Both pods die (a node drains); Kubernetes starts them again, rank 1 on a node without rank 0's volume.
        for rank in ranks:
            rank.kill(signal.SIGKILL)
        ranks = start_ranks(tmp_path, {**trainer_settings, **role_settings("trainer", STEPS, addresses)}, envs, "again")
        checkpoint = Path(str(ranks[0].info["resumed_from"]))
        assert checkpoint.name == f"v{FIRST_STEPS:08d}", ranks[0].info
        assert not (tmp_path / "no-such-volume").exists()  # rank 1 read (and wrote) nothing there

        second = drive(sets, {**addresses, "trainer": ranks[0].address}, STEPS, tmp_path / "run2")
        assert second["status"] == "completed" and second["steps"][-1]["policy_version"] == STEPS
        assert [s["policy_version"] for s in second["steps"]] == list(range(FIRST_STEPS + 1, STEPS + 1))
        assert second["staleness_violations"] == 0
        assert all(rank.proc is not None and rank.proc.poll() is None for rank in ranks)
    finally:
        for rank in ranks:
            rank.stop()
