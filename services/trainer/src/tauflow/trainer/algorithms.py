"""The algorithm registry: (advantage estimator, policy loss) pairs, and the losses themselves.

Everything here works on plain tensors of shape ``[B, T]`` (B sequences, T target positions) with a
boolean mask of the tokens the loss trains on, so it is independent of the model and of batching.
The formulas are written out in ``services/trainer/README.md``.

Normalisation is global: a step may run as several micro-batches (gradient accumulation), so every
loss divides by a `Normaliser` computed once for the whole step, and the micro-batch losses add up to
the loss of the step as if it had run in one piece.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sample-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("truncate", "mask")
_MAX_LOG_RATIO = 20.0  # |log ratio| beyond this is clamped inside exp() so a KL estimate stays finite


@dataclass(frozen=True)
class AlgorithmConfig:
    """Knobs of the advantage estimator and the policy loss."""

    # Advantages.
    norm_adv_by_std: bool = True
    """GRPO: (r - mean) / (std + eps). False: r - mean only (Dr. GRPO)."""
    adv_eps: float = 1e-6
    skip_zero_advantage_groups: bool = True
    """Groups whose rewards are all identical have zero advantage; skip their forward/backward."""

    # Policy loss (PPO-clip against the proximal policy, decoupled from the behaviour policy).
    clip_low: float = 0.2
    """The ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    is_cap: float | None = 2.0
    """Cap of the importance weight pi_prox / pi_behaviour; None disables the correction (w = 1)."""
    is_mode: str = "truncate"
    """truncate: w = min(w, cap). mask: tokens with w > cap contribute nothing (they still count in the
    normaliser)."""
    aggregation: str = "token-mean"
    """How per-token losses become one number: one of AGGREGATIONS."""

    # KL penalty to the reference model (in the loss, GRPO-style).
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, not {self.kl_estimator!r}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode must be one of {IS_MODES}, not {self.is_mode!r}")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be positive or None, not {self.is_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, not {self.kl_coef}")
        if self.adv_eps < 0:
            raise ValueError(f"adv_eps must be >= 0, not {self.adv_eps}")

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0


# --------------------------------------------------------------------------------------------------
# Advantages


@dataclass(frozen=True)
class GroupAdvantages:
    """One advantage per sample, per group, and which groups carry no signal."""

    values: list[list[float]]
    zero_groups: list[bool]
    """True where every reward of the group was identical (so every advantage is exactly 0)."""

    @property
    def num_zero_groups(self) -> int:
        return sum(self.zero_groups)


def grpo_advantages(rewards: Sequence[Sequence[float]], config: AlgorithmConfig) -> GroupAdvantages:
    """Group-normalised advantages: A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction
    (as TRL and verl do); without ``norm_adv_by_std``, A_i = r_i - mean(r). A group of one sample, or one
    whose rewards are all equal, gets exactly 0."""
    values: list[list[float]] = []
    zero: list[bool] = []
    for group in rewards:
        if len(group) == 0:
            raise ValueError("a group has no samples")
        r = torch.tensor([float(x) for x in group], dtype=torch.float64)
        if not torch.isfinite(r).all():
            raise ValueError(f"rewards must be finite, got {list(group)}")
        if len(group) == 1 or bool((r == r[0]).all()):
            values.append([0.0] * len(group))
            zero.append(True)
            continue
        a = r - r.mean()
        if config.norm_adv_by_std:
            a = a / (r.std(unbiased=True) + config.adv_eps)
        values.append(a.tolist())
        zero.append(False)
    return GroupAdvantages(values, zero)


# --------------------------------------------------------------------------------------------------
# Aggregation


