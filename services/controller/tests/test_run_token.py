"""The run token (tauflow.core.auth) as the controller keeps it: one 0600 file per out_dir, every role's
auth.token_file; ControllerService's control methods need it, and `tauflow scale`/`set` find it through the
run directory."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tauflow.api.controller.v1 import controller_pb2 as pb
from tauflow.api.controller.v1 import controller_pb2_grpc
from tauflow.controller.adapters.controller_client import ControlError, ControllerClient, find_run
from tauflow.controller.app import build_run, execute_with_control
from tauflow.controller.cli import main as cli_main
from tauflow.controller.config import ROLES, RunConfig
from tauflow.controller.external import ExternalLauncher
from tauflow.core.channel import create_channel
from tauflow.core.runtoken import TokenFileError, use_run_token, write_token_file

EXTERNAL = {role: "127.0.0.1:9" for role in ("queue", "reward", "weights", "trainer", "rollout")}


@pytest.fixture(autouse=True)
def no_process_token() -> Any:
    yield
    use_run_token("")  # (the Run made this test's token the process's)


def _config(out: Path, **more: Any) -> RunConfig:
    return RunConfig(model="m", dataset="d", steps=2, out_dir=str(out), launcher="external", external=EXTERNAL,
                     start_timeout_s=3600, **more)  # fmt: skip


def test_one_token_per_out_dir_written_for_its_user_and_given_to_every_role(tmp_path: Path) -> None:
    run = build_run(_config(tmp_path), serve_metrics=False)
    token_file = tmp_path / "run.token"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert token_file.read_text().strip() == run.run_token and len(run.run_token) >= 32
    for role in ROLES:
        assert run._settings(role, {})["auth.token_file"] == str(token_file), role
    again = build_run(_config(tmp_path), serve_metrics=False)  # services deployed with it keep working
    assert again.run_token == run.run_token
    other = build_run(_config(tmp_path / "other"), serve_metrics=False)
    assert other.run_token != run.run_token


def test_a_configured_token_file_is_the_runs_and_none_is_written(tmp_path: Path) -> None:
    secret = tmp_path / "secret" / "token"
    write_token_file(secret, "mounted-secret-0123456789")
    run = build_run(_config(tmp_path / "run", token_file=str(secret)), serve_metrics=False)
    assert run.run_token == "mounted-secret-0123456789"
    assert run._settings("queue", {})["auth.token_file"] == str(secret)
    assert not (tmp_path / "run" / "run.token").exists()


def test_control_methods_need_the_token_and_the_run_directory_gives_it(tmp_path: Path) -> None:
    run = build_run(_config(tmp_path))
    assert isinstance(run.launcher, ExternalLauncher)
    run.launcher.health_check = lambda address, timeout_s: (False, "UNAVAILABLE")  # the roles never serve

    async def scenario() -> None:
        task = asyncio.create_task(execute_with_control(run))
        deadline = time.monotonic() + 30
        while not (tmp_path / "controller.ready.json").exists():
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
        address, token_file = find_run(str(tmp_path))
        assert token_file == str(tmp_path / "run.token")
        use_run_token("")  # a stranger's process: no token of its own
        async with create_channel(address, []) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            for call, request in [
                (stub.StopRun, pb.StopRunRequest(immediate=True)),
                (stub.SetMaxStaleness, pb.SetMaxStalenessRequest(max_staleness=0)),
                (stub.ScaleRollout, pb.ScaleRolloutRequest(replicas=2)),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await stub.GetRun(pb.GetRunRequest())).run.state == pb.RUN_STATE_STARTING  # reading is open
        assert not task.done() and run.stop_reason == ""
        with pytest.raises(ControlError, match="UNAUTHENTICATED"):
            stranger = ControllerClient(address)
            try:
                await stranger.set_max_staleness(0)
            finally:
                await stranger.close()
        client = ControllerClient(address, token_file)  # what `tauflow set --run <dir>` makes
        try:
            with pytest.raises(ControlError) as refused_while_starting:
                await client.set_max_staleness(0)
            assert "UNAUTHENTICATED" not in str(refused_while_starting.value)
        finally:
            await client.close()
        stopper = ControllerClient(address, token_file)  # what `tauflow stop <dir> --immediate` makes
        try:
            assert await stopper.stop_run("done", immediate=True) in ("stopping", "stopped")
        finally:
            await stopper.close()
        await asyncio.wait_for(task, 60)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()  # (not asyncio.run: its executor's shutdown would wait for a launch that never ends)
    assert run.stop_reason == "done"


def test_a_bad_token_file_is_a_control_error_that_does_not_quote_it(tmp_path: Path) -> None:
    bad = tmp_path / "token"
    bad.write_text("tiny")

    async def set_tau() -> None:
        client = ControllerClient("127.0.0.1:9", str(bad))  # (`tauflow status` reads no token: it needs none)
        try:
            await client.set_max_staleness(0)
        finally:
            await client.close()

    with pytest.raises(ControlError, match="at least 16") as refused:
        asyncio.run(set_tau())
    assert "tiny" not in str(refused.value)


def test_the_token_path_is_absolute_and_a_damaged_token_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run = build_run(_config(Path("runs/relative")), serve_metrics=False)
    assert run.token_file == tmp_path / "runs" / "relative" / "run.token"
    assert run._settings("trainer", {})["auth.token_file"] == str(run.token_file)
    run.token_file.write_text("damaged")  # services deployed with the old token would be locked out
    with pytest.raises(TokenFileError, match="at least 16"):
        build_run(_config(Path("runs/relative")), serve_metrics=False)
    assert run.token_file.read_text() == "damaged"


def test_tauflow_run_with_a_bad_token_file_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from tauflow.controller import cli

    printed = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=printed, width=400))
    (tmp_path / "token").write_text("short")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: m\ndataset: d\nsteps: 1\nout_dir: {tmp_path / 'out'}\ntoken_file: {tmp_path / 'token'}\n"
    )
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert cli_main(["run", str(config)]) == 2
    # A run that could not be built leaves SIGTERM as it was (it set its own handler first: a worker later forked
    # by this process caught SIGTERM, and a reward test saw its case directory cleaned up).
    assert signal.getsignal(signal.SIGTERM) == before
    out = printed.getvalue()
    assert "auth.token_file" in out and "at least 16" in out and "Traceback" not in out


def test_a_ray_node_gets_the_token_unless_it_holds_it(tmp_path: Path) -> None:
    from tauflow.controller.raylauncher import _place_token

    path = tmp_path / "node" / "run.token"
    _place_token(str(path), "token-0123456789abcdef")  # a node without it
    assert path.read_text().strip() == "token-0123456789abcdef"
    path.chmod(0o400)
    path.parent.chmod(0o500)  # a read-only mount that holds it: left alone
    try:
        _place_token(str(path), "token-0123456789abcdef")
    finally:
        path.parent.chmod(0o700)
    _place_token(str(path), "token-of-a-new-run-0123")
    assert path.read_text().strip() == "token-of-a-new-run-0123"
