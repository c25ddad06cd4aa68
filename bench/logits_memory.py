#!/usr/bin/env python
"""``backend.logits_chunk_tokens``: a trainer step with the output layer's logits a chunk of positions at a time,
against the whole logits at once (the default), in one run.

Each setting is a fresh process (its own peak memory) running the torch backend's real ``train_step`` (GRPO with
the entropy in the metrics, one update) on a Qwen2-shaped model built here from a config, with a large
vocabulary and a small body, so that the logits are what a micro-batch's memory is made of (as they are for a
150k vocabulary at 0.5-7B parameters): the same batch every step, one micro-batch of ``--tokens`` padded tokens.
The first step is a warm-up and is not counted. Reported per setting: the process's peak resident memory above
what it held before the first step (``ru_maxrss``; on a GPU ``torch.cuda.max_memory_allocated`` tells the same
story), the bytes autograd saves for the step's backward (counted with ``saved_tensors_hooks``), and the median
step time. Prints ratios against the whole logits, then ``BENCH_JSON {...}``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch


def build_model(folder: Path, args: argparse.Namespace) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=4 * args.hidden, max_position_embeddings=args.tokens,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(folder)


def make_batch(args: argparse.Namespace, step: int) -> list[Any]:
    """Groups of 4 samples that fill one micro-batch of ``--tokens`` (new ids each step, the same tokens)."""
    from tauflow.trainer.batch import Group, Sample

    rng = random.Random(0)
    samples_per_batch, length = 8, args.tokens // 8
    groups = []
    for g in range(samples_per_batch // 4):
        samples = []
        for s in range(4):
            prompt = [rng.randrange(args.vocab) for _ in range(length // 4)]
            completion = [rng.randrange(args.vocab) for _ in range(length - len(prompt))]
            samples.append(Sample(prompt, completion, [-1.0] * len(completion), reward=float(s % 2), behaviour_version=step))
        groups.append(Group(f"s{step}-g{g}", samples))
    return groups


def run_setting(model: Path, chunk: int, args: argparse.Namespace) -> dict[str, Any]:
    """One setting, in this process: peak memory, saved bytes, step times."""
    from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
    from tauflow.trainer.optim import OptimConfig

    config = TorchBackendConfig(
        model_path=str(model), optim=OptimConfig(lr=1e-4), micro_batch_tokens=args.tokens, logits_chunk_tokens=chunk
    )
    backend = TorchBackend(config)
    saved = [0]

    def count(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        if step == 0:
            with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
                result = backend.train_step(make_batch(args, step))
        else:
            result = backend.train_step(make_batch(args, step))
        assert result.committed
        if step:
            times.append(time.perf_counter() - started)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "chunk": chunk,
        "peak_mib": (peak_kib - before_kib) / 1024,
        "saved_mib": saved[0] / 2**20,
        "step_s": statistics.median(times),
        "loss": result.loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="padded tokens of the step's one micro-batch")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="logits_chunk_tokens to compare")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (after a warm-up)")
    parser.add_argument("--setting", type=int, help=argparse.SUPPRESS)  # (a child process: one setting)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting is not None:
        print("RESULT " + json.dumps(run_setting(args.model, args.setting, args)), flush=True)
        return

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model, args)
        for chunk in [0, *args.chunks]:
            command = [sys.executable, __file__, "--setting", str(chunk), "--model", str(model)]
            command += [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "layers", "tokens", "steps")]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    whole = results[0]
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, one micro-batch of {args.tokens} tokens; "
          f"whole logits float32: {args.tokens * args.vocab * 4 / 2**20:.0f} MiB a copy")  # fmt: skip
    print(f"{'logits_chunk_tokens':>20} {'peak MiB':>9} {'saved MiB':>10} {'step s':>7}  memory vs whole, time vs whole")
    for r in results:
        print(f"{r['chunk'] or 'whole':>20} {r['peak_mib']:9.0f} {r['saved_mib']:10.1f} {r['step_s']:7.2f}  "
              f"{r['peak_mib'] / whole['peak_mib']:.2f}x, {r['step_s'] / whole['step_s']:.2f}x")  # fmt: skip
        assert abs(r["loss"] - whole["loss"]) <= 1e-4 * max(1.0, abs(whole["loss"])), (r, whole)  # the same step
    record = {"date": datetime.date.today().isoformat(), "args": {k: v for k, v in vars(args).items() if k not in
              ("setting", "model")}, "results": results}  # fmt: skip
    print("BENCH_JSON " + json.dumps(record))


if __name__ == "__main__":
    main()
