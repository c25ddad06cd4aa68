"""``qa``, ``multiple_choice`` and ``compose``, called directly (no pool, no gRPC)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tauflow.reward.answers import MultipleChoice, QuestionAnswering, extract_choice, squad_normalise, token_f1
from tauflow.reward.api import SampleInput, Score
from tauflow.reward.builtins import ConfigInvalid, MissingReference
from tauflow.reward.compose import Compose
from tauflow.reward.config import RewardConfig
from tauflow.reward.errors import InvalidRequest
from tauflow.reward.registry import build_registry


def sample(text: str, **metadata: str) -> SampleInput:
    return SampleInput(sample_id="0", completion_text=text, metadata=metadata)


def run(fn: Any, s: SampleInput, **overrides: Any) -> Score:
    result = fn(s, fn.validate_config({**fn.default_config, **overrides}))
    assert isinstance(result, Score)
    return result


# -- qa -----------------------------------------------------------------------------------------


def test_squad_normalisation_and_f1_match_the_published_metric() -> None:
    assert squad_normalise("The  Eiffel-Tower!") == "eiffeltower"
    assert squad_normalise("an apple, a pear") == "apple pear"
    # prediction "the big red fox" vs "red fox": tokens big red fox / red fox: P = 2/3, R = 1 -> F1 = 0.8
    assert token_f1("the big red fox", "red fox") == pytest.approx(0.8)
    assert token_f1("blue", "red fox") == 0.0
    assert token_f1("fox fox", "fox") == pytest.approx(2 * 0.5 * 1 / 1.5)  # a bag: the repeat counts once
    assert token_f1("", "") == 1.0 and token_f1("the", "fox") == 0.0  # "the" normalises to nothing


def test_qa_scores_f1_or_exact_match_against_the_best_reference() -> None:
    qa = QuestionAnswering()
    got = run(qa, sample("The Red Fox.", answer="red fox"))
    assert got.score == 1.0 and got.components == {"answer_found": 1.0, "exact_match": 1.0, "f1": 1.0}
    got = run(qa, sample("the big red fox", answer=json.dumps(["a dog", "red fox"])))
    assert got.score == pytest.approx(0.8) and got.components["exact_match"] == 0.0
    assert run(qa, sample("the big red fox", answer="red fox"), metric="exact_match").score == 0.0
    assert (
        run(qa, sample("Denver Broncos", answer=json.dumps(["Broncos", "Denver Broncos"])), metric="exact_match").score
        == 1.0
    )
    # a reference that only looks like a list stays one string when told so
    assert run(qa, sample("[1, 2]", answer="[1, 2]"), references="single", metric="exact_match").score == 1.0


def test_qa_extracts_the_answer_and_refuses_bad_references() -> None:
    qa = QuestionAnswering()
    text = "Let me think. The capital is Paris.\nAnswer: Paris"
    assert run(qa, sample(text, answer="Paris"), extract_pattern=r"Answer:\s*(.+)").score == 1.0
    assert run(qa, sample(text, answer="Paris")).score < 0.5  # the whole reasoning dilutes F1
    missing = run(qa, sample("no marker", answer="Paris"), extract_pattern=r"Answer:\s*(.+)")
    assert missing.score == 0.0 and missing.components["answer_found"] == 0.0
    with pytest.raises(ValueError, match="JSON list"):
        run(qa, sample("x", answer="[not json"))
    with pytest.raises(ValueError, match="at most 64"):
        run(qa, sample("x", answer=json.dumps(["a"] * 65)))
    with pytest.raises(MissingReference):
        run(qa, sample("x"))
    with pytest.raises(ConfigInvalid) as e:
        qa.validate_config({**qa.default_config, "metric": "bleu"})
    assert e.value.key == "metric"


# -- multiple_choice ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("C", "C"),
        ("(C)", "C"),
        ("**C**", "C"),
        ("C.", "C"),
        ("The answer is (B).", "B"),
        ("the answer is B because...", "B"),
        ("Answer: D", "D"),
        ("**Answer:** A", "A"),
        ("**Answer: A**", "A"),
        ("Answer: $C$", "C"),
        ("so the final answer is \\boxed{D}", "D"),
        ("\\boxed{\\text{B}}", "B"),
        ("\\boxed{(A)}", "A"),
        ("I pick option C.", "C"),
        # the strongest form wins over a later, weaker one; its last match over an earlier draft
        ("Answer: A. Hmm, no. Answer: B\n\nC", "B"),
        ("Answer: A ... \\boxed{C}", "C"),
        ("Lots of reasoning about A and B.\nB", "B"),
        ("Lots of reasoning about A and B.", None),  # no commitment: letters inside prose are not answers
        ("Answer: Z", None),  # not an allowed letter
        ("", None),
    ],
)
def test_choice_extraction_reads_the_letter_in_the_forms_models_write(text: str, letter: str | None) -> None:
    assert extract_choice(text, "ABCD") == letter


def test_multiple_choice_scores_the_committed_letter() -> None:
    mc = MultipleChoice()
    assert run(mc, sample("Answer: B", answer="B")).score == 1.0
    assert run(mc, sample("Answer: B", answer="(C)")).score == 0.0
    unsure = run(mc, sample("It could be A or B", answer="A"))
    assert unsure.score == 0.0 and unsure.components == {"answer_found": 0.0}
    assert run(mc, sample("answer: b", answer="B")).score == 0.0
    assert run(mc, sample("answer: b", answer="B"), ignore_case=True).score == 1.0
    assert run(mc, sample("Answer: E", answer="D"), letters="ABCD").components == {"answer_found": 0.0}
    with pytest.raises(ValueError, match="neither one of the letters ABCD"):
        run(mc, sample("Answer: E", answer="E"), letters="ABCD")
    with pytest.raises(ValueError, match="neither one of the letters"):
        run(mc, sample("Answer: A", answer="Paris"))
    with pytest.raises(ConfigInvalid) as e:
        mc.validate_config({**mc.default_config, "letters": "AAB"})
    assert e.value.key == "letters"


def test_multiple_choice_with_option_texts_gpqa_style() -> None:
    mc = MultipleChoice()
    options = json.dumps(["Helium", "Neon", "Argon", "Krypton"])
    # the reference is the correct option's text; the completion may answer with the letter or the text
    assert run(mc, sample("Answer: C", answer="Argon", choices=options), choices_key="choices").score == 1.0
    assert run(mc, sample("Answer: B", answer="Argon", choices=options), choices_key="choices").score == 0.0
    assert run(mc, sample("I think it is\nargon", answer="Argon", choices=options), choices_key="choices").score == 1.0
    with pytest.raises(ValueError, match="at most 4 strings"):
        run(mc, sample("A", answer="A", choices=json.dumps(list("abcde"))), choices_key="choices", letters="ABCD")


def test_choice_extraction_is_linear_on_hostile_text() -> None:
    # Adjacent \s* under a backtracking engine would take hours here; RE2 reads it in milliseconds.
    assert extract_choice("answer" + " " * 200_000 + "!", "ABCD") is None


def test_qa_normalises_the_completion_once_however_many_references(monkeypatch: pytest.MonkeyPatch) -> None:
    # It was normalised again for each reference (twice: exact match, then F1): 64 references made a 1 MiB
    # completion cost ~3 s of the service process's CPU per sample, inline, where the 1 s timeout is not
    # enforced.
    from tauflow.reward import answers

    text = "the big red fox " * 1000
    expected = token_f1(text, "red fox")
    seen: list[int] = []
    real = answers.squad_normalise
    monkeypatch.setattr(answers, "squad_normalise", lambda text: seen.append(len(text)) or real(text))
    qa = QuestionAnswering()
    got = run(qa, sample(text, answer=json.dumps(["a dog"] * 63 + ["red fox"])))
    assert got.score == pytest.approx(expected) and got.components["exact_match"] == 0.0
    assert seen.count(len(text)) == 1 and len(seen) == 1 + 64  # the completion once, each reference once


def test_qa_bounds_the_work_of_a_sample_by_max_answer_chars() -> None:
    qa = QuestionAnswering()
    assert qa.default_config["max_answer_chars"] == 65_536
    # an answer over the bound scores 0 without being compared (its F1 would be near 0 anyway)
    huge = ("word " * 209_715)[: 1 << 20]
    started = time.monotonic()
    got = run(qa, sample(huge, answer=json.dumps(["word"] * 64)))
    assert time.monotonic() - started < 0.5  # (normalising 1 MiB 64 times over took ~3 s)
    assert got == Score(0.0, {"answer_found": 1.0, "exact_match": 0.0, "f1": 0.0})
    assert run(qa, sample("word " * 20, answer="word"), max_answer_chars=100).score == 1.0 / 10.5
    assert run(qa, sample("word " * 21, answer="word"), max_answer_chars=100).score == 0.0
    # the bound holds for what extract_pattern picks out, not the whole completion
    assert run(qa, sample(huge + "\nAnswer: word", answer="word"), extract_pattern=r"Answer: (\w+)").score == 1.0
    # a reference over it (a JSON list counts whole) is an error of the sample
    with pytest.raises(ValueError, match="the reference is 102 characters long; max_answer_chars is 100"):
        run(qa, sample("word", answer=json.dumps(["w" * 98])), max_answer_chars=100)


def counting_normalise(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts ``squad_normalise`` is given from now on (the memos forgotten first)."""
    from tauflow.reward import answers

    answers._gold_answers.clear()
    answers._gold_choice.clear()
    seen: list[int] = []
    real = answers.squad_normalise
    monkeypatch.setattr(answers, "squad_normalise", lambda text: seen.append(len(text)) or real(text))
    return seen


