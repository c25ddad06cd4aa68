"""Advantage estimators: from the rewards of a step's groups to one advantage per sample, or one per
completion token (docs/algorithms.md has the formulas, their options and the peers' conventions).

An estimator sees every group of the step at once (REINFORCE++ whitens over the whole batch, GPG scales by
the batch's share of groups with a signal) and returns, for each sample, a float (the same for all its
completion tokens) or a list with one value per completion token. Groups whose every advantage is exactly
0 are reported, so that the backend can skip their forward and backward.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tauflow.trainer.algorithms import AlgorithmConfig

ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_passk", "gpg", "opd", "gae", "remax")
SINGLETON_GROUPS = ("raw", "skip")
GPG_ALPHAS = ("valid", "nonzero")
WHITEN_EPS = 1e-8  # inside the square root, with Bessel's variance, as verl and slime whiten (docs/algorithms.md)

Advantage = float | list[float]


@dataclass(frozen=True)
class Scored:
    """What an estimator reads of a sample: its reward, which completion tokens train, per-token rewards
    added to the outcome (the KL penalty in the reward: −β · KL_t), if any, and the critic's value of each
    completion token's state (gae)."""

    reward: float
    mask: Sequence[bool]
    token_rewards: Sequence[float] | None = None
    values: Sequence[float] | None = None
    """V(s_t) of each completion token t: the critic's estimate of the return from the state before it."""
    baseline: float | None = None
    """The reward of the prompt's greedy completion (remax), the same for every sample of a group."""

    @property
    def trained_tokens(self) -> int:
        return sum(bool(x) for x in self.mask)

    @property
    def score(self) -> float:
        """The outcome reward plus the per-token rewards of the trained tokens (verl's
        ``token_level_rewards.sum(-1)``): what the outcome estimators see."""
        if not self.token_rewards:
            return float(self.reward)
        return float(self.reward) + sum(float(r) for r, m in zip(self.token_rewards, self.mask, strict=True) if m)


@dataclass(frozen=True)
class GroupAdvantages:
    """One advantage per sample (a float, or one per completion token), per group, which groups carry no
    signal (every advantage exactly 0), and, for an estimator with a critic (gae), each completion token's
    return: the critic's regression target."""

    values: list[list[Advantage]]
    zero_groups: list[bool]
    returns: list[list[list[float]]] | None = None

    @property
    def num_zero_groups(self) -> int:
        return sum(self.zero_groups)


