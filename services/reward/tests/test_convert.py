"""Protobuf → what reward functions see, and the response back (no server)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from google.protobuf import duration_pb2, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from tauflow.api.common.v1 import common_pb2
from tauflow.reward.adapters import convert
from tauflow.reward.config import LimitsConfig, RewardConfig
from tauflow.reward.errors import InvalidRequest
from tauflow.reward.metrics import field_label
from tauflow.reward.registry import build_registry
from tauflow.reward.runner import SampleResult, Status


def request_groups() -> list[common_pb2.Group]:
    return [
        common_pb2.Group(
            group_id="g",
            prompt_id="p",
            metadata={"answer": "4"},
            samples=[
                common_pb2.Sample(
                    sample_id="a",
                    completion_text="4",
                    prompt_token_ids=[1, 2],
                    completion_token_ids=[3],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    metadata={"k": "v"},
                )
            ],
        )
    ]


def test_samples_carry_text_metadata_and_finish_reason_and_token_ids_only_on_demand() -> None:
    (g,) = convert.groups_from_proto(request_groups(), uses_token_ids=False)
    (s,) = g.samples
    assert (s.sample_id, s.completion_text, s.group_id, s.prompt_id) == ("a", "4", "g", "p")
    assert (dict(s.metadata), s.get("answer"), s.finish_reason) == ({"k": "v"}, "4", "length")
    assert s.completion_token_ids == () and s.prompt_token_ids == ()
    (g,) = convert.groups_from_proto(request_groups(), uses_token_ids=True)
    assert g.samples[0].completion_token_ids == (3,) and g.samples[0].prompt_token_ids == (1, 2)


def test_response_keeps_order_status_components_message_and_duration() -> None:
    fn = build_registry(RewardConfig(load_entry_points=False)).get("exact_match")
    groups = convert.groups_from_proto(request_groups(), uses_token_ids=False)
    results = [[SampleResult(Status.TIMEOUT, -1.0, {"x": 0.5}, "too slow", 1.25, "timeout")]]
    resp = convert.score_response(fn, groups, results)
    (sr,) = resp.groups[0].samples
    assert resp.reward_fn == "exact_match" and resp.groups[0].group_id == "g" and sr.sample_id == "a"
    assert (sr.reward.score, sr.reward.status, sr.reward.message) == (
        -1.0,
        common_pb2.REWARD_STATUS_TIMEOUT,
        "too slow",
    )
    assert dict(sr.reward.components) == {"x": 0.5}
    assert (sr.duration.seconds, sr.duration.nanos) == (1, 250_000_000)


# -- bounds and refusals (issue #11: every string and list bounded, bad input named) ------------------------

LIMITS = LimitsConfig(
    max_id_chars=8, max_text_chars=16, max_map_entries=2, max_tokens_per_sample=4, max_config_bytes=64
)


def _with(**edit: Any) -> list[common_pb2.Group]:
    """request_groups() with one field of the group (``group__*``) or of its sample (``sample__*``) replaced."""
    groups = request_groups()
    for key, value in edit.items():
        where, _, name = key.partition("__")
        target = groups[0] if where == "group" else groups[0].samples[0]
        path = name.split("__")
        for part in path[:-1]:
            target = getattr(target, part)
        field = getattr(target, path[-1])
        if isinstance(value, dict):
            field.update(value)
        elif isinstance(value, list):
            field.extend(value)
        else:
            setattr(target, path[-1], value)
    return groups


@pytest.mark.parametrize(
    ("edit", "field", "key"),
    [
        ({"group__group_id": "g" * 9}, "groups[0].group_id", "max_id_chars"),
        ({"group__prompt_id": "p" * 9}, "groups[0].prompt_id", "max_id_chars"),
        ({"group__producer_id": "p" * 9}, "groups[0].producer_id", "max_id_chars"),
        ({"group__metadata": {"a": "1", "b": "2"}}, "groups[0].metadata", "max_map_entries"),  # 3 entries
        ({"group__metadata": {"k" * 9: "1"}}, "groups[0].metadata['kkkkkkkkk']", "max_id_chars"),
        ({"group__metadata": {"answer": "4" * 17}}, "groups[0].metadata['answer']", "max_text_chars"),
        ({"sample__sample_id": "s" * 9}, "groups[0].samples[0].sample_id", "max_id_chars"),
        ({"sample__completion_text": "x" * 17}, "groups[0].samples[0].completion_text", "max_text_chars"),
        ({"sample__metadata": {"v": "x" * 17}}, "groups[0].samples[0].metadata['v']", "max_text_chars"),
        ({"sample__prompt_token_ids": [1, 2, 3]}, "groups[0].samples[0].prompt_token_ids", "max_tokens_per_sample"),
        (
            {"sample__completion_token_ids": [1] * 4},
            "groups[0].samples[0].completion_token_ids",
            "max_tokens_per_sample",
        ),
        ({"sample__behaviour_logprobs": [0.0] * 5}, "groups[0].samples[0].behaviour_logprobs", "max_tokens_per_sample"),
        ({"sample__token_versions": [0] * 5}, "groups[0].samples[0].token_versions", "max_tokens_per_sample"),
        ({"sample__loss_mask": [True] * 5}, "groups[0].samples[0].loss_mask", "max_tokens_per_sample"),
        (
            {"sample__reward__components": {"a": 1.0, "b": 2.0, "c": 3.0}},
            "groups[0].samples[0].reward.components",
            "max_map_entries",
        ),
    ],
)
def test_every_string_and_list_of_a_group_is_bounded(edit: dict[str, Any], field: str, key: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        convert.groups_from_proto(_with(**edit), uses_token_ids=False, limits=LIMITS)
    assert e.value.field == field and f"(limits.{key})" in str(e.value) and str(e.value).startswith(field + ": ")
    convert.groups_from_proto(request_groups(), uses_token_ids=False, limits=LIMITS)  # the unedited groups pass


@settings(max_examples=300, deadline=None)
@given(
    sample_id=st.text(max_size=6),
    text=st.text(max_size=6),
    tokens=st.lists(st.integers(0, (1 << 31) - 1), max_size=6),
    logprobs=st.lists(st.floats(-50, 0), max_size=6),
    mask=st.lists(st.booleans(), max_size=6),
    limit=st.integers(1, 8),
    token_limit=st.integers(0, 8),
)
def test_the_quick_bound_check_accepts_only_what_the_field_by_field_check_accepts(
    sample_id: str,
    text: str,
    tokens: list[int],
    logprobs: list[float],
    mask: list[bool],
    limit: int,
    token_limit: int,
) -> None:
    sample = common_pb2.Sample(
        sample_id=sample_id,
        completion_text=text,
        completion_token_ids=tokens,
        prompt_token_ids=tokens[:2],
        behaviour_logprobs=logprobs,
        loss_mask=mask,
    )
    limits = LimitsConfig(max_id_chars=limit, max_text_chars=limit, max_tokens_per_sample=token_limit)
    if convert._sample_in_bounds(sample, limits):
        convert._check_sample("s", sample, limits)  # raises if the quick check let an oversized field through


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda g: setattr(g.trace_context, "traceparent", "0" * 129), "groups[0].trace_context.traceparent"),
        (lambda g: setattr(g.trace_context, "tracestate", "k=" + "v" * 511), "groups[0].trace_context.tracestate"),
        (lambda g: setattr(g.samples[0].reward, "message", "m" * 4097), "groups[0].samples[0].reward.message"),
        (lambda g: g.samples.extend([common_pb2.Sample(sample_id=str(i)) for i in range(4096)]), "groups[0].samples"),
    ],
)
def test_the_bounds_common_proto_fixes_for_every_group(edit: Any, field: str) -> None:
    groups = request_groups()
    edit(groups[0])
    with pytest.raises(InvalidRequest) as e:
        convert.groups_from_proto(groups, uses_token_ids=False)
    assert e.value.field == field and "over the limit of" in str(e.value)


def test_a_refusal_quotes_a_hostile_name_cut_short() -> None:
    groups = request_groups() * 2
    groups[0].group_id = groups[1].group_id = "g" * 200
    with pytest.raises(InvalidRequest) as e:
        convert.groups_from_proto(groups, uses_token_ids=False)
    assert e.value.field == "groups[1].group_id" and len(str(e.value)) < 200 and "(200 characters)" in str(e.value)


def _struct(**values: Any) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"correct_score": math.nan}, "config.correct_score"),
        ({"x": math.inf}, "config.x"),
        ({"nested": {"deep": [1.0, -math.inf]}}, "config.nested.deep[1]"),
    ],
)
def test_config_refuses_nan_and_infinities_naming_the_key(values: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        convert.config_from_proto(_struct(**values), max_bytes=1024)
    assert e.value.field == field and "not a finite number" in str(e.value)


def test_config_is_bounded_and_read_as_plain_values() -> None:
    with pytest.raises(InvalidRequest, match=r"^config: 115 bytes, over .* \(limits.max_config_bytes\)"):
        convert.config_from_proto(_struct(pattern="x" * 100), max_bytes=64)
    config = _struct(a=1.0, b="s", c=True, d=None, e=[1.0, "x"], f={"g": False})
    config.fields["unset"].CopyFrom(struct_pb2.Value())
    assert convert.config_from_proto(config, max_bytes=1024) == {
        "a": 1.0,
        "b": "s",
        "c": True,
        "d": None,
        "e": [1.0, "x"],
        "f": {"g": False},
        "unset": None,
    }


@pytest.mark.parametrize(
    ("seconds", "nanos", "message"),
    [
        (0, 0, "sample_timeout: must be positive"),
        (1, -1, "sample_timeout: must be positive"),
        (0, 1_000_000_000, "sample_timeout.nanos: 1000000000 is outside"),
        (-5, 0, "sample_timeout: must be positive"),
        (2**40, 0, "sample_timeout: 1.09951e+12 s is over this service's limit of 600 s"),
    ],
)
def test_sample_timeout_is_a_positive_bounded_duration(seconds: int, nanos: int, message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        convert.sample_timeout_s(duration_pb2.Duration(seconds=seconds, nanos=nanos), 600.0)
    assert convert.sample_timeout_s(duration_pb2.Duration(seconds=1, nanos=500_000_000), 600.0) == 1.5


@pytest.mark.parametrize(
    ("field", "label"),
    [
        ("groups[3].samples[0].completion_text", "groups.samples.completion_text"),
        ("groups[0].metadata['a.b[1]']", "groups.metadata"),
        ("groups[0].samples[2].reward.components['x']", "groups.samples.reward.components"),
        ("config.anything_a_client_sends", "config"),
        ("config", "config"),
        ("sample_timeout.nanos", "sample_timeout.nanos"),
        ("request", "request"),
    ],
)
def test_metric_labels_name_the_field_not_the_clients_values(field: str, label: str) -> None:
    assert field_label(field) == label


def test_a_multimodal_prompts_parts_reach_functions_that_ask_for_them() -> None:
    import numpy as np

    from tauflow import media
    from tauflow.media import wire as media_wire

    parts = [media.image(np.zeros((8, 8, 3), np.uint8)), media.Text("how many?")]
    groups = request_groups()
    groups[0].prompt_parts.extend(media_wire.to_proto(parts))
    (g,) = convert.groups_from_proto(groups, uses_token_ids=False)
    assert list(g.prompt_parts) == parts and g.samples[0].prompt_parts == ()  # a group-level copy only
    (g,) = convert.groups_from_proto(groups, uses_token_ids=False, uses_prompt_parts=True)
    assert list(g.samples[0].prompt_parts) == parts
    decoded = media.decode(g.samples[0].prompt_parts[0], media.MediaLimits())
    assert decoded.image is not None and decoded.image.shape == (8, 8, 3)  # what a reward function can read
    groups[0].prompt_parts[0].media.media_type = "image/tiff"
    with pytest.raises(InvalidRequest) as e:
        convert.groups_from_proto(groups, uses_token_ids=False)
    assert e.value.field == "groups[0].prompt_parts[0].media.media_type"
    groups[0].prompt_parts.add()  # neither text nor media
    groups[0].prompt_parts[0].media.media_type = "image/png"
    with pytest.raises(InvalidRequest) as e:
        convert.groups_from_proto(groups, uses_token_ids=False)
    assert e.value.field == "groups[0].prompt_parts[2]"
