"""End to end on a Ray cluster that the test starts (one node, on this machine): `tauflow run --launcher ray`
places every service on it as a Ray actor's process and the run goes as with the local launcher; a
service process that is killed, or whose actor is lost, is started again on its node, on the same ports;
a crash loop fails naming the role."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.controller.config import ROLES, RayConfig
from tauflow.controller.launcher import ServiceFailed, ServiceSpec
from tauflow.controller.raylauncher import RayLauncher
from tests.runs import LiveRun, run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "addition"

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
# A one-node cluster in a process of its own: it lives while our pipe to it is open (ray.shutdown then
# stops every process it started), so nothing is left behind and no other Ray on the machine is touched.
HEAD = """
import logging, sys, ray
context = ray.init(num_cpus=8, include_dashboard=False, object_store_memory=80 * 2**20, logging_level=logging.WARNING)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **RAY_ENV},
    )
    try:
        address = head.stdout.readline().strip()
        assert address, f"the Ray head did not start (exit code {head.wait(30)})"
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _parent_command(pid: int) -> str:
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ready(out: Path, role: str) -> dict:
    return json.loads((out / f"{role}.ready.json").read_text())


STEPS = 8


def test_a_run_on_ray_trains_as_with_the_local_launcher_and_a_killed_trainer_comes_back(
    ray_address: str, tmp_path: Path
) -> None:
    model, dataset = tiny_addition(tmp_path)
    out = tmp_path / "run"
    sets = [
        "prepare=[]",
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
        "services.trainer.checkpoint_every_steps=3",
        "services.trainer.lease_s=4",
    ]
    cmd = run_command(RECIPE, sets, "--launcher", "ray", "--address", ray_address)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **RAY_ENV}
    )
    deadline = time.monotonic() + 300
    # Kill the trainer's process once it has checkpointed version 3 and trained beyond it.
    while not (out / "checkpoints" / "v00000003").exists() or not (out / "rollout.ready.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    ready = {role: _ready(out, role) for role in ROLES}
    for role, info in ready.items():  # each service is its Ray actor's child, on the node's address
        assert _parent_command(info["pid"]).startswith("ray::ServiceHost"), (role, _parent_command(info["pid"]))
    os.kill(ready["trainer"]["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

    node = ray_address.rsplit(":", 1)[0]
    log = (out / "logs" / "trainer.log").read_text()
    assert "=== start 1 of trainer" in log and f" on {node}, Ray actor " in log  # restarted in place, by its actor
    assert _ready(out, "trainer")["grpc_port"] == ready["trainer"]["grpc_port"]  # on the same port
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["staleness_violations"] == 0
    assert summary["steps"][-1]["policy_version"] == STEPS
    state = json.loads((out / "checkpoints" / f"v{STEPS:08d}" / "trainer_state.json").read_text())
    trained = state["trained_group_ids"]
    # None trained twice across the restart. (Groups in the checkpoint whose leases were not acked yet come
    # back and are skipped, so a step after the restart may train fewer than 4: the trainer's rule.)
    assert len(trained) == len(set(trained)) >= STEPS
    # Prometheus finds every role on its node's address.
    targets = {t["labels"]["role"]: t["targets"][0] for t in json.loads((out / "prometheus-targets.json").read_text())}
    for role in ROLES:
        assert targets[role] == f"{node}:{_ready(out, role)['metrics_port']}"
    # Stopped: every service drained (SIGTERM, in the stop order) and exited.
    for role in ROLES:
        assert not _running(_ready(out, role)["pid"]), role
        assert "draining" in (out / "logs" / f"{role}.log").read_text(), role


def test_on_ray_two_trainer_ranks_train_and_rollout_scales_1_2_1_mid_run(ray_address: str, tmp_path: Path) -> None:
    """The trainer's gang and the rollout replicas are Ray actors' processes too, and `tauflow scale` adds and
    removes replicas on the cluster while the run trains."""
    model, dataset = tiny_addition(tmp_path)
    out = tmp_path / "run"
    steps = 300  # tiny steps: enough of them that the scaling below happens while the run trains
    sets = [
        "prepare=[]",
        f"out_dir={out}",
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={steps}",
        "groups_per_step=4",
        "group_size=4",
        "max_staleness=1",
        "services.rollout.groups_per_ticket=2",
        "trainer.world_size=2",
        "rollout.replicas=1",
    ]
    run = LiveRun(run_command(RECIPE, sets, "--launcher", "ray", "--address", ray_address), out, env=RAY_ENV)
    run.wait_for("the controller", run.controller_up)
    run.wait_for("version 3", lambda: run.version() >= 3)
    assert "1 -> 2" in run.tauflow("scale", "rollout", "2")
    run.wait_for("2 serving rollout replicas", lambda: run.serving("rollout") == ["rollout", "rollout-1"])
    for name in ("trainer", "trainer-1", "rollout", "rollout-1"):  # each its own actor's child on the node
        assert _parent_command(_ready(out, name)["pid"]).startswith("ray::ServiceHost"), name
    assert "2 -> 1" in run.tauflow("scale", "rollout", "1")
    run.wait_for("one rollout replica", lambda: run.serving("rollout") == ["rollout"])
    summary = run.finish()
    assert summary["status"] == "completed" and summary["staleness_violations"] == 0
    assert [n for _, n in summary["rollout_replicas"]] == [1, 2, 1]
    assert "draining" in (out / "logs" / "rollout-1.log").read_text()  # removed with SIGTERM: it drained
    state = json.loads((out / "checkpoints" / f"v{steps:08d}" / "trainer_state.json").read_text())
    assert len(state["trained_group_ids"]) == len(set(state["trained_group_ids"])) == steps * 4


def test_a_lost_actor_comes_back_on_its_node_with_the_same_ports(ray_address: str, tmp_path: Path, monkeypatch) -> None:
    import ray

    monkeypatch.setenv("TAUFLOW_QUEUE_LOG__FORMAT", "json")  # the controller's TAUFLOW_* reach the service
    launcher = RayLauncher(tmp_path, RayConfig(address=ray_address), max_restarts=2, backoff_s=0.1)
    try:
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        address, node_id, old_pid = queue.address, queue.proc.node_id, queue.proc.pid
        assert address.startswith(ray_address.rsplit(":", 1)[0] + ":") and _serving(address)
        assert json.loads(queue.log_file.read_text().splitlines()[-1])["service"] == "queue"
        ray.kill(queue.proc.actor)  # its worker dies; the service gets SIGTERM and drains
        restarted: list[str] = []
        deadline = time.monotonic() + 60
        while not restarted and time.monotonic() < deadline:
            restarted = launcher.check()
            time.sleep(0.05)
        assert restarted == ["queue"]
        assert queue.address == address and _serving(address)  # same node, same port: its peers reconnect
        assert queue.proc.node_id == node_id and queue.proc.pid != old_pid and not _running(old_pid)
        assert queue.up
    finally:
        codes = launcher.stop()
    assert codes == {"queue": 0}  # SIGTERM through the actor: drained and exited cleanly


def test_a_crash_loop_on_ray_fails_the_run_naming_the_service(ray_address: str, tmp_path: Path) -> None:
    launcher = RayLauncher(tmp_path, RayConfig(address=ray_address), max_restarts=1, backoff_s=0.05)
    try:
        with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code 2 while starting") as err:
            launcher.start(ServiceSpec("queue", {"no_such_key": 1}))
        assert "unknown config key 'no_such_key'" in str(err.value)  # the end of its log, read from the run folder
        queue = launcher.start(ServiceSpec("queue", {"wal.dir": str(tmp_path / "wal")}))
        with pytest.raises(ServiceFailed, match="service 'queue' failed: exited with code -9 after 1 restarts"):
            for _ in range(2):
                os.kill(queue.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not launcher.check():
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
    finally:
        launcher.stop()


def test_a_role_the_cluster_has_no_room_for_fails_saying_what_it_needs(ray_address: str, tmp_path: Path) -> None:
    # A GPU run on this CPU-only cluster: the trainer's actor asks for a GPU that no node has.
    config = RayConfig(address=ray_address)
    launcher = RayLauncher(tmp_path, config, start_timeout_s=3.0)
    started = time.monotonic()
    try:
        with pytest.raises(
            ServiceFailed,
            match=r"service 'trainer' failed: its Ray actor was not placed within 3s: "
            r"it needs \{'num_cpus': 1.0, 'num_gpus': 1.0\}; the cluster has .*'CPU': .* free",
        ):
            launcher.start(ServiceSpec("trainer", {"backend.device": "cuda"}))
    finally:
        launcher.stop()
    assert time.monotonic() - started < 20  # and the pending actor is given up at once
