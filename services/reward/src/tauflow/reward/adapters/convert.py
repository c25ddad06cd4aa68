"""Protobuf ↔ domain for the reward service, and the checks of a Score request that name the field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import duration_pb2, struct_pb2

from tauflow import media
from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2
from tauflow.core.protobuf import duration, seconds
from tauflow.media import wire as media_wire
from tauflow.reward.api import GroupInput, SampleInput
from tauflow.reward.config import Executor, LimitsConfig, RewardConfig
from tauflow.reward.errors import Exhausted, InvalidRequest, cut, shown
from tauflow.reward.registry import RewardFunction
from tauflow.reward.runner import SampleResult, Status

_DEFAULT_LIMITS = LimitsConfig()

_FINISH = {
    value.number: value.name.removeprefix("FINISH_REASON_").lower()
    for value in common_pb2.FinishReason.DESCRIPTOR.values
}
_STATUS = {
    Status.OK: common_pb2.REWARD_STATUS_OK,
    Status.ERROR: common_pb2.REWARD_STATUS_ERROR,
    Status.TIMEOUT: common_pb2.REWARD_STATUS_TIMEOUT,
}


@dataclass(frozen=True)
class ScoreJob:
    groups: list[GroupInput]
    config: dict[str, Any]
    timeout_s: float
    n_samples: int
    executor: Executor


# Bounds that common.proto fixes for a Group wherever it goes (the queue refuses the same); the others are
# this service's ``limits``.
MAX_SAMPLES_PER_GROUP = 4096
MAX_TRACE_CONTEXT_CHARS = {"traceparent": 128, "tracestate": 512}  # W3C: 55 for version 00; 32 members
MAX_REWARD_MESSAGE_CHARS = 4096
_MAX_NANOS = 999_999_999


def count_samples(request: reward_pb2.ScoreRequest, limit: int) -> int:
    n = sum(len(g.samples) for g in request.groups)
    if n > limit:
        raise Exhausted(
            f"the request holds {n} samples; this service scores at most {limit} per Score call "
            "(max_samples_per_request): split it"
        )
    return n


def reward_fn_name(name: str, limits: LimitsConfig) -> str:
    _chars("", "reward_fn", name, limits.max_id_chars, "max_id_chars")
    return name


# The checks take the field's path in two parts (``at``, ``name``), joined only for a refusal; a sample in
# bounds passes one expression (``_sample_in_bounds``) and builds no path at all.


def _field(at: str, name: str) -> str:
    return f"{at}.{name}" if at else name


def _chars(at: str, name: str, text: str, limit: int, key: str) -> None:
    if len(text) > limit:
        raise InvalidRequest(
            _field(at, name), f"{len(text)} characters, over this service's limit of {limit} (limits.{key})"
        )


def _count(at: str, name: str, n: int, limit: int, key: str, what: str = "entries") -> None:
    if n > limit:
        raise InvalidRequest(_field(at, name), f"{n} {what}, over this service's limit of {limit} (limits.{key})")


def _check_map(at: str, name: str, entries: Mapping[str, Any], limits: LimitsConfig) -> None:
    """A metadata map (string values) or reward.components (numbers: ignored by Score, so only bounded)."""
    if not entries:
        return
    _count(at, name, len(entries), limits.max_map_entries, "max_map_entries")
    for key, value in entries.items():
        if len(key) > limits.max_id_chars:
            raise InvalidRequest(
                f"{_field(at, name)}[{shown(key)}]",
                f"a key of {len(key)} characters, over this "
                f"service's limit of {limits.max_id_chars} (limits.max_id_chars)",
            )
        if isinstance(value, str) and len(value) > limits.max_text_chars:
            _chars(at, f"{name}[{shown(key)}]", value, limits.max_text_chars, "max_text_chars")


def _check_group(at: str, g: common_pb2.Group, limits: LimitsConfig) -> None:
    """The bounds of a group's own fields (its samples are checked one by one as they are converted)."""
    ids = limits.max_id_chars
    _chars(at, "group_id", g.group_id, ids, "max_id_chars")
    _chars(at, "prompt_id", g.prompt_id, ids, "max_id_chars")
    _chars(at, "producer_id", g.producer_id, ids, "max_id_chars")
    for name, limit in MAX_TRACE_CONTEXT_CHARS.items():
        text = getattr(g.trace_context, name)
        if len(text) > limit:
            raise InvalidRequest(f"{at}.trace_context.{name}", f"{len(text)} characters, over the limit of {limit}")
    if len(g.samples) > MAX_SAMPLES_PER_GROUP:
        raise InvalidRequest(f"{at}.samples", f"{len(g.samples)} samples, over the limit of {MAX_SAMPLES_PER_GROUP}")
    _check_map(at, "metadata", g.metadata, limits)


_TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "token_versions", "loss_mask")


def _check_sample(at: str, s: common_pb2.Sample, limits: LimitsConfig) -> None:
    """Every string and list of a sample, including those Score ignores (they are still bounded)."""
    _chars(at, "sample_id", s.sample_id, limits.max_id_chars, "max_id_chars")
    _chars(at, "completion_text", s.completion_text, limits.max_text_chars, "max_text_chars")
    _check_map(at, "metadata", s.metadata, limits)
    for name in _TOKEN_FIELDS:
        _count(at, name, len(getattr(s, name)), limits.max_tokens_per_sample, "max_tokens_per_sample", "values")
    if s.HasField("reward"):
        if len(s.reward.message) > MAX_REWARD_MESSAGE_CHARS:
            raise InvalidRequest(
                f"{at}.reward.message",
                f"{len(s.reward.message)} characters, over the limit of {MAX_REWARD_MESSAGE_CHARS}",
            )
        _check_map(at, "reward.components", s.reward.components, limits)


def _sample_in_bounds(s: common_pb2.Sample, limits: LimitsConfig) -> bool:
    """The common case at a glance (one expression, no path built); ``_check_sample`` names what is not.
    (Not one ``ByteSize``: upb encodes the whole sample for it, which costs more than these lengths for a
    sample of a thousand tokens.)"""
    tokens = limits.max_tokens_per_sample
    return (
        len(s.sample_id) <= limits.max_id_chars
        and len(s.completion_text) <= limits.max_text_chars
        and len(s.completion_token_ids) <= tokens
        and len(s.prompt_token_ids) <= tokens
        and len(s.behaviour_logprobs) <= tokens
        and len(s.token_versions) <= tokens
        and len(s.loss_mask) <= tokens
        and not s.metadata
        and not s.HasField("reward")
    )


def groups_from_proto(
    groups: Sequence[common_pb2.Group],
    uses_token_ids: bool,
    limits: LimitsConfig = _DEFAULT_LIMITS,
    uses_prompt_parts: bool = False,
) -> list[GroupInput]:
    if not groups:
        raise InvalidRequest("groups", "must hold at least one group")
    seen: dict[str, int] = {}
    out: list[GroupInput] = []
    for i, g in enumerate(groups):
        at = f"groups[{i}]"
        _check_group(at, g, limits)
        gid = g.group_id
        if gid in seen:
            raise InvalidRequest(f"{at}.group_id", f"{shown(gid)} repeats groups[{seen[gid]}].group_id")
        seen[gid] = i
        if not g.samples:
            raise InvalidRequest(f"{at}.samples", f"group {shown(gid)} has no samples")
        group_meta = dict(g.metadata)
        parts = _prompt_parts(at, g)
        sample_ids: dict[str, int] = {}
        samples = []
        for j, s in enumerate(g.samples):
            plain = _sample_in_bounds(s, limits)  # (then its metadata is empty)
            if not plain:
                _check_sample(f"{at}.samples[{j}]", s, limits)
            sid = s.sample_id
            if sid in sample_ids:
                raise InvalidRequest(
                    f"{at}.samples[{j}].sample_id",
                    f"{shown(sid)} repeats samples[{sample_ids[sid]}] of group {shown(gid)}",
                )
            sample_ids[sid] = j
            samples.append(
                SampleInput(
                    sample_id=sid,
                    completion_text=s.completion_text,
                    metadata={} if plain else dict(s.metadata),
                    group_metadata=group_meta,
                    group_id=gid,
                    prompt_id=g.prompt_id,
                    finish_reason=_FINISH.get(s.finish_reason, "unspecified"),
                    completion_token_ids=tuple(s.completion_token_ids) if uses_token_ids else (),
                    prompt_token_ids=tuple(s.prompt_token_ids) if uses_token_ids else (),
                    prompt_parts=parts if uses_prompt_parts else (),
                )
            )
        out.append(
            GroupInput(
                group_id=gid, prompt_id=g.prompt_id, samples=tuple(samples), metadata=group_meta, prompt_parts=parts
            )
        )
    return out


