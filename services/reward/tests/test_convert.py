"""Protobuf → what reward functions see, and the response back (no server)."""

from __future__ import annotations

from tauflow.api.common.v1 import common_pb2
from tauflow.reward import convert
from tauflow.reward.config import RewardConfig
from tauflow.reward.registry import build_registry
from tauflow.reward.runner import SampleResult, Status


def request_groups() -> list[common_pb2.Group]:
    return [
        common_pb2.Group(
            group_id="g", prompt_id="p", metadata={"answer": "4"},
            samples=[
                common_pb2.Sample(
                    sample_id="a", completion_text="4", prompt_token_ids=[1, 2], completion_token_ids=[3],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH, metadata={"k": "v"},
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
    assert (sr.reward.score, sr.reward.status, sr.reward.message) == (-1.0, common_pb2.REWARD_STATUS_TIMEOUT, "too slow")
    assert dict(sr.reward.components) == {"x": 0.5}
    assert (sr.duration.seconds, sr.duration.nanos) == (1, 250_000_000)
