"""OpenTelemetry set-up from the standard ``OTEL_*`` variables.

Tracing is exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (or ``OTEL_TRACES_EXPORTER=otlp``);
``OTEL_SDK_DISABLED=true`` turns it off. The service name comes from
``OTEL_SERVICE_NAME`` when set, otherwise ``tauflow-<service>``. gRPC servers
and clients are instrumented either way, so trace context crosses every call.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace

log = logging.getLogger(__name__)
_configured = False


def _exporter_wanted() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if exporters:
        return "otlp" in exporters.split(",")
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_telemetry(service: str, version: str) -> None:
    """Installs the tracer provider and the gRPC instrumentation, once per process."""
    global _configured
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
    provider = TracerProvider(resource=Resource.create(attrs))
    if _exporter_wanted():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing exported over OTLP")
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()


def shutdown_telemetry() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
