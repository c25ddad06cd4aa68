"""The reward hub through a real reward service process: every new built-in scores over gRPC in the pool, and
``remote_rm`` calls a real HTTP scoring server that this test starts, with the service's own URL and token."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.channel import ChannelConfig, create_sync_channel
from tauflow.core.testing import ServiceProcess

OK, ERROR = common_pb2.REWARD_STATUS_OK, common_pb2.REWARD_STATUS_ERROR
TOKEN = "s3cret-token-for-the-test"


class ScoringServer(ThreadingHTTPServer):
    """A reward-model server: scores a completion 1 when it holds its sample's answer, else 0.25."""

    requests: list[dict[str, Any]]
    auth: list[str]


class Handler(BaseHTTPRequestHandler):
    server: ScoringServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self.server.auth.append(self.headers.get("Authorization", ""))
        scores = [1.0 if m.get("answer", "?") in c else 0.25 for c, m in zip(body["completions"], body["metadata"])]
        payload = json.dumps({"scores": scores, "components": [{"chars": len(c)} for c in body["completions"]]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def scoring_server() -> Iterator[ScoringServer]:
    server = ScoringServer(("127.0.0.1", 0), Handler)
    server.requests, server.auth = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, scoring_server: ScoringServer) -> Iterator[ServiceProcess]:
    settings = {
        "pool.workers": 2,
        "pool.preload": "[]",
        "functions.remote_rm.config.url": f"http://127.0.0.1:{scoring_server.server_address[1]}/score",
        "functions.remote_rm.config.api_key_env": "TAUFLOW_RM_TOKEN",
        "functions.remote_rm.config.max_batch": "2",
    }
    proc = ServiceProcess("reward", tmp_path_factory.mktemp("svc"), settings, env={"TAUFLOW_RM_TOKEN": TOKEN})
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(service: ServiceProcess) -> reward_pb2_grpc.RewardServiceStub:
    channel = create_sync_channel(
        service.address, [reward_pb2.DESCRIPTOR.services_by_name["RewardService"]], ChannelConfig(default_timeout_s=30)
    )
    return reward_pb2_grpc.RewardServiceStub(channel)


def score(stub: Any, fn: str, texts: list[str], config: dict[str, Any] | None = None, **metadata: str) -> list[Any]:
    struct = struct_pb2.Struct()
    struct.update(config or {})
    group = common_pb2.Group(
        group_id="g",
        metadata=metadata,
        samples=[common_pb2.Sample(sample_id=str(i), completion_text=t) for i, t in enumerate(texts)],
    )
    reply = stub.Score(reward_pb2.ScoreRequest(reward_fn=fn, groups=[group], config=struct))
    return [s.reward for s in reply.groups[0].samples]


def test_qa_and_multiple_choice_over_grpc(stub: Any) -> None:
    got = score(stub, "qa", ["The Red Fox.", "the big red fox", "a dog"], answer=json.dumps(["red fox", "fox"]))
    assert [r.score for r in got] == pytest.approx([1.0, 0.8, 0.0])
    assert got[1].components["exact_match"] == 0.0 and got[0].components["exact_match"] == 1.0
    got = score(stub, "multiple_choice", ["Answer: (B)", "\\boxed{C}", "A or B?"], answer="B")
    assert [r.score for r in got] == [1.0, 0.0, 0.0] and got[2].components["answer_found"] == 0.0


def test_ifeval_and_compose_run_in_the_pool(stub: Any) -> None:
    constraints = json.dumps([{"type": "no_commas"}, {"type": "length_words", "relation": "at most", "num": 3}])
    got = score(stub, "ifeval", ["two words", "one, two", "a b c d"], {"scoring": "fraction"}, constraints=constraints)
    assert [r.score for r in got] == [1.0, 0.5, 0.5]
    config = {
        "parts": [{"fn": "math"}, {"fn": "ifeval", "weight": 0.5}],
        "gate": {"fn": "format", "config": {"pattern": r"<answer>.*</answer>"}, "fail_score": -1.0},
    }
    texts = ["<answer>\\boxed{4}</answer>", "<answer>\\boxed{5}</answer>", "\\boxed{4}"]
    got = score(stub, "compose", texts, config, answer="4", constraints=json.dumps([{"type": "no_commas"}]))
    assert [r.score for r in got] == [1.5, 0.5, -1.0]
    assert all(r.status == OK for r in got) and got[0].components["ifeval.followed"] == 1.0


def test_compose_refuses_an_unknown_part_naming_it(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        score(stub, "compose", ["x"], {"parts": [{"fn": "nope"}]})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("config.parts.0.fn: 'nope' is not a registered reward function")


def test_remote_rm_scores_through_a_real_http_server_with_the_services_token(
    stub: Any, scoring_server: ScoringServer
) -> None:
    before = len(scoring_server.requests)
    got = score(stub, "remote_rm", ["it is 42", "it is 41", "42!", "no"], answer="42")
    assert [r.score for r in got] == [1.0, 0.25, 1.0, 0.25]
    assert got[0].components["remote_error"] == 0.0 and got[0].components["chars"] == 8.0
    assert len(scoring_server.requests) - before == 2  # max_batch 2: four samples in two requests
    assert scoring_server.auth[-1] == f"Bearer {TOKEN}"


def test_a_request_cannot_point_remote_rm_elsewhere_or_pick_its_secret(stub: Any) -> None:
    for key, value in [("url", "http://attacker.example/steal"), ("api_key_env", "TAUFLOW_RM_OTHER")]:
        with pytest.raises(grpc.RpcError) as err:
            score(stub, "remote_rm", ["x"], {key: value})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(f"config.{key}: set only in the service's settings")
        assert TOKEN not in (err.value.details() or "")
