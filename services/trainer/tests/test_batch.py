"""Packing groups into tensors, masks aligned with the logits shift, and padding-invariant log-probs."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

VOCAB = 16  # the tiny model's vocabulary (conftest)
TinyModel = Callable[..., torch.nn.Module]

from tauflow.trainer.batch import (
    Group,
    Sample,
    completion_logprobs,
    logprobs_of_logits,
    pack,
    split_by_token_budget,
    unpack,
)

A = Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], loss_mask=[True, False, True], reward=1.0, sample_id="a")
B = Sample([6], [7], [-0.7], reward=0.0, sample_id="b")


def test_pack_right_padded_by_hand() -> None:
    # width 5; targets are input_ids[:, 1:] and sit at logits[:, :-1]
    # A: input [1 2 3 4 5], targets [2 3 4 5]: completion 3,4,5 at target columns 1,2,3; 4 is masked
    # B: input [6 7 _ _ _], targets [7 _ _ _]: completion 7 at target column 0
    b = pack([A, B], [0.5, -0.5], pad_token_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 1, 1, 1]]
    assert b.loss_mask.tolist() == [[False, True, False, True], [True, False, False, False]]
    assert torch.allclose(b.behaviour_logprobs, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.7, 0, 0, 0]]))
    assert b.advantages.tolist() == [[0, 0.5, 0, 0.5], [-0.5, 0, 0, 0]]
    assert b.num_tokens == 3


def test_pack_left_padded_by_hand() -> None:
    # B: input [_ _ _ 6 7], positions count real tokens only: [0 0 0 0 1]; target of 7 is column 3
    b = pack([A, B], [0.5, -0.5], pad_token_id=0, padding_side="left")
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [0, 0, 0, 6, 7]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    assert b.loss_mask.tolist() == [[False, True, False, True], [False, False, False, True]]
    assert b.advantages.tolist() == [[0, 0.5, 0, 0.5], [0, 0, 0, -0.5]]


def _random_samples(seed: int, n: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(1, 6), rng.randint(1, 7)
        mask = [rng.random() > 0.3 for _ in range(c)]
        out.append(
            Sample(
                [rng.randrange(VOCAB) for _ in range(p)],
                [rng.randrange(VOCAB) for _ in range(c)],
                [-float(j) for j in range(c)],
                loss_mask=mask,
                sample_id=str(i),
            )
        )
    return out


@pytest.mark.parametrize("side", ["right", "left"])
def test_masks_line_up_with_the_completion_tokens(side: str) -> None:
    samples = _random_samples(1, 8)
    b = pack(samples, [float(i) for i in range(8)], padding_side=side)
    targets = b.input_ids[:, 1:]
    for i, s in enumerate(samples):
        trained = [tok for tok, m in zip(s.completion_ids, s.mask, strict=True) if m]
        assert targets[i][b.loss_mask[i]].tolist() == trained
        behaviour = [lp for lp, m in zip(s.behaviour_logprobs, s.mask, strict=True) if m]
        assert b.behaviour_logprobs[i][b.loss_mask[i]].tolist() == behaviour
        assert set(b.advantages[i][b.loss_mask[i]].tolist()) <= {float(i)}
        assert unpack(b.behaviour_logprobs, samples, padding_side=side)[i] == pytest.approx(s.behaviour_logprobs)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_padding_invariant(side: str, temperature: float, tiny_qwen2: TinyModel) -> None:
    model = tiny_qwen2(seed=3).eval()
    samples = _random_samples(2, 6)
    with torch.no_grad():
        batched = completion_logprobs(model, pack(samples, padding_side=side, pad_token_id=5), temperature=temperature)
        together = unpack(batched.logprobs, samples, padding_side=side)
        for s, got in zip(samples, together, strict=True):
            alone = completion_logprobs(model, pack([s]), temperature=temperature).logprobs
            assert got == pytest.approx(unpack(alone, [s])[0], abs=1e-5)


def test_logprobs_match_a_hand_computed_log_softmax_at_temperature(tiny_qwen2: TinyModel) -> None:
    model = tiny_qwen2(seed=4).eval()
    s = Sample([1, 2, 3], [4, 5], [0.0, 0.0])
    with torch.no_grad():
        lp = completion_logprobs(model, pack([s]), temperature=2.0, with_entropy=True)
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0].float() / 2.0
        expected = torch.log_softmax(logits, -1)
        # completion token 4 is predicted at position 2, token 5 at position 3
        assert unpack(lp.logprobs, [s])[0] == pytest.approx([float(expected[2, 4]), float(expected[3, 5])], abs=1e-6)
        p = expected.exp()
        entropy = -(p * expected).sum(-1)
        assert lp.entropy is not None
        assert unpack(lp.entropy, [s])[0] == pytest.approx(entropy[2:4].tolist(), abs=1e-5)


def test_split_by_token_budget() -> None:
    # longest first: 10 (i1) alone (2·10 > 12); 5, 5 (i2, i3): 2·5 = 10 <= 12, a third row would be 15; 3 (i0)
    assert split_by_token_budget([3, 10, 5, 5], 12) == [[1], [2, 3], [0]]
    assert split_by_token_budget([30], 12) == [[0]]  # a row over the budget goes alone
    assert split_by_token_budget([2, 2, 2], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        split_by_token_budget([1], 0)


def test_sample_validation_and_versions() -> None:
    with pytest.raises(ValueError, match="behaviour log-probs"):
        Sample([1], [2, 3], [-1.0])
    with pytest.raises(ValueError, match="loss_mask"):
        Sample([1], [2, 3], [-1.0, -1.0], loss_mask=[True])
    with pytest.raises(ValueError, match="prompt is empty"):
        Sample([], [2], [-1.0])
    with pytest.raises(ValueError, match="no samples"):
        Group("g", [])
    s = Sample([1], [2, 3], [-1.0, -1.0], versions=[4, 3])
    assert s.oldest_version == 3 and s.mask == [True, True]
    g = Group("g", [s, Sample([1], [2], [-1.0], behaviour_version=5)])
    assert g.oldest_version == 3
    assert g.staleness(7) == 4 and g.staleness(2) == 0


def test_group_from_proto() -> None:
    from tauflow.api.common.v1 import common_pb2
    from tauflow.trainer.adapters.convert import group_from_proto

    pb = common_pb2.Group(
        group_id="g1",
        samples=[
            common_pb2.Sample(
                sample_id="0",
                prompt_token_ids=[1, 2],
                completion_token_ids=[3, 4],
                behaviour_logprobs=[-0.5, -0.25],
                token_versions=[2, 1],
                reward=common_pb2.Reward(score=1.0),
            ),
            common_pb2.Sample(
                sample_id="1",
                prompt_token_ids=[1, 2],
                completion_token_ids=[5],
                behaviour_logprobs=[-1.0],
                loss_mask=[False],
                behaviour_version=3,
            ),
        ],
    )
    g = group_from_proto(pb)
    assert g.group_id == "g1" and g.oldest_version == 1
    assert g.samples[0].mask == [True, True] and g.samples[0].reward == 1.0
    assert g.samples[1].mask == [False] and g.samples[1].oldest_version == 3
    assert g.baseline_reward is None  # no greedy completion came with it
    pb.baseline_reward = 0.0
    assert group_from_proto(pb).baseline_reward == 0.0  # a baseline of 0 is one


def test_a_banned_tokens_gradient_stays_finite_under_a_loss_scale() -> None:
    # A banned token's logit is finite and its probability 0; the entropy's gradient through it stays 0 (not 0
    # times an overflow) however large the upstream gradient (fp16's loss scale).
    batch = pack([Sample([1, 2], [3, 4], [-1.0, -1.0])], banned_ids=(5,))
    logits = torch.randn(1, 4, 8, requires_grad=True)
    lp = logprobs_of_logits(logits, batch, with_entropy=True, entropy_grad=True)
    assert lp.entropy is not None
    (1e12 * (lp.entropy.sum() - lp.logprobs.sum())).backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert float(logits.grad[..., 5].abs().max()) == 0.0
