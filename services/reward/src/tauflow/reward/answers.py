"""Built-ins that compare a short answer: ``qa`` (SQuAD-style exact match and token F1) and
``multiple_choice`` (a letter, extracted however the model formatted it; GPQA and MMLU style).

Both follow the published metrics: ``qa`` is the SQuAD v1.1 evaluation (lower-case, drop punctuation and
the articles a/an/the, collapse whitespace; F1 over the bag of tokens; the best over the reference
answers), and ``multiple_choice`` scores the letter a model commits to, as simple-evals' GPQA and MMLU
graders do, with extraction that also reads ``\\boxed{C}``, ``**(C)**``, ``Answer: C`` and a bare ``C``.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import (
    DEFAULT_ANSWER_CHARS,
    MAX_ANSWER_CHARS,
    MAX_KEY_CHARS,
    GroupMemo,
    RE2Pattern,
    _compile,
    _last_match,
    _Options,
    _reference,
    _validate,
    answer_too_long,
)

MAX_REFERENCES = 64  # answers in a JSON list of references (SQuAD has up to 6)


def references(raw: str, form: str) -> list[str]:
    """The reference answers: ``raw`` itself, or the strings of a JSON list (``form`` json_list, or auto
    when ``raw`` reads as one)."""
    if form == "single" or (form == "auto" and not raw.lstrip().startswith("[")):
        return [raw]
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the reference is not a JSON list of strings: {e}") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError("the reference is not a non-empty JSON list of strings")
    if len(value) > MAX_REFERENCES:
        raise ValueError(f"the reference lists {len(value)} answers; at most {MAX_REFERENCES} are accepted")
    return value


# -- qa -----------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def squad_normalise(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


class _Answer:
    """An answer normalised once: its normalised text and its bag of tokens, for comparing with many."""

    __slots__ = ("bag", "size", "text")

    def __init__(self, raw: str) -> None:
        self.text = squad_normalise(raw)
        tokens = self.text.split()
        self.size = len(tokens)
        self.bag = Counter(tokens)

    def f1(self, other: _Answer) -> float:
        """SQuAD's F1 of this answer (the prediction) against ``other`` (a reference)."""
        if not self.size or not other.size:
            return float(self.size == other.size)
        small, large = (self.bag, other.bag) if len(self.bag) <= len(other.bag) else (other.bag, self.bag)
        common = sum(min(n, large[t]) for t, n in small.items() if t in large)
        if common == 0:
            return 0.0
        precision, recall = common / self.size, common / other.size
        return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's F1 over the normalised tokens (two empty answers agree: 1.0)."""
    return _Answer(prediction).f1(_Answer(reference))


def _golds(raw: str, form: str) -> tuple[_Answer, ...]:
    return tuple(_Answer(g) for g in references(raw, form))


_gold_answers = GroupMemo(_golds)  # once per group: its samples share the reference


class QAOptions(_Options):
    answer_key: str = Field("answer", min_length=1, max_length=MAX_KEY_CHARS)
    references: Literal["auto", "single", "json_list"] = "auto"
    metric: Literal["f1", "exact_match"] = "f1"
    # When set, the completion's answer is group 1 (else the whole match) of the pattern's last match.
    extract_pattern: RE2Pattern = ""
    # The work per sample is bounded: an answer longer than this scores 0 without being compared (its F1
    # against a short reference is near 0 anyway), and a reference (the metadata value, a JSON list
    # included) longer than this is an error of the sample.
    max_answer_chars: int = Field(DEFAULT_ANSWER_CHARS, ge=1, le=MAX_ANSWER_CHARS)


