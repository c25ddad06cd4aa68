"""The metrics kit: scrape-time collectors, the catalog the docs are checked against, a closable endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tauflow.core.metrics import MetricInfo, ScrapeCollector, catalog, serve_metrics


def test_scrape_collector_reads_values_when_scraped_and_skips_a_broken_reader() -> None:
    registry = CollectorRegistry()
    state = {"tokens": 3}
    c = ScrapeCollector()
    c.counter("tauflow_x_tokens_total", "tokens", lambda: state["tokens"])
    c.gauge("tauflow_x_version", "by engine", lambda: {("e0",): 4, ("e1",): 5}, labels=["engine"])
    c.gauge("tauflow_x_broken", "raises", lambda: 1 / 0)
    c.gauge("tauflow_x_absent", "nothing yet", lambda: None)
    registry.register(c)
    state["tokens"] = 7
    text = generate_latest(registry).decode()
    assert "tauflow_x_tokens_total 7.0" in text
    assert 'tauflow_x_version{engine="e1"} 5.0' in text
    assert "tauflow_x_broken" not in text and "tauflow_x_absent " not in text
    assert "_created" not in text


def test_catalog_lists_names_as_exposed_with_types_and_labels() -> None:
    registry = CollectorRegistry()
    Counter("tauflow_x_events", "events", ["reason"], registry=registry)
    Gauge("tauflow_x_depth_groups", "depth", registry=registry)
    Histogram("tauflow_x_step_seconds", "step", ["phase"], registry=registry)
    Gauge("other_metric", "not ours", registry=registry)
    c = ScrapeCollector()
    c.counter("tauflow_x_tokens_total", "tokens", lambda: 1)
    registry.register(c)
    assert catalog(registry) == [
        MetricInfo("tauflow_x_depth_groups", "gauge", (), "depth"),
        MetricInfo("tauflow_x_events_total", "counter", ("reason",), "events"),
        MetricInfo("tauflow_x_step_seconds", "histogram", ("phase",), "step"),
        MetricInfo("tauflow_x_tokens_total", "counter", (), "tokens"),
    ]
    assert catalog(registry)[2].series == (
        "tauflow_x_step_seconds_bucket",
        "tauflow_x_step_seconds_sum",
        "tauflow_x_step_seconds_count",
    )


def test_a_metrics_server_serves_then_closes() -> None:
    registry = CollectorRegistry()
    Gauge("tauflow_x_up", "up", registry=registry).set(1)
    server = serve_metrics("127.0.0.1", 0, registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert "tauflow_x_up 1.0" in body
    finally:
        server.close()


def test_idle_connections_are_bounded_and_closed_so_that_scrapes_go_on() -> None:
    """Every half-sent request held a thread and a descriptor for ever: 1,000 idle connections, 1,000 threads
    (and, near the descriptor limit, a queue whose gRPC port stopped accepting)."""
    import socket
    import threading
    import time

    registry = CollectorRegistry()
    Gauge("tauflow_x_up", "up", registry=registry).set(1)
    server = serve_metrics("127.0.0.1", 0, registry, idle_timeout_s=0.5, max_connections=4)
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
    try:
        for s in idle:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request, then nothing
        # the 5th and later took the place of the oldest held ones (each evicted as the next came): at most 4
        # held once that settles, well before the idle timeout (a single look raced the eviction under load)
        deadline = time.monotonic() + 0.4
        while threading.active_count() > threads_before + 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() <= threads_before + 4
        deadline = time.monotonic() + 10  # past the idle timeout: the held ones are closed too
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads_before
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert "tauflow_x_up 1.0" in body
    finally:
        for s in idle:
            s.close()
        server.close()


def test_the_cuda_memory_peak_sums_the_allocators_high_water_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from types import SimpleNamespace

    from tauflow.core.metrics import cuda_memory_peak_bytes

    peaks = {0: 3 << 30, 1: 1 << 20}
    cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2, max_memory_reserved=peaks.__getitem__)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    assert cuda_memory_peak_bytes() == (3 << 30) + (1 << 20)
    cuda.is_initialized = lambda: False  # torch imported, CUDA never touched
    assert cuda_memory_peak_bytes() == 0.0
    monkeypatch.delitem(sys.modules, "torch")
    assert cuda_memory_peak_bytes() == 0.0


def test_a_client_that_reopens_every_connection_does_not_keep_scrapes_out() -> None:
    """Each half-sent request closed at its timeout was reopened at once: 64 slots stayed taken and 10 of 12
    scrapes were refused. A newcomer now takes the place of the oldest connection still sending its request."""
    import socket
    import threading

    registry = CollectorRegistry()
    Gauge("tauflow_x_up", "up", registry=registry).set(1)
    server = serve_metrics("127.0.0.1", 0, registry, idle_timeout_s=30.0, request_timeout_s=30.0, max_connections=4)
    stop = threading.Event()
    held: list[socket.socket] = []

    def hog() -> None:  # keeps 4 half-sent requests open, reopening each one closed
        while not stop.is_set():
            for s in list(held):
                try:
                    if s.recv(1, socket.MSG_DONTWAIT) == b"":
                        held.remove(s)
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    held.remove(s)
            while len(held) < 4 and not stop.is_set():
                try:
                    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                    held.append(s)
                    s.sendall(b"GET /metrics HTTP/1.1\r\n")
                except OSError:
                    pass  # (closed before its first line: it is reopened)
            stop.wait(0.01)

    attacker = threading.Thread(target=hog, daemon=True)
    attacker.start()
    try:
        stop.wait(0.3)
        for _ in range(5):
            body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
            assert "tauflow_x_up 1.0" in body
    finally:
        stop.set()
        attacker.join(5)
        for s in held:
            s.close()
        server.close()