def test_qa_normalises_a_groups_references_once_not_once_per_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    # Group.metadata is shared by every sample: each sample normalised its 64 references again (~30 ms per
    # sample at the bound, half an hour for the 65,536 samples a request may hold).
    seen = counting_normalise(monkeypatch)
    qa = QuestionAnswering()
    config = qa.validate_config(qa.default_config)
    shared = {"answer": json.dumps([f"answer number {i} " + "w " * 400 for i in range(64)])}
    for i in range(200):
        got = qa(
            SampleInput(sample_id=str(i), completion_text=f"answer number {i % 64}", group_metadata=shared), config
        )
        assert got.components["f1"] > 0
    assert len(seen) == 64 + 200  # each reference once for the group, each completion once


def test_multiple_choice_reads_a_groups_reference_and_options_once_not_once_per_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The probe's request: a reference that names no option, 10 long options, shared by every sample through
    # Group.metadata; each sample normalised the reference and every option again (0.4 s per sample for a
    # 2 MiB request: ~27 min for 4,096 samples, inline in the service process).
    seen = counting_normalise(monkeypatch)
    mc = MultipleChoice()
    config = mc.validate_config({**mc.default_config, "choices_key": "choices"})
    shared = {"answer": "x " * 3000, "choices": json.dumps([f"option {i} " + "y " * 600 for i in range(10)])}
    samples = [SampleInput(sample_id=str(i), completion_text="", group_metadata=shared) for i in range(300)]
    for s in samples:
        with pytest.raises(ValueError, match="neither one of the letters ABCDEFGHIJ nor the text of exactly one"):
            mc(s, config)
    assert len(seen) == 10 + 1  # the options and the reference, once for the group (it was 300 x 20)
    # a good reference: scored, still reading the group's options once
    seen.clear()
    shared = {"answer": "option 3 " + "y " * 600, "choices": shared["choices"]}
    said = ["Answer: D", "Answer: A", "I pick\noption 3 " + "y " * 600, "no idea"]
    got = [
        mc(SampleInput(sample_id=str(i), completion_text=t, group_metadata=shared), config) for i, t in enumerate(said)
    ]
    assert [g.score for g in got] == [1.0, 0.0, 1.0, 0.0]
    assert len(seen) == 10 + 1 + 2  # options, reference; then the last lines of the two without a letter


