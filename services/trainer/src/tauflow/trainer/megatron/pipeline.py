"""Pipeline parallelism for the megatron backend: the stages of one pipeline run a window of micro-batches.

Each stage holds consecutive layers (the first the embedding, the last the final norm and the output layer).
A micro-batch's forward goes stage after stage: each sends its hidden states (float32, megatron's ``[T, B,
H]``) to the next, point to point; the last computes the logits and the per-token log-probs (and entropy)
of the batch and broadcasts those, ``[B, T - 1]`` each, to the other stages of its pipeline. Every stage so
computes the same losses and metrics from the same values, as a tensor-parallel rank does, and the trainer's
step is the torch backend's on every stage. The backward runs the other way: the last stage's reaches its
input and sends that gradient back; each stage below receives the gradient of the hidden states it sent
(inside the backward of its own loss, whose gradient towards the broadcast log-probs it ignores) and goes on.

The schedule: a window of micro-batches at a time (``pipeline_micro_batches_in_flight``, by default as many
as there are stages), GPipe within it. Every stage runs the forward of each micro-batch of the window as soon
as the one below has sent it, so while stage s works on micro-batch k, stage s - 1 works on k + 1; then the
last stage broadcasts the window's log-probs, and the backwards run micro-batch after micro-batch, stage
s + 1 on k + 1 while stage s is on k. A window of W micro-batches on P stages takes W + P - 1 stage-times
instead of W P; it holds the activations of W micro-batches (1F1B's bound is P: a window of P holds as many).
A window of 1 is the stages taking turns. megatron-core's own schedules hard-code CUDA; this is plain
``torch.distributed`` (gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tauflow.trainer.batch import PackedBatch, TokenLogProbs


class PipelineStage:
    """This rank's stage (``rank``) of its pipeline (the process ``group`` of its stages), and the ranks around
    it."""

    def __init__(self, rank: int, group: Any, device: torch.device) -> None:
        self.group = group
        self.ranks: list[int] = list(dist.get_process_group_ranks(group))  # global ranks, by stage
        self.size = len(self.ranks)
        self.rank = rank
        self.device = device

    @classmethod
    def of_megatron(cls, device: torch.device) -> PipelineStage:
        """This rank's stage as megatron's ``parallel_state`` places it."""
        from megatron.core import parallel_state

        rank = int(parallel_state.get_pipeline_model_parallel_rank())
        return cls(rank, parallel_state.get_pipeline_model_parallel_group(), device)

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
    """Sends this stage's hidden states on and returns buffers for what the last stage broadcasts back once
    the window's forwards are done (the log-probs, and the entropy: ``_broadcast_window`` fills them); the
    backward receives the gradient of the hidden states from the next stage."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, stage: PipelineStage, shapes: Sequence[tuple[int, ...]], entropy_grad: bool
    ) -> tuple[torch.Tensor, ...]:
        ctx.stage, ctx.shape, ctx.dtype = stage, hidden.shape, hidden.dtype
        dist.send(hidden.detach().float().contiguous(), dst=stage.ranks[stage.rank + 1])
        outs = tuple(torch.empty(shape, dtype=torch.float32, device=stage.device) for shape in shapes)
        if len(outs) > 1 and not entropy_grad:
            ctx.mark_non_differentiable(outs[1])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # (the gradients towards the broadcast values are the last stage's to follow: it has the graph)
        grad = torch.empty(ctx.shape, dtype=torch.float32, device=ctx.stage.device)
        dist.recv(grad, src=ctx.stage.ranks[ctx.stage.rank + 1])
        return grad.to(ctx.dtype), None, None, None


def pipeline_logprobs(
    model: Any, batches: Sequence[PackedBatch], stage: PipelineStage, **options: Any
) -> list[TokenLogProbs]:
    """``completion_logprobs(model, batch, **options)`` of each of a window of ``batches`` under the pipeline
    ``model`` (a ``MegatronCausalLM`` stage): every stage of the pipeline calls it with the same batches and
    gets the same values; the backwards of their losses, taken in the batches' order on every stage, flow
    back through every stage (the module's docstring)."""
    if options.get("with_distribution"):
        raise ValueError("the megatron backend's pipeline stages do not pass the whole distribution on")
    with_entropy = bool(options.get("with_entropy"))
    out: list[TokenLogProbs] = []
    for batch in batches:  # the forwards: each as soon as the stage below has sent it
        rows, length = batch.input_ids.shape
        hidden = None
        if not stage.first:
            anchor = torch.empty(0, device=stage.device, requires_grad=torch.is_grad_enabled())
            hidden = _FromPreviousStage.apply(anchor, stage, (length, rows, model.layout.hidden_size))
        if stage.last:  # (with tensor parallelism: from its vocabulary slice)
            out.append(model.batch_logprobs(batch, hidden, **options))
        else:
            shapes = [(rows, length - 1)] * (2 if with_entropy else 1)
            output = model.batch_forward(batch, hidden)
            outs = _ToNextStage.apply(output, stage, shapes, bool(options.get("entropy_grad")))
            out.append(TokenLogProbs(outs[0], outs[1] if with_entropy else None))
    _broadcast_window(out, stage, with_entropy)
    return out


def _broadcast_window(values: Sequence[TokenLogProbs], stage: PipelineStage, with_entropy: bool) -> None:
    """The last stage's log-probs (and entropy) of each micro-batch of the window to the other stages, into
    the buffers their ``_ToNextStage`` returned (written through a detached view: the graph is the last
    stage's, and nothing has used them yet)."""
    for lp in values:
        for value in (lp.logprobs, lp.entropy) if with_entropy else (lp.logprobs,):
            assert value is not None
            tensor = value.detach()
            if stage.last:
                tensor = tensor.float().contiguous()
            dist.broadcast(tensor, src=stage.ranks[-1], group=stage.group)
