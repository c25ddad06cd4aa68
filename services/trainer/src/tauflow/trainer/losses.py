"""Policy losses, their aggregation, the KL estimators and the off-policy corrections, on plain tensors.

Everything works on ``[B, T]`` tensors (B sequences, T target positions) with a boolean mask of the
tokens the loss trains on, so it is independent of the model and of batching. docs/algorithms.md writes
out every formula, its options and the peers' conventions.

Normalisation is global: an optimizer update may run as several micro-batches (and, with data
parallelism, on several ranks), so every loss divides by a `Normaliser` computed once for the whole
update's batch, and the micro-batch losses add up to the loss of the update as if it ran in one piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tauflow.trainer.algorithms import AlgorithmConfig

AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "sample-sum",
)
POLICY_LOSSES = ("ppo", "gspo", "sapo", "cispo", "gpg")
KL_ESTIMATORS = (
    "k1",
    "kl",
    "k2",
    "k3",
    "abs",
    "mse",
    "low_var_kl",
    "k1+",
    "kl+",
    "k2+",
    "mse+",
    "k3+",
    "low_var_kl+",
    "abs+",
)
IS_LEVELS = ("token", "sequence", "geometric", "none")
IS_MODES = ("truncate", "mask")
MAX_LOG_RATIO = 20.0  # |log ratio| beyond this is clamped inside exp(), as every peer does
GSPO_MAX_LOG_RATIO = 10.0  # GSPO's sequence ratio: clamped from above only (as in the paper's reference code)


# --------------------------------------------------------------------------------------------------
# Aggregation


@dataclass(frozen=True)
class Normaliser:
    """Denominators of the aggregation modes, fixed for a whole optimizer update (all its micro-batches,
    on every rank)."""

    tokens: float
    """Tokens the loss trains on."""
    sequences: float
    """Sequences with at least one trained token."""
    samples: float
    """Samples the step consumed, including those of skipped zero-advantage groups."""
    longest: float = 0.0
    """The longest completion (in tokens) of the update's batch: seq-mean-token-sum-norm's constant when
    the config sets none."""

    @classmethod
    def of(cls, mask: torch.Tensor, samples: int | None = None) -> Normaliser:
        """The normaliser of a batch that runs in one piece (``samples`` defaults to its rows)."""
        m = mask.bool()
        per_row = m.sum(-1)
        return cls(
            tokens=float(m.sum()),
            sequences=float((per_row > 0).sum()),
            samples=float(m.shape[0] if samples is None else samples),
            longest=float(m.shape[-1]),
        )


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normaliser, scale: float | None = None
) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token values over the tokens where ``mask`` is true (n_i: row i's tokens):

    token-mean:              Σ_it x_it / N_tokens
    token-sum:               Σ_it x_it
    seq-mean-token-mean:     Σ_i (Σ_t x_it / n_i) / N_sequences
    seq-mean-token-sum:      Σ_it x_it / N_sequences
    seq-mean-token-sum-norm: Σ_it x_it / (N_sequences · L), L = ``scale`` or else the longest completion
    sample-sum:              Σ_it x_it / N_samples
    """
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros_like(per_token))  # never NaN * 0
    if mode == "token-mean":
        return x.sum() / max(norm.tokens, 1.0)
    if mode == "token-sum":
        return x.sum()
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(-1) / m.sum(-1).clamp(min=1).to(x.dtype)
        return per_seq.sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return x.sum() / max(norm.sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        length = scale if scale is not None else norm.longest
        return x.sum() / (max(norm.sequences, 1.0) * max(length, 1.0))
    if mode == "sample-sum":
        return x.sum() / max(norm.samples, 1.0)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {mode!r}")


# --------------------------------------------------------------------------------------------------
# KL


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (Schulman's estimators), with
    λ = log π_ref − log π:

        k1 = kl = −λ    abs = |λ|    k2 = mse = λ² / 2    k3 = low_var_kl = exp(λ) − λ − 1

    k3 is computed with λ clamped to ±20 and its value clamped to ±``clamp`` (10: verl's low_var_kl;
    OpenRLHF and AReaL clamp every estimator, slime's k3 none; None: unclamped). A name ending in ``+``
    keeps its value but takes k2's gradient (straight-through), k2 being the estimator whose gradient is that
    of the KL."""
    straight_through = estimator.endswith("+")
    base = estimator.removesuffix("+")
    log_ratio = ref_logp - logp
    if base in ("k1", "kl"):
        value = -log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * log_ratio.square()
    elif base in ("k3", "low_var_kl"):
        lam = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        value = torch.exp(lam) - lam - 1.0
        if clamp is not None:
            value = value.clamp(-clamp, clamp)
    else:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, not {estimator!r}")
    if not straight_through or base in ("k2", "mse"):
        return value
    k2 = 0.5 * log_ratio.square()
    return k2 - k2.detach() + value.detach()


# --------------------------------------------------------------------------------------------------
# Inputs and outputs of a loss


@dataclass
class LossInputs:
    """Per-token tensors, all ``[B, T]`` and aligned with the target tokens."""

    logp: torch.Tensor
    """log π_θ of each target token (with grad)."""
    behaviour_logp: torch.Tensor
    """log π_behaviour: what the sampler reported."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """True where the loss trains."""
    prox_logp: torch.Tensor | None = None
    """log π_prox, the proximal policy (the trainer's weights before the step's first update); None means
    logp.detach() (the step's only update, on weights that have not moved)."""
    ref_logp: torch.Tensor | None = None
    """log π_ref, needed when the config has kl_coef > 0."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of π_θ: for the metrics, and for the loss (with grad) when entropy_coef > 0."""
    distribution: torch.Tensor | None = None
    """``[B, T, V]`` log π_θ of the whole vocabulary at each position (with grad): distillation by the full
    reverse KL ..."""
    teacher_distribution: torch.Tensor | None = None
    """... and log π_teacher of the whole vocabulary there."""


@dataclass
class LossOutput:
    """The loss to backpropagate, and additive statistics (sums over tokens or sequences; see `summarize`)."""

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)


def _masked_sum(x: torch.Tensor, m: torch.Tensor) -> float:
    # (in float64: metrics such as the explained variance subtract sums of squares, which float32 loses)
    return float(torch.where(m, x.detach().double(), torch.zeros((), dtype=torch.float64, device=x.device)).sum())


def _count(x: torch.Tensor) -> float:
    return float(x.sum())


# --------------------------------------------------------------------------------------------------
# The off-policy correction: behaviour → proximal


@dataclass
class Correction:
    """Per-token weights (detached) that correct for the behaviour policy, and what they did."""

    weights: torch.Tensor
    sums: dict[str, float]


def off_policy_correction(
    prox: torch.Tensor,
    behaviour: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    m: torch.Tensor,
    config: AlgorithmConfig,
) -> Correction:
    """The importance weight w of π_prox / π_behaviour (per token, per sequence, or the sequence's geometric
    mean), truncated (TIS) or masked outside [is_lower, is_cap] (MIS, IcePop), times OPSM's mask of negative
    sequences that are too far off policy. Outside the mask w = 1, so that nothing non-finite there can reach
    the gradient."""
    ones = torch.ones_like(prox)
    log_w = torch.where(m, prox - behaviour, torch.zeros_like(prox))
    if config.is_level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(prox)
    elif config.is_level == "geometric":
        # the geometric mean of the token weights (AReaL's and slime's sequence level): it does not grow
        # with the length as the product does
        n = m.sum(-1, keepdim=True).clamp(min=1)
        log_w = (log_w.sum(-1, keepdim=True) / n).expand_as(prox)
    raw = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    sums: dict[str, float] = {}
    if config.is_level == "none" or config.is_cap is None:
        w = ones
        if config.is_level != "none":
            sums["is_weight_raw"] = _masked_sum(raw, m)
    else:
        high = (raw > config.is_cap) & m
        low = (raw < config.is_lower) & m if config.is_lower is not None else torch.zeros_like(m)
        if config.is_mode == "truncate":
            w = raw.clamp(max=config.is_cap)
            if config.is_lower is not None:
                w = w.clamp(min=config.is_lower)
        else:  # mask: the token (or the whole sequence) contributes 0 but stays in every denominator
            w = torch.where(high | low, torch.zeros_like(raw), raw)
        sums.update({"is_truncated": _count(high | low), "is_high": _count(high), "is_low": _count(low)})
        sums["is_weight_raw"] = _masked_sum(raw, m)
    if config.opsm_delta is not None:
        # DeepSeek-V3.2's off-policy sequence masking: a sequence with a negative advantage whose mean
        # log(π_behaviour / π_θ) exceeds δ trains nothing.
        n = m.sum(-1, keepdim=True).clamp(min=1)
        seq_kl = torch.where(m, behaviour - logp.detach(), torch.zeros_like(prox)).sum(-1, keepdim=True) / n
        masked = (adv < 0) & (seq_kl > config.opsm_delta) & m
        w = torch.where(masked, torch.zeros_like(w), w)
        sums["opsm_masked"] = _count(masked)
    w = torch.where(m, w, ones).detach()
    sums["is_weight"] = _masked_sum(w, m)
    return Correction(w, sums)


# --------------------------------------------------------------------------------------------------
# Policy losses


def policy_loss(inputs: LossInputs, config: AlgorithmConfig, norm: Normaliser) -> LossOutput:
    """The policy loss ``config.loss`` (ppo, gspo, sapo, cispo, gpg; docs/algorithms.md), weighted per token
    by the off-policy correction, aggregated, plus the KL penalty to the reference and minus the entropy
    bonus:

        loss = aggregate(w · l_pg) + kl_coef · aggregate(KL) − entropy_coef · aggregate(H)
    """
    m = inputs.mask.bool()
    logp = inputs.logp
    prox = logp.detach() if inputs.prox_logp is None else inputs.prox_logp.detach().to(logp.dtype)
    adv = torch.where(m, inputs.advantages.to(logp.dtype), torch.zeros_like(logp))
    # Outside the mask the behaviour log-prob is arbitrary (0 on the wire, maybe NaN).
    behaviour = torch.where(m, inputs.behaviour_logp.detach().to(logp.dtype), prox)
    zeros = torch.zeros_like(m)

    log_ratio = torch.where(m, logp - prox, torch.zeros_like(logp))
    clip_low = clip_high = dual = zeros
    kind = config.loss
    if kind == "ppo":
        ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        pg = torch.maximum(pg1, pg2)
        clipped = (pg2 > pg1) & m
        clip_high, clip_low = clipped & (adv > 0), clipped & (adv < 0)
        if config.clip_ratio_c is not None:
            # Dual clip: with A < 0 the loss is bounded by −A · c, however large the ratio grows.
            pg3 = -adv * config.clip_ratio_c
            dual = (pg > pg3) & (adv < 0) & m
            pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    elif kind == "gspo":
        n = m.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / n
        # s_i,t = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t)): the sequence's ratio in value, each token's gradient
        log_s = (logp - logp.detach() + seq_log_ratio.detach()).clamp(max=GSPO_MAX_LOG_RATIO)
        s = torch.exp(log_s)
        pg1 = -adv * s
        pg2 = -adv * s.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        pg = torch.maximum(pg1, pg2)
        clipped = (pg2 > pg1) & m
        clip_high, clip_low = clipped & (adv > 0), clipped & (adv < 0)
        ratio = s
    elif kind == "sapo":
        ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        tau = torch.where(adv > 0, torch.full_like(ratio, config.tau_pos), torch.full_like(ratio, config.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        pg = -gate * adv
    elif kind == "cispo":
        ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high).detach()
        pg = -clipped_ratio * adv * logp
        clip_high, clip_low = (ratio > 1.0 + config.clip_high) & m, (ratio < 1.0 - config.clip_low) & m
    elif kind == "gpg":
        ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        pg = -logp * adv
    else:
        raise ValueError(f"loss must be one of {POLICY_LOSSES}, not {kind!r}")

    correction = off_policy_correction(prox, behaviour, logp, adv, m, config)
    per_token = correction.weights * pg
    pg_loss = aggregate(per_token, m, config.aggregation, norm, config.loss_scale_factor)
    loss = pg_loss
    sums: dict[str, float] = {
        "tokens": float(m.sum()),
        "pg_loss": float(pg_loss.detach()),
        "clip_low": _count(clip_low),
        "clip_high": _count(clip_high),
        "clip_dual": _count(dual),
        "ratio": _masked_sum(ratio, m),
        # k1 of π_prox against π_θ: how far the step's updates have moved the policy from the proximal one.
        "ppo_kl": _masked_sum(-log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), m),
        "advantage": _masked_sum(adv, m),
        # KL(behaviour || current) by k3 on samples of the behaviour policy: how far the data is off-policy.
        "kl_behaviour": _masked_sum(kl_estimate(behaviour, logp.detach(), "k3", clamp=None), m),
        **correction.sums,
    }
    if config.kl_coef > 0:
        if inputs.ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference model's log-probs)")
        # Outside the mask both log-probs are 0 (a log-ratio of 0): padding with a non-finite log-prob gave a NaN
        # gradient through k2 and the straight-through estimators (0 · NaN), the loss itself finite.
        zero = torch.zeros((), dtype=logp.dtype)
        ref = torch.where(m, inputs.ref_logp.detach().to(logp.dtype), zero)
        kl = kl_estimate(torch.where(m, logp, zero), ref, config.kl_estimator, config.kl_clamp)
        kl_loss = aggregate(kl, m, config.aggregation, norm, config.loss_scale_factor)
        loss = loss + config.kl_coef * kl_loss
        sums["kl_ref"] = _masked_sum(kl, m)
        sums["kl_loss"] = float(kl_loss.detach())
    if config.estimator == "opd" and config.opd_loss == "reverse_kl":
        if inputs.distribution is None or inputs.teacher_distribution is None:
            raise ValueError("opd_loss reverse_kl needs the policy's and the teacher's distributions")
        teacher_kl = reverse_kl(inputs.distribution, inputs.teacher_distribution)
        distill_loss = aggregate(teacher_kl, m, config.aggregation, norm, config.loss_scale_factor)
        loss = loss + distill_loss
        sums["teacher_kl"] = _masked_sum(teacher_kl, m)
        sums["distill_loss"] = float(distill_loss.detach())
    if inputs.entropy is not None:
        sums["entropy"] = _masked_sum(inputs.entropy, m)
        if config.entropy_coef > 0:
            entropy_loss = aggregate(inputs.entropy, m, config.aggregation, norm, config.loss_scale_factor)
            loss = loss - config.entropy_coef * entropy_loss
            sums["entropy_loss"] = float(entropy_loss.detach())
    elif config.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the entropy of π_θ (with grad)")
    sums["loss"] = float(loss.detach())
    return LossOutput(loss, sums)


def reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)) over the last dimension, from log-probs ``[..., V]``
    (gradient through p only: q is detached); a token p gives no mass adds nothing, whatever q."""
    q = log_q.detach().to(log_p.dtype)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - q), torch.zeros_like(p)).sum(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    config: AlgorithmConfig,
    norm: Normaliser,
) -> LossOutput:
    """The critic's clipped value loss (PPO; verl's compute_value_loss), per trained token:

        v_clip = clip(V, V_old − c, V_old + c),   l = max((V − R)², (v_clip − R)²)
        loss = ½ · aggregate(l)

    V the critic's value now (with grad), V_old its value before the step's first update, R the GAE return,
    c = ``value_clip`` (None: l = (V − R)²), aggregated by ``value_aggregation``. Reported:
    ``value_clip_fraction`` (tokens where the clipped term is the larger)."""
    m = mask.bool()
    old = old_values.detach().to(values.dtype)
    target = returns.detach().to(values.dtype)
    unclipped = (values - target).square()
    if config.value_clip is not None:
        clipped_values = old + (values - old).clamp(-config.value_clip, config.value_clip)
        clipped = (clipped_values - target).square()
        per_token = torch.maximum(unclipped, clipped)
        # (where the clamp acts: elsewhere old + (V − old) can differ from V by an ulp and look "clipped")
        acted = (values - old).abs() > config.value_clip
        clip_count = _count((clipped > unclipped) & acted & m)
    else:
        per_token, clip_count = unclipped, 0.0
    loss = 0.5 * aggregate(per_token, m, config.value_aggregation, norm, config.loss_scale_factor)
    sums = {
        "value_tokens": float(m.sum()),
        "value_loss": float(loss.detach()),
        "value_clipped": clip_count,
        "value": _masked_sum(values, m),
        "return": _masked_sum(target, m),
        # Σ (R − V)² and Σ R²: with Σ V and Σ R, the critic's explained variance over the whole step
        "value_error_sq": _masked_sum((target - values.detach()).square(), m),
        "return_sq": _masked_sum(target.square(), m),
    }
    return LossOutput(loss, sums)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> LossOutput:
    """Supervised fine-tuning: the token-mean negative log-likelihood of the masked completion tokens."""
    m = mask.bool()
    loss = aggregate(-logp, m, "token-mean", norm)
    nll = _masked_sum(-logp, m)
    return LossOutput(loss, {"tokens": float(m.sum()), "loss": float(loss.detach()), "nll": nll})


# --------------------------------------------------------------------------------------------------
# Metrics

LOSS_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "value_loss", "distill_loss")
PER_TOKEN_METRICS = {
    "clip_low": "clip_fraction_low",
    "clip_high": "clip_fraction_high",
    "clip_dual": "clip_fraction_dual",
    "ratio": "ratio_mean",
    "ppo_kl": "ppo_kl",
    "is_weight": "is_weight_mean",
    "is_weight_raw": "is_weight_raw_mean",
    "is_truncated": "is_truncated_fraction",
    "is_high": "is_high_fraction",
    "is_low": "is_low_fraction",
    "opsm_masked": "opsm_masked_fraction",
    "kl_behaviour": "kl_behaviour",
    "kl_ref": "kl_ref",
    "entropy": "entropy",
    "advantage": "advantage_mean",
    "nll": "nll",
    "teacher_kl": "kl_teacher",
}


def add_sums(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The micro-batch sums added up, key by key (a rank's part of a step; the ranks' add up the same way)."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def summarize(parts: Iterable[Mapping[str, float]], updates: int = 1) -> dict[str, float]:
    """Add the sums of every micro-batch of ``updates`` optimizer updates and turn them into the step's
    metrics: the losses are means over the updates (each is normalised for its own update already), token
    sums become means over the trained tokens of all updates. ``clip_fraction`` is low + high."""
    total = add_sums(parts)
    tokens = total.get("tokens", 0.0)
    out: dict[str, float] = {"tokens": tokens / max(updates, 1)}
    for key in LOSS_KEYS:
        if key in total:
            out[key] = total[key] / max(updates, 1)
    for key, name in PER_TOKEN_METRICS.items():
        if key in total:
            out[name] = total[key] / tokens if tokens > 0 else 0.0
    if "clip_low" in total:
        out["clip_fraction"] = out["clip_fraction_low"] + out["clip_fraction_high"]
    value_tokens = total.get("value_tokens", 0.0)
    if value_tokens > 0:
        # the critic's statistics, over the tokens its loss saw in every update
        out["value_clip_fraction"] = total["value_clipped"] / value_tokens
        out["value_mean"] = total["value"] / value_tokens
        out["return_mean"] = total["return"] / value_tokens
        # 1 − Var(R − V) / Var(R) (verl's vf_explained_var), V the critic's values in the updates
        return_var = total["return_sq"] / value_tokens - out["return_mean"] ** 2
        error_var = total["value_error_sq"] / value_tokens - (out["return_mean"] - out["value_mean"]) ** 2
        if return_var > 0:
            out["value_explained_variance"] = 1.0 - error_var / return_var
    return out
