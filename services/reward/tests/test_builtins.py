"""The built-in reward functions, called directly (no pool, no gRPC)."""

from __future__ import annotations

from typing import Any

import pytest

from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid, ExactMatch, Format, Math, MissingReference


def sample(text: str, answer: str | None = None, group_answer: str | None = None) -> SampleInput:
    return SampleInput(
        sample_id="0",
        completion_text=text,
        metadata={} if answer is None else {"answer": answer},
        group_metadata={} if group_answer is None else {"answer": group_answer},
    )


def run(fn: Any, s: SampleInput, **overrides: Any) -> float:
    config = fn.validate_config({**fn.default_config, **overrides})
    result = fn(s, config)
    return result.score if isinstance(result, Score) else result


# -- exact_match ---------------------------------------------------------------------------------


def test_exact_match_scores_equal_answers_one_and_others_zero() -> None:
    em = ExactMatch()
    assert run(em, sample("42", "42")) == 1.0
    assert run(em, sample("43", "42")) == 0.0
    assert run(em, sample("420", "42")) == 0.0


def test_exact_match_reads_the_sample_answer_before_the_group_answer() -> None:
    em = ExactMatch()
    assert run(em, sample("7", group_answer="7")) == 1.0
    assert run(em, sample("7", answer="8", group_answer="7")) == 0.0  # the sample's own answer wins
    with pytest.raises(MissingReference, match=r"Sample.metadata\['answer'\].*Group.metadata\['answer'\]"):
        run(em, sample("7"))


def test_exact_match_normalisation_options() -> None:
    em = ExactMatch()
    assert run(em, sample("  42\n", "42")) == 1.0
    assert run(em, sample("  42\n", "42"), strip=False) == 0.0
    assert run(em, sample("New   York", "new york")) == 0.0  # case matters by default
    assert run(em, sample("New   York", "new york"), ignore_case=True) == 1.0
    assert run(em, sample("New   York", "New York"), collapse_whitespace=False) == 0.0


def test_exact_match_extracts_the_last_match_of_extract_pattern() -> None:
    em = ExactMatch()
    text = "first #### 12 then thinking again #### 13"
    assert run(em, sample(text, "13"), extract_pattern=r"####\s*(\S+)") == 1.0
    assert run(em, sample(text, "12"), extract_pattern=r"####\s*(\S+)") == 0.0
    result = em(sample("no marker", "13"), em.validate_config({**em.default_config, "extract_pattern": "####(.*)"}))
    assert result.score == 0.0 and result.components == {"answer_found": 0.0}


def test_exact_match_scores_are_configurable_and_config_is_checked() -> None:
    em = ExactMatch()
    assert run(em, sample("x", "y"), incorrect_score=-1.0) == -1.0
    with pytest.raises(ConfigInvalid) as e:
        em.validate_config({**em.default_config, "extract_pattern": "(unclosed"})
    assert e.value.key == "extract_pattern"
    with pytest.raises(ConfigInvalid) as e:
        em.validate_config({**em.default_config, "strip": "sometimes"})
    assert e.value.key == "strip"


# -- format -------------------------------------------------------------------------------------


def test_format_default_checks_think_then_answer_tags() -> None:
    fmt = Format()
    assert run(fmt, sample("<think>a\nb</think>\n<answer>4</answer>")) == 1.0
    assert run(fmt, sample("<answer>4</answer>")) == 0.0
    assert run(fmt, sample("<think>a</think><answer>4</answer> trailing")) == 0.0  # fullmatch


def test_format_modes_and_flags() -> None:
    fmt = Format()
    assert run(fmt, sample("the answer is 4"), pattern=r"\d+", mode="search") == 1.0
    assert run(fmt, sample("the answer is 4"), pattern=r"\d+", mode="match") == 0.0
    assert run(fmt, sample("ANSWER: 4"), pattern=r"answer: \d", mode="fullmatch") == 0.0
    assert run(fmt, sample("ANSWER: 4"), pattern=r"answer: \d", flags=["IGNORECASE"]) == 1.0
    assert run(fmt, sample("x"), pattern="y", mismatch_score=-0.5) == -0.5


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"pattern": "(("}, "pattern"), ({"pattern": ""}, "pattern"), ({"mode": "sometimes"}, "mode"),
     ({"flags": ["VERBOSE"]}, "flags.0")],
)
def test_format_rejects_bad_config_naming_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        Format.validate_config({**Format.default_config, **overrides})
    assert e.value.key == key


# -- math ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
        ("So we get $0.5$.", "\\frac{1}{2}"),
        ("Therefore the result is \\boxed{2/4}", "$\\frac{1}{2}$"),
        ("... which gives \\boxed{1000}", "1,000"),
        ("The roots are $x = 3$", "3"),
    ],
)
def test_math_accepts_equivalent_answers(completion: str, answer: str) -> None:
    assert run(Math(), sample(completion, answer)) == 1.0


def test_math_rejects_wrong_or_missing_answers() -> None:
    m = Math()
    assert run(m, sample("The answer is \\boxed{3}", "4")) == 0.0
    result = m(sample("I do not know", "4"), Math.validate_config(dict(Math.default_config)))
    assert result.score == 0.0 and result.components["answer_found"] == 0.0
    with pytest.raises(MissingReference):
        run(m, sample("\\boxed{4}"))


def test_math_uses_the_final_boxed_answer_and_the_group_reference() -> None:
    assert run(Math(), sample("Try 3? No: the answer is \\boxed{5}", group_answer="5")) == 1.0


def test_math_reference_that_does_not_parse_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not parse"):
        run(Math(), sample("\\boxed{4}", "no math here at all"))


def test_math_config_is_checked() -> None:
    with pytest.raises(ConfigInvalid) as e:
        Math.validate_config({**Math.default_config, "extraction": ["latex", "pictures"]})
    assert e.value.key.startswith("extraction")
    assert Math.validate_config({**Math.default_config, "float_rounding": 3.0})["float_rounding"] == 3
