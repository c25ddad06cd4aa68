"""The registry (built-ins, entry points, settings) and the worker's result checks, without gRPC."""

from __future__ import annotations

import math
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from tauflow.reward import worker
from tauflow.reward.api import ENTRY_POINT_GROUP, GroupInput, SampleInput, Score, reward
from tauflow.reward.config import Executor, FunctionSettings, RewardConfig
from tauflow.reward.errors import InvalidRequest, NotFound
from tauflow.reward.registry import Registry, RegistryError, build_registry

PLUGIN = textwrap.dedent(
    '''
    from tauflow.reward.api import reward

    @reward(description="length of the completion", default_config={"scale": 1.0}, timeout_s=2.5,
            fallback_score=-1.0)
    def length(sample, config):
        return config["scale"] * len(sample.completion_text)

    class Judge:
        """Ranks a group."""
        group_level = True
        default_config = {"best": 1.0}
        def __call__(self, group, config):
            return [config["best"] if i == 0 else 0.0 for i, _ in enumerate(group.samples)]
    '''
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[metadata.EntryPoint]:
    (tmp_path / "reg_plugin_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield [
        metadata.EntryPoint("length", "reg_plugin_mod:length", ENTRY_POINT_GROUP),
        metadata.EntryPoint("judge", "reg_plugin_mod:Judge", ENTRY_POINT_GROUP),
        metadata.EntryPoint("broken", "no_such_module_anywhere:fn", ENTRY_POINT_GROUP),
        metadata.EntryPoint("math", "reg_plugin_mod:length", ENTRY_POINT_GROUP),  # a built-in's name: skipped
    ]
    sys.modules.pop("reg_plugin_mod", None)


def config(**kw: object) -> RewardConfig:
    return RewardConfig.model_validate(kw)


def test_builtins_are_registered_with_their_executors() -> None:
    reg = build_registry(config(load_entry_points=False))
    inline = {"exact_match", "format", "qa", "multiple_choice"}  # cheap and trusted: a call on a thread
    pooled = {"math", "ifeval", "code", "compose", "remote_rm", "genrm"}  # killable: a timeout is enforced
    assert [f.name for f in reg.functions()] == sorted(inline | pooled)
    assert all(reg.get(name).executor is Executor.INLINE for name in inline)
    assert all(reg.get(name).executor is Executor.PROCESS for name in pooled)
    assert reg.get("remote_rm").service_only_keys == {"url", "api_key_env"}
    assert reg.get("genrm").service_only_keys == {"address"}
    assert reg.get("").name == "exact_match"  # the default


def test_entry_points_register_functions_and_classes(plugin: list[metadata.EntryPoint]) -> None:
    reg = build_registry(config(), entry_points=plugin)
    length = reg.get("length")
    assert (length.description, length.timeout_s, length.fallback_score) == ("length of the completion", 2.5, -1.0)
    assert length.executor is Executor.PROCESS and length.ref == "reg_plugin_mod:length"
    judge = reg.get("judge")
    assert judge.group_level and judge.description == "Ranks a group." and judge.default_config == {"best": 1.0}
    assert reg.get("math").source == "built-in"  # the entry point did not replace the built-in
    with pytest.raises(NotFound, match="broken.*failed to load: ModuleNotFoundError"):
        reg.get("broken")


def test_resolve_config_merges_and_names_the_bad_key() -> None:
    reg = build_registry(config(load_entry_points=False))
    fn = reg.get("exact_match")
    assert fn.resolve_config({"ignore_case": True})["ignore_case"] is True
    assert fn.resolve_config(None) == fn.default_config
    with pytest.raises(InvalidRequest, match=r"^config\.ignorecase: unknown key.*'exact_match'.*ignore_case"):
        fn.resolve_config({"ignorecase": True})
    with pytest.raises(InvalidRequest, match=r"^config\.pattern: .*regular expression"):
        reg.get("format").resolve_config({"pattern": "(("})


def test_settings_override_defaults_and_disable(plugin: list[metadata.EntryPoint]) -> None:
    reg = build_registry(
        config(
            functions={
                "exact_match": {"timeout_s": 0.5, "fallback_score": -2, "config": {"ignore_case": True}},
                "length": {"executor": "inline"},
                "format": {"enabled": False},
            }
        ),
        entry_points=plugin,
    )
    em = reg.get("exact_match")
    assert (em.timeout_s, em.fallback_score, em.default_config["ignore_case"]) == (0.5, -2.0, True)
    assert reg.get("length").executor is Executor.INLINE
    with pytest.raises(NotFound):
        reg.get("format")


OPERATOR_LIMITS = {
    "code": {"memory_mb": 64, "cpu_time_s": 1, "max_output_bytes": 1024, "wall_time_s": 3.0, "max_cases": 4},
    "remote_rm": {"url": "http://rm.invalid/score", "retries": 1, "max_concurrency": 2, "budget_s": 10.0,
                  "max_tokens": 64, "request_timeout_s": 5.0, "max_batch": 8},
    "genrm": {"address": "judge.invalid:1", "max_new_tokens": 32, "request_timeout_s": 5.0,
              "max_concurrency": 2},
    "qa": {"max_answer_chars": 100},
    "exact_match": {"max_answer_chars": 100},
    "multiple_choice": {"max_answer_chars": 100},
}  # fmt: skip


@pytest.mark.parametrize(
    ("fn_name", "key", "higher"),
    [
        ("code", "memory_mb", 16384),
        ("code", "cpu_time_s", 60),
        ("code", "max_output_bytes", 64 << 20),
        ("code", "wall_time_s", 3.5),
        ("code", "max_cases", 5),
        ("remote_rm", "retries", 10),
        ("remote_rm", "max_concurrency", 64),
        ("remote_rm", "budget_s", 3600),
        ("remote_rm", "max_tokens", 65536),
        ("remote_rm", "request_timeout_s", 600),
        ("remote_rm", "max_batch", 4096),
        ("genrm", "max_new_tokens", 32768),
        ("genrm", "max_concurrency", 3),
        ("qa", "max_answer_chars", 101),
        ("exact_match", "max_answer_chars", 101),
        ("multiple_choice", "max_answer_chars", 101),
    ],
)
def test_a_request_may_lower_the_operators_limits_but_never_raise_them(fn_name: str, key: str, higher: float) -> None:
    # The operator's functions.<name>.config limits are ceilings: a request over one is INVALID_ARGUMENT
    # naming the key and the ceiling (it was merged over them: 16 GiB for a sandbox set to 64 MiB).
    functions = {name: {"config": limits} for name, limits in OPERATOR_LIMITS.items()}
    fn = build_registry(config(load_entry_points=False, functions=functions)).get(fn_name)
    ceiling = OPERATOR_LIMITS[fn_name][key]
    with pytest.raises(InvalidRequest) as e:
        fn.resolve_config({key: higher})
    assert e.value.field == f"config.{key}"
    assert f"over this service's ceiling of {ceiling!r} (functions.{fn_name}.config.{key})" in str(e.value)
    assert fn.resolve_config({key: ceiling})[key] == ceiling
    lower = ceiling / 2 if isinstance(ceiling, float) else max(1, ceiling // 2)
    assert fn.resolve_config({key: lower})[key] == lower


def test_ceilings_are_the_functions_defaults_where_the_operator_set_none_and_hold_in_compose() -> None:
    reg = build_registry(config(load_entry_points=False, functions={"code": {"config": {"memory_mb": 64}}}))
    with pytest.raises(InvalidRequest, match=r"^config\.cpu_time_s: 60 is over this service's ceiling of 5 "):
        reg.get("code").resolve_config({"cpu_time_s": 60})
    with pytest.raises(InvalidRequest, match=r"^config\.parts\.0\.config\.memory_mb: 16384 is over .* of 64 "):
        reg.get("compose").resolve_config({"parts": [{"fn": "code", "config": {"memory_mb": 16384}}]})
    # the operator's own settings may go past the built-in defaults: the ceilings are theirs to set
    reg = build_registry(config(load_entry_points=False, functions={"code": {"config": {"memory_mb": 4096}}}))
    assert reg.get("code").resolve_config({"memory_mb": 4096})["memory_mb"] == 4096


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"functions": {"nope": {}}}, "functions.nope: no reward function"),
        ({"functions": {"format": {"config": {"pattern": "(("}}}}, "functions.format.config.pattern"),
        ({"default_reward_fn": "nope"}, "default_reward_fn 'nope' is not a registered"),
    ],
)
def test_bad_settings_stop_the_start(settings: dict[str, object], message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        build_registry(config(load_entry_points=False, **settings))


def test_no_default_makes_reward_fn_required() -> None:
    reg = build_registry(config(load_entry_points=False, default_reward_fn=""))
    with pytest.raises(InvalidRequest, match="^reward_fn: empty"):
        reg.get("")


def test_registering_twice_and_non_callables_are_refused() -> None:
    reg = Registry()
    reg.register("f", lambda s, c: 1.0, ref="x:f", executor=Executor.INLINE)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("f", lambda s, c: 1.0, ref="x:g", executor=Executor.INLINE)
    with pytest.raises(RegistryError, match="not a callable"):
        reg.register("g", 42, ref="x:h")
    with pytest.raises(RegistryError, match="JSON-like"):
        reg.register("h", reward(default_config={"obj": object()})(lambda s, c: 1.0), ref="x:i")


# -- what a function returns -----------------------------------------------------------------------

S = SampleInput(sample_id="0", completion_text="abc")


@pytest.mark.parametrize(
    ("result", "score", "parts"),
    [
        (1, 1.0, {}),
        (True, 1.0, {}),
        (0.25, 0.25, {}),
        (Score(0.5, {"fmt": 1}), 0.5, {"fmt": 1.0}),
        ({"score": -1, "components": {"a": 2}}, -1.0, {"a": 2.0}),
    ],
)
def test_accepted_results(result: object, score: float, parts: dict[str, float]) -> None:
    worker.register_local("t:ok", lambda s, c: result)
    ok, got, got_parts, message, _, duration = worker.call_sample("t:ok", S, {})
    assert (ok, got, got_parts, message) == (True, score, parts, "")
    assert duration >= 0


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (None, "returned NoneType"),
        ("1.0", "returned str"),
        (math.nan, "non-finite"),
        ({"value": 1}, "without a 'score' key"),
        (Score(1.0, {"a": "x"}), "component 'a'"),
    ],
)
def test_bad_results_are_errors_not_crashes(result: object, message: str) -> None:
    worker.register_local("t:bad", lambda s, c: result)
    ok, score, _, got, _, _ = worker.call_sample("t:bad", S, {})
    assert not ok and score == 0.0 and message in got


