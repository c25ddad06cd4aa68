"""The built-in reward functions, called directly (no pool, no gRPC)."""

from __future__ import annotations

import time
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


class CountingSpaces:
    """Stands in for ``builtins._SPACES``: counts the texts exact_match normalises, by their length."""

    def __init__(self) -> None:
        import re

        self.real = re.compile(r"\s+")
        self.lengths: list[int] = []

    def sub(self, repl: str, text: str) -> str:
        self.lengths.append(len(text))
        return self.real.sub(repl, text)


def test_exact_match_normalises_a_groups_reference_once_not_once_per_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    # Group.metadata is shared by every sample of a request: its reference was normalised again for each
    # sample (a 1 MiB reference: ~50 ms per sample, ~50 min for the 65,536 samples one request may hold).
    from tauflow.reward import builtins

    counting = CountingSpaces()
    monkeypatch.setattr(builtins, "_SPACES", counting)
    builtins._normalised_reference.clear()
    em = ExactMatch()
    config = em.validate_config(em.default_config)
    reference = "the answer  is " + "x " * 30_000  # under max_answer_chars (65,536)
    shared = {"answer": reference}  # one dict for the group, as the service builds it
    samples = [SampleInput(sample_id=str(i), completion_text=f"c{i}", group_metadata=shared) for i in range(500)]
    results = [em(s, config) for s in samples]
    assert [r.score for r in results] == [0.0] * 500
    assert counting.lengths.count(len(reference)) == 1  # once for the group (it was 500)
    assert len(counting.lengths) == 1 + 500  # and each completion once
    # a sample's own reference is its own, and another group's reference is normalised once more
    assert em(sample(" " + reference, answer=reference + "  "), config).score == 1.0
    other = {"answer": "y " * 100}
    for i in range(10):
        em(SampleInput(sample_id=str(i), completion_text="y", group_metadata=other), config)
    assert counting.lengths.count(200) == 1
    # the normalisation options are part of what is remembered
    assert em(sample("THE ANSWER IS " + "X " * 30_000, group_answer=reference), {**config, "ignore_case": True}).score
    assert em(sample("THE ANSWER IS " + "X " * 30_000, group_answer=reference), config).score == 0.0


def test_exact_match_bounds_the_reference_and_the_answer_by_max_answer_chars() -> None:
    em = ExactMatch()
    assert em.default_config["max_answer_chars"] == 65_536
    # a reference over the bound is an error of the sample (as qa's), found without reading it
    with pytest.raises(ValueError, match="the reference is 65537 characters long; max_answer_chars is 65536"):
        run(em, sample("x", group_answer="x" * 65_537))
    with pytest.raises(ValueError, match="the reference is 11 characters long; max_answer_chars is 10"):
        run(em, sample("x", group_answer="x" * 11), max_answer_chars=10)
    assert run(em, sample("x" * 10, group_answer="x" * 10), max_answer_chars=10) == 1.0
    # an answer over it scores incorrect_score without being compared (answer_found: it was there)
    config = em.validate_config({**em.default_config, "max_answer_chars": 10})
    assert em(sample("42" + " " * 9, "42"), config) == Score(0.0, {"answer_found": 1.0})
    assert em(sample("42" + " " * 8, "42"), config) == Score(1.0, {"answer_found": 1.0})
    with pytest.raises(ConfigInvalid) as e:
        em.validate_config({**em.default_config, "max_answer_chars": (1 << 20) + 1})
    assert e.value.key == "max_answer_chars"


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
    [
        ({"pattern": "(("}, "pattern"),
        ({"pattern": ""}, "pattern"),
        ({"mode": "sometimes"}, "mode"),
        ({"flags": ["VERBOSE"]}, "flags.0"),
    ],
)
def test_format_rejects_bad_config_naming_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigInvalid) as e:
        Format.validate_config({**Format.default_config, **overrides})
    assert e.value.key == key


def _timed(fn: Any, s: SampleInput, **overrides: Any) -> tuple[float, float]:
    start = time.perf_counter()
    score = run(fn, s, **overrides)
    return score, time.perf_counter() - start


