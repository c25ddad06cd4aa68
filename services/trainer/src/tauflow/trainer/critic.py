"""The critic of PPO with GAE (estimator ``gae``): a value model that lives in the trainer process beside
the policy (verl's and OpenRLHF's "hybrid" layout), trained by its own optimizer on the clipped value loss
(losses.value_loss), checkpointed with the policy and sharded like it across the trainer's ranks.

The critic is a token classifier with one label (``AutoModelForTokenClassification``, as verl's critic):
the backbone of a causal LM folder (the policy's by default) with a linear value head, new when the folder
holds a causal LM, restored when it holds a critic that a checkpoint saved (``<checkpoint>/critic``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tauflow.trainer.batch import PackedBatch, completion_values
from tauflow.trainer.optim import OptimConfig, build_optimizer, clip_and_step
from tauflow.trainer.parallel import RankGroup

CRITIC_FOLDER = "critic"
"""Where a checkpoint keeps the critic's weights (``save_pretrained``), beside the policy's."""


class Critic:
    """The value model, what forward runs on (sharded or wrapped across the ranks), its optimizer and its
    learning-rate schedule (stepped once per step, as the policy's)."""

    def __init__(
        self,
        path: Path,
        *,
        device: torch.device,
        optim: OptimConfig,
        group: RankGroup | None = None,
        gradient_checkpointing: bool = False,
        seed: int = 0,
    ) -> None:
        from transformers import AutoConfig, AutoModelForTokenClassification

        # one value per position; no dropout before the head (a token classifier's default is 0.1): the
        # values before the step and in its updates must come from the same function
        model_config = AutoConfig.from_pretrained(path, num_labels=1)
        model_config.classifier_dropout = 0.0
        # a new value head drawn from ``seed`` alone: the same head whatever ran before (another parallel layout,
        # another order of loading), so that runs of one seed start from one critic
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForTokenClassification.from_pretrained(path, config=model_config)
        model.to(device=device, dtype=torch.float32)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        self.model: Any = model
        self.optim = optim
        if group is not None:
            group.overwrite_with_leaders(model.state_dict().values())  # before it is sharded or wrapped
        self.forward_model = group.wrap(model) if group is not None else model
        self.optimizer, self.scheduler = build_optimizer(model.parameters(), optim)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def values(self, batch: PackedBatch) -> torch.Tensor:
        """V(s_t) of every target token of ``batch`` (``[B, T - 1]``; with grad where grad is enabled)."""
        return completion_values(self.forward_model, batch)

    def update(self) -> dict[str, float]:
        """One optimizer update of the critic's accumulated gradients (clipped as the policy's)."""
        out = clip_and_step(self.model, self.optimizer, self.optim.grad_clip)
        return {"critic_grad_norm": out["grad_norm"], "critic_skipped_nonfinite_grad": out["skipped_nonfinite_grad"]}

    def save(self, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The critic's weights as ``folder/critic`` (``from_pretrained`` loads them; None: the model's own
        state, else the gathered one)."""
        self.model.save_pretrained(folder / CRITIC_FOLDER, state_dict=state_dict)


def critic_source(checkpoint: Path | None, configured: str | None, policy: str) -> Path:
    """Where the critic starts from: the checkpoint's critic when it has one, else ``configured``
    (backend.critic_model_path), else the policy's model folder (a new value head on its backbone)."""
    if checkpoint is not None and (checkpoint / CRITIC_FOLDER / "config.json").is_file():
        return checkpoint / CRITIC_FOLDER
    return Path(configured or policy)
