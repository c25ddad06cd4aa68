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


def _saved_for_backward(compute: Callable[[], torch.Tensor]) -> int:
    """How many elements autograd keeps for the backward of ``compute()``'s graph, all tensors together."""
    sizes = [0]

    def pack_hook(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        compute().backward()
    return sum(sizes)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_logits_in_chunks_give_the_log_probs_entropy_and_gradients_of_the_whole(
    side: str, chunk: int, tiny_qwen2: TinyModel
) -> None:
    # backend.logits_chunk_tokens: the same values and weight gradients (temperature, a banned token, the
    # entropy's gradient) from the output layer's logits a chunk of positions at a time, checkpointed
    samples = _random_samples(5, 6)
    batch = pack(samples, [float(i % 3) - 1 for i in range(6)], padding_side=side, banned_ids=(7,))
    options = {"temperature": 0.7, "with_entropy": True, "entropy_grad": True}
    results = []
    for chunk_tokens in (0, chunk):
        model = tiny_qwen2(seed=6)
        lp = completion_logprobs(model, batch, logits_chunk_tokens=chunk_tokens, **options)
        assert lp.entropy is not None
        (lp.logprobs * batch.advantages - 0.1 * lp.entropy).masked_select(batch.loss_mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((lp.logprobs.detach(), lp.entropy.detach(), grads))
        assert "lm_head.weight" in grads and not isinstance(model.lm_head.__dict__.get("forward"), Callable)
    (whole_lp, whole_entropy, whole_grads), (lp_, entropy, grads) = results
    mask = batch.loss_mask | (batch.attention_mask[:, 1:] > 0)
    assert torch.allclose(lp_[mask], whole_lp[mask], atol=1e-6)
    assert torch.allclose(entropy[mask], whole_entropy[mask], atol=1e-5)
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, whole_grads[name], atol=1e-6), name
    # without the entropy's gradient it comes back detached, as logprobs_of_logits's does
    with_plain_entropy = completion_logprobs(tiny_qwen2(seed=6), batch, logits_chunk_tokens=chunk, with_entropy=True)
    assert with_plain_entropy.entropy is not None and not with_plain_entropy.entropy.requires_grad


def test_logits_in_chunks_keep_no_logits_for_the_backward() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab, chunk = 2048, 8
    torch.manual_seed(0)
    shape = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, intermediate_size=32, max_position_embeddings=64, **shape))
    rng = random.Random(0)
    samples = [Sample([rng.randrange(vocab) for _ in range(8)], [rng.randrange(vocab) for _ in range(24)],
                      [0.0] * 24) for _ in range(4)]  # fmt: skip
    batch = pack(samples, [1.0] * 4)
    tokens = batch.input_ids.numel()  # 128: the whole logits are 128 x 2048

    def loss(chunk_tokens: int) -> torch.Tensor:
        lp = completion_logprobs(model, batch, logits_chunk_tokens=chunk_tokens, with_entropy=True)
        return lp.logprobs.masked_select(batch.loss_mask).sum()

    whole, chunked = _saved_for_backward(lambda: loss(0)), _saved_for_backward(lambda: loss(chunk))
    print(f"saved for the backward: {whole} elements whole, {chunked} in chunks")
    assert whole >= 2 * (tokens - 4) * vocab  # the float32 logits, and the log-softmax's
    assert chunked <= tokens * vocab / 4  # the weights and the hidden states, no logits


def test_logits_in_chunks_refuse_a_model_that_changes_its_output_layers_logits(tiny_qwen2: TinyModel) -> None:
    class SoftCapped(torch.nn.Module):  # as Gemma 2's final_logit_softcapping does
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_qwen2(seed=1)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.inner.get_output_embeddings()

        def forward(self, **inputs: object) -> object:
            out = self.inner(**inputs)
            out.logits = 30.0 * torch.tanh(out.logits / 30.0)
            return out

    capped = SoftCapped()
    with pytest.raises(ValueError, match="logits_chunk_tokens"):
        completion_logprobs(capped, pack(_random_samples(1, 2)), logits_chunk_tokens=4)
    # the output layer is the model's own again
    assert "forward" not in capped.inner.lm_head.__dict__
    assert completion_logprobs(capped, pack(_random_samples(1, 2))).logprobs.shape[0] == 2


@pytest.mark.gpu
def test_cuda_logits_in_chunks_lower_the_peak_memory_of_a_forward_and_backward() -> None:
    # The reason for backend.logits_chunk_tokens, measured where it matters: the GPU's peak allocation of a
    # micro-batch's forward and backward in bfloat16 autocast, whole logits against chunks of 128 positions.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 65536
    shape = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, intermediate_size=128, **shape)).cuda()
    rng = random.Random(0)
    samples = [Sample([rng.randrange(vocab) for _ in range(64)], [rng.randrange(vocab) for _ in range(448)],
                      [0.0] * 448) for _ in range(4)]  # fmt: skip
    batch = pack(samples, [1.0] * 4).to("cuda")
    peaks, values = [], []
    for chunk in (0, 128):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp = completion_logprobs(model, batch, logits_chunk_tokens=chunk, with_entropy=True)
        (lp.logprobs * batch.advantages).masked_select(batch.loss_mask).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        values.append(lp.logprobs.detach())
    print(f"peak above the model: whole logits {peaks[0] / 2**20:.0f} MiB, chunks of 128 {peaks[1] / 2**20:.0f} MiB")
    assert peaks[1] < 0.25 * peaks[0]  # 2,048 x 65,536 logits: 512 MiB a float32 copy, several copies
    assert torch.allclose(values[1], values[0], atol=1e-3)