def test_multiple_choice_bounds_the_reference_and_the_options_by_max_answer_chars() -> None:
    mc = MultipleChoice()
    assert mc.default_config["max_answer_chars"] == 65_536
    options = json.dumps(["Helium", "Neon", "Argon", "Krypton"])  # 38 characters
    with pytest.raises(ValueError, match="the reference is 65537 characters long; max_answer_chars is 65536"):
        run(mc, sample("Answer: A", answer="A" * 65_537))
    with pytest.raises(ValueError, match=r"metadata\['choices'\] is 38 characters long; max_answer_chars is 37"):
        run(mc, sample("Answer: C", answer="Argon", choices=options), choices_key="choices", max_answer_chars=37)
    assert run(mc, sample("Answer: C", answer="Argon", choices=options), choices_key="choices", max_answer_chars=38)
    # a last line longer than the bound is not read as an option's text
    long_line = "argon" + " " * 60 + "."  # 66 characters, normalised "argon"
    assert run(mc, sample(long_line, answer="Argon", choices=options), choices_key="choices").score == 1.0
    got = run(mc, sample(long_line, answer="Argon", choices=options), choices_key="choices", max_answer_chars=64)
    assert got == Score(0.0, {"answer_found": 0.0})
    with pytest.raises(ConfigInvalid) as e:
        mc.validate_config({**mc.default_config, "max_answer_chars": 0})
    assert e.value.key == "max_answer_chars"


