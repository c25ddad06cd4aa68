"""Trajectories and groups as the queue takes them.

A trajectory is one sample of an episode: its prompt, then turns. A model turn (tokens sampled from
the policy, with their behaviour log-probs and policy versions) is trained on; an observation (a tool's
output, an environment's message) is context only: its tokens are in the completion, masked out of the
loss (``loss_mask`` 0), with log-prob 0 and the oldest version of the model's tokens, so that they
change neither the loss nor the sample's behaviour version.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tauflow.api.common.v1 import common_pb2
from tauflow.media import PromptPart
from tauflow.media import wire as media_wire


@dataclass(frozen=True)
class Completion:
    """One completion sampled from the rollout service (``RolloutClient.generate``)."""

    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each token under the policy that sampled it (the behaviour policy)."""
    versions: list[int]
    """Policy version that produced each token (a completion may span a weight update)."""
    finish_reason: str
    """"stop" (a stop or end-of-sequence token, included in ``token_ids``), "length", "abort" or ""."""
    text: str = ""

    @classmethod
    def from_proto(cls, sample: common_pb2.Sample) -> Completion:
        versions = list(sample.token_versions) or [sample.behaviour_version] * len(sample.completion_token_ids)
        reason = common_pb2.FinishReason.Name(sample.finish_reason).removeprefix("FINISH_REASON_").lower()
        return cls(
            list(sample.completion_token_ids),
            list(sample.behaviour_logprobs),
            versions,
            "" if reason == "unspecified" else reason,
            sample.completion_text,
        )


class Trajectory:
    """A sample built turn by turn: ``add_model`` / ``add_completion`` for the policy's tokens (trained),
    ``add_observation`` for a tool's or environment's tokens (masked out of the loss)."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("a trajectory needs a prompt (the first completion token is predicted from it)")
        self.prompt_token_ids = list(prompt_token_ids)
        self.completion_token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[bool] = []
        self._versions: list[int | None] = []  # None for observation tokens, filled in by to_sample
        self.finish_reason = ""

    @property
    def context(self) -> list[int]:
        """Prompt and completion so far: the prompt of the next model turn."""
        return self.prompt_token_ids + self.completion_token_ids

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_completion(self, completion: Completion) -> None:
        """Appends a sampled completion as a model turn."""
        self.add_model(completion.token_ids, completion.logprobs, completion.versions)
        self.finish_reason = completion.finish_reason

    def add_model(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Appends tokens sampled from the policy: trained on, corrected against ``logprobs``."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a model turn needs one log-prob and one version per token: {len(token_ids)} tokens, "
                f"{len(logprobs)} log-probs, {len(versions)} versions"
            )
        self.completion_token_ids += token_ids
        self.logprobs += logprobs
        self.loss_mask += [True] * len(token_ids)
        self._versions += versions

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Appends tokens the policy did not sample (a tool's output): context only, masked out of the loss."""
        self.completion_token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [False] * len(token_ids)
        self._versions += [None] * len(token_ids)

    def to_sample(
        self, sample_id: str, reward: float | None = None, *, text: str = "", metadata: Mapping[str, str] | None = None
    ) -> common_pb2.Sample:
        """The common Sample; ``reward`` may be left for the reward service (``RewardClient.score``)."""
        model_versions = [v for v in self._versions if v is not None]
        if not model_versions:
            raise ValueError(f"sample {sample_id!r} has no model tokens: nothing to train on")
        oldest = min(model_versions)
        sample = common_pb2.Sample(
            sample_id=sample_id,
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=self.completion_token_ids,
            behaviour_logprobs=self.logprobs,
            token_versions=[oldest if v is None else v for v in self._versions],
            # Only a trajectory with observations needs a mask: empty means every token trains.
            loss_mask=self.loss_mask if not all(self.loss_mask) else [],
            behaviour_version=oldest,
            completion_text=text,
            metadata=dict(metadata or {}),
        )
        if self.finish_reason:
            sample.finish_reason = common_pb2.FinishReason.Value(f"FINISH_REASON_{self.finish_reason.upper()}")
        if reward is not None:
            sample.reward.score = reward
            sample.reward.status = common_pb2.REWARD_STATUS_OK
        return sample


def make_group(
    samples: Sequence[common_pb2.Sample],
    *,
    group_id: str = "",
    prompt_id: str = "",
    metadata: Mapping[str, str] | None = None,
    baseline_reward: float | None = None,
    prompt_parts: Sequence[PromptPart] = (),
) -> common_pb2.Group:
    """A group of ``samples`` (one prompt's samples, trained together: their advantages are relative to
        each other). ``group_id`` must be unique for the run (Put is idempotent by it): a random one by
        default. The queue sets ``producer_id`` to the client name of the token. ``baseline_reward``: the reward
        of the prompt's greedy completion, for a trainer running REMAX (docs/algorithms.md). ``prompt_parts``: a
    multimodal prompt's parts (``tauflow.media``: ``Text``, and ``image``/``audio``/``video``/``from_file``
    media), sent once for the group; the samples' prompt token ids are the processor's tokenization of them
    (docs/omni.md)."""
    group = common_pb2.Group(
        group_id=group_id or uuid.uuid4().hex, prompt_id=prompt_id, samples=samples, metadata=dict(metadata or {})
    )
    if baseline_reward is not None:
        group.baseline_reward = baseline_reward
    group.prompt_parts.extend(media_wire.to_proto(prompt_parts))
    group.created_at.FromNanoseconds(time.time_ns())
    return group
