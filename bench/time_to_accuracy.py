#!/usr/bin/env python
"""Wall-clock to reach held-out accuracy targets with tau = 0, 1, 2 and -1, over several seeds, and the ratios.

Each (seed, tau) is a full `tauflow run` of a recipe (default: examples/addition): every service its own
process, one thread each, the same prepared model, seed and hyperparameters; only `max_staleness`
differs. A seed is the recipe's `seed`: its warm start (the recipe's `prepare`, made once per seed and
kept for that seed's runs) and its sampling. Runs go seed by seed, every tau of a seed in turn. Time is
counted from each run's first committed step (service start-up excluded, it is the same for every tau)
to the first evaluation at or above each target. Runs stop at the highest target (`stop_at_target`) or
at the recipe's `steps` (its cosine schedule's length; `--steps` changes both).

Also reported per tau, from the trainer's own step timings (medians): the time a step waits for data,
trains, and blocks on the hand-off of its weights to the sidecar (`time/publish_s`), that blocking time
as a share of the step, and the overlap: the share of tau = 0's wait for data per step that the run does
not wait (1 - wait / wait at tau = 0, same seed). Per tau, the table gives the median over seeds.

    python bench/time_to_accuracy.py                       # tau 0, 1, 2, -1; seeds 0, 1, 2; 60/70/80 %
    python bench/time_to_accuracy.py --taus 0,1 --seeds 0 --targets 0.5 --steps 400

Prints a table and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
from pathlib import Path

from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
from tauflow.controller.config import RunConfig
from tauflow.core.config import load_config


def run_one(recipe: Path, tau: int, seed: int, out: Path, steps: int | None, target: float, extra: list[str]) -> dict:
    overrides = [
        f"max_staleness={tau}",
        f"seed={seed}",
        f"out_dir={out}",
        *([f"steps={steps}"] if steps is not None else []),
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


def _median(values: list[float]) -> float | None:
    values = [v for v in values if not math.isnan(v)]  # (NaN: a run with no step that waited)
    return statistics.median(values) if values else None


def _cell(value: float | None) -> str:
    return f"{value:>6.3f}" if value is not None else f"{'-':>6}"


def summarize(runs: dict[int, dict[int, dict]], targets: list[float]) -> dict[int, dict]:
    """Per tau, the median over seeds of each figure; a target a seed never reached counts as missed."""
    table = {}
    for tau, by_seed in runs.items():
        row: dict = {"seeds": len(by_seed)}
        for t in targets:
            hits = [r["reached"][str(t)] for r in by_seed.values() if r["reached"][str(t)]]
            row[f"to_{t}"] = {
                "reached": len(hits),
                "median_s": _median([h["seconds"] for h in hits]),
                "median_steps": _median([h["version"] for h in hits]),
            }
        for key in ("step_s", "wait_s", "train_s", "publish_share", "final_accuracy", "overlap"):
            values = [r[key] for r in by_seed.values() if r.get(key) is not None]
            row[key] = _median(values)
        finals = [r["final_accuracy"] for r in by_seed.values() if r["final_accuracy"] is not None]
        row["min_final_accuracy"] = min(finals) if finals else None  # (None: a run without evaluations)
        table[tau] = row
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=Path("examples/addition/config.yaml"))
    p.add_argument("--taus", default="0,1,2,-1")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--targets", default="0.6,0.7,0.8")
    p.add_argument("--steps", type=int, default=None, help="upper bound per run (default: the recipe's steps)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-time-to-accuracy"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override for every run")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    taus = [int(t) for t in args.taus.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = sorted(float(t) for t in args.targets.split(","))
    runs: dict[int, dict[int, dict]] = {tau: {} for tau in taus}
    for seed in seeds:
        for tau in taus:
            out = args.out / f"seed{seed}-tau{tau}"
            summary = run_one(args.recipe, tau, seed, out, args.steps, targets[-1], args.set)
            r = runs[tau][seed] = analyse(summary, targets)
            print(
                f"seed={seed} tau={tau}: {json.dumps(r['reached'])} steps {r['steps']} step {r['step_s']:.3f}s "
                f"wait {r['wait_s']:.3f}s final {r['final_accuracy']}",
                flush=True,
            )
        wait0 = runs[0][seed]["wait_s"] if 0 in runs else None
        for tau in taus:
            r = runs[tau][seed]
            r["overlap"] = 1.0 - r["wait_s"] / wait0 if wait0 else None

    table = summarize(runs, targets)
    base = table.get(0)
    n = len(seeds)
    print(f"\nmedians over {n} seed(s) {seeds}; 'reached' = seeds that reached the target")
    print(
        f"{'tau':>4} "
        + " ".join(f"{'to ' + format(t, '.0%'):>10} {'vs tau0':>8} {'reached':>7}" for t in targets)
        + f" {'step s':>7} {'wait s':>7} {'overlap':>7} {'train s':>7} {'publish/step':>12} {'final':>6} {'min':>6}"
    )
    for tau, row in table.items():
        cells = []
        for t in targets:
            hit = row[f"to_{t}"]
            ref = base[f"to_{t}"]["median_s"] if base else None
            secs = f"{hit['median_s']:.0f}s" if hit["median_s"] is not None else "-"
            ratio = f"{ref / hit['median_s']:.2f}x" if hit["median_s"] and ref else "-"
            cells.append(f"{secs:>10} {ratio:>8} {hit['reached']:>3}/{n:<3}")
        overlap = f"{row['overlap']:.0%}" if row["overlap"] is not None else "-"
        print(
            f"{tau:>4} " + " ".join(cells) + f" {row['step_s']:>7.3f} {row['wait_s']:>7.3f} {overlap:>7}"
            f" {row['train_s']:>7.3f} {row['publish_share']:>12.1%} {_cell(row['final_accuracy'])}"
            f" {_cell(row['min_final_accuracy'])}"
        )
    print("BENCH_JSON " + json.dumps({"targets": targets, "seeds": seeds, "table": table, "runs": runs}))


if __name__ == "__main__":
    main()
