"""PPO with GAE: the critic lives in the trainer, learns the returns, trains beside the policy (or alone
during its warm-up), and is checkpointed and resumed with it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.batch import Group, Sample
from tauflow.trainer.critic import CRITIC_FOLDER
from tauflow.trainer.optim import OptimConfig

MakeGroups = Callable[..., list[Group]]


def ppo(model_dir: Path, **options: object) -> TorchBackendConfig:
    return TorchBackendConfig(
        model_path=str(model_dir),
        algorithm="ppo",
        algorithm_options=options,
        optim=OptimConfig(lr=1e-3),
        critic_optim=OptimConfig(lr=3e-3),
    )


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def moved(before: dict[str, torch.Tensor], module: torch.nn.Module) -> bool:
    return any(not torch.equal(before[k], v) for k, v in module.state_dict().items())


def parity_groups(seed: int, n: int = 6) -> list[Group]:
    """Rewards the critic can learn from the prompt alone: 1 when the prompt's first token is even."""
    rng = random.Random(seed)
    groups = []
    for g in range(n):
        prompt = [rng.randrange(1, 16) for _ in range(3)]
        samples = []
        for i in range(4):
            c = rng.randint(2, 4)
            samples.append(
                Sample(prompt, [rng.randrange(1, 16) for _ in range(c)], [-2.7] * c, reward=float(prompt[0] % 2 == 0))
            )
        groups.append(Group(f"p{seed}-{g}", samples))
    return groups


def test_the_critic_learns_the_returns_while_the_policy_trains(tiny_model_dir: Path) -> None:
    backend = TorchBackend(ppo(tiny_model_dir))
    assert backend.critic is not None
    policy, critic = weights(backend.model), weights(backend.critic.model)
    first = backend.train_step(parity_groups(0))
    assert moved(policy, backend.model) and moved(critic, backend.critic.model)
    for key in ("value_loss", "value_clip_fraction", "value_mean", "return_mean", "critic_grad_norm", "critic_lr"):
        assert key in first.metrics, key
    assert first.metrics["critic_updates"] == first.metrics["updates"] == 1.0
    # γ = λ = 1: every return is the sample's outcome, so the critic's targets are the rewards
    assert first.metrics["return_mean"] == pytest.approx(first.mean_reward, abs=0.15)
    losses = [backend.train_step(parity_groups(k)).metrics["value_loss"] for k in range(1, 40)]
    assert sum(losses[-5:]) / 5 < 0.5 * first.metrics["value_loss"], losses
    assert backend.version == 40


def test_gae_advantages_reach_the_loss_per_token(tiny_model_dir: Path) -> None:
    # Equal rewards in a group give GRPO nothing to train; with a critic they still have advantages
    # R − V ≠ 0 (and the group trains): the estimator, not the group, decides.
    same = [Group("same", [Sample([1, 2], [3, 4, 5], [-2.7] * 3, reward=1.0) for _ in range(3)])]
    backend = TorchBackend(ppo(tiny_model_dir, whiten_advantages=False))
    result = backend.train_step(same)
    assert result.metrics["skipped_zero_advantage_groups"] == 0.0 and result.trained_tokens == 9
    assert result.metrics["advantage_mean"] != 0.0


def test_critic_warmup_trains_the_critic_alone(tiny_model_dir: Path) -> None:
    backend = TorchBackend(ppo(tiny_model_dir, critic_warmup_steps=2, mini_batches=2))
    assert backend.critic is not None
    policy, critic = weights(backend.model), weights(backend.critic.model)
    for k in range(2):
        result = backend.train_step(parity_groups(k))
        assert result.committed and result.metrics["updates"] == 0.0 and result.metrics["critic_updates"] == 2.0
    assert backend.version == 2  # the warm-up's steps are versions too
    assert not moved(policy, backend.model) and moved(critic, backend.critic.model)
    assert backend.train_step(parity_groups(2)).metrics["updates"] == 2.0
    assert moved(policy, backend.model)


def test_a_checkpoint_holds_the_critic_and_resumes_it_bitwise(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ppo(tiny_model_dir, mini_batches=2, epochs=2)
    batches = [parity_groups(k) for k in range(4)]
    a = TorchBackend(config)
    for batch in batches[:2]:
        a.train_step(batch)
    info = a.save_checkpoint(tmp_path / "ckpt")
    assert (info.path / CRITIC_FOLDER / "config.json").is_file()
    for batch in batches[2:]:
        a.train_step(batch)

    b = TorchBackend(config, checkpoint=info.path)  # the critic's weights, optimizer and schedule come back
    assert b.critic is not None and a.critic is not None
    for batch in batches[2:]:
        b.train_step(batch)
    for mine, theirs in ((a.model, b.model), (a.critic.model, b.critic.model)):
        wa, wb = weights(mine), weights(theirs)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    c = TorchBackend(config)
    c.load_checkpoint(info.path)  # in place, too
    assert c.critic is not None and moved(weights(b.critic.model), c.critic.model)
    for batch in batches[2:]:
        c.train_step(batch)
    assert not moved(weights(b.critic.model), c.critic.model)


def test_a_new_critic_starts_from_the_configured_folder_and_a_grpo_checkpoint(
    tiny_model_dir: Path, make_groups: MakeGroups, tmp_path: Path
) -> None:
    # A run that switches from GRPO to PPO resumes a checkpoint without a critic: a new value head on the
    # policy's backbone, a fresh optimizer.
    grpo = TorchBackend(TorchBackendConfig(model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-2)))
    grpo.train_step(make_groups(1, 3))
    info = grpo.save_checkpoint(tmp_path / "ckpt")
    assert not (info.path / CRITIC_FOLDER).exists()
    resumed = TorchBackend(ppo(tiny_model_dir), checkpoint=info.path)
    assert resumed.critic is not None and resumed.version == 1
    backbone = {k.removeprefix("model."): v for k, v in resumed.critic.model.state_dict().items()}
    tuned = grpo.model.state_dict()
    # the critic starts from model_path (the initial policy), not from the checkpoint's trained policy
    assert not torch.equal(backbone["layers.0.mlp.up_proj.weight"], tuned["model.layers.0.mlp.up_proj.weight"])
    assert resumed.train_step(make_groups(2, 3)).metrics["critic_updates"] == 1.0
