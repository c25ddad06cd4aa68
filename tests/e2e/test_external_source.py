"""End to end on CPU: a program outside tauflow trains the model. A `tauflow run` of a tiny model whose
rollout only serves Generate (no dataset of its own) and whose queue has its external port on; the
calculator agent of examples/calculator_agent samples from the rollout, calls its tool, and puts
multi-turn groups with its token. Every group it put is in the trainer's checkpoint, the tokens trained
are exactly its unmasked ones (the tool's output is masked out), and in the middle of the run a wrong
token (UNAUTHENTICATED), a malformed group (INVALID_ARGUMENT naming the field) and calls the port does not
serve (UNIMPLEMENTED) change nothing: the training goes on to its last step and loses nothing."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.api.queue.v1 import queue_pb2_grpc
from tauflow.client import QueueClient, TauflowError
from tauflow.core.testing import make_group
from tests.runs import run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "addition"
AGENT = ROOT / "examples" / "calculator_agent" / "agent.py"

STEPS, GROUPS_PER_STEP = 8, 2
FIRST, SECOND = 6, 10  # the agent's groups before and after the bad calls: STEPS x GROUPS_PER_STEP in all
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _agent(out: Path, token_file: Path, record: Path, groups: int, seed: int) -> None:
    cmd = [
        sys.executable,
        str(AGENT),
        "--run-dir",
        str(out),
        "--token-file",
        str(token_file),
        "--groups",
        str(groups),
        "--group-size",
        "8",
        "--seed",
        str(seed),
        "--record",
        str(record),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def _external_metrics(port: int) -> dict[tuple[str, ...], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name.removeprefix("tauflow_queue_external_"), *(s.labels[k] for k in sorted(s.labels))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tauflow_queue_external_") and s.name.endswith("_total")
    }


def test_an_agent_outside_tauflow_trains_the_model_through_the_external_port(tmp_path: Path) -> None:
    model, dataset = tiny_addition(tmp_path, problems=10)
    agent_token, probe_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"calculator-agent: {agent_token}\nprobe: {probe_token}\n")
    token_file = tmp_path / "agent.token"
    token_file.write_text(agent_token)
    out, record = tmp_path / "run", tmp_path / "agent.jsonl"
    sets = [
        "prepare=[]",
        f"out_dir={out}",
        f"model={model}",
        f"dataset={dataset}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={STEPS}",
        f"groups_per_step={GROUPS_PER_STEP}",
        "max_staleness=1",
        "services.rollout.dataset=",  # the rollout serves Generate only: the agent is the run's one producer
        "services.trainer.checkpoint_every_steps=4",
        "services.queue.external.enabled=true",
        "services.queue.external.port=0",
        f"services.queue.external.tokens_file={tokens}",
    ]
    cmd = run_command(RECIPE, sets)
    run = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "rollout.ready.json").exists():
            assert run.poll() is None, run.stderr.read()[-3000:] if run.stderr else ""
            assert time.monotonic() < deadline, "the run's services did not start"
            time.sleep(0.2)
        queue_info = json.loads((out / "queue.ready.json").read_text())
        external = f"127.0.0.1:{queue_info['external_port']}"

        _agent(out, token_file, record, FIRST, seed=1)
        with QueueClient(external, probe_token, timeout_s=10) as probe:
            deadline = time.monotonic() + 120
            while (stats := probe.stats()).trainer_version < FIRST // GROUPS_PER_STEP:
                assert time.monotonic() < deadline, f"the agent's groups were not trained: {stats}"
                time.sleep(0.2)
            assert stats.trainer_version == FIRST // GROUPS_PER_STEP and stats.evicted_groups.get("stale", 0) == 0

            # Mid-run, with the trainer waiting for more: a stranger, a malformed group, calls that would
            # consume or steer. Each gets its status; none changes the queue.
            with QueueClient(external, secrets.token_urlsafe(24)) as stranger:
                try:
                    stranger.put(make_group("intruder"))
                    raise AssertionError("a put with an unknown token was accepted")
                except TauflowError as e:
                    assert e.code == grpc.StatusCode.UNAUTHENTICATED, e
            bad = make_group("malformed")
            del bad.samples[1].loss_mask[:]
            bad.samples[1].loss_mask.extend([True] * 3)
            try:
                probe.put(bad)
                raise AssertionError("a malformed group was accepted")
            except TauflowError as e:
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
                assert "samples[1].loss_mask has 3 entries for 8 completion tokens" in e.details
            raw = queue_pb2_grpc.QueueServiceStub(probe.channel)
            as_probe = (("authorization", f"Bearer {probe_token}"),)
            for call, request in (
                (raw.Get, q.GetRequest(max_groups=2)),
                (raw.SetTrainerVersion, q.SetTrainerVersionRequest(policy_version=100)),
            ):
                try:
                    call(request, metadata=as_probe, timeout=5)
                    raise AssertionError("the external port served a consumer's call")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
            after = probe.stats()
            assert (after.trainer_version, after.accepted_groups, after.depth_groups, after.leased_groups) == (
                stats.trainer_version,
                stats.accepted_groups,
                stats.depth_groups,
                stats.leased_groups,
            )
            assert after.accepted_groups == FIRST and after.depth_groups == 0  # (leased until a checkpoint)
            metrics = _external_metrics(queue_info["metrics_port"])
            assert metrics[("put_groups_total", "calculator-agent")] == FIRST
            assert metrics[("put_groups_total", "probe")] == 0
            assert metrics[("rejected_requests_total", "unknown", "UNAUTHENTICATED", "Put")] == 1
            assert metrics[("rejected_requests_total", "probe", "INVALID_ARGUMENT", "Put")] == 1
            assert metrics[("rejected_requests_total", "probe", "UNIMPLEMENTED", "other")] == 2

        _agent(out, token_file, record, SECOND, seed=2)
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(30)

    groups = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(groups) == FIRST + SECOND and all(g["accepted"] for g in groups)
    state = json.loads((out / "checkpoints" / f"v{STEPS:08d}" / "trainer_state.json").read_text())
    assert state["policy_version"] == STEPS
    # Everything the agent put was trained, and nothing else was (its ids namespaced by its client name).
    assert sorted(state["trained_group_ids"]) == sorted(f"calculator-agent/{g['group_id']}" for g in groups)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["staleness_violations"] == 0
    # The tokens trained are the agent's unmasked tokens of the groups with a learning signal (rewards that
    # differ), not its tool outputs: masked tokens never reach the loss.
    learning = [g for g in groups if len(set(g["rewards"])) > 1]
    assert learning and sum(g["masked_tokens"] for g in learning) > 0
    assert sum(s["trained_tokens"] for s in summary["steps"]) == sum(g["trained_tokens"] for g in learning)
