"""The reward service as a real process, with custom rewards installed as a real distribution.

A tiny distribution (a module plus a ``.dist-info`` whose ``entry_points.txt`` declares the
``tauflow.rewards`` group) is written to a directory on the service's PYTHONPATH, exactly what
``pip install`` leaves behind, so the service finds it through ``importlib.metadata``.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import grpc
import pytest
from google.protobuf import duration_pb2, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.core.testing import ServiceProcess

OK, ERROR, TIMEOUT = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR, common_pb2.REWARD_STATUS_TIMEOUT

MODULE = textwrap.dedent(
    '''
    """Custom rewards of the test distribution."""
    from tauflow.reward.api import Score, reward

    @reward(description="fails on 'boom'", fallback_score=-1.0)
    def picky(sample, config):
        if "boom" in sample.completion_text:
            raise ValueError("refusing to score " + sample.completion_text)
        return Score(float(len(sample.completion_text)), {"chars": len(sample.completion_text)})

    class Spin:
        """Spins on 'hang' (CPU-bound), else scores the reward of the answer key."""
        timeout_s = 0.4
        fallback_score = -5.0
        default_config = {"bonus": 0.0}

        def __call__(self, sample, config):
            if sample.completion_text == "hang":
                while True:
                    pass
            return 1.0 + config["bonus"]

    class Judge:
        """Scores a group by rank."""
        group_level = True

        def __call__(self, group, config):
            return [float(len(group.samples) - i) for i in range(len(group.samples))]

    class Stall:
        """Sleeps 20 s on 'block' (the service runs it inline), else scores its length."""
        timeout_s = 10.0
        fallback_score = -3.0

        def __call__(self, sample, config):
            import time
            if sample.completion_text == "block":
                time.sleep(20)
            return float(len(sample.completion_text))
    '''
)
ENTRY_POINTS = textwrap.dedent(
    """
    [tauflow.rewards]
    picky = tauflow_test_rewards:picky
    spin = tauflow_test_rewards:Spin
    spin_long = tauflow_test_rewards:Spin
    judge = tauflow_test_rewards:Judge
    stall = tauflow_test_rewards:Stall
    broken = tauflow_test_rewards_missing:fn
    """
)


def start_service(tmp_path_factory: pytest.TempPathFactory, **extra: object) -> tuple[ServiceProcess, Path]:
    """A reward service with the test plug-ins (MODULE) installed in a site folder; (service, site)."""
    site = tmp_path_factory.mktemp("site")
    (site / "tauflow_test_rewards.py").write_text(MODULE)
    dist = site / "tauflow_test_rewards-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tauflow-test-rewards\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    settings = {
        "pool.workers": 2,
        "pool.preload": "[]",
        "max_samples_per_request": 600,
        "functions.exact_match.config.ignore_case": "true",
        "functions.stall.executor": "inline",
        "max_inline_call_s": 3,
        "functions.spin_long.timeout_s": 30,  # (a request may lower a function's timeout, not raise it)
        **extra,
    }
    proc = ServiceProcess("reward", tmp_path_factory.mktemp("svc"), settings, env={"PYTHONPATH": str(site)})
    proc.start()
    return proc, site


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    proc, _ = start_service(tmp_path_factory)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(service: ServiceProcess) -> reward_pb2_grpc.RewardServiceStub:
    channel = create_sync_channel(
        service.address, [reward_pb2.DESCRIPTOR.services_by_name["RewardService"]], ChannelConfig(default_timeout_s=20)
    )
    return reward_pb2_grpc.RewardServiceStub(channel)


def group(gid: str, *texts: str, answer: str | None = None, answers: list[str] | None = None) -> common_pb2.Group:
    return common_pb2.Group(
        group_id=gid,
        metadata={} if answer is None else {"answer": answer},
        samples=[
            common_pb2.Sample(
                sample_id=str(i),
                completion_text=t,
                metadata={"answer": answers[i]} if answers else {},
                reward=common_pb2.Reward(score=99.0),  # ignored by Score
            )
            for i, t in enumerate(texts)
        ],
    )


def scores(resp: reward_pb2.ScoreResponse) -> list[list[float]]:
    return [[s.reward.score for s in g.samples] for g in resp.groups]


def metric(service: ServiceProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.info['metrics_port']}/metrics").read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_lists_builtins_and_entry_points(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    resp = stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest())
    by_name = {f.name: f for f in resp.reward_functions}
    builtins = ["code", "compose", "exact_match", "format", "genrm", "ifeval", "math", "multiple_choice", "qa"]
    builtins.append("remote_rm")
    assert list(by_name) == sorted([*builtins, "judge", "picky", "spin", "spin_long", "stall"])  # sorted, no 'broken'
    assert resp.default_reward_fn == "exact_match"
    assert by_name["exact_match"].default_config["ignore_case"] is True  # the service setting applied
    assert by_name["spin"].timeout.ToTimedelta().total_seconds() == 0.4
    assert by_name["spin"].fallback_score == -5.0 and dict(by_name["spin"].default_config) == {"bonus": 0.0}
    assert by_name["judge"].group_level and not by_name["picky"].group_level
    assert by_name["picky"].description == "fails on 'boom'"
    assert "math-verify" in by_name["math"].description


def test_scores_groups_with_the_default_function(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    req = reward_pb2.ScoreRequest(
        groups=[group("a", "42", " 42 ", "41", answer="42"), group("b", "Paris", "paris", answers=["PARIS", "x"])]
    )
    resp = stub.Score(req)
    assert resp.reward_fn == "exact_match"
    assert [g.group_id for g in resp.groups] == ["a", "b"]
    assert [[s.sample_id for s in g.samples] for g in resp.groups] == [["0", "1", "2"], ["0", "1"]]
    assert scores(resp) == [[1.0, 1.0, 0.0], [1.0, 0.0]]
    assert all(s.reward.status == OK for g in resp.groups for s in g.samples)


def test_request_config_is_merged_over_the_defaults(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    config = struct_pb2.Struct()
    config.update({"ignore_case": False, "correct_score": 2.0})
    resp = stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "Paris", "paris", answer="Paris")], config=config))
    assert scores(resp) == [[2.0, 0.0]]


def test_math_and_format(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    resp = stub.Score(
        reward_pb2.ScoreRequest(
            reward_fn="math", groups=[group("m", "so \\boxed{\\frac{1}{2}}", "it is 0.5", "\\boxed{2}", answer="1/2")]
        )
    )
    assert scores(resp) == [[1.0, 1.0, 0.0]]
    resp = stub.Score(
        reward_pb2.ScoreRequest(
            reward_fn="format", groups=[group("f", "<think>x</think><answer>1</answer>", "<answer>1</answer>")]
        )
    )
    assert scores(resp) == [[1.0, 0.0]]


def test_a_raising_function_gives_error_status_and_fallback(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    before = metric(service, "tauflow_reward_failures_total", fn="picky", reason="error")
    resp = stub.Score(reward_pb2.ScoreRequest(reward_fn="picky", groups=[group("p", "abc", "boom", "de")]))
    ok, bad, ok2 = resp.groups[0].samples
    assert (ok.reward.score, ok.reward.status, dict(ok.reward.components)) == (3.0, OK, {"chars": 3.0})
    assert (bad.reward.score, bad.reward.status) == (-1.0, ERROR)
    assert bad.reward.message == "ValueError: refusing to score boom"
    assert ok2.reward.score == 2.0
    assert metric(service, "tauflow_reward_failures_total", fn="picky", reason="error") == before + 1


def test_a_hanging_function_times_out_and_the_service_keeps_serving(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    start = time.monotonic()
    resp = stub.Score(reward_pb2.ScoreRequest(reward_fn="spin", groups=[group("s", "hang", "fine"), group("t", "ok")]))
    assert time.monotonic() - start < 4
    hung, fine = resp.groups[0].samples
    assert (hung.reward.status, hung.reward.score) == (TIMEOUT, -5.0)
    assert "did not finish this sample within 0.4 s" in hung.reward.message
    assert hung.duration.ToTimedelta().total_seconds() == pytest.approx(0.4)
    assert (fine.reward.status, fine.reward.score) == (OK, 1.0) and scores(resp)[1] == [1.0]
    assert metric(service, "tauflow_reward_failures_total", fn="spin", reason="timeout") >= 1
    # the service and its pool still serve: several hangs at once, then normal work
    resp = stub.Score(reward_pb2.ScoreRequest(reward_fn="spin", groups=[group("u", "hang", "hang", "hang", "x")]))
    assert [s.reward.status for s in resp.groups[0].samples] == [TIMEOUT, TIMEOUT, TIMEOUT, OK]
    resp = stub.Score(
        reward_pb2.ScoreRequest(
            reward_fn="math",
            groups=[group("m", "\\boxed{3}", answer="3")],
            sample_timeout=duration_pb2.Duration(seconds=5),
        )
    )
    assert scores(resp) == [[1.0]]
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(service.address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert metric(service, "tauflow_reward_scored_samples_total", fn="spin", status="timeout") >= 4


def test_group_level_function(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    resp = stub.Score(reward_pb2.ScoreRequest(reward_fn="judge", groups=[group("j", "a", "b", "c")]))
    assert scores(resp) == [[3.0, 2.0, 1.0]]


def test_the_callers_deadline_is_kept(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    req = reward_pb2.ScoreRequest(
        reward_fn="spin_long", groups=[group("d", "hang")], sample_timeout=duration_pb2.Duration(seconds=30)
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(req, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    resp = stub.Score(reward_pb2.ScoreRequest(reward_fn="spin", groups=[group("d", "fine")]))
    assert scores(resp) == [[1.0]]


def _hold_two_slots(stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess) -> list[Any]:
    """Two Score calls in progress (a pool sample that spins until its 30 s timeout), once both are."""
    hogs = [
        stub.Score.future(reward_pb2.ScoreRequest(reward_fn="spin_long", groups=[group(f"h{i}", "hang")]), timeout=20)
        for i in range(2)
    ]
    deadline = time.monotonic() + 10
    while metric(service, "tauflow_reward_inflight_requests") < 2:
        assert time.monotonic() < deadline, "the two calls never started"
        time.sleep(0.02)
    return hogs


def test_calls_past_max_concurrent_requests_are_refused_logged_once_and_served_once_slots_free(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    service, _ = start_service(tmp_path_factory, max_concurrent_requests=2)
    try:
        stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(service.address))
        hogs = _hold_two_slots(stub, service)
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "x", answer="x")]), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                "2 Score calls are in progress" in e.value.details() and "max_concurrent_requests" in e.value.details()
            )
        for hog in hogs:
            hog.cancel()
        deadline = time.monotonic() + 10
        while True:  # (a cancelled call frees its slot once the service sees the cancel)
            try:
                resp = stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "x", answer="x")]), timeout=5)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, err
                time.sleep(0.05)
        assert scores(resp) == [[1.0]]
        assert service.log_text().count("every Score slot is taken") == 1  # five or more refused, one line
    finally:
        service.stop()


def test_callers_without_the_run_token_cannot_take_the_slots_kept_for_the_runs_own_calls(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    token = "run-token-0123456789abcdef"
    token_file = tmp_path_factory.mktemp("token") / "run.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    service, _ = start_service(
        tmp_path_factory, max_concurrent_requests=3, run_reserved_requests=1, **{"auth.token_file": str(token_file)}
    )
    from tauflow.core.runtoken import preferred_token

    run = (("authorization", f"Bearer {preferred_token(token)}"),)  # what the run's channels send on Score
    try:
        stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(service.address))
        hogs = _hold_two_slots(stub, service)  # anyone may call Score: no token needed
        easy = reward_pb2.ScoreRequest(groups=[group("a", "x", answer="x")])
        for metadata in [(), (("authorization", "Bearer not-the-run-token-0123"),)]:  # a wrong token is anyone's
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(easy, timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_requests less run_reserved_requests" in e.value.details()
        assert scores(stub.Score(easy, timeout=5, metadata=run)) == [[1.0]]  # the run's own call: its slot
        for hog in hogs:
            hog.cancel()
    finally:
        service.stop()


def test_unknown_functions_are_not_found(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    for name, detail in [("nope", "'nope' is not a registered"), ("broken", "failed to load: ModuleNotFoundError")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(reward_pb2.ScoreRequest(reward_fn=name, groups=[group("a", "x", answer="x")]))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert detail in e.value.details() and "exact_match" in e.value.details()


def _config(**kw: object) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(kw)
    return s


@pytest.mark.parametrize(
    ("request_kw", "code", "message"),
    [
        ({"groups": []}, "INVALID_ARGUMENT", "groups: must hold at least one group"),
        (
            {"groups": [common_pb2.Group(group_id="e")]},
            "INVALID_ARGUMENT",
            "groups[0].samples: group 'e' has no samples",
        ),
        (
            {"groups": [group("a", "x"), group("a", "y")]},
            "INVALID_ARGUMENT",
            "groups[1].group_id: 'a' repeats groups[0]",
        ),
        (
            {"groups": [common_pb2.Group(group_id="a", samples=[common_pb2.Sample(sample_id="s")] * 2)]},
            "INVALID_ARGUMENT",
            "groups[0].samples[1].sample_id: 's' repeats samples[0]",
        ),
        ({"config": _config(ignorecase=True)}, "INVALID_ARGUMENT", "config.ignorecase: unknown key"),
        ({"reward_fn": "format", "config": _config(pattern="((")}, "INVALID_ARGUMENT", "config.pattern:"),
        ({"reward_fn": "spin", "config": _config(bonus=1, extra=2)}, "INVALID_ARGUMENT", "config.extra: unknown key"),
        (  # the service's sandbox limits are ceilings: a request may lower them only
            {"reward_fn": "code", "config": _config(memory_mb=16384)},
            "INVALID_ARGUMENT",
            "config.memory_mb: 16384 is over this service's ceiling of 512 (functions.code.config.memory_mb)",
        ),
        ({"sample_timeout": duration_pb2.Duration(seconds=-1)}, "INVALID_ARGUMENT", "sample_timeout: must be positive"),
        ({"sample_timeout": duration_pb2.Duration(seconds=3600)}, "INVALID_ARGUMENT", "max_sample_timeout_s"),
        (  # a request may lower a function's timeout, not raise it (two such calls held both workers a minute)
            {"reward_fn": "math", "sample_timeout": duration_pb2.Duration(seconds=60)},
            "INVALID_ARGUMENT",
            "sample_timeout: 60 s is over reward function 'math''s timeout of 5 s (functions.math.timeout_s)",
        ),
        ({"groups": [group(f"g{i}", *["x"] * 8) for i in range(76)]}, "RESOURCE_EXHAUSTED", "608 samples"),
        (
            {"config": _config(correct_score=float("nan"))},
            "INVALID_ARGUMENT",
            "config.correct_score: nan is not a finite number",
        ),
        (
            {"reward_fn": "format", "config": _config(pattern=r"(\w)\1")},
            "INVALID_ARGUMENT",
            "config.pattern: not a valid regular expression (RE2 syntax",
        ),
        ({"reward_fn": "f" * 300}, "INVALID_ARGUMENT", "reward_fn: 300 characters, over this service's limit of 256"),
        (
            {"groups": [group("a", "x" * (1 << 20 + 1))]},
            "INVALID_ARGUMENT",
            "groups[0].samples[0].completion_text: 2097152 characters",
        ),
        (
            {"sample_timeout": duration_pb2.Duration(seconds=1, nanos=-5)},
            "INVALID_ARGUMENT",
            "sample_timeout: must be positive",
        ),
    ],
)
def test_bad_requests_get_a_status_naming_the_field(
    stub: reward_pb2_grpc.RewardServiceStub, request_kw: dict[str, object], code: str, message: str
) -> None:
    req = reward_pb2.ScoreRequest(**{"groups": [group("a", "x", answer="x")], **request_kw})
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(req)
    assert e.value.code() == getattr(grpc.StatusCode, code)
    assert message in e.value.details()


def test_bytes_that_are_no_request_are_invalid_argument_and_counted(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    channel = grpc.insecure_channel(service.address)
    before = metric(service, "tauflow_reward_invalid_requests_total", field="request", method="Score")
    for method, raw in [("Score", b"\x0a\xff"), ("Score", b"\x12\x02\xff\xfe"), ("ListRewardFunctions", b"\x0b")]:
        call = channel.unary_unary(f"/tauflow.api.reward.v1.RewardService/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(raw, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert e.value.details().startswith(f"request: not a valid tauflow.api.reward.v1.{method}Request: ")
    # corrupt wire format; a string that is not UTF-8 (protobuf refuses it, gRPC would say UNKNOWN)
    assert metric(service, "tauflow_reward_invalid_requests_total", field="request", method="Score") == before + 2
    channel.close()


def test_a_group_of_millions_of_samples_is_refused_before_it_is_decoded(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    """A group of 10 M empty samples (19 MiB) took 1.3 GB and 1.4 s of the event loop to decode before it was
    refused: its samples are counted on the wire bytes, and the count stops at the bound."""
    group_bytes = b"\x1a\x00" * 2_000_000  # (Group.samples = 3: two million empty samples)
    raw = b"\x0a" + _varint(len(group_bytes)) + group_bytes  # ScoreRequest.groups = 1
    before = metric(service, "tauflow_reward_invalid_requests_total", field="groups.samples", method="Score")
    call = grpc.insecure_channel(service.address).unary_unary("/tauflow.api.reward.v1.RewardService/Score")
    with pytest.raises(grpc.RpcError) as e:
        call(raw, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "groups[0].samples: has more than 4096 elements, over the limit of 4096"
    assert (
        metric(service, "tauflow_reward_invalid_requests_total", field="groups.samples", method="Score") == before + 1
    )
    assert stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "x", answer="x")])).groups  # serving


def _peak_rss_mib(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmHWM"].split()[0]) / 1024


def test_a_config_holding_millions_of_values_is_refused_before_it_is_decoded(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    """A config of 4 M nulls in one list (`{"a": [null, ...]}`, 15 MiB) was decoded whole (~0.2 GB, 0.2 s)
    before the max_config_bytes check refused it: the config's bytes are measured as sent."""
    nulls = b"\x0a\x02\x08\x00" * 4_000_000  # ListValue.values: Value{null_value}
    value = b"\x32" + _varint(len(nulls)) + nulls  # Value.list_value = 6
    entry = b"\x0a\x01a\x12" + _varint(len(value)) + value  # Struct.fields entry: "a" -> the list
    config = b"\x0a" + _varint(len(entry)) + entry
    raw = b"\x1a" + _varint(len(config)) + config  # ScoreRequest.config = 3
    before = metric(service, "tauflow_reward_invalid_requests_total", field="config", method="Score")
    peak = _peak_rss_mib(service.proc.pid)
    call = grpc.insecure_channel(service.address, options=[("grpc.max_send_message_length", -1)]).unary_unary(
        "/tauflow.api.reward.v1.RewardService/Score"
    )
    with pytest.raises(grpc.RpcError) as e:
        call(raw, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        f"config: {len(config)} bytes as sent, over this service's limit of 65536 (limits.max_config_bytes)"
    )
    assert metric(service, "tauflow_reward_invalid_requests_total", field="config", method="Score") == before + 1
    assert _peak_rss_mib(service.proc.pid) - peak < 60  # (decoded: ~215 MiB more)
    # in parts: the parts are merged by the decode, so their sum is what was sent
    part = struct_pb2.Struct(fields={"k": struct_pb2.Value(string_value="x" * 40_000)}).SerializeToString()
    two = b"".join(b"\x1a" + _varint(len(part)) + part for _ in range(2))
    with pytest.raises(grpc.RpcError) as e:
        call(two, timeout=30)
    assert e.value.details().startswith(f"config: {2 * len(part)} bytes as sent, over")
    one = b"\x1a" + _varint(len(part)) + part  # one part is within the bound (the function refuses key k)
    with pytest.raises(grpc.RpcError) as e:
        call(one, timeout=30)
    assert "as sent" not in e.value.details()
    assert stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "x", answer="x")])).groups  # serving


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out, n = out + bytes([(n & 0x7F) | 0x80]), n >> 7
    return out + bytes([n])


