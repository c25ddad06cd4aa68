#!/usr/bin/env python
"""What each role gains from more processes, measured side by side in one invocation (issue #13).

- **rollout**: tokens generated per second with 1, 2, 3 rollout replicas at a fixed trainer. Each is a
  `tauflow run` of the embedded recipe (every service its own process, one thread each) with τ = -1, so
  that pacing never holds a replica back: what the replicas generate is what they can. Tokens are the
  completion tokens of every group the queue accepted (read from its write-ahead log), over the run's
  wall time from its first committed step.
- **trainer**: the step time of the same batches at world_size 1 (one process) and 2 (two processes,
  gloo on loopback, FSDP2 and DDP), the trainer backend called directly: the medians of `--trainer-steps`
  steps after one warm-up step.

A 2-core machine cannot show a speed-up: every replica and every rank competes for the same two cores
with the other services, so these ratios measure what the extra processes cost here, not what they buy on
a cluster (docs/scaling.md carries the numbers into a capacity model).

    python bench/scaling.py                                   # both parts
    python bench/scaling.py --part trainer --world-sizes 1,2

Prints tables and ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "examples" / "addition"


# -- rollout replicas --------------------------------------------------------------------------------------


def generated_tokens(out: Path) -> tuple[int, int]:
    """(groups, completion tokens) the queue accepted in the run in ``out`` (from a copy of its log)."""
    from tauflow.api.common.v1 import common_pb2
    from tauflow.queue.records import PUT
    from tauflow.queue.wal import WriteAheadLog

    copy = out / "wal-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out / "queue-wal", copy)
    wal = WriteAheadLog(copy / "queue.wal")
    groups = tokens = 0
    try:
        for kind, _, blob, _ in wal.replay():
            if kind == PUT:
                group = common_pb2.Group.FromString(blob)
                groups += 1
                tokens += sum(len(s.completion_token_ids) for s in group.samples)
    finally:
        wal.close()
    return groups, tokens


def rollout_run(prepared: Path, replicas: int, steps: int, out: Path) -> dict[str, Any]:
    from tauflow.controller.app import build_run
    from tauflow.controller.config import RunConfig
    from tauflow.core.config import load_config

    overrides = [
        "prepare=[]",
        f"out_dir={out}",
        f"model={prepared / 'model'}",
        f"dataset={prepared / 'train.jsonl'}",
        "eval.dataset=",
        "target_accuracy=null",
        f"steps={steps}",
        "max_staleness=-1",
        f"rollout.replicas={replicas}",
        "services.queue.wal.compact_min_bytes=1099511627776",  # every Put stays in the log, to be counted
    ]
    config = load_config(RunConfig, path=ADDITION / "config.yaml", env_prefix="TAUFLOW_RUN_", overrides=overrides)
    summary = asyncio.run(build_run(config).execute()).to_json()
    steps_seen = summary["steps"]
    wall = steps_seen[-1]["committed_s"] - steps_seen[0]["committed_s"]
    groups, tokens = generated_tokens(out)
    step_times = [b["committed_s"] - a["committed_s"] for a, b in itertools.pairwise(steps_seen)]
    return {
        "replicas": replicas,
        "groups": groups,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "step_s": statistics.median(step_times) if step_times else float("nan"),
        "staleness_violations": summary["staleness_violations"],
    }


# -- trainer ranks -----------------------------------------------------------------------------------------


def batches(n_steps: int, groups: int, group_size: int, vocab: int, seed: int = 0) -> list[list[Any]]:
    """The recipe's shape: `groups` prompts of 5-9 tokens, `group_size` completions of 2-4 tokens each."""
    from tauflow.trainer.batch import Group, Sample

    rng = random.Random(seed)
    out = []
    for step in range(n_steps):
        step_groups = []
        for g in range(groups):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(5, 9))]
            samples = []
            for s in range(group_size):
                n = rng.randint(2, 4)
                samples.append(
                    Sample(
                        prompt_ids=prompt,
                        completion_ids=[rng.randrange(1, vocab) for _ in range(n)],
                        behaviour_logprobs=[-rng.uniform(1.0, 3.0) for _ in range(n)],
                        reward=float(rng.random() > 0.6),
                        behaviour_version=step,
                        sample_id=str(s),
                    )
                )
            step_groups.append(Group(f"s{step}-g{g}", samples))
        out.append(step_groups)
    return out


