"""Secrets stay out of what others can read: GetRun's config, the summary and the logs redact secrets held in
values (flags, URLs, commands), not only under keys that name one; and a service's settings reach it in a file
only its user can read, never on its command line (``/proc/<pid>/cmdline`` is every local user's)."""

from __future__ import annotations

import asyncio
import json
import logging
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.controller import raylauncher
from tauflow.controller.adapters.servicer import ControllerServicer
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.launcher import LaunchFailed, nested, service_env, write_settings
from tauflow.controller.secrets import redact_text, redacted
from tauflow.core.config import load_config

SECRETS = ("hf_SECRETabc123", "sk-SGLANG-SECRET", "PASSWORD", "SECRET-IN-QUERY", "RAYPASS", "ghp_TOKENINURL",
           "SIGVALUE", "ENVSECRET", "EQSECRET", "LISTSECRET")  # fmt: skip


def _config(tmp_path: Path) -> RunConfig:
    return RunConfig(
        model="m",
        dataset="d",
        steps=1,
        out_dir=str(tmp_path / "run"),
        prepare=["HF_TOKEN=ENVSECRET huggingface-cli download org/model --token hf_SECRETabc123 --local-dir m"],
        services={
            "rollout": {
                "engine": "sglang",
                "sampling": {"max_new_tokens": 64},
                "engine_options": {
                    "server_args": [
                        "--api-key",
                        "sk-SGLANG-SECRET",
                        "--mem-fraction",
                        "0.8",
                        "--hf-token=EQSECRET",
                        "--max-new-tokens",
                        "128",
                    ],
                    "base_url": "http://admin:PASSWORD@sglang:30000/v1",
                    "mirror": "https://ghp_TOKENINURL@github.com/org/repo.git",
                    "download": "https://bucket.example/m.bin?X-Amz-Signature=SIGVALUE&part=2",
                },
            },
            "reward": {
                "functions": {"remote_rm": {"config": {"url": "https://judge.example/v1/score?key=SECRET-IN-QUERY"}}},
                "command": ["judge", "--token", "LISTSECRET"],
            },
        },
        ray={"address": "ray://user:RAYPASS@head:10001"},
    )


class Context:
    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(code, details)


def test_get_run_redacts_secrets_held_in_values(tmp_path: Path) -> None:
    run = build_run(_config(tmp_path), serve_metrics=False)
    reply = asyncio.run(ControllerServicer(run).GetRun(pb.GetRunRequest(), Context())).run
    from google.protobuf.json_format import MessageToDict

    shown = MessageToDict(reply.config)
    text = json.dumps(shown)
    assert [s for s in SECRETS if s in text] == []
    # what is not a secret stays readable
    options = shown["services"]["rollout"]["engine_options"]
    assert options["server_args"] == ["--api-key", "<redacted>", "--mem-fraction", "0.8", "--hf-token=<redacted>",
                                      "--max-new-tokens", "128"]  # fmt: skip
    assert options["base_url"] == "http://<redacted>@sglang:30000/v1"
    assert options["download"] == "https://bucket.example/m.bin?X-Amz-Signature=<redacted>&part=2"
    assert shown["services"]["rollout"]["sampling"] == {"max_new_tokens": 64.0}
    assert shown["ray"]["address"] == "ray://<redacted>@head:10001"
    assert shown["prepare"] == [
        "HF_TOKEN=<redacted> huggingface-cli download org/model --token <redacted> --local-dir m"
    ]
    assert shown["services"]["reward"]["command"] == ["judge", "--token", "<redacted>"]


def test_plain_values_are_left_alone() -> None:
    plain = {"model": "/models/Qwen-0.5B", "url": "http://judge:8000/v1/score?model=m&n=2", "tokens_file": "t.txt",
             "args": ["--port", "30000", "--tokenizer", "tok"], "max_new_tokens": 8, "prompt": "a=b and c"}  # fmt: skip
    assert redacted(plain) == plain


def test_a_prepare_command_with_a_token_is_logged_and_reported_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = RunConfig(model="m", dataset="d", steps=1, out_dir=str(tmp_path / "run"),
                       prepare=["python", "-c", "raise SystemExit(3)", "--token", "hf_SECRETabc123"])  # fmt: skip
    run = build_run(config, serve_metrics=False)
    with caplog.at_level(logging.INFO, logger="tauflow.controller.run"), pytest.raises(LaunchFailed) as failed:
        run._prepare()
    assert "exited with code 3" in str(failed.value) and "hf_SECRETabc123" not in str(failed.value)
    logged = [r.command for r in caplog.records if r.getMessage() == "prepare"]  # type: ignore[attr-defined]
    assert logged == [f"{sys.executable} -c raise SystemExit(3) --token <redacted>"]


def test_a_ray_address_with_credentials_is_not_in_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchFailed) as failed:
        raylauncher._probe("ray://user:RAYPASS@127.0.0.1:1")
    assert "RAYPASS" not in str(failed.value) and "ray://<redacted>@127.0.0.1:1" in str(failed.value)
    assert redact_text("at 'ray://user:RAYPASS@head:10001': refused") == "at 'ray://<redacted>@head:10001': refused"


class Inner(BaseModel):
    b: int = 0
    c: str = ""