def test_refusals_are_counted_by_field(stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess) -> None:
    labels = {"field": "groups.samples.sample_id", "method": "Score"}
    before = metric(service, "tauflow_reward_invalid_requests_total", **labels)
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            stub.Score(
                reward_pb2.ScoreRequest(
                    groups=[
                        group("a", "x", "y", answer="x"),
                        common_pb2.Group(samples=[common_pb2.Sample(sample_id="s" * 257)]),
                    ]
                )
            )
    assert metric(service, "tauflow_reward_invalid_requests_total", **labels) == before + 2


def test_an_inline_call_without_a_deadline_answers_within_its_budget(
    stub: reward_pb2_grpc.RewardServiceStub, service: ServiceProcess
) -> None:
    # Nothing ended an inline call that came without a deadline: it held a slot and a thread for as long as
    # its samples took (an hour for one request of large shared references). Now its budget (here
    # max_inline_call_s, 3 s) ends it: the samples scored keep their scores, the rest time out.
    before = metric(service, "tauflow_reward_failures_total", fn="stall", reason="timeout")
    req = reward_pb2.ScoreRequest(reward_fn="stall", groups=[group("s", "ab", "block", "cde"), group("t", "f")])
    with grpc.insecure_channel(service.address) as channel:  # (tauflow's channels give every call a deadline)
        resp = reward_pb2_grpc.RewardServiceStub(channel).Score(req)
    got = [(s.reward.status, s.reward.score) for g in resp.groups for s in g.samples]
    assert got == [(OK, 2.0), (TIMEOUT, -3.0), (TIMEOUT, -3.0), (TIMEOUT, -3.0)]
    assert "this call's time budget (3 s: at most max_inline_call_s, 3 s" in resp.groups[0].samples[1].reward.message
    assert metric(service, "tauflow_reward_failures_total", fn="stall", reason="timeout") == before + 3
    # its slot is free, and the service serves on (the blocked sample's thread ends by itself)
    assert scores(stub.Score(reward_pb2.ScoreRequest(reward_fn="stall", groups=[group("u", "abcd")]))) == [[4.0]]


