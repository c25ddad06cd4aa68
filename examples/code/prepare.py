"""Prepares the code recipe: a tiny instruct model built here (byte-level BPE, ChatML) warm-started to
write, for each training problem, its correct program one time in three, and the problems with their
stdin/stdout tests.

    python examples/code/prepare.py --out runs/code/prepared
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import task

from tauflow.models import tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/code/prepared"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.out / "model" / "config.json").exists():
        print(f"prepared already: {args.out}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny.build_chat_model(args.out / "model", task.corpus(), vocab_size=400, hidden=64, layers=2, heads=4)
    loss = tiny.sft_chat(model, task.warm_start_pairs(args.seed), steps=150, lr=3e-3, seed=args.seed)
    print(f"warm start: final SFT loss {loss:.3f}")
    task.write_data(args.out)
    print(f"prepared {args.out}")


if __name__ == "__main__":
    main()
