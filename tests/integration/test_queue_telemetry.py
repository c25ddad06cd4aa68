"""The runtime kit's OpenTelemetry set-up, seen from a real OTLP/gRPC receiver."""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.testing import make_group, queue_stub

STATS = "/tauflow.api.queue.v1.QueueService/Stats"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def attributes(self, name: str) -> list[dict[str, str]]:
        """The string attributes of every span called ``name``."""
        with self.lock:
            return [
                {a.key: a.value.string_value for a in s.attributes}
                for req in self.requests
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for s in ss.spans
                if s.name == name
            ]

    def spans(self) -> list[tuple[str, str]]:
        """(service.name, span name) of every span received."""
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    out += [(attrs.get("service.name", ""), s.name) for ss in rs.scope_spans for s in ss.spans]
        return out


def test_service_spans_reach_an_otlp_receiver(service_process) -> None:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        queue = service_process("queue", {"wal.dir": "wal"}, env)
        stub = queue_stub(queue.address)
        stub.Put(q.PutRequest(group=make_group("traced")))
        stub.Stats(q.StatsRequest())
        # A caller chooses its user-agent, which the instrumentation copies into the server's span: bounded
        with grpc.insecure_channel(queue.address, [("grpc.primary_user_agent", "x" * 6000)]) as channel:
            channel.unary_unary(STATS, q.StatsRequest.SerializeToString, q.StatsResponse.FromString)(
                q.StatsRequest(), timeout=10
            )
        assert queue.kill(signal.SIGTERM) == 0  # shutdown flushes the span processor
        spans = receiver.spans()
        assert ("tauflow-queue", STATS) in spans
        agents = [a["rpc.user_agent"] for a in receiver.attributes(STATS) if "rpc.user_agent" in a]
        assert len(agents) == 2 and any(a.startswith("xxx") for a in agents)
        assert max(len(a) for a in agents) == 1024  # (6,000 characters were kept whole)
        # The per-group Put is left out of the gRPC instrumentation (the rollout's queue.put span covers it)
        assert ("tauflow-queue", "/tauflow.api.queue.v1.QueueService/Put") not in spans
    finally:
        server.stop(0)