def test_a_large_shared_reference_is_an_error_of_each_sample_past_max_answer_chars(
    stub: reward_pb2_grpc.RewardServiceStub,
) -> None:
    # The probe's request (smaller): multiple_choice with a group reference and options of 80,000 characters
    # each, shared by 64 samples; each sample normalised them all again (0.4 s per sample at 2 MiB, inline).
    options = json.dumps(["y " * 4000] * 10)
    meta = {"answer": "x " * 40_000, "choices": options}
    samples = [common_pb2.Sample(sample_id=str(i), completion_text="") for i in range(64)]
    config = struct_pb2.Struct()
    config.update({"choices_key": "choices"})
    req = reward_pb2.ScoreRequest(
        reward_fn="multiple_choice",
        config=config,
        groups=[common_pb2.Group(group_id="g", metadata=meta, samples=samples)],
    )
    resp = stub.Score(req)
    (rewards,) = [[s.reward for s in g.samples] for g in resp.groups]
    assert {(r.status, r.score) for r in rewards} == {(ERROR, 0.0)}
    assert rewards[0].message == "ValueError: the reference is 80000 characters long; max_answer_chars is 65536"
    req.groups[0].metadata["answer"] = "A"
    (rewards,) = [[s.reward for s in g.samples] for g in stub.Score(req).groups]
    assert rewards[0].message == (
        "ValueError: metadata['choices'] is 80040 characters long; max_answer_chars is 65536"
    ) and {r.status for r in rewards} == {ERROR}
    # exact_match: the same bound
    req = reward_pb2.ScoreRequest(reward_fn="exact_match", groups=[group("e", "x", "y", answer="x" * 65_537)])
    assert {s.reward.message for s in stub.Score(req).groups[0].samples} == {
        "ValueError: the reference is 65537 characters long; max_answer_chars is 65536"
    }


