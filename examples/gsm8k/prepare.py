"""Prepares the CPU smoke run of the GSM8K recipe: a tiny Qwen2 instruct model built here, with a byte-level
BPE tokenizer trained by the `tokenizers` library on the bundled problems and a ChatML chat template, saved
with save_pretrained (a real run names a real checkpoint folder instead: config.gpu.yaml).

    python examples/gsm8k/prepare.py --out runs/gsm8k/prepared
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tauflow.models import tiny

HERE = Path(__file__).parent
SYSTEM = "Solve the problem step by step. Put the final answer in \\boxed{}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gsm8k/prepared"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.out / "model"
    if (model / "config.json").exists():
        print(f"prepared already: {model}")
        return
    rows = [json.loads(line) for f in ("train", "test") for line in (HERE / "data" / f"{f}.jsonl").open()]
    corpus = [SYSTEM, "The answer is \\boxed{42}."] + [r["question"] for r in rows] + [r["answer"] for r in rows]
    tiny.build_chat_model(model, corpus, vocab_size=640, hidden=64, layers=2, heads=4, seed=args.seed)
    print(f"prepared {model}")


if __name__ == "__main__":
    main()
