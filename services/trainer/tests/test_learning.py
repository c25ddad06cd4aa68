"""A tiny model learns a trivial task with GRPO, on-policy and one version stale (step-based, no clock).

Task: after the prompt [1, 2], emit token 3 first (reward 1, else 0). A separate "rollout" copy of the
model samples with torch.multinomial and reports behaviour log-probs; it receives the trainer's weights
through `state_dict_for_publish`, like the weight sidecar would deliver them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.optim import OptimConfig

PROMPT = [1, 2]
TARGET = 3
GROUP_SIZE = 8
GROUPS_PER_STEP = 4
COMPLETION_LEN = 2
MAX_STEPS = 40


def rollout(model: torch.nn.Module, version: int, step: int, gen: torch.Generator) -> list[Group]:
    groups = []
    with torch.no_grad():
        for gi in range(GROUPS_PER_STEP):
            ids = torch.tensor([PROMPT] * GROUP_SIZE)
            logps = []
            for _ in range(COMPLETION_LEN):
                logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
                tok = torch.multinomial(logp.exp(), 1, generator=gen)
                logps.append(logp.gather(-1, tok))
                ids = torch.cat([ids, tok], dim=1)
            behaviour = torch.cat(logps, dim=1)
            samples = [
                Sample(
                    prompt_ids=PROMPT,
                    completion_ids=ids[i, len(PROMPT) :].tolist(),
                    behaviour_logprobs=behaviour[i].tolist(),
                    reward=float(ids[i, len(PROMPT)] == TARGET),
                    behaviour_version=version,
                )
                for i in range(GROUP_SIZE)
            ]
            groups.append(Group(f"s{step}-g{gi}", samples))
    return groups


@pytest.mark.parametrize("staleness", [0, 1])
def test_grpo_learns_to_emit_the_rewarded_token(tiny_model_dir: Path, staleness: int) -> None:
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(TorchBackendConfig(model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-2), seed=0))
    engine = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(0)
    pending = [rollout(engine, 0, k, gen) for k in range(staleness)]  # generated ahead, at version 0
    rewards: list[float] = []
    for k in range(MAX_STEPS):
        pending.append(rollout(engine, backend.version, k + staleness, gen))
        batch = pending.pop(0)
        result = backend.train_step(batch, max_staleness=staleness)
        assert result.committed and result.max_staleness <= staleness and not result.skipped_stale_group_ids
        engine.load_state_dict(backend.state_dict_for_publish())
        rewards.append(result.mean_reward)
        if k >= 4 and sum(rewards[-3:]) / 3 >= 0.9:
            break
    assert rewards[0] < 0.3, rewards
    assert sum(rewards[-3:]) / 3 >= 0.9, f"mean reward did not reach 0.9 within {MAX_STEPS} steps: {rewards}"
    assert backend.version == len(rewards)