def test_a_missing_reference_is_a_per_sample_error(stub: reward_pb2_grpc.RewardServiceStub) -> None:
    resp = stub.Score(reward_pb2.ScoreRequest(groups=[group("a", "x", answers=["x"]), group("b", "y")]))
    assert scores(resp)[0] == [1.0]
    (missing,) = resp.groups[1].samples
    assert missing.reward.status == ERROR and "no reference answer" in missing.reward.message


def _pool_processes(marker: str) -> dict[int, int]:
    """pid -> parent pid of the processes whose command line names ``marker`` (the pool's fork server and
    its workers: the fork server is started with the service's import path)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                out[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_workers_end_when_the_service_is_killed_even_inside_a_function_that_never_returns(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import os
    import signal

    service, site = start_service(tmp_path_factory)
    try:
        stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(service.address))
        # A worker spins in `hang` for up to 30 s; the caller gives up after 0.5 s.
        with pytest.raises(grpc.RpcError):
            stub.Score(
                reward_pb2.ScoreRequest(
                    reward_fn="spin_long", groups=[group("h", "hang")], sample_timeout=duration_pb2.Duration(seconds=30)
                ),
                timeout=0.5,
            )
        # pool.workers: 2, children of the fork server (the cancelled task's worker is being replaced: wait)
        deadline = time.monotonic() + 10
        while True:
            pool = _pool_processes(str(site))
            workers = {pid for pid, parent in pool.items() if parent in pool}
            if len(workers) == 2:
                break
            assert time.monotonic() < deadline, pool
            time.sleep(0.05)
    finally:
        service.stop()  # SIGKILL: no drain, no pool shutdown
    deadline = time.monotonic() + 10
    while workers & set(_pool_processes(str(site))):
        assert time.monotonic() < deadline, f"workers outlived the service: {_pool_processes(str(site))}"
        time.sleep(0.1)
    for pid in _pool_processes(str(site)):  # the idle fork server (it starts no more workers)
        os.kill(pid, signal.SIGKILL)


class HealthWatch:
    """Checks health every 50 ms on its own channel, in a thread; ``worst_s`` is the slowest answer, and a
    check that did not answer SERVING within 1 s is kept in ``failures``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.worst_s, self.checks, self.failures = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            start = time.monotonic()
            try:
                status = self.stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status != health_pb2.HealthCheckResponse.SERVING:
                    self.failures.append(status)
            except grpc.RpcError as e:
                self.failures.append(e.code())
            self.checks += 1
            self.worst_s = max(self.worst_s, time.monotonic() - start)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.channel.close()


