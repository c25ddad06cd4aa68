"""From trajectory groups to padded tensors, and per-token log-probs of the completions.

Layout of a packed batch of B samples, padded to T = max(len(prompt) + len(completion)) tokens:

    input_ids, attention_mask, position_ids   [B, T]
    loss_mask, behaviour_logprobs, advantages [B, T - 1]  aligned with the *targets* input_ids[:, 1:],
    (returns, old_values: with a critic)                  i.e. with logits[:, :-1]

Completion token j of a sample whose first real token sits at column o (o = 0 when right-padded, the
pad count when left-padded) is input column o + P + j and target column o + P + j - 1, P = len(prompt).
Position ids count real tokens only (cumsum of the attention mask - 1), so a sample gets the same
positions whatever its padding and logits do not depend on the batch it is in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from tauflow.core.staleness import staleness

PADDING_SIDES = ("right", "left")


@dataclass
class Sample:
    """One completion of a prompt with what the loss needs (mirrors tauflow.api.common.v1.Sample)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    """log pi_behaviour of each completion token (anything where loss_mask is false)."""
    loss_mask: list[bool] | None = None
    """Per completion token; None or empty means every completion token trains."""
    reward: float = 0.0
    versions: list[int] | None = None
    """Policy version that generated each completion token; None or empty: use behaviour_version."""
    behaviour_version: int | None = None
    sample_id: str = ""
    truncated: bool = False
    """The completion ended at the length limit (finish reason length), not by itself."""
    media: dict[str, torch.Tensor] | None = None
    """A multimodal model's encoder inputs for the prompt (tauflow.models.processor: pixel values, audio
    features, grids), shared by the group's samples; ``{}`` for a text prompt to such a model; None for a
    text model."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.prompt_ids) == 0:
            raise ValueError(
                f"sample {self.sample_id!r}: the prompt is empty (the first completion token "
                "needs a token to be predicted from)"
            )
        if len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.behaviour_logprobs)} behaviour log-probs "
                f"for {n} completion tokens"
            )
        if self.loss_mask and len(self.loss_mask) != n:
            raise ValueError(
                f"sample {self.sample_id!r}: loss_mask has {len(self.loss_mask)} entries for {n} completion tokens"
            )
        if self.versions and len(self.versions) != n:
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.versions)} token versions for {n} completion tokens"
            )

    @property
    def mask(self) -> list[bool]:
        """The effective loss mask (all ones when none was given)."""
        return [bool(x) for x in self.loss_mask] if self.loss_mask else [True] * len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)

    @property
    def oldest_version(self) -> int | None:
        """The behaviour version: the oldest version of any completion token, when known."""
        if self.versions:
            return min(self.versions)
        return self.behaviour_version

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class Group:
    """The samples of one prompt; the unit that is trained at most once (by ``group_id``)."""

    group_id: str
    samples: list[Sample] = field(default_factory=list)
    baseline_reward: float | None = None
    """The reward of the prompt's greedy completion, when the producer sent one (REMAX's baseline)."""
    prompt_parts: list[Any] = field(default_factory=list)
    """The prompt as typed parts (tauflow.media.PromptPart), for a multimodal model; empty for text."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"group {self.group_id!r} has no samples")

    @property
    def oldest_version(self) -> int | None:
        versions = [v for v in (s.oldest_version for s in self.samples) if v is not None]
        return min(versions) if versions else None

    def staleness(self, step: int) -> int:
        """``step − oldest behaviour version`` (0 when no version is known; never negative)."""
        return staleness(step, self.oldest_version)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    """The critic's targets (GAE returns), when the step trains a critic ..."""
    old_values: torch.Tensor | None = None
    """... and its values before the step's first update (the value clip's centre)."""
    media: dict[str, torch.Tensor] | None = None
    """The rows' encoder inputs, concatenated in row order, for a multimodal model (which then computes its
    own positions: Qwen's 3-D rope); None for a text model."""
    banned_ids: torch.Tensor | None = None
    """Token ids the sampler never draws (a multimodal model's media tokens): their logits are masked before
    the log-softmax, as the rollout engine masks them."""

    @property
    def num_tokens(self) -> int:
        """Tokens the loss trains on."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> PackedBatch:
        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.loss_mask.to(device),
            self.behaviour_logprobs.to(device),
            self.advantages.to(device),
            returns=moved(self.returns),
            old_values=moved(self.old_values),
            media=None if self.media is None else {k: v.to(device) for k, v in self.media.items()},
            banned_ids=moved(self.banned_ids),
        )

    def model_inputs(self, model: torch.nn.Module) -> dict[str, Any]:
        """The forward's arguments: ids, mask and positions; for a multimodal model the encoders' inputs
        under the names its forward takes, and no positions (it derives its 3-D ones from the mask)."""
        if self.media is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                    "position_ids": self.position_ids}  # fmt: skip
        from tauflow.models.processor import accepted_inputs

        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                **accepted_inputs(model, self.media, self.input_ids)}  # fmt: skip


def pack(
    samples: Sequence[Sample],
    advantages: Sequence[float | Sequence[float]] | None = None,
    *,
    pad_token_id: int = 0,
    padding_side: str = "right",
    returns: Sequence[Sequence[float]] | None = None,
    old_values: Sequence[Sequence[float]] | None = None,
    banned_ids: Sequence[int] = (),
) -> PackedBatch:
    """Pad ``samples`` into one batch. ``advantages`` (default 0) holds one per sample: a float, broadcast
    over the sample's completion tokens, or one value per completion token; ``returns`` and ``old_values``
    (the critic's), when given, one value per completion token."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, not {padding_side!r}")
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"{len(advantages)} advantages for {len(samples)} samples")
    batch, width = len(samples), max(len(s) for s in samples)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width - 1), dtype=torch.bool)
    behaviour = torch.zeros((batch, width - 1), dtype=torch.float32)
    adv = torch.zeros((batch, width - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        o = 0 if padding_side == "right" else width - p - c
        input_ids[i, o : o + p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        attention_mask[i, o : o + p + c] = 1
        if c == 0:
            continue
        t0 = o + p - 1  # target column of completion token 0
        loss_mask[i, t0 : t0 + c] = torch.tensor(s.mask, dtype=torch.bool)
        behaviour[i, t0 : t0 + c] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if advantages is not None:
            a = advantages[i]
            if isinstance(a, int | float):
                adv[i, t0 : t0 + c] = float(a)
            elif len(a) == c:
                adv[i, t0 : t0 + c] = torch.tensor([float(x) for x in a], dtype=torch.float32)
            else:
                raise ValueError(f"sample {s.sample_id!r}: {len(a)} advantages for {c} completion tokens")
    adv = torch.where(loss_mask, adv, torch.zeros_like(adv))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    media = None
    if any(s.media is not None for s in samples):
        keys = sorted({k for s in samples for k in (s.media or {})})
        media = {k: torch.cat([s.media[k] for s in samples if s.media and k in s.media]) for k in keys}
    return PackedBatch(
        input_ids,
        attention_mask,
        position_ids,
        loss_mask,
        behaviour,
        adv,
        returns=_per_target(returns, samples, "returns", width, padding_side),
        old_values=_per_target(old_values, samples, "old_values", width, padding_side),
        media=media,
        banned_ids=torch.tensor(list(banned_ids), dtype=torch.long) if banned_ids else None,
    )


def _per_target(
    values: Sequence[Sequence[float]] | None, samples: Sequence[Sample], name: str, width: int, padding_side: str
) -> torch.Tensor | None:
    """One value per completion token of each sample, placed at the tokens' target columns (0 elsewhere)."""
    if values is None:
        return None
    if len(values) != len(samples):
        raise ValueError(f"{len(values)} {name} for {len(samples)} samples")
    out = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for i, (s, v) in enumerate(zip(samples, values, strict=True)):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if len(v) != c:
            raise ValueError(f"sample {s.sample_id!r}: {len(v)} {name} for {c} completion tokens")
        o = 0 if padding_side == "right" else width - p - c
        if c:
            out[i, o + p - 1 : o + p - 1 + c] = torch.tensor([float(x) for x in v], dtype=torch.float32)
    return out


def unpack(values: torch.Tensor, samples: Sequence[Sample], *, padding_side: str = "right") -> list[list[float]]:
    """The inverse of `pack` for a ``[B, T - 1]`` per-target tensor: each sample's completion values."""
    width = values.shape[1] + 1
    out: list[list[float]] = []
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        o = 0 if padding_side == "right" else width - p - c
        out.append(values[i, o + p - 1 : o + p - 1 + c].tolist())
    return out


def split_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of micro-batches whose padded size (rows × longest row) stays within ``budget`` tokens;
    a row longer than the budget goes alone. Rows are taken longest first (less padding), ties in order."""
    if budget <= 0:
        raise ValueError(f"token budget must be positive, not {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        widest = lengths[current[0]] if current else lengths[i]  # longest first: the first row is widest
        if current and (len(current) + 1) * widest > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass
class TokenLogProbs:
    logprobs: torch.Tensor
    """``[B, T - 1]`` float32: log p(input_ids[:, t + 1] | input_ids[:, :t + 1])."""
    entropy: torch.Tensor | None = None
    """``[B, T - 1]`` float32 entropy of the predicted distribution, when asked for (with grad only when
    asked for too: the entropy bonus)."""
    distribution: torch.Tensor | None = None
    """``[B, T - 1, V]`` float32 log-probs of the whole vocabulary at every target position, when asked for
    (distillation by the full reverse KL)."""


BANNED_LOGIT = -1e30
"""A banned token's logit: its probability 0 (``exp`` underflows), yet finite, so that a probability of 0 times
its log stays 0 (entropy, KL), and far from float32's lowest, so that sums with it stay finite."""


def completion_logprobs(
    model: torch.nn.Module, batch: PackedBatch, *, logits_chunk_tokens: int = 0, **options: Any
) -> TokenLogProbs:
    """:func:`logprobs_of_logits` of the logits ``model`` (a causal LM) computes for ``batch``.

    ``logits_chunk_tokens`` > 0: the same values without ever holding the ``[B, T, V]`` logits (see
    :func:`chunked_completion_logprobs`); the whole distribution, when asked for, needs them all."""
    if logits_chunk_tokens > 0 and not options.get("with_distribution"):
        options.pop("with_distribution", None)
        options.pop("distribution_vocab", None)
        return chunked_completion_logprobs(model, batch, logits_chunk_tokens, **options)
    out = model(**batch.model_inputs(model), use_cache=False)
    return logprobs_of_logits(out.logits, batch, **options)


def chunked_completion_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    chunk_tokens: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> TokenLogProbs:
    """:func:`completion_logprobs` with the output layer run ``chunk_tokens`` target positions at a time.

    The logits of a micro-batch are its largest tensors: float32 ``[B, T, V]`` several times over (the cast,
    the temperature, the softmax the entropy needs), 0.6 MB a token each for a 150k vocabulary. Here the
    model's output layer is swapped, for this forward only, for one that computes each chunk's per-token
    log-prob and entropy from its hidden states and keeps nothing else (:func:`values_in_chunks`). The values
    are those of :func:`logprobs_of_logits`. A model whose forward changes its output layer's logits (a soft
    cap, a scale) is refused: what it returns must be what the layer returned."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    inner: Any = getattr(model, "module", model)  # (DistributedDataParallel wraps the model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(inner).__name__} has no output embeddings to compute the logits in chunks")
    logits_of = head.forward  # (whatever is in effect: an instance's own forward, e.g. accelerate's hooks)

    def chunk_values(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        scaled = scaled_logits(logits_of(hidden), temperature, batch.banned_ids)
        return token_values(scaled, targets, batch.banned_ids, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def per_token_head(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:2] != batch.input_ids.shape:
            raise ValueError(f"the output layer got hidden states {tuple(hidden.shape)} for a batch of "
                             f"{tuple(batch.input_ids.shape)} tokens")  # fmt: skip
        values = values_in_chunks(hidden[:, :-1], batch.input_ids[:, 1:], chunk_tokens, chunk_values, with_entropy)
        return torch.nn.functional.pad(values, (0, 0, 0, 1))  # [B, T, 1 or 2]: the last position predicts nothing

    with output_layer_swapped(head, per_token_head) as returned:
        out = model(**batch.model_inputs(model), use_cache=False)
    if len(returned) != 1 or out.logits is not returned[0]:
        raise ValueError(
            f"{type(inner).__name__} changes its output layer's logits (or calls it more than once): "
            "backend.logits_chunk_tokens cannot compute its log-probs in chunks (set it to 0)"
        )
    return token_logprobs_of_values(out.logits[:, :-1], entropy_grad)


@contextlib.contextmanager
def output_layer_swapped(layer: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[list[Any]]:
    """``layer`` computing ``forward`` instead of its own for the block; yields the list of what it returned."""
    returned: list[Any] = []
    own = layer.__dict__.get("forward")
    layer.forward = forward
    hook = layer.register_forward_hook(lambda module, args, output: returned.append(output))
    try:
        yield returned
    finally:
        hook.remove()
        if own is None:
            del layer.forward
        else:
            layer.forward = own


def token_logprobs_of_values(values: torch.Tensor, entropy_grad: bool) -> TokenLogProbs:
    """The log-probs (and entropy, when there) of ``values``, ``[B, T - 1, 1 or 2]`` from :func:`values_in_chunks`;
    the entropy detached unless it has a gradient to carry, as :func:`logprobs_of_logits` computes it."""
    entropy = values[..., 1] if values.shape[-1] > 1 else None
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return TokenLogProbs(values[..., 0], entropy)


ChunkValues = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""``(hidden [N, H], targets [N]) -> (log-probs [N], entropy [N] or None)``: one chunk's values."""


def values_in_chunks(
    hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, chunk_values: ChunkValues, with_entropy: bool
) -> torch.Tensor:
    """``chunk_values`` of ``hidden`` (``[..., H]``, the states that predict ``targets``, ``[...]``) ``chunk_tokens``
    positions at a time: ``[..., 1]`` log-probs, or ``[..., 2]`` with the entropy. With grad each chunk runs
    under activation checkpointing (its logits computed again in its backward), so no more than one chunk's
    logits are ever held, at the cost of the output layer's matmul once more."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    columns: list[list[torch.Tensor]] = [[], []]
    for start in range(0, flat.shape[0], chunk_tokens):
        part = (flat[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens])
        if torch.is_grad_enabled():
            lp, entropy = torch.utils.checkpoint.checkpoint(chunk_values, *part, use_reentrant=False)
        else:
            lp, entropy = chunk_values(*part)
        columns[0].append(lp)
        if with_entropy:
            assert entropy is not None
            columns[1].append(entropy)
    return torch.stack([torch.cat(c).view(targets.shape) for c in columns if c], dim=-1)


def scaled_logits(logits: torch.Tensor, temperature: float, banned_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` as the sampler saw them: float32, divided by the temperature, the banned tokens' at
    :data:`BANNED_LOGIT`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if banned_ids is not None:
        logits = logits.index_fill(-1, banned_ids, BANNED_LOGIT)
    return logits


def token_values(
    scaled: torch.Tensor,
    targets: torch.Tensor,
    banned_ids: torch.Tensor | None,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob of each of ``targets`` (``[...]``) under ``scaled`` (``[..., V]``, :func:`scaled_logits`), and
    the entropy when asked for (with grad only when asked for too)."""
    logsumexp = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp
    entropy = None
    if with_entropy:
        with torch.enable_grad() if entropy_grad else torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            entropy = logsumexp - without_banned(probs * scaled, banned_ids).sum(-1)
    return logprobs, entropy


def logprobs_of_logits(
    logits: torch.Tensor,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    with_distribution: bool = False,
    distribution_vocab: int | None = None,
) -> TokenLogProbs:
    """Per-token log-probs of every target token of ``batch`` under the causal LM whose ``[B, T, V]`` ``logits``
    these are: float32 ``log_softmax`` of ``logits[:, :-1] / temperature`` gathered at ``input_ids[:, 1:]``. Use the sampler's temperature so
    that these match the behaviour log-probs the rollout engine reported. ``with_distribution``: the whole
    log-softmax too (with grad where grad is enabled), over the first ``distribution_vocab`` rows of the
    vocabulary when given (a teacher and a student that pad their vocabularies differently)."""
    scaled = scaled_logits(logits[:, :-1], temperature, batch.banned_ids)
    logprobs, entropy = token_values(
        scaled, batch.input_ids[:, 1:], batch.banned_ids, with_entropy=with_entropy, entropy_grad=entropy_grad
    )
    distribution = None
    if with_distribution:
        shared = scaled if distribution_vocab is None else scaled[..., :distribution_vocab]
        distribution = torch.log_softmax(shared, dim=-1)
    return TokenLogProbs(logprobs, entropy, distribution)


def without_banned(terms: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """``terms`` (one per vocabulary entry) with the banned entries' 0: so that no gradient, however large,
    meets a banned token's logit (0 times it is 0, a large gradient times it would overflow)."""
    return terms if banned is None or not banned.numel() else terms.index_fill(-1, banned, 0.0)


def completion_values(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """A critic's value of each target token's state: ``[B, T - 1]`` float32, the value the model (a token
    classifier with one label: ``AutoModelForTokenClassification``, verl's critic) gives at the position
    whose logits predict that token, i.e. V(s_t), s_t the prompt and the completion before token t."""
    if batch.media is not None:
        raise NotImplementedError("a critic for a multimodal policy is not supported yet (docs/omni.md)")
    out = model(**batch.model_inputs(model), use_cache=False)
    return out.logits[:, :-1, 0].float()
