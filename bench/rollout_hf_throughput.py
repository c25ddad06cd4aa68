"""Tokens per second of tauflow's `hf` engine against plain `transformers` `generate`, on the same model,
prompts and sampling, each in its own process, in one invocation (issue #17).

    OMP_NUM_THREADS=1 python bench/rollout_hf_throughput.py                  # both models, ~3 min on 2 cores
    OMP_NUM_THREADS=1 python bench/rollout_hf_throughput.py --models toy --rounds 5

A step is what the rollout generates for one trainer step: 64 prompts, 8 samples each, at temperature 1
with the log-probability of every sampled token (what the trainer needs), EOS ignored so that both sides
generate exactly the same number of tokens.

* **engine**: `HFEngine.submit(64 prompts, n=8)`, one call per step. The engine prefills each prompt once
  for its 8 samples (prefix sharing), batches every sequence in one decode loop with a KV cache, and
  samples and scores tokens itself.
* **generate** (the baseline): `model.generate(left-padded prompts, num_return_sequences=8,
  do_sample=True, output_scores=True)`, then the log-probabilities from the scores: plain transformers, the
  prompts copied 8 times before the prefill.

Models, both Qwen2 built here from a config (random weights; speed does not depend on them):

* **toy**: the embedded recipe's (~0.5 M parameters, vocab 16), prompts of 7 tokens, 4 new tokens.
* **medium**: ~30 M parameters (hidden 512, 8 layers, vocab 8192), prompts of 24-40 tokens, 32 new tokens:
  large enough that per-call overhead does not dominate.

Rounds alternate the two sides and flip the order every round; each side runs in a fresh process
(`--threads` torch threads) with one warm-up step. Prints the median tokens/s of each side and the ratio
engine / generate, then a `BENCH_JSON {...}` line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "toy": {
        "config": {"vocab_size": 16, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                       "num_key_value_heads": 8, "intermediate_size": 512, "max_position_embeddings": 32},
        "prompt_tokens": (7, 7), "new_tokens": 4,
    },
    "medium": {
        "config": {"vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                       "num_key_value_heads": 8, "intermediate_size": 1408, "max_position_embeddings": 128},
        "prompt_tokens": (24, 40), "new_tokens": 32,
    },
}
PROMPTS, SAMPLES = 64, 8


def build(name: str, path: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**MODELS[name]["config"], tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def step_prompts(name: str, rng: random.Random) -> list[list[int]]:
    low, high = MODELS[name]["prompt_tokens"]
    vocab = MODELS[name]["config"]["vocab_size"]
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(low, high) - 1)] for _ in range(PROMPTS)]


def run_engine(path: str, name: str, steps: int, seed: int) -> tuple[int, float]:
    from tauflow.rollout.engine import SamplingParams
    from tauflow.rollout.engine.hf import HFEngine

    engine = HFEngine.from_pretrained(path, seed=seed)
    params = SamplingParams(max_new_tokens=MODELS[name]["new_tokens"], n=SAMPLES, temperature=1.0, ignore_eos=True)
    rng = random.Random(seed)

    def step() -> int:
        out = engine.submit(step_prompts(name, rng), params).result()
        assert all(len(c.logprobs) == len(c.token_ids) for group in out for c in group)
        return sum(len(c.token_ids) for group in out for c in group)

    step()  # warm-up
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    elapsed = time.perf_counter() - t0
    engine.close()
    return tokens, elapsed


def run_generate(path: str, name: str, steps: int, seed: int) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    new = MODELS[name]["new_tokens"]
    rng = random.Random(seed)

    @torch.inference_mode()
    def step() -> int:
        prompts = step_prompts(name, rng)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded, as generate wants
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new, min_new_tokens=new, num_return_sequences=SAMPLES, output_scores=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
        sampled = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # (rows, new, vocab), after the temperature
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, sampled[..., None]).squeeze(-1)
        assert logprobs.shape == sampled.shape
        return int(sampled.numel())

    step()  # warm-up
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    return tokens, time.perf_counter() - t0


def _child(side: str, path: str, name: str, steps: int, seed: int, threads: int, out: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    fn = run_engine if side == "engine" else run_generate
    out.put(fn(path, name, steps, seed))


def measure(side: str, path: str, name: str, steps: int, seed: int, threads: int) -> tuple[int, float]:
    """One side in a fresh process (spawned: nothing shared with the other side)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=_child, args=(side, path, name, steps, seed, threads, results))
    proc.start()
    result = results.get(timeout=1800)
    proc.join(60)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="steps per measurement (default: 20 toy, 3 medium)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side's process")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    report: dict[str, Any] = {"benchmark": "rollout_hf_throughput", "threads": args.threads, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = Path(tmp) / name
            n_params = build(name, path)
            steps = args.steps or (20 if name == "toy" else 3)
            runs: dict[str, list[float]] = {"engine": [], "generate": []}
            for rnd in range(args.rounds):
                sides = ["engine", "generate"] if rnd % 2 == 0 else ["generate", "engine"]
                for side in sides:
                    tokens, elapsed = measure(side, str(path), name, steps, seed=rnd, threads=args.threads)
                    runs[side].append(tokens / elapsed)
                    print(f"  {name} round {rnd} {side:8s} {tokens / elapsed:10,.0f} tokens/s ({tokens} in "
                          f"{elapsed:.2f} s)", flush=True)
            medians = {side: statistics.median(v) for side, v in runs.items()}
            ratio = medians["engine"] / medians["generate"]
            report["models"][name] = {"params": n_params, "steps": steps, "runs": runs, "medians": medians,
                                      "ratio_engine_vs_generate": ratio, **{k: v for k, v in MODELS[name].items()
                                                                            if k != "config"}}
            print(f"{name}: {n_params / 1e6:.1f} M parameters; engine {medians['engine']:,.0f} tokens/s, generate "
                  f"{medians['generate']:,.0f} tokens/s: engine / generate = {ratio:.2f}\n", flush=True)
    print("BENCH_JSON " + json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    sys.exit(main())
