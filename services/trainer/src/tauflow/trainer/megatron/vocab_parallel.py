"""Per-token log-probs and entropy from vocabulary-parallel logits, never gathered.

With tensor parallelism each rank's output layer computes the logits of its slice of the vocabulary, ``[B, T,
V / TP]``. Gathering them puts the whole ``[B, T, V]`` on every rank (for a 150k vocabulary, 0.6 MB a token in
float32); here each rank keeps its slice and the ranks exchange per-token sums instead (megatron's
vocabulary-parallel cross-entropy, with the temperature, banned tokens and the entropy the losses need): the
maximum (no gradient), the sum of exponentials, the target token's logit and the entropy's ``sum p * logit``,
each an all-reduce over the tensor-parallel group whose backward is the identity (every rank computes the
same loss from the same sums, so each slice's gradient is the loss's gradient through its own terms); the
log-normaliser every rank's probabilities share takes the sum of the ranks' gradients through them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tauflow.trainer.batch import BANNED_LOGIT, PackedBatch, TokenLogProbs, without_banned


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    batch: PackedBatch,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> TokenLogProbs:
    """``logprobs_of_logits`` of the whole vocabulary's logits, from this rank's slice of them (``logits``: ``[B,
    T, V / TP]``, the vocabulary from ``vocab_start``): a collective of the tensor-parallel group."""
    logprobs, entropy = vocab_parallel_token_values(
        logits[:, :-1],
        batch.input_ids[:, 1:],
        batch.banned_ids,
        vocab_start=vocab_start,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    return TokenLogProbs(logprobs, entropy)


def vocab_parallel_token_values(
    logits: torch.Tensor,
    targets: torch.Tensor,
    banned_ids: torch.Tensor | None,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``batch.token_values`` of the whole vocabulary's logits at each of ``targets`` (``[...]``), from this rank's
    slice of them (``logits``: ``[..., V / TP]``, the vocabulary from ``vocab_start``; not yet scaled): a
    collective of the tensor-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as shared
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as summed

    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    local = logits.float()
    if temperature != 1.0:
        local = local / temperature
    width = local.shape[-1]
    banned = None  # this slice's banned entries
    if banned_ids is not None:
        ids = banned_ids
        banned = ids[(ids >= vocab_start) & (ids < vocab_start + width)] - vocab_start
        if banned.numel():
            local = local.index_fill(-1, banned, BANNED_LOGIT)
    top = local.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    logsumexp = summed((local - top.unsqueeze(-1)).exp().sum(dim=-1)).log() + top
    here = (targets >= vocab_start) & (targets < vocab_start + width)
    picked = local.gather(-1, (targets - vocab_start).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    logprobs = summed(torch.where(here, picked, torch.zeros_like(picked))) - logsumexp
    entropy = None
    if with_entropy:
        with torch.enable_grad() if entropy_grad else torch.no_grad():
            # (each rank's probabilities depend on the log-normaliser every rank shares: its gradient through
            # them is summed over the ranks, as megatron's column-parallel layers sum their input's)
            probs = (local - shared(logsumexp).unsqueeze(-1)).exp()
            entropy = logsumexp - summed(without_banned(probs * local, banned).sum(dim=-1))
    return logprobs, entropy
