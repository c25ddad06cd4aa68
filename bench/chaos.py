"""The chaos run, longer (#11): tests/e2e/test_chaos.py's run with more steps, more faults and several seeds.

For each seed: a `tauflow run` of the embedded task's tiny model in which every role is SIGKILLed
``--kills-per-role`` times (each round in the seed's order) and each role of ``--stop`` is SIGSTOPped once
for longer than its callers' deadlines, while an outside producer puts groups through the queue's external
port; then the exact accounting of tests/chaos.py. Prints one line of figures per seed and the totals, writes
them as JSON (``--json``), and exits 1 if any seed's accounting is not exact.

    OMP_NUM_THREADS=1 .venv/bin/python bench/chaos.py                      # 3 seeds, 60 steps, 2 kills per role
    OMP_NUM_THREADS=1 .venv/bin/python bench/chaos.py --seeds 7 --steps 90 --kills-per-role 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.chaos, tests.runs

from tests.chaos import STOP_S, ChaosRun, Report, schedule
from tests.runs import tiny_addition


def line(r: Report) -> str:
    kills = sum(f.kind == "kill" for f in r.faults)
    stops = sum(f.kind == "stop" for f in r.faults)
    evicted = sum(r.evicted.values())
    return (f"seed {r.seed:>3}: {r.steps} steps, {kills} kills + {stops} stops, {r.minutes:5.1f} min | accepted "
            f"{r.acknowledged} ({r.acknowledged_external} external) = trained {r.trained} + left {r.left} + evicted "
            f"{evicted} | evicted after training {r.evicted_after_training}, external refused "
            f"{sum(r.refused_external.values())}, producer retries {r.producer_retries} | "
            f"{'exact' if not r.problems else 'NOT EXACT: ' + '; '.join(r.problems)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kills-per-role", type=int, default=2)
    p.add_argument("--stop", nargs="*", default=["reward", "rollout"], choices=sorted(STOP_S))
    p.add_argument("--json", help="write every seed's report here")
    p.add_argument("--keep", help="run in this folder (kept) instead of a temporary one")
    args = p.parse_args(argv)

    reports = []
    with tempfile.TemporaryDirectory(prefix="tauflow-chaos-") as tmp:
        root = Path(args.keep or tmp)
        for seed in args.seeds:
            work = root / f"seed{seed}"
            work.mkdir(parents=True, exist_ok=True)
            model, dataset = tiny_addition(work)
            faults = schedule(seed, args.steps, args.kills_per_role, tuple(args.stop))
            print(f"seed {seed}: " + ", ".join(f"{f.kind} {f.role} after v{f.after_version}" for f in faults), flush=True)
            report = ChaosRun(work, model, dataset, args.steps, faults, seed=seed, timeout_s=3600).execute()
            for f in report.faults:
                print(f"  {f.kind} {f.role} at v{f.at_version}: back after {f.back_after_s:.1f}s {f.evidence or ''}")
            print(line(report), flush=True)
            reports.append(report)
    total = {key: sum(getattr(r, key) for r in reports)
             for key in ("acknowledged", "acknowledged_external", "trained", "left", "evicted_after_training")}
    total["evicted"] = sum(sum(r.evicted.values()) for r in reports)
    total["faults"] = sum(len(r.faults) for r in reports)
    total["minutes"] = round(sum(r.minutes for r in reports), 1)
    print(f"all {len(reports)} seeds: {json.dumps(total)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"reports": [r.as_dict() for r in reports], "total": total}, indent=1))
    return 0 if all(not r.problems for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
