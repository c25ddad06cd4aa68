#!/usr/bin/env python
"""Held-out accuracy of each algorithm family on the embedded task after the same number of steps, side by
side, against GRPO (the shipped recipe's algorithm) run beside them.

Each algorithm is a full `tauflow run` of the recipe (default: examples/addition): every service its own
process, the same prepared model, seed, τ and schedule; only `services.trainer.backend.algorithm` (and its
options) differs. Reported per algorithm: greedy held-out accuracy at the start, at each evaluation and at
the end, the best, the points gained, its ratio to GRPO's gain, the wall time of the run, and the step
metrics that tell the families apart (clip fractions, IS weights, updates per step).

    python bench/algorithms.py                                   # every family, 150 steps each
    python bench/algorithms.py --algorithms grpo,rloo --steps 100
    python bench/algorithms.py --algorithms "grpo,dapo:mini_batches=2;epochs=2"
    python bench/algorithms.py --algorithms "grpo,ppo|services.trainer.backend.critic_optim.lr=1e-3"

An entry ``name:key=value;key=value`` sets algorithm options (numbers and booleans as YAML reads them);
``|key=value|key=value`` after it sets run settings for that entry alone (a critic's learning rate, the
rollout's dynamic sampling or greedy baseline, a teacher's folder), as ``--set`` does for every entry.
Prints a table and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import yaml

from tauflow.controller.app import build_run  # the run wired with its launcher and gRPC clients
from tauflow.controller.config import RunConfig
from tauflow.core.config import load_config
from tauflow.trainer.algorithms import ALGORITHMS, AlgorithmConfig

FAMILIES = "grpo,dr_grpo,dapo,rloo,reinforce_pp,reinforce_pp_baseline,gspo,sapo,cispo,gpg"
# (ppo, remax and opd need settings of their own: bench/README.md gives the invocation)


def parse(entry: str) -> tuple[str, dict[str, object], list[str]]:
    entry, *settings = entry.split("|")
    name, _, options = entry.partition(":")
    opts = {}
    for item in filter(None, options.split(";")):
        key, _, value = item.partition("=")
        opts[key] = yaml.safe_load(value)
    return name, opts, settings


def run_one(recipe: Path, entry: str, out: Path, steps: int, every: int, extra: list[str]) -> dict:
    name, options, settings = parse(entry)
    base = dict(yaml.safe_load(recipe.read_text())["services"]["trainer"]["backend"].get("algorithm_options", {}))
    preset = ALGORITHMS[name].config.aggregation
    if preset != AlgorithmConfig().aggregation:
        base["aggregation"] = preset  # the family's own (GSPO, SAPO: per sequence; Dr. GRPO: a constant)
    overrides = [
        f"out_dir={out}",
        f"steps={steps}",
        f"eval.every_steps={every}",
        "target_accuracy=null",
        f"services.trainer.backend.algorithm={name}",
        f"services.trainer.backend.algorithm_options={json.dumps({**base, **options})}",
        *extra,
        *settings,
    ]
    config = load_config(RunConfig, path=recipe, env_prefix="TAUFLOW_RUN_", overrides=overrides)
    started = time.monotonic()
    summary = asyncio.run(build_run(config).execute()).to_json()
    summary["bench_wall_s"] = time.monotonic() - started
    return summary


def analyse(summary: dict, every: int) -> dict:
    evals = summary["evals"]
    steps = summary["steps"]

    def median(key: str) -> float:
        values = [s["metrics"][key] for s in steps if key in s["metrics"]]
        return statistics.median(values) if values else float("nan")

    first, last = evals[0]["accuracy"], evals[-1]["accuracy"]
    return {
        # each evaluation at the version it was taken (the controller asks every `every` steps, and the
        # trainer may be a step or two further): columns are the nearest multiple of `every`
        "accuracy": {round(e["policy_version"] / every) * every: e["accuracy"] for e in evals},
        "first": first,
        "final": last,
        "best": max(e["accuracy"] for e in evals),
        "gain": last - first,
        "wall_s": summary["bench_wall_s"],
        "clip_fraction": median("clip_fraction"),
        "is_weight_mean": median("is_weight_mean"),
        "updates": median("updates"),
        "staleness_violations": summary["staleness_violations"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=Path("examples/addition/config.yaml"))
    p.add_argument("--algorithms", default=FAMILIES, help="comma-separated entries (grpo first: the baseline)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=50, help="evaluate every this many steps")
    p.add_argument("--out", type=Path, default=Path("runs/bench-algorithms"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override for every run")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    entries = args.algorithms.split(",")
    results = {}
    for entry in entries:
        slug = entry.split("|")[0].replace(":", "-").replace(";", "-").replace("=", "")
        results[entry] = analyse(
            run_one(args.recipe, entry, args.out / slug, args.steps, args.every, args.set), args.every
        )
        r = results[entry]
        print(f"{entry}: {r['first']:.1%} -> {r['final']:.1%} (best {r['best']:.1%}) in {r['wall_s']:.0f}s", flush=True)

    base = results.get("grpo")
    versions = sorted({v for r in results.values() for v in r["accuracy"]})
    print(f"\n{'algorithm':<34}" + "".join(f"{'@' + str(v):>7}" for v in versions)
          + f" {'gain':>6} {'vs grpo':>8} {'wall s':>7} {'clip':>6} {'IS w':>6} {'upd':>4}")
    for entry, r in results.items():
        cells = "".join(f"{r['accuracy'][v]:>7.1%}" if v in r["accuracy"] else f"{'-':>7}" for v in versions)
        ratio = f"{r['gain'] / base['gain']:.2f}x" if base and base["gain"] > 0 else "-"
        print(f"{entry:<34}{cells} {r['gain'] * 100:>5.1f}p {ratio:>8} {r['wall_s']:>7.0f} {r['clip_fraction']:>6.3f}"
              f" {r['is_weight_mean']:>6.3f} {r['updates']:>4.0f}")
    print("BENCH_JSON " + json.dumps({"steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
