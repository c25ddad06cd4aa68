"""The metrics contract: every service exports ``tauflow_<service>_*`` metrics named by the conventions,
docs/metrics.md lists exactly those, and the dashboards read nothing else."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.observability import (
    DASHBOARDS,
    PROMETHEUS_SERIES,
    QUERY_LABELS,
    ROOT,
    SERVICES,
    TARGET_LABELS,
    all_registered,
    dashboard_queries,
    documented,
    grouping_labels,
    query_names,
    registered,
    series_names,
)

UNITS = ("_seconds", "_bytes", "_bytes_per_second", "_steps", "_ratio", "_nats")


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_exports_metrics_under_its_own_prefix(service: str) -> None:
    metrics = registered(service)
    assert metrics, f"{service} registers no tauflow_{service}_* metric"
    for m in metrics:
        assert m.name.startswith(f"tauflow_{service}_"), m.name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", m.name), m.name
        assert m.help, f"{m.name} has no help text"


def test_metric_names_follow_the_prometheus_conventions() -> None:
    for m in all_registered().values():
        if m.type == "counter":
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), f"{m.name}: only counters end in _total"
        if "duration" in m.name or m.type == "histogram" and "time" in m.help.lower():
            assert m.name.endswith("_seconds"), f"{m.name}: a duration is in seconds"
        if "bytes" in m.name:
            assert m.name.endswith(("_bytes", "_bytes_total", "_bytes_per_second")), m.name
        if m.type == "histogram":
            assert m.name.endswith(UNITS), f"{m.name}: a histogram names its unit"
        assert "le" not in m.labels and "quantile" not in m.labels
        # A label Prometheus also sets on the target would be renamed exported_<label> at scrape time.
        assert not set(m.labels) & TARGET_LABELS, f"{m.name}: label {set(m.labels) & TARGET_LABELS} is a target label"


def test_docs_list_exactly_the_metrics_the_services_register() -> None:
    docs, code = documented(), all_registered()
    missing = sorted(set(code) - set(docs))
    stale = sorted(set(docs) - set(code))
    assert not missing, f"registered but not in docs/metrics.md: {missing}"
    assert not stale, f"in docs/metrics.md but registered by no service: {stale}"
    for name, m in code.items():
        d = docs[name]
        assert d.type == m.type, f"{name}: docs say {d.type}, the service registers a {m.type}"
        assert d.labels == tuple(sorted(m.labels)), f"{name}: docs say labels {d.labels}, code has {m.labels}"
        assert d.help, f"{name}: docs/metrics.md says nothing about what it means"


def test_the_key_series_of_issue_4_exist() -> None:
    code = all_registered()
    for name in (
        "tauflow_rollout_generated_tokens_total",
        "tauflow_rollout_engine_inflight_requests",
        "tauflow_rollout_engine_policy_version",
        "tauflow_queue_depth_groups",
        "tauflow_queue_reserved_groups",
        "tauflow_queue_evicted_total",
        "tauflow_queue_delivered_staleness_steps",
        "tauflow_trainer_step_phase_duration_seconds",
        "tauflow_trainer_loss",
        "tauflow_trainer_reward_mean",
        "tauflow_trainer_kl_behaviour_nats",
        "tauflow_trainer_clipped_tokens_ratio",
        "tauflow_trainer_grad_norm",
        "tauflow_trainer_trained_tokens_total",
        "tauflow_weights_broadcast_bytes_total",
        "tauflow_weights_broadcast_duration_seconds",
        "tauflow_weights_broadcasts_total",
        "tauflow_controller_service_up",
        "tauflow_controller_service_restarts_total",
        "tauflow_controller_service_answering",
        "tauflow_controller_service_unanswered_total",
    ):
        assert name in code, name


def _dashboards() -> list:
    return sorted(DASHBOARDS.glob("*.json"))


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
def test_every_dashboard_query_names_only_exported_metrics(path) -> None:
    series = series_names(all_registered())
    queries = dashboard_queries(path)
    assert queries, f"{path.name} has no query"
    for where, expr in queries:
        names, labels = query_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            assert name in series or name in PROMETHEUS_SERIES, f"{where}: {name} is exported by no service ({expr})"
        for name, matched in labels.items():
            known = set(series[name].labels) if name in series else set()
            assert matched <= known | QUERY_LABELS, f"{where}: {name} has no label {matched - known} ({expr})"
        if any(n in series for n in names):
            allowed = QUERY_LABELS | {lab for n in names if n in series for lab in series[n].labels}
            assert grouping_labels(expr) <= allowed, f"{where}: groups by a label no series has ({expr})"


def test_the_dashboards_cover_every_service_and_the_run_overview() -> None:
    names = {p.stem for p in _dashboards()}
    assert {"overview", *SERVICES} <= names
    used: set[str] = set()
    for path in _dashboards():
        for _, expr in dashboard_queries(path):
            used |= query_names(expr)[0]
    overview = {n for _, e in dashboard_queries(DASHBOARDS / "overview.json") for n in query_names(e)[0]}
    for must in (
        "tauflow_trainer_reward_mean",
        "tauflow_controller_heldout_accuracy_ratio",
        "tauflow_queue_delivered_staleness_steps_sum",
        "tauflow_rollout_generated_tokens_total",
        "tauflow_queue_depth_groups",
        "tauflow_trainer_step_phase_duration_seconds_sum",
        "tauflow_weights_broadcast_duration_seconds_bucket",
    ):
        assert must in overview, f"the run overview does not show {must}"


def test_dashboard_files_are_what_the_builder_writes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy/observability/grafana/build_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
