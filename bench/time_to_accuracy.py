#!/usr/bin/env python
"""Wall-clock to reach held-out accuracy targets with tau = 0, 1 and 2, in one run, and the ratios.

Each tau is a full `tauflow run` of a recipe (default: examples/addition): every service its own
process, one thread each, the same prepared model, seed and hyperparameters; only `max_staleness`
differs. Time is counted from each run's first committed step (service start-up excluded, it is the
same for every tau) to the first evaluation at or above each target. Runs stop at the highest target
(`stop_at_target`) or at `--steps`.

Also reported per tau, from the trainer's own step timings (medians): the time a step waits for data,
trains, and blocks on the hand-off of its weights to the sidecar (`time/publish_s`), and that
blocking time as a share of the step.

    python bench/time_to_accuracy.py                       # tau 0, 1, 2 to 60 % and 80 %
    python bench/time_to_accuracy.py --taus 0,1 --targets 0.5 --steps 400

Prints a table and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
from tauflow.controller.config import RunConfig
from tauflow.core.config import load_config


def run_one(recipe: Path, tau: int, out: Path, steps: int, target: float, extra: list[str]) -> dict:
    overrides = [
        f"max_staleness={tau}",
        f"out_dir={out}",
        f"steps={steps}",
        f"target_accuracy={target}",
        "stop_at_target=true",
        *extra,
    ]
    config = load_config(RunConfig, path=recipe, env_prefix="TAUFLOW_RUN_", overrides=overrides)
    summary = asyncio.run(build_run(config).execute())
    return summary.to_json()


def analyse(summary: dict, targets: list[float]) -> dict:
    steps = summary["steps"]
    start = steps[0]["committed_s"] if steps else 0.0
    reached = {}
    for t in targets:
        hit = next((e for e in summary["evals"] if e["accuracy"] >= t), None)
        reached[str(t)] = None if hit is None else {"seconds": hit["time_s"] - start, "version": hit["policy_version"]}

    def median(key: str) -> float:
        values = [s["metrics"][key] for s in steps if key in s["metrics"]]
        return statistics.median(values) if values else float("nan")

    # committed_s is the trainer's own commit time (time_s is when the controller saw the step, polling
    # every 0.5 s): the mean step over the run, evaluations included
    step_s = (steps[-1]["committed_s"] - steps[0]["committed_s"]) / (len(steps) - 1) if len(steps) > 1 else 0.0
    return {
        "reached": reached,
        "steps": len(steps),
        "final_accuracy": summary["final_accuracy"],
        "step_s": step_s,
        "wait_s": median("time/wait_s"),
        "train_s": median("time/train_s"),
        "publish_s": median("time/publish_s"),
        "publish_share": median("time/publish_s") / step_s if step_s > 0 else float("nan"),
        "staleness_histogram": summary["staleness_histogram"],
        "staleness_violations": summary["staleness_violations"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=Path("examples/addition/config.yaml"))
    p.add_argument("--taus", default="0,1,2")
    p.add_argument("--targets", default="0.6,0.8")
    p.add_argument("--steps", type=int, default=2500, help="upper bound per run")
    p.add_argument("--out", type=Path, default=Path("runs/bench-time-to-accuracy"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override for every run")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    taus = [int(t) for t in args.taus.split(",")]
    targets = sorted(float(t) for t in args.targets.split(","))
    results = {}
    for tau in taus:
        summary = run_one(args.recipe, tau, args.out / f"tau{tau}", args.steps, targets[-1], args.set)
        results[tau] = analyse(summary, targets)
        print(f"tau={tau}: {json.dumps(results[tau]['reached'])} final {results[tau]['final_accuracy']}", flush=True)

    base = results.get(0)
    print(
        f"\n{'tau':>4} "
        + " ".join(f"{'to ' + format(t, '.0%'):>10} {'vs tau0':>8}" for t in targets)
        + f" {'step s':>7} {'wait s':>7} {'train s':>7} {'publish s':>9} {'publish/step':>12}"
    )
    for tau, r in results.items():
        cells = []
        for t in targets:
            hit, ref = r["reached"][str(t)], base["reached"][str(t)] if base else None
            secs = f"{hit['seconds']:.0f}s" if hit else "-"
            ratio = f"{ref['seconds'] / hit['seconds']:.2f}x" if hit and ref else "-"
            cells.append(f"{secs:>10} {ratio:>8}")
        print(
            f"{tau:>4} " + " ".join(cells) + f" {r['step_s']:>7.3f} {r['wait_s']:>7.3f} {r['train_s']:>7.3f}"
            f" {r['publish_s']:>9.4f} {r['publish_share']:>12.1%}"
        )
    print("BENCH_JSON " + json.dumps({"targets": targets, "results": results}))


if __name__ == "__main__":
    main()
