#!/usr/bin/env python
"""The megatron backend's pipeline schedule: a trainer step on P stages with windows of W micro-batches in
flight, against W = 1 (the stages taking turns), in one run.

Each setting is a fresh gang of P rank processes (gloo on loopback, one thread each) running the megatron
backend's real ``train_step`` (GRPO, one update, no reference) on a Qwen2-shaped model built here from a config
(random weights), the same batch every step: M micro-batches of ``--micro-batch-tokens`` padded tokens.
The first step of each gang is a warm-up and is not counted. The settings run in turn, ``--rounds`` times.

It runs on the CPU (one GPU per stage is what a CUDA run needs; NCCL refuses two ranks on one GPU), under the
trainer tests' CPU shim (``tauflow.trainer.megatron.cpu_shim``: megatron-core's forward assumes CUDA) -- a shim
for measuring the schedule, not a product path. With W micro-batches in flight a step takes about (M / W)(W + P - 1) stage-times
instead of M P: for P = 2, M = 8, 1.33x at W = 2, 1.6x at W = 4, 1.78x at W = 8 if the stages are even and the
sends free. Prints medians and ratios, then ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other bench scripts' helpers

import torch
from scaling import run_gang


def build_model(folder: Path, args: argparse.Namespace) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=4 * args.hidden, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)


def make_batch(args: argparse.Namespace, step: int) -> list[Any]:
    """Groups whose samples fill ``--micro-batches`` micro-batches of ``--micro-batch-tokens`` each, made by the
    policy of version ``step`` (the trainer takes a group once: new ids each step, the same tokens)."""
    from tauflow.trainer.batch import Group, Sample

    rng = random.Random(0)
    per_micro_batch = 4  # samples, each a quarter of the budget
    length = args.micro_batch_tokens // per_micro_batch
    groups = []
    for g in range(args.micro_batches * per_micro_batch // 4):
        prompt = [rng.randrange(1, args.vocab) for _ in range(8)]
        samples = [
            Sample(prompt, [rng.randrange(1, args.vocab) for _ in range(length - 8)], [-3.0] * (length - 8),
                   reward=float(s % 2), behaviour_version=step, sample_id=str(s))
            for s in range(4)
        ]  # fmt: skip
        groups.append(Group(f"step{step}-g{g}", samples))
    return groups


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: Path) -> None:
    import tauflow.trainer.megatron.backend as megatron_backend
    from tauflow.trainer.megatron.cpu_shim import run_megatron_on_cpu
    from tauflow.trainer.parallel import DistributedConfig, RankGroup

    torch.set_num_threads(1)
    run_megatron_on_cpu()  # (the module's docstring)
    group = RankGroup(DistributedConfig(world, rank, f"127.0.0.1:{port}", timeout_s=600), torch.device("cpu"))
    backend = megatron_backend.MegatronBackend(job["config"], group=group)
    if rank != 0:
        backend.follow()
        backend.close()
        return
    times, micro_batches = [], 0.0
    for batch in job["batches"]:
        start = time.perf_counter()
        result = backend.train_step(batch)
        times.append(time.perf_counter() - start)
        micro_batches = result.metrics["micro_batches"]
    backend.close()
    out.write_bytes(pickle.dumps({"step_s": times[1:], "micro_batches": micro_batches}))


def run_job(job: dict[str, Any], world: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "rank0.pkl"
    out.unlink(missing_ok=True)
    run_gang(_rank, world, job, out, timeout_s=1200)
    return pickle.loads(out.read_bytes())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="pipeline_parallel P (as many ranks)")
    p.add_argument("--windows", default="1,2,4,8", help="pipeline_micro_batches_in_flight values; 1 is the baseline")
    p.add_argument("--micro-batches", type=int, default=8, help="M: micro-batches a step")
    p.add_argument("--micro-batch-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="timed steps a gang (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, in turn with the others")
    args = p.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    if 1 not in windows:
        windows.insert(0, 1)

    from tauflow.trainer.backend import TorchBackendConfig
    from tauflow.trainer.optim import OptimConfig

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        build_model(tmp / "model", args)
        batches = [make_batch(args, step) for step in range(args.steps + 1)]
        step_s: dict[int, list[float]] = {w: [] for w in windows}
        seen_micro_batches = 0.0
        for round_ in range(args.rounds):
            for window in windows:
                config = TorchBackendConfig(
                    model_path=str(tmp / "model"), kind="megatron", device="cpu", pipeline_parallel=args.stages,
                    pipeline_micro_batches_in_flight=window, micro_batch_tokens=args.micro_batch_tokens,
                    optim=OptimConfig(lr=1e-5, schedule="constant"),
                )  # fmt: skip
                got = run_job({"config": config, "batches": batches}, args.stages, tmp)
                step_s[window] += got["step_s"]
                seen_micro_batches = got["micro_batches"]
                print(f"round {round_ + 1} W={window}: step {statistics.median(got['step_s']):.3f} s (median)",
                      flush=True)  # fmt: skip
    base = statistics.median(step_s[1])
    print(f"\nP = {args.stages} stages, M = {seen_micro_batches:.0f} micro-batches a step, "
          f"{args.layers} layers of {args.hidden}")  # fmt: skip
    print(f"{'in flight':>10} {'step s (median)':>16} {'speed-up vs W=1':>16} {'ideal':>6}")
    results = {}
    for window in windows:
        median = statistics.median(step_s[window])
        m, pp = int(seen_micro_batches), args.stages
        windows_of = [min(window, m - start) for start in range(0, m, window)]
        ideal = (m * pp) / sum(w + pp - 1 for w in windows_of)  # (the optimizer's step is not pipelined)
        results[str(window)] = {"step_s_median": median, "speedup": base / median, "ideal": ideal}
        print(f"{window:>10} {median:>16.3f} {base / median:>15.2f}x {ideal:>5.2f}x")
    print("BENCH_JSON " + json.dumps({
        "date": datetime.date.today().isoformat(), "device": "cpu",
        "stages": args.stages, "micro_batches": seen_micro_batches, "layers": args.layers, "hidden": args.hidden,
        "results": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
