#!/usr/bin/env python
"""Step time with tracing on against tracing off, in one invocation: the ratio (target <= 1.03).

Runs short `tauflow run`s of a recipe (default: examples/addition, its prepared warm start), alternating
tracing off and on in rounds ordered off-on, on-off, off-on, ... so that drifts in the machine's speed
hit both alike. Only the
standard OpenTelemetry variables differ between the two:

- off: ``OTEL_SDK_DISABLED=true`` (no tracer provider: no spans at all);
- on: every span sampled (``OTEL_TRACES_SAMPLER=always_on``) and exported over OTLP/gRPC to a receiver
  inside this process (opentelemetry-proto's TraceService, counting what arrives), or with
  ``--exporter file`` to the span file exporter (``OTEL_TRACES_EXPORTER=file``, ``TAUFLOW_TRACES_FILE``).

The step time of a run is the median interval between two committed steps (the trainer's
``committed_s`` in summary.json: everything a step waits for — rollout, reward, queue — included), the
first ``--warmup`` steps left out. The ratio is the median over the rounds of each round's "on" step time
over its "off" one (paired, so that the machine's drift over the invocation cancels); the ratio of the
medians and the trainer's own phases (``time/train_s``, ``time/publish_s``) are reported too.

    python bench/tracing_overhead.py                     # 4 rounds of 60 steps
    python bench/tracing_overhead.py --rounds 3 --steps 100 --exporter file

Prints a table and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTEL_KEYS = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_TRACES_EXPORTER",
             "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "TAUFLOW_TRACES_FILE")


class Receiver:
    """An OTLP/gRPC trace receiver in this process. It keeps the requests as bytes and counts the spans per
    service only when asked (``take``, between runs): a collector runs on other cores, so the benchmark
    does not charge the run with decoding what it exported."""

    def __init__(self) -> None:
        import grpc

        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        lock, requests = self.lock, self.requests

        def export(request: bytes, context: grpc.ServicerContext) -> bytes:
            with lock:
                requests.append(request)
            return b""  # an empty ExportTraceServiceResponse

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(export)},  # no (de)serializers: raw bytes
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """The spans received since the last call: (count per service, count per span name)."""
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        with self.lock:
            requests = list(self.requests)
            self.requests.clear()
        services: Counter[str] = Counter()
        names: Counter[str] = Counter()
        for raw in requests:
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "?")
                for ss in rs.scope_spans:
                    services[service] += len(ss.spans)
                    names.update(f"{service} {span.name}" for span in ss.spans)
        return dict(services), dict(names)

    def stop(self) -> None:
        self.server.stop(grace=1)


def tracing_env(mode: str, exporter: str, receiver: Receiver | None, spans_file: Path) -> dict[str, str]:
    if mode == "off":
        return {"OTEL_SDK_DISABLED": "true"}
    env = {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_SAMPLER": "always_on"}
    if exporter == "otlp":
        assert receiver is not None
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_TRACES_EXPORTER": "otlp"}
    else:
        env |= {"OTEL_TRACES_EXPORTER": "file", "TAUFLOW_TRACES_FILE": str(spans_file)}
    return env


class ServiceCpu:
    """Samples the CPU time (user + system) of the run's service processes (their pids from the ready
    files) every ``period_s``: ``at(t)`` is their total at wall time ``t``. CPU time is far steadier than
    step time on a shared machine, and on 2 busy cores every CPU second spent on spans is taken from a step."""

    def __init__(self, run_dir: Path, period_s: float = 0.25) -> None:
        self.run_dir = run_dir
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.time(), role -> CPU seconds)
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.25):
            for ready in self.run_dir.glob("*.ready.json"):
                try:
                    pid = json.loads(ready.read_text())["pid"]
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, ValueError, KeyError):
                    continue  # not written yet, or the process is gone: keep its last value
                self._last[ready.name.split(".")[0]] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            self.samples.append((time.time(), dict(self._last)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> dict[str, float]:
        """Each role's CPU seconds at the last sample taken at or before ``t``."""
        before = [cpu for ts, cpu in self.samples if ts <= t]
        return before[-1] if before else {}


def run_one(recipe: Path, prepared: Path, out: Path, steps: int, env: dict[str, str], extra: list[str],
            warmup: int) -> dict:
    """One run; its summary, with ``cpu_per_step_s``: the services' CPU seconds per step after ``warmup``."""
    from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
    from tauflow.controller.config import RunConfig
    from tauflow.core.config import load_config

    for key in OTEL_KEYS:  # the launcher passes this process's environment to every service
        os.environ.pop(key, None)
    os.environ.update(env)
    overrides = [
        "prepare=[]", f"out_dir={out}", f"model={prepared / 'model'}", f"dataset={prepared / 'train.jsonl'}",
        "eval.dataset=", "target_accuracy=null", f"steps={steps}", *extra,
    ]
    config = load_config(RunConfig, path=recipe, env_prefix="TAUFLOW_RUN_", overrides=overrides)
    run = build_run(config)
    cpu = ServiceCpu(out)
    try:
        summary = asyncio.run(run.execute()).to_json()
    finally:
        cpu.stop()
    commits = [run._wall0 + s["committed_s"] for s in summary["steps"][warmup:]]
    first, last = cpu.at(commits[0]), cpu.at(commits[-1])
    n = max(1, len(commits) - 1)
    summary["cpu_per_step_by_role_s"] = {role: (last[role] - first.get(role, 0.0)) / n for role in sorted(last)}
    summary["cpu_per_step_s"] = sum(summary["cpu_per_step_by_role_s"].values()) if len(commits) > 1 else float("nan")
    return summary


