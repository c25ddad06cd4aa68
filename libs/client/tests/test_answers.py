"""tauflow-client against a server whose answers break the contract (a buggy or hostile server, in this
process): a Score answer of another shape is a TauflowError and writes no reward, a Put answer with no
outcome is an error (not a duplicate), and each client's receive limit bounds the answers it takes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.api.reward.v1 import reward_pb2 as r
from tauflow.client import QueueClient, RewardClient, TauflowError
from tauflow.client.channel import SMALL_ANSWER_BYTES
from tauflow.core.testing import make_group

Answer = Callable[[str], bytes]  # the method's name -> the raw answer


class _Raw(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.answer: Answer = lambda method: b""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        name = details.method.rpartition("/")[2]
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self.answer(name))


@pytest.fixture
def server() -> Iterator[tuple[_Raw, str]]:
    """A server answering every method with ``handler.answer(method)``, raw bytes, sent whatever their size."""
    handler = _Raw()
    limit = 64 * 1024 * 1024
    s = grpc.server(
        futures.ThreadPoolExecutor(2),
        options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)],
    )
    s.add_generic_rpc_handlers((handler,))
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    try:
        yield handler, f"127.0.0.1:{port}"
    finally:
        s.stop(0)


def _groups() -> list:
    groups = [make_group("g0", samples=2), make_group("g1", samples=3)]
    for group in groups:
        for sample in group.samples:
            sample.reward.score = -7.0  # the caller's own value, which a refused answer must leave alone
    return groups


def _scores(groups: list) -> list[list[float]]:
    return [[s.reward.score for s in g.samples] for g in groups]


def _score_answer(*samples_per_group: int) -> bytes:
    answer = r.ScoreResponse(reward_fn="f")
    for n in samples_per_group:
        g = answer.groups.add()
        for i in range(n):
            g.samples.add(sample_id=str(i)).reward.score = 1.0
    return answer.SerializeToString()


@pytest.mark.parametrize(
    ("shape", "what"),
    [
        ((2,), "1 group(s) for the 2 sent"),  # fewer groups: was ValueError from zip
        ((2, 3, 1), "3 group(s) for the 2 sent"),  # more groups: was raised after writing both groups
        ((2, 2), "groups[1] has 2 reward(s) for its 3 sample(s)"),  # was raised after writing groups[0]
        ((1, 3), "groups[0] has 1 reward(s) for its 2 sample(s)"),
        ((), "0 group(s) for the 2 sent"),
    ],
)
def test_a_score_answer_of_another_shape_is_a_tauflow_error_and_writes_no_reward(
    server: tuple[_Raw, str], shape: tuple[int, ...], what: str
) -> None:
    handler, address = server
    handler.answer = lambda method: _score_answer(*shape)
    groups = _groups()
    with RewardClient(address, timeout_s=10) as client, pytest.raises(TauflowError) as caught:
        client.score(groups)
    assert caught.value.code == grpc.StatusCode.INTERNAL and what in caught.value.details, caught.value
    assert _scores(groups) == [[-7.0, -7.0], [-7.0, -7.0, -7.0]]
    handler.answer = lambda method: _score_answer(2, 3)  # the right shape is taken, every reward written
    with RewardClient(address, timeout_s=10) as client:
        assert client.score(groups) == "f"
    assert _scores(groups) == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def test_a_put_answer_with_no_outcome_is_an_error_not_a_duplicate(server: tuple[_Raw, str]) -> None:
    handler, address = server
    with QueueClient(address, "token", timeout_s=10) as client:
        for unspecified in (b"", q.PutResponse(depth_groups=3).SerializeToString()):
            handler.answer = lambda method, a=unspecified: a
            with pytest.raises(TauflowError) as caught:
                client.put(make_group("g"))
            assert caught.value.code == grpc.StatusCode.INTERNAL and "PUT_OUTCOME_UNSPECIFIED" in caught.value.details
        handler.answer = lambda method: q.PutResponse(outcome=7).SerializeToString()  # an outcome unknown here
        with pytest.raises(TauflowError, match="outcome is 7"):
            client.put(make_group("g"))
        handler.answer = lambda method: q.PutResponse(
            outcome=q.PUT_OUTCOME_DUPLICATE, depth_groups=3
        ).SerializeToString()
        assert client.put(make_group("g")) == (result := client.put(make_group("g")))
        assert (result.accepted, result.depth_groups) == (False, 3)
        handler.answer = lambda method: q.PutResponse(
            outcome=q.PUT_OUTCOME_ACCEPTED, depth_groups=4
        ).SerializeToString()
        result = client.put(make_group("g"))
        assert (result.accepted, result.depth_groups) == (True, 4)


def _big_stats(size: int) -> bytes:
    return q.StatsResponse(trainer_version=5).SerializeToString() + _unknown_field(size)


def _unknown_field(size: int) -> bytes:
    """A length-delimited field of number 1000 (unknown to every message here) holding ``size`` bytes."""
    tag = (1000 << 3) | 2
    return _varint(tag) + _varint(size) + b"x" * size


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_the_queue_client_takes_no_answer_over_a_few_mib_and_the_limit_is_configurable(
    server: tuple[_Raw, str],
) -> None:
    handler, address = server
    handler.answer = lambda method: _big_stats(SMALL_ANSWER_BYTES + 1024)
    with QueueClient(address, "token", timeout_s=10) as client:
        with pytest.raises(TauflowError) as caught:
            client.stats()
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
    with QueueClient(address, "token", timeout_s=10, max_receive_bytes=2 * SMALL_ANSWER_BYTES) as client:
        assert client.stats().trainer_version == 5
    handler.answer = lambda method: _big_stats(1024)
    with (
        QueueClient(address, "token", timeout_s=10, max_receive_bytes=512) as client,
        pytest.raises(TauflowError, match="RESOURCE_EXHAUSTED"),
    ):
        client.stats()
    with pytest.raises(ValueError, match="max_receive_bytes must be positive"):
        QueueClient(address, "token", max_receive_bytes=0)


def test_the_reward_client_takes_score_answers_that_grow_with_the_request(server: tuple[_Raw, str]) -> None:
    handler, address = server
    groups = _groups()
    big = r.ScoreResponse.FromString(_score_answer(2, 3))
    big.groups[1].samples[2].reward.message = "m" * (2 * SMALL_ANSWER_BYTES)  # larger than the queue's limit
    handler.answer = lambda method: big.SerializeToString()
    with RewardClient(address, timeout_s=10) as client:
        assert client.score(groups) == "f"
    assert len(groups[1].samples[2].reward.message) == 2 * SMALL_ANSWER_BYTES
    with (
        RewardClient(address, timeout_s=10, max_receive_bytes=SMALL_ANSWER_BYTES) as client,  # configurable
        pytest.raises(TauflowError, match="RESOURCE_EXHAUSTED"),
    ):
        client.score(_groups())
