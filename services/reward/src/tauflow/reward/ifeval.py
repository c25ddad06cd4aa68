"""The ``ifeval`` built-in: verifiable instruction-following constraints, in the style of IFEval.

IFEval (Zhou et al., 2023, "Instruction-Following Evaluation for Large Language Models") lists 25 kinds of
instruction whose following a program can check ("write at least 300 words", "no commas", "wrap the whole
response in double quotes"). This module is tauflow's own implementation of that catalogue, under its own
names, with the semantics written down below (where they differ from IFEval's, it says so).

Each sample carries its constraints as a JSON list under ``Sample.metadata[constraints_key]`` (else
``Group.metadata[constraints_key]``), ``constraints_key`` defaulting to ``"constraints"``::

    [{"type": "length_words", "relation": "at least", "num": 300}, {"type": "no_commas"}]

Scoring (config ``scoring``): ``"all"`` (IFEval's prompt-level accuracy) gives ``correct_score`` when every
constraint holds, else ``incorrect_score``; ``"fraction"`` (instruction-level) gives
``incorrect_score + (correct_score - incorrect_score) * followed / constraints``. With ``loose`` (IFEval's
loose accuracy) a constraint holds when it holds on any of eight variants of the response: the response,
without its first line, without its last line, without both, and each of those four with every ``*``
removed (the variants are stripped; an empty variant counts for nothing). An empty (whitespace-only)
response follows no constraint, strict or loose, not even ``no_commas``.

Components: ``followed`` (how many constraints hold), ``constraints`` (how many there are) and, for the
i-th constraint (from 0, as in the JSON list), ``c<i>.<type>``: 1 when it holds, else 0.

Text units, the same for every constraint:

- a *word* is a run of letters and digits, which may contain apostrophes between them (``don't``, ``l'eau``,
  ``rock'n'roll`` are one word each; ``_`` and punctuation separate words). IFEval counts ``\\w+`` runs
  (``don't`` is two words there) and NLTK tokens for capital words.
- a *sentence* ends at a run of ``.``, ``!`` or ``?`` followed by whitespace or the end of the text; the
  pieces that contain a letter or digit are counted (a final piece without a terminator counts too).
  ``3.14`` does not end a sentence; ``Mr. Smith`` does (IFEval's splitter knows some abbreviations).
- *blank-line paragraphs* are groups of consecutive non-blank lines (one or more blank lines between).
- *divider paragraphs* are the pieces between lines that consist of ``***`` alone (a markdown divider,
  surrounding spaces allowed); empty pieces at either end are dropped, an empty piece between two dividers
  fails the constraint. IFEval also splits at a ``***`` inside a line, which ``***bold italic***`` trips.
- keywords and phrases match case-insensitively (``str.casefold``) as *whole words*: an occurrence may not
  have a letter or digit right before or after it (when the keyword itself begins or ends with one), so
  ``cat`` is not found in ``category``, but is in ``cat's``. IFEval matches included keywords and counts
  keyword frequency as substrings, and only forbidden words as whole words.
- ``relation`` is one of ``"at least"`` (count >= num), ``"at most"`` (<=), ``"less than"`` (<),
  ``"more than"`` (>) and ``"exactly"`` (==); IFEval has only the first and the third.

The constraint types (``CONSTRAINT_TYPES``) and their kwargs:

- ``length_words`` {relation, num}: the number of words compares to num.
- ``length_sentences`` {relation, num}: the number of sentences compares to num.
- ``length_paragraphs`` {num}: exactly num divider paragraphs (separated by ``***`` lines).
- ``paragraphs_blank_lines`` {num}: exactly num blank-line paragraphs.
- ``nth_paragraph_first_word`` {num_paragraphs, nth, first_word}: exactly num_paragraphs blank-line
  paragraphs, and the first word of paragraph nth (from 1) is first_word (case-insensitive); nth must be
  at most num_paragraphs and first_word one word.
- ``keywords_include`` {keywords: [..]}: every keyword occurs.
- ``keywords_exclude`` {keywords: [..]}: no keyword occurs.
- ``keyword_frequency`` {keyword, relation, num}: the number of (non-overlapping) occurrences of keyword
  compares to num.
- ``letter_frequency`` {letter, relation, num}: the number of occurrences of the letter (one alphabetic
  character), upper or lower case, compares to num.
- ``json_format``: the whole response parses as JSON (strict: no NaN or Infinity); a fenced block
  (a line of three backticks, optionally tagged ``json``, up to closing backticks at the end) is unwrapped.
- ``title``: a title in double angle brackets, ``<<like this>>``, on one line, with some non-blank text.
- ``bullet_points`` {num}: exactly num markdown bullets: lines that begin (after indentation) with ``*``
  or ``-`` followed by a space or tab. IFEval also counts ``*text`` and ``---`` lines.
- ``highlighted_sections`` {num}: at least num highlights, ``*text*`` or ``**text**`` within one line,
  with non-blank text.
- ``sections`` {section_spliter, num}: at least num section headers: section_spliter (case-sensitive, as
  written, e.g. ``"Section"`` or ``"SECTION"``) not preceded by a letter or digit, then optional spaces or
  tabs, then a digit (``SECTION 1``, ``**Section 2**``).
- ``placeholders`` {num}: at least num placeholders: non-empty square brackets within one line without
  brackets inside (``[name]``, ``[address]``).
- ``postscript`` {postscript_marker}: a line that begins with the marker (e.g. ``"P.S."`` or ``"P.P.S"``),
  case-insensitive, ignoring whitespace (``P. S.`` matches ``P.S.``) and leading ``*`` or ``_``
  (``**P.S.**``).
- ``constrained_response`` {options: [..], optional}: exactly one of the options occurs in the response
  (case-sensitive; several occurrences of the same one are fine); the options default to
  ``"My answer is yes."``, ``"My answer is no."``, ``"My answer is maybe."``. IFEval accepts a response that
  contains any of them, so one that lists all three passes there.
- ``lowercase``: no uppercase letter and at least one lowercase one (``str.islower``).
- ``uppercase``: no lowercase letter and at least one uppercase one (``str.isupper``).
- ``capital_word_frequency`` {relation, num}: the number of all-capital words (``str.isupper``: ``NASA``,
  ``I``, ``U2``) compares to num.
- ``no_commas``: no ``,`` (nor the full-width ``，``).
- ``end_checker`` {end_phrase}: the stripped response ends with the stripped end_phrase (case-insensitive);
  nothing may follow it.
- ``quotation``: the stripped response begins and ends with a double quote (``"`` … ``"``, or “ … ”) and
  is longer than one character.
- ``repeat_prompt`` {prompt_to_repeat}: the stripped response begins with the stripped prompt
  (case-insensitive).
- ``two_responses``: the response split at ``******`` gives exactly two non-blank pieces (blank pieces at
  either end are dropped, a blank one in between fails), and they differ once stripped.
- ``regex`` {pattern} (tauflow's own): an RE2 search of the pattern finds a match (RE2 syntax; inline flags
  such as ``(?i)`` and ``(?s)``; compiled under the same memory budget as ``format``'s patterns).

Not implemented: IFEval's ``language:response_language`` (the response is in a given language), which
needs a language identifier (IFEval uses ``langdetect``), a dependency this service does not carry; and
IFEval's ``english_lowercase``/``english_capital`` check that the response is English, which these
``lowercase``/``uppercase`` do not.

Bounds, each a per-sample ``ValueError`` (an ERROR result for the sample) that names the constraint's index
and kwarg: the JSON text at most 64 KiB, a list of 1 to ``max_constraints`` objects (default 32, at most 62:
with ``followed`` and ``constraints`` that makes the 64 components a function may return), no unknown
type or kwarg (a kwarg whose value is ``null`` counts as absent, which helps with datasets stored with
every kwarg of every type), strings of 1 to 2048 characters (not blank), lists of 1 to 64 entries, numbers
integers from 0 to 1,000,000. Word counts, searches and splits are linear in the response; the RE2 match
of a ``regex`` is too. No pattern from a sample or a config is ever given to Python's ``re``.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import (
    MAX_KEY_CHARS,
    MAX_PATTERN_CHARS,
    ConfigInvalid,
    MissingReference,
    _compile,
    _Options,
    _validate,
)

MAX_CONSTRAINTS_BYTES = 64 * 1024  # the JSON text of a sample's constraints, in UTF-8
MAX_KWARG_CHARS = 2048
MAX_KWARG_ITEMS = 64
MAX_NUM = 1_000_000
# A function returns at most 64 components (worker.MAX_COMPONENTS): one per constraint, and two counts.
MAX_CONSTRAINTS = 62

ANSWER_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


class ConstraintInvalid(ValueError):
    """A sample's constraints that cannot be checked; ``index`` (or -1 for the whole list) and ``kwarg``
    ("" when none) say where."""

    def __init__(self, where: str, problem: str, index: int = -1, kwarg: str = "") -> None:
        super().__init__(f"{where}: {problem}")
        self.index = index
        self.kwarg = kwarg


# -- text units (fixed patterns: none can backtrack, see the comments) ----------------------------

# A run of letters/digits, then (apostrophe, run)*: each repetition must start with an apostrophe, so
# there is one way to match and no backtracking.
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
# Always matches once it starts (a run of at least one): finditer never retries inside a run.
_TERMINATORS = re.compile(r"[.!?]+")
# Stops at a newline, a bracket or an angle bracket, so the runs scanned from different starts do not overlap.
_HIGHLIGHT = re.compile(r"\*([^\n*]+)\*")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_TITLE = re.compile(r"<<([^\n<>]+)>>")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def _has_alnum(text: str) -> bool:
    return any(c.isalnum() for c in text)


def _count_sentences(text: str) -> int:
    count = start = 0
    for m in _TERMINATORS.finditer(text):
        end = m.end()
        if end == len(text) or text[end].isspace():
            count += _has_alnum(text[start:end])
            start = end
    return count + _has_alnum(text[start:])


def _blank_line_paragraphs(text: str) -> list[str]:
    paragraphs: list[str] = []
    lines: list[str] = []
    for line in text.splitlines():
        if line.strip():
            lines.append(line)
        elif lines:
            paragraphs.append("\n".join(lines))
            lines = []
    if lines:
        paragraphs.append("\n".join(lines))
    return paragraphs


def _divider_paragraphs(text: str) -> list[str] | None:
    """The pieces between ``***`` lines; None when one between two dividers is blank."""
    pieces: list[str] = []
    lines: list[str] = []
    for line in text.splitlines():
        if line.strip() == "***":
            pieces.append("\n".join(lines))
            lines = []
        else:
            lines.append(line)
    pieces.append("\n".join(lines))
    return _trim_blank_ends(pieces)


def _trim_blank_ends(pieces: list[str]) -> list[str] | None:
    first, last = 0, len(pieces)
    while first < last and not pieces[first].strip():
        first += 1
    while last > first and not pieces[last - 1].strip():
        last -= 1
    kept = pieces[first:last]
    return None if any(not p.strip() for p in kept) else kept


def _occurrences(text: str, needle: str, *, whole_end: bool = True) -> Iterator[int]:
    """The end of each non-overlapping occurrence of ``needle`` in ``text`` with no letter or digit right
    before it (when ``needle`` begins with one) nor, with ``whole_end``, right after it."""
    n = len(needle)
    check_start = needle[0].isalnum()
    check_end = whole_end and needle[-1].isalnum()
    i = text.find(needle)
    while i != -1:
        end = i + n
        if (not check_start or i == 0 or not text[i - 1].isalnum()) and (
            not check_end or end == len(text) or not text[end].isalnum()
        ):
            yield end
            i = text.find(needle, end)
        else:
            i = text.find(needle, i + 1)


def _count_keyword(text: str, keyword: str) -> int:
    return sum(1 for _ in _occurrences(text.casefold(), keyword.strip().casefold()))


def _squash(text: str) -> str:
    return "".join(text.casefold().split())


# -- checkers ------------------------------------------------------------------------------------

_RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "at least": operator.ge,
    "at most": operator.le,
    "less than": operator.lt,
    "more than": operator.gt,
    "exactly": operator.eq,
}


def _compares(count: int, kw: dict[str, Any]) -> bool:
    return _RELATIONS[kw["relation"]](count, kw["num"])


def _length_words(text: str, kw: dict[str, Any]) -> bool:
    return _compares(len(_words(text)), kw)


def _length_sentences(text: str, kw: dict[str, Any]) -> bool:
    return _compares(_count_sentences(text), kw)


def _length_paragraphs(text: str, kw: dict[str, Any]) -> bool:
    pieces = _divider_paragraphs(text)
    return pieces is not None and len(pieces) == kw["num"]


def _paragraphs_blank_lines(text: str, kw: dict[str, Any]) -> bool:
    return len(_blank_line_paragraphs(text)) == kw["num"]


def _nth_paragraph_first_word(text: str, kw: dict[str, Any]) -> bool:
    paragraphs = _blank_line_paragraphs(text)
    if len(paragraphs) != kw["num_paragraphs"]:
        return False
    first = _WORD.search(paragraphs[kw["nth"] - 1])
    return first is not None and first.group().casefold() == kw["first_word"].strip().casefold()


def _keywords_include(text: str, kw: dict[str, Any]) -> bool:
    folded = text.casefold()
    return all(next(_occurrences(folded, k.strip().casefold()), None) is not None for k in kw["keywords"])


def _keywords_exclude(text: str, kw: dict[str, Any]) -> bool:
    folded = text.casefold()
    return all(next(_occurrences(folded, k.strip().casefold()), None) is None for k in kw["keywords"])


def _keyword_frequency(text: str, kw: dict[str, Any]) -> bool:
    return _compares(_count_keyword(text, kw["keyword"]), kw)


def _letter_frequency(text: str, kw: dict[str, Any]) -> bool:
    return _compares(text.lower().count(kw["letter"].lower()), kw)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_format(text: str, kw: dict[str, Any]) -> bool:
    body = text.strip()
    if body.startswith("```"):
        opening, _, rest = body.partition("\n")
        rest = rest.rstrip()
        if opening[3:].strip().casefold() not in ("", "json") or not rest.endswith("```"):
            return False
        body = rest[:-3]
    try:
        json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False
    return True


def _title(text: str, kw: dict[str, Any]) -> bool:
    return any(m.group(1).strip() for m in _TITLE.finditer(text))


def _bullet_points(text: str, kw: dict[str, Any]) -> bool:
    count = sum(1 for line in text.splitlines() if line.lstrip()[:2] in ("* ", "- ", "*\t", "-\t"))
    return count == kw["num"]


def _highlighted_sections(text: str, kw: dict[str, Any]) -> bool:
    return sum(1 for m in _HIGHLIGHT.finditer(text) if m.group(1).strip()) >= kw["num"]


def _sections(text: str, kw: dict[str, Any]) -> bool:
    count = 0
    for end in _occurrences(text, kw["section_spliter"].strip(), whole_end=False):
        while end < len(text) and text[end] in " \t":
            end += 1
        count += end < len(text) and "0" <= text[end] <= "9"
    return count >= kw["num"]


def _placeholders(text: str, kw: dict[str, Any]) -> bool:
    return sum(1 for _ in _PLACEHOLDER.finditer(text)) >= kw["num"]


def _postscript(text: str, kw: dict[str, Any]) -> bool:
    marker = _squash(kw["postscript_marker"])
    return any(_squash(line.lstrip(" \t*_")).startswith(marker) for line in text.splitlines())


def _constrained_response(text: str, kw: dict[str, Any]) -> bool:
    return len({o.strip() for o in kw["options"] if o.strip() in text}) == 1


def _lowercase(text: str, kw: dict[str, Any]) -> bool:
    return text.islower()


def _uppercase(text: str, kw: dict[str, Any]) -> bool:
    return text.isupper()


def _capital_word_frequency(text: str, kw: dict[str, Any]) -> bool:
    return _compares(sum(1 for w in _words(text) if w.isupper()), kw)


def _no_commas(text: str, kw: dict[str, Any]) -> bool:
    return "," not in text and "，" not in text


def _end_checker(text: str, kw: dict[str, Any]) -> bool:
    return text.strip().casefold().endswith(kw["end_phrase"].strip().casefold())


def _quotation(text: str, kw: dict[str, Any]) -> bool:
    body = text.strip()
    return len(body) > 1 and (body[0], body[-1]) in (('"', '"'), ("“", "”"))


def _repeat_prompt(text: str, kw: dict[str, Any]) -> bool:
    return text.strip().casefold().startswith(kw["prompt_to_repeat"].strip().casefold())


def _two_responses(text: str, kw: dict[str, Any]) -> bool:
    pieces = _trim_blank_ends(text.split("******"))
    return pieces is not None and len(pieces) == 2 and pieces[0].strip() != pieces[1].strip()


def _regex(text: str, kw: dict[str, Any]) -> bool:
    return _compile(kw["pattern"], ()).search(text) is not None


# -- kwargs --------------------------------------------------------------------------------------


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be blank")
    return v


def _one_word(v: str) -> str:
    if _WORD.fullmatch(v.strip()) is None:
        raise ValueError("must be a single word (letters and digits, apostrophes between them)")
    return v


def _one_letter(v: str) -> str:
    if len(v) != 1 or not v.isalpha():
        raise ValueError("must be a single letter")
    return v


Text = Annotated[str, Field(min_length=1, max_length=MAX_KWARG_CHARS), AfterValidator(_not_blank)]
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_KWARG_ITEMS)]
Num = Annotated[int, Field(ge=0, le=MAX_NUM)]
Relation = Literal["at least", "at most", "less than", "more than", "exactly"]


class _Kwargs(_Options):
    # strict: 3.0 or "3" is no count, and a typo of a kwarg's type is reported, not coerced.
    model_config = ConfigDict(strict=True)


class _NoKwargs(_Kwargs):
    pass


class _Compare(_Kwargs):
    relation: Relation
    num: Num


class _Count(_Kwargs):
    num: Num


class _NthParagraph(_Kwargs):
    num_paragraphs: Annotated[int, Field(ge=1, le=MAX_NUM)]
    nth: Annotated[int, Field(ge=1, le=MAX_NUM)]
    first_word: Annotated[Text, AfterValidator(_one_word)]

    @field_validator("nth")
    @classmethod
    def _within(cls, v: int, info: ValidationInfo) -> int:
        total = info.data.get("num_paragraphs")
        if total is not None and v > total:
            raise ValueError(f"must be at most num_paragraphs ({total})")
        return v


class _Keywords(_Kwargs):
    keywords: Texts


class _KeywordFrequency(_Compare):
    keyword: Text


class _LetterFrequency(_Compare):
    letter: Annotated[str, AfterValidator(_one_letter)]


class _Sections(_Kwargs):
    section_spliter: Text
    num: Num


class _Postscript(_Kwargs):
    postscript_marker: Text


class _ConstrainedResponse(_Kwargs):
    options: Texts = Field(default_factory=lambda: list(ANSWER_OPTIONS))


class _EndPhrase(_Kwargs):
    end_phrase: Text


class _RepeatPrompt(_Kwargs):
    prompt_to_repeat: Text


class _Regex(_Kwargs):
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        _compile(v, ())
        return v


@dataclass(frozen=True)
class Constraint:
    """A constraint type: the model of its kwargs, its check (on a response and the validated kwargs, as a
    dict) and a line for docs."""

    kwargs: type[_Kwargs]
    check: Callable[[str, dict[str, Any]], bool]
    summary: str


CONSTRAINT_TYPES: dict[str, Constraint] = {
    "length_words": Constraint(_Compare, _length_words, "the number of words compares to num"),
    "length_sentences": Constraint(_Compare, _length_sentences, "the number of sentences compares to num"),
    "length_paragraphs": Constraint(_Count, _length_paragraphs, "exactly num paragraphs separated by *** lines"),
    "paragraphs_blank_lines": Constraint(_Count, _paragraphs_blank_lines, "exactly num paragraphs (blank lines)"),
    "nth_paragraph_first_word": Constraint(
        _NthParagraph,
        _nth_paragraph_first_word,
        "exactly num_paragraphs paragraphs (blank lines); paragraph nth begins with first_word",
    ),
    "keywords_include": Constraint(_Keywords, _keywords_include, "every keyword occurs (whole words, any case)"),
    "keywords_exclude": Constraint(_Keywords, _keywords_exclude, "no keyword occurs (whole words, any case)"),
    "keyword_frequency": Constraint(
        _KeywordFrequency, _keyword_frequency, "the number of occurrences of keyword compares to num"
    ),
    "letter_frequency": Constraint(
        _LetterFrequency, _letter_frequency, "the number of occurrences of letter (any case) compares to num"
    ),
    "json_format": Constraint(_NoKwargs, _json_format, "the whole response is JSON (a ```json fence allowed)"),
    "title": Constraint(_NoKwargs, _title, "a title in double angle brackets, <<title>>"),
    "bullet_points": Constraint(_Count, _bullet_points, "exactly num markdown bullets ('* ' or '- ')"),
    "highlighted_sections": Constraint(_Count, _highlighted_sections, "at least num *highlighted* sections"),
    "sections": Constraint(_Sections, _sections, "at least num sections headed '<section_spliter> <number>'"),
    "placeholders": Constraint(_Count, _placeholders, "at least num [placeholders] in square brackets"),
    "postscript": Constraint(_Postscript, _postscript, "a line beginning with postscript_marker (P.S., P.P.S)"),
    "constrained_response": Constraint(
        _ConstrainedResponse, _constrained_response, "exactly one of the options ('My answer is yes.', ...) occurs"
    ),
    "lowercase": Constraint(_NoKwargs, _lowercase, "all letters lowercase"),
    "uppercase": Constraint(_NoKwargs, _uppercase, "all letters uppercase"),
    "capital_word_frequency": Constraint(
        _Compare, _capital_word_frequency, "the number of all-capital words compares to num"
    ),
    "no_commas": Constraint(_NoKwargs, _no_commas, "no commas"),
    "end_checker": Constraint(_EndPhrase, _end_checker, "ends with end_phrase (any case)"),
    "quotation": Constraint(_NoKwargs, _quotation, "wrapped in double quotes"),
    "repeat_prompt": Constraint(_RepeatPrompt, _repeat_prompt, "begins with prompt_to_repeat (any case)"),
    "two_responses": Constraint(_NoKwargs, _two_responses, "two different responses separated by ******"),
    "regex": Constraint(_Regex, _regex, "an RE2 search of pattern matches"),
}


@functools.lru_cache(maxsize=128)
def _parse(raw: str, key: str, max_constraints: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """A sample's constraints, validated (cached: a group's samples usually share theirs)."""
    if len(raw) > MAX_CONSTRAINTS_BYTES or len(raw.encode()) > MAX_CONSTRAINTS_BYTES:
        raise ConstraintInvalid(key, f"more than {MAX_CONSTRAINTS_BYTES} bytes of JSON")
    try:
        items = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ConstraintInvalid(key, f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise ConstraintInvalid(key, f"not valid JSON: {str(e)[:100]}") from None
    if not isinstance(items, list):
        raise ConstraintInvalid(key, f'expected a JSON list of {{"type": ...}} objects, not {type(items).__name__}')
    if not items:
        raise ConstraintInvalid(key, "an empty list: at least one constraint is needed")
    if len(items) > max_constraints:
        raise ConstraintInvalid(key, f"{len(items)} constraints; at most {max_constraints} (max_constraints)")
    parsed = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise ConstraintInvalid(where, f'expected a {{"type": ...}} object, not {type(item).__name__}', i)
        kind = item.get("type")
        if not isinstance(kind, str):
            raise ConstraintInvalid(where, "type: missing, or not a string", i, "type")
        constraint = CONSTRAINT_TYPES.get(kind)
        if constraint is None:
            raise ConstraintInvalid(
                where,
                f"type: unknown constraint type {kind!r:.80} (see tauflow.reward.ifeval.CONSTRAINT_TYPES)",
                i,
                "type",
            )
        kwargs = {k: v for k, v in item.items() if k != "type" and v is not None}
        try:
            parsed.append((kind, _validate(constraint.kwargs, kwargs)))
        except ConfigInvalid as e:
            raise ConstraintInvalid(f"{where} ({kind})", f"{e.key}: {e.problem}", i, e.key) from None
    return tuple(parsed)


def _variants(text: str, loose: bool) -> list[str]:
    """The texts a constraint is checked on: the response, or with ``loose`` IFEval's eight variants;
    blank ones are dropped (an empty response follows nothing)."""
    if not loose:
        return [text] if text.strip() else []
    lines = text.split("\n")
    cut = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    variants = cut + [v.replace("*", "") for v in cut]
    return [v for v in dict.fromkeys(variants) if v.strip()]


# -- the reward function -------------------------------------------------------------------------


class IFEvalOptions(_Options):
    constraints_key: str = Field("constraints", min_length=1, max_length=MAX_KEY_CHARS)
    scoring: Literal["all", "fraction"] = "all"
    loose: bool = False
    max_constraints: int = Field(32, ge=1, le=MAX_CONSTRAINTS)
    correct_score: float = 1.0
    incorrect_score: float = 0.0


class InstructionFollowing:
    description = (
        "IFEval-style verifiable instructions: the constraints of each sample (a JSON list under "
        "Sample.metadata['constraints'], else Group.metadata['constraints'], e.g. "
        '[{"type": "length_words", "relation": "at least", "num": 300}, {"type": "no_commas"}]) are checked '
        "on the completion; scoring 'all' gives correct_score when every one holds, 'fraction' the fraction "
        "that hold (between incorrect_score and correct_score); loose also tries the response without its "
        "first/last line and without '*'. Components: followed, constraints, c<i>.<type>."
    )
    default_config: ClassVar[dict[str, Any]] = IFEvalOptions().model_dump()
    timeout_s = 2.0
    fallback_score = 0.0

    @staticmethod
    def validate_config(config: dict[str, Any]) -> dict[str, Any]:
        return _validate(IFEvalOptions, config)

    def __call__(self, sample: SampleInput, config: dict[str, Any]) -> Score:
        key = config["constraints_key"]
        raw = sample.get(key)
        if raw is None:
            raise MissingReference(
                f"no constraints: neither Sample.metadata[{key!r}] nor Group.metadata[{key!r}] is set"
            )
        constraints = _parse(raw, key, config["max_constraints"])
        variants = _variants(sample.completion_text, config["loose"])
        followed = 0
        held: dict[str, float] = {}
        for i, (kind, kwargs) in enumerate(constraints):
            check = CONSTRAINT_TYPES[kind].check
            holds = any(check(v, kwargs) for v in variants)
            followed += holds
            held[f"c{i}.{kind}"] = 1.0 if holds else 0.0
        n = len(constraints)
        correct, incorrect = config["correct_score"], config["incorrect_score"]
        if followed == n:
            score = correct
        elif config["scoring"] == "all":
            score = incorrect
        else:
            score = incorrect + (correct - incorrect) * followed / n
        return Score(score, {"followed": float(followed), "constraints": float(n), **held})
