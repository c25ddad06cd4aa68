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

from tauflow.reward.adapters.remote import (
    DEFAULT_SCORE_PATTERN,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TEMPLATE,
    MAX_TEXT_CHARS,
    _Failure,
    fill,
    parse_score,
)
from tauflow.reward.adapters.rollout_client import JudgeFailed, judge_reply
from tauflow.reward.api import GroupInput, SampleInput, Score
from tauflow.reward.builtins import MAX_KEY_CHARS, RE2Pattern, _Options, _validate


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
    ceiling_keys = ("max_new_tokens", "request_timeout_s", "max_concurrency")  # a request may only lower them
    timeout_s = 300.0  # a group's judgements: request_timeout_s each, max_concurrency at once
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(GenRMOptions, config)

    def __call__(self, group: GroupInput, config: dict[str, Any]) -> list[Score]:
        with ThreadPoolExecutor(min(config["max_concurrency"], len(group.samples))) as pool:
            return list(pool.map(lambda s: self._judge(s, config), group.samples))

    @staticmethod
    def _judge(sample: SampleInput, c: dict[str, Any]) -> Score:
        user = fill(
            c["template"],
            {
                "prompt": sample.get(c["prompt_key"]) or "",
                "completion": sample.completion_text,
                "reference": sample.get(c["answer_key"]) or "",
            },
        )
        start = time.monotonic()
        try:
            reply = judge_reply(
                c["address"],
                [("system", c["system_prompt"]), ("user", user)],
                max_new_tokens=c["max_new_tokens"],
                stop=c["stop"],
                timeout_s=c["request_timeout_s"],
                request_id=f"genrm-{sample.group_id}-{sample.sample_id}",
            )
            score, raw = parse_score(reply, c)
        except _Failure:
            return Score(c["fallback_score"], {"judge_error": 1.0})
        except JudgeFailed:  # a judge that fails costs this sample only
            return Score(c["fallback_score"], {"judge_error": 1.0, "judge_seconds": time.monotonic() - start})
        return Score(score, {"judge_score": raw, "judge_error": 0.0})