def test_patterns_that_backtrack_catastrophically_in_python_re_match_in_linear_time() -> None:
    # Python's re takes minutes on both (the nested quantifier; the default pattern over a completion of
    # 40,000 '</think><answer>' junctions is quadratic: 13.7 s at 10,000 of them): RE2 never backtracks.
    fmt = Format()
    assert _timed(fmt, sample("a" * 40), pattern="(a+)+$")[0] == 1.0
    score, took = _timed(fmt, sample("a" * 40 + "b"), pattern="(a+)+$", mode="search")
    assert score == 0.0 and took < 0.05
    score, took = _timed(fmt, sample("<think></think><answer>" * 40_000))
    assert score == 0.0 and took < 0.5
    em = ExactMatch()
    score, took = _timed(em, sample("a" * 5000 + "!", "x"), extract_pattern="(a|aa)+$")
    assert score == 0.0 and took < 0.5


@pytest.mark.parametrize(
    ("fn", "overrides", "key", "message"),
    [
        (Format, {"pattern": r"(a)\1"}, "pattern", "RE2 syntax"),  # a backreference
        (Format, {"pattern": r"(?=a)"}, "pattern", "RE2 syntax"),  # look-ahead
        (Format, {"pattern": "x" * 2049}, "pattern", "at most 2048 characters"),
        (Format, {"pattern": r"(x|y|\pL){1000}"}, "pattern", "pattern too large"),  # over RE2's memory budget
        (Format, {"match_score": float("nan")}, "match_score", "finite number"),
        (Format, {"flags": ["DOTALL"] * 5}, "flags", "at most 4 items"),
        (ExactMatch, {"extract_pattern": r"(\w+)\1"}, "extract_pattern", "RE2 syntax"),
        (ExactMatch, {"correct_score": float("inf")}, "correct_score", "finite number"),
        (ExactMatch, {"answer_key": "k" * 257}, "answer_key", "at most 256 characters"),
        (Math, {"incorrect_score": float("-inf")}, "incorrect_score", "finite number"),
        (Math, {"boxed_match_priority": 1e300}, "boxed_match_priority", ""),
    ],
)
def test_configs_refuse_unsafe_patterns_non_finite_scores_and_oversized_values(
    fn: Any, overrides: dict[str, Any], key: str, message: str
) -> None:
    with pytest.raises(ConfigInvalid) as e:
        fn.validate_config({**fn.default_config, **overrides})
    assert e.value.key == key and message in e.value.problem


def test_format_flags_map_to_re2_options() -> None:
    fmt = Format()
    assert run(fmt, sample("a\nb"), pattern="a.b") == 1.0  # DOTALL, the default
    assert run(fmt, sample("a\nb"), pattern="a.b", flags=[]) == 0.0
    assert run(fmt, sample("x\nanswer: 4"), pattern=r"^answer: \d$", mode="search", flags=["MULTILINE"]) == 1.0
    assert run(fmt, sample("x\nanswer: 4"), pattern=r"^answer: \d$", mode="search", flags=[]) == 0.0
    assert run(fmt, sample("Ünïcode"), pattern=r"\pL+", flags=["ASCII"]) == 1.0  # \pL: Unicode letters


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


def test_math_reads_a_gsm8k_reference_through_reference_pattern() -> None:
    m = Math()
    solution = "She sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert run(m, sample("so \\boxed{72}", solution), reference_pattern=r"####\s*(.+)") == 1.0
    assert run(m, sample("so \\boxed{24}", solution), reference_pattern=r"####\s*(.+)") == 0.0
    with pytest.raises(ValueError, match="does not match reference_pattern"):
        run(m, sample("\\boxed{72}", "72"), reference_pattern=r"####\s*(.+)")
    with pytest.raises(ConfigInvalid) as e:
        m.validate_config({**m.default_config, "reference_pattern": "(("})
    assert e.value.key == "reference_pattern"
