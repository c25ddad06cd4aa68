"""A multi-turn sample from the wire, its tool output masked (``loss_mask``): the masked tokens are context,
never trained. The optimizer step does not depend on their behaviour log-probs, nor on the ids of the
masked tokens that no trained token follows; unmasked, the same tokens do change it."""

from __future__ import annotations

from pathlib import Path

import torch

from tauflow.api.common.v1 import common_pb2
from tauflow.trainer.adapters.convert import group_from_proto
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.optim import OptimConfig

PROMPT = [1, 2, 3]
# model 4 5 | tool 6 7 | model 8 | tool 9 10
COMPLETION = [4, 5, 6, 7, 8, 9, 10]
MASK = [True, True, False, False, True, False, False]


def _group(tool_logprob: float, tail: list[int], mask: list[bool] | None) -> common_pb2.Group:
    completion = COMPLETION[:5] + tail
    logprobs = [-2.5 if m else tool_logprob for m in MASK]
    return common_pb2.Group(
        group_id="agent-1",
        samples=[
            common_pb2.Sample(
                sample_id=str(i),
                prompt_token_ids=PROMPT,
                completion_token_ids=completion,
                behaviour_logprobs=logprobs,
                token_versions=[0] * len(completion),
                loss_mask=mask or [],
                reward=common_pb2.Reward(score=score),
            )
            for i, score in enumerate((1.0, 0.0))  # two rewards: a non-zero advantage, a real gradient
        ],
    )


def _step(model_dir: Path, group: common_pb2.Group) -> tuple[dict[str, torch.Tensor], int]:
    backend = TorchBackend(TorchBackendConfig(model_path=str(model_dir), seed=0, optim=OptimConfig(lr=1e-2)))
    result = backend.train_step([group_from_proto(group)])
    assert result.committed
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}, result.trained_tokens


def test_masked_tool_tokens_get_no_loss_and_no_gradient(tiny_model_dir: Path) -> None:
    reference, tokens = _step(tiny_model_dir, _group(-2.5, [9, 10], MASK))
    assert tokens == 2 * MASK.count(True)  # per sample: the three model tokens
    # Garbage behaviour log-probs on the masked tokens, other ids at the masked tail: the same step.
    garbage, _ = _step(tiny_model_dir, _group(-50.0, [11, 12], MASK))
    for name, value in reference.items():
        assert torch.allclose(value, garbage[name], rtol=0, atol=1e-7), name
    # The same tokens trained (no mask): another step, so the comparison above can see a difference.
    unmasked, all_tokens = _step(tiny_model_dir, _group(-2.5, [9, 10], None))
    assert all_tokens == 2 * len(COMPLETION)
    assert any(not torch.allclose(value, unmasked[name], rtol=0, atol=1e-6) for name, value in reference.items())


def test_padding_with_a_non_finite_log_prob_gives_no_gradient_through_any_kl_estimator() -> None:
    """Outside the mask nothing counts, its gradient included: k2 and the straight-through estimators gave NaN
    there (0 · NaN in the backward) while the loss stayed finite (a peer's reference check found it)."""
    from tauflow.trainer.algorithms import AlgorithmConfig
    from tauflow.trainer.losses import KL_ESTIMATORS, LossInputs, Normaliser, policy_loss

    mask = torch.tensor([[True, True, False]])
    for estimator in KL_ESTIMATORS:
        for bad in (float("nan"), float("inf"), -float("inf")):
            logp = torch.tensor([[-0.5, -1.0, bad]], dtype=torch.float64, requires_grad=True)
            ref = torch.tensor([[-0.7, -0.9, bad]], dtype=torch.float64)
            inputs = LossInputs(logp, logp.detach(), torch.zeros(1, 3, dtype=torch.float64), mask, ref_logp=ref)
            out = policy_loss(inputs, AlgorithmConfig(kl_coef=0.1, kl_estimator=estimator), Normaliser.of(mask))
            out.loss.backward()
            assert torch.isfinite(out.loss), (estimator, bad)
            assert torch.isfinite(logp.grad).all() and float(logp.grad[0, 2]) == 0.0, (estimator, bad, logp.grad)


def test_an_empty_completion_gets_no_advantage_from_any_estimator() -> None:
    """The queue refuses empty completions, but ``estimate`` is public: reinforce_pp, gae and remax raised
    IndexError placing the outcome reward on a token that is not there."""
    from tauflow.trainer.advantages import ESTIMATORS, Scored, estimate
    from tauflow.trainer.algorithms import AlgorithmConfig

    for estimator in ESTIMATORS:
        group = [[Scored(1.0, [], values=[], baseline=0.5), Scored(0.0, [True, True], values=[0.1, 0.2], baseline=0.5)]]
        values = estimate(group, AlgorithmConfig(estimator=estimator)).values
        assert len(values) == 1 and len(values[0]) == 2, estimator
        if isinstance(values[0][0], list):  # per-token advantages: none for a completion without tokens
            assert values[0][0] == [] and len(values[0][1]) == 2, estimator
