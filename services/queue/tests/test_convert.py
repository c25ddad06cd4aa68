"""Validation and conversion of incoming groups (convert.group_to_record), without gRPC."""

from __future__ import annotations

import math
import re

import pytest

from tauflow.api.common.v1 import common_pb2
from tauflow.queue.adapters import convert

LIMIT = 1 << 20


def sample(
    sample_id: str = "0",
    prompt: tuple[int, ...] = (1, 2, 3),
    completion: tuple[int, ...] = (4, 5),
    logprobs: tuple[float, ...] | None = None,
    versions: tuple[int, ...] | None = None,
    mask: tuple[bool, ...] | None = None,
    behaviour_version: int = 0,
    score: float = 1.0,
) -> common_pb2.Sample:
    s = common_pb2.Sample(
        sample_id=sample_id,
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        behaviour_version=behaviour_version,
        reward=common_pb2.Reward(score=score),
    )
    # (one per completion token unless the test says otherwise: the contract requires them)
    s.behaviour_logprobs.extend((-0.5,) * len(completion) if logprobs is None else logprobs)
    if versions is not None:
        s.token_versions.extend(versions)
    if mask is not None:
        s.loss_mask.extend(mask)
    return s


def group(*samples: common_pb2.Sample, group_id: str = "g1") -> common_pb2.Group:
    return common_pb2.Group(group_id=group_id, prompt_id="p", samples=list(samples))


def invalid(g: common_pb2.Group, limit: int = LIMIT) -> str:
    with pytest.raises(convert.InvalidGroup) as err:
        convert.group_to_record(g, limit)
    return str(err.value)


# -- well-formed groups ---------------------------------------------------------------------


def test_valid_group_record_fields() -> None:
    g = group(
        sample("0", prompt=(1, 2, 3), completion=(4, 5), logprobs=(-0.1, -2.0), versions=(3, 4), mask=(True, False)),
        sample("1", prompt=(1, 2, 3), completion=(6, 7, 8), versions=(5, 5, 5), behaviour_version=5),
        group_id="abc",
    )
    rec = convert.group_to_record(g, LIMIT)
    assert rec.group_id == "abc"
    assert rec.behaviour_version == 3  # min over samples of min over tokens
    assert rec.n_tokens == (3 + 2) + (3 + 3)  # prompt + completion tokens of every sample
    assert rec.payload == g.SerializeToString()
    back = common_pb2.Group()
    back.ParseFromString(rec.payload)
    assert back == g
    assert rec.size == len(rec.payload)


def test_behaviour_version_without_token_versions_uses_sample_field() -> None:
    g = group(sample("0", behaviour_version=7), sample("1", behaviour_version=4), sample("2", versions=(9, 6)))
    rec = convert.group_to_record(g, LIMIT)
    assert rec.behaviour_version == 4
    assert rec.n_tokens == 3 * (3 + 2)


def test_behaviour_version_is_oldest_token_across_a_weight_update() -> None:
    # A sample whose generation spanned an update keeps the version of every token: its behaviour
    # version is the oldest one, wherever in the completion it sits.
    g = group(sample("0", completion=(1, 2, 3, 4), versions=(8, 8, 7, 9)), sample("1", versions=(8, 8)))
    assert convert.group_to_record(g, LIMIT).behaviour_version == 7


def test_matching_behaviour_version_and_token_versions_is_accepted() -> None:
    rec = convert.group_to_record(group(sample(versions=(2, 3), behaviour_version=2)), LIMIT)
    assert rec.behaviour_version == 2


def test_zero_logprob_and_optional_fields_accepted() -> None:
    rec = convert.group_to_record(group(sample(logprobs=(0.0, -1e9), mask=(False, True))), LIMIT)
    assert rec.behaviour_version == 0


def test_group_exactly_at_the_byte_limit_is_accepted() -> None:
    g = group(sample())
    size = len(g.SerializeToString())
    assert convert.group_to_record(g, size).size == size


# -- malformed groups: InvalidGroup naming the field ---------------------------------------


def test_empty_group_id() -> None:
    assert "group_id" in invalid(group(sample(), group_id=""))