# -- compose ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_fn() -> Any:
    return build_registry(RewardConfig(load_entry_points=False)).get("compose")


def score_composed(compose_fn: Any, text: str, config: dict[str, Any], **metadata: str) -> Score:
    return Compose()(sample(text, **metadata), compose_fn.resolve_config(config))


def test_compose_sums_weighted_parts_with_their_components(compose_fn: Any) -> None:
    config = {
        "parts": [
            {"fn": "math", "weight": 1.0},
            {"fn": "format", "weight": 0.5, "config": {"pattern": "<answer>.*</answer>", "mode": "search"}},
        ],
        "bias": -0.25,
    }
    got = score_composed(compose_fn, "<answer>\\boxed{4}</answer>", config, answer="4")
    assert got.score == pytest.approx(1.0 + 0.5 - 0.25)
    assert got.components == {"math": 1.0, "math.answer_found": 1.0, "format": 1.0}
    got = score_composed(compose_fn, "\\boxed{5}", config, answer="4")
    assert got.score == pytest.approx(-0.25) and got.components["format"] == 0.0


def test_compose_gate_gives_the_fail_score_and_skips_the_parts(compose_fn: Any) -> None:
    config = {
        "parts": [{"fn": "math"}],
        "gate": {"fn": "format", "config": {"pattern": r"<answer>.*</answer>"}, "fail_score": -1.0},
    }
    assert score_composed(compose_fn, "<answer>\\boxed{4}</answer>", config, answer="4").score == 1.0
    gated = score_composed(compose_fn, "4", config, answer="4")
    assert gated.score == -1.0 and gated.components == {"gate": 0.0}  # math was never run


def test_a_failing_part_costs_only_that_part(compose_fn: Any) -> None:
    config = {"parts": [{"fn": "math"}, {"fn": "format", "config": {"pattern": "x", "mode": "search"}, "weight": 2}]}
    got = score_composed(compose_fn, "x", config)  # no reference: math raises MissingReference
    assert got.score == 2.0 and got.components["error.math"] == 1.0 and got.components["math"] == 0.0


def test_compose_config_is_checked_part_by_part_and_refs_come_from_the_registry(compose_fn: Any) -> None:
    def refused(config: dict[str, Any]) -> str:
        with pytest.raises(InvalidRequest) as e:
            compose_fn.resolve_config(config)
        return str(e.value)

    assert refused({"parts": [{"fn": "nope"}]}).startswith("config.parts.0.fn: 'nope' is not a registered")
    assert refused({"parts": [{"fn": "compose"}]}).startswith("config.parts.0.fn:")
    assert refused({"parts": [{"fn": "format", "config": {"mode": "all"}}]}).startswith("config.parts.0.config.mode:")
    assert refused({"parts": [{"fn": "math"}, {"fn": "math"}]}).startswith("config: two parts share a label")
    assert refused({"parts": [{"fn": "math"}] * 9}).startswith("config.parts:")
    assert refused({"gate": {"fn": "math", "min_score": float("nan")}}).startswith("config.gate.min_score:")
    # a request's own reference is replaced: it cannot make a worker import a module of its choosing
    resolved = compose_fn.resolve_config({"parts": [{"fn": "math", "ref": "os:system", "fallback_score": 9}]})
    assert resolved["parts"][0]["ref"] == "tauflow.reward.builtins:Math"
    assert resolved["parts"][0]["fallback_score"] == 0.0


def test_compose_parts_take_the_services_settings_of_their_functions() -> None:
    from tauflow.reward.config import FunctionSettings

    functions = {
        "compose": FunctionSettings(config={"parts": [{"fn": "math"}]}),  # listed first: applied last
        "math": FunctionSettings(config={"reference_pattern": r"####\s*(.+)"}),
    }
    reg = build_registry(RewardConfig(load_entry_points=False, functions=functions))
    part = reg.get("compose").default_config["parts"][0]
    assert part["config"]["reference_pattern"] == r"####\s*(.+)"
    got = Compose()(sample("\\boxed{72}", answer="so 72\n#### 72"), reg.get("compose").resolve_config({}))
    assert got.score == 1.0


def test_a_blank_completion_is_no_choice() -> None:
    mc = MultipleChoice()
    options = json.dumps(["Helium", "Neon"])
    got = run(mc, sample("   \n ", answer="A", choices=options), choices_key="choices", letters="AB")
    assert got.score == 0.0 and got.components == {"answer_found": 0.0}
