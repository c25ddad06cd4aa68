"""Throughput of the hf engine at the embedded example's shape: 64 prompts x 8 samples per step, a ~0.5M-parameter
Qwen2 (hidden 128, 2 layers, 4 heads, vocab 16), prompts of ~7 tokens, completions of at most 4 tokens.

    OMP_NUM_THREADS=2 python bench/rollout_hf_throughput.py [--threads 2] [--steps 30]

Two ways of submitting a step: one call with 64 prompts (n=8), and 64 concurrent asyncio calls of one prompt
each (n=8), as a rollout loop with one request per group would. Prints generated tokens/s and steps/s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import torch


def build(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    # the shape of examples/addition (task.build_model)
    config = Qwen2Config(vocab_size=16, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, intermediate_size=512, max_position_embeddings=32,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tauflow.rollout.engine import SamplingParams
    from tauflow.rollout.engine.hf import HFEngine

    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=4, n=8, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        engine = HFEngine.from_pretrained(tmp, batch_wait_s=args.batch_wait_ms / 1e3)
        print(f"params: {sum(p.numel() for p in engine._model.parameters()):,}  torch threads: {args.threads}")

        def prompts() -> list[list[int]]:
            return [[1] + [rng.randrange(3, 16) for _ in range(6)] for _ in range(64)]

        def one_call() -> int:
            out = engine.submit(prompts(), params).result()
            return sum(len(c.token_ids) for group in out for c in group)

        async def per_group() -> int:
            outs = await asyncio.gather(*(engine.generate([p], params) for p in prompts()))
            return sum(len(c.token_ids) for out in outs for c in out[0])

        async def run_async(steps: int) -> int:
            return sum([await per_group() for _ in range(steps)])

        def timed(step) -> tuple[int, float]:
            step(3)  # warm-up
            t0 = time.perf_counter()
            return step(args.steps), time.perf_counter() - t0

        for name, step in (("1 call x 64 prompts", lambda k: sum(one_call() for _ in range(k))),
                           ("64 calls x 1 prompt", lambda k: asyncio.run(run_async(k)))):
            tokens, dt = timed(step)
            print(f"{name:22s} {tokens / dt:10,.0f} tokens/s  {args.steps / dt:6.1f} steps/s  "
                  f"({tokens / args.steps:.0f} tokens/step, {1e3 * dt / args.steps:.1f} ms/step)")
        print(engine.stats().counters)
        engine.close()


if __name__ == "__main__":
    main()
