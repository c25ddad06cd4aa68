"""The losses and advantages against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from tauflow.trainer.algorithms import (
    ALGORITHMS,
    AlgorithmConfig,
    LossInputs,
    Normaliser,
    aggregate,
    get_algorithm,
    grpo_advantages,
    kl_estimate,
    policy_loss,
    sft_loss,
    summarize,
)

EXACT = AlgorithmConfig(adv_eps=0.0)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ----------------------------------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand() -> None:
    # [1, 0, 0, 1]: mean 0.5, deviations ±0.5, Bessel variance 4·0.25/3 = 1/3, std = 0.57735
    #   -> A = ±0.5 / 0.57735 = ±0.866025
    # [0, 1, 2]: mean 1, variance (1 + 0 + 1)/2 = 1 -> A = [-1, 0, 1]
    adv = grpo_advantages([[1, 0, 0, 1], [0, 1, 2]], EXACT)
    s = 0.5 / math.sqrt(1 / 3)
    assert adv.values[0] == pytest.approx([s, -s, -s, s])
    assert adv.values[1] == pytest.approx([-1.0, 0.0, 1.0])
    assert adv.zero_groups == [False, False]


def test_identical_rewards_give_zero_advantage_and_are_counted() -> None:
    # all-equal rewards carry no signal: exactly 0, flagged, counted; a group of one is skipped or, by
    # default (verl's convention: mean 0, std 1), trains on its raw reward 0.5 / (1 + eps)
    adv = grpo_advantages([[2, 2, 2], [0.5], [1, 0]], AlgorithmConfig(singleton_groups="skip"))
    assert adv.values[0] == [0.0, 0.0, 0.0]
    assert adv.values[1] == [0.0]
    assert adv.zero_groups == [True, True, False]
    assert adv.num_zero_groups == 2
    raw = grpo_advantages([[2, 2, 2], [0.5], [1, 0]], AlgorithmConfig())
    assert raw.values[1] == pytest.approx([0.5 / (1 + 1e-6)]) and raw.zero_groups == [True, False, False]


def test_dr_grpo_does_not_divide_by_std() -> None:
    # [1, 0, 0, 1] - 0.5 = [0.5, -0.5, -0.5, 0.5]
    adv = grpo_advantages([[1, 0, 0, 1]], AlgorithmConfig(norm_adv_by_std=False))
    assert adv.values[0] == [0.5, -0.5, -0.5, 0.5]
    assert ALGORITHMS["dr_grpo"].config.norm_adv_by_std is False


def test_eps_keeps_small_spreads_finite() -> None:
    # [0, 1e-9]: Bessel std = 1e-9/sqrt(2) ≈ 7.07e-10; with eps = 1e-6 the advantages stay ≈ ±5e-10/1e-6
    adv = grpo_advantages([[0.0, 1e-9]], AlgorithmConfig(adv_eps=1e-6))
    assert all(abs(a) < 1e-3 for a in adv.values[0])


# ----------------------------------------------------------------------------------------- PPO clip


def _clip_case(config: AlgorithmConfig) -> tuple[torch.Tensor, object]:
    # ratios r = [1.5, 0.5, 1.5, 0.5] against prox = 0, advantages A = [+1, +1, -1, -1]
    logp = torch.log(t([1.5, 0.5, 1.5, 0.5])).requires_grad_()
    inputs = LossInputs(
        logp=logp,
        behaviour_logp=torch.zeros(1, 4),
        advantages=t([1.0, 1.0, -1.0, -1.0]),
        mask=torch.ones(1, 4, dtype=torch.bool),
        prox_logp=torch.zeros(1, 4),
    )
    out = policy_loss(inputs, config, Normaliser.of(inputs.mask))
    out.loss.backward()
    return logp.grad, out


def test_ppo_clip_on_both_sides() -> None:
    # symmetric clip [0.8, 1.2], no IS (is_cap=None):
    #   t0: r=1.5, A=+1: min(1.5, 1.2) = 1.2   -> l = -1.2, clipped (no gradient)
    #   t1: r=0.5, A=+1: min(0.5, 0.8) = 0.5   -> l = -0.5, gradient -r·A/4 = -0.125
    #   t2: r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> l = +1.5, gradient -r·A/4 = +0.375
    #   t3: r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> l = +0.8, clipped
    #   token-mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; clip fraction 2/4
    grad, out = _clip_case(AlgorithmConfig(clip_low=0.2, clip_high=0.2, is_cap=None))
    assert out.loss.item() == pytest.approx(0.15)
    assert grad.tolist()[0] == pytest.approx([0.0, -0.125, 0.375, 0.0])
    assert summarize([out.sums])["clip_fraction"] == pytest.approx(0.5)


def test_ppo_clip_asymmetric_clip_higher() -> None:
    # clip [0.8, 1.6] (clip_high = 0.6): t0 is now inside the range: min(1.5, 1.5) -> l = -1.5, gradient -1.5/4
    #   token-mean = (-1.5 - 0.5 + 1.5 + 0.8) / 4 = 0.075; clip fraction 1/4 (t3 only)
    grad, out = _clip_case(AlgorithmConfig(clip_low=0.2, clip_high=0.6, is_cap=None))
    assert out.loss.item() == pytest.approx(0.075)
    assert grad.tolist()[0] == pytest.approx([-0.375, -0.125, 0.375, 0.0])
    assert summarize([out.sums])["clip_fraction"] == pytest.approx(0.25)


# ----------------------------------------------------------------------------------------- IS weights


def _is_case(config: AlgorithmConfig) -> tuple[torch.Tensor, object]:
    # prox = logp.detach() = [0, 0, 0]; behaviour = -log([0.5, 1, 3]) so raw w = exp(prox - beh) = [0.5, 1, 3]
    # ratio = 1 everywhere, A = 1: per-token l = -w
    logp = torch.zeros(1, 3, requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        behaviour_logp=-torch.log(t([0.5, 1.0, 3.0])),
        advantages=t([1.0, 1.0, 1.0]),
        mask=torch.ones(1, 3, dtype=torch.bool),
    )
    out = policy_loss(inputs, config, Normaliser.of(inputs.mask))
    out.loss.backward()
    return logp.grad, out


def test_is_weights_truncated_at_cap() -> None:
    # cap 2: w = [0.5, 1, 2]; loss = -(0.5 + 1 + 2)/3 = -7/6; gradient -w/3; mean w = 3.5/3; truncated 1/3
    grad, out = _is_case(AlgorithmConfig(is_cap=2.0))
    assert out.loss.item() == pytest.approx(-3.5 / 3)
    assert grad.tolist()[0] == pytest.approx([-0.5 / 3, -1 / 3, -2 / 3])
    m = summarize([out.sums])
    assert m["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert m["is_truncated_fraction"] == pytest.approx(1 / 3)


def test_is_mask_mode_drops_tokens_over_the_cap() -> None:
    # mask mode: t2 (w = 3 > 2) contributes nothing but still counts: loss = -(0.5 + 1)/3 = -0.5
    grad, out = _is_case(AlgorithmConfig(is_cap=2.0, is_mode="mask"))
    assert out.loss.item() == pytest.approx(-0.5)
    assert grad.tolist()[0] == pytest.approx([-0.5 / 3, -1 / 3, 0.0])


def test_is_disabled_without_cap() -> None:
    # is_cap=None: w = 1, loss = -(1 + 1 + 1)/3 = -1
    _, out = _is_case(AlgorithmConfig(is_cap=None))
    assert out.loss.item() == pytest.approx(-1.0)
    assert summarize([out.sums])["is_weight_mean"] == pytest.approx(1.0)


def test_stale_sample_is_corrected_towards_the_current_policy() -> None:
    # a token the behaviour policy found likelier (p_beh = 0.5) than the current one (p = 0.25) is weighted
    # w = 0.25/0.5 = 0.5; the reverse is weighted 2: exactly pi_prox / pi_beh
    logp = torch.log(t([0.25, 0.5])).requires_grad_()
    inputs = LossInputs(logp, torch.log(t([0.5, 0.25])), t([1.0, 1.0]), torch.ones(1, 2, dtype=torch.bool))
    out = policy_loss(inputs, AlgorithmConfig(is_cap=10.0), Normaliser.of(inputs.mask))
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5 / 2, -2.0 / 2])  # -w·r·A/N with r = 1


# ----------------------------------------------------------------------------------------- masking


def test_masked_tokens_never_matter_even_when_garbage() -> None:
    # t1 is masked and carries NaN behaviour log-prob and a huge advantage: neither loss nor gradient see it.
    # Left: t0 and t2 with w = 1, r = 1, A = 1 -> loss -(1 + 1)/2 = -1, gradient -1/2 on t0, t2.
    logp = torch.zeros(1, 3, requires_grad=True)
    inputs = LossInputs(
        logp=logp,
        behaviour_logp=t([0.0, float("nan"), 0.0]),
        advantages=t([1.0, 1e6, 1.0]),
        mask=torch.tensor([[True, False, True]]),
    )
    out = policy_loss(inputs, AlgorithmConfig(), Normaliser.of(inputs.mask))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, 0.0, -0.5])
    assert summarize([out.sums])["tokens"] == 2


# ----------------------------------------------------------------------------------------- aggregation

X = t([1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 4 tokens: 2.5
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),  # 2 sequences with tokens: 3.0
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5.0
        ("sample-sum", (6 + 4) / 5),  # 5 samples delivered (e.g. 2 more in a skipped group): 2.0
    ],
)
def test_aggregation_modes(mode: str, expected: float) -> None:
    norm = Normaliser.of(M, samples=5)
    assert (norm.tokens, norm.sequences, norm.samples) == (4, 2, 5)
    assert float(aggregate(X, M, mode, norm)) == pytest.approx(expected)
    # micro-batches with the step's normaliser add up to the whole
    parts = aggregate(X[:1], M[:1], mode, norm) + aggregate(X[1:], M[1:], mode, norm)
    assert float(parts) == pytest.approx(expected)


def test_aggregation_is_a_config_choice() -> None:
    with pytest.raises(ValueError, match="aggregation must be one of"):
        AlgorithmConfig(aggregation="mean")
    # the same tokens under two modes: t = [[-1, -1], [-1, pad]] with r = 1, w = 1, A = 1
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    inputs = LossInputs(logp, torch.zeros(2, 2), torch.ones(2, 2), mask)
    token_mean = policy_loss(inputs, AlgorithmConfig(aggregation="token-mean"), Normaliser.of(mask))
    seq_sum = policy_loss(inputs, AlgorithmConfig(aggregation="seq-mean-token-sum"), Normaliser.of(mask))
    assert token_mean.loss.item() == pytest.approx(-3 / 3)  # -3 over 3 tokens
    assert seq_sum.loss.item() == pytest.approx(-3 / 2)  # -3 over 2 sequences


# ----------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand() -> None:
    # logp = -1, ref = -1.5: log_ratio = ref - logp = -0.5
    #   k1 = 0.5, k2 = 0.25/2 = 0.125, k3 = exp(-0.5) + 0.5 - 1 = 0.6065307 - 0.5 = 0.1065307
    logp, ref = t([-1.0]), t([-1.5])
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(0.5)
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.125)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(math.exp(-0.5) - 0.5)
    assert float(kl_estimate(ref, ref, "k3")) == 0.0


def test_kl_penalty_adds_to_the_loss() -> None:
    # pg part: r = 1, w = 1, A = [1, -1] -> (-1 + 1)/2 = 0; KL part: k3 = 0.1065307 on both tokens
    # -> loss = 0 + 0.1 · 0.1065307
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    inputs = LossInputs(
        logp,
        torch.full((1, 2), -1.0),
        t([1.0, -1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        ref_logp=torch.full((1, 2), -1.5),
    )
    out = policy_loss(inputs, AlgorithmConfig(kl_coef=0.1, kl_estimator="k3"), Normaliser.of(inputs.mask))
    k3 = math.exp(-0.5) - 0.5
    assert out.loss.item() == pytest.approx(0.1 * k3)
    assert summarize([out.sums])["kl_ref"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(
            LossInputs(logp, inputs.behaviour_logp, inputs.advantages, inputs.mask),
            AlgorithmConfig(kl_coef=0.1),
            Normaliser.of(inputs.mask),
        )


def test_kl_to_behaviour_metric() -> None:
    # behaviour -1.5, current -1 (prox): k3 with log_ratio = logp - beh = 0.5 ... estimated from the
    # behaviour's samples: exp(0.5) - 0.5 - 1 = 0.1487213
    logp = torch.full((1, 1), -1.0)
    inputs = LossInputs(logp, torch.full((1, 1), -1.5), t([0.0]), torch.ones(1, 1, dtype=torch.bool))
    out = policy_loss(inputs, AlgorithmConfig(), Normaliser.of(inputs.mask))
    assert summarize([out.sums])["kl_behaviour"] == pytest.approx(math.exp(0.5) - 1.5)


# ----------------------------------------------------------------------------------------- SFT, registry


def test_sft_loss_token_mean_nll() -> None:
    # p = [0.5, 0.25, 0.1], last token masked: (ln 2 + ln 4)/2 = 1.5 ln 2 = 1.0397208
    logp = torch.log(t([0.5, 0.25, 0.1]))
    mask = torch.tensor([[True, True, False]])
    out = sft_loss(logp, mask, Normaliser.of(mask))
    assert out.loss.item() == pytest.approx(1.5 * math.log(2))
    assert summarize([out.sums])["nll"] == pytest.approx(1.5 * math.log(2))


def test_registry() -> None:
    assert {"grpo", "dr_grpo", "dapo"} <= set(ALGORITHMS)
    grpo = ALGORITHMS["grpo"]
    assert (grpo.config.estimator, grpo.config.loss) == ("grpo", "ppo")
    assert (grpo.config.clip_low, grpo.config.clip_high, grpo.config.aggregation) == (0.2, 0.2, "token-mean")
    assert get_algorithm("grpo", clip_high=0.28).config.clip_high == 0.28
    assert ALGORITHMS["grpo"].config.clip_high == 0.2  # overrides copy
    with pytest.raises(KeyError, match="registered"):
        get_algorithm("nope")
    with pytest.raises(ValueError):
        get_algorithm("grpo", is_mode="drop")