def _prompt_parts(at: str, g: common_pb2.Group) -> tuple[media.PromptPart, ...]:
    """The group's prompt parts, their structure checked (the contract's bounds); a function that reads a
    part's media decodes it itself (tauflow.media.decode): a part that does not decode fails that function."""
    if not g.prompt_parts:
        return ()
    try:
        parts = media_wire.checked_parts(g.prompt_parts)
    except media.InvalidMedia as e:
        field, _, why = str(e).partition(" ")
        raise InvalidRequest(f"{at}.{field.rstrip(':')}", why) from e
    return tuple(parts)


def sample_timeout_s(d: duration_pb2.Duration, max_sample_timeout_s: float) -> float:
    if not -_MAX_NANOS <= d.nanos <= _MAX_NANOS:
        raise InvalidRequest("sample_timeout.nanos", f"{d.nanos} is outside [-999999999, 999999999]")
    if d.seconds < 0 or d.nanos < 0 or (d.seconds == 0 and d.nanos == 0):
        raise InvalidRequest("sample_timeout", f"must be positive, got {seconds(d):g} s")
    timeout_s = seconds(d)
    if timeout_s > max_sample_timeout_s:
        raise InvalidRequest(
            "sample_timeout",
            f"{timeout_s:g} s is over this service's limit of {max_sample_timeout_s:g} s (max_sample_timeout_s)",
        )
    return timeout_s


def config_from_proto(config: struct_pb2.Struct, max_bytes: int) -> dict[str, Any]:
    """A request's ``config`` as plain JSON-like values. Refused: over ``max_bytes``, or a NaN or an infinity
    anywhere (JSON has neither; a NaN score would reach the trainer)."""
    size = config.ByteSize()
    if size > max_bytes:
        raise InvalidRequest(
            "config", f"{size} bytes, over this service's limit of {max_bytes} (limits.max_config_bytes)"
        )
    return {key: _plain(value, f"config.{cut(key)}") for key, value in config.fields.items()}


def _plain(value: struct_pb2.Value, field: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise InvalidRequest(field, f"{number} is not a finite number")
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {k: _plain(v, f"{field}.{cut(k)}") for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_plain(v, f"{field}[{i}]") for i, v in enumerate(value.list_value.values)]
    return None  # null_value, or no kind set (what JSON reads as null)


def score_job(request: reward_pb2.ScoreRequest, fn: RewardFunction, config: RewardConfig, n_samples: int) -> ScoreJob:
    limits = config.limits
    groups = groups_from_proto(request.groups, fn.uses_token_ids, limits, fn.uses_prompt_parts)
    timeout_s = fn.timeout_s
    if request.HasField("sample_timeout"):
        timeout_s = sample_timeout_s(request.sample_timeout, config.max_sample_timeout_s)
        if timeout_s > fn.timeout_s:  # the operator's limit: a request may lower it, not raise it
            raise InvalidRequest(
                "sample_timeout",
                f"{timeout_s:g} s is over reward function {fn.name!r}'s timeout of {fn.timeout_s:g} s "
                f"(functions.{fn.name}.timeout_s): a request may only lower it",
            )
    overrides = config_from_proto(request.config, limits.max_config_bytes) if request.HasField("config") else {}
    return ScoreJob(groups, fn.resolve_config(overrides), timeout_s, n_samples, fn.executor_for(overrides))


def score_response(
    fn: RewardFunction, groups: Sequence[GroupInput], results: Sequence[Sequence[SampleResult]]
) -> reward_pb2.ScoreResponse:
    # Filled in place (add() and field assignment): about twice as fast as nesting constructors.
    out = reward_pb2.ScoreResponse(reward_fn=fn.name)
    for g, rs in zip(groups, results, strict=True):
        group = out.groups.add(group_id=g.group_id)
        for s, r in zip(g.samples, rs, strict=True):
            sample = group.samples.add(sample_id=s.sample_id)
            reward = sample.reward
            reward.score = r.score
            reward.status = _STATUS[r.status]
            if r.components:
                reward.components.update(r.components)
            if r.message:
                reward.message = r.message
            whole = int(r.duration_s)
            sample.duration.seconds = whole
            sample.duration.nanos = int((r.duration_s - whole) * 1e9)
    return out


def function_info(fn: RewardFunction) -> reward_pb2.RewardFunctionInfo:
    config = struct_pb2.Struct()
    config.update(fn.default_config)
    return reward_pb2.RewardFunctionInfo(
        name=fn.name,
        description=fn.description,
        default_config=config,
        timeout=duration(fn.timeout_s),
        fallback_score=fn.fallback_score,
        group_level=fn.group_level,
    )
