"""Held-out accuracy, measured as an outside program would: greedy answers from the rollout service, scored
by the reward service."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tauflow import media
from tauflow.controller.config import EvalConfig
from tauflow.controller.ports import (
    SERVER_DEFAULTS,
    ChatPrompt,
    GreedySampling,
    HeldOutPrompt,
    RewardPort,
    RolloutPort,
    ToScore,
)
from tauflow.core.config import DataConfig
from tauflow.media import DataRow

BATCH = 64  # prompts asked of each rollout server at once
CALL_TIMEOUT_S = 120.0  # each call's own deadline: the rollout server is generating for training meanwhile


def read_heldout(config: EvalConfig, data: DataConfig | None = None) -> list[DataRow]:
    """The held-out rows, read with the run's column mapping ``data`` (and the eval's ``split``), at most
    ``max_prompts``; none without a data set. A multimodal row's parts are read now (their files)."""
    if not config.dataset:
        return []
    mapping = {**(data or DataConfig()).model_dump(), "split": config.split}
    return media.data_rows(config.dataset, mapping)[: config.max_prompts]


def _prompt(row: DataRow) -> HeldOutPrompt:
    if row.parts is not None:
        return row.parts
    if row.messages is not None:
        return ChatPrompt(row.messages)
    if row.token_ids is not None:
        return row.token_ids
    assert row.text is not None  # data_rows gives exactly one form
    return row.text


async def evaluate(
    rollouts: Sequence[RolloutPort],
    reward: RewardPort,
    rows: list[DataRow],
    reward_fn: str,
    sampling: GreedySampling = SERVER_DEFAULTS,
) -> tuple[float, int]:
    """The share of greedy answers scored 1, and the oldest version an engine answered with (it may lag
    or, with tau > 0, differ from the trainer's). The prompts are spread over the rollout servers
    ``rollouts`` (prompt i to server i mod R), each answering its share at once; ``sampling``: how the
    training's completions end."""

    async def one(i: int, row: DataRow) -> ToScore:
        rollout = rollouts[i % len(rollouts)]
        completion = await rollout.generate_greedy(_prompt(row), CALL_TIMEOUT_S, sampling)
        return ToScore(f"eval-{row.prompt_id}", row.metadata, completion)

    groups: list[ToScore] = []
    batch = BATCH * len(rollouts)
    for start in range(0, len(rows), batch):
        groups += await asyncio.gather(*(one(start + i, row) for i, row in enumerate(rows[start : start + batch])))
    scores = await reward.score(groups, reward_fn, timeout_s=CALL_TIMEOUT_S)
    engine_version = min((v for g in groups for v in g.completion.behaviour_versions), default=0)
    return sum(1.0 for s in scores if s >= 1.0) / max(len(scores), 1), engine_version
