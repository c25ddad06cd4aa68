"""End to end on CPU: `tauflow run` SIGKILLed mid-run leaves no service behind (each stops by itself, drained,
once its controller is gone: TAUFLOW_PARENT_PID, tauflow.core.lifeline), and `tauflow run --resume` finishes
the run from the trainer's checkpoint and the queue's log with nothing lost and nothing trained twice; a
resume of the completed run ends at once and keeps its summary."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tauflow.controller.config import ROLES
from tauflow.core.lifeline import CHECK_EVERY_S
from tests.runs import ADDITION, ROOT, run_command, tiny_addition

STEPS, GROUPS_PER_STEP = 24, 4  # killed at step 6 or so (the run frozen first: a step takes 0.08-0.7 s), resumed
EXIT_BOUND_S = 15.0  # a second to notice, the drain (10 s grace at most), the exit


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _acked_group_ids(wal_dir: Path, copy: Path) -> set[str]:
    """The groups whose leases the queue acknowledged, from its write-ahead log (replayed from a copy: reading
    a log may cut a torn tail)."""
    from tauflow.queue.records import ACK, LEASE, SNAPSHOT
    from tauflow.queue.wal import WriteAheadLog

    shutil.copytree(wal_dir, copy)
    leases: dict[str, list[str]] = {}
    acked: set[str] = set()
    wal = WriteAheadLog(copy / "queue.wal")
    for kind, meta, _, _ in wal.replay():
        if kind == LEASE:
            leases[meta["l"]] = list(meta["gs"])
        elif kind == ACK:
            acked.update(leases.pop(meta["l"]))
        elif kind == SNAPSHOT:  # a compacted log: the groups done before it
            acked.update(meta["done"])
    wal.close()
    return acked


def _trained(checkpoint: Path) -> list[str]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["trained_group_ids"]


def test_a_killed_controller_leaves_no_service_and_resume_trains_every_group_once(tmp_path: Path) -> None:
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
        f"groups_per_step={GROUPS_PER_STEP}",
        "group_size=4",
        "max_staleness=1",
        "services.rollout.groups_per_ticket=2",
        "services.trainer.checkpoint_every_steps=3",
        "services.trainer.lease_s=4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    controller = subprocess.Popen(
        run_command(ADDITION, sets), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    checkpoints = out / "checkpoints"
    deadline = time.monotonic() + 300
    # Kill the controller once the trainer has checkpointed version 6 (the newest three are kept) and trains on.
    # The services are frozen (SIGSTOP) around the kill so that a fast machine cannot finish the run in the
    # second their lifelines take to notice: on SIGCONT each sees at once that its controller is gone.
    while not any(int(c.name[1:]) >= 6 for c in checkpoints.glob("v*")) or not (out / "rollout.ready.json").exists():
        assert controller.poll() is None, controller.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint of version 6 within 300 s"
        time.sleep(0.05)
    pids = {role: json.loads((out / f"{role}.ready.json").read_text())["pid"] for role in ROLES}
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    for role, pid in pids.items():  # each service is the controller's child
        assert int(_stat(pid)[1]) == controller.pid, role
    controller.kill()
    controller.wait()
    # Frozen past one lifeline period, so that each lifeline's sleep has run out: on SIGCONT it looks at once
    # (a shorter freeze left it up to a second, in which the tiny run could train to its end).
    time.sleep(CHECK_EVERY_S + 0.5)
    for pid in pids.values():
        os.kill(pid, signal.SIGCONT)
    controller.stderr.close()
    killed_at = time.monotonic()
    left = dict(pids)
    while left and time.monotonic() - killed_at < EXIT_BOUND_S:
        left = {role: pid for role, pid in left.items() if _running(pid)}
        time.sleep(0.05)
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {EXIT_BOUND_S:.0f}s after their controller was SIGKILLed: {left}"
    for role in ROLES:  # each noticed, drained as on SIGTERM, and stopped
        log = (out / "logs" / f"{role}.log").read_text()
        gone = log.find(f"controller {controller.pid} gone: stopping")
        drained = 0 < gone < log.find("core.server: draining", gone) < log.find("core.server: stopped", gone)
        assert drained, (role, log[-800:])
    acked = _acked_group_ids(out / "queue-wal", tmp_path / "wal-at-kill")
    newest = max(checkpoints.glob("v*"))
    assert int(newest.name[1:]) < STEPS  # killed mid-run
    before = set(_trained(newest))
    assert acked and acked <= before  # a lease is acked only once a checkpoint holds its groups

    done = subprocess.run(
        run_command(ADDITION, sets, "--resume"), cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    resumed_from = int(newest.name[1:])
    # Every step after the checkpoint, once each, up to the last.
    assert [s["policy_version"] for s in summary["steps"]] == list(range(resumed_from + 1, STEPS + 1))
    assert summary["status"] == "completed" and summary["extra"]["resumed_from_version"] == resumed_from
    trained = _trained(checkpoints / f"v{STEPS:08d}")
    assert len(trained) == len(set(trained))  # no group twice
    assert acked <= before <= set(trained)  # nothing acked or checkpointed before the kill is lost
    # Every step full, except for groups a step skipped by the trainer's rules: already trained (checkpointed
    # before the kill, their leases not acked yet: redelivered, skipped by id) or too stale.
    skipped = sum(
        int(s["metrics"].get(f"skipped_{why}_groups", 0)) for s in summary["steps"] for why in ("duplicate", "stale")
    )
    assert len(trained) == STEPS * GROUPS_PER_STEP - skipped, skipped
    # A resume of the completed run (or of one whose controller died after the last checkpoint) has nothing
    # to train: it ends at once, completed, and the run's summary stays (it waited for a step that never came,
    # ended "stalled" after stall_timeout_s, and replaced the summary with one of no steps).
    again = subprocess.run(
        run_command(ADDITION, [*sets, "stall_timeout_s=120"], "--resume"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert "the run had completed already" in again.stderr
