"""The built-in reward functions: ``exact_match``, ``math`` and ``format``.

Each is a small class with the same attributes a custom reward may have (see the README): a
description, a default config, a ``validate_config`` that checks a request's config once per call
(and returns it normalised), and ``__call__(sample, config)``, which runs once per sample and reads the
already-validated config with plain dict look-ups, so that it stays cheap.

Regular expressions from configs (``format``'s ``pattern``, ``exact_match``'s ``extract_pattern``) are
RE2 (``google-re2``), not Python's ``re``: RE2 never backtracks, so a match costs time linear in the text
(``(a+)+$`` is no longer catastrophic), its compile is bounded by a memory budget, and it releases the
GIL while matching. A request that supplies its own pattern is still scored in the killable pool
(``isolated_keys``): linear in the text is also linear in the pattern's program, which a hostile pattern
can make large.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, cast

import re2
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from tauflow.reward.api import SampleInput, Score


class ConfigInvalid(ValueError):
    """A reward config that does not fit its function; ``key`` names the offending key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


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
        if err["type"] == "value_error":  # a validator's own message, without pydantic's "Value error, "
            raise ConfigInvalid(key, str(err["ctx"]["error"])) from None
        raise ConfigInvalid(key, err["msg"]) from None


def _reference(sample: SampleInput, key: str) -> str:
    value = sample.get(key)
    if value is None:
        raise MissingReference(
            f"no reference answer: neither Sample.metadata[{key!r}] nor Group.metadata[{key!r}] is set"
        )
    return value


MAX_PATTERN_CHARS = 2048
MAX_KEY_CHARS = 256  # answer_key: a metadata key (limits.max_id_chars by default)
# The most max_answer_chars may be (a request's text is at most 1 MiB): the bound of a reference (and of the
# options of multiple_choice) and of the answer compared with it, in exact_match, qa and multiple_choice.
MAX_ANSWER_CHARS = 1 << 20
DEFAULT_ANSWER_CHARS = 65_536

T = TypeVar("T")


class GroupMemo(Generic[T]):
    """``compute(*key)``, remembered for the last few keys on each thread: what a reward function derives
    from a group's shared metadata (its reference normalised, its options parsed) is computed once per
    group, not once per sample. A group's samples share ``Group.metadata``, so without it the work of one
    call grew as samples x reference (a 1 MiB reference normalised again for each of 65,536 samples).

    Per thread, not per process: an inline call scores its samples one after another on a thread of its own
    (its groups' samples in a row, so a few entries suffice), and the memo goes with the thread; concurrent
    calls cannot evict each other's entries, and nothing outlives a call but a pool worker's last few. A
    ``ValueError`` (a reference that is no answer) is remembered too, by its message, so a bad reference
    fails each sample without being read again."""

    def __init__(self, compute: Callable[..., T], size: int = 4) -> None:
        self._compute = compute
        self._size = size
        self._local = threading.local()

    def __call__(self, *key: Hashable) -> T:
        entries: OrderedDict[tuple[Hashable, ...], tuple[T | None, str]] | None = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = OrderedDict()
        entry = entries.get(key)
        if entry is not None:
            entries.move_to_end(key)
        else:
            try:
                entry = (self._compute(*key), "")
            except ValueError as e:
                entry = (None, str(e) or type(e).__name__)
            entries[key] = entry
            if len(entries) > self._size:
                entries.popitem(last=False)
        value, failure = entry
        if failure:
            raise ValueError(failure)
        return cast(T, value)  # (None only with a failure)

    def clear(self) -> None:
        """Forgets this thread's entries (for tests)."""
        self._local.entries = OrderedDict()


def _compiled(pattern: str) -> str:
    """``pattern`` if RE2 compiles it (an empty one is no pattern)."""
    if pattern:
        _compile(pattern, ())
    return pattern


# A regular expression of a config: RE2, checked when the config is validated; "" is none.
RE2Pattern = Annotated[str, Field(max_length=MAX_PATTERN_CHARS), AfterValidator(_compiled)]


class _Options(BaseModel):
    # NaN and infinities are refused: a score of NaN would reach the trainer as a reward.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- exact_match ---------------------------------------------------------------------------------


class ExactMatchOptions(_Options):
    answer_key: str = Field("answer", min_length=1, max_length=MAX_KEY_CHARS)
    strip: bool = True
    ignore_case: bool = False
    collapse_whitespace: bool = True
    # When set, the completion's answer is group 1 (else the whole match) of the pattern's last match.
    extract_pattern: RE2Pattern = ""
    correct_score: float = 1.0
    incorrect_score: float = 0.0
    # The work per sample is bounded: a reference longer than this is an error of the sample, and an answer
    # longer than this scores incorrect_score without being compared (as qa's max_answer_chars).
    max_answer_chars: int = Field(DEFAULT_ANSWER_CHARS, ge=1, le=MAX_ANSWER_CHARS)


_SPACES = re.compile(r"\s+")


def _normalise(text: str, c: dict[str, Any]) -> str:
    return _normalised(text, c["collapse_whitespace"], c["strip"], c["ignore_case"])


