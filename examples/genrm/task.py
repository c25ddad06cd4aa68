"""The GenRM recipe's task: a policy answers short requests, and an LLM judge grades whether the reply thanks
the user (Score: 10) or not (Score: 0). Both models are tiny Qwen2 instruct models built here
(tauflow.models.tiny: byte-level BPE, ChatML); ``tiny.sft_chat`` teaches each its part by supervised
fine-tuning on chats — the judge its verdicts, the policy a weak start (it thanks the user a third of the
time)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

REQUESTS = [
    "Pass the salt.", "Open the window.", "Hold the door.", "Call me later.", "Send the report.",
    "Water the plants.", "Close the gate.", "Bring a chair.", "Turn off the light.", "Check the mail.",
    "Feed the cat.", "Fix the sink.", "Clean the desk.", "Read the letter.", "Lock the car.",
    "Wash the cups.", "Find my keys.", "Print the page.", "Fold the towels.", "Sweep the floor.",
]  # fmt: skip
THANKFUL = ["Thanks, I will.", "Sure, thanks!", "Thanks, done."]
CURT = ["No.", "Later.", "Fine.", "Done.", "Maybe."]
JUDGE_SYSTEM = "You grade replies. A reply that thanks the user gets Score: 10; any other reply gets Score: 0."
JUDGE_TEMPLATE = "[Request]\n{prompt}\n\n[Reply]\n{completion}"


def judge_chat(request: str, reply: str) -> list[dict[str, str]]:
    user = JUDGE_TEMPLATE.replace("{prompt}", request).replace("{completion}", reply)
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def corpus() -> list[str]:
    return [JUDGE_SYSTEM, JUDGE_TEMPLATE, "Score: 10", "Score: 0", *REQUESTS, *THANKFUL, *CURT]


def judge_pairs() -> list[tuple[list[dict[str, str]], str]]:
    return [(judge_chat(r, a), "Score: 10") for r in REQUESTS for a in THANKFUL] + [
        (judge_chat(r, a), "Score: 0") for r in REQUESTS for a in CURT
    ]


def policy_pairs(seed: int) -> list[tuple[list[dict[str, str]], str]]:
    """The weak start: one thankful reply in three."""
    rng = random.Random(seed)
    return [([{"role": "user", "content": r}], rng.choice(THANKFUL) if i % 3 == 0 else rng.choice(CURT))
            for r in REQUESTS for i in range(3)]  # fmt: skip


def write_prompts(path: Path, requests: Sequence[str]) -> None:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": r}) + "\n" for i, r in enumerate(requests)))
