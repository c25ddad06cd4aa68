"""The queue's streaming calls (queue.v1 revision 4) as the service's own process, over real sockets:
PutStream answers each group in order with Put's status, Deliver leases as Get does, and what a stream
answered survives a SIGKILL of the queue."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.testing import make_group, queue_stub

_METHOD = "/tauflow.api.queue.v1.QueueService/"


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _raw_stream(address: str, method: str):
    """A bidirectional call that sends bytes as they are (so that a test can send what no stub would)."""
    channel = grpc.insecure_channel(address)
    return channel, channel.stream_stream(_METHOD + method, request_serializer=bytes, response_deserializer=bytes)


def _put(group, ticket: str = "") -> bytes:
    return q.PutStreamRequest(group=group, ticket_id=ticket).SerializeToString()


def _deliver(**get) -> bytes:
    return q.DeliverRequest(get=q.GetRequest(**get)).SerializeToString()


def test_put_stream_answers_each_group_in_order_and_deliver_leases_as_get(service_process) -> None:
    queue = service_process(
        "queue",
        {"wal.dir": "wal", "max_staleness": -1, "max_group_bytes": 20000, "server.max_message_bytes": 200000},
    )
    bad_mask = make_group("bad-mask")
    del bad_mask.samples[1].loss_mask[:]
    bad_mask.samples[1].loss_mask.extend([True])
    sent = [
        _put(make_group("g0")),
        _put(make_group("g1")),
        _put(make_group("g0")),  # again: a duplicate, answered OK
        b"\xff\xff\xff",  # does not decode: this group is refused, the stream goes on
        _put(bad_mask),
        _put(make_group("big", payload_tokens=3000)),  # over max_group_bytes
        _put(make_group("g2"), ticket="x" * 300),  # ticket_id over its bound
        _put(make_group("g3")),
    ]
    channel, put_stream = _raw_stream(queue.address, "PutStream")
    answers = [q.PutStreamResponse.FromString(a) for a in put_stream(iter(sent), timeout=30)]
    channel.close()
    assert len(answers) == len(sent)
    ok, dup = q.PUT_OUTCOME_ACCEPTED, q.PUT_OUTCOME_DUPLICATE
    assert [(a.outcome, a.code) for a in answers[:3]] == [(ok, 0), (ok, 0), (dup, 0)]
    assert answers[1].depth_groups == 2
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[3].code == invalid and "does not decode" in answers[3].message
    assert answers[4].code == invalid and "samples[1].loss_mask" in answers[4].message
    assert answers[5].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert answers[5].reason == q.ERROR_REASON_GROUP_TOO_LARGE and "over the limit" in answers[5].message
    assert answers[6].code == invalid and "ticket_id" in answers[6].message
    assert (answers[7].outcome, answers[7].code) == (ok, 0)
    assert all(a.outcome == q.PUT_OUTCOME_UNSPECIFIED for a in answers[3:7])  # refused: nothing stored

    stub = queue_stub(queue.address)
    stats = stub.Stats(q.StatsRequest())
    assert (stats.depth_groups, stats.accepted_groups) == (3, 3)

    # Deliver: one batch per request, in order; the leases are Get's (acked by the unary Ack).
    channel, deliver = _raw_stream(queue.address, "Deliver")
    requests = [
        _deliver(consumer_id="t", max_groups=2, min_groups=2, wait=_duration(5)),
        _deliver(consumer_id="t", max_groups=2, wait=_duration(0.2)),
        _deliver(consumer_id="t", max_groups=2, wait=_duration(0.2)),  # nothing left: no lease, no groups
    ]
    batches = [q.DeliverResponse.FromString(r).batch for r in deliver(iter(requests), timeout=30)]
    assert [[d.group.group_id for d in b.groups] for b in batches] == [["g0", "g1"], ["g3"], []]
    assert not batches[2].HasField("lease") and batches[0].max_staleness == -1
    assert batches[0].groups[0].group.samples[0].completion_token_ids == make_group("g0").samples[0].completion_token_ids
    for b in batches[:2]:
        assert stub.Ack(q.AckRequest(lease_id=b.lease.lease_id)).acked_groups == len(b.groups)

    # A request Get would refuse ends the stream with Get's status and leases nothing.
    stub.Put(q.PutRequest(group=make_group("g4")))
    for bad, field in ((_deliver(consumer_id="t"), "max_groups"), (b"\xff\xff", "does not decode")):
        with pytest.raises(grpc.RpcError) as err:
            list(deliver(iter([bad]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    channel.close()
    stats = stub.Stats(q.StatsRequest())
    assert (stats.depth_groups, stats.leased_groups, stats.acked_groups) == (1, 0, 3)
    assert queue.proc.poll() is None


def test_groups_a_stream_answered_survive_a_sigkill(service_process) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": -1, "stream_window": 4})
    answered: list[str] = []
    enough = threading.Event()

    def groups():
        i = 0
        while True:  # until the queue dies under the stream
            yield _put(make_group(f"g{i:05d}", payload_tokens=256))
            i += 1

    def produce() -> None:
        channel, put_stream = _raw_stream(queue.address, "PutStream")
        i = 0
        try:
            for raw in put_stream(groups(), timeout=60):
                answer = q.PutStreamResponse.FromString(raw)
                assert answer.code == 0
                answered.append(f"g{i:05d}")  # answers come in the order sent
                i += 1
                if i >= 120:
                    enough.set()
        except grpc.RpcError:
            pass  # the queue was killed
        finally:
            channel.close()

    producer = threading.Thread(target=produce)
    producer.start()
    assert enough.wait(60), "the stream made no progress"
    assert queue.kill(signal.SIGKILL) == -signal.SIGKILL
    producer.join(10)
    promised = list(answered)

    queue.start()
    stub = queue_stub(queue.address)
    delivered: list[str] = []
    while True:
        resp = stub.Get(q.GetRequest(consumer_id="t", max_groups=256, wait=_duration(0.5)))
        if not resp.groups:
            break
        delivered += [d.group.group_id for d in resp.groups]
        stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))
    assert set(promised) <= set(delivered), "a group the stream answered OK was lost"
    assert len(delivered) == len(set(delivered))


def test_a_draining_queue_ends_its_streams_at_once_rather_than_at_the_end_of_its_grace(service_process) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": -1, "server.drain_grace_s": 60})
    more = threading.Event()

    def groups():
        for i in range(3):
            yield _put(make_group(f"d{i}"))
        more.wait(60)  # an open stream with nothing more to send

    put_channel, put_stream = _raw_stream(queue.address, "PutStream")
    answers = put_stream(groups(), timeout=60)
    got = [q.PutStreamResponse.FromString(next(answers)) for _ in range(3)]
    assert all(a.outcome == q.PUT_OUTCOME_ACCEPTED for a in got)

    deliver_channel, deliver = _raw_stream(queue.address, "Deliver")
    batches: list[q.GetResponse] = []
    requests = iter(
        [
            _deliver(consumer_id="t", max_groups=3, min_groups=3, wait=_duration(5)),
            _deliver(consumer_id="t", max_groups=1, wait=_duration(50)),  # a long poll: nothing is left
        ]
    )
    consumer = threading.Thread(
        target=lambda: batches.extend(q.DeliverResponse.FromString(r).batch for r in deliver(requests, timeout=60))
    )
    consumer.start()
    deadline = time.monotonic() + 10
    while len(batches) < 1:
        assert time.monotonic() < deadline, "the first batch did not come"
        time.sleep(0.01)
    time.sleep(0.2)  # the second request is now a long poll in the queue

    started = time.monotonic()
    assert queue.kill(signal.SIGTERM) == 0  # drained and exited cleanly
    assert time.monotonic() - started < 30, "the drain waited for its streams' grace (60 s)"
    assert list(answers) == []  # the put stream ended OK, after its answers
    consumer.join(10)
    assert [len(b.groups) for b in batches] == [3, 0]  # the long poll was answered (empty), then the end
    more.set()
    put_channel.close()
    deliver_channel.close()
