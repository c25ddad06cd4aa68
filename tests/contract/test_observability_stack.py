"""deploy/observability and deploy/k8s/observability, checked offline: Prometheus configs (promtool), the
kustomize render (kubectl kustomize + kubernetes-validate), the compose file, Grafana provisioning and the
Collector pipeline."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
from pathlib import Path

import pytest
import yaml

from tests.deploy import render, validate
from tests.observability import ROOT, SERVICES

OBS = ROOT / "deploy" / "observability"
K8S = ROOT / "deploy" / "k8s" / "observability"
PROMETHEUS_CONFIGS = [OBS / "prometheus" / "prometheus.yml", OBS / "prometheus" / "prometheus-k8s.yml"]


@pytest.mark.parametrize("path", PROMETHEUS_CONFIGS, ids=lambda p: p.name)
def test_prometheus_config_passes_promtool(path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    done = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", PROMETHEUS_CONFIGS, ids=lambda p: p.name)
def test_prometheus_has_a_scrape_job_per_role(path: Path) -> None:
    jobs = {j["job_name"] for j in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert {f"tauflow-{role}" for role in SERVICES} <= jobs


def test_kustomize_renders_resources_that_kubernetes_validate_accepts() -> None:
    docs = render(K8S)
    validate(docs)
    kinds = {
        (d["kind"], d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "ConfigMap" else d["metadata"]["name"])
        for d in docs
    }
    for name in ("otel-collector", "jaeger", "prometheus", "grafana"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds, name
    for role in SERVICES:
        assert ("Service", f"tauflow-{role}-metrics") in kinds, role
    assert all(d["metadata"].get("namespace") == "tauflow" for d in docs if d["kind"] != "Namespace")


def test_kustomize_mounts_the_same_configuration_as_compose() -> None:
    docs = render(K8S)
    maps = {d["metadata"]["name"].rsplit("-", 1)[0]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    assert maps["prometheus-config"]["prometheus.yml"] == (OBS / "prometheus" / "prometheus-k8s.yml").read_text()
    assert maps["otel-collector-config"]["config.yaml"] == (OBS / "otel-collector.yaml").read_text()
    dashboards = {p.name: p.read_text() for p in (OBS / "grafana" / "dashboards").glob("*.json")}
    assert maps["grafana-dashboards"] == dashboards
    # Every ConfigMap a Deployment mounts is one the render defines (names with their hash suffix).
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for d in docs:
        if d["kind"] == "Deployment":
            for v in d["spec"]["template"]["spec"].get("volumes", []):
                if "configMap" in v:
                    assert v["configMap"]["name"] in names, v
    # The per-role metrics Services select the labels the roles' pods will carry (issue #5); the sidecar's
    # in deploy/k8s selects the trainer's rank-0 pod, which holds it (tests/contract/test_deploy.py).
    for d in docs:
        if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics"):
            role = d["metadata"]["name"][len("tauflow-") : -len("-metrics")]
            assert d["spec"]["clusterIP"] == "None"
            expected = {"app.kubernetes.io/part-of": "tauflow", "app.kubernetes.io/component": role}
            if role == "weights-sidecar":
                expected = {**expected, "app.kubernetes.io/component": "trainer", "tauflow.dev/trainer-rank": "leader"}
            assert d["spec"]["selector"] == expected


def test_compose_file_mounts_files_that_exist_and_publishes_the_entry_points() -> None:
    compose = yaml.safe_load((OBS / "compose.yaml").read_text())
    services = compose["services"]
    assert {"otel-collector", "jaeger", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert svc.get("image"), name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (OBS / source).exists(), f"{name} mounts {source}, which does not exist"
    published = {p.split(":")[0] for s in services.values() for p in s.get("ports", [])}
    assert {"4317", "9090", "3000", "16686"} <= published


def test_grafana_provisioning_names_the_data_sources_the_dashboards_use() -> None:
    sources = yaml.safe_load((OBS / "grafana/provisioning/datasources/datasources.yaml").read_text())["datasources"]
    uids = {s["uid"]: s["type"] for s in sources}
    assert uids.get("prometheus") == "prometheus" and uids.get("jaeger") == "jaeger"
    provider = yaml.safe_load((OBS / "grafana/provisioning/dashboards/dashboards.yaml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/tauflow"
    for path in (OBS / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        assert board["uid"].startswith("tauflow-")
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] in uids, (path.name, panel["title"])


def test_collector_receives_otlp_grpc_and_exports_traces_to_jaeger() -> None:
    config = yaml.safe_load((OBS / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    pipeline = config["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for name in pipeline[kind]:
            assert name in config[kind], f"{kind} {name} is used by the pipeline but not defined"
    exporter = config["exporters"][pipeline["exporters"][0]]
    assert exporter["endpoint"] == "jaeger:4317"


def test_every_dashboard_query_parses_in_prometheus(tmp_path: Path) -> None:
    """Prometheus itself parses every dashboard expression (Grafana's variables replaced by durations)."""
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus server is not installed (Debian: apt-get install prometheus)")
    from tests.observability import DASHBOARDS, Prometheus, dashboard_queries

    prometheus = Prometheus(tmp_path, tmp_path / "no-targets.json")
    try:
        for path in sorted(DASHBOARDS.glob("*.json")):
            for where, expr in dashboard_queries(path):
                expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
                try:
                    prometheus.api("query", query=expr)
                except urllib.error.HTTPError as e:
                    pytest.fail(f"{where}: Prometheus cannot parse {expr!r}: {e.read().decode()[:300]}")
    finally:
        prometheus.stop()
