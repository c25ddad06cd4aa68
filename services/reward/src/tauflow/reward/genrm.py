"""The ``genrm`` built-in: an LLM judge (generative reward model) that is its own deployment.

The judge is a tauflow rollout server running a judge model whose weights are never trained (its own replica
set; ``tauflow run`` starts one from ``judge_model``, as role ``judge``). For each sample this function asks it
``Generate`` with a chat: ``system_prompt``, then ``template`` filled with the prompt (metadata
``prompt_key``), the completion and the reference (metadata ``answer_key``); the judge's chat template formats
it (rollout revision 5). The verdict is read from the judge's greedy reply with ``score_pattern`` (RE2) and,
with ``normalise``, mapped from [min_score, max_score] to [0, 1]: the same reading as ``remote_rm``'s OpenAI
protocol. Components: ``judge_score`` (the judge's number) and ``judge_error`` (1 when the judge failed or its
reply had no verdict; the sample then gets ``fallback_score``).

``address`` is a service-only key (functions.genrm.config.address; ``tauflow run`` sets it): a request cannot
send the completions elsewhere.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.reward.api import GroupInput, SampleInput, Score
from tauflow.reward.builtins import MAX_KEY_CHARS, RE2Pattern, _Options, _validate
from tauflow.reward.remote import (
    DEFAULT_SCORE_PATTERN,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TEMPLATE,
    MAX_TEXT_CHARS,
    _Failure,
    fill,
    parse_score,
)

ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]


class GenRMOptions(_Options):
    address: str = Field("", max_length=512)  # the judge's rollout server, host:port (service-only)
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, max_length=MAX_TEXT_CHARS)
    template: str = Field(DEFAULT_TEMPLATE, max_length=MAX_TEXT_CHARS)
    prompt_key: str = Field("prompt", min_length=1, max_length=MAX_KEY_CHARS)
    answer_key: str = Field("answer", min_length=1, max_length=MAX_KEY_CHARS)
    score_pattern: RE2Pattern = Field(DEFAULT_SCORE_PATTERN, min_length=1)
    min_score: float = 0.0
    max_score: float = 10.0
    normalise: bool = True
    max_new_tokens: int = Field(256, ge=1, le=32768)
    stop: list[str] = Field(default_factory=list, max_length=16)
    request_timeout_s: float = Field(60.0, gt=0, le=600)
    max_concurrency: int = Field(8, ge=1, le=64)
    fallback_score: float = 0.0

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if not v:
            raise ValueError("required: the judge's rollout server (functions.genrm.config.address)")
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port")
        return v

    @model_validator(mode="after")
    def _range(self) -> GenRMOptions:
        if self.normalise and not self.max_score > self.min_score:
            raise ValueError("max_score must be greater than min_score")
        return self

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        if "{completion}" not in v:
            raise ValueError("must contain {completion}")
        return v


class GenerativeJudge:
    description = (
        "LLM-as-judge (GenRM): asks a rollout server running a judge model (address; `tauflow run` starts one "
        "from judge_model) to grade each completion with a chat (system_prompt, template with {prompt}, "
        "{completion}, {reference}); the verdict is read with score_pattern and normalised from "
        "[min_score, max_score] to [0, 1]; components judge_score and judge_error"
    )
    default_config: ClassVar[dict[str, Any]] = GenRMOptions().model_dump()
    group_level = True
    service_only_keys = ("address",)
    timeout_s = 300.0  # a group's judgements: request_timeout_s each, max_concurrency at once
    fallback_score = 0.0

    def __init__(self) -> None:
        self._stubs: dict[str, rollout_pb2_grpc.RolloutServiceStub] = {}

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(GenRMOptions, config)

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        stub = self._stubs.get(address)
        if stub is None:  # one channel per judge and worker process, kept: a channel per call would redial
            stub = rollout_pb2_grpc.RolloutServiceStub(create_sync_channel(address, [ROLLOUT], ChannelConfig()))
            self._stubs[address] = stub
        return stub

    def __call__(self, group: GroupInput, config: dict[str, Any]) -> list[Score]:
        stub = self._stub(config["address"])
        with ThreadPoolExecutor(min(config["max_concurrency"], len(group.samples))) as pool:
            return list(pool.map(lambda s: self._judge(stub, s, config), group.samples))

    @staticmethod
    def _judge(stub: rollout_pb2_grpc.RolloutServiceStub, sample: SampleInput, c: dict[str, Any]) -> Score:
        user = fill(
            c["template"],
            {
                "prompt": sample.get(c["prompt_key"]) or "",
                "completion": sample.completion_text,
                "reference": sample.get(c["answer_key"]) or "",
            },
        )
        request = rollout_pb2.GenerateRequest(
            request_id=f"genrm-{sample.group_id}-{sample.sample_id}"[:128],
            prompt_messages=[
                rollout_pb2.ChatMessage(role="system", content=c["system_prompt"]),
                rollout_pb2.ChatMessage(role="user", content=user),
            ],
            sampling=rollout_pb2.SamplingParams(
                n=1, temperature=0.0, max_new_tokens=c["max_new_tokens"], stop=c["stop"]
            ),
        )
        start = time.monotonic()
        try:
            reply = stub.Generate(request, timeout=c["request_timeout_s"])
            score, raw = parse_score(reply.samples[0].completion_text, c)
        except _Failure:
            return Score(c["fallback_score"], {"judge_error": 1.0})
        except Exception:  # noqa: BLE001 - a judge that fails (grpc.RpcError) costs this sample only
            return Score(c["fallback_score"], {"judge_error": 1.0, "judge_seconds": time.monotonic() - start})
        return Score(score, {"judge_score": raw, "judge_error": 0.0})
