"""The algorithms: one configuration (`AlgorithmConfig`) selects the advantage estimator (advantages.py),
the policy loss, its aggregation, the off-policy correction and the KL (losses.py), and the PPO updates of
a step (mini-batches and epochs, run by the backend); the registry names the presets users know (GRPO,
Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, SAPO, CISPO, GPG, ...). docs/algorithms.md writes out every
formula with its options, defaults and the peers' conventions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tauflow.trainer.advantages import (
    ESTIMATORS,
    GPG_ALPHAS,
    SINGLETON_GROUPS,
    GroupAdvantages,
    Scored,
    estimate,
)
from tauflow.trainer.losses import (
    AGGREGATIONS,
    IS_LEVELS,
    IS_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    LossOutput,
    Normaliser,
    add_sums,
    aggregate,
    kl_estimate,
    policy_loss,
    sft_loss,
    summarize,
)

PROXIMAL = ("recompute", "behaviour")
OPD_LOSSES = ("advantage", "reverse_kl")

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "GroupAdvantages",
    "LossInputs",
    "LossOutput",
    "Normaliser",
    "Scored",
    "add_sums",
    "aggregate",
    "get_algorithm",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "register",
    "sft_loss",
    "summarize",
]


def _one_of(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, not {value!r}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Every knob of an algorithm (``algorithm_options`` in the trainer's config); docs/algorithms.md."""

    # Advantages (advantages.py).
    estimator: str = "grpo"
    """grpo, rloo, reinforce_pp, reinforce_pp_baseline, grpo_passk, gpg, opd (on-policy distillation: needs
    the trainer's backend.teacher_model_path), gae (PPO with a critic: a value model in the trainer), remax
    (the greedy completion's reward as baseline: the rollout's greedy_baseline)."""
    norm_adv_by_std: bool = True
    """grpo, grpo_passk, gpg: divide by the group's std (+ adv_eps). False: Dr. GRPO."""
    adv_eps: float = 1e-6
    gamma: float = 1.0
    """reinforce_pp, gae: the discount of the rewards over the completion's tokens."""
    lam: float = 1.0
    """gae: λ, the bias/variance trade-off of the advantage (1: Monte-Carlo return − V; 0: one-step TD)."""
    whiten_advantages: bool = True
    """gae: whiten the advantages over every trained token of the batch (verl, OpenRLHF)."""
    opd_outcome_coef: float = 0.0
    """opd: the weight of the outcome reward's GRPO advantage added to the distillation's per-token one."""
    opd_loss: str = "advantage"
    """opd: advantage (each sampled token's advantage is log π_teacher − log π_prox, in the policy loss) or
    reverse_kl (the per-token reverse KL over the whole vocabulary, Σ_v π_θ(v) log(π_θ(v) / π_teacher(v)),
    minimised directly: its exact gradient at every visited state, no sampling of the token's own term)."""
    gpg_alpha: str = "valid"
    """gpg: α = B / B_valid, B_valid the samples of groups with a signal (valid, the paper) or the samples
    whose reward is not 0 (nonzero, verl)."""
    singleton_groups: str = "raw"
    """A group of one sample: raw (its reward as advantage, no baseline: verl's convention) or skip."""
    skip_zero_advantage_groups: bool = True
    """Groups whose every advantage is 0 (e.g. all rewards equal) run no forward/backward where that is all their
    loss would hold (no KL or entropy term); they count in the denominators either way: the same update."""
    overlong_buffer: int | None = None
    """DAPO's overlong reward shaping: the last this many tokens before max_response_length are penalised
    linearly (down to −overlong_penalty at the limit, and beyond); None: off."""
    max_response_length: int | None = None
    """The completion length limit the shaping counts from (the rollout's max_new_tokens)."""
    overlong_penalty: float = 1.0
    mask_truncated: bool = False
    """DAPO's overlong filtering: a completion cut at the length limit (finish reason length) trains nothing;
    it still counts in its group's baseline (its reward is what a cut answer earns)."""

    # The policy loss (losses.py).
    loss: str = "ppo"
    """ppo (PPO-clip, with dual clip), gspo, sapo, cispo, gpg."""
    clip_low: float = 0.2
    """ppo, gspo, cispo: the ratio is clipped to [1 − clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    """ppo's dual clip: with A < 0 the loss is at most −A · clip_ratio_c (> 1); None: no dual clip."""
    tau_pos: float = 1.0
    """sapo: the soft gate's temperature for A > 0 ..."""
    tau_neg: float = 1.05
    """... and for A ≤ 0."""
    aggregation: str = "token-mean"
    """How per-token losses become one number: one of AGGREGATIONS."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's constant L (Dr. GRPO: the generation budget); None: the batch's longest
    completion."""

    # The correction from the behaviour policy (the sampler) to the proximal one.
    is_level: str = "token"
    """token (per-token ratio), sequence (the product over the sequence), geometric (its geometric mean over
    the sequence's tokens: AReaL's and slime's sequence level) or none."""
    is_cap: float | None = 2.0
    """Upper bound of the importance weight π_prox / π_behaviour; None: no correction (w = 1)."""
    is_lower: float | None = None
    """Lower bound (None: none). truncate clamps to it; mask (MIS, IcePop) masks below it."""
    is_mode: str = "truncate"
    """truncate (TIS: w clamped to the bounds) or mask (MIS/IcePop: w = 0 outside them; the tokens still
    count in the denominators)."""
    opsm_delta: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): a sequence with A < 0 whose mean log(π_beh / π_θ)
    exceeds δ trains nothing; None: off."""
    reject_lower: float | None = None
    """Rejection: a sample whose geometric-mean weight exp(mean_t log(π_prox / π_beh)) is below this is
    dropped from the step (not trained, out of every denominator); None: no lower bound."""
    reject_upper: float | None = None
    """... or above this; None: no upper bound."""

    # KL to the reference model, and the entropy bonus.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    """k1 (= kl), k2 (= mse), k3 (= low_var_kl), abs; with "+": the value of one, the gradient of k2."""
    kl_clamp: float | None = 10.0
    """k3's value is clamped to ±kl_clamp (10, as verl's low_var_kl); None: unclamped (slime's k3)."""
    kl_reward_coef: float = 0.0
    """The KL as a reward penalty (verl's use_kl_in_reward): each trained token gets −β · KL_t(π_prox ‖ π_ref)
    before the advantages; 0: off."""
    kl_reward_estimator: str = "k1"
    """The estimator of that per-token KL (verl's kl_penalty: k1 by default)."""
    entropy_coef: float = 0.0
    """The entropy bonus: the loss minus entropy_coef · aggregate(entropy)."""

    # The critic (estimator gae): a value model in the trainer process, trained beside the policy.
    value_clip: float | None = 0.5
    """The clipped value loss: the new value is kept within ±value_clip of the value before the step (verl's
    cliprange_value 0.5); None: the plain squared error."""
    value_aggregation: str = "token-mean"
    """How the per-token value losses become one number: one of AGGREGATIONS (verl: the critic's
    loss_agg_mode, token-mean)."""
    critic_warmup_steps: int = 0
    """The first this many steps train the critic only: the policy's weights stay (its version still counts
    the step), so that its first updates see a critic that has learned something (verl's critic_warmup)."""

    # PPO updates: one step (one policy version) = epochs × mini_batches optimizer updates.
    mini_batches: int = 1
    """The step's batch is split into this many mini-batches, one optimizer update each."""
    epochs: int = 1
    """Passes over the step's mini-batches."""
    proximal: str = "recompute"
    """The proximal policy: recompute (the trainer's weights before the step's first update, by a forward
    pass when the step makes more than one update) or behaviour (the sampler's log-probs: no extra pass,
    and then no off-policy correction)."""

    def __post_init__(self) -> None:
        _one_of("estimator", self.estimator, ESTIMATORS)
        _one_of("singleton_groups", self.singleton_groups, SINGLETON_GROUPS)
        _one_of("gpg_alpha", self.gpg_alpha, GPG_ALPHAS)
        _one_of("loss", self.loss, POLICY_LOSSES)
        _one_of("aggregation", self.aggregation, AGGREGATIONS)
        _one_of("value_aggregation", self.value_aggregation, AGGREGATIONS)
        _one_of("is_level", self.is_level, IS_LEVELS)
        _one_of("is_mode", self.is_mode, IS_MODES)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("kl_reward_estimator", self.kl_reward_estimator, KL_ESTIMATORS)
        _one_of("proximal", self.proximal, PROXIMAL)
        _one_of("opd_loss", self.opd_loss, OPD_LOSSES)
        if not 0.0 <= self.clip_low <= 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None), not {self.clip_ratio_c}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be positive or None, not {self.is_cap}")
        if self.is_lower is not None and (self.is_cap is None or not 0 <= self.is_lower < self.is_cap):
            raise ValueError(f"is_lower needs is_cap, and 0 <= is_lower < is_cap; got {self.is_lower}, {self.is_cap}")
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError("tau_pos and tau_neg must be positive")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], not {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], not {self.lam}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be positive or None, not {self.value_clip}")
        if self.critic_warmup_steps < 0:
            raise ValueError(f"critic_warmup_steps must be >= 0, not {self.critic_warmup_steps}")
        if self.reject_lower is not None and self.reject_upper is not None and self.reject_lower >= self.reject_upper:
            raise ValueError(f"need reject_lower < reject_upper, got {self.reject_lower}, {self.reject_upper}")
        for name in (
            "kl_coef",
            "kl_reward_coef",
            "entropy_coef",
            "adv_eps",
            "reject_lower",
            "reject_upper",
            "opd_outcome_coef",
        ):
            if getattr(self, name) is None:
                continue
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be positive or None, not {self.kl_clamp}")
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be positive or None, not {self.loss_scale_factor}")
        if self.opsm_delta is not None and self.opsm_delta < 0:
            raise ValueError(f"opsm_delta must be >= 0 or None, not {self.opsm_delta}")
        if self.overlong_buffer is not None and (
            self.max_response_length is None or not 0 < self.overlong_buffer <= self.max_response_length
        ):
            raise ValueError(
                "overlong_buffer needs max_response_length, and 0 < overlong_buffer <= max_response_length"
            )
        if self.overlong_penalty < 0:
            raise ValueError(f"overlong_penalty must be >= 0, not {self.overlong_penalty}")
        if self.mini_batches < 1 or self.epochs < 1:
            raise ValueError(f"need mini_batches >= 1 and epochs >= 1, got {self.mini_batches}, {self.epochs}")

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0 or self.kl_reward_coef > 0

    @property
    def uses_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def rejects(self) -> bool:
        return self.reject_lower is not None or self.reject_upper is not None

    @property
    def needs_forward_before_advantages(self) -> bool:
        """The KL in the reward, rejection, distillation and the critic's values need a forward pass over
        every sample before the advantages."""
        return self.kl_reward_coef > 0 or self.rejects or self.estimator == "gae" or self.teacher_scores_samples

    @property
    def teacher_scores_samples(self) -> bool:
        """Distillation in the advantage form: the teacher's log-prob of every sampled token, before the
        advantages."""
        return self.estimator == "opd" and self.opd_loss == "advantage"

    @property
    def distills_full_kl(self) -> bool:
        """Distillation by the full per-token reverse KL: the teacher's distributions in every update."""
        return self.estimator == "opd" and self.opd_loss == "reverse_kl"

    @property
    def updates(self) -> int:
        """Optimizer updates per step."""
        return self.mini_batches * self.epochs


