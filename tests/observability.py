"""What the observability checks share: the metrics every service registers, docs/metrics.md's tables, and
the PromQL of the dashboards and of Prometheus' rules."""

from __future__ import annotations

import importlib
import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry

from tauflow.core.metrics import MetricInfo, catalog

ROOT = Path(__file__).resolve().parents[1]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "pyproject.toml").exists())
DASHBOARDS = ROOT / "deploy" / "observability" / "grafana" / "dashboards"
# Each service's metrics: (module, class) built on a registry of their own.
METRICS_CLASSES = {
    "controller": ("tauflow.controller.metrics", "ControllerMetrics"),
    "queue": ("tauflow.queue.metrics", "QueueMetrics"),
    "reward": ("tauflow.reward.metrics", "RewardMetrics"),
    "rollout": ("tauflow.rollout.metrics", "RolloutMetrics"),
    "trainer": ("tauflow.trainer.metrics", "TrainerMetrics"),
    "weights": ("tauflow.weights.metrics", "WeightsMetrics"),
    "server": ("tauflow.core.metrics", "ServerMetrics"),  # every service's server bootstrap (tauflow-core)
}
# Series a query may name besides the services' own: Prometheus' per-target ones.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Labels every tauflow series carries once scraped (target labels of deploy/observability/prometheus.yml).
TARGET_LABELS = {"job", "instance", "role", "run", "namespace", "pod"}
QUERY_LABELS = TARGET_LABELS | {"le", "quantile"}  # labels a query may use on any series


def registered(service: str) -> list[MetricInfo]:
    module, cls = METRICS_CLASSES[service]
    registry = CollectorRegistry()
    getattr(importlib.import_module(module), cls)(registry)
    return catalog(registry)


def all_registered() -> dict[str, MetricInfo]:
    return {m.name: m for service in (*SERVICES, "server") for m in registered(service)}


def series_names(metrics: dict[str, MetricInfo]) -> dict[str, MetricInfo]:
    """Every series name a query may use (``_bucket``, ``_sum``... of histograms) -> its metric."""
    return {s: m for m in metrics.values() for s in m.series}


_ROW = re.compile(r"^\|\s*`(tauflow_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|\s*([^|]*)\|\s*(.*)\|\s*$")


def documented(path: Path = ROOT / "docs" / "metrics.md") -> dict[str, MetricInfo]:
    """The metric tables of docs/metrics.md: ``| `name` | type | labels | meaning |`` rows."""
    out: dict[str, MetricInfo] = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, kind, labels, meaning = m.groups()
        label_tuple = tuple(sorted(x.strip() for x in labels.split(",") if x.strip() not in ("", "-")))
        if name in out:
            raise AssertionError(f"docs/metrics.md lists {name} twice")
        out[name] = MetricInfo(name, kind, label_tuple, meaning.strip())
    return out


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(where, expr) of every query of a Grafana dashboard JSON: panels (rows' nested panels included)
    and templating variables."""
    board = json.loads(path.read_text())
    found: list[tuple[str, str]] = []

    def panels(items: list[dict]) -> None:
        for p in items:
            for t in p.get("targets", []):
                if t.get("expr"):
                    found.append((f"{path.name}: {p.get('title', '?')}", t["expr"]))
            panels(p.get("panels", []))

    panels(board.get("panels", []))
    for var in board.get("templating", {}).get("list", []):
        q = var.get("query")
        expr = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and expr:
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr.strip())
            found.append((f"{path.name}: variable {var.get('name')}", inner.group(1) if inner else expr))
    return found


# PromQL words that are not metric names.
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "histogram_quantile",
    "clamp_min",
    "clamp_max",
    "clamp",
    "abs",
    "ceil",
    "floor",
    "round",
    "sqrt",
    "exp",
    "ln",
    "log2",
    "log10",
    "time",
    "timestamp",
    "vector",
    "scalar",
    "label_replace",
    "label_join",
    "absent",
    "absent_over_time",
    "changes",
    "resets",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "sum_over_time",
    "count_over_time",
    "last_over_time",
    "quantile_over_time",
    "sort",
    "sort_desc",
    "inf",
    "nan",
    "le",
}


def query_names(expr: str) -> tuple[set[str], dict[str, set[str]]]:
    """The metric names an expression reads and, per name, the labels its selector matches on (a rough
    PromQL reader: strings, durations, grouping clauses and label matchers are removed first)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\$\{?\w+\}?", "x", expr)  # Grafana variables ($__rate_interval, ${role})
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    labels: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        labels.setdefault(name, set()).update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        token = m.group(0)
        if token.lower() in _KEYWORDS or bare[m.end() :].lstrip().startswith("("):
            continue  # a keyword or a function call
        names.add(token)
    names |= {n for n in labels if n.lower() not in _KEYWORDS}
    return names, labels


def grouping_labels(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    out: set[str] = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        out |= {x.strip() for x in clause.split(",") if x.strip()}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, workdir: Path, targets: Path) -> None:
        self.port = _free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
                    "scrape_configs": [
                        {
                            "job_name": "tauflow-run",
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                        }
                    ],
                }
            )
        )
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "prometheus not ready after 60s"
                time.sleep(0.2)

    def api(self, path: str, **params: object) -> object:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def series(self, expr: str, start: float, end: float) -> dict[str, list[float]]:
        """Every sample of ``expr`` per series (keyed by its labels), one per second."""
        data = self.api("query_range", query=expr, start=start, end=end, step=1)
        return {json.dumps(r["metric"], sort_keys=True): [float(v) for _, v in r["values"]] for r in data["result"]}

    def one(self, expr: str, start: float, end: float) -> list[float]:
        found = self.series(expr, start, end)
        assert len(found) == 1, f"{expr}: {len(found)} series ({list(found)})"
        return next(iter(found.values()))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
