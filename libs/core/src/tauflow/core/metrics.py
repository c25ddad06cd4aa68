"""The Prometheus ``/metrics`` endpoint every service serves, and the tools its metrics are built with.

- ``start_metrics_server`` serves a registry on a daemon thread (``serve_metrics`` returns a handle that
  can be closed, for processes that serve metrics only for a while, like ``tauflow run``).
- ``ScrapeCollector``: metrics read from a service's own objects when Prometheus scrapes (an engine's
  counters, a launcher's processes), so the code that does the work needs no metric calls.
- ``ServerMetrics``: what the server bootstrap counts in every service (``tauflow_server_*``: handlers that
  raised an unexpected exception).
- ``catalog``: every metric a registry holds, as exposed (name, type, labels, help). docs/metrics.md and
  the dashboards are checked against it (tests/contract/test_metrics_catalog.py).

Conventions (docs/metrics.md): ``tauflow_<service>_<what>_<unit>``; counters end in ``_total``, durations
are ``_seconds``, sizes ``_bytes``, fractions ``_ratio``. The ``_created`` series of counters and
histograms are not exported (they double the series count and no dashboard reads them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

disable_created_metrics()

# Values a ScrapeCollector reader returns: one number, or one number per tuple of label values.
Reading = float | int | Mapping[tuple[str, ...], float | int] | None


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    port: int
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed
REQUEST_TIMEOUT_S = 10.0  # a connection is closed this long after it was accepted, whatever it sends
MAX_CONNECTIONS = 64  # connections served at once; one more takes the place of one still sending its request
EVICT_WAIT_S = 1.0  # how long a newcomer waits for the slot of the connection it closed


class _DeadlineSocket(socket.socket):
    """An accepted connection whose every read and write waits at most ``idle_s`` and ends by ``deadline``
    (time.monotonic) in any case: the idle timeout alone is per read, so a client that sent a byte every few
    seconds kept its connection for ever, and 64 of them held every slot (scrapes refused)."""

    deadline = float("inf")
    idle_s = IDLE_TIMEOUT_S
    requested = False  # its request (line and headers) was read whole

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the connection's time is up")
        self.settimeout(min(self.idle_s, remaining))

    def recv_into(self, *args: Any, **kwargs: Any) -> int:  # (what the handler's rfile reads with)
        self._arm()
        return super().recv_into(*args, **kwargs)

    def sendall(self, *args: Any, **kwargs: Any) -> None:  # (what its wfile writes with)
        self._arm()
        super().sendall(*args, **kwargs)


class _MetricsHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S  # (the socket's: a client that holds a request half-sent gives its thread back)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if isinstance(self.connection, _DeadlineSocket):
            self.connection.requested = True  # (from now on its slot is not given to a newcomer)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # (a scrape every few seconds: no log line each)


class _MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's server (a thread per connection) with its connections bounded: it kept every idle
    connection, a thread and a descriptor each, for ever (1,000 half-sent requests: 1,000 threads)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    idle_timeout_s = IDLE_TIMEOUT_S
    request_timeout_s = REQUEST_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._open: dict[int, _DeadlineSocket] = {}  # the connections served, oldest first
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = self.socket.accept()
        timed = _DeadlineSocket(connection.family, connection.type, connection.proto, fileno=connection.detach())
        timed.idle_s = self.idle_timeout_s
        timed.deadline = time.monotonic() + self.request_timeout_s  # (a request and its answer: one scrape)
        return timed, address

    def process_request(self, request: Any, client_address: Any) -> None:
        # Full: the oldest connection still sending its request makes room (a client that reopened every
        # connection closed kept all 64 slots taken and 10 of 12 scrapes were refused); else the newcomer is
        # closed at once, and the scraper retries at its next interval.
        if not self._slots.acquire(blocking=False) and not (
            self._close_oldest_unrequested() and self._slots.acquire(timeout=EVICT_WAIT_S)
        ):
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open[id(request)] = request
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            self._slots.release()
            raise

    def _close_oldest_unrequested(self) -> bool:
        with self._open_lock:
            oldest = next((c for c in self._open.values() if not c.requested), None)
            if oldest is None:
                return False
            del self._open[id(oldest)]
        with contextlib.suppress(OSError):  # (its thread reads the end of the stream and gives its slot back)
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            if self._open.get(id(request)) is request:
                del self._open[id(request)]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went quiet (the idle timeout) or away is no error: socketserver printed a traceback for
        # each, a log flood of its own. Anything else is reported as before.
        if not isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)
            self._slots.release()


def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry = REGISTRY,
    *,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> MetricsServer:
    """Serves ``/metrics`` on a daemon thread; ``port`` 0 picks a free port (read it from the handle).
    A port that cannot be bound raises OSError naming the address (and no traceback is needed to see why).
    At most ``max_connections`` at once, each closed after ``idle_timeout_s`` without a byte, and
    ``request_timeout_s`` after it was accepted in any case (a slowly dripping client holds a slot no longer)."""
    handler = type("MetricsHandler", (_MetricsHandler,), {"timeout": idle_timeout_s})
    server_class = type(
        "MetricsHTTPServer",
        (_MetricsHTTPServer,),
        {
            "max_connections": max_connections,
            "address_family": _family(host),
            "idle_timeout_s": idle_timeout_s,
            "request_timeout_s": request_timeout_s,
        },
    )
    try:
        server = server_class((host, port), handler)
    except OSError as e:
        raise OSError(f"cannot serve /metrics on {host}:{port}: {e.strerror or e}") from e
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(int(server.server_address[1]), server, thread)


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return socket.AF_INET


def start_metrics_server(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serves ``/metrics`` on a daemon thread for the life of the process; returns the bound port."""
    return serve_metrics(host, port, registry).port


