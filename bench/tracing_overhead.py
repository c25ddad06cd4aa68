#!/usr/bin/env python
"""Step time with tracing on against tracing off, in one invocation: the ratio (target <= 1.03).

Runs short `tauflow run`s of a recipe (default: examples/addition, its prepared warm start), alternating
tracing off and on (off, on, off, on, ... so that drifts in the machine's load hit both alike). Only the
standard OpenTelemetry variables differ between the two:

- off: ``OTEL_SDK_DISABLED=true`` (no tracer provider: no spans at all);
- on: every span sampled (``OTEL_TRACES_SAMPLER=always_on``) and exported over OTLP/gRPC to a receiver
  inside this process (opentelemetry-proto's TraceService, counting what arrives), or with
  ``--exporter file`` to the span file exporter (``OTEL_TRACES_EXPORTER=file``, ``TAUFLOW_TRACES_FILE``).

The step time of a run is the median interval between two committed steps (the trainer's
``committed_s`` in summary.json: everything a step waits for — rollout, reward, queue — included), the
first ``--warmup`` steps left out. The ratio is the median over the "on" runs divided by the median over
the "off" runs; the trainer's own phases (``time/train_s``, ``time/publish_s``) are reported too.

    python bench/tracing_overhead.py                     # 2 rounds of 60 steps
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
from collections import Counter
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTEL_KEYS = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_TRACES_EXPORTER",
             "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "TAUFLOW_TRACES_FILE")


class Receiver:
    """An OTLP/gRPC trace receiver in this process: counts the spans that arrive, per service."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: Counter[str] = Counter()
        lock = threading.Lock()
        spans = self.spans

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                with lock:
                    for rs in request.resource_spans:
                        name = next((a.value.string_value for a in rs.resource.attributes
                                     if a.key == "service.name"), "?")
                        spans[name] += sum(len(ss.spans) for ss in rs.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def take(self) -> dict[str, int]:
        out = dict(self.spans)
        self.spans.clear()
        return out

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


def run_one(recipe: Path, prepared: Path, out: Path, steps: int, env: dict[str, str], extra: list[str]) -> dict:  # type: ignore[type-arg]
    from tauflow.controller.config import RunConfig
    from tauflow.controller.run import Run
    from tauflow.core.config import load_config

    for key in OTEL_KEYS:  # the launcher passes this process's environment to every service
        os.environ.pop(key, None)
    os.environ.update(env)
    overrides = [
        "prepare=[]", f"out_dir={out}", f"model={prepared / 'model'}", f"dataset={prepared / 'train.jsonl'}",
        "eval.dataset=", "target_accuracy=null", f"steps={steps}", *extra,
    ]
    config = load_config(RunConfig, path=recipe, env_prefix="TAUFLOW_RUN_", overrides=overrides)
    summary = asyncio.run(Run(config).execute())
    return summary.to_json()


def step_times(summary: dict, warmup: int) -> dict[str, float]:  # type: ignore[type-arg]
    steps = summary["steps"][warmup:]
    commits = [s["committed_s"] for s in steps]
    intervals = [b - a for a, b in itertools.pairwise(commits)]

    def median(key: str) -> float:
        values = [s["metrics"][key] for s in steps if key in s["metrics"]]
        return statistics.median(values) if values else float("nan")

    return {"step_s": statistics.median(intervals) if intervals else float("nan"), "train_s": median("time/train_s"),
            "publish_s": median("time/publish_s"), "wait_s": median("time/wait_s"), "steps": len(steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "examples/addition/config.yaml")
    p.add_argument("--prepared", type=Path, default=ROOT / "runs/addition/prepared",
                   help="the recipe's prepared model and data (made with examples/addition/prepare.py if missing)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (off, on)")
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
    results: dict[str, list[dict]] = {"off": [], "on": []}  # type: ignore[type-arg]
    try:
        for r in range(args.rounds):
            for mode in ("off", "on"):
                spans_file = out / f"{mode}{r}" / "spans.jsonl"
                spans_file.parent.mkdir(parents=True, exist_ok=True)
                env = tracing_env(mode, args.exporter, receiver, spans_file)
                summary = run_one(args.recipe, args.prepared, out / f"{mode}{r}", args.steps, env, args.set)
                t = step_times(summary, args.warmup)
                if receiver is not None:
                    t["spans"] = receiver.take()
                elif spans_file.exists():
                    t["spans"] = dict(Counter(json.loads(line).get("service", "?")
                                              for line in spans_file.read_text().splitlines() if line.strip()))
                else:
                    t["spans"] = {}
                results[mode].append(t)
                print(f"round {r} tracing {mode:3}: step {t['step_s'] * 1000:7.1f} ms  train "
                      f"{t['train_s'] * 1000:6.1f} ms  publish {t['publish_s'] * 1000:5.1f} ms  "
                      f"spans {sum(t['spans'].values())}", flush=True)
    finally:
        if receiver is not None:
            receiver.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in results[mode])

    report = {
        "exporter": args.exporter, "steps": args.steps, "rounds": args.rounds,
        "step_s": {m: med(m, "step_s") for m in results}, "train_s": {m: med(m, "train_s") for m in results},
        "publish_s": {m: med(m, "publish_s") for m in results},
        "ratio": med("on", "step_s") / med("off", "step_s"),
        "train_ratio": med("on", "train_s") / med("off", "train_s"),
        "spans_on": [x["spans"] for x in results["on"]], "spans_off": [x["spans"] for x in results["off"]],
        "runs": results,
    }
    print(f"\nstep time (median of medians): off {report['step_s']['off'] * 1000:.1f} ms, "
          f"on {report['step_s']['on'] * 1000:.1f} ms, ratio {report['ratio']:.3f} (target <= 1.03); "
          f"trainer's train phase ratio {report['train_ratio']:.3f}")
    if not any(sum(s.values()) for s in report["spans_on"]):
        print("warning: no span arrived with tracing on: the ratio measures nothing", file=sys.stderr)
    print("BENCH_JSON " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
