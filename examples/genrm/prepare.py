"""Prepares the GenRM recipe: the judge (a tiny instruct model taught to grade whether a reply thanks the
user) and the policy (a tiny instruct model that thanks the user one time in three), both built here, and
the training and held-out requests.

    python examples/genrm/prepare.py --out runs/genrm/prepared
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
    parser.add_argument("--out", type=Path, default=Path("runs/genrm/prepared"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.out / "policy" / "config.json").exists():
        print(f"prepared already: {args.out}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    judge = tiny.build_chat_model(args.out / "judge", task.corpus(), vocab_size=300, hidden=32, layers=1, heads=2)
    print(f"judge: final SFT loss {tiny.sft_chat(judge, task.judge_pairs(), steps=150, lr=3e-3, seed=args.seed):.3f}")
    policy = tiny.build_chat_model(args.out / "policy", task.corpus(), vocab_size=300, hidden=32, layers=1, heads=2)
    print(
        f"policy: final SFT loss {tiny.sft_chat(policy, task.policy_pairs(args.seed), steps=60, lr=3e-3, seed=args.seed):.3f}"
    )
    task.write_prompts(args.out / "train.jsonl", task.REQUESTS[:15])
    task.write_prompts(args.out / "heldout.jsonl", task.REQUESTS[15:])
    print(f"prepared {args.out}")


if __name__ == "__main__":
    main()
