"""The optimizer: AdamW with gradient-norm clipping, and its learning-rate schedule (stepped once per version)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tauflow.models.offload import hand_back, sharded_local, storage_to_device, storage_to_host, tensor_to_host

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with gradient-norm clipping and a learning-rate schedule (stepped once per version)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """Applied to matrices only (ndim >= 2), not to biases and norm weights."""
    grad_clip: float | None = 1.0
    """Max global L2 norm of the gradient; None: no clipping (the norm is still reported)."""
    schedule: str = "constant"
    """constant (after warmup) or cosine (after warmup, down to min_lr_ratio * lr at total_steps)."""
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if self.schedule == "cosine" and not self.total_steps:
            raise ValueError("the cosine schedule needs total_steps")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1")


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of ``lr`` for the optimizer step with index ``step`` (0-based)."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    assert config.total_steps is not None
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, max(0.0, (step - config.warmup_steps) / span))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], config: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable ``parameters`` (weight decay on matrices only) and its LambdaLR schedule."""
    params = [p for p in parameters if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)

    def factor(step: int) -> float:
        return lr_factor(step, config)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_optim_config(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, config: OptimConfig
) -> dict[str, list[Any]]:
    """Puts ``config``'s lr, betas, eps and weight decay on an optimizer and schedule just loaded from a
    checkpoint (whose saved state brings the old ones back: a resume with a new lr trained at the old one,
    silently, while a new warmup or schedule was taken); the moments and the step count stay the
    checkpoint's. Returns each setting that changed: {name: [checkpoint's, config's]}."""
    groups = optimizer.param_groups
    before = {"lr": scheduler.base_lrs[0], "betas": list(groups[0]["betas"]), "eps": groups[0]["eps"],
              "weight_decay": groups[0]["weight_decay"]}  # fmt: skip
    decays = [config.weight_decay, *([0.0] * (len(groups) - 1))]  # (build_optimizer: matrices, then the rest)
    scheduler.base_lrs = [config.lr] * len(groups)
    now = config.lr * lr_factor(scheduler.last_epoch, config)  # (the step the schedule has reached)
    for group, decay in zip(groups, decays, strict=True):
        group.update(initial_lr=config.lr, lr=now, betas=tuple(config.betas), eps=config.eps, weight_decay=decay)
    scheduler._last_lr = [now] * len(groups)  # (get_last_lr)
    after = {"lr": config.lr, "betas": list(config.betas), "eps": config.eps, "weight_decay": config.weight_decay}
    return {key: [before[key], after[key]] for key in after if before[key] != after[key]}


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float | None,
    scaler: torch.amp.GradScaler | None = None,
    norm_of: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None,
    scaled: bool = True,
) -> dict[str, float]:
    """One optimizer update of ``model``'s accumulated gradients: clip their global norm, step, clear them.
    A non-finite norm skips the update (``skipped_nonfinite_grad`` = 1). Under FSDP2 the norm is that of
    the whole gradient over every rank's shard, so every rank decides alike; ``norm_of`` (the parameters ->
    their gradient's norm) computes it where torch cannot see the shards (megatron's tensor parallelism).
    With fp16's ``scaler`` the gradients (of a scaled loss) are unscaled first, and the scale adapts: halved
    after an overflow, grown after a run of good steps (torch.amp.GradScaler). ``scaled`` False: the gradients
    are zeros standing in for an update that ran no backward: nothing to unscale, and the scale stays."""
    params = [p for p in model.parameters() if p.grad is not None]
    reported = scaler
    if not params or not scaled:
        # (no gradient at all: nothing to unscale, and the scale neither grows nor shrinks on it; AdamW leaves
        # the weights alone. The backend gives the policy zeros instead where its update ran no backward.)
        scaler = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = grad_clip if grad_clip is not None else math.inf
    grad_norm = 0.0
    if norm_of is not None:  # (a collective where the ranks hold parts: every rank computes it, gradients or not)
        total = norm_of(params)
        if math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        grad_norm = float(total)
    elif params:
        norm: Any = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        grad_norm = float(full_tensor() if full_tensor is not None else norm)
    skipped = 0.0
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        skipped = 1.0
    optimizer.zero_grad(set_to_none=True)
    out = {"grad_norm": grad_norm, "skipped_nonfinite_grad": skipped}
    if scaler is not None:
        scaler.update()
    if reported is not None:
        out["loss_scale"] = float(reported.get_scale())
    return out


class OptimizerOffload:
    """The optimizer's state in host memory between updates: colocated mode (docs/gpu.md), where the engine
    generates on the same GPU while the trainer waits for its batch. AdamW keeps two float32 moments per
    parameter, twice the float32 weights: the largest part of a trainer's memory that the engine can use.

    ``to_host`` after an update copies every state tensor into a host buffer of its own (pinned for a GPU;
    kept, so later updates allocate nothing) and frees the device copy; ``to_device`` before the next update
    copies them back to their parameter's device. A plain state tensor is replaced by its host copy, so a
    checkpoint saved meanwhile reads the same values; a sharded one (FSDP2's DTensor) is emptied in place
    and must be brought back before anything reads it (:meth:`resident`). On a CPU the "host" is the
    device: nothing is saved there, but the copies run both ways, which is what lets CPU tests check it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id of the parameter, state key) -> buffer
        self._emptied: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a sharded state's local shard, its bytes)
        self.offloaded_bytes = 0

    def to_host(self) -> int:
        """Moves the device-resident state to host memory; the bytes moved."""
        moved = 0
        gpus: set[torch.device] = set()
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                # (not a host scalar such as AdamW's step count, nor what is in host memory already)
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.device != param.device:
                    continue
                if value is self._host.get((id(param), key)):
                    continue
                local = sharded_local(value)
                if local is not None:
                    if local.untyped_storage().nbytes() == 0:
                        continue  # (emptied already)
                    host = self._host[(id(param), key)] = storage_to_host(local, self._host.get((id(param), key)))
                    self._emptied.append((local, host))
                else:
                    host = self._host[(id(param), key)] = tensor_to_host(value, self._host.get((id(param), key)))
                    state[key] = host
                moved += host.numel() * host.element_size()
                if value.is_cuda:
                    gpus.add(value.device)
        hand_back(gpus)
        self.offloaded_bytes += moved
        return moved

    def to_device(self) -> None:
        """Moves the offloaded state back to each parameter's device, before an update."""
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and self._host.get((id(param), key)) is value:
                    # a copy on a CPU too (not the buffer itself), so that CPU tests see what a GPU does
                    state[key] = value.to(param.device, non_blocking=True, copy=True)
        for local, host in self._emptied:
            storage_to_device(local, host)
        self._emptied.clear()
        self.offloaded_bytes = 0

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The state on its devices for a while (a checkpoint gathering it), then back in host memory if it
        was there."""
        if not self.offloaded_bytes:
            yield
            return
        self.to_device()
        try:
            yield
        finally:
            self.to_host()