# --------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class Algorithm:
    """A named preset of `AlgorithmConfig`: what ``algorithm: <name>`` selects (its options override it)."""

    name: str
    config: AlgorithmConfig = AlgorithmConfig()

    def advantages(self, groups: Sequence[Sequence[Scored]]) -> GroupAdvantages:
        return estimate(groups, self.config)

    def policy_loss(self, inputs: LossInputs, norm: Normaliser) -> LossOutput:
        return policy_loss(inputs, self.config, norm)

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


def grpo_advantages(rewards: Sequence[Sequence[float]], config: AlgorithmConfig) -> GroupAdvantages:
    """``config.estimator``'s advantages of groups given by their rewards alone (one trained token each)."""
    return estimate([[Scored(float(r), [True]) for r in group] for group in rewards], config)


_PRESETS: dict[str, AlgorithmConfig] = {
    # GRPO (DeepSeekMath): group-normalised advantages, PPO-clip, token-mean (verl's default aggregation).
    "grpo": AlgorithmConfig(),
    # Dr. GRPO: no division by the group's std, and a constant length normaliser instead of 1/|o_i|.
    "dr_grpo": AlgorithmConfig(norm_adv_by_std=False, aggregation="seq-mean-token-sum-norm"),
    # DAPO: asymmetric clip (clip-higher), token-level mean, zero-signal groups filtered out.
    "dapo": AlgorithmConfig(clip_low=0.2, clip_high=0.28),
    "rloo": AlgorithmConfig(estimator="rloo"),
    "reinforce_pp": AlgorithmConfig(estimator="reinforce_pp"),
    "reinforce_pp_baseline": AlgorithmConfig(estimator="reinforce_pp_baseline"),
    "grpo_passk": AlgorithmConfig(estimator="grpo_passk"),
    # GSPO (Qwen): the sequence's length-normalised ratio, clipped tightly, sequence-level mean.
    "gspo": AlgorithmConfig(loss="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"),
    # SAPO (Qwen): a soft, temperature-controlled gate instead of the hard clip.
    "sapo": AlgorithmConfig(loss="sapo", aggregation="seq-mean-token-mean"),
    # CISPO (MiniMax-M1): the clipped IS weight, detached, times log π; no lower bound on the ratio.
    "cispo": AlgorithmConfig(loss="cispo", clip_low=1.0, clip_high=0.28),
    # GPG: plain policy gradient, group-mean baseline scaled by the share of groups with a signal.
    "gpg": AlgorithmConfig(estimator="gpg", loss="gpg", norm_adv_by_std=False),
    # On-policy distillation: the teacher's per-token log-probs against the student's, as advantages.
    "opd": AlgorithmConfig(estimator="opd", skip_zero_advantage_groups=False),
    # REMAX: the reward of the prompt's greedy completion (the rollout's greedy_baseline) as the baseline.
    "remax": AlgorithmConfig(estimator="remax"),
    # PPO (Schulman et al. 2017; InstructGPT's RLHF form): GAE with a critic in the trainer, PPO-clip.
    "ppo": AlgorithmConfig(estimator="gae"),
    # IcePop (Ring-1T): tokens whose π_prox / π_behaviour leaves [0.5, 5] are masked out of the gradient.
    "icepop": AlgorithmConfig(is_mode="mask", is_lower=0.5, is_cap=5.0),
}
for _name, _config in _PRESETS.items():
    register(Algorithm(_name, _config))