def _random_text(chars: str, n: int) -> str:
    import random

    rng = random.Random(0)
    return "".join(rng.choice(chars) for _ in range(n))


# RE2 never backtracks, but its cost is linear in the text times the pattern's program: this one, over
# 512 KiB of random a/b, takes RE2 about 7 s (the DFA gives up, the NFA tracks 2,000 states per byte).
SLOW_FOR_RE2 = r"(?:[ab]*a[ab]{999}c|[ab]*b[ab]{999}c)"


def test_client_regexes_cannot_hang_the_service_and_sigterm_still_stops_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Issue #11, defect 5: `(a+)+$` on 40 "a"s hung the event loop (Python's re, inline): health checks
    timed out and SIGTERM was ignored."""
    import signal

    service = ServiceProcess(
        "reward",
        tmp_path_factory.mktemp("hostile"),
        {"pool.workers": 2, "pool.preload": "[]", "server.drain_grace_s": 1, "load_entry_points": "false"},
    ).start()
    try:
        stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(service.address))
        with HealthWatch(service.address) as health:
            start = time.monotonic()
            resp = stub.Score(
                reward_pb2.ScoreRequest(
                    reward_fn="format", config=_config(pattern="(a+)+$"), groups=[group("a", "a" * 40, "a" * 40 + "b")]
                ),
                timeout=10,
            )
            assert time.monotonic() - start < 2.0  # format's timeout: 1 s (a backtracking match: for ever)
            assert [(s.reward.status, s.reward.score) for s in resp.groups[0].samples] == [(OK, 1.0), (OK, 0.0)]
            # A pattern whose work is large even for RE2: stopped at format's 1 s timeout, in the pool.
            start = time.monotonic()
            resp = stub.Score(
                reward_pb2.ScoreRequest(
                    reward_fn="format",
                    config=_config(pattern=SLOW_FOR_RE2, mode="search"),
                    groups=[group("b", _random_text("ab", 1 << 19), "ab")],
                ),
                timeout=10,
            )
            took = time.monotonic() - start
            slow, fast = resp.groups[0].samples
            assert slow.reward.status == TIMEOUT and "within 1 s" in slow.reward.message
            assert (fast.reward.status, fast.reward.score) == (OK, 0.0) and took < 5.0  # (RE2 alone: 7 s)
            # The default pattern over a completion that makes Python's re quadratic (minutes): inline, fast.
            start = time.monotonic()
            resp = stub.Score(
                reward_pb2.ScoreRequest(reward_fn="format", groups=[group("c", "<think></think><answer>" * 40_000)]),
                timeout=10,
            )
            assert resp.groups[0].samples[0].reward.status == OK and time.monotonic() - start < 2.0
        assert health.checks >= 10 and not health.failures and health.worst_s < 0.5, vars(health)

        # SIGTERM during a call of hostile patterns (12 samples of 1 s each, on one worker: 12 s): the process
        # drains for server.drain_grace_s (1 s), stops its pool and exits.
        pending = stub.Score.future(
            reward_pb2.ScoreRequest(
                reward_fn="format",
                config=_config(pattern=SLOW_FOR_RE2, mode="search"),
                groups=[group("d", *[_random_text("ab", 1 << 19)] * 12)],
            ),
            timeout=30,
        )
        deadline = time.monotonic() + 10  # the call is in progress once its sample is handed to the pool
        while metric(service, "tauflow_reward_inflight_requests") < 1:
            assert time.monotonic() < deadline, "the Score call never started"
            time.sleep(0.02)
        start = time.monotonic()
        assert service.kill(signal.SIGTERM, timeout_s=10) == 0
        assert time.monotonic() - start < 5.0
        with pytest.raises(grpc.RpcError):
            pending.result()
    finally:
        service.stop()