@dataclass(frozen=True)
class Normaliser:
    """Denominators of the aggregation modes, fixed for a whole step (all its micro-batches)."""

    tokens: float
    """Tokens the loss trains on."""
    sequences: float
    """Sequences with at least one trained token."""
    samples: float
    """Samples the step consumed, including those of skipped zero-advantage groups."""

    @classmethod
    def of(cls, mask: torch.Tensor, samples: int | None = None) -> Normaliser:
        """The normaliser of a batch that runs in one piece (``samples`` defaults to its rows)."""
        m = mask.bool()
        return cls(
            tokens=float(m.sum()),
            sequences=float((m.sum(-1) > 0).sum()),
            samples=float(m.shape[0] if samples is None else samples),
        )


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normaliser) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token values over the tokens where ``mask`` is true.

    token-mean:          sum_{i,t} x_it / N_tokens
    seq-mean-token-mean: sum_i (sum_t x_it / n_i) / N_sequences
    seq-mean-token-sum:  sum_{i,t} x_it / N_sequences
    sample-sum:          sum_{i,t} x_it / N_samples
    """
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros_like(per_token))  # never NaN * 0
    if mode == "token-mean":
        return x.sum() / max(norm.tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(-1) / m.sum(-1).clamp(min=1).to(x.dtype)
        return per_seq.sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return x.sum() / max(norm.sequences, 1.0)
    if mode == "sample-sum":
        return x.sum() / max(norm.samples, 1.0)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {mode!r}")


# --------------------------------------------------------------------------------------------------
# Losses


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), with
    log_ratio = log pi_ref - log pi:  k1 = -log_ratio,  k2 = log_ratio^2 / 2,
    k3 = exp(log_ratio) - log_ratio - 1 (unbiased and >= 0)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, not {estimator!r}")


@dataclass
class LossInputs:
    """Per-token tensors, all ``[B, T]`` and aligned with the target tokens."""

    logp: torch.Tensor
    """log pi_theta of each target token (with grad)."""
    behaviour_logp: torch.Tensor
    """log pi_behaviour: what the sampler reported."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """True where the loss trains."""
    prox_logp: torch.Tensor | None = None
    """log pi_prox, the proximal policy of decoupled PPO; None means logp.detach() (one update per batch)."""
    ref_logp: torch.Tensor | None = None
    """log pi_ref, needed when the config has kl_coef > 0."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of pi_theta, for the metrics only."""


@dataclass
class LossOutput:
    """The loss to backpropagate, and additive statistics (sums over tokens; see `summarize`)."""

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)


