"""The span-to-file exporter and the trace-context helpers of tauflow.core.telemetry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tauflow.core import telemetry
from tauflow.core.telemetry import JsonLinesSpanExporter, set_error, span_context_of, traceparent_of


def _provider(path: Path, service: str = "tauflow-test") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(str(path))))
    return provider


def test_file_exporter_writes_one_json_line_per_span_with_ids_parent_links_attributes_and_times(tmp_path) -> None:
    path = tmp_path / "spans.jsonl"
    provider = _provider(path)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("linked-to") as target:
        pass
    link = trace.Link(target.get_span_context(), {"rl.staleness": 2})
    with tracer.start_as_current_span("parent", links=[link], attributes={"rl.group_id": "g1"}) as parent:
        with tracer.start_as_current_span("child", attributes={"rl.tokens": 12, "shape": (1, 2)}) as child:
            pass
        try:
            raise ValueError("boom")
        except ValueError as e:
            set_error(parent, e)
    provider.shutdown()  # flushes the batch processor and closes the file

    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert set(spans) == {"linked-to", "parent", "child"}
    p, c, t = spans["parent"], spans["child"], spans["linked-to"]
    assert p["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    assert c["span_id"] == format(child.get_span_context().span_id, "016x") and len(c["span_id"]) == 16
    assert c["parent_span_id"] == p["span_id"] and c["trace_id"] == p["trace_id"]
    assert p["parent_span_id"] is None
    assert p["links"] == [{"trace_id": t["trace_id"], "span_id": t["span_id"], "attributes": {"rl.staleness": 2}}]
    assert c["attributes"] == {"rl.tokens": 12, "shape": [1, 2]}
    assert p["attributes"] == {"rl.group_id": "g1"}
    assert p["status"] == "ERROR" and "boom" in p["status_message"] and c["status"] == "UNSET"
    assert all(s["service"] == "tauflow-test" for s in spans.values())
    assert p["start_ns"] <= c["start_ns"] <= c["end_ns"] <= p["end_ns"]
    assert p["start_ns"] > 1_600_000_000 * 10**9  # epoch nanoseconds


_WRITER = """
import sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from tauflow.core.telemetry import JsonLinesSpanExporter
provider = TracerProvider(resource=Resource.create({"service.name": sys.argv[2]}))
provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(sys.argv[1]), max_export_batch_size=64))
tracer = provider.get_tracer("w")
for i in range(2000):
    with tracer.start_as_current_span("s", attributes={"i": i, "pad": "x" * 200}):
        pass
provider.shutdown()
"""


def test_processes_appending_to_one_file_never_tear_a_line(tmp_path) -> None:
    path = tmp_path / "spans.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"w{k}"]) for k in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    spans = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert len(spans) == 4000
    for k in range(2):
        assert sorted(s["attributes"]["i"] for s in spans if s["service"] == f"w{k}") == list(range(2000))


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"OTEL_TRACES_EXPORTER": "file", "TAUFLOW_TRACES_FILE": "x.jsonl"}, "x.jsonl"),
        ({"OTEL_TRACES_EXPORTER": "otlp, file", "TAUFLOW_TRACES_FILE": "x.jsonl"}, "x.jsonl"),
        ({"OTEL_TRACES_EXPORTER": "file"}, None),  # no path: warned, no file
        ({"OTEL_TRACES_EXPORTER": "otlp", "TAUFLOW_TRACES_FILE": "x.jsonl"}, None),
        ({"OTEL_TRACES_EXPORTER": "file", "TAUFLOW_TRACES_FILE": "x.jsonl", "OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_the_file_exporter_is_chosen_by_otel_traces_exporter(monkeypatch, env, want) -> None:
    for key in ("OTEL_TRACES_EXPORTER", "TAUFLOW_TRACES_FILE", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert telemetry._file_wanted() == want


def test_otlp_stays_on_with_an_endpoint_unless_the_exporter_list_leaves_it_out(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert telemetry._exporter_wanted()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,file")
    assert telemetry._exporter_wanted()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    assert not telemetry._exporter_wanted()


def test_a_stored_traceparent_round_trips_to_a_link_target() -> None:
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("group") as span:
        traceparent, _ = traceparent_of()
        assert traceparent_of(span)[0] == traceparent
    ctx = span.get_span_context()
    assert traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    restored = span_context_of(traceparent)
    assert restored is not None and restored.is_remote
    assert (restored.trace_id, restored.span_id) == (ctx.trace_id, ctx.span_id)
    assert span_context_of("") is None and span_context_of("not-a-traceparent") is None
    assert span_context_of(traceparent + "-extra") is None  # version 00 has exactly four fields
    assert span_context_of(f"00-{0:032x}-{ctx.span_id:016x}-01") is None  # an all-zero trace id is invalid
    with_state = span_context_of(traceparent, "vendor=abc,other=1")
    assert with_state is not None and with_state.trace_state.get("vendor") == "abc"
    assert traceparent_of(trace.INVALID_SPAN) == ("", "")  # tracing off: nothing stored


def test_the_grpc_instrumentation_leaves_out_health_checks_and_the_per_group_put() -> None:
    from types import SimpleNamespace

    from tauflow.core.telemetry import _traced_methods_filter

    traced = _traced_methods_filter()

    def call(method: str) -> SimpleNamespace:
        return SimpleNamespace(method=method)

    assert not traced(call("/tauflow.api.queue.v1.QueueService/Put"))  # the rollout's queue.put span covers it
    assert not traced(call("/grpc.health.v1.Health/Check"))
    for method in (
        "/tauflow.api.queue.v1.QueueService/Get",
        "/tauflow.api.queue.v1.QueueService/Reserve",
        "/tauflow.api.reward.v1.RewardService/Score",
        "/tauflow.api.queue.v1.QueueService/Ack",
    ):
        assert traced(call(method)), method