def step_times(summary: dict, warmup: int) -> dict[str, float]:
    steps = summary["steps"][warmup:]
    commits = [s["committed_s"] for s in steps]
    intervals = [b - a for a, b in itertools.pairwise(commits)]

    def median(key: str) -> float:
        values = [s["metrics"][key] for s in steps if key in s["metrics"]]
        return statistics.median(values) if values else float("nan")

    return {"step_s": statistics.median(intervals) if intervals else float("nan"), "train_s": median("time/train_s"),
            "publish_s": median("time/publish_s"), "wait_s": median("time/wait_s"), "steps": len(steps),
            "cpu_per_step_s": summary.get("cpu_per_step_s", float("nan")),
            "cpu_per_step_by_role_s": summary.get("cpu_per_step_by_role_s", {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "examples/addition/config.yaml")
    p.add_argument("--prepared", type=Path, default=ROOT / "runs/addition/prepared",
                   help="the recipe's prepared model and data (made with examples/addition/prepare.py if missing)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--rounds", type=int, default=4, help="pairs of runs (off, on)")
    p.add_argument("--exporter", choices=("otlp", "file"), default="otlp")
    p.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra run config override")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    if not (args.prepared / "model").exists():
        subprocess.run([sys.executable, str(ROOT / "examples/addition/prepare.py"), "--out", str(args.prepared)],
                       check=True)
    receiver = Receiver() if args.exporter == "otlp" else None
    out = args.out or Path(tempfile.mkdtemp(prefix="tauflow-bench-tracing-"))
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # ABBA: a steady drift hits both alike
                spans_file = out / f"{mode}{r}" / "spans.jsonl"
                spans_file.parent.mkdir(parents=True, exist_ok=True)
                env = tracing_env(mode, args.exporter, receiver, spans_file)
                summary = run_one(args.recipe, args.prepared, out / f"{mode}{r}", args.steps, env, args.set,
                                  args.warmup)
                t = step_times(summary, args.warmup)
                if receiver is not None:
                    t["spans"], t["span_names"] = receiver.take()
                else:
                    lines = spans_file.read_text().splitlines() if spans_file.exists() else []
                    records = [json.loads(line) for line in lines if line.strip()]
                    t["spans"] = dict(Counter(r.get("service", "?") for r in records))
                    t["span_names"] = dict(Counter(f"{r.get('service', '?')} {r['name']}" for r in records))
                results[mode].append(t)
                print(f"round {r} tracing {mode:3}: step {t['step_s'] * 1000:7.1f} ms  train "
                      f"{t['train_s'] * 1000:6.1f} ms  publish {t['publish_s'] * 1000:5.1f} ms  "
                      f"services' CPU {t['cpu_per_step_s'] * 1000:6.1f} ms/step  spans {sum(t['spans'].values())}",
                      flush=True)
    finally:
        if receiver is not None:
            receiver.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in results[mode])

    report = {
        "exporter": args.exporter, "steps": args.steps, "rounds": args.rounds,
        "step_s": {m: med(m, "step_s") for m in results}, "train_s": {m: med(m, "train_s") for m in results},
        "publish_s": {m: med(m, "publish_s") for m in results},
        # Each round's "on" run over the "off" run just before it, so that a drift of the machine's speed
        # over the invocation (10-15 % here between runs of one setting) cancels; the median of those.
        "paired_ratios": [on["step_s"] / off["step_s"] for off, on in zip(results["off"], results["on"], strict=True)],
        "ratio_of_medians": med("on", "step_s") / med("off", "step_s"),
        "cpu_per_step_s": {m: med(m, "cpu_per_step_s") for m in results},
        "cpu_paired_ratios": [on["cpu_per_step_s"] / off["cpu_per_step_s"]
                              for off, on in zip(results["off"], results["on"], strict=True)],
        "train_ratio": med("on", "train_s") / med("off", "train_s"),
        "spans_on": [x["spans"] for x in results["on"]], "spans_off": [x["spans"] for x in results["off"]],
        "runs": results,
    }
    report["ratio"] = statistics.median(report["paired_ratios"])
    report["cpu_ratio"] = statistics.median(report["cpu_paired_ratios"])
    print(f"\nstep time on/off per round: {' '.join(f'{r:.3f}' for r in report['paired_ratios'])}; "
          f"median {report['ratio']:.3f} (target <= 1.03)")
    print(f"services' CPU per step on/off per round: {' '.join(f'{r:.3f}' for r in report['cpu_paired_ratios'])}; "
          f"median {report['cpu_ratio']:.3f} (off {report['cpu_per_step_s']['off'] * 1000:.1f} ms, "
          f"on {report['cpu_per_step_s']['on'] * 1000:.1f} ms per step)")
    for mode in ("off", "on"):
        roles = sorted({r for x in results[mode] for r in x["cpu_per_step_by_role_s"]})
        print(f"services' CPU per step, tracing {mode} (median over rounds): " + ", ".join(
            f"{r} {statistics.median(x['cpu_per_step_by_role_s'].get(r, 0.0) for x in results[mode]) * 1000:.1f} ms"
            for r in roles))
    print(f"median of medians: off {report['step_s']['off'] * 1000:.1f} ms, on {report['step_s']['on'] * 1000:.1f} ms, "
          f"ratio {report['ratio_of_medians']:.3f}; trainer's train phase ratio {report['train_ratio']:.3f}")
    last = results["on"][-1]
    per_step = max(1, args.steps)
    print("spans per step (last 'on' run): " + ", ".join(
        f"{name} {n / per_step:.1f}" for name, n in sorted(last["span_names"].items(), key=lambda kv: -kv[1])[:12]))
    if not any(sum(s.values()) for s in report["spans_on"]):
        print("warning: no span arrived with tracing on: the ratio measures nothing", file=sys.stderr)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"BENCH_JSON in {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