def _masked_sum(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(torch.where(m, x.detach().float(), torch.zeros((), dtype=torch.float32, device=x.device)).sum())


def decoupled_ppo_loss(inputs: LossInputs, config: AlgorithmConfig, norm: Normaliser) -> LossOutput:
    """PPO-clip against the proximal policy, weighted by a truncated importance weight that corrects for
    the behaviour policy (decoupled PPO, as in AReaL), plus an optional KL penalty to the reference:

        r   = exp(logp - prox_logp)
        w   = min(exp(prox_logp - behaviour_logp), is_cap)        (detached; 1 when is_cap is None)
        l_t = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)  +  kl_coef * KL_t
        loss = aggregate(l, mask)
    """
    m = inputs.mask.bool()
    logp = inputs.logp
    prox = logp.detach() if inputs.prox_logp is None else inputs.prox_logp.detach()
    adv = torch.where(m, inputs.advantages.to(logp.dtype), torch.zeros_like(logp))

    ratio = torch.exp(logp - prox)
    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    pg = -torch.minimum(surr, surr_clipped)
    clipped = (surr_clipped < surr) & m  # the clipped branch is the one taken (its gradient is 0)

    # Outside the mask the behaviour log-prob is arbitrary (0 on the wire, maybe NaN): take w = 1 there so
    # that nothing non-finite can reach the gradient through the product below.
    behaviour = torch.where(m, inputs.behaviour_logp.detach().to(logp.dtype), prox)
    raw_w = torch.exp((prox - behaviour).clamp(max=_MAX_LOG_RATIO))
    if config.is_cap is None:
        w = torch.ones_like(raw_w)
        truncated = torch.zeros_like(m)
    else:
        truncated = (raw_w > config.is_cap) & m
        if config.is_mode == "truncate":
            w = raw_w.clamp(max=config.is_cap)
        else:  # mask: the token contributes 0 but stays in every denominator
            w = torch.where(truncated, torch.zeros_like(raw_w), raw_w)
    per_token = w * pg
    pg_loss = aggregate(per_token, m, config.aggregation, norm)
    loss = pg_loss

    sums: dict[str, float] = {
        "tokens": float(m.sum()),
        "pg_loss": float(pg_loss.detach()),
        "clipped": float(clipped.sum()),
        "is_weight": _masked_sum(w, m),
        "is_truncated": float(truncated.sum()),
        "advantage": _masked_sum(adv, m),
        # KL(behaviour || current) by k3 on samples of the behaviour policy: how far the data is off-policy.
        "kl_behaviour": _masked_sum(kl_estimate(behaviour, logp.detach(), "k3"), m),
    }
    if config.kl_coef > 0:
        if inputs.ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference model's log-probs)")
        kl = kl_estimate(logp, inputs.ref_logp.detach().to(logp.dtype), config.kl_estimator)
        kl_loss = aggregate(kl, m, config.aggregation, norm)
        loss = loss + config.kl_coef * kl_loss
        sums["kl_ref"] = _masked_sum(kl, m)
        sums["kl_loss"] = float(kl_loss.detach())
    if inputs.entropy is not None:
        sums["entropy"] = _masked_sum(inputs.entropy, m)
    sums["loss"] = float(loss.detach())
    return LossOutput(loss, sums)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> LossOutput:
    """Supervised fine-tuning: the token-mean negative log-likelihood of the masked completion tokens."""
    m = mask.bool()
    loss = aggregate(-logp, m, "token-mean", norm)
    nll = _masked_sum(-logp, m)
    return LossOutput(loss, {"tokens": float(m.sum()), "loss": float(loss.detach()), "nll": nll})


def add_sums(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The micro-batch sums added up, key by key (a rank's part of a step; the ranks' add up the same way)."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def summarize(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Add the micro-batch sums and turn them into the step's metrics: losses stay sums (they are already
    normalised for the whole step), token sums become means over the trained tokens."""
    total = add_sums(parts)
    tokens = total.get("tokens", 0.0)
    out: dict[str, float] = {"tokens": tokens}
    for key in ("loss", "pg_loss", "kl_loss"):
        if key in total:
            out[key] = total[key]
    per_token = {
        "clipped": "clip_fraction",
        "is_weight": "is_weight_mean",
        "is_truncated": "is_truncated_fraction",
        "kl_behaviour": "kl_behaviour",
        "kl_ref": "kl_ref",
        "entropy": "entropy",
        "advantage": "advantage_mean",
        "nll": "nll",
    }
    for key, name in per_token.items():
        if key in total:
            out[name] = total[key] / tokens if tokens > 0 else 0.0
    return out


# --------------------------------------------------------------------------------------------------
# Registry

AdvantageEstimator = Callable[[Sequence[Sequence[float]], AlgorithmConfig], GroupAdvantages]
PolicyLoss = Callable[[LossInputs, AlgorithmConfig, Normaliser], LossOutput]


@dataclass(frozen=True)
class Algorithm:
    """A named (advantage estimator, policy loss) pair with its default configuration."""

    name: str
    advantages: AdvantageEstimator
    policy_loss: PolicyLoss
    config: AlgorithmConfig = AlgorithmConfig()

    def with_options(self, **changes: object) -> Algorithm:
        """The same algorithm with some config fields changed (validated)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))  # type: ignore[arg-type]  # the fields are checked by AlgorithmConfig


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str, **options: object) -> Algorithm:
    """The registered algorithm ``name``, with config overrides."""
    try:
        algorithm = ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(ALGORITHMS)}") from None
    return algorithm.with_options(**options) if options else algorithm


register(Algorithm("grpo", grpo_advantages, decoupled_ppo_loss, AlgorithmConfig()))
# Dr. GRPO: no division by the group's std, and no per-length normalisation (sum over tokens / samples).
register(
    Algorithm(
        "dr_grpo",
        grpo_advantages,
        decoupled_ppo_loss,
        AlgorithmConfig(norm_adv_by_std=False, aggregation="sample-sum"),
    )
)
# DAPO: asymmetric clip (clip-higher), token-level mean, zero-signal groups filtered out.
register(Algorithm("dapo", grpo_advantages, decoupled_ppo_loss, AlgorithmConfig(clip_low=0.2, clip_high=0.28)))