class Model(BaseModel):
    a: Inner = Inner()
    d: dict[str, int] = {}
    path: str = ""
    f: int = 0
    flag: bool = False


def test_a_settings_file_and_the_environment_give_the_service_what_set_overrides_gave(tmp_path: Path) -> None:
    settings = {"a.b": 1, "a.c": "1e3", "d": {"x": 1}, "d.y": 2, "path": tmp_path / "p", "flag": True}
    write_settings(tmp_path / "s" / "svc.json", settings)
    assert stat.S_IMODE((tmp_path / "s" / "svc.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    assert nested(settings) == {"a": {"b": 1, "c": "1e3"}, "d": {"x": 1, "y": 2}, "path": str(tmp_path / "p"),
                                "flag": True}  # fmt: skip
    # The run's settings win over the controller's environment, as they did on the command line; the
    # environment still sets what the run does not.
    environ = {"TAUFLOW_SVC_A__B": "5", "TAUFLOW_SVC_A": "{}", "TAUFLOW_SVC_F": "7", "TAUFLOW_SVC_D__Z": "3",
               "PATH": "/bin"}  # fmt: skip
    file_settings, env = service_env("svc", settings, environ)
    assert env == {"TAUFLOW_SVC_F": "7", "TAUFLOW_SVC_D__Z": "3", "PATH": "/bin"}
    write_settings(tmp_path / "s" / "svc.json", file_settings)
    loaded = load_config(Model, path=tmp_path / "s" / "svc.json", env_prefix="TAUFLOW_SVC_", environ=env)
    assert loaded == Model(a=Inner(b=1, c="1e3"), d={"x": 1, "y": 2, "z": 3}, path=str(tmp_path / "p"), f=7, flag=True)


def test_an_environment_section_beneath_the_runs_settings_is_merged_not_dropped(tmp_path: Path) -> None:
    # TAUFLOW_SVC_A='{c: x, e: 9}' beside the run's a.b: on the command line the run's key went over the section;
    # dropping the variable lost a.e (a trainer's backend kind, silently the default)
    settings = {"a.b": 1}
    file_settings, env = service_env("svc", settings, {"TAUFLOW_SVC_A": "{c: x, b: 5}", "TAUFLOW_SVC_F": "7"})
    assert file_settings == {"a": {"c": "x", "b": 1}} and env == {"TAUFLOW_SVC_F": "7"}
    write_settings(tmp_path / "svc.json", file_settings)
    loaded = load_config(Model, path=tmp_path / "svc.json", env_prefix="TAUFLOW_SVC_", environ=env)
    assert loaded.a == Inner(b=1, c="x") and loaded.f == 7
    assert "\\u00e9" in (
        write_settings(tmp_path / "t.json", {"path": "caf\u00e9"}) or (tmp_path / "t.json").read_text()
    )


def test_the_ray_actor_writes_the_settings_to_a_file_and_not_onto_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    spawned: dict[str, Any] = {}

    def spawn(command: list[str], env: dict[str, str], log_file: str, header: str, cwd: str | None = None) -> Any:
        spawned.update(command=command, env=env)
        return SimpleNamespace(pid=4242)

    monkeypatch.setattr(raylauncher, "spawn_service", spawn)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_actor_id=lambda: "a",
                                                                            get_node_id=lambda: "n"))  # fmt: skip
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    settings_file = tmp_path / "settings" / "rollout.json"
    raylauncher.ServiceHost().spawn(
        "rollout", {"engine_options.api_key": "sk-SGLANG-SECRET"}, {"TAUFLOW_ROLLOUT_ENGINE_OPTIONS__API_KEY": "old"},
        str(tmp_path), str(tmp_path / "rollout.log"), str(tmp_path / "rollout.ready.json"), str(settings_file), 0,
        None, 1.0,
    )  # fmt: skip
    assert not any("sk-SGLANG-SECRET" in arg for arg in spawned["command"])
    assert spawned["command"][-2:] == ["--config", str(settings_file)]
    assert "TAUFLOW_ROLLOUT_ENGINE_OPTIONS__API_KEY" not in spawned["env"]  # the run's key wins
    assert json.loads(settings_file.read_text()) == {
        "server": {"host": "10.0.0.7"},
        "metrics": {"host": "10.0.0.7"},
        "engine_options": {"api_key": "sk-SGLANG-SECRET"},
    }
    assert stat.S_IMODE(settings_file.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "text",
    [
        "curl -H 'Authorization: Bearer SECRET1' https://rm.example/score",
        "Authorization: Basic SECRET1",
        "X-Api-Key: SECRET1",
        "x-api-key: SECRET1",
        "--header Bearer SECRET1",
    ],
)
def test_a_credential_in_a_header_or_after_its_scheme_is_redacted(text: str) -> None:
    out = redact_text(text)
    assert "SECRET1" not in out, out
    assert redacted({"X-Api-Key": "SECRET1"}) == {"X-Api-Key": "<redacted>"}
    assert redacted({"headers": ["Authorization: Bearer SECRET1"]}) == {"headers": ["Authorization: Bearer <redacted>"]}


def test_words_about_tokens_and_keys_are_not_secrets() -> None:
    for text in ("the run token file is missing", "basic arithmetic, 40 tokens", "key: answer"):
        assert redact_text(text) == text
