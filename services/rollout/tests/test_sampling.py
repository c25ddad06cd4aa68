"""The batched sampler as pure tensor functions: truncation, behaviour log-probs, greedy rows, the counter RNG."""

from __future__ import annotations

import math

import pytest
import torch

from tauflow.rollout.engine.base import InvalidRequestError, SamplingParams
from tauflow.rollout.engine.sampling import counter_uniforms, row_keys, sample_tokens

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


def _draw(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, draws: int = 20000):
    rows = logits.expand(draws, -1)
    return sample_tokens(
        rows,
        torch.full((draws,), temperature),
        torch.full((draws,), top_p),
        torch.full((draws,), top_k, dtype=torch.long),
        torch.rand(draws, dtype=torch.float64),
    )


@pytest.mark.parametrize(
    ("top_p", "nucleus"), [(0.45, {1}), (0.51, {1, 3}), (0.79, {1, 3}), (0.81, {1, 3, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_never_draws_outside_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    torch.manual_seed(0)
    tokens, logprobs = _draw(PROBS.log()[None], top_p=top_p)
    assert set(tokens.tolist()) == nucleus
    # frequencies follow the renormalized nucleus
    mass = sum(PROBS[t].item() for t in nucleus)
    for t in nucleus:
        assert (tokens == t).double().mean().item() == pytest.approx(PROBS[t].item() / mass, abs=0.015)
    # behaviour log-probs are those of the full distribution, before truncation
    assert torch.allclose(logprobs, PROBS.log()[tokens], atol=1e-6)


def test_top_k_and_top_p_together_keep_the_intersection() -> None:
    torch.manual_seed(0)
    tokens, _ = _draw(PROBS.log()[None], top_k=3, top_p=1.0)
    assert set(tokens.tolist()) == {1, 3, 2}
    tokens, _ = _draw(PROBS.log()[None], top_k=3, top_p=0.6)
    assert set(tokens.tolist()) == {1, 3}
    tokens, _ = _draw(PROBS.log()[None], top_k=1)
    assert set(tokens.tolist()) == {1}


def test_temperature_scales_the_distribution_and_the_logprobs() -> None:
    torch.manual_seed(0)
    logits = PROBS.log()[None]
    tokens, logprobs = _draw(logits, temperature=0.5)
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    for t in range(4):
        assert (tokens == t).double().mean().item() == pytest.approx(expected[t].item(), abs=0.015)
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-5)


def test_greedy_rows_take_the_argmax_and_report_temperature_one_logprobs() -> None:
    logits = torch.randn(6, 10)
    tokens, logprobs = sample_tokens(
        logits, torch.zeros(6), torch.ones(6), torch.zeros(6, dtype=torch.long), torch.rand(6, dtype=torch.float64)
    )
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])


def test_rows_with_different_parameters_in_one_batch_and_the_fast_paths_agree() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 12)
    temp = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 4, 0, 2])
    u = torch.rand(5, dtype=torch.float64)
    tokens, logprobs = sample_tokens(logits, temp, top_p, top_k, u)
    for i in range(5):  # each row alone, with the fast paths a lone row allows, draws the same token
        alone, lp = sample_tokens(
            logits[i : i + 1],
            temp[i : i + 1],
            top_p[i : i + 1],
            top_k[i : i + 1],
            u[i : i + 1],
            truncate=bool(top_p[i] < 1 or top_k[i] > 0),
            any_greedy=bool(temp[i] == 0),
        )
        assert alone.item() == tokens[i].item()
        assert lp.item() == pytest.approx(logprobs[i].item(), abs=1e-6)
    scale = torch.where(temp > 0, temp, 1.0)
    assert torch.allclose(logprobs, torch.log_softmax(logits / scale[:, None], -1).gather(1, tokens[:, None])[:, 0])


def test_a_token_of_zero_probability_is_never_drawn_even_at_the_edges() -> None:
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).expand(3, -1)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-32], dtype=torch.float64)
    tokens, _ = sample_tokens(logits, torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long), u)
    assert tokens.tolist() == [0, 2, 2]


def test_counter_uniforms_are_deterministic_uniform_and_depend_on_every_input() -> None:
    seeds = torch.tensor([0, 1, -1, 2**62, 12345] * 2000)
    streams = torch.arange(seeds.numel())
    keys = row_keys(seeds, streams)
    u = counter_uniforms(keys, torch.zeros_like(keys))
    assert torch.equal(u, counter_uniforms(row_keys(seeds, streams), torch.zeros_like(keys)))
    assert bool((u >= 0).all()) and bool((u < 1).all())
    assert u.mean().item() == pytest.approx(0.5, abs=0.01)
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert bool((counts > 850).all()) and bool((counts < 1150).all())
    assert u.unique().numel() > 0.99 * u.numel()
    assert not torch.equal(u, counter_uniforms(keys, torch.ones_like(keys)))
    assert row_keys(torch.tensor([7]), torch.tensor([0])) != row_keys(torch.tensor([8]), torch.tensor([0]))
    assert row_keys(torch.tensor([7]), torch.tensor([0])) != row_keys(torch.tensor([7]), torch.tensor([1]))
    assert row_keys(torch.tensor([7]), torch.tensor([0])) != row_keys(torch.tensor([7 + 2**32]), torch.tensor([0]))


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_new_tokens=0),
        dict(n=0),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=1e-40),  # logits / 1e-40 overflow float32: NaN log-probs
        dict(temperature=9e-6),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(stop_token_ids=(-3,)),
        dict(seed=-1),
        dict(seed=2**64),
    ],
)
def test_sampling_params_reject_out_of_range_values(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_the_smallest_temperature_is_accepted_as_the_proto_carries_it() -> None:
    from tauflow.rollout.engine.base import MIN_TEMPERATURE

    as_float32 = torch.tensor(MIN_TEMPERATURE, dtype=torch.float32).item()  # a little below 1e-5
    assert SamplingParams(temperature=as_float32).temperature == as_float32
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("temperature", [1.0, 1e-40, 0.0])
def test_a_row_of_non_finite_logits_gets_a_token_in_range_and_leaves_the_others_alone(temperature: float) -> None:
    # logits / 1e-40 are inf, as a model that overflows gives: the row's log-prob says so, the index stays in range
    logits = torch.stack([PROBS.log(), torch.tensor([1.0, float("nan"), 0.0, 2.0]), PROBS.log() * 3])
    temps = torch.tensor([1.0, 1.0, temperature])
    tokens, logprobs = sample_tokens(
        logits, temps, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.tensor([0.01, 0.99, 0.5])
    )
    assert bool(((tokens >= 0) & (tokens < 4)).all())
    assert not math.isfinite(logprobs[1].item())
    assert tokens[0].item() == 0 and logprobs[0].item() == pytest.approx(math.log(0.05), abs=1e-6)
    assert math.isfinite(logprobs[2].item()) == (temperature != 1e-40)


def test_a_negative_stop_id_is_named_by_its_index_not_by_quoting_the_list() -> None:
    """The message quoted the whole list: 100,000 ids made a refusal bigger than clients take in trailers."""
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(stop_token_ids=tuple([7] * 3 + [-1] * 100_000))
    assert str(refused.value) == "stop_token_ids[3] is -1: token ids are non-negative"