def test_overlong_group_id() -> None:
    assert "group_id" in invalid(group(sample(), group_id="x" * (convert.MAX_ID_CHARS + 1)))
    convert.group_to_record(group(sample(), group_id="x" * convert.MAX_ID_CHARS), LIMIT)


def test_no_samples() -> None:
    msg = invalid(group(group_id="nos"))
    assert "samples" in msg and "nos" in msg


def test_empty_prompt() -> None:
    msg = invalid(group(sample("0"), sample("1", prompt=())))
    assert "samples[1]" in msg and "prompt_token_ids" in msg


def test_empty_completion() -> None:
    msg = invalid(group(sample(completion=())))
    assert "samples[0]" in msg and "completion_token_ids" in msg


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("behaviour_logprobs", {"logprobs": (-0.5,)}),
        ("behaviour_logprobs", {"logprobs": (-0.5, -0.5, -0.5)}),
        ("token_versions", {"versions": (1,)}),
        ("token_versions", {"versions": (1, 1, 1)}),
        ("loss_mask", {"mask": (True,)}),
        ("loss_mask", {"mask": (True, True, False)}),
    ],
)
def test_length_mismatch(field: str, kwargs: dict) -> None:
    msg = invalid(group(sample("0"), sample("1", **kwargs)))
    assert f"samples[1].{field}" in msg


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.5, 3.0])
def test_non_finite_or_positive_logprob(bad: float) -> None:
    msg = invalid(group(sample(logprobs=(-0.1, bad))))
    assert "behaviour_logprobs" in msg


def test_behaviour_version_differs_from_min_token_versions() -> None:
    msg = invalid(group(sample(versions=(3, 4), behaviour_version=4)))
    assert "behaviour_version" in msg and "token_versions" in msg
    msg = invalid(group(sample(versions=(3, 4), behaviour_version=2)))
    assert "behaviour_version" in msg


def test_non_finite_reward() -> None:
    assert "reward" in invalid(group(sample(score=math.nan)))


def test_repeated_sample_id() -> None:
    msg = invalid(group(sample("a"), sample("a")))
    assert "sample_id" in msg


def test_oversize_group() -> None:
    g = group(sample(completion=tuple(range(1000))), group_id="big")
    size = len(g.SerializeToString())
    msg = invalid(g, limit=size - 1)
    assert "big" in msg and str(size) in msg and "bytes" in msg


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_baseline_reward_that_is_not_finite_is_refused_by_name(bad: float) -> None:
    g = group(sample())
    g.baseline_reward = bad
    assert "group.baseline_reward is not finite" in invalid(g)
    g.baseline_reward = 0.25  # a finite one travels with the group
    convert.group_to_record(g, LIMIT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda g: setattr(g.created_at, "seconds", 2**62),
            "group.created_at is not a valid google.protobuf.Timestamp",
        ),
        (lambda g: setattr(g.created_at, "nanos", -1), "group.created_at is not a valid google.protobuf.Timestamp"),
        (lambda g: setattr(g.samples[0], "finish_reason", 99), "samples[0].finish_reason 99 is not a FinishReason"),
        (lambda g: setattr(g.samples[0].reward, "status", -5), "samples[0].reward.status -5 is not a RewardStatus"),
        (lambda g: setattr(g, "group_id", "a\x00b"), "group.group_id holds a control character"),
        (lambda g: setattr(g.samples[0], "sample_id", "0\n"), "samples[0].sample_id holds a control character"),
    ],
)
def test_values_no_consumer_can_read_are_refused_by_both_paths(change, message: str) -> None:
    # Timestamps beyond what the well-known type allows (ToDatetime raises), enum values no name matches, and
    # control characters in ids were stored, latent poison for the next consumer (a dashboard, an export).
    from tauflow.queue.adapters import wire

    g = group(sample("0"), sample("1"))
    change(g)
    assert message in invalid(g)
    with pytest.raises(convert.InvalidGroup, match=re.escape(message)):
        wire.group_record(g.SerializeToString(), LIMIT)  # (the wire fast path checks the same)
