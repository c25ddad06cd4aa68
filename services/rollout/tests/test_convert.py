"""Completions -> protobuf: the contract's invariants hold on what the rollout sends."""

from __future__ import annotations

from tauflow.rollout.adapters.convert import sample_to_proto
from tauflow.rollout.engine.base import Completion, FinishReason


def test_behaviour_version_is_the_oldest_token_version() -> None:
    # A completion that spanned a weight update: its behaviour version is that of its oldest token, as
    # common.proto requires (behaviour_version == min(token_versions)); a caller of Generate reads it.
    c = Completion([5, 6, 2], [-0.1, -0.2, -0.3], [7, 8, 8], FinishReason.STOP)
    sample = sample_to_proto(0, [1, 4], c)
    assert sample.behaviour_version == 7 and list(sample.token_versions) == [7, 8, 8]


def test_an_empty_completion_has_version_zero_and_no_token_versions() -> None:
    sample = sample_to_proto(0, [1, 4], Completion([], [], [], FinishReason.ABORT))
    assert sample.behaviour_version == 0 and not sample.token_versions


def test_the_greedy_baseline_travels_with_the_group_and_only_when_made() -> None:
    from tauflow.rollout.adapters.convert import group_to_proto
    from tauflow.rollout.dataset import Prompt
    from tauflow.rollout.ports import ProducedGroup

    c = Completion([5], [-0.1], [0], FinishReason.STOP)
    made = group_to_proto(ProducedGroup("g", Prompt("p", [1]), [c], [""], baseline_reward=0.0))
    assert made.HasField("baseline_reward") and made.baseline_reward == 0.0  # 0 is a baseline, not "none"
    assert not group_to_proto(ProducedGroup("g", Prompt("p", [1]), [c], [""])).HasField("baseline_reward")


def test_a_multimodal_prompts_parts_travel_once_per_group() -> None:
    from tauflow import media
    from tauflow.media import wire as media_wire
    from tauflow.rollout.adapters.convert import group_to_proto
    from tauflow.rollout.dataset import Prompt
    from tauflow.rollout.ports import ProducedGroup

    parts = [media.Media(media.Modality.AUDIO, "audio/wav", data=b"RIFF", num_tokens=3), media.Text("=")]
    c = Completion([5], [-0.1], [0], FinishReason.STOP)
    group = group_to_proto(ProducedGroup("g", Prompt("p", [1, 7, 7, 7, 2], parts=parts), [c, c], ["", ""]))
    assert media_wire.from_proto(group.prompt_parts) == parts
    assert all(list(s.prompt_token_ids) == [1, 7, 7, 7, 2] for s in group.samples)


def test_a_group_is_encoded_once_and_what_changes_after_scoring_is_set_anew() -> None:
    from tauflow.api.common.v1 import common_pb2
    from tauflow.rollout.adapters.convert import group_to_proto
    from tauflow.rollout.dataset import Prompt
    from tauflow.rollout.ports import ProducedGroup

    c = Completion([5, 6], [-0.1, -0.2], [3, 3], FinishReason.STOP)
    g = ProducedGroup("g", Prompt("p", [1]), [c, c], ["a", "b"])
    scored = group_to_proto(g)  # as the reward call sends it: no rewards, no trace context yet
    assert not any(s.HasField("reward") for s in scored.samples) and not scored.trace_context.traceparent
    g.rewards = [common_pb2.Reward(score=1.0), common_pb2.Reward(score=0.0)]
    g.baseline_reward, g.traceparent = 0.5, "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    put = group_to_proto(g)
    assert put is g.encoded  # the samples were not encoded again
    assert [s.reward.score for s in put.samples] == [1.0, 0.0] and put.baseline_reward == 0.5
    assert put.trace_context.traceparent == g.traceparent
    assert [list(s.completion_token_ids) for s in put.samples] == [[5, 6], [5, 6]]
    g.rewards, g.baseline_reward = [], None  # (what is taken away goes too)
    again = group_to_proto(g)
    assert not any(s.HasField("reward") for s in again.samples) and not again.HasField("baseline_reward")
