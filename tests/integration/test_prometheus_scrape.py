"""A real Prometheus scrapes every service of a short `tauflow run`: the key series exist and move.

Prometheus (Debian's `prometheus`) is started by the test with a generated config whose one job reads the
run's ``prometheus-targets.json`` (file_sd, written by the controller as the roles start), scraping every
second. The run trains a tiny model (a 1-layer Qwen2 on two-digit addition) for a few dozen steps; the
assertions read Prometheus' HTTP API: generated tokens > 0 and increasing, the trainer's version
increasing and reaching the engine, queue depth within the pacing rule at every scrape, every role up.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.observability import Prometheus
from tests.runs import run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
ADDITION = ROOT / "examples" / "addition"
ROLES = ("queue", "reward", "weights", "trainer", "rollout", "controller")
TAU, GROUPS_PER_STEP, STEPS = 1, 4, 300  # start-up takes ~60 s on 2 cores, 300 steps ~30 s more

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus server is not installed (Debian: apt-get install prometheus; .ci/run installs it)",
)


def test_prometheus_scrapes_every_service_and_the_key_series_move(tmp_path: Path) -> None:
    model, dataset = tiny_addition(tmp_path, problems=400)
    out = tmp_path / "run"
    out.mkdir()
    prometheus = Prometheus(tmp_path, out / "prometheus-targets.json")
    sets = [
        "prepare=[]",
        f"out_dir={out}",
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={STEPS}",
        f"max_staleness={TAU}",
        f"groups_per_step={GROUPS_PER_STEP}",
        "group_size=4",
        "services.rollout.groups_per_ticket=2",
        "services.trainer.checkpoint_every_steps=100",
    ]
    cmd = run_command(ADDITION, sets)
    start = time.time()
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        time.sleep(2)  # the last scrape
        end = time.time()

        # Every role, the controller included, was a target and scraped successfully.
        up = prometheus.series("up", start, end)
        roles_up = {json.loads(k)["role"] for k, values in up.items() if max(values) == 1}
        assert roles_up == set(ROLES), up.keys()
        health = prometheus.series("tauflow_controller_service_up", start, end)
        assert {json.loads(k)["service"] for k, v in health.items() if max(v) == 1} == set(ROLES) - {"controller"}

        # Rollout: generated tokens > 0 and increasing (a counter: never down, and up over the run).
        tokens = prometheus.one("tauflow_rollout_generated_tokens_total", start, end)
        assert tokens[-1] > 0 and tokens[-1] > tokens[0], tokens
        assert all(b >= a for a, b in itertools.pairwise(tokens)), tokens
        rate = prometheus.one("rate(tauflow_rollout_generated_tokens_total[5s])", start, end)
        assert max(rate) > 0, rate

        # Trainer: the policy version increases over the run, and the engine follows it. The services stop
        # right after the last step, so the last scrape may precede the last few versions (on a loaded
        # machine CI saw 291 of 300): ask for most of the run, not its very end.
        version = prometheus.one("tauflow_trainer_policy_version", start, end)
        assert version[-1] >= STEPS * 3 // 4 and version[-1] > version[0], version
        assert all(b >= a for a, b in itertools.pairwise(version)), version
        engine = prometheus.one("tauflow_rollout_engine_policy_version", start, end)
        assert max(engine) >= STEPS // 2, engine
        phases = prometheus.series("tauflow_trainer_step_phase_duration_seconds_count", start, end)
        assert {json.loads(k)["phase"] for k, v in phases.items() if max(v) > 0} == {"wait", "train", "publish"}

        # Queue: depth within the pacing rule at every scrape ((tau + 1) x groups_per_step), and the rule
        # itself (accepted + reserved <= limit) held in every sample.
        depth = prometheus.one("tauflow_queue_depth_groups", start, end)
        assert max(depth) <= (TAU + 1) * GROUPS_PER_STEP, depth
        slack = prometheus.one(
            "tauflow_queue_pacing_limit_groups - tauflow_queue_accepted_groups - tauflow_queue_reserved_groups",
            start,
            end,
        )
        assert min(slack) >= 0, slack
        delivered = prometheus.one("tauflow_queue_delivered_staleness_steps_count", start, end)
        assert delivered[-1] >= STEPS * 3 // 4 * GROUPS_PER_STEP, delivered

        # Weights: versions broadcast, with bytes and a duration per broadcast.
        assert prometheus.one("tauflow_weights_broadcast_bytes_total", start, end)[-1] > 0
        ok = prometheus.one('tauflow_weights_broadcasts_total{outcome="ok"}', start, end)
        assert ok[-1] > 0, ok
    finally:
        prometheus.stop()
