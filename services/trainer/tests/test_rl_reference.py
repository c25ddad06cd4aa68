"""Every estimator, loss, aggregation, correction and KL estimator against a small numpy reference written
from the published formula (docs/algorithms.md), on random batches: values and gradients, with masked
tokens, fully-masked rows, singleton groups, equal rewards and extreme ratios. The references loop over
sequences and tokens in float64 and share no code with the torch implementation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tauflow.trainer.advantages import Scored, estimate
from tauflow.trainer.algorithms import ALGORITHMS, AlgorithmConfig
from tauflow.trainer.losses import (
    AGGREGATIONS,
    LossInputs,
    Normaliser,
    aggregate,
    kl_estimate,
    policy_loss,
    summarize,
    value_loss,
)

SEEDS = range(6)
B, T = 6, 9
TOL = dict(rel=1e-5, abs=1e-6)

# ------------------------------------------------------------------------------------------ random data


def random_groups(rng: np.random.Generator, *, sizes: tuple[int, ...] = (4, 4, 1, 3), binary: bool = False):
    """Groups of scored samples: random rewards (one group with equal rewards), random masks."""
    groups = []
    for g, n in enumerate(sizes):
        if g == 1:
            rewards = [1.0] * n  # equal rewards
        elif binary:
            rewards = [float(x) for x in rng.integers(0, 2, n)]
        else:
            rewards = [float(x) for x in rng.normal(size=n).round(3)]
        group = []
        for r in rewards:
            c = int(rng.integers(1, 7))
            mask = [bool(x) for x in rng.random(c) > 0.25]
            mask[int(rng.integers(0, c))] = True
            group.append(Scored(r, mask))
        groups.append(group)
    return groups


def random_batch(rng: np.random.Generator, *, spread: float = 0.3, extreme: bool = False) -> dict[str, np.ndarray]:
    """A [B, T] batch: log-probs of the current, proximal and behaviour policies and of a reference, token
    advantages, and a mask with a fully-masked row and masked tokens; the unmasked places hold garbage."""
    logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
    prox = logp + rng.normal(0, spread, (B, T))
    beh = prox + rng.normal(0, spread, (B, T))
    ref = logp + rng.normal(0, spread, (B, T))
    if extreme:
        prox[0, :3] = logp[0, :3] - 8.0  # ratios of e^8
        beh[1, :3] = prox[1, :3] + 9.0
        ref[2, :2] = logp[2, :2] + 12.0  # k3 far past its clamp
    adv = rng.normal(0, 1, (B, 1)) * np.ones((1, T)) + rng.normal(0, 0.1, (B, T))
    mask = rng.random((B, T)) > 0.3
    mask[3] = False  # a fully-masked row
    mask[0, 0] = mask[1, 0] = True
    beh = np.where(mask, beh, np.nan)  # garbage outside the mask must not matter
    return {"logp": logp, "prox": prox, "beh": beh, "ref": ref, "adv": adv, "mask": mask}


# ------------------------------------------------------------------------------------------ references


def ref_aggregate(x: np.ndarray, mask: np.ndarray, mode: str, *, samples: float, scale: float | None) -> float:
    n_tokens, rows = mask.sum(), mask.sum(axis=1)
    n_seq = int((rows > 0).sum())
    total = sum(x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t])
    if mode == "token-mean":
        return total / max(n_tokens, 1)
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-mean":
        per_seq = [
            sum(x[i, t] for t in range(x.shape[1]) if mask[i, t]) / rows[i] for i in range(x.shape[0]) if rows[i]
        ]
        return sum(per_seq) / max(n_seq, 1)
    if mode == "seq-mean-token-sum":
        return total / max(n_seq, 1)
    if mode == "seq-mean-token-sum-norm":
        return total / (max(n_seq, 1) * (scale if scale is not None else x.shape[1]))
    if mode == "sample-sum":
        return total / samples
    raise AssertionError(mode)


def ref_agg_weights(mask: np.ndarray, mode: str, *, samples: float, scale: float | None) -> np.ndarray:
    """d aggregate / d x_it: the weight each token's value gets."""
    n_tokens, rows = mask.sum(), mask.sum(axis=1)
    n_seq = max(int((rows > 0).sum()), 1)
    w = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            w[i, t] = {
                "token-mean": 1 / max(n_tokens, 1),
                "token-sum": 1.0,
                "seq-mean-token-mean": 1 / (rows[i] * n_seq),
                "seq-mean-token-sum": 1 / n_seq,
                "seq-mean-token-sum-norm": 1 / (n_seq * (scale if scale is not None else mask.shape[1])),
                "sample-sum": 1 / samples,
            }[mode]
    return w


def ref_is_weights(d: dict[str, np.ndarray], c: AlgorithmConfig) -> np.ndarray:
    """w_it: the behaviour → proximal weight per token (TIS truncation or MIS masking), times OPSM."""
    mask = d["mask"]
    rows_n, cols_n = mask.shape
    w = np.ones(mask.shape)
    for i in range(rows_n):
        log_seq = sum(d["prox"][i, t] - d["beh"][i, t] for t in range(cols_n) if mask[i, t])
        if c.is_level == "geometric":  # AReaL's and slime's sequence level: the mean of the token logs
            log_seq /= max(1, int(mask[i].sum()))
        for t in range(cols_n):
            if not mask[i, t]:
                continue
            if c.is_level == "none" or c.is_cap is None:
                raw = None
            elif c.is_level == "token":
                raw = math.exp(max(-20, min(20, d["prox"][i, t] - d["beh"][i, t])))
            else:
                raw = math.exp(max(-20, min(20, log_seq)))
            if raw is not None:
                lo = c.is_lower if c.is_lower is not None else -math.inf
                if c.is_mode == "truncate":
                    w[i, t] = min(max(raw, lo), c.is_cap)
                else:
                    w[i, t] = raw if lo <= raw <= c.is_cap else 0.0
            if c.opsm_delta is not None:
                n = mask[i].sum()
                seq_kl = sum(d["beh"][i, s] - d["logp"][i, s] for s in range(cols_n) if mask[i, s]) / n
                if d["adv"][i, t] < 0 and seq_kl > c.opsm_delta:
                    w[i, t] = 0.0
    return w


