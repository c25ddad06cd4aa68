"""End to end on CPU, the chaos test (#11): a `tauflow run` of the embedded task's tiny model in which, on a
seeded schedule, every role is SIGKILLed in turn — queue, reward, rollout, weight sidecar, trainer, in the
seed's order — and the rollout is SIGSTOPped for longer than the sidecar's broadcast deadlines, while an
outside producer keeps putting groups through the queue's external port. The run finishes, and accounting
is exact: every group the queue accepted (its log) was trained once (the last checkpoint), is still in the
queue, or was evicted by the queue as stale (and never trained); every group the outside producer was told was accepted is
among them; 0 staleness violations. Each kill is in the controller's log and its restart counter, the stop
in the sidecar's failed broadcasts, the rollout's re-join and the controller's health probe (its log and
counter). The long version: bench/chaos.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import KILLED, ChaosRun, schedule
from tests.runs import tiny_addition

SEED, STEPS = 0, 300
# The faults fall where a 30-step run puts them (its first 60 %); the steps after them leave the run the time
# to go through them all and bring the last killed role back while it trains: a tiny step takes as little as
# 0.06 s, and a 30- or 60-step run could end while the test still waited for a role to come back. 150 steps
# once ended while the stopped rollout (12 s, the outside producer feeding the trainer meanwhile) was still
# on its way back into the sidecar.
FAULT_STEPS = 30


@pytest.mark.timeout(900)  # bounded waits inside; a loaded machine only makes it slower
def test_every_role_killed_and_the_rollout_stopped_mid_run_loses_nothing(tmp_path: Path) -> None:
    model, dataset = tiny_addition(tmp_path)
    faults = schedule(SEED, FAULT_STEPS)
    assert sorted(f.role for f in faults if f.kind == "kill") == sorted(KILLED)
    chaos = ChaosRun(tmp_path, model, dataset, STEPS, faults, seed=SEED)
    report = chaos.execute()
    assert report.problems == [], report
    # Each step trained at least one group and at most its batch (fewer where it skipped a group trained
    # before a restart); the run was fed by both producers, and the outside one's calls met a queue that was down.
    assert STEPS <= report.trained <= STEPS * 4, report
    assert 0 < report.acknowledged_external < report.acknowledged
    assert report.producer_retries > 0, report
    assert report.acknowledged == report.trained + report.left + sum(report.evicted.values())
    log = chaos.controller_log()
    for role in KILLED:  # each kill: in the controller's log and its Prometheus counter
        assert f"service died; restarting service={role} code=-9" in log, (role, log[-3000:])
        assert report.restarts[role] == 1, report.restarts
    [stop] = [f for f in faults if f.kind == "stop"]
    assert stop.back_after_s >= 12, stop  # 3 x the sidecar's broadcast deadlines (4 s)
    assert stop.evidence["weights_failed_broadcasts"] >= 1 and stop.evidence["rollout_sidecar_rejoins"] >= 1, stop
    # The stop in the controller's log and its counter: alive, so not restarted, but not answering its health.
    assert "service not answering health service=rollout" in log, log[-3000:]
    assert "service answers health again service=rollout" in log, log[-3000:]
    assert report.unanswered.get("rollout", 0) >= 1 and report.restarts.get("rollout", 0) == 1, report
    assert all(f.at_version >= f.after_version for f in faults), faults