def test_a_raise_is_an_error_with_its_message_and_traceback() -> None:
    def boom(sample: SampleInput, config: dict) -> float:
        raise KeyError("expected_key")

    worker.register_local("t:boom", boom)
    ok, _, _, message, detail, _ = worker.call_sample("t:boom", S, {})
    assert not ok and message == "KeyError: 'expected_key'" and "in boom" in detail


def test_group_level_results_must_match_the_group() -> None:
    group = GroupInput("g", "p", (S, S, S))
    worker.register_local("t:group", lambda g, c: [1.0, 0.0, Score(0.5)])
    assert [o[1] for o in worker.call_group("t:group", group, {})] == [1.0, 0.0, 0.5]
    worker.register_local("t:short", lambda g, c: [1.0])
    outcomes = worker.call_group("t:short", group, {})
    assert len(outcomes) == 3 and all(not o[0] and "1 results for a group of 3" in o[3] for o in outcomes)


def test_sample_input_reads_sample_then_group_metadata() -> None:
    s = SampleInput("0", "x", metadata={"answer": "1"}, group_metadata={"answer": "2", "other": "3"})
    assert (s.get("answer"), s.get("other"), s.get("none", "d")) == ("1", "3", "d")


def test_settings_model_is_strict() -> None:
    with pytest.raises(ValueError):
        FunctionSettings.model_validate({"timeout": 1})


def test_an_exit_is_an_error_not_the_end_of_the_process() -> None:
    def leave(sample: SampleInput, config: dict) -> float:
        sys.exit(2)

    worker.register_local("t:exit", leave)
    ok, _, _, message, _, _ = worker.call_sample("t:exit", S, {})
    assert not ok and message == "SystemExit: 2"
