"""The run token (tauflow.core.auth): a control method without it is refused UNAUTHENTICATED before its
request is read and changes nothing; open methods, health and info need none; the channels send the
process's token, except those to servers outside the run; token files are validated without quoting them."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.api.info.v1 import info_pb2, info_pb2_grpc
from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core import runtoken
from tauflow.core.app import service_main
from tauflow.core.channel import create_channel, create_sync_channel
from tauflow.core.config import ServerConfig, ServiceConfig
from tauflow.core.runtoken import (
    CONTROL_METHODS,
    TokenFileError,
    bearer_token,
    load_run_token,
    read_token_file,
    use_run_token,
    write_token_file,
)
from tauflow.core.server import GrpcServer, ServiceApp, ServiceBinding

QUEUE = queue_pb2.DESCRIPTOR.services_by_name["QueueService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
INFO = info_pb2.DESCRIPTOR.services_by_name["ServerInfoService"]
TOKEN = "run-token-0123456789abcdef"


class Queue(queue_pb2_grpc.QueueServiceServicer):
    """SetTrainerVersion (a control method) moves ``version``; Stats (open) reads it."""

    def __init__(self) -> None:
        self.version = 0
        self.put_streams = 0
        self.seen_metadata: list[tuple[str, str]] = []

    async def SetTrainerVersion(self, request, context):
        self.seen_metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        self.version = request.policy_version
        return queue_pb2.SetTrainerVersionResponse(trainer_version=self.version)

    async def Stats(self, request, context):
        self.seen_metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        return queue_pb2.StatsResponse(trainer_version=self.version)

    async def PutStream(self, request_iterator, context) -> AsyncIterator[queue_pb2.PutStreamResponse]:
        self.put_streams += 1
        async for _ in request_iterator:
            yield queue_pb2.PutStreamResponse()


@pytest.fixture(autouse=True)
def no_process_token() -> Iterator[None]:
    use_run_token("")
    yield
    use_run_token("")


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Queue]]:
    state = Queue()
    binding = ServiceBinding(QUEUE, state, queue_pb2_grpc.add_QueueServiceServicer_to_server)
    server = GrpcServer([binding], ServerConfig(port=0, drain_grace_s=0), run_token=TOKEN)
    port = await server.start()
    await server.set_serving(True)
    try:
        yield f"127.0.0.1:{port}", state
    finally:
        await server.drain()


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize(
    "metadata, why",
    [
        ((), "missing `authorization: Bearer <token>`"),
        ((("authorization", TOKEN),), "must be `Bearer <token>`"),
        (_bearer("run-token-0123456789abcdeX"), "not the run's token"),
        (_bearer(TOKEN[:-1]), "not the run's token"),
    ],
)
async def test_a_control_call_without_the_token_is_refused_and_changes_nothing(
    served: tuple[str, Queue], metadata: tuple[tuple[str, str], ...], why: str
) -> None:
    address, state = served
    async with create_channel(address, [QUEUE]) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(policy_version=7), metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "SetTrainerVersion is a control method" in refused.value.details()
        assert why in refused.value.details()
        assert TOKEN not in refused.value.details()
        assert state.version == 0
        # open methods need no token
        assert (await stub.Stats(queue_pb2.StatsRequest())).trainer_version == 0


async def test_a_control_stream_without_the_token_never_reaches_the_servicer(served: tuple[str, Queue]) -> None:
    address, state = served
    async with create_channel(address, [QUEUE]) as channel:
        call = queue_pb2_grpc.QueueServiceStub(channel).PutStream(iter([queue_pb2.PutStreamRequest()]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state.put_streams == 0


async def test_the_process_token_is_sent_on_control_calls_only_and_admitted(served: tuple[str, Queue]) -> None:
    address, state = served
    use_run_token(TOKEN)  # after the channel is made too: read at each call
    async with create_channel(address, [QUEUE]) as channel:
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        reply = await stub.SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(policy_version=7))
        assert reply.trainer_version == 7 and state.version == 7
        assert state.seen_metadata == [("authorization", f"Bearer {TOKEN}")]
        await stub.Stats(queue_pb2.StatsRequest())  # open: a server of another deployment never sees the token
        assert state.seen_metadata == []
        # a caller's own authorization is not doubled
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.SetTrainerVersion(queue_pb2.SetTrainerVersionRequest(), metadata=_bearer("other-0123456789ab"))
        assert state.version == 7


async def test_a_channel_outside_the_run_never_sends_the_token(served: tuple[str, Queue]) -> None:
    address, state = served
    use_run_token(TOKEN)
    async with create_channel(address, [QUEUE], send_run_token=False) as channel:
        await queue_pb2_grpc.QueueServiceStub(channel).Stats(queue_pb2.StatsRequest())
        assert state.seen_metadata == []
    sync = create_sync_channel(address, [QUEUE], send_run_token=False)
    try:
        await asyncio.to_thread(queue_pb2_grpc.QueueServiceStub(sync).Stats, queue_pb2.StatsRequest())
        assert state.seen_metadata == []
        with pytest.raises(grpc.RpcError) as refused:
            await asyncio.to_thread(
                queue_pb2_grpc.QueueServiceStub(sync).SetTrainerVersion,
                queue_pb2.SetTrainerVersionRequest(policy_version=3),
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        sync.close()
    sync = create_sync_channel(address, [QUEUE])  # the sync channel of the run sends it
    try:
        reply = await asyncio.to_thread(
            queue_pb2_grpc.QueueServiceStub(sync).SetTrainerVersion,
            queue_pb2.SetTrainerVersionRequest(policy_version=3),
        )
        assert reply.trainer_version == 3
    finally:
        sync.close()


async def test_health_and_info_need_no_token(served: tuple[str, Queue]) -> None:
    address, _ = served
    async with create_channel(address, [HEALTH, INFO]) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        await info_pb2_grpc.ServerInfoServiceStub(channel).GetServerInfo(info_pb2.GetServerInfoRequest())


# Every method of the run's services is either a control method or one of these, so that a method added later
# is not left open unnoticed.
OPEN_METHODS = {
    "tauflow.api.queue.v1.QueueService": {"Stats"},
    "tauflow.api.weights.v1.WeightsService": {"GetManifest", "GetStatus"},
    "tauflow.api.rollout.v1.RolloutService": {"Generate", "ComputeLogprobs", "GetStatus"},
    "tauflow.api.trainer.v1.TrainerService": {"GetStatus", "ListSteps"},
    "tauflow.api.controller.v1.ControllerService": {"GetRun", "ListServices"},
    "tauflow.api.reward.v1.RewardService": {"Score", "ListRewardFunctions"},
}


def test_every_method_of_the_run_is_either_guarded_or_known_to_be_open() -> None:
    """A renamed method would leave the guard silently open; a new one must be put in one list or the other."""
    from google.protobuf import descriptor_pool

    import tauflow.api.controller.v1.controller_pb2
    import tauflow.api.reward.v1.reward_pb2
    import tauflow.api.rollout.v1.rollout_pb2
    import tauflow.api.trainer.v1.trainer_pb2
    import tauflow.api.weights.v1.weights_pb2  # noqa: F401

    pool = descriptor_pool.Default()
    for service in {*CONTROL_METHODS, *OPEN_METHODS}:
        guarded, open_ = CONTROL_METHODS.get(service, frozenset()), OPEN_METHODS.get(service, set())
        methods = {m.name for m in pool.FindServiceByName(service).methods}
        assert not guarded & open_ and guarded | open_ == methods, service
    assert "Publish" in CONTROL_METHODS["tauflow.api.weights.v1.WeightsService"]
    assert "Generate" not in CONTROL_METHODS["tauflow.api.rollout.v1.RolloutService"]


def test_the_run_sends_its_token_on_preferred_open_methods_and_a_server_tells_its_own_calls() -> None:
    from tauflow.core.runtoken import RUN_PREFERRED_METHODS, from_the_run, preferred_token, token_for

    for service, methods in RUN_PREFERRED_METHODS.items():  # open methods: anyone may call them
        assert methods <= OPEN_METHODS[service] and not methods & CONTROL_METHODS.get(service, frozenset())
    try:
        use_run_token("")
        assert token_for("/tauflow.api.queue.v1.QueueService/Ack") == ""  # no run token: none sent
        assert from_the_run(()) and from_the_run(_bearer("anything-0123456789"))  # no token: all calls are
        use_run_token(TOKEN)
        derived = preferred_token(TOKEN)
        assert token_for(b"/tauflow.api.queue.v1.QueueService/Ack") == TOKEN  # a control method
        # an open method where the run's calls come first: a token derived from the run's, never the run's
        assert token_for("/tauflow.api.reward.v1.RewardService/Score") == derived and TOKEN not in derived
        assert token_for("/tauflow.api.reward.v1.RewardService/ListRewardFunctions") == ""
        assert token_for("/tauflow.api.rollout.v1.RolloutService/Generate") == ""  # a judge of another run
        assert from_the_run(_bearer(derived)) and from_the_run((("authorization", f"bearer  {derived}"),))
        assert from_the_run(_bearer(TOKEN))  # (a holder of the run token is the run)
        for metadata in [(), _bearer("other-0123456789ab"), _bearer(derived + "x"), (("authorization", derived),)]:
            assert not from_the_run(metadata), metadata
        use_run_token("another-run-0123456789")  # another run's derived token is not this run's
        assert not from_the_run(_bearer(derived))
    finally:
        use_run_token("")


@pytest.mark.parametrize(
    "content, why",
    [
        (b"short", "at least 16"),
        (b"x" * 600, "longer than 512"),
        (b"has a space in it 0123456789", "printable ASCII without spaces"),
        ("t\u00f6ken-0123456789abcdef".encode(), "printable ASCII without spaces"),
    ],
)
def test_a_bad_token_file_is_refused_without_quoting_it(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(TokenFileError) as refused:
        read_token_file(path)
    assert why in str(refused.value) and str(path) in str(refused.value)
    assert content.decode(errors="replace")[:16] not in str(refused.value)
    with pytest.raises(TokenFileError, match="No such file"):
        read_token_file(tmp_path / "missing")


def test_a_token_file_is_written_for_its_user_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "run.token"
    token = runtoken.new_token()
    write_token_file(path, token)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_run_token(path) == token == runtoken.run_token()
    assert runtoken.run_token_file() == str(path)


@pytest.mark.parametrize(
    "metadata, token",
    [((("authorization", "bearer  abc "),), "abc"), ((("authorization", b"Bearer xyz"),), "xyz"), ((), "")],
)
def test_bearer_token_reading(metadata: tuple, token: str) -> None:
    assert bearer_token(metadata)[0] == token


def test_a_service_with_a_bad_token_file_does_not_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def build(config: ServiceConfig) -> ServiceApp:  # pragma: no cover - never reached
        raise AssertionError("built despite a bad token file")

    (tmp_path / "token").write_text("short\n")
    main = service_main("probe", ServiceConfig, build, "0.0.0")
    code = main(["--set", f"auth.token_file={tmp_path / 'token'}", "--set", "metrics.enabled=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "auth.token_file" in err and "at least 16" in err


def test_a_token_file_that_is_a_fifo_or_a_folder_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO in its place held a restarting role (and `tauflow set`) forever, with no word of the token."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(TokenFileError, match="not a regular file|Is a directory"):
            read_token_file(path)


def test_a_peer_refusing_the_token_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role restarted with another run's token died on its first control call with a traceback (exit 1),
    three times, and the run failed without a word of the token."""
    import tauflow.core.app

    # (not the process-wide gRPC instrumentation: it would stay on for the later tests of this process)
    monkeypatch.setattr(tauflow.core.app, "setup_telemetry", lambda service, version: None)
    token_file = tmp_path / "token"
    write_token_file(token_file, "another-runs-token-0123456789")

    async def build(config: ServiceConfig) -> ServiceApp:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "SetTrainerVersion is a control method: the bearer token is not the run's token",
        )

    main = service_main("probe", ServiceConfig, build, "0.0.0")
    code = main(["--set", f"auth.token_file={token_file}", "--set", "metrics.enabled=false"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"auth.token_file {token_file}" in err and "not the run's token" in err
    assert "another-runs-token" not in err