class ServerMetrics:
    """Counted by the server bootstrap (``tauflow.core.server``) for every service and every server of it."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.unexpected_errors = Counter(
            "tauflow_server_unexpected_errors",
            "calls whose handler raised an unexpected exception (a bug), answered INTERNAL, by method",
            ["method"],
            registry=registry,
        )
        self.stopped_by_itself = Counter(
            "tauflow_server_stopped_by_itself",
            "gRPC servers of this process that stopped by themselves (the process then exits to be restarted), "
            "by config key (server, external...)",
            ["key"],
            registry=registry,
        )
        # Which process of its role this is (rollout replica 2, trainer rank 1): Prometheus's file_sd labels
        # say it too, but a scrape made some other way (a pod's annotations, a test) still reads it here.
        self.process = Info(
            "tauflow_server_process",
            "which process of its role this server is: instance_name (e.g. rollout-2), replica (index or rank)",
            registry=registry,
        )
        self.process.info(process_identity())
        self.cuda_memory_peak = Gauge(
            "tauflow_process_cuda_memory_peak_bytes",
            "GPU memory this process's PyTorch caching allocator has reserved at most, over its devices (0: no CUDA)",
            registry=registry,
        )
        self.cuda_memory_peak.set_function(cuda_memory_peak_bytes)


def cuda_memory_peak_bytes() -> float:
    """The high-water mark of GPU memory PyTorch reserved in this process, over every device; 0 where torch
    was never imported or never touched CUDA (this module imports no torch: queue and reward have none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    return float(sum(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())))


def process_identity() -> dict[str, str]:
    """``instance_name`` and ``replica`` of this process, from the resource attributes its launcher set
    (``OTEL_RESOURCE_ATTRIBUTES``: service.instance.id, tauflow.replica); empty strings where it was started
    without them. (Its role is the scrape target's ``role`` label.)"""
    attributes = dict(
        part.split("=", 1) for part in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",") if "=" in part
    )
    return {
        "instance_name": attributes.get("service.instance.id", "").strip(),
        "replica": attributes.get("tauflow.replica", "").strip(),
    }


@dataclass(frozen=True)
class MetricInfo:
    """One metric as Prometheus sees it: ``name`` as exposed (counters with ``_total``)."""

    name: str
    type: str  # counter, gauge, histogram, summary, info, stateset, enum
    labels: tuple[str, ...]
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        """The series names a query may use."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.type == "summary":
            return (self.name, f"{self.name}_sum", f"{self.name}_count")
        if self.type == "info":
            return (f"{self.name}_info",)
        return (self.name,)


@dataclass(frozen=True)
class _Scraped:
    info: MetricInfo
    read: Callable[[], Reading]


class ScrapeCollector(Collector):
    """Counters and gauges whose values are read when Prometheus scrapes.

    ``counter(name, help, read)`` / ``gauge(...)`` declare a metric; ``read()`` returns a number, a mapping
    from label values to numbers, or None (nothing to report yet). A reader that raises is logged once and
    skipped: a scrape never fails because of one metric. Register the collector after declaring its metrics
    (``registry.register(collector)``) so that the registry knows its names.
    """

    def __init__(self) -> None:
        self._metrics: list[_Scraped] = []
        self._failed: set[str] = set()

    def counter(self, name: str, help: str, read: Callable[[], Reading], labels: Iterable[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        self._metrics.append(_Scraped(MetricInfo(name, "counter", tuple(labels), help), read))

    def gauge(self, name: str, help: str, read: Callable[[], Reading], labels: Iterable[str] = ()) -> None:
        self._metrics.append(_Scraped(MetricInfo(name, "gauge", tuple(labels), help), read))

    def infos(self) -> list[MetricInfo]:
        return [m.info for m in self._metrics]

    def _family(self, info: MetricInfo) -> CounterMetricFamily | GaugeMetricFamily:
        cls = CounterMetricFamily if info.type == "counter" else GaugeMetricFamily
        return cls(info.name, info.help, labels=list(info.labels))

    def describe(self) -> Iterable[Any]:
        return [self._family(m.info) for m in self._metrics]

    def collect(self) -> Iterable[Any]:
        for m in self._metrics:
            try:
                value = m.read()
            except Exception:  # one broken reader must not fail the scrape
                if m.info.name not in self._failed:
                    self._failed.add(m.info.name)
                    log.exception("metric reader failed", extra={"metric": m.info.name})
                continue
            family = self._family(m.info)
            if value is None:
                continue
            if isinstance(value, Mapping):
                for label_values, v in value.items():
                    family.add_metric(list(label_values), float(v))
            else:
                family.add_metric([], float(value))
            yield family


def _info_of(collector: object) -> list[MetricInfo]:
    if isinstance(collector, ScrapeCollector):
        return collector.infos()
    if isinstance(collector, MetricWrapperBase):
        kind = collector._type or ""  # private in prometheus_client, and stable (set by every subclass)
        name = collector._name
        if kind == "counter":
            name += "_total"
        return [MetricInfo(name, kind, tuple(collector._labelnames), collector._documentation or "")]
    describe = getattr(collector, "describe", None)
    families = describe() if describe else []
    return [
        MetricInfo(f.name + ("_total" if f.type == "counter" else ""), f.type, (), f.documentation) for f in families
    ]


def catalog(registry: CollectorRegistry = REGISTRY, prefix: str = "tauflow_") -> list[MetricInfo]:
    """Every metric registered in ``registry`` whose name starts with ``prefix``, sorted by name."""
    with registry._lock:
        collectors = list(registry._collector_to_names)
    infos = [i for c in collectors for i in _info_of(c) if i.name.startswith(prefix)]
    return sorted(infos, key=lambda i: i.name)
