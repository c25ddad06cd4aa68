"""remote_rm's gRPC protocol (issue #16): a reward service scores through another tauflow reward service's
Score (protocol tauflow, url grpc://host:port), in batches, with the remote's components; a sample the remote
could not score, and a remote that is gone, cost their samples the fallback score, never the call."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc


def _score(
    stub: reward_pb2_grpc.RewardServiceStub, texts: list[str], answers: list[str | None], **config: object
) -> list:
    struct = struct_pb2.Struct()
    struct.update(config)
    samples = [
        common_pb2.Sample(sample_id=str(i), completion_text=t, metadata={} if a is None else {"answer": a})
        for i, (t, a) in enumerate(zip(texts, answers, strict=True))
    ]
    group = common_pb2.Group(group_id="g", samples=samples)
    reply = stub.Score(reward_pb2.ScoreRequest(reward_fn="remote_rm", groups=[group], config=struct), timeout=60)
    return [s.reward for s in reply.groups[0].samples]


def test_remote_rm_scores_through_another_reward_service_over_grpc(service_process) -> None:
    remote = service_process("reward", {"pool.workers": 1})
    settings = {
        "pool.workers": 1,
        "functions.remote_rm.config.protocol": "tauflow",
        "functions.remote_rm.config.url": f"grpc://{remote.address}",
        "functions.remote_rm.config.remote_fn": "qa",
        "functions.remote_rm.config.max_batch": 2,
        "functions.remote_rm.config.fallback_score": -1.0,
    }
    local = service_process("reward", settings)
    stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(local.address))
    got = _score(stub, ["the red fox", "red fox", "a dog", "fox"], ["red fox", "red fox", "red fox", None])
    # the remote's qa (SQuAD F1); the last sample has no reference: an ERROR there, the fallback here
    assert [r.score for r in got] == pytest.approx([1.0, 1.0, 0.0, -1.0])
    assert [r.components["remote_error"] for r in got] == [0.0, 0.0, 0.0, 1.0]
    assert got[0].components["f1"] == 1.0 and got[2].components["exact_match"] == 0.0  # the remote's components
    with pytest.raises(grpc.RpcError) as err:  # the address is the service's own setting
        _score(stub, ["x"], ["x"], url="grpc://127.0.0.1:1")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    remote.stop()
    gone = _score(stub, ["red fox"], ["red fox"], request_timeout_s=2.0, budget_s=5.0)
    assert gone[0].score == -1.0 and gone[0].components["remote_error"] == 1.0
