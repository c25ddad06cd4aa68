"""OpenTelemetry set-up from the standard ``OTEL_*`` variables.

Tracing is exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (or ``OTEL_TRACES_EXPORTER=otlp``);
``OTEL_SDK_DISABLED=true`` turns it off. The service name comes from
``OTEL_SERVICE_NAME`` when set, otherwise ``tauflow-<service>``. gRPC servers
and clients are instrumented either way, so trace context crosses every call
(all but health checks and the queue's Put: ``UNTRACED_METHODS``).

``OTEL_TRACES_EXPORTER=file`` (alone or in a list, e.g. ``otlp,file``) with
``TAUFLOW_TRACES_FILE=PATH`` also writes every span to ``PATH`` as JSON lines
(see ``JsonLinesSpanExporter``), so a run can be inspected without a collector;
several processes may append to one file. Spans are exported by a
``BatchSpanProcessor`` either way: a step never waits on an export.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tauflow.core.logs import CallerProvokedErrors

log = logging.getLogger(__name__)
_configured = False
# gRPC methods the instrumentation leaves alone: health checks (polled all run long), and the per-group
# Put, whose `queue.put` span the rollout makes itself (the group carries its trace context in the
# message, so nothing is lost; two gRPC spans per group were a third of all spans: bench/README.md).
UNTRACED_METHODS = ("/tauflow.api.queue.v1.QueueService/Put",)
TRACES_FILE_ENV = "TAUFLOW_TRACES_FILE"


def _hex_trace(trace_id: int) -> str:
    return format(trace_id, "032x")


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def _value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One span as the file exporter writes it: ids in hex as W3C writes them, times in ns since the
    epoch, the service name and the process's instance id (``service.instance.id``) from the resource."""
    ctx = span.context
    resource = span.resource.attributes if span.resource is not None else {}
    return {
        "name": span.name,
        "service": resource.get("service.name", ""),
        "instance": resource.get("service.instance.id", ""),  # the process of its role (rollout-2, trainer-1)
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_span_id": _hex_span(span.parent.span_id) if span.parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "attributes": {k: _value(v) for k, v in (span.attributes or {}).items()},
        "links": [
            {
                "trace_id": _hex_trace(link.context.trace_id),
                "span_id": _hex_span(link.context.span_id),
                "attributes": {k: _value(v) for k, v in (link.attributes or {}).items()},
            }
            for link in span.links
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file (see ``span_to_dict``). Each batch is one ``write`` on
    a file opened with ``O_APPEND``, so several processes can share the file without tearing lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError:
                log.warning("could not write spans", extra={"path": self.path}, exc_info=True)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _exporters() -> list[str]:
    return [e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]


def _file_wanted() -> str | None:
    """The path of the span file when ``file`` is among the exporters (and tracing is on)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or "file" not in _exporters():
        return None
    path = os.environ.get(TRACES_FILE_ENV, "")
    if not path:
        log.warning(f"OTEL_TRACES_EXPORTER names `file` but {TRACES_FILE_ENV} is not set; no span file")
        return None
    return path


def configured_exporters() -> list[str]:
    """The span exporters the environment asks for: ``OTEL_TRACES_EXPORTER`` (without ``none``), or
    ``otlp`` when only an OTLP endpoint is set."""
    exporters = _exporters()
    if not exporters and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        exporters = ["otlp"]
    return [e for e in exporters if e != "none"]


def _exporter_wanted() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return "otlp" in configured_exporters()


DETACH_LOGGER = "opentelemetry.context"
DETACH_LOG_EVERY_S = 60.0


class DetachErrors(CallerProvokedErrors):
    """OpenTelemetry logs "Failed to detach context" at ERROR with a traceback whenever a context is detached in
    another context than it was attached in: the grpc aio server instrumentation does so for every
    response-streaming call whose caller left mid-stream (its generator is closed from another task), so any
    client could write one traceback per dropped stream, at will (28 KB/s from one client)."""

    def __init__(self, every_s: float = DETACH_LOG_EVERY_S) -> None:
        super().__init__(
            "Failed to detach context",
            "failed to detach a trace context (%s; a caller left a stream); %d more since the last line",
            every_s,
        )


def quiet_detach_errors(every_s: float = DETACH_LOG_EVERY_S) -> None:
    """Installs :class:`DetachErrors` on OpenTelemetry's context logger (once: a second call replaces it)."""
    logger = logging.getLogger(DETACH_LOGGER)
    logger.filters[:] = [f for f in logger.filters if not isinstance(f, DetachErrors)]
    logger.addFilter(DetachErrors(every_s))


def setup_telemetry(service: str, version: str) -> None:
    """Installs the tracer provider and the gRPC instrumentation, once per process."""
    global _configured
    quiet_detach_errors()  # (before the early return: the rate limit holds whoever set tracing up)
    if _configured:
        return
    _configured = True
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
    )
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {SERVICE_VERSION: version}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = f"tauflow-{service}"
    provider = TracerProvider(resource=Resource.create(attrs), span_limits=span_limits())
    if _exporter_wanted():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing exported over OTLP")
    path = _file_wanted()
    if path:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
        log.info("spans written to a file", extra={"path": path})
    trace.set_tracer_provider(provider)
    traced = _traced_methods_filter()
    GrpcAioInstrumentorServer(filter_=traced).instrument()
    GrpcAioInstrumentorClient(filter_=traced).instrument()


# A span attribute's longest string value, unless OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT or
# OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT says otherwise: the gRPC instrumentation copies a caller's user-agent into
# every server span whole (any caller, on any port, without a token: a 9 KB header made each span 15x larger).
SPAN_ATTRIBUTE_MAX_CHARS = 1024


def span_limits():
    from opentelemetry.sdk.trace import SpanLimits

    if os.environ.get("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT") or os.environ.get("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"):
        return SpanLimits()  # (the SDK reads them)
    return SpanLimits(max_span_attribute_length=SPAN_ATTRIBUTE_MAX_CHARS)


def _traced_methods_filter():
    """The instrumentation's filter: True for the calls that get spans (see ``UNTRACED_METHODS``)."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(filters.health_check(), *(filters.full_method_name(m) for m in UNTRACED_METHODS))
    )


def shutdown_telemetry() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


# -- trace context in messages (common.v1.TraceContext) ---------------------------------------


def traceparent_of(span: trace.Span | None = None) -> tuple[str, str]:
    """(traceparent, tracestate) of ``span`` (default: the current span) as W3C trace context writes
    them; ("", "") when it is not a valid trace, e.g. with tracing off."""
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return "", ""
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state


def span_context_of(traceparent: str, tracestate: str = "") -> trace.SpanContext | None:
    """The remote span context a stored ``traceparent`` names, for a link; None when it is empty or
    malformed. (A plain parse: a step links to every group it trains, so this runs often.)"""
    parts = traceparent.split("-") if traceparent else []
    if len(parts) < 4 or len(parts[0]) != 2 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        version, trace_id, span_id, flags = (int(p, 16) for p in parts[:4])
    except ValueError:
        return None
    if version == 0xFF or (version == 0 and len(parts) != 4):
        return None
    state = trace.TraceState.from_header([tracestate]) if tracestate else None
    ctx = trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags & 0xFF), trace_state=state
    )
    return ctx if ctx.is_valid else None


def set_error(span: trace.Span, error: BaseException) -> None:
    """Marks ``span`` failed with ``error`` (status ERROR and an exception event)."""
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