def _rewards(group: Sequence[Scored]) -> torch.Tensor:
    if len(group) == 0:
        raise ValueError("a group has no samples")
    r = torch.tensor([s.score for s in group], dtype=torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def _is_zero(values: Sequence[Advantage]) -> bool:
    return all((v == 0.0) if isinstance(v, float) else all(x == 0.0 for x in v) for v in values)


def _result(
    values: list[list[Advantage]],
    skipped: Sequence[bool] | None = None,
    returns: list[list[list[float]]] | None = None,
) -> GroupAdvantages:
    skipped = skipped or [False] * len(values)
    return GroupAdvantages(values, [s or _is_zero(v) for v, s in zip(values, skipped, strict=True)], returns)


def _singleton(r: torch.Tensor, config: AlgorithmConfig, divides_by_std: bool) -> list[Advantage]:
    """A group of one sample has no baseline: its raw reward (verl's convention: mean 0, std 1, so r / (1 + eps)
    where the estimator divides by the std), or 0 (skip)."""
    if config.singleton_groups == "skip":
        return [0.0]
    value = float(r[0])
    return [value / (1.0 + config.adv_eps) if divides_by_std else value]


def _equal(r: torch.Tensor) -> bool:
    """Every reward the same: a group baseline gives exactly 0 (r − mean(r) in floating point may not)."""
    return len(r) > 1 and bool((r == r[0]).all())


def _group_baseline(
    groups: Sequence[Sequence[Scored]],
    config: AlgorithmConfig,
    advantages_of: Callable[[torch.Tensor], list[float]],
    scale: float = 1.0,
    divides_by_std: bool = False,
) -> GroupAdvantages:
    """The estimators with a group baseline: a group of one follows singleton_groups, a group of equal rewards
    gets exactly 0, any other group ``advantages_of(its rewards)``; every value times ``scale`` (GPG's α).
    ``divides_by_std``: the estimator divides by (std + eps), a group of one's std being 1."""
    values: list[list[Advantage]] = []
    for group in groups:
        r = _rewards(group)
        if len(group) == 1:
            row: Sequence[Advantage] = _singleton(r, config, divides_by_std)
        elif _equal(r):
            row = [0.0] * len(group)
        else:
            row = advantages_of(r)
        values.append([scale * float(v) for v in row])  # type: ignore[arg-type]  # group baselines are floats
    return _result(values)


def _centred(r: torch.Tensor, config: AlgorithmConfig) -> list[float]:
    """r − mean(r), divided by (std(r) + adv_eps) with norm_adv_by_std (std with Bessel's correction)."""
    a = r - r.mean()
    if config.norm_adv_by_std:
        a = a / (r.std(unbiased=True) + config.adv_eps)
    return [float(x) for x in a]


def grpo(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """A_i = (r_i − mean(r)) / (std(r) + eps), std with Bessel's correction; without norm_adv_by_std
    (Dr. GRPO), A_i = r_i − mean(r)."""
    return _group_baseline(groups, config, lambda r: _centred(r, config), divides_by_std=config.norm_adv_by_std)


def rloo(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """Leave-one-out baseline: A_i = r_i − mean_{j≠i}(r_j) = n / (n − 1) · (r_i − mean(r))."""
    return _group_baseline(groups, config, lambda r: [float(x) for x in r - (r.sum() - r) / (len(r) - 1)])


def grpo_passk(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """Pass@k-style GRPO (as verl's grpo_passk): only the group's best sample (the first of equals) gets a
    non-zero advantage, r_max − r_second, divided by (std(r) + eps) with norm_adv_by_std."""

    def best_only(r: torch.Tensor) -> list[float]:
        best = int(torch.argmax(r))
        a = float(r[best]) - float(torch.topk(r, 2).values[1])
        if config.norm_adv_by_std:
            a = a / (float(r.std(unbiased=True)) + config.adv_eps)
        return [a if i == best else 0.0 for i in range(len(r))]

    return _group_baseline(groups, config, best_only, divides_by_std=config.norm_adv_by_std)


def gpg(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """GPG: A_i = α · (r_i − mean(r)) (/ (std + eps) with norm_adv_by_std), α = B / B_valid, B the step's
    samples. gpg_alpha "valid" (the paper): B_valid counts the samples of groups whose rewards are not all
    equal; "nonzero" (verl): the samples whose reward is not 0."""
    rewards = [_rewards(g) for g in groups]
    total = sum(len(r) for r in rewards)
    if config.gpg_alpha == "valid":
        valid = sum(len(r) for r in rewards if len(r) > 1 and not _equal(r))
    else:
        valid = sum(int((r != 0).sum()) for r in rewards)
    return _group_baseline(
        groups,
        config,
        lambda r: _centred(r, config),
        scale=total / max(valid, 1),
        divides_by_std=config.norm_adv_by_std,
    )


def _whiten(per_sample: list[list[torch.Tensor]], masks: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """(x − μ) / sqrt(σ² + 1e-8) over every trained token of the batch, σ² with Bessel's correction."""
    flat = torch.cat([x[m] for xs, ms in zip(per_sample, masks, strict=True) for x, m in zip(xs, ms, strict=True)])
    if flat.numel() == 0:
        return per_sample
    mean = flat.mean()
    var = flat.var(unbiased=True) if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype)
    scale = torch.rsqrt(var + WHITEN_EPS)
    return [[(x - mean) * scale for x in xs] for xs in per_sample]


def reinforce_pp(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """REINFORCE++: the discounted return at each completion token t, G_t = Σ_{u ≥ t} γ^(u − t) · r_u, of
    the per-token rewards (the KL penalty, when in the reward) and the outcome reward, which sits on the last
    trained token l (G_t = γ^(l − t) · r without per-token rewards; 0 after l), whitened over every trained
    token of the batch (no baseline, no group: singleton_groups does not apply)."""
    returns: list[list[torch.Tensor]] = []
    masks: list[list[torch.Tensor]] = []
    for group in groups:
        _rewards(group)  # checked: finite
        row, mask_row = [], []
        for s in group:
            mask = torch.tensor([bool(x) for x in s.mask], dtype=torch.bool)
            # per-token rewards on the trained tokens, the outcome on the last trained one (tokens after it
            # return 0); then G_t = Σ_{u ≥ t} γ^(u − t) · r_u
            last = int(mask.nonzero().max()) if bool(mask.any()) else len(s.mask) - 1
            rewards = torch.zeros(len(s.mask), dtype=torch.float64)
            if s.token_rewards:
                rewards += torch.tensor([float(x) for x in s.token_rewards], dtype=torch.float64) * mask
            if len(s.mask):  # (an empty completion has no token to carry it)
                rewards[last] += float(s.reward)
            discounted = torch.zeros_like(rewards)
            running = 0.0
            for t in range(len(s.mask) - 1, -1, -1):
                running = float(rewards[t]) + config.gamma * running
                discounted[t] = running if t <= last else 0.0
            row.append(discounted)
            mask_row.append(mask)
        returns.append(row)
        masks.append(mask_row)
    whitened = _whiten(returns, masks)
    # 0 on tokens that do not train (verl's `masked_whiten(...) * mask`): whitening shifts every position, and a
    # masked one held (0 − μ)/σ (−10,000 where one token trained), which zero_groups read as a signal
    values: list[list[Advantage]] = [
        [[float(x) if m else 0.0 for x, m in zip(a, mask, strict=True)] for a, mask in zip(row, mask_row, strict=True)]
        for row, mask_row in zip(whitened, masks, strict=True)
    ]
    return _result(values)


def reinforce_pp_baseline(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """REINFORCE++-baseline: s_i = r_i − mean(r) of its group, then whitened over every trained token of the
    batch (each sample's tokens all carry s_i, so each sample keeps one advantage). A skipped singleton
    group stays out of the statistics."""
    scores: list[list[torch.Tensor]] = []
    masks: list[list[torch.Tensor]] = []
    skipped: list[bool] = []
    for group in groups:
        r = _rewards(group)
        skip = len(group) == 1 and config.singleton_groups == "skip"
        s = r - (r.mean() if len(group) > 1 else 0.0)
        skipped.append(skip)
        scores.append(
            [torch.full((len(x.mask),), float(v), dtype=torch.float64) for x, v in zip(group, s, strict=True)]
        )
        masks.append([torch.tensor([bool(m) and not skip for m in x.mask], dtype=torch.bool) for x in group])
    whitened = _whiten(scores, masks)
    values: list[list[Advantage]] = []
    for row, mask_row, skip, group in zip(whitened, masks, skipped, groups, strict=True):
        # (0 for a sample with no token that trains: whitening shifted it, −μ/σ, and zero_groups read it)
        values.append([0.0 if skip or not bool(m.any()) else float(a[0]) for a, m in zip(row, mask_row, strict=True)])
    return _result(values, skipped)


def opd(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """On-policy distillation, advantage form: each trained token's advantage is its per-token reward, the
    negative sampled reverse KL to the teacher, log π_teacher − log π_prox (with the KL penalty, when in the
    reward), undiscounted and not whitened; plus opd_outcome_coef × the group's GRPO advantage of the
    outcome reward (0 by default: pure distillation)."""
    outcome = grpo([[Scored(s.reward, s.mask) for s in g] for g in groups], config) if config.opd_outcome_coef else None
    values: list[list[Advantage]] = []
    for gi, group in enumerate(groups):
        _rewards(group)
        row: list[Advantage] = []
        for si, s in enumerate(group):
            base = float(outcome.values[gi][si]) * config.opd_outcome_coef if outcome is not None else 0.0  # type: ignore[arg-type]
            tokens = s.token_rewards or [0.0] * len(s.mask)
            row.append([(float(t) + base) if m else 0.0 for t, m in zip(tokens, s.mask, strict=True)])
        values.append(row)
    return _result(values)


def _last_trained(mask: Sequence[bool]) -> int:
    """Where the outcome reward sits: the completion's last trained token (its last token when none trains)."""
    trained = [t for t, m in enumerate(mask) if m]
    return trained[-1] if trained else len(mask) - 1


def token_rewards_of(s: Scored) -> list[float]:
    """The per-token rewards of a completion: its per-token rewards on the trained tokens, plus the outcome
    reward on its last trained token (verl's ``token_level_rewards``)."""
    rewards = [float(r) if m else 0.0 for r, m in zip(s.token_rewards or [0.0] * len(s.mask), s.mask, strict=True)]
    if rewards:  # (an empty completion has no token to carry the outcome)
        rewards[_last_trained(s.mask)] += float(s.reward)
    return rewards


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over ``[B, T]`` completions (Schulman et al. 2015), right to left:

        δ_t = r_t + γ · V_next − V_t,   A_t = δ_t + γλ · A_next,   returns_t = A_t + V_t

    where V_next and A_next are those of the next *trained* token (0 after the last one): a masked token
    (tool output, padding) neither bootstraps nor accumulates, it passes its successor's values through
    (verl's multi-turn form; for right-padded completions the same as the plain recursion). Returns the
    advantages (not whitened) and the returns; on masked tokens both hold what the recursion carried, so
    read them on trained tokens only."""
    mask = mask.bool()
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    running = torch.zeros(values.shape[0], dtype=values.dtype)
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = torch.where(mask[:, t], values[:, t], next_value)  # (a masked value never leaks in, NaN or not)
        running = torch.where(mask[:, t], candidate, running)
        advantages[:, t] = running
    return advantages, advantages + values


def gae(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """PPO's estimator with a critic: `gae_advantages` of each completion (the per-token rewards and the
    outcome on the last trained token, the critic's values), the advantages whitened over every trained
    token of the batch with ``whiten_advantages`` (verl, OpenRLHF); the returns (not whitened) are the
    critic's targets. Groups play no part: singleton_groups does not apply."""
    flat = [s for g in groups for s in g]
    for g in groups:
        _rewards(g)  # checked: finite
    if any(s.values is None or len(s.values) != len(s.mask) for s in flat):
        raise ValueError("gae needs the critic's value of every completion token")
    width = max(len(s.mask) for s in flat)
    rewards = torch.zeros(len(flat), width, dtype=torch.float64)
    values = torch.zeros(len(flat), width, dtype=torch.float64)
    mask = torch.zeros(len(flat), width, dtype=torch.bool)
    for i, s in enumerate(flat):
        n = len(s.mask)
        rewards[i, :n] = torch.tensor(token_rewards_of(s), dtype=torch.float64)
        values[i, :n] = torch.tensor([float(v) for v in s.values or ()], dtype=torch.float64)
        mask[i, :n] = torch.tensor([bool(m) for m in s.mask], dtype=torch.bool)
    if not torch.isfinite(values[mask]).all():
        raise ValueError("the critic's values must be finite")
    adv, ret = gae_advantages(rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        adv = torch.stack(_whiten([list(adv.unbind(0))], [list(mask.unbind(0))])[0])
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    ret = torch.where(mask, ret, torch.zeros_like(ret))  # (a masked token is no regression target)
    out_values: list[list[Advantage]] = []
    out_returns: list[list[list[float]]] = []
    i = 0
    for g in groups:
        row: list[Advantage] = []
        ret_row: list[list[float]] = []
        for s in g:
            n = len(s.mask)
            row.append([float(x) for x in adv[i, :n]])
            ret_row.append([float(x) for x in ret[i, :n]])
            i += 1
        out_values.append(row)
        out_returns.append(ret_row)
    return _result(out_values, returns=out_returns)


def remax(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """REMAX (Li et al. 2023; verl's remax): the greedy completion's reward b as the baseline, per trained
    token A_t = Σ_{u ≥ t} r_u − b, the reward-to-go (the outcome on the last trained token plus the per-token
    rewards from t on) minus b; not whitened. A group of one sample is REMAX's original form. A group that
    came without a baseline (its producer made no greedy completion) trains nothing: every A is 0."""
    values: list[list[Advantage]] = []
    for group in groups:
        _rewards(group)
        baseline = group[0].baseline if group else None
        if baseline is None or not math.isfinite(baseline):
            values.append([[0.0] * len(s.mask) for s in group])
            continue
        row: list[Advantage] = []
        for s in group:
            to_go = list(itertools.accumulate(reversed(token_rewards_of(s))))[::-1]
            row.append([(g - baseline) if m else 0.0 for g, m in zip(to_go, s.mask, strict=True)])
        values.append(row)
    return _result(values)


AdvantageEstimator = Callable[[Sequence[Sequence[Scored]], "AlgorithmConfig"], GroupAdvantages]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo_passk": grpo_passk,
    "gpg": gpg,
    "opd": opd,
    "gae": gae,
    "remax": remax,
}


def overlong_penalty(length: int, config: AlgorithmConfig) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens, L = max_response_length,
    B = overlong_buffer: 0 up to L − B, then falling linearly to −overlong_penalty at L, and
    −overlong_penalty beyond (0 when no buffer is set)."""
    if config.overlong_buffer is None or config.max_response_length is None:
        return 0.0
    start = config.max_response_length - config.overlong_buffer
    if length <= start:
        return 0.0
    if length > config.max_response_length:
        return -config.overlong_penalty
    return (start - length) / config.overlong_buffer * config.overlong_penalty


def estimate(groups: Sequence[Sequence[Scored]], config: AlgorithmConfig) -> GroupAdvantages:
    """The advantages of ``config.estimator`` for the step's groups (their rewards shaped first by the
    overlong penalty, when one is set)."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[config.estimator]
    except KeyError:
        raise ValueError(f"estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, not {config.estimator!r}") from None
    if config.overlong_buffer is not None:
        groups = [
            [dataclasses.replace(s, reward=s.reward + overlong_penalty(len(s.mask), config)) for s in g] for g in groups
        ]
    return estimator(groups, config)
