"""Pipeline parallelism for the megatron backend: the stages of one pipeline run a micro-batch in turn.

Each stage holds consecutive layers (the first the embedding, the last the final norm and the output layer).
A micro-batch's forward goes stage after stage: each sends its hidden states (float32, megatron's ``[T, B,
H]``) to the next, point to point; the last computes the logits and the per-token log-probs (and entropy)
of the batch and broadcasts those, ``[B, T - 1]`` each, to the other stages of its pipeline. Every stage so
computes the same losses and metrics from the same values, as a tensor-parallel rank does, and the trainer's
step is the torch backend's on every stage. The backward runs the other way: the last stage's reaches its
input and sends that gradient back; each stage below receives the gradient of the hidden states it sent
(inside the backward of its own loss, whose gradient towards the broadcast log-probs it ignores) and goes on.

The stages take turns (no interleaving of micro-batches, no 1F1B schedule): a pipeline splits the model's
memory over its stages, not its time. megatron-core's own schedules interleave, but they hard-code CUDA;
this is plain ``torch.distributed`` (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tauflow.trainer.batch import PackedBatch, TokenLogProbs


class PipelineStage:
    """This rank's stage of its pipeline (megatron's ``parallel_state``), and the ranks around it."""

    def __init__(self, device: torch.device) -> None:
        from megatron.core import parallel_state

        self.size = int(parallel_state.get_pipeline_model_parallel_world_size())
        self.rank = int(parallel_state.get_pipeline_model_parallel_rank())
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks: list[int] = list(dist.get_process_group_ranks(self.group))  # global ranks, by stage
        self.device = device

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def leading(self) -> bool:
        """Whether this is the pipeline of global rank 0 (its first stage): the one a publish or a checkpoint
        gathers the stages of."""
        return self.ranks[0] == 0

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every stage's ``value``, by stage."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def collect(self, named: Mapping[Any, Any]) -> dict[Any, Any]:
        """Every stage's ``named`` (tensors, or small objects) on the first stage of the leading pipeline, the
        tensors in host memory, one at a time (a collective of the leading pipeline's stages; the others, and
        its stages but the first, get {})."""
        if not self.leading:
            return {}
        out: dict[Any, Any] = dict(named) if self.first else {}
        for source in range(1, self.size):
            shapes: list[Any] = [
                {
                    k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v)
                    for k, v in named.items()
                }
                if self.rank == source
                else None
            ]
            dist.broadcast_object_list(shapes, src=self.ranks[source], group=self.group)
            for key, (shape, what) in shapes[0].items():
                if shape == "object":
                    if self.first:
                        out[key] = what
                elif self.rank == source:
                    dist.send(named[key].detach().to(self.device).contiguous(), dst=self.ranks[0])
                elif self.first:
                    buffer = torch.empty(shape, dtype=what, device=self.device)
                    dist.recv(buffer, src=self.ranks[source])
                    out[key] = buffer.cpu()
        return out if self.first else {}


class _FromPreviousStage(torch.autograd.Function):
    """The hidden states the previous stage sent; the backward sends their gradient back."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stage: PipelineStage, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.stage = stage
        hidden = torch.empty(shape, dtype=torch.float32, device=stage.device)
        dist.recv(hidden, src=stage.ranks[stage.rank - 1])
        return hidden

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        dist.send(grad.float().contiguous(), dst=ctx.stage.ranks[ctx.stage.rank - 1])
        return None, None, None


class _ToNextStage(torch.autograd.Function):
    """Sends this stage's hidden states on and returns what the last stage broadcasts back (the log-probs,
    and the entropy); the backward receives the gradient of the hidden states from the next stage."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, stage: PipelineStage, shapes: Sequence[tuple[int, ...]], entropy_grad: bool
    ) -> tuple[torch.Tensor, ...]:
        ctx.stage, ctx.shape, ctx.dtype = stage, hidden.shape, hidden.dtype
        dist.send(hidden.detach().float().contiguous(), dst=stage.ranks[stage.rank + 1])
        outs = tuple(torch.empty(shape, dtype=torch.float32, device=stage.device) for shape in shapes)
        for out in outs:
            dist.broadcast(out, src=stage.ranks[-1], group=stage.group)
        if len(outs) > 1 and not entropy_grad:
            ctx.mark_non_differentiable(outs[1])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # (the gradients towards the broadcast values are the last stage's to follow: it has the graph)
        grad = torch.empty(ctx.shape, dtype=torch.float32, device=ctx.stage.device)
        dist.recv(grad, src=ctx.stage.ranks[ctx.stage.rank + 1])
        return grad.to(ctx.dtype), None, None, None


def pipeline_logprobs(model: Any, batch: PackedBatch, stage: PipelineStage, **options: Any) -> TokenLogProbs:
    """``completion_logprobs(model, batch, **options)`` under the pipeline ``model`` (a ``MegatronCausalLM``
    stage): every stage of the pipeline calls it with the same batch and gets the same values; the gradient
    flows back through every stage (the module's docstring)."""
    if options.get("with_distribution"):
        raise ValueError("the megatron backend's pipeline stages do not pass the whole distribution on")
    with_entropy = bool(options.get("with_entropy"))
    rows, length = batch.input_ids.shape
    hidden = None
    if not stage.first:
        anchor = torch.empty(0, device=stage.device, requires_grad=torch.is_grad_enabled())
        hidden = _FromPreviousStage.apply(anchor, stage, (length, rows, model.layout.hidden_size))
    out = model.batch_forward(batch, hidden)
    shapes = [(rows, length - 1)] * (2 if with_entropy else 1)
    if not stage.last:
        outs = _ToNextStage.apply(out, stage, shapes, bool(options.get("entropy_grad")))
        return TokenLogProbs(outs[0], outs[1] if with_entropy else None)
    lp = model.logprobs_of_output(out, batch, **options)  # (with tensor parallelism: from its vocabulary slice)
    for value in (lp.logprobs, lp.entropy) if with_entropy else (lp.logprobs,):
        assert value is not None
        dist.broadcast(value.detach().float().contiguous(), src=stage.ranks[-1], group=stage.group)
    return lp
