"""The built-in reward functions: ``exact_match``, ``math`` and ``format``.

Each is a small class with the same attributes a custom reward may have (see the README): a
description, a default config, a ``validate_config`` that checks a request's config once per call
(and returns it normalised), and ``__call__(sample, config)``, which runs once per sample and reads the
already-validated config with plain dict look-ups, so that it stays cheap.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tauflow.reward.api import SampleInput, Score


class ConfigInvalid(ValueError):
    """A reward config that does not fit its function; ``key`` names the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


class MissingReference(LookupError):
    """The sample carries no reference answer under the configured key."""


def _validate(model: type[BaseModel], config: dict[str, Any]) -> dict[str, Any]:
    try:
        return model.model_validate(config).model_dump(mode="json")
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ConfigInvalid(key, "unknown key") from None
        raise ConfigInvalid(key, err["msg"]) from None


def _reference(sample: SampleInput, key: str) -> str:
    value = sample.get(key)
    if value is None:
        raise MissingReference(
            f"no reference answer: neither Sample.metadata[{key!r}] nor Group.metadata[{key!r}] is set"
        )
    return value


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- exact_match ---------------------------------------------------------------------------------


class ExactMatchOptions(_Options):
    answer_key: str = Field("answer", min_length=1)
    strip: bool = True
    ignore_case: bool = False
    collapse_whitespace: bool = True
    extract_pattern: str = ""  # when set: the completion's answer is group 1 (else the whole match) of its last match
    correct_score: float = 1.0
    incorrect_score: float = 0.0

    @field_validator("extract_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        if v:
            _compile(v, ())
        return v


_SPACES = re.compile(r"\s+")


def _normalise(text: str, c: dict[str, Any]) -> str:
    if c["collapse_whitespace"]:
        text = _SPACES.sub(" ", text)
    if c["strip"]:
        text = text.strip()
    if c["ignore_case"]:
        text = text.casefold()
    return text


class ExactMatch:
    description = (
        "1 when the completion equals the reference answer (Sample.metadata['answer'], else "
        "Group.metadata['answer']) after normalisation (strip, collapse_whitespace, ignore_case), else 0; "
        "extract_pattern picks the answer out of the completion first (its last match, group 1)"
    )
    default_config: ClassVar[dict[str, Any]] = ExactMatchOptions().model_dump()
    timeout_s = 1.0
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(ExactMatchOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        reference = _normalise(_reference(sample, config["answer_key"]), config)
        text = sample.completion_text
        pattern = config["extract_pattern"]
        if pattern:
            found = _last_match(_compile(pattern, ()), text)
            if found is None:
                return Score(config["incorrect_score"], {"answer_found": 0.0})
            text = found
        correct = _normalise(text, config) == reference
        return Score(config["correct_score"] if correct else config["incorrect_score"], {"answer_found": 1.0})


def _last_match(pattern: re.Pattern[str], text: str) -> str | None:
    last = None
    for last in pattern.finditer(text):  # noqa: B007
        pass
    if last is None:
        return None
    return last.group(1) if pattern.groups else last.group(0)


# -- format -------------------------------------------------------------------------------------

_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "DOTALL": re.DOTALL, "ASCII": re.ASCII}


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, flags: tuple[str, ...]) -> re.Pattern[str]:
    value = 0
    for name in flags:
        value |= _FLAGS[name]
    try:
        return re.compile(pattern, value)
    except re.error as e:
        raise ValueError(f"not a valid regular expression: {e}") from None


class FormatOptions(_Options):
    pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>"
    mode: Literal["fullmatch", "match", "search"] = "fullmatch"
    flags: list[Literal["IGNORECASE", "MULTILINE", "DOTALL", "ASCII"]] = ["DOTALL"]
    strip: bool = True
    match_score: float = 1.0
    mismatch_score: float = 0.0

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        _compile(v, ())
        return v


class Format:
    description = (
        "1 when the completion matches the regular expression `pattern` (mode fullmatch, match or search; "
        "flags IGNORECASE, MULTILINE, DOTALL, ASCII), else 0; the default checks "
        "<think>…</think><answer>…</answer>"
    )
    default_config: ClassVar[dict[str, Any]] = FormatOptions().model_dump()
    timeout_s = 1.0
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(FormatOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> float:
        pattern = _compile(config["pattern"], tuple(config["flags"]))
        text = sample.completion_text.strip() if config["strip"] else sample.completion_text
        matched = getattr(pattern, config["mode"])(text) is not None
        return config["match_score"] if matched else config["mismatch_score"]


# -- math ---------------------------------------------------------------------------------------

# This service enforces its own per-sample timeout (a killable worker process), so math-verify's
# signal.alarm timeouts are turned off, and with them its warning that they are.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class MathOptions(_Options):
    answer_key: str = Field("answer", min_length=1)
    extraction: list[Literal["latex", "expr", "string"]] = Field(["latex", "expr"], min_length=1)
    extraction_mode: Literal["any_match", "first_match"] = "any_match"
    boxed_match_priority: int = 0
    float_rounding: int = Field(6, ge=0, le=15)
    numeric_precision: int = Field(15, ge=1, le=100)
    strict: bool = True
    correct_score: float = 1.0
    incorrect_score: float = 0.0


@functools.lru_cache(maxsize=64)
def _extraction(targets: tuple[str, ...], boxed_match_priority: int) -> tuple[Any, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig

    made = {
        "latex": lambda: LatexExtractionConfig(boxed_match_priority=boxed_match_priority),
        "expr": ExprExtractionConfig,
        "string": StringExtractionConfig,
    }
    return tuple(made[t]() for t in targets)


@functools.lru_cache(maxsize=1024)
def _parse_reference(reference: str) -> list[Any]:
    """The parsed reference, cached per process: a group's samples share their reference."""
    from math_verify import parse

    return parse(reference, parsing_timeout=None)  # type: ignore[arg-type,no-any-return]


class Math:
    description = (
        "1 when the completion's final answer is mathematically equivalent to the reference answer "
        "(Sample.metadata['answer'], else Group.metadata['answer']), checked by math-verify: the answer is "
        "extracted from the completion (\\boxed{}, LaTeX, plain expressions) and compared symbolically and "
        "numerically; else 0. Runs in the killable worker pool."
    )
    default_config: ClassVar[dict[str, Any]] = MathOptions().model_dump()
    timeout_s = 5.0
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(MathOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        from math_verify import parse, verify

        reference = _reference(sample, config["answer_key"])
        # The reference is parsed with math-verify's defaults (LaTeX, then plain expressions); the
        # completion with the configured targets. verify() is not symmetric: the gold goes first.
        gold = _parse_reference(reference)
        if not gold:
            raise ValueError(f"the reference answer {reference!r} does not parse as a math answer")
        extraction = _extraction(tuple(config["extraction"]), config["boxed_match_priority"])
        answer = parse(
            sample.completion_text,
            extraction_config=extraction,
            extraction_mode=config["extraction_mode"],
            parsing_timeout=None,  # type: ignore[arg-type]
        )
        if not answer:
            return Score(config["incorrect_score"], {"answer_found": 0.0})
        correct = verify(
            gold,
            answer,
            float_rounding=config["float_rounding"],
            numeric_precision=config["numeric_precision"],
            strict=config["strict"],
            timeout_seconds=None,
        )
        return Score(config["correct_score"] if correct else config["incorrect_score"], {"answer_found": 1.0})
