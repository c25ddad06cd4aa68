"""GenRM as its own deployment (issue #16): a reward service asks a rollout server that runs a judge model
(a tiny instruct model taught here to grade replies) with a judging chat, reads the verdict, and records it
in the reward's components; a judge that is gone costs each sample its fallback score, never the call."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf import struct_pb2

from tauflow.api.common.v1 import common_pb2
from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.models import tiny

GENRM = Path(__file__).resolve().parents[2] / "examples" / "genrm"


def _genrm_task() -> ModuleType:
    """examples/genrm/task.py, under a name of its own (other examples have a task.py too)."""
    spec = importlib.util.spec_from_file_location("genrm_task", GENRM / "task.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


task = _genrm_task()


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tiny.build_chat_model(
        tmp_path_factory.mktemp("judge"), task.corpus(), vocab_size=300, hidden=32, layers=1, heads=2
    )
    tiny.sft_chat(out, task.judge_pairs(), steps=150, lr=3e-3, seed=0)
    return out


def _score(stub: reward_pb2_grpc.RewardServiceStub, texts: list[str], config: dict | None = None) -> list:
    struct = struct_pb2.Struct()
    struct.update(config or {})
    group = common_pb2.Group(
        group_id="g",
        metadata={"prompt": "Pass the salt."},
        samples=[common_pb2.Sample(sample_id=str(i), completion_text=t) for i, t in enumerate(texts)],
    )
    reply = stub.Score(reward_pb2.ScoreRequest(reward_fn="genrm", groups=[group], config=struct), timeout=120)
    return [s.reward for s in reply.groups[0].samples]


def test_the_reward_service_asks_the_judge_deployment_and_records_its_verdict(
    service_process, judge_model: Path
) -> None:
    judge = service_process("rollout", {"model_path": str(judge_model), "server_id": "judge"})
    settings = {
        "pool.workers": 1,
        "functions.genrm.config.address": judge.address,
        "functions.genrm.config.system_prompt": task.JUDGE_SYSTEM,
        "functions.genrm.config.template": task.JUDGE_TEMPLATE,
        "functions.genrm.config.max_new_tokens": 8,
    }
    reward = service_process("reward", settings)
    stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(reward.address))
    got = _score(stub, ["Thanks a lot.", "No.", "Sure, thanks!", "Later."])
    assert [r.score for r in got] == [1.0, 0.0, 1.0, 0.0]  # Score: 10 and Score: 0, normalised from [0, 10]
    assert [r.components["judge_score"] for r in got] == [10.0, 0.0, 10.0, 0.0]
    assert all(r.components["judge_error"] == 0.0 and r.status == common_pb2.REWARD_STATUS_OK for r in got)
    raw = _score(stub, ["Thanks, done."], {"normalise": False})
    assert raw[0].score == 10.0
    with pytest.raises(grpc.RpcError) as err:  # a request cannot send the completions to another server
        _score(stub, ["x"], {"address": "127.0.0.1:1"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("config.address: set only in the service's settings")
    judge.stop()
    gone = _score(stub, ["Thanks!", "No."], {"request_timeout_s": 2.0})
    assert [(r.score, r.components["judge_error"]) for r in gone] == [(0.0, 1.0), (0.0, 1.0)]