def backend_config(model: Path) -> Any:
    from tauflow.trainer.backend import TorchBackendConfig
    from tauflow.trainer.optim import OptimConfig

    return TorchBackendConfig(model_path=str(model), optim=OptimConfig(lr=3e-4))


def timed_steps(backend: Any, work: list[list[Any]]) -> list[float]:
    times = []
    for batch in work:
        t0 = time.perf_counter()
        backend.train_step(batch)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step warms up (allocations, FSDP's first gathers)


def _rank(rank: int, world: int, port: int, strategy: str, model: Path, work: list[list[Any]], out: Path) -> None:
    import torch

    from tauflow.trainer.backend import TorchBackend
    from tauflow.trainer.parallel import DistributedConfig, RankGroup

    torch.set_num_threads(1)
    dist = DistributedConfig(world, rank, f"127.0.0.1:{port}", strategy=strategy, timeout_s=300, keepalive_s=60)
    backend = TorchBackend(backend_config(model), group=RankGroup(dist, torch.device("cpu")))
    if rank != 0:
        backend.follow()
        backend.close()
        return
    times = timed_steps(backend, work)
    backend.close()
    out.write_text(json.dumps(times))


def trainer_times(model: Path, world: int, strategy: str, work: list[list[Any]], tmp: Path) -> list[float]:
    if world == 1:
        import torch

        from tauflow.trainer.backend import TorchBackend

        torch.set_num_threads(1)
        return timed_steps(TorchBackend(backend_config(model)), work)
    out = tmp / f"times-{strategy}-{world}.json"
    run_gang(_rank, world, strategy, model, work, out)
    times: list[float] = json.loads(out.read_text())
    return times


def run_gang(target: Any, world: int, *args: Any, timeout_s: float = 900) -> None:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes (``port``: a free one on loopback for
    their process group); raises if a rank failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, world, port, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


# -- main --------------------------------------------------------------------------------------------------


def prepare(out: Path) -> Path:
    if not (out / "model").exists():
        subprocess.run([sys.executable, str(ADDITION / "prepare.py"), "--out", str(out)], check=True, cwd=ROOT)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["rollout", "trainer", "both"], default="both")
    p.add_argument("--replicas", default="1,2,3")
    p.add_argument("--steps", type=int, default=40, help="steps of each rollout run")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--strategies", default="fsdp,ddp")
    p.add_argument("--trainer-steps", type=int, default=8, help="timed trainer steps (after one warm-up)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-scaling"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prepared = prepare(args.out / "prepared")
    report: dict[str, Any] = {}

    if args.part in ("rollout", "both"):
        rows = [
            rollout_run(prepared, int(n), args.steps, args.out / f"rollout{n}") for n in args.replicas.split(",")
        ]
        base = rows[0]["tokens_per_s"]
        print(f"\n{'replicas':>8} {'groups':>7} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'vs 1':>6} {'step s':>7}")
        for r in rows:
            r["ratio"] = r["tokens_per_s"] / base
            print(
                f"{r['replicas']:>8} {r['groups']:>7} {r['tokens']:>8} {r['seconds']:>8.1f} "
                f"{r['tokens_per_s']:>9.0f} {r['ratio']:>5.2f}x {r['step_s']:>7.3f}"
            )
        report["rollout"] = rows

    if args.part in ("trainer", "both"):
        vocab = json.loads((prepared / "model" / "config.json").read_text())["vocab_size"]
        work = batches(args.trainer_steps + 1, groups=64, group_size=8, vocab=vocab)
        rows = []
        one = statistics.median(trainer_times(prepared / "model", 1, "fsdp", work, args.out))
        rows.append({"world_size": 1, "strategy": "-", "step_s": one, "ratio": 1.0})
        for world in (int(w) for w in args.world_sizes.split(",") if int(w) > 1):
            for strategy in args.strategies.split(","):
                t = statistics.median(trainer_times(prepared / "model", world, strategy, work, args.out))
                rows.append({"world_size": world, "strategy": strategy, "step_s": t, "ratio": one / t})
        print(f"\n{'world':>5} {'strategy':>8} {'step s':>7} {'speed-up':>8}")
        for r in rows:
            print(f"{r['world_size']:>5} {r['strategy']:>8} {r['step_s']:>7.3f} {r['ratio']:>7.2f}x")
        report["trainer"] = rows

    print("BENCH_JSON " + json.dumps(report))


if __name__ == "__main__":
    main()
