"""Held-out accuracy, measured as an outside program would: greedy answers from the rollout service, scored
by the reward service."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tauflow import media
from tauflow.controller.config import EvalConfig
from tauflow.controller.ports import RewardPort, RolloutPort, ToScore

BATCH = 64  # prompts asked of each rollout server at once
CALL_TIMEOUT_S = 120.0  # each call's own deadline: the rollout server is generating for training meanwhile


def read_heldout(config: EvalConfig) -> list[dict[str, Any]]:
    """The held-out rows (``id``, ``prompt`` or ``prompt_parts``, ``answer``), at most ``max_prompts``; none
    without a dataset. A multimodal row's parts are read now (their files, relative to the data set)."""
    if not config.dataset:
        return []
    rows = media.read_rows(config.dataset)[: config.max_prompts]  # JSONL or Parquet
    for i, row in enumerate(rows):
        if "prompt_parts" in row:
            row["prompt_parts"] = media.parts_from_row(
                row["prompt_parts"], Path(config.dataset).parent, f"{config.dataset}: row {i}: prompt_parts"
            )
    return rows


async def evaluate(
    rollouts: Sequence[RolloutPort], reward: RewardPort, rows: list[dict[str, Any]], reward_fn: str
) -> tuple[float, int]:
    """The share of greedy answers scored 1, and the oldest version an engine answered with (it may lag
    or, with tau > 0, differ from the trainer's). The prompts are spread over the rollout servers
    ``rollouts`` (prompt i to server i mod R), each answering its share at once."""

    async def one(i: int, row: dict[str, Any]) -> ToScore:
        rollout = rollouts[i % len(rollouts)]
        prompt = row["prompt_parts"] if "prompt_parts" in row else row["prompt"]
        completion = await rollout.generate_greedy(prompt, timeout_s=CALL_TIMEOUT_S)
        return ToScore(f"eval-{row['id']}", str(row["answer"]), completion)

    groups: list[ToScore] = []
    batch = BATCH * len(rollouts)
    for start in range(0, len(rows), batch):
        groups += await asyncio.gather(*(one(start + i, row) for i, row in enumerate(rows[start : start + batch])))
    scores = await reward.score(groups, reward_fn, timeout_s=CALL_TIMEOUT_S)
    engine_version = min((v for g in groups for v in g.completion.behaviour_versions), default=0)
    return sum(1.0 for s in scores if s >= 1.0) / max(len(scores), 1), engine_version
