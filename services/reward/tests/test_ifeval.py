"""The ``ifeval`` built-in (instruction-following constraints), called directly (no pool, no gRPC)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid, MissingReference
from tauflow.reward.ifeval import CONSTRAINT_TYPES, ConstraintInvalid, IFEvalOptions, InstructionFollowing

IF = InstructionFollowing()


def sample(text: str, constraints: Any = None, *, group: Any = None, key: str = "constraints") -> SampleInput:
    def encoded(c: Any) -> dict[str, str]:
        if c is None:
            return {}
        return {key: c if isinstance(c, str) else json.dumps(c)}

    return SampleInput(
        sample_id="0", completion_text=text, metadata=encoded(constraints), group_metadata=encoded(group)
    )


def score(text: str, constraints: Any, **overrides: Any) -> Score:
    config = IF.validate_config({**IF.default_config, **overrides})
    return IF(sample(text, constraints), config)


def holds(constraint: dict[str, Any], text: str, *, loose: bool = False) -> bool:
    result = score(text, [constraint], loose=loose)
    assert result.components["constraints"] == 1.0
    return result.components[f"c0.{constraint['type']}"] == 1.0


# -- every constraint type: a response that follows it and one that does not ----------------------

CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "length_words", "relation": "at least", "num": 5}, "Don't stop: it's 42 o'clock!", "one two three four"),
    ({"type": "length_sentences", "relation": "exactly", "num": 3}, "Pi is 3.14 exactly. Wait... really?!", "A. B."),
    ({"type": "length_paragraphs", "num": 2}, "***\n***Bold*** one.\n  ***  \nTwo.\n***\n", "One.\n\nTwo."),
    ({"type": "paragraphs_blank_lines", "num": 3}, "a\nstill a\n\nb\n \t\n\nc\n", "a\nb\n\nc"),
    (
        {"type": "nth_paragraph_first_word", "num_paragraphs": 3, "nth": 2, "first_word": "Moreover"},
        "Intro.\n\nmoreover, this.\n\nEnd.",
        "Intro.\n\nHowever, moreover.\n\nEnd.",
    ),
    (
        {"type": "keywords_include", "keywords": ["cat", "Machine learning"]},
        "The CAT's view on machine learning.",
        "The category of machine learning.",
    ),
    ({"type": "keywords_exclude", "keywords": ["cat", "dog"]}, "A category of hotdogs.", "A dog and a Cat."),
    (
        {"type": "keyword_frequency", "keyword": "the", "relation": "exactly", "num": 2},
        "The cat and the dog went there, then.",
        "the the the",
    ),
    ({"type": "letter_frequency", "letter": "a", "relation": "at least", "num": 4}, "A banana", "Abc bca xyz"),
    ({"type": "json_format"}, '```json\n{"a": [1, 2]}\n```', '{"a": 1} and some words'),
    ({"type": "title"}, "<<My Title>>\nThe body.", "<<  >> <Not a title> <<broken\ntitle>>"),
    ({"type": "bullet_points", "num": 2}, "* one\n  - two\n**bold** line\n*italic*\n***", "* one\n* two\n* three"),
    ({"type": "highlighted_sections", "num": 2}, "*one* and **two**", "*one* and * * and *two\nlines*"),
    (
        {"type": "sections", "section_spliter": "SECTION", "num": 2},
        "SECTION 1\nx\n**SECTION\t2**\ny",
        "SECTION 1\nx\nSection 2\ny\nSUBSECTION 3\nSECTIONS 4\nSECTION X",
    ),
    ({"type": "placeholders", "num": 2}, "Dear [name], at [address].", "Dear [name], at [] or [a\nb]."),
    ({"type": "postscript", "postscript_marker": "P.S."}, "Hi.\n\n**P. S.** bye", "Hi. P.S. inline\nP.P.S. x"),
    ({"type": "constrained_response"}, "My answer is yes. Because.", "My answer is yes. My answer is no."),
    ({"type": "lowercase"}, "hello world 42.", "Hello world."),
    ({"type": "uppercase"}, "HELLO WORLD 42.", "HELLO world."),
    ({"type": "capital_word_frequency", "relation": "at least", "num": 2}, "NASA and I went", "Nasa and i went"),
    ({"type": "no_commas"}, "No commas here.", "Full-width，comma."),
    (
        {"type": "end_checker", "end_phrase": "Any other questions?"},
        "Done. any other questions?  \n",
        "Done. Any other questions? Bye.",
    ),
    ({"type": "quotation"}, ' "Quoted, fully." ', '"Quoted" and then not.'),
    ({"type": "repeat_prompt", "prompt_to_repeat": "Write a poem."}, "write a POEM.\nRoses...", "Sure! Write a poem."),
    ({"type": "two_responses"}, "First.\n******\nSecond.", "Same.\n******\n Same. "),
    ({"type": "regex", "pattern": r"(?i)^hello\s+world$"}, "HELLO   World", "well, hello world"),
]


@pytest.mark.parametrize(("constraint", "following", "not_following"), CASES, ids=[c[0]["type"] for c in CASES])
def test_each_constraint_holds_on_a_following_response_and_fails_on_another(
    constraint: dict[str, Any], following: str, not_following: str
) -> None:
    assert holds(constraint, following)
    assert not holds(constraint, not_following)


def test_the_cases_cover_every_constraint_type() -> None:
    assert {c[0]["type"] for c in CASES} == set(CONSTRAINT_TYPES)
    assert all(c.summary for c in CONSTRAINT_TYPES.values())


@pytest.mark.parametrize(
    ("constraint", "text", "expected"),
    [
        # words: letters/digits with apostrophes inside; "_" and punctuation separate them
        ({"type": "length_words", "relation": "exactly", "num": 6}, "snake_case: 3.14 rock'n'roll -- l'eau", True),
        ({"type": "length_sentences", "relation": "exactly", "num": 1}, "no terminator at all", True),
        ({"type": "length_sentences", "relation": "exactly", "num": 2}, "Mr. Smith", True),  # no abbreviations
        ({"type": "length_sentences", "relation": "exactly", "num": 1}, "... ?! .", False),  # no words: none
        ({"type": "length_paragraphs", "num": 2}, "a\n***\n\n***\nb", False),  # a blank piece in between
        ({"type": "length_paragraphs", "num": 1}, "a *** b", True),  # only a line of *** divides
        (
            {"type": "nth_paragraph_first_word", "num_paragraphs": 2, "nth": 2, "first_word": "end"},
            "a\n\n**End**",
            True,
        ),
        ({"type": "keywords_include", "keywords": ["c++"]}, "I like C++.", True),
        ({"type": "keyword_frequency", "keyword": "aa", "relation": "exactly", "num": 0}, "aaaa aaa", True),
        ({"type": "keyword_frequency", "keyword": "ab", "relation": "exactly", "num": 2}, "ab-ab", True),
        ({"type": "json_format"}, '{"a": NaN}', False),
        ({"type": "json_format"}, "```\n[1, 2]\n```", True),
        ({"type": "json_format"}, "```python\n[1, 2]\n```", False),
        ({"type": "json_format"}, "[" * 500 + "]" * 500, True),
        ({"type": "json_format"}, "[" * 100_000, False),  # too deep for the parser: not JSON, no crash
        ({"type": "constrained_response", "options": ["Yes", "No"]}, "No, thanks.", True),
        ({"type": "constrained_response"}, "My answer is yes. Really: My answer is yes.", True),
        ({"type": "lowercase"}, "123 !", False),  # no letter at all
        ({"type": "quotation"}, '"', False),
        ({"type": "quotation"}, "“Curly.”", True),
        ({"type": "two_responses"}, "******\nOne.\n******\nTwo.\n******", True),
        ({"type": "two_responses"}, "One.\n******\nTwo.\n******\nThree.", False),
        ({"type": "two_responses"}, "One.\n******\n\n******\nTwo.", False),
        ({"type": "postscript", "postscript_marker": "P.P.S"}, "Hi.\np.p.s. more", True),
    ],
)
def test_text_units_and_edge_cases(constraint: dict[str, Any], text: str, expected: bool) -> None:
    assert holds(constraint, text) is expected


FIVE_WORDS = "one two three four five"


@pytest.mark.parametrize(
    ("relation", "num", "expected"),
    [
        ("at least", 4, True),
        ("at least", 5, True),
        ("at least", 6, False),
        ("at most", 6, True),
        ("at most", 5, True),
        ("at most", 4, False),
        ("less than", 6, True),
        ("less than", 5, False),
        ("less than", 4, False),
        ("more than", 4, True),
        ("more than", 5, False),
        ("more than", 6, False),
        ("exactly", 5, True),
        ("exactly", 4, False),
        ("exactly", 6, False),
    ],
)
def test_relations_at_their_boundaries(relation: str, num: int, expected: bool) -> None:
    for kind in ("length_words", "capital_word_frequency"):
        text = FIVE_WORDS if kind == "length_words" else FIVE_WORDS.upper() + " and more"
        assert holds({"type": kind, "relation": relation, "num": num}, text) is expected
    assert holds({"type": "length_sentences", "relation": relation, "num": num}, "A. B! C? D... E") is expected
    assert holds({"type": "keyword_frequency", "keyword": "x", "relation": relation, "num": num}, "x " * 5) is expected
    assert holds({"type": "letter_frequency", "letter": "Z", "relation": relation, "num": num}, "zZzZz") is expected


# -- scoring, loose, components ------------------------------------------------------------------

SURE = "Sure, here it is:\nhello world without any punctuation marks\nHope this helps!"


def test_loose_tries_the_response_without_its_first_and_last_lines_and_without_asterisks() -> None:
    constraints = [
        {"type": "lowercase"},
        {"type": "no_commas"},
        {"type": "end_checker", "end_phrase": "punctuation marks"},
    ]
    strict = score(SURE, constraints)
    assert strict.score == 0.0
    assert strict.components == {
        "followed": 0.0,
        "constraints": 3.0,
        "c0.lowercase": 0.0,
        "c1.no_commas": 0.0,
        "c2.end_checker": 0.0,
    }
    loose = score(SURE, constraints, loose=True)
    assert loose.score == 1.0 and loose.components["followed"] == 3.0
    # ``*`` removed: the JSON wrapped in bold
    assert not holds({"type": "json_format"}, '**{"a": 1}**')
    assert holds({"type": "json_format"}, '**{"a": 1}**', loose=True)
    # a constraint that never holds does not hold loosely either
    assert not holds({"type": "uppercase"}, SURE, loose=True)


def test_an_empty_response_follows_nothing() -> None:
    for text in ("", "  \n\t"):
        for loose in (False, True):
            result = score(text, [{"type": "no_commas"}, {"type": "keywords_exclude", "keywords": ["x"]}], loose=loose)
            assert result.score == 0.0 and result.components["followed"] == 0.0


def test_scoring_all_or_fraction_between_incorrect_and_correct_score() -> None:
    constraints = [
        {"type": "lowercase"},
        {"type": "no_commas"},
        {"type": "length_words", "relation": "at most", "num": 3},
        {"type": "title"},
    ]
    text = "hello there, world"
    assert score(text, constraints).score == 0.0
    assert score(text, constraints, scoring="fraction").score == pytest.approx(0.5)
    assert score(text, constraints, scoring="fraction", incorrect_score=-1.0).score == pytest.approx(0.0)
    assert score(text, constraints, correct_score=2.0, incorrect_score=-1.0).score == -1.0
    result = score(text, constraints, scoring="fraction")
    assert result.components == {
        "followed": 2.0,
        "constraints": 4.0,
        "c0.lowercase": 1.0,
        "c1.no_commas": 0.0,
        "c2.length_words": 1.0,
        "c3.title": 0.0,
    }
    # all of them: exactly correct_score, whatever the rounding of the fraction
    assert (
        score("hello", [{"type": "lowercase"}] * 3, scoring="fraction", correct_score=0.3, incorrect_score=0.1).score
        == 0.3
    )
    assert score("hello", [{"type": "lowercase"}] * 3, correct_score=0.3).score == 0.3


def test_constraints_come_from_the_sample_then_the_group_under_constraints_key() -> None:
    config = IF.validate_config(IF.default_config)
    assert IF(sample("hi", group=[{"type": "lowercase"}]), config).score == 1.0
    assert IF(sample("hi", [{"type": "uppercase"}], group=[{"type": "lowercase"}]), config).score == 0.0
    with pytest.raises(MissingReference, match=r"Sample.metadata\['constraints'\].*Group.metadata\['constraints'\]"):
        IF(sample("hi"), config)
    other = IF.validate_config({**IF.default_config, "constraints_key": "ifeval"})
    assert IF(sample("hi", [{"type": "lowercase"}], key="ifeval"), other).score == 1.0
    with pytest.raises(MissingReference, match="ifeval"):
        IF(sample("hi", [{"type": "lowercase"}]), other)


def test_default_config_and_config_checks() -> None:
    assert IF.default_config == {
        "constraints_key": "constraints",
        "scoring": "all",
        "loose": False,
        "max_constraints": 32,
        "correct_score": 1.0,
        "incorrect_score": 0.0,
    }
    assert IF.default_config == IFEvalOptions().model_dump()
    assert IF.timeout_s == 2.0 and IF.fallback_score == 0.0
    for overrides, key in [
        ({"scoring": "most"}, "scoring"),
        ({"max_constraints": 63}, "max_constraints"),
        ({"max_constraints": 0}, "max_constraints"),
        ({"correct_score": float("nan")}, "correct_score"),
        ({"constraints_key": ""}, "constraints_key"),
        ({"threshold": 1}, "threshold"),
    ]:
        with pytest.raises(ConfigInvalid) as e:
            IF.validate_config({**IF.default_config, **overrides})
        assert e.value.key == key


# -- malformed constraints: a ValueError that says where ------------------------------------------


def _refused(raw: Any, **overrides: Any) -> ConstraintInvalid:
    with pytest.raises(ConstraintInvalid) as e:
        score("text", raw, **overrides)
    assert isinstance(e.value, ValueError)
    return e.value


OK = {"type": "no_commas"}


@pytest.mark.parametrize(
    ("raw", "index", "kwarg", "message"),
    [
        ("not json", -1, "", r"^constraints: not valid JSON"),
        ("[NaN]", -1, "", r"not valid JSON"),
        ("[" * 50_000, -1, "", r"not valid JSON"),
        ('{"type": "no_commas"}', -1, "", r"expected a JSON list .* not dict"),
        ([], -1, "", r"an empty list"),
        ("[" + " " * 70_000 + "]", -1, "", r"more than 65536 bytes"),
        ([OK, 3], 1, "", r"^constraints\[1\]: expected a .* object, not int"),
        ([OK, {"num": 3}], 1, "type", r"^constraints\[1\]: type: missing"),
        ([OK, {"type": 7}], 1, "type", r"type: missing, or not a string"),
        ([OK, {"type": "language"}], 1, "type", r"unknown constraint type 'language'"),
        ([{"type": "length_words", "num": 3}], 0, "relation", r"^constraints\[0\] \(length_words\): relation: Field"),
        ([{"type": "length_words", "relation": "about", "num": 3}], 0, "relation", r"relation: Input should be"),
        ([{"type": "length_words", "relation": "at least", "num": "3"}], 0, "num", r"num: Input should be a valid int"),
        ([{"type": "length_words", "relation": "at least", "num": 3.0}], 0, "num", r"num: "),
        ([{"type": "length_words", "relation": "at least", "num": True}], 0, "num", r"num: "),
        ([{"type": "length_words", "relation": "at least", "num": -1}], 0, "num", r"num: .*greater than or equal"),
        ([OK, OK, {"type": "bullet_points", "num": 1_000_001}], 2, "num", r"^constraints\[2\] \(bullet_points\): num"),
        ([{"type": "keywords_include", "keywords": []}], 0, "keywords", r"keywords: .*at least 1 item"),
        ([{"type": "keywords_include", "keywords": ["x"] * 65}], 0, "keywords", r"at most 64 items"),
        ([{"type": "keywords_include", "keywords": "cat"}], 0, "keywords", r"valid list"),
        ([{"type": "keywords_exclude", "keywords": ["a", ""]}], 0, "keywords.1", r"keywords.1: "),
        ([{"type": "keywords_exclude", "keywords": ["  "]}], 0, "keywords.0", r"must not be blank"),
        (
            [{"type": "letter_frequency", "letter": "ab", "relation": "exactly", "num": 1}],
            0,
            "letter",
            r"single letter",
        ),
        ([{"type": "letter_frequency", "letter": "1", "relation": "exactly", "num": 1}], 0, "letter", r"single letter"),
        (
            [{"type": "nth_paragraph_first_word", "num_paragraphs": 2, "nth": 3, "first_word": "a"}],
            0,
            "nth",
            r"nth: must be at most num_paragraphs \(2\)",
        ),
        (
            [{"type": "nth_paragraph_first_word", "num_paragraphs": 2, "nth": 1, "first_word": "two words"}],
            0,
            "first_word",
            r"single word",
        ),
        ([{"type": "end_checker", "end_phrase": "x" * 2049}], 0, "end_phrase", r"at most 2048 characters"),
        ([{"type": "end_checker"}], 0, "end_phrase", r"Field required"),
        ([{"type": "no_commas", "strict": True}], 0, "strict", r"strict: unknown key"),
        ([{"type": "regex", "pattern": r"(a)\1"}], 0, "pattern", r"pattern: not a valid regular expression"),
        ([{"type": "regex", "pattern": r"(?=a)"}], 0, "pattern", r"RE2 syntax"),
        ([{"type": "regex", "pattern": r"(x|y|\pL){1000}"}], 0, "pattern", r"pattern too large"),
        ([{"type": "regex", "pattern": ""}], 0, "pattern", r"at least 1 character"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_index_and_kwarg(
    raw: Any, index: int, kwarg: str, message: str
) -> None:
    error = _refused(raw)
    assert (error.index, error.kwarg) == (index, kwarg)
    assert len(str(error)) < 400
    assert re.search(message, str(error)), str(error)


def test_a_null_kwarg_counts_as_absent() -> None:
    # (datasets stored with a column per kwarg carry every kwarg of every type, mostly null)
    assert holds({"type": "no_commas", "num": None, "keywords": None}, "fine")
    assert holds({"type": "constrained_response", "options": None}, "My answer is no.")
    assert _refused([{"type": "length_words", "relation": "at least", "num": None}]).kwarg == "num"


def test_too_many_constraints_are_refused() -> None:
    error = _refused([OK] * 33)
    assert "33 constraints; at most 32 (max_constraints)" in str(error)
    result = score("fine", [OK] * 62, max_constraints=62)
    assert result.score == 1.0 and len(result.components) == 64  # what the service keeps
    assert "at most 5" in str(_refused([OK] * 6, max_constraints=5))


def test_errors_are_raised_again_for_every_sample_with_the_same_constraints() -> None:
    # (the parse is cached, its failures are not)
    raw = [{"type": "nope"}]
    for _ in range(2):
        _refused(raw)


# -- bounded work -----------------------------------------------------------------------------------


def _timed(text: str, constraints: list[dict[str, Any]], **overrides: Any) -> tuple[Score, float]:
    start = time.perf_counter()
    result = score(text, constraints, **overrides)
    return result, time.perf_counter() - start


def test_a_hostile_regex_runs_in_linear_time() -> None:
    # (a+)+$ takes minutes in Python's re on 40 a's and a b; RE2 never backtracks
    result, took = _timed("a" * 100_000 + "b", [{"type": "regex", "pattern": "(a+)+$"}], loose=True)
    assert result.score == 0.0 and took < 0.5


@pytest.mark.parametrize(
    "text",
    [
        "<<" * 50_000,
        "[" * 100_000,
        "*" * 100_000,
        "." * 100_000 + "x",
        "a'" * 50_000,
        "\n" * 100_000,
        "SECTION" * 20_000,
        "x" * 100_000,
    ],
    ids=["angles", "brackets", "stars", "dots", "apostrophes", "newlines", "spliters", "letters"],
)
def test_every_constraint_on_a_pathological_response_is_fast(text: str) -> None:
    every = [{"type": kind, **kwargs} for kind, kwargs in _KWARGS.items()]
    result, took = _timed(text, every, loose=True, max_constraints=62)
    assert result.components["constraints"] == len(CONSTRAINT_TYPES)
    assert took < 1.5


_KWARGS: dict[str, dict[str, Any]] = {c["type"]: {k: v for k, v in c.items() if k != "type"} for c, _, _ in CASES}
_KWARGS["keyword_frequency"] = {"keyword": "x" * 1000, "relation": "at least", "num": 1}