class QuestionAnswering:
    description = (
        "SQuAD-style QA: token F1 (metric f1) or exact match (metric exact_match) of the completion against "
        "the reference answer, after SQuAD's normalisation (lower case, no punctuation, no a/an/the); a JSON "
        "list of references scores the best of them; components exact_match and f1"
    )
    default_config: ClassVar[dict[str, Any]] = QAOptions().model_dump()
    isolated_keys = ("extract_pattern",)
    ceiling_keys = ("max_answer_chars",)  # a request may lower the bound, not raise it
    timeout_s = 1.0  # (inline, so enforced only by the call's budget: max_answer_chars bounds a sample's work)
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(QAOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        # The completion is normalised and counted once per sample, however many references there are (it
        # was normalised again for each one: 64 references cost 64 passes over the completion), and the
        # references once per group (they were normalised again for each of its samples).
        bound = config["max_answer_chars"]
        raw = _reference(sample, config["answer_key"])
        if len(raw) > bound:
            raise answer_too_long("the reference", len(raw), bound)
        golds = _gold_answers(raw, config["references"])
        text = sample.completion_text
        if config["extract_pattern"]:
            found = _last_match(_compile(config["extract_pattern"], ()), text)
            if found is None:
                return Score(0.0, {"answer_found": 0.0, "exact_match": 0.0, "f1": 0.0})
            text = found
        if len(text) > bound:
            return Score(0.0, {"answer_found": 1.0, "exact_match": 0.0, "f1": 0.0})
        answer = _Answer(text)
        em = float(any(answer.text == g.text for g in golds))
        f1 = max(answer.f1(g) for g in golds)
        return Score(f1 if config["metric"] == "f1" else em, {"answer_found": 1.0, "exact_match": em, "f1": f1})


# -- multiple_choice ----------------------------------------------------------------------------

# The forms a model commits to a letter in, strongest first; each pattern's group 1 is the letter. ``L`` is
# replaced by the allowed letters' class. Markup around the letter (``**``, ``(``, ``$``, ``\\text{``) is
# skipped.
_FORMS = (
    r"\\boxed\{\s*(?:\\text\{)?\s*\(?([L])\)?",  # \boxed{C}, \boxed{\text{C}}, \boxed{(C)}
    r"(?i:answer)\s*(?:is|:)?\s*(?:\*\*|__|\$)?\s*:?\s*[(\[]?\s*([L])\b",  # Answer: C, the answer is (C)
    r"(?i:option|choice)\s+[(\[]?([L])\b",  # option C
)
_BARE = r"^\W*([L])\W*$"  # the whole reply (or its last line) is the letter with markup: "C", "(C).", "**C**"


class ChoiceOptions(_Options):
    answer_key: str = Field("answer", min_length=1, max_length=MAX_KEY_CHARS)
    letters: str = Field("ABCDEFGHIJ", min_length=2, max_length=26)
    # When set, Sample/Group.metadata[choices_key] is a JSON list of the options' texts, in letter order: the
    # reference may then be the correct option's text, and a completion that answers with an option's full
    # text (and no letter) is read as that option.
    choices_key: str = Field("", max_length=MAX_KEY_CHARS)
    ignore_case: bool = False  # accept "answer: c"
    correct_score: float = 1.0
    incorrect_score: float = 0.0
    # The work per sample is bounded: a reference, or a choices_key value (the JSON list counted whole),
    # longer than this is an error of the sample; a completion's last line longer than this is not read as
    # an option's text.
    max_answer_chars: int = Field(DEFAULT_ANSWER_CHARS, ge=1, le=MAX_ANSWER_CHARS)

    @field_validator("letters")
    @classmethod
    def _letters(cls, v: str) -> str:
        if not all("A" <= c <= "Z" for c in v) or len(set(v)) != len(v):
            raise ValueError("must be distinct upper-case letters A-Z")
        return v


def _forms(letters: str, ignore_case: bool) -> list[Any]:
    # RE2 (linear time): a reply of a million spaces after "answer" would make the adjacent \s* of these
    # patterns polynomial under Python's backtracking re.
    allowed = letters + (letters.lower() if ignore_case else "")
    return [_compile(p.replace("[L]", f"[{allowed}]"), ()) for p in (*_FORMS, _BARE)]


def extract_choice(text: str, letters: str, ignore_case: bool = False) -> str | None:
    """The letter ``text`` commits to: the last match of the strongest form present, else a last line that
    is only the letter, else ``None``."""
    forms = _forms(letters, ignore_case)
    for form in forms[:-1]:
        found = None
        for found in form.finditer(text):
            pass
        if found is not None:
            return found.group(1).upper()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        bare = forms[-1].match(lines[-1].strip())
        if bare is not None:
            return bare.group(1).upper()
    return None


def _choices(raw: str, key: str, letters: str) -> list[str]:
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"metadata[{key!r}] is not a JSON list of the options' texts: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) > len(letters):
        raise ValueError(f"metadata[{key!r}] must be a JSON list of at most {len(letters)} strings (one per letter)")
    return value


class MultipleChoice:
    description = (
        "Multiple choice (GPQA, MMLU style): correct_score when the letter the completion commits to "
        "(\\boxed{C}, 'Answer: C', 'the answer is (C)', or a last line that is only the letter) is the "
        "reference letter (or, with choices_key, the letter of the reference option's text), else "
        "incorrect_score; components answer_found"
    )
    default_config: ClassVar[dict[str, Any]] = ChoiceOptions().model_dump()
    ceiling_keys = ("max_answer_chars",)  # a request may lower the bound, not raise it
    timeout_s = 1.0  # (inline, so enforced only by the call's budget: max_answer_chars bounds a sample's work)
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(ChoiceOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        letters: str = config["letters"]
        bound: int = config["max_answer_chars"]
        reference = _reference(sample, config["answer_key"])
        if len(reference) > bound:
            raise answer_too_long("the reference", len(reference), bound)
        key: str = config["choices_key"]
        choices = sample.get(key) if key else None
        if choices is not None and len(choices) > bound:
            raise answer_too_long(f"metadata[{key!r}]", len(choices), bound)
        # once per group (its samples share the reference and the options), not once per sample
        gold, options = _gold_choice(reference, letters, key, choices)
        answer = extract_choice(sample.completion_text, letters, config["ignore_case"])
        lines = sample.completion_text.strip().splitlines()
        # the completion may spell out an option instead of its letter (a line longer than the bound is none)
        if answer is None and options and lines and len(lines[-1]) <= bound:
            said = squad_normalise(lines[-1])
            hits = [letters[i] for i, o in enumerate(options) if o == said]
            answer = hits[0] if len(hits) == 1 else None
        if answer is None:
            return Score(config["incorrect_score"], {"answer_found": 0.0})
        score = config["correct_score"] if answer == gold else config["incorrect_score"]
        return Score(score, {"answer_found": 1.0})


def _resolve_choice(reference: str, letters: str, key: str, choices: str | None) -> tuple[str, tuple[str, ...]]:
    """The reference's letter, and the options' texts normalised (none without ``choices``)."""
    options = tuple(squad_normalise(o) for o in _choices(choices, key, letters)) if choices is not None else ()
    return _letter_of(reference.strip(), letters, options), options


_gold_choice = GroupMemo(_resolve_choice)


def _letter_of(reference: str, letters: str, options: tuple[str, ...]) -> str:
    """The reference's letter: the reference itself (``C``, ``(C)``), or the letter of the option it names
    (``options`` normalised by ``squad_normalise``)."""
    bare = _compile(rf"\W*([{letters}])\W*", ()).fullmatch(reference)
    if bare is not None:
        return bare.group(1)
    named = squad_normalise(reference)
    matches = [letters[i] for i, o in enumerate(options) if o == named]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(
        f"the reference {reference[:80]!r} is neither one of the letters {letters} nor the text of exactly one "
        "option of choices_key"
    )
