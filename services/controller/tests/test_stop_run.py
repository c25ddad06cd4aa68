"""ControllerService's StopRun and GetRun over a run still launching (launcher external, towards roles that never
serve): the states a client sees, why the run stopped, the bounds of the grace period, and a launch that stops
waiting once the run is stopped."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.controller.adapters.servicer import ControllerServicer, redacted
from tauflow.controller.app import build_run
from tauflow.controller.config import RunConfig
from tauflow.controller.external import ExternalLauncher


class Aborted(Exception):
    pass


class Context:
    """The part of grpc.aio.ServicerContext the servicer uses: abort raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def test_stop_run_says_stopping_records_why_and_ends_a_launch_that_still_waits(tmp_path: Path) -> None:
    roles = ("queue", "reward", "weights", "trainer", "rollout")
    config = RunConfig(model="m", dataset="d", steps=2, out_dir=str(tmp_path), launcher="external",
                       external={role: "127.0.0.1:9" for role in roles}, start_timeout_s=3600)  # fmt: skip
    run = build_run(config, serve_metrics=False)
    probes: list[float] = []

    def never_serving(address: str, timeout_s: float) -> tuple[bool, str]:
        probes.append(time.monotonic())
        return False, "UNAVAILABLE"

    assert isinstance(run.launcher, ExternalLauncher)
    run.launcher.health_check = never_serving

    async def scenario() -> None:
        task: asyncio.Task[Any] = asyncio.create_task(run.execute())
        servicer = ControllerServicer(run, task)
        while not probes:
            await asyncio.sleep(0.01)
        got = (await servicer.GetRun(pb.GetRunRequest(), Context())).run
        assert got.state == pb.RUN_STATE_STARTING  # (SetMaxStaleness says "still starting" too)
        assert got.run_id.startswith(config.name) and got.started_at.seconds > 0 and not got.HasField("ended_at")
        assert got.config["steps"] == 2 and got.config["launcher"] == "external"
        for grace in (Duration(seconds=3601), Duration(seconds=-1)):  # refused: nothing stops
            with pytest.raises(Aborted) as refused:
                await servicer.StopRun(pb.StopRunRequest(grace_period=grace), Context())
            assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "grace_period" in refused.value.args[1]
        for reason in ("\x1b[2J forged", "two\nlines", "nul\x00", "c1\x9b"):  # a terminal's escapes, a forged line
            with pytest.raises(Aborted) as refused:
                await servicer.StopRun(pb.StopRunRequest(reason=reason), Context())
            assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.args[1] == "reason holds a control character"
        assert not task.done() and not servicer.stop_requested
        answer = await servicer.StopRun(pb.StopRunRequest(reason="maintenance\twindow", immediate=True), Context())
        assert answer.state == pb.RUN_STATE_STOPPING and run.stop_grace_s == 0.0
        with pytest.raises(asyncio.CancelledError):
            await task
        final = (await servicer.GetRun(pb.GetRunRequest(), Context())).run
        assert final.state == pb.RUN_STATE_STOPPED and final.HasField("ended_at")
        assert final.message == "stopped by the user: maintenance\twindow"
        again = await servicer.StopRun(pb.StopRunRequest(reason="twice"), Context())
        assert again.state == pb.RUN_STATE_STOPPED and run.stop_reason == "maintenance\twindow"

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()  # (not asyncio.run: its executor's shutdown would wait for a launch that never ends)
    # the launch thread, still waiting for the queue when the run was stopped, gives up instead of connecting
    time.sleep(1.5)
    assert probes[-1] < time.monotonic() - 1.0
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncio_") and t.is_alive()]


def test_get_run_shows_the_config_without_its_secrets() -> None:
    config = {"name": "r", "external": {"queue": "q:1"}, "env": {"HF_TOKEN": "hf_abc", "queue_auth_token": "t"},
              "roles": [{"password": "p", "port": 1, "api_key": "k", "max_new_tokens": 8, "tokens_file": "f",
                         "AWS_SECRET_ACCESS_KEY": "a", "webhookToken": "w", "stop_token_ids": [2]}]}  # fmt: skip
    hidden = "<redacted>"
    assert redacted(config) == {
        "name": "r",
        "external": {"queue": "q:1"},
        "env": {"HF_TOKEN": hidden, "queue_auth_token": hidden},
        "roles": [  # (settings that count tokens, or name a file, are not secrets)
            {
                "password": hidden,
                "port": 1,
                "api_key": hidden,
                "max_new_tokens": 8,
                "tokens_file": "f",
                "AWS_SECRET_ACCESS_KEY": hidden,
                "webhookToken": hidden,
                "stop_token_ids": [2],
            }
        ],
    }


@pytest.mark.parametrize(
    ("status", "acc", "target", "code"),
    [
        ("interrupted", 0.334, 0.8, 130),  # stopped below the target: not "target reached", not 0
        ("interrupted", 0.95, 0.8, 130),  # stopped, even past it: the run did not reach its end
        ("interrupted", None, 0.8, 130),  # stopped before the first evaluation (no accuracy to format)
        ("below_target", None, 0.8, 3),
        ("below_target", 0.5, 0.8, 3),
        ("completed", 0.85, 0.8, 0),
        ("completed", None, None, 0),
    ],
)
def test_tauflow_runs_exit_code_says_how_the_run_ended(
    status: str, acc: float | None, target: float | None, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    from tauflow.controller import cli

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200))
    assert cli._exit_code(status, "stopped by the user: maintenance", acc, target) == code
    printed = out.getvalue()
    assert ("target reached" in printed) == (status == "completed" and target is not None)
    assert ("stopped by the user: maintenance" in printed) == (status == "interrupted")
