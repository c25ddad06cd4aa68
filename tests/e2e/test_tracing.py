"""End to end on CPU: a short `tauflow run` of a tiny model exports its spans over OTLP/gRPC to a real
receiver in this test (opentelemetry-proto's TraceService) and to the run's span file; a trained group's
path rollout -> reward -> queue is one trace, a trainer.step links to it, and the sidecar's broadcast and the
engine's load link to that step's publish (docs/observability.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.runs import run_command, tiny_addition

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "addition"

SERVICES = {"tauflow-queue", "tauflow-reward", "tauflow-weights", "tauflow-trainer", "tauflow-rollout"}
STEPS = 12


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span, as the file exporter writes them."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans += [_span(s, resource.get("service.name", "")) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def _span(s, service: str) -> dict[str, Any]:
    return {
        "name": s.name,
        "service": service,
        "trace_id": s.trace_id.hex(),
        "span_id": s.span_id.hex(),
        "parent_span_id": s.parent_span_id.hex() or None,
        "start_ns": s.start_time_unix_nano,
        "end_ns": s.end_time_unix_nano,
        "status": {0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code],
        "attributes": {a.key: _value(a.value) for a in s.attributes},
        "links": [
            {
                "trace_id": link.trace_id.hex(),
                "span_id": link.span_id.hex(),
                "attributes": {a.key: _value(a.value) for a in link.attributes},
            }
            for link in s.links
        ],
    }


def _linking(spans: list[dict[str, Any]], name: str, target: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        s
        for s in spans
        if s["name"] == name
        and any(link["span_id"] == target["span_id"] and link["trace_id"] == target["trace_id"] for link in s["links"])
    ]


def test_each_group_traced_from_rollout_to_queue_and_linked_from_the_step_the_broadcast_and_the_loads(
    tmp_path: Path,
) -> None:
    model, dataset = tiny_addition(tmp_path)

    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
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
        "traces_file=traces.jsonl",
        "services.rollout.groups_per_ticket=2",
        "services.trainer.checkpoint_every_steps=100",
    ]
    cmd = run_command(RECIPE, sets)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    env.pop("OTEL_TRACES_EXPORTER", None)
    env.pop("OTEL_SDK_DISABLED", None)
    try:
        done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        server.stop(0)
    spans = receiver.spans

    # Every service's spans arrive.
    assert SERVICES <= {s["service"] for s in spans}, sorted({s["service"] for s in spans})
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)

    steps = [s for s in spans if s["name"] == "trainer.step" and s["attributes"].get("rl.committed")]
    assert len(steps) >= STEPS, len(steps)
    complete = 0  # steps whose groups, broadcast and loads are all traced
    for step in steps:
        assert step["service"] == "tauflow-trainer" and step["links"]
        assert step["attributes"]["rl.max_staleness"] <= 1  # tau = 1
        children = {s["name"] for s in by_trace[step["trace_id"]] if s["parent_span_id"] == step["span_id"]}
        assert {"queue.get", "forward_backward", "optimizer.step", "weights.publish"} <= children, children
        # For each group the step trained: the rollout -> reward -> queue path, one trace id.
        for link in step["links"]:
            assert isinstance(link["attributes"].get("rl.staleness"), int) and link["attributes"]["rl.staleness"] >= 0
            put = by_id[(link["trace_id"], link["span_id"])]  # the group's span: its put
            assert put["name"] == "queue.put" and put["service"] == "tauflow-rollout"
            assert put["attributes"]["rl.group_id"] == link["attributes"]["rl.group_id"]
            assert "rl.reward_mean" in put["attributes"] and put["attributes"]["rl.completion_tokens"] > 0
            ticket = by_id[(put["trace_id"], put["parent_span_id"])]
            assert ticket["name"] == "rollout.ticket" and ticket["parent_span_id"] is None
            trace_spans = by_trace[put["trace_id"]]
            phases = {s["name"]: s for s in trace_spans if s["parent_span_id"] == ticket["span_id"]}
            assert {"rollout.generate", "reward.score", "queue.put"} <= set(phases)
            assert phases["rollout.generate"]["end_ns"] <= phases["reward.score"]["start_ns"]
            assert phases["reward.score"]["end_ns"] <= put["start_ns"]
            # The Score call crossed into the reward process within the same trace (gRPC propagation).
            assert any(s["service"] == "tauflow-reward" and s["name"].endswith("/Score") for s in trace_spans)
        publish = next(
            s
            for s in by_trace[step["trace_id"]]
            if s["parent_span_id"] == step["span_id"] and s["name"] == "weights.publish"
        )
        broadcasts = [s for s in _linking(spans, "weights.broadcast", publish) if s["service"] == "tauflow-weights"]
        loads = [s for s in _linking(spans, "weights.load", publish) if s["service"] == "tauflow-rollout"]
        if broadcasts and loads:
            complete += 1
            assert broadcasts[0]["attributes"]["rl.policy_version"] == step["attributes"]["rl.policy_version"]
            assert loads[0]["attributes"]["rl.policy_version"] == step["attributes"]["rl.policy_version"]
            # (the sidecar may finish a tiny broadcast before the Publish response is back at the trainer)
            assert publish["start_ns"] <= broadcasts[0]["start_ns"] <= loads[0]["end_ns"] <= broadcasts[0]["end_ns"]
    # The sidecar skips a version superseded before its broadcast began (tau = 1 lets the trainer run
    # ahead), so not every publish is broadcast; most are.
    assert complete >= len(steps) // 2, (complete, len(steps))

    # The same run's span file, and `tauflow trace` on it.
    lines = (out / "traces.jsonl").read_text().splitlines()
    in_file = [json.loads(line) for line in lines]
    assert SERVICES <= {s["service"] for s in in_file}
    assert {s["span_id"] for s in in_file if s["name"] == "trainer.step"} >= {s["span_id"] for s in steps}
    summary = subprocess.run(
        [sys.executable, "-m", "tauflow.controller.cli", "trace", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in summary.stdout.splitlines()[2:]}
    for phase in ("generate", "score", "queue_wait", "train", "publish", "broadcast", "load", "total"):
        assert int(rows[phase][1]) > 0, summary.stdout  # every phase measured for some trained group
    assert (out / "traces.png").stat().st_size > 5_000
    print(summary.stdout)
