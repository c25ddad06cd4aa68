"""PutBatch (queue.v1 revision 5) as the queue's own process, over a real socket: each entry answered in
order as PutStream answers a group, a refused entry changes nothing and keeps no other out, a request
out of bounds is refused whole, and an answered batch survives a SIGKILL of the queue."""

from __future__ import annotations

import signal

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.protobuf import length_delimited
from tauflow.core.testing import make_group, queue_stub

_PUT_BATCH = "/tauflow.api.queue.v1.QueueService/PutBatch"


def _put(group, ticket: str = "") -> bytes:
    return q.PutRequest(group=group, ticket_id=ticket).SerializeToString()


def _batch(address: str, puts: list[bytes]) -> q.PutBatchResponse:
    """A PutBatch of serialized entries as they are (so that a test can send what no stub would)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(_PUT_BATCH, request_serializer=bytes, response_deserializer=bytes)
        raw = b"".join(part for put in puts for part in length_delimited(1, put))
        return q.PutBatchResponse.FromString(call(raw, timeout=30))


def test_each_entry_is_answered_in_order_and_a_refused_one_keeps_no_other_out(service_process) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": 0, "max_group_bytes": 20000})
    sent = [
        _put(make_group("g0")),
        _put(make_group("g1")),
        _put(make_group("g0")),  # again, in the same batch: a duplicate
        b"\x0a\x03\xff\xff\xff",  # a group whose bytes do not decode
        _put(make_group("big", payload_tokens=3000)),  # over max_group_bytes
        _put(make_group("future", version=5)),  # newer than the trainer's version 0
        _put(make_group("g2")),
    ]
    answers = list(_batch(queue.address, sent).results)
    assert len(answers) == len(sent)
    ok, dup = q.PUT_OUTCOME_ACCEPTED, q.PUT_OUTCOME_DUPLICATE
    assert [(a.outcome, a.code) for a in answers[:3]] == [(ok, 0), (ok, 0), (dup, 0)]
    assert [a.depth_groups for a in answers[:2]] == [1, 2]
    assert answers[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and answers[3].message
    assert answers[4].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert answers[4].reason == q.ERROR_REASON_GROUP_TOO_LARGE
    assert answers[5].code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "version" in answers[5].message
    assert (answers[6].outcome, answers[6].code) == (ok, 0)
    assert all(a.outcome == q.PUT_OUTCOME_UNSPECIFIED for a in answers[3:6])
    stats = queue_stub(queue.address).Stats(q.StatsRequest())
    assert (stats.depth_groups, stats.accepted_groups) == (3, 3)


@pytest.mark.parametrize(
    ("puts", "field"),
    [
        ([], "puts"),
        ([_put(make_group("n"))] * 1025, "puts has 1025 elements"),
        # (one over the ids' bound of 256: the strings' general bound of 4096 let 257..4096 through)
        (
            [_put(make_group("ok")), _put(make_group("t"), ticket="x" * 257)],
            "puts[1].ticket_id is 257 long, over the limit of 256",
        ),
        ([b"\xff\xff"], "does not decode"),
    ],
    ids=["empty", "too-many", "ticket-id", "garbage"],
)
def test_a_request_out_of_bounds_is_refused_whole_and_changes_nothing(service_process, puts, field) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": -1})
    with pytest.raises(grpc.RpcError) as err:
        _batch(queue.address, puts)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert queue_stub(queue.address).Stats(q.StatsRequest()).accepted_groups == 0


@pytest.mark.parametrize("chars", [257, 5000])
def test_put_refuses_a_ticket_id_over_its_bound_naming_the_bound(service_process, chars: int) -> None:
    queue = service_process("queue", {"max_staleness": -1})
    with pytest.raises(grpc.RpcError) as err:
        queue_stub(queue.address).Put(q.PutRequest(group=make_group("g"), ticket_id="x" * chars))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ticket_id" in err.value.details() and "256" in err.value.details()
    assert queue_stub(queue.address).Stats(q.StatsRequest()).accepted_groups == 0


def test_an_answered_batch_survives_a_sigkill(service_process) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": -1})
    answers = _batch(queue.address, [_put(make_group(f"g{i}", payload_tokens=64)) for i in range(50)]).results
    assert all(a.outcome == q.PUT_OUTCOME_ACCEPTED for a in answers)
    queue.proc.send_signal(signal.SIGKILL)
    queue.proc.wait()
    queue.start()
    stats = queue_stub(queue.address).Stats(q.StatsRequest())
    assert (stats.depth_groups, stats.accepted_groups) == (50, 50)