def _normalised(text: str, collapse_whitespace: bool, strip: bool, ignore_case: bool) -> str:
    if collapse_whitespace:
        text = _SPACES.sub(" ", text)
    if strip:
        text = text.strip()
    if ignore_case:
        text = text.casefold()
    return text


_normalised_reference = GroupMemo(_normalised)


def answer_too_long(what: str, length: int, bound: int) -> ValueError:
    """The error of a sample whose reference (or options) is over ``max_answer_chars``."""
    return ValueError(f"{what} is {length} characters long; max_answer_chars is {bound}")


class ExactMatch:
    description = (
        "1 when the completion equals the reference answer (Sample.metadata['answer'], else "
        "Group.metadata['answer']) after normalisation (strip, collapse_whitespace, ignore_case), else 0; "
        "extract_pattern (RE2) picks the answer out of the completion first (its last match, group 1)"
    )
    default_config: ClassVar[dict[str, Any]] = ExactMatchOptions().model_dump()
    isolated_keys = ("extract_pattern",)
    ceiling_keys = ("max_answer_chars",)  # a request may lower the bound, not raise it
    timeout_s = 1.0  # (inline, so enforced only by the call's budget: max_answer_chars bounds a sample's work)
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(ExactMatchOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        bound = config["max_answer_chars"]
        raw = _reference(sample, config["answer_key"])
        if len(raw) > bound:
            raise answer_too_long("the reference", len(raw), bound)
        # normalised once per group (the samples of a group share Group.metadata's reference)
        reference = _normalised_reference(raw, config["collapse_whitespace"], config["strip"], config["ignore_case"])
        text = sample.completion_text
        pattern = config["extract_pattern"]
        if pattern:
            found = _last_match(_compile(pattern, ()), text)
            if found is None:
                return Score(config["incorrect_score"], {"answer_found": 0.0})
            text = found
        if len(text) > bound:  # not compared: an answer this long is not the (bounded) reference's
            return Score(config["incorrect_score"], {"answer_found": 1.0})
        correct = _normalise(text, config) == reference
        return Score(config["correct_score"] if correct else config["incorrect_score"], {"answer_found": 1.0})


def _last_match(pattern: Any, text: str) -> str | None:
    last = None
    for last in pattern.finditer(text):
        pass
    if last is None:
        return None
    return last.group(1) if pattern.groups else last.group(0)


# -- format -------------------------------------------------------------------------------------

# RE2's memory budget per pattern (its default is 8 MiB): it bounds the compiled program, and with it the
# compile's time (~10 ms at worst here, against ~85 ms at 8 MiB) and the DFA cache of each match.
RE2_MAX_MEM = 1 << 20
RE2_SYNTAX = "RE2 syntax: no backreferences or look-around; \\z, not \\Z"


@functools.lru_cache(maxsize=64)
def _compile(pattern: str, flags: tuple[str, ...]) -> Any:
    """``pattern`` compiled by RE2 with Python's flag names: ``ASCII`` changes nothing (RE2's ``\\w``,
    ``\\d``, ``\\s`` and ``\\b`` are ASCII; ``\\pL`` and ``\\pN`` match Unicode letters and digits)."""
    options = re2.Options()
    options.log_errors = False  # (its log line would quote the pattern)
    options.max_mem = RE2_MAX_MEM
    options.case_sensitive = "IGNORECASE" not in flags
    options.dot_nl = "DOTALL" in flags
    try:
        return re2.compile(("(?m)" if "MULTILINE" in flags else "") + pattern, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"not a valid regular expression ({RE2_SYNTAX}): {reason[:200]}") from None


class FormatOptions(_Options):
    pattern: str = Field(r"<think>.*?</think>\s*<answer>.*?</answer>", max_length=MAX_PATTERN_CHARS)
    mode: Literal["fullmatch", "match", "search"] = "fullmatch"
    flags: list[Literal["IGNORECASE", "MULTILINE", "DOTALL", "ASCII"]] = Field(["DOTALL"], max_length=4)
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
        "1 when the completion matches the RE2 regular expression `pattern` (mode fullmatch, match or search; "
        "flags IGNORECASE, MULTILINE, DOTALL, ASCII), else 0; the default checks "
        "<think>…</think><answer>…</answer>"
    )
    default_config: ClassVar[dict[str, Any]] = FormatOptions().model_dump()
    isolated_keys = ("pattern",)
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
    answer_key: str = Field("answer", min_length=1, max_length=MAX_KEY_CHARS)
    # When set, the reference is group 1 (else the whole match) of the pattern's last match in it: GSM8K's
    # answers are a worked solution ending "#### 72" (reference_pattern "####\\s*(.+)").
    reference_pattern: RE2Pattern = ""
    extraction: list[Literal["latex", "expr", "string"]] = Field(["latex", "expr"], min_length=1, max_length=3)
    extraction_mode: Literal["any_match", "first_match"] = "any_match"
    boxed_match_priority: int = Field(0, ge=-1, le=1000)  # math-verify's: 0 first, 50 its default, -1 off
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

    return parse(reference, parsing_timeout=None)


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
        if config["reference_pattern"]:
            found = _last_match(_compile(config["reference_pattern"], ()), reference)
            if found is None:
                raise ValueError(f"the reference answer {reference[:80]!r} does not match reference_pattern")
            reference = found.strip()
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
            parsing_timeout=None,
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