def ref_pg(d: dict[str, np.ndarray], c: AlgorithmConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-token policy loss l_it and its derivative by logp_it (the sequence ratio's too, for GSPO)."""
    logp, prox, adv, mask = d["logp"], d["prox"], d["adv"], d["mask"]
    rows_n, cols_n = mask.shape
    loss, grad = np.zeros(mask.shape), np.zeros(mask.shape)
    for i in range(rows_n):
        n = max(mask[i].sum(), 1)
        seq = sum(logp[i, t] - prox[i, t] for t in range(cols_n) if mask[i, t]) / n
        for t in range(cols_n):
            if not mask[i, t]:
                continue
            a = adv[i, t]
            if c.loss == "ppo":
                r = math.exp(max(-20, min(20, logp[i, t] - prox[i, t])))
                unclipped, clipped = -a * r, -a * min(max(r, 1 - c.clip_low), 1 + c.clip_high)
                value, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
                if c.clip_ratio_c is not None and a < 0 and value > -a * c.clip_ratio_c:
                    value, slope = -a * c.clip_ratio_c, 0.0
            elif c.loss == "gspo":
                s = math.exp(min(seq, 10.0))
                unclipped, clipped = -a * s, -a * min(max(s, 1 - c.clip_low), 1 + c.clip_high)
                # the token's gradient: d s_it / d logp_it = s (the sequence ratio is detached)
                value, slope = (unclipped, -a * s) if unclipped >= clipped else (clipped, 0.0)
            elif c.loss == "sapo":
                r = math.exp(max(-20, min(20, logp[i, t] - prox[i, t])))
                tau = c.tau_pos if a > 0 else c.tau_neg
                sig = 1 / (1 + math.exp(-tau * (r - 1)))
                value, slope = -a * sig * 4 / tau, -a * 4 * sig * (1 - sig) * r
            elif c.loss == "cispo":
                r = math.exp(max(-20, min(20, logp[i, t] - prox[i, t])))
                w = min(max(r, 1 - c.clip_low), 1 + c.clip_high)
                value, slope = -w * a * logp[i, t], -w * a
            else:  # gpg
                value, slope = -logp[i, t] * a, -a
            loss[i, t], grad[i, t] = value, slope
    return loss, grad


def ref_kl(logp: np.ndarray, ref: np.ndarray, estimator: str, clamp: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Value and d/dlogp of the KL estimator, λ = ref − logp."""
    lam = ref - logp
    base = estimator.removesuffix("+")
    if base in ("k1", "kl"):
        value, grad = -lam, np.ones_like(lam)
    elif base == "abs":
        value, grad = np.abs(lam), -np.sign(lam)
    elif base in ("k2", "mse"):
        value, grad = lam**2 / 2, -lam
    else:
        lc = np.clip(lam, -20, 20)
        value = np.exp(lc) - lc - 1
        grad = -(np.exp(lc) - 1) * (np.abs(lam) < 20)
        if clamp is not None:
            grad = np.where(np.abs(value) > clamp, 0.0, grad)
            value = np.clip(value, -clamp, clamp)
    if estimator.endswith("+") and base not in ("k2", "mse"):
        grad = -lam  # straight-through: k2's gradient
    return value, grad


def as_inputs(d: dict[str, np.ndarray]) -> tuple[LossInputs, torch.Tensor]:
    logp = torch.tensor(d["logp"], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        behaviour_logp=torch.tensor(d["beh"], dtype=torch.float64),
        advantages=torch.tensor(d["adv"], dtype=torch.float64),
        mask=torch.tensor(d["mask"]),
        prox_logp=torch.tensor(d["prox"], dtype=torch.float64),
        ref_logp=torch.tensor(d["ref"], dtype=torch.float64),
    )
    return inputs, logp


def check_loss(d: dict[str, np.ndarray], config: AlgorithmConfig, samples: float = 7.0) -> dict[str, float]:
    """tauflow's loss and gradient against the reference for ``config``; returns the loss's sums."""
    inputs, logp = as_inputs(d)
    mask = d["mask"]
    norm = Normaliser.of(inputs.mask, samples=int(samples))
    out = policy_loss(inputs, config, norm)
    out.loss.backward()
    pg, pg_grad = ref_pg(d, config)
    w = ref_is_weights(d, config)
    agg = dict(samples=samples, scale=config.loss_scale_factor)
    expected = ref_aggregate(w * pg, mask, config.aggregation, **agg)
    weights = ref_agg_weights(mask, config.aggregation, **agg)
    grad = weights * w * pg_grad
    if config.loss == "gspo":
        # every token of a sequence moves its ratio: d s_i / d logp_it = s_i / n_i, through the detached
        # sequence ratio only via the token's own log-prob (GSPO's token form): nothing more to add
        pass
    if config.kl_coef > 0:
        kl, kl_grad = ref_kl(d["logp"], d["ref"], config.kl_estimator, config.kl_clamp)
        expected += config.kl_coef * ref_aggregate(kl, mask, config.aggregation, **agg)
        grad = grad + config.kl_coef * weights * kl_grad
    assert out.loss.item() == pytest.approx(expected, **TOL), config
    got = logp.grad.numpy()
    np.testing.assert_allclose(np.where(mask, got, 0.0), np.where(mask, grad, 0.0), rtol=1e-5, atol=1e-8)
    assert np.all(got[~mask] == 0.0), "a masked token got a gradient"
    return out.sums


# ------------------------------------------------------------------------------------------ advantages


def ref_group_stats(r: list[float]) -> tuple[float, float]:
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    return mean, std


def ref_advantages(groups, c: AlgorithmConfig) -> list[list[Any]]:
    out: list[list[Any]] = []
    if c.estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        per_token, tokens = [], []
        for group in groups:
            r = [s.reward for s in group]
            mean = sum(r) / len(r) if len(r) > 1 else 0.0
            skip = len(group) == 1 and c.singleton_groups == "skip"
            row = []
            for s in group:
                n = len(s.mask)
                if c.estimator == "reinforce_pp":
                    last = max(t for t in range(n) if s.mask[t])  # the reward sits on the last trained token
                    values = [s.reward * c.gamma ** (last - t) if t <= last else 0.0 for t in range(n)]
                else:
                    values = [s.reward - mean] * n
                row.append(values)
                tokens += [v for v, m in zip(values, s.mask, strict=True) if m and not skip]
            per_token.append(row)
        mu = sum(tokens) / len(tokens)
        var = sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1)
        for group, row in zip(groups, per_token, strict=True):
            skip = len(group) == 1 and c.singleton_groups == "skip" and c.estimator != "reinforce_pp"
            if c.estimator == "reinforce_pp":
                out.append(
                    [
                        [(v - mu) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(values, s.mask, strict=True)]
                        for values, s in zip(row, group, strict=True)
                    ]
                )  # (0 where no token trains: verl's masked_whiten(returns, mask) * mask)
            else:
                out.append([0.0 if skip else (values[0] - mu) / math.sqrt(var + 1e-8) for values in row])
        return out
    total = sum(len(g) for g in groups)
    if c.gpg_alpha == "valid":
        valid = sum(len(g) for g in groups if len(g) > 1 and len({s.reward for s in g}) > 1)
    else:
        valid = sum(1 for g in groups for s in g if s.reward != 0)
    alpha = total / max(valid, 1) if c.estimator == "gpg" else 1.0
    for group in groups:
        r = [s.reward for s in group]
        if len(r) == 1:
            # (verl: a group of one has mean 0 and std 1, so the estimators that divide by the std give r / (1 + eps))
            divides = c.estimator in ("grpo", "gpg", "grpo_passk", "opd") and c.norm_adv_by_std
            raw = r[0] / (1 + c.adv_eps) if divides else r[0]
            out.append([0.0] if c.singleton_groups == "skip" else [alpha * raw])
            continue
        mean, std = ref_group_stats(r)
        if c.estimator == "rloo":
            out.append([x - (sum(r) - x) / (len(r) - 1) for x in r])
        elif c.estimator == "grpo_passk":
            best = r.index(max(r))
            second = sorted(r)[-2]
            a = (r[best] - second) / ((std + c.adv_eps) if c.norm_adv_by_std else 1.0)
            out.append([a if i == best else 0.0 for i in range(len(r))])
        else:  # grpo, gpg
            div = (std + c.adv_eps) if c.norm_adv_by_std else 1.0
            out.append([alpha * (x - mean) / div for x in r])
    return out


ESTIMATOR_CONFIGS = [
    AlgorithmConfig(),
    AlgorithmConfig(norm_adv_by_std=False),
    AlgorithmConfig(singleton_groups="skip"),
    AlgorithmConfig(estimator="rloo"),
    AlgorithmConfig(estimator="rloo", singleton_groups="skip"),
    AlgorithmConfig(estimator="reinforce_pp"),
    AlgorithmConfig(estimator="reinforce_pp", gamma=0.9),
    AlgorithmConfig(estimator="reinforce_pp_baseline"),
    AlgorithmConfig(estimator="reinforce_pp_baseline", singleton_groups="skip"),
    AlgorithmConfig(estimator="grpo_passk"),
    AlgorithmConfig(estimator="grpo_passk", norm_adv_by_std=False),
    AlgorithmConfig(estimator="gpg", norm_adv_by_std=False),
    AlgorithmConfig(estimator="gpg", gpg_alpha="nonzero"),
]


@pytest.mark.parametrize(
    "config",
    ESTIMATOR_CONFIGS,
    ids=lambda c: f"{c.estimator}-{c.norm_adv_by_std}-{c.singleton_groups}-{c.gamma}-{c.gpg_alpha}",
)
@pytest.mark.parametrize("seed", SEEDS)
def test_estimators_match_the_reference(config: AlgorithmConfig, seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = random_groups(rng, binary=seed % 2 == 0)
    got = estimate(groups, config)
    want = ref_advantages(groups, config)
    for g_got, g_want in zip(got.values, want, strict=True):
        for a, b in zip(g_got, g_want, strict=True):
            assert a == pytest.approx(b, **TOL)
    for flag, values in zip(got.zero_groups, got.values, strict=True):
        flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
        assert flag == all(x == 0.0 for x in flat)


def test_equal_rewards_are_a_zero_group_for_group_baselines_but_not_after_whitening() -> None:
    groups = [[Scored(1.0, [True]), Scored(1.0, [True])], [Scored(1.0, [True]), Scored(0.0, [True, True])]]
    for name in ("grpo", "rloo", "grpo_passk", "gpg"):
        assert estimate(groups, ALGORITHMS[name].config).zero_groups[0] is True, name
    # REINFORCE++-baseline whitens over the batch: the equal group's 0 becomes −μ/σ, as in verl
    assert estimate(groups, ALGORITHMS["reinforce_pp_baseline"].config).zero_groups == [False, False]


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (AlgorithmConfig(), 1 / (1 + 1e-6)),
        (AlgorithmConfig(estimator="grpo_passk"), 1 / (1 + 1e-6)),
        (AlgorithmConfig(estimator="gpg", gpg_alpha="nonzero"), 1 / (1 + 1e-6)),  # α = 1 / 1
        (AlgorithmConfig(estimator="gpg", gpg_alpha="nonzero", norm_adv_by_std=False), 1.0),
        (AlgorithmConfig(norm_adv_by_std=False), 1.0),
        (AlgorithmConfig(estimator="rloo"), 1.0),
    ],
    ids=lambda x: f"{x.estimator}-{x.norm_adv_by_std}" if isinstance(x, AlgorithmConfig) else "",
)
def test_a_group_of_one_has_mean_0_and_std_1(config: AlgorithmConfig, want: float) -> None:
    # verl's convention: the estimators that divide by (std + ε) give r / (1 + ε), the others r
    assert estimate([[Scored(1.0, [True])]], config).values == [[pytest.approx(want, rel=1e-12)]]
    # on-policy distillation's outcome term is the GRPO advantage of the outcome reward (teacher = student here)
    opd = AlgorithmConfig(estimator="opd", opd_outcome_coef=1.0)
    assert estimate([[Scored(1.0, [True], token_rewards=[0.0])]], opd).values == [
        [[pytest.approx(1 / (1 + 1e-6), rel=1e-12)]]
    ]


def test_reinforce_pp_discounts_towards_the_first_token() -> None:
    # one sample of 3 tokens and reward 1, one of 1 token and reward 0, γ = 0.5: returns [0.25, 0.5, 1], [0]
    groups = [[Scored(1.0, [True, True, True])], [Scored(0.0, [True])]]
    values = estimate(groups, AlgorithmConfig(estimator="reinforce_pp", gamma=0.5)).values
    tokens = np.array([0.25, 0.5, 1.0, 0.0])
    whitened = (tokens - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    assert values[0][0] == pytest.approx(list(whitened[:3])) and values[1][0] == pytest.approx([whitened[3]])


# ------------------------------------------------------------------------------------------ losses

LOSS_CONFIGS = [
    AlgorithmConfig(),
    AlgorithmConfig(clip_ratio_c=None),
    AlgorithmConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=2.0),
    AlgorithmConfig(is_level="none"),
    AlgorithmConfig(is_level="sequence", is_cap=3.0),
    AlgorithmConfig(is_cap=1.5, is_lower=0.8),
    AlgorithmConfig(is_mode="mask", is_lower=0.5, is_cap=1.6),  # IcePop
    AlgorithmConfig(is_mode="mask", is_level="sequence", is_lower=0.2, is_cap=4.0),  # sequence MIS
    AlgorithmConfig(is_level="geometric", is_cap=1.2, is_lower=0.9),
    AlgorithmConfig(is_mode="mask", is_level="geometric", is_lower=0.9, is_cap=1.1),  # AReaL's sequence mask
    AlgorithmConfig(opsm_delta=0.05),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="k1"),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="k2"),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="k3"),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="k3", kl_clamp=None),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="abs"),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="k3+"),
    AlgorithmConfig(kl_coef=0.3, kl_estimator="low_var_kl+"),
    ALGORITHMS["gspo"].config,
    AlgorithmConfig(loss="gspo", clip_low=0.05, clip_high=0.05),
    ALGORITHMS["sapo"].config,
    ALGORITHMS["cispo"].config,
    AlgorithmConfig(loss="cispo", clip_low=0.2, clip_high=0.2),
    ALGORITHMS["gpg"].config,
]


@pytest.mark.parametrize(
    "config",
    LOSS_CONFIGS,
    ids=lambda c: (
        f"{c.loss}-{c.is_level}-{c.is_mode}-{c.kl_estimator if c.kl_coef else 'nokl'}-{c.clip_high}-{c.opsm_delta}"
    ),
)
@pytest.mark.parametrize("seed", SEEDS)
def test_losses_and_gradients_match_the_reference(config: AlgorithmConfig, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    check_loss(random_batch(rng, spread=0.3 if seed % 2 else 0.05, extreme=seed == 5), config)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_every_aggregation_matches_the_reference(mode: str, seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    d = random_batch(rng)
    check_loss(d, AlgorithmConfig(aggregation=mode))
    check_loss(d, AlgorithmConfig(aggregation=mode, loss_scale_factor=64.0))


@pytest.mark.parametrize("estimator", ["k1", "kl", "k2", "k3", "abs", "mse", "low_var_kl", "k1+", "k2+", "k3+", "abs+"])
def test_kl_estimators_value_and_gradient(estimator: str) -> None:
    rng = np.random.default_rng(7)
    logp_np = np.log(rng.uniform(0.01, 0.99, (4, 5)))
    ref_np = logp_np + rng.normal(0, 2.0, (4, 5))
    ref_np[0, 0] = logp_np[0, 0] + 15.0  # k3 = e^15: clamped to 10, no gradient
    logp = torch.tensor(logp_np, requires_grad=True)
    value = kl_estimate(logp, torch.tensor(ref_np), estimator)
    value.sum().backward()
    want, want_grad = ref_kl(logp_np, ref_np, estimator, 10.0)
    np.testing.assert_allclose(value.detach().numpy(), want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(logp.grad.numpy(), want_grad, rtol=1e-6, atol=1e-9)


def test_k3_is_clamped_where_peers_clamp_it() -> None:
    # the case: a log-ratio of 5 gives e^5 − 6 ≈ 142 unclamped; peers clamp to 10 with no gradient
    logp = torch.tensor([[-6.0]], requires_grad=True)
    value = kl_estimate(logp, torch.tensor([[-1.0]]), "k3")
    value.sum().backward()
    assert float(value.detach()) == 10.0 and float(logp.grad) == 0.0
    assert float(kl_estimate(logp, torch.tensor([[-1.0]]), "k3", clamp=None)) == pytest.approx(math.exp(5) - 6)


def test_dual_clip_bounds_a_negative_advantage_loss() -> None:
    # A = −1, ratio e^2 ≈ 7.39: PPO-clip alone gives 7.39 (unbounded in the ratio); the dual clip caps it at c = 3
    d = {
        "logp": np.array([[0.0]]),
        "prox": np.array([[-2.0]]),
        "beh": np.array([[-2.0]]),
        "ref": np.array([[0.0]]),
        "adv": np.array([[-1.0]]),
        "mask": np.array([[True]]),
    }
    inputs, _ = as_inputs(d)
    norm = Normaliser.of(inputs.mask)
    assert policy_loss(inputs, AlgorithmConfig(clip_ratio_c=None), norm).loss.item() == pytest.approx(math.exp(2))
    out = policy_loss(inputs, AlgorithmConfig(), norm)
    assert out.loss.item() == pytest.approx(3.0) and out.sums["clip_dual"] == 1.0


def test_clip_fractions_count_each_side() -> None:
    # token 0: A > 0, ratio 1.5 (clipped high); token 1: A < 0, ratio 0.5 (clipped low); token 2: A < 0,
    # ratio 5 (dual); token 3: inside the range
    logp = np.log(np.array([[0.6, 0.2, 0.5, 0.4]]))
    prox = logp - np.log(np.array([[1.5, 0.5, 5.0, 1.05]]))
    d = {
        "logp": logp,
        "prox": prox,
        "beh": prox,
        "ref": logp,
        "adv": np.array([[1.0, -1.0, -1.0, 1.0]]),
        "mask": np.ones((1, 4), dtype=bool),
    }
    sums = check_loss(d, AlgorithmConfig())
    assert (sums["clip_high"], sums["clip_low"], sums["clip_dual"]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("level", "want"), [("geometric", -math.exp(0.3)), ("sequence", -2.0), ("token", -math.exp(0.3))]
)
def test_the_geometric_level_weighs_a_sequence_by_the_mean_of_its_token_logs(level: str, want: float) -> None:
    # four tokens each 0.3 nats more likely under π_prox than under π_beh, A = 1, on policy otherwise:
    # AReaL's and slime's geometric sequence weight is e^0.3 (inside [0.5, 2]); the product e^1.2 is truncated
    logp = np.log(np.full((1, 4), 0.5))
    d = {
        "logp": logp,
        "prox": logp,
        "beh": logp - 0.3,
        "ref": logp,
        "adv": np.ones((1, 4)),
        "mask": np.ones((1, 4), dtype=bool),
    }
    config = AlgorithmConfig(is_level=level, is_lower=0.5, is_cap=2.0)
    check_loss(d, config)
    inputs = as_inputs(d)[0]
    assert policy_loss(inputs, config, Normaliser.of(inputs.mask)).loss.item() == pytest.approx(want, rel=1e-9)


def test_masked_garbage_and_fully_masked_rows_change_nothing() -> None:
    rng = np.random.default_rng(3)
    d = random_batch(rng)
    dirty = {k: v.copy() for k, v in d.items()}
    for key in ("logp", "prox", "ref", "adv"):
        dirty[key] = np.where(d["mask"], d[key], 1e6 if key == "adv" else -1e6)
    for config in (AlgorithmConfig(kl_coef=0.1), ALGORITHMS["gspo"].config, ALGORITHMS["cispo"].config):
        a, b = as_inputs(d)[0], as_inputs(dirty)[0]
        norm = Normaliser.of(a.mask)
        assert policy_loss(a, config, norm).loss.item() == pytest.approx(
            policy_loss(b, config, norm).loss.item(), **TOL
        )


def test_the_presets_are_what_their_names_say() -> None:
    presets: dict[str, Callable[[AlgorithmConfig], bool]] = {
        "grpo": lambda c: (
            (c.estimator, c.loss, c.aggregation, c.norm_adv_by_std) == ("grpo", "ppo", "token-mean", True)
        ),
        "dr_grpo": lambda c: not c.norm_adv_by_std and c.aggregation == "seq-mean-token-sum-norm",
        "dapo": lambda c: (c.clip_low, c.clip_high) == (0.2, 0.28),
        "rloo": lambda c: c.estimator == "rloo",
        "reinforce_pp": lambda c: c.estimator == "reinforce_pp",
        "reinforce_pp_baseline": lambda c: c.estimator == "reinforce_pp_baseline",
        "grpo_passk": lambda c: c.estimator == "grpo_passk",
        "gspo": lambda c: c.loss == "gspo" and c.aggregation == "seq-mean-token-mean",
        "sapo": lambda c: c.loss == "sapo",
        "cispo": lambda c: c.loss == "cispo" and c.clip_low == 1.0,
        "gpg": lambda c: c.loss == "gpg" and c.estimator == "gpg",
        "icepop": lambda c: c.is_mode == "mask" and (c.is_lower, c.is_cap) == (0.5, 5.0),
    }
    assert set(presets) <= set(ALGORITHMS)
    for name, check in presets.items():
        assert check(ALGORITHMS[name].config), name


def test_aggregate_of_one_piece_equals_the_sum_of_its_micro_batches() -> None:
    rng = np.random.default_rng(11)
    d = random_batch(rng)
    x, mask = torch.tensor(d["adv"]), torch.tensor(d["mask"])
    norm = Normaliser.of(mask)
    for mode in AGGREGATIONS:
        whole = aggregate(x, mask, mode, norm)
        parts = sum(aggregate(x[i : i + 2], mask[i : i + 2], mode, norm) for i in range(0, B, 2))
        assert float(parts) == pytest.approx(float(whole), **TOL), mode


def test_dapo_overlong_shaping_penalises_the_last_tokens_of_the_budget() -> None:
    # L = 10, buffer 4: lengths <= 6 keep their reward; 8 loses (6 - 8)/4 = 0.5; 10 loses 1; 12 loses 1
    config = AlgorithmConfig(overlong_buffer=4, max_response_length=10, estimator="rloo")
    lengths = [3, 6, 8, 10, 12]
    group = [Scored(1.0, [True] * n) for n in lengths]
    shaped = [1.0, 1.0, 0.5, 0.0, 0.0]
    want = [r - (sum(shaped) - r) / (len(shaped) - 1) for r in shaped]
    assert estimate([group], config).values[0] == pytest.approx(want)
    assert estimate([group], AlgorithmConfig(estimator="rloo")).zero_groups == [True]  # unshaped: all equal
    with pytest.raises(ValueError, match="max_response_length"):
        AlgorithmConfig(overlong_buffer=4)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "grpo_passk", "gpg"])
@pytest.mark.parametrize("reward", [0.1, 0.7, 1 / 3, -2.3])
def test_equal_rewards_that_floats_cannot_hold_are_still_exactly_zero(name: str, reward: float) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: r − mean(r) must not leave a residue that trains the group
    groups = [[Scored(reward, [True]) for _ in range(n)] for n in (2, 3, 5, 7)]
    for config in (ALGORITHMS[name].config, AlgorithmConfig(estimator=ALGORITHMS[name].config.estimator, adv_eps=0.0)):
        got = estimate(groups, config)
        assert got.zero_groups == [True] * 4 and all(v == 0.0 for g in got.values for v in g), config


def test_reinforce_pp_returns_count_from_the_last_trained_token() -> None:
    # trailing masked tokens (padding) carry no return: γ^0 on the last trained token
    values = estimate(
        [[Scored(1.0, [True, True, True, False, False])], [Scored(0.0, [True])]],
        AlgorithmConfig(estimator="reinforce_pp", gamma=0.5),
    ).values
    tokens = np.array([0.25, 0.5, 1.0, 0.0])
    whitened = (tokens - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    assert values[0][0][:3] == pytest.approx(list(whitened[:3]))
    assert values[0][0][3:] == [0.0, 0.0]  # (verl: masked_whiten(returns, mask) * mask)


def test_reinforce_pp_baseline_gives_a_sample_with_no_trained_token_zero() -> None:
    config = AlgorithmConfig(estimator="reinforce_pp_baseline")
    masked = [Scored(1.0, [False, False]), Scored(0.0, [True]), Scored(1.0, [True, True])]
    got = estimate([masked, [Scored(1.0, [False]), Scored(1.0, [False])]], config)
    assert got.values[0][0] == 0.0 and 0.0 not in got.values[0][1:]  # (whitening left it non-zero before)
    assert got.values[1] == [0.0, 0.0] and got.zero_groups == [False, True]  # nothing of it trains: no forward


def test_reinforce_pp_advantages_are_zero_where_no_token_trains() -> None:
    # whitening shifts every position: a masked one held (0 − μ)/σ, −10,000 where a single token trained
    config = AlgorithmConfig(estimator="reinforce_pp")
    one = estimate([[Scored(1.0, [True, False, False])]], config)
    assert one.values == [[[0.0, 0.0, 0.0]]] and one.zero_groups == [True]
    inside = estimate(
        [[Scored(1.0, [True, True, False, True, True]), Scored(0.0, [True, True, True, False, False])]], config
    )
    assert inside.values[0][0][2] == 0.0 and inside.values[0][1][3:] == [0.0, 0.0]
    assert all(v != 0.0 for v in inside.values[0][0][:2] + inside.values[0][0][3:])


def test_bounds_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="is_lower"):
        AlgorithmConfig(is_lower=0.5, is_cap=None)
    with pytest.raises(ValueError, match="is_lower"):
        AlgorithmConfig(is_lower=3.0, is_cap=2.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        AlgorithmConfig(clip_ratio_c=1.0)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gpg"])
@pytest.mark.parametrize("seed", SEEDS)
def test_per_token_rewards_enter_as_verl_sums_them(estimator: str, seed: int) -> None:
    # The KL in the reward: each trained token carries −β · KL_t. Outcome estimators see r + Σ_t (masked);
    # REINFORCE++ discounts them token by token: G_t = Σ_{u ≥ t} γ^(u − t) r_u, the outcome on the last
    # trained token.
    rng = np.random.default_rng(300 + seed)
    groups = random_groups(rng)
    shaped = [
        [Scored(s.reward, s.mask, [float(x) for x in rng.normal(0, 0.1, len(s.mask))]) for s in g] for g in groups
    ]
    config = AlgorithmConfig(estimator=estimator, gamma=0.8)
    got = estimate(shaped, config)
    if estimator != "reinforce_pp":
        summed = [
            [Scored(s.reward + sum(t for t, m in zip(s.token_rewards, s.mask) if m), s.mask) for s in g] for g in shaped
        ]
        want = ref_advantages(summed, config)
    else:
        returns, tokens = [], []
        for g in shaped:
            row = []
            for s in g:
                last = max(t for t in range(len(s.mask)) if s.mask[t])
                r = [
                    (tr if m else 0.0) + (s.reward if t == last else 0.0)
                    for t, (tr, m) in enumerate(zip(s.token_rewards, s.mask))
                ]
                values = [
                    sum(config.gamma ** (u - t) * r[u] for u in range(t, len(r))) if t <= last else 0.0
                    for t in range(len(r))
                ]
                row.append(values)
                tokens += [v for v, m in zip(values, s.mask) if m]
            returns.append(row)
        mu, var = float(np.mean(tokens)), float(np.var(tokens, ddof=1))
        want = [
            [
                [(v - mu) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(values, s.mask)]
                for values, s in zip(row, g)
            ]
            for row, g in zip(returns, shaped)
        ]
    for g_got, g_want in zip(got.values, want, strict=True):
        for a, b in zip(g_got, g_want, strict=True):
            assert a == pytest.approx(b, **TOL)


def test_opd_advantages_are_the_teachers_per_token_log_ratio() -> None:
    # token rewards carry log π_teacher − log π_prox (the backend puts them there); opd adds nothing else by
    # default, and opd_outcome_coef mixes in the outcome's GRPO advantage
    rng = np.random.default_rng(17)
    groups = [[Scored(float(r), [True, False, True], [float(x) for x in rng.normal(size=3)]) for r in (1, 0, 1)]]
    got = estimate(groups, AlgorithmConfig(estimator="opd")).values[0]
    for s, a in zip(groups[0], got, strict=True):
        assert a == pytest.approx([s.token_rewards[0], 0.0, s.token_rewards[2]])
    mixed = estimate(groups, AlgorithmConfig(estimator="opd", opd_outcome_coef=0.5)).values[0]
    outcome = ref_advantages([[Scored(s.reward, s.mask) for s in groups[0]]], AlgorithmConfig())[0]
    for s, a, o in zip(groups[0], mixed, outcome, strict=True):
        assert a == pytest.approx([s.token_rewards[0] + 0.5 * o, 0.0, s.token_rewards[2] + 0.5 * o])


# ------------------------------------------------------------------------------------------ GAE and the critic


def random_valued_groups(rng: np.random.Generator, *, token_rewards: bool) -> list[list[Scored]]:
    """Groups with the critic's values on every completion token (garbage on masked ones) and, optionally,
    per-token rewards (the KL in the reward)."""
    groups = []
    for g in random_groups(rng):
        group = []
        for s in g:
            n = len(s.mask)
            values = [
                float(v) if m else float(rng.normal(0, 50)) for v, m in zip(rng.normal(0, 1, n), s.mask, strict=True)
            ]
            tokens = [float(x) for x in rng.normal(0, 0.1, n)] if token_rewards else None
            group.append(Scored(s.reward, s.mask, tokens, values))
        groups.append(group)
    return groups


def ref_gae(groups: list[list[Scored]], c: AlgorithmConfig) -> tuple[list[list[float]], list[list[float]]]:
    """GAE written from the paper over each completion's trained tokens t_1 < … < t_k (masked tokens are not
    steps of the episode): r_j the per-token reward (+ the outcome at t_k), δ_j = r_j + γ·V_{j+1} − V_j with
    V_{k+1} = 0, A_j = δ_j + γλ·A_{j+1}; returns A + V; then A whitened over every trained token of the
    batch (Bessel). Returns each sample's advantages and returns on its trained tokens, in order."""
    adv_rows, ret_rows = [], []
    for group in groups:
        for s in group:
            steps = [t for t, m in enumerate(s.mask) if m]
            rewards = [(s.token_rewards[t] if s.token_rewards else 0.0) for t in steps]
            rewards[-1] += s.reward
            values = [s.values[t] for t in steps]
            adv = [0.0] * len(steps)
            following = 0.0
            for j in range(len(steps) - 1, -1, -1):
                next_value = values[j + 1] if j + 1 < len(steps) else 0.0
                delta = rewards[j] + c.gamma * next_value - values[j]
                following = delta + c.gamma * c.lam * following
                adv[j] = following
            adv_rows.append(adv)
            ret_rows.append([a + v for a, v in zip(adv, values, strict=True)])
    if c.whiten_advantages:
        flat = [a for row in adv_rows for a in row]
        mu = sum(flat) / len(flat)
        var = sum((a - mu) ** 2 for a in flat) / (len(flat) - 1)
        adv_rows = [[(a - mu) / math.sqrt(var + 1e-8) for a in row] for row in adv_rows]
    return adv_rows, ret_rows


GAE_CONFIGS = [
    AlgorithmConfig(estimator="gae"),
    AlgorithmConfig(estimator="gae", gamma=0.9, lam=0.95),
    AlgorithmConfig(estimator="gae", lam=0.0),
    AlgorithmConfig(estimator="gae", gamma=0.8, lam=0.5, whiten_advantages=False),
]


@pytest.mark.parametrize("config", GAE_CONFIGS, ids=lambda c: f"g{c.gamma}-l{c.lam}-w{c.whiten_advantages}")
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_the_reference(config: AlgorithmConfig, token_rewards: bool, seed: int) -> None:
    groups = random_valued_groups(np.random.default_rng(seed), token_rewards=token_rewards)
    got = estimate(groups, config)
    want_adv, want_ret = ref_gae(groups, config)
    assert got.returns is not None
    flat = [
        (s, a, r)
        for g, ga, gr in zip(groups, got.values, got.returns, strict=True)
        for s, a, r in zip(g, ga, gr, strict=True)
    ]
    for (s, adv, ret), want_a, want_r in zip(flat, want_adv, want_ret, strict=True):
        assert isinstance(adv, list) and len(adv) == len(s.mask) == len(ret)
        assert [a for a, m in zip(adv, s.mask, strict=True) if m] == pytest.approx(want_a, **TOL)
        assert [r for r, m in zip(ret, s.mask, strict=True) if m] == pytest.approx(want_r, **TOL)
        assert all(a == 0.0 for a, m in zip(adv, s.mask, strict=True) if not m)  # masked: no advantage


def test_gae_limits_are_monte_carlo_and_one_step_td() -> None:
    # one completion of 3 trained tokens, outcome 1, values [0.2, 0.5, 0.9], γ = 1, no whitening:
    #   λ = 1: A_t = R − V_t = [0.8, 0.5, 0.1]
    #   λ = 0: A_t = r_t + V_{t+1} − V_t = [0.3, 0.4, 1 − 0.9] = [0.3, 0.4, 0.1]; returns A + V
    group = [[Scored(1.0, [True, True, True], values=[0.2, 0.5, 0.9])]]
    mc = estimate(group, AlgorithmConfig(estimator="gae", lam=1.0, whiten_advantages=False))
    td = estimate(group, AlgorithmConfig(estimator="gae", lam=0.0, whiten_advantages=False))
    assert mc.values[0][0] == pytest.approx([0.8, 0.5, 0.1]) and mc.returns == [[pytest.approx([1.0, 1.0, 1.0])]]
    assert td.values[0][0] == pytest.approx([0.3, 0.4, 0.1])
    assert td.returns == [[pytest.approx([0.5, 0.9, 1.0])]]


def test_gae_skips_masked_tokens_as_verl_does() -> None:
    # A masked token in the middle (tool output) is not a step: the token before it bootstraps from the
    # token after it. values [0.1, 99 (masked), 0.4], outcome 1, γ = 0.5, λ = 0:
    #   A_0 = 0 + 0.5 · 0.4 − 0.1 = 0.1 (not 0.5 · 99 − 0.1), A_2 = 1 − 0.4 = 0.6
    group = [[Scored(1.0, [True, False, True], values=[0.1, 99.0, 0.4])]]
    got = estimate(group, AlgorithmConfig(estimator="gae", gamma=0.5, lam=0.0, whiten_advantages=False))
    assert got.values[0][0] == pytest.approx([0.1, 0.0, 0.6])


def test_gae_needs_the_critics_values() -> None:
    with pytest.raises(ValueError, match="critic"):
        estimate([[Scored(1.0, [True])]], AlgorithmConfig(estimator="gae"))


def ref_value_loss(v, old, ret, mask, c: AlgorithmConfig) -> tuple[float, np.ndarray, float]:
    """½ · aggregate(max((V − R)², (clip(V, V_old ± c) − R)²)) and its gradient by V; the clip fraction."""
    per, slope = np.zeros(v.shape), np.zeros(v.shape)
    clipped = 0
    for i in range(v.shape[0]):
        for t in range(v.shape[1]):
            if not mask[i, t]:
                continue
            plain = (v[i, t] - ret[i, t]) ** 2
            if c.value_clip is None:
                per[i, t], slope[i, t] = plain, 2 * (v[i, t] - ret[i, t])
                continue
            lo, hi = old[i, t] - c.value_clip, old[i, t] + c.value_clip
            vc = min(max(v[i, t], lo), hi)
            outside = (vc - ret[i, t]) ** 2
            if outside > plain:
                clipped += 1
                per[i, t], slope[i, t] = outside, (2 * (vc - ret[i, t]) if lo < v[i, t] < hi else 0.0)
            else:
                per[i, t], slope[i, t] = plain, 2 * (v[i, t] - ret[i, t])
    agg = dict(samples=7.0, scale=None)
    weights = ref_agg_weights(mask, c.value_aggregation, **agg)
    return 0.5 * ref_aggregate(per, mask, c.value_aggregation, **agg), 0.5 * weights * slope, clipped / mask.sum()


@pytest.mark.parametrize("clip", [0.5, 0.2, None])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_the_reference(clip: float | None, mode: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = random_batch(rng)
    old = rng.normal(0, 1, (B, T))
    v = old + rng.normal(0, 0.5, (B, T))
    ret = old + rng.normal(0, 1, (B, T))
    config = AlgorithmConfig(estimator="gae", value_clip=clip, value_aggregation=mode)
    values = torch.tensor(v, requires_grad=True)
    mask = torch.tensor(d["mask"])
    out = value_loss(values, torch.tensor(old), torch.tensor(ret), mask, config, Normaliser.of(mask, samples=7))
    out.loss.backward()
    want, grad, fraction = ref_value_loss(v, old, ret, d["mask"], config)
    assert out.loss.item() == pytest.approx(want, **TOL)
    np.testing.assert_allclose(values.grad.numpy(), grad, rtol=1e-6, atol=1e-9)
    assert out.sums["value_clipped"] / out.sums["value_tokens"] == pytest.approx(fraction)
    if clip == 0.2:
        assert fraction > 0  # the case exercises the clip


def test_value_clip_fraction_counts_only_where_the_clip_acts() -> None:
    # old + (V − old) is not always V in floating point: a wide clip must count nothing
    rng = np.random.default_rng(0)
    old = torch.tensor(rng.normal(0, 3, (64, 32)), dtype=torch.float32)
    v = torch.tensor(rng.normal(0, 30, (64, 32)), dtype=torch.float32)
    ret = torch.tensor(rng.normal(0, 3, (64, 32)), dtype=torch.float32)
    mask = torch.ones(64, 32, dtype=torch.bool)
    config = AlgorithmConfig(estimator="gae", value_clip=100.0)
    assert ((old + (v - old)) != v).any()  # (the case exercises the rounding)
    assert value_loss(v, old, ret, mask, config, Normaliser.of(mask)).sums["value_clipped"] == 0.0


def test_explained_variance_of_returns_far_from_zero_is_exact() -> None:
    # Var(R) from Σ R² − (Σ R)²/n: in float32 sums, returns of 20 ± 0.05 lost the variance's digits
    rng = np.random.default_rng(1)
    ret = 20 + rng.normal(0, 0.05, (16, 64))
    v = ret + rng.normal(0, 0.025, (16, 64))
    mask = torch.ones(16, 64, dtype=torch.bool)
    config = AlgorithmConfig(estimator="gae", value_clip=None)
    out = value_loss(
        torch.tensor(v, dtype=torch.float32), torch.tensor(v, dtype=torch.float32), torch.tensor(ret, dtype=torch.float32),
        mask, config, Normaliser.of(mask),
    )  # fmt: skip
    r32, v32 = ret.astype(np.float32).astype(np.float64), v.astype(np.float32).astype(np.float64)
    want = 1 - np.var(r32 - v32) / np.var(r32)
    assert summarize([out.sums])["value_explained_variance"] == pytest.approx(want, abs=1e-4)


def test_value_clip_keeps_the_critic_near_its_old_values() -> None:
    # V_old = 0, R = 2, c = 0.5: at V = 1 the clipped value is 0.5, (0.5 − 2)² = 2.25 > (1 − 2)² = 1, so the
    # loss is ½ · 2.25 and V gets no gradient (it moved past the clip towards R); at V = 0.3, inside, the
    # gradient is ½ · 2 · (0.3 − 2) = −1.7
    config = AlgorithmConfig(estimator="gae", value_clip=0.5)
    v = torch.tensor([[1.0, 0.3]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = value_loss(v, torch.zeros(1, 2), torch.full((1, 2), 2.0), mask, config, Normaliser(1.0, 1.0, 1.0))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.5 * (2.25 + 1.7**2))
    assert v.grad.tolist() == [[0.0, pytest.approx(-1.7)]]
    assert out.sums["value_clipped"] == 1.0


# ------------------------------------------------------------------------------------------ REMAX


def ref_remax(groups: list[list[Scored]]) -> list[list[list[float]]]:
    """A_t = (the rewards from token t on: per-token ones on trained tokens, the outcome on the last trained
    one) − b, the greedy completion's reward; 0 on masked tokens; a group without b: all 0."""
    out = []
    for group in groups:
        b = group[0].baseline
        row = []
        for s in group:
            n = len(s.mask)
            if b is None:
                row.append([0.0] * n)
                continue
            last = max(t for t in range(n) if s.mask[t])
            r = [((s.token_rewards[t] if s.token_rewards else 0.0) if s.mask[t] else 0.0) for t in range(n)]
            r[last] += s.reward
            row.append([sum(r[t:]) - b if s.mask[t] else 0.0 for t in range(n)])
        out.append(row)
    return out


@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_the_reference(token_rewards: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = []
    for gi, g in enumerate(random_valued_groups(rng, token_rewards=token_rewards)):
        baseline = None if gi == 2 else float(rng.normal())  # one group came without a greedy completion
        groups.append([Scored(s.reward, s.mask, s.token_rewards, baseline=baseline) for s in g])
    got = estimate(groups, AlgorithmConfig(estimator="remax"))
    want = ref_remax(groups)
    for got_row, want_row in zip(got.values, want, strict=True):
        for a, w in zip(got_row, want_row, strict=True):
            assert a == pytest.approx(w, **TOL)
    assert got.zero_groups[2]  # no baseline: nothing to train


def test_remax_by_hand() -> None:
    # rewards 1 and 0, the greedy completion scored 0.25: A = 0.75 and −0.25 on every trained token
    group = [[Scored(1.0, [True, True], baseline=0.25), Scored(0.0, [True, False, True], baseline=0.25)]]
    got = estimate(group, AlgorithmConfig(estimator="remax"))
    assert got.values == [[[0.75, 0.75], [-0.25, 0.0, -0.25]]]
    same = estimate([[Scored(1.0, [True], baseline=1.0)]], AlgorithmConfig(estimator="remax"))
    assert same.zero_groups == [True]  # as good as greedy: no signal


# ------------------------------------------------------------------------------------------ distillation


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", SEEDS)
def test_the_full_reverse_kl_to_the_teacher_matches_the_reference(mode: str, seed: int) -> None:
    # KL_t = Σ_v p_v (log p_v − log q_v) over a vocabulary of 5, its gradient by log p_v (the policy's
    # log-softmax): p_v (log p_v − log q_v + 1); the teacher's q gets none.
    rng = np.random.default_rng(seed)
    d = random_batch(rng)
    vocab = 5

    def log_softmax(x: np.ndarray) -> np.ndarray:
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp = log_softmax(rng.normal(0, 1.5, (B, T, vocab)))
    lq = log_softmax(rng.normal(0, 1.5, (B, T, vocab)))
    kl = np.zeros((B, T))
    slope = np.zeros((B, T, vocab))
    for i in range(B):
        for t in range(T):
            for v in range(vocab):
                p = math.exp(lp[i, t, v])
                kl[i, t] += p * (lp[i, t, v] - lq[i, t, v])
                slope[i, t, v] = p * (lp[i, t, v] - lq[i, t, v] + 1)
    config = AlgorithmConfig(estimator="opd", opd_loss="reverse_kl", aggregation=mode, is_level="none")
    inputs, _ = as_inputs({**d, "adv": np.zeros((B, T))})  # no outcome term: the KL alone
    distribution = torch.tensor(lp, requires_grad=True)
    teacher = torch.tensor(lq, requires_grad=True)
    inputs.distribution, inputs.teacher_distribution = distribution, teacher
    mask = d["mask"]
    out = policy_loss(inputs, config, Normaliser.of(inputs.mask, samples=7))
    out.loss.backward()
    agg = dict(samples=7.0, scale=None)
    assert out.loss.item() == pytest.approx(ref_aggregate(kl, mask, mode, **agg), **TOL)
    want = ref_agg_weights(mask, mode, **agg)[..., None] * slope
    np.testing.assert_allclose(distribution.grad.numpy(), want, rtol=1e-6, atol=1e-9)
    assert teacher.grad is None or not teacher.grad.any()  # the teacher is a target, not trained
    assert out.sums["teacher_kl"] == pytest.approx(float(kl[mask].sum()), rel=1e-5)


def test_gae_reads_no_value_of_a_masked_token_not_even_a_nan() -> None:
    # values at masked tokens are never used (nor propagated, as NaN · 0 would be)
    group = [[Scored(1.0, [True, False, True], values=[0.1, float("nan"), 0.4])]]
    got = estimate(group, AlgorithmConfig(estimator="gae", gamma=0.5, lam=0.0, whiten_advantages=False))
    assert got.values[0][0] == pytest.approx([0.1, 0.0, 0.6]) and got.returns == [[pytest.approx([0.2, 0.0, 1.0])]]
