"""The Prometheus ``/metrics`` endpoint every service serves."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server


def start_metrics_server(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serves ``/metrics`` on a daemon thread; returns the bound port (useful with port 0)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])
