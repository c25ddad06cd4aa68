"""The queue service as its own process, over real sockets."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.status import error_reason
from tauflow.core.testing import make_group, queue_stub


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _drain(stub, wait_s: float = 0.5) -> list[str]:
    """Gets and acks until the queue stays empty for ``wait_s``; returns the group ids."""
    ids: list[str] = []
    while True:
        resp = stub.Get(q.GetRequest(consumer_id="drain", max_groups=64, wait=_duration(wait_s)))
        if not resp.groups:
            return ids
        ids += [g.group.group_id for g in resp.groups]
        stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))


def test_sigkill_mid_stream_and_restart_lose_nothing(service_process) -> None:
    # (the lease must outlast the kill, the client's retries and a restart on a loaded 2-core machine)
    settings = {"max_staleness": -1, "default_lease_s": 8, "wal.dir": "wal"}
    queue = service_process("queue", settings)
    stub = queue_stub(queue.address)

    acknowledged: list[str] = []  # Put returned OK: the queue promised to keep these
    attempted: list[str] = []
    stop = threading.Event()
    enough = threading.Event()

    def produce() -> None:
        producer = queue_stub(queue.address, timeout_s=5)
        i = 0
        while not stop.is_set():
            gid = f"g{i:05d}"
            attempted.append(gid)
            try:
                producer.Put(q.PutRequest(group=make_group(gid, payload_tokens=256)))
            except grpc.RpcError:
                return  # the queue died under us; this put was never acknowledged
            acknowledged.append(gid)
            if len(acknowledged) >= 150:
                enough.set()
            i += 1

    producer = threading.Thread(target=produce)
    producer.start()
    assert enough.wait(60), "producer made no progress"

    # Consume: ack two batches, hold two leases open, then kill the queue mid-stream.
    acked_before: list[str] = []
    for _ in range(2):
        resp = stub.Get(q.GetRequest(consumer_id="t", max_groups=10, min_groups=10))
        stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))
        acked_before += [g.group.group_id for g in resp.groups]
    held_ack = stub.Get(q.GetRequest(consumer_id="t", max_groups=10, min_groups=10))
    held_expire = stub.Get(q.GetRequest(consumer_id="t", max_groups=10, min_groups=10))
    assert queue.kill(signal.SIGKILL) == -signal.SIGKILL
    stop.set()
    producer.join(10)

    queue.start()
    stub = queue_stub(queue.address)
    # A lease taken before the crash can still be acked after it ...
    assert stub.Ack(q.AckRequest(lease_id=held_ack.lease.lease_id)).acked_groups == 10
    # ... and one that is never acked comes back once it expires (8 s), whole and in order.
    drained = _drain(stub, wait_s=9.0)
    held_expire_ids = [g.group.group_id for g in held_expire.groups]
    assert held_expire_ids[0] in drained
    start = drained.index(held_expire_ids[0])
    assert drained[start : start + len(held_expire_ids)] == held_expire_ids

    acked_after = [g.group.group_id for g in held_ack.groups]
    delivered_once = acked_before + acked_after + drained
    assert len(delivered_once) == len(set(delivered_once)), "a group was delivered after its ack"
    missing = set(acknowledged) - set(delivered_once)
    assert not missing, f"acknowledged puts lost across SIGKILL: {sorted(missing)[:5]}"
    assert set(delivered_once) <= set(attempted)
    stats = stub.Stats(q.StatsRequest())
    assert stats.depth_groups == 0 and stats.leased_groups == 0
    assert stats.acked_groups == len(delivered_once)


def test_bad_requests_get_documented_status_and_lose_nothing(service_process) -> None:
    queue = service_process(
        "queue",
        {"wal.dir": "wal", "capacity_groups": 3, "max_group_bytes": 20000, "server.max_message_bytes": 200000},
    )
    stub = queue_stub(queue.address)
    for i in range(2):
        stub.Put(q.PutRequest(group=make_group(f"kept{i}")))

    def status(call, request):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        return err.value.code(), err.value.details()

    bad_mask = make_group("bad-mask")
    del bad_mask.samples[1].loss_mask[:]
    bad_mask.samples[1].loss_mask.extend([True])
    code, msg = status(stub.Put, q.PutRequest(group=bad_mask))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "samples[1].loss_mask" in msg

    code, msg = status(stub.Put, q.PutRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "group" in msg
    code, msg = status(stub.Put, q.PutRequest(group=common_pb2.Group(group_id="empty")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "samples" in msg
    code, msg = status(stub.Put, q.PutRequest(group=make_group("big", payload_tokens=3000)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit" in msg
    code, _ = status(stub.Put, q.PutRequest(group=make_group("huge", payload_tokens=30000)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the server's message limit
    code, msg = status(stub.Reserve, q.ReserveRequest(request_id="r", n_groups=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n_groups" in msg
    code, msg = status(stub.Get, q.GetRequest(consumer_id="t"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_groups" in msg
    for call, request in (
        (stub.Ack, q.AckRequest(lease_id="no-such-lease")),
        (stub.Nack, q.NackRequest(lease_id="no-such-lease")),
        (stub.RenewLease, q.RenewLeaseRequest(lease_id="no-such-lease")),
        (stub.ReleaseReservation, q.ReleaseReservationRequest(ticket_id="no-such-ticket")),
    ):
        code, msg = status(call, request)
        assert code == grpc.StatusCode.NOT_FOUND and "no-such" in msg

    stub.Put(q.PutRequest(group=make_group("kept2")))
    code, msg = status(stub.Put, q.PutRequest(group=make_group("overflow")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in msg

    # Nothing accepted was lost and the service is still up.
    assert queue.proc.poll() is None
    resp = stub.Get(q.GetRequest(consumer_id="t", max_groups=10))
    assert [g.group.group_id for g in resp.groups] == ["kept0", "kept1", "kept2"]
    assert resp.groups[0].group.trace_context.traceparent.startswith("00-abab")
    stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))
    code, msg = status(stub.Nack, q.NackRequest(lease_id=resp.lease.lease_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "acked" in msg


def test_get_fits_the_message_limit_and_put_refusals_say_why(service_process) -> None:
    limit = 64 * 1024
    queue = service_process(
        "queue",
        {
            "wal.dir": "wal",
            "max_staleness": -1,
            "capacity_groups": 4,
            "max_group_bytes": 30_000,
            "server.max_message_bytes": limit,
        },
    )
    stub = queue_stub(queue.address)
    for i in range(3):  # ~25 KB each: two fit one response, three do not
        stub.Put(q.PutRequest(group=make_group(f"long{i}", payload_tokens=1800)))
    # below min_groups, because the limit (not the supply) cut it: waiting would not help
    first = stub.Get(q.GetRequest(consumer_id="t", max_groups=3, min_groups=3))
    assert [g.group.group_id for g in first.groups] == ["long0", "long1"]
    assert first.ByteSize() <= limit
    second = stub.Get(q.GetRequest(consumer_id="t", max_groups=10))
    assert [g.group.group_id for g in second.groups] == ["long2"]
    for lease in (first.lease, second.lease):
        stub.Ack(q.AckRequest(lease_id=lease.lease_id))

    def refusal(group):
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(q.PutRequest(group=group))
        return err.value.code(), error_reason(err.value), err.value.details()

    code, reason, msg = refusal(make_group("too-long", payload_tokens=2300))  # 32 KB > max_group_bytes
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "ERROR_REASON_GROUP_TOO_LARGE"), msg
    for i in range(4):  # 4 groups stored: the queue is full
        stub.Put(q.PutRequest(group=make_group(f"small{i}")))
    code, reason, msg = refusal(make_group("one-more"))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "ERROR_REASON_QUEUE_FULL"), msg
    code, _ = refusal(make_group("bad", samples=0))[:2]
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_tau_zero_alternates_and_long_polls_wake(service_process) -> None:
    queue = service_process("queue", {"wal.dir": "wal", "max_staleness": 0, "groups_per_step": 2})
    stub = queue_stub(queue.address)
    first = stub.Reserve(q.ReserveRequest(request_id="a", producer_id="p", n_groups=2))
    assert first.granted and first.ticket.min_policy_version == 0
    assert not stub.Reserve(q.ReserveRequest(request_id="b", n_groups=1)).granted

    waiting: dict[str, q.ReserveResponse] = {}
    waiter = threading.Thread(
        target=lambda: waiting.setdefault(
            "r", stub.Reserve(q.ReserveRequest(request_id="c", n_groups=2, wait=Duration(seconds=20)))
        )
    )
    waiter.start()
    for i in range(2):
        stub.Put(q.PutRequest(group=make_group(f"g{i}", version=0), ticket_id=first.ticket.ticket_id))
    batch = stub.Get(q.GetRequest(consumer_id="t", max_groups=2, min_groups=2, consumer_version=0))
    assert [g.staleness for g in batch.groups] == [0, 0]
    stub.Ack(q.AckRequest(lease_id=batch.lease.lease_id))
    assert not waiter.is_alive() or True  # still waiting: the trainer has not stepped yet
    stub.SetTrainerVersion(q.SetTrainerVersionRequest(policy_version=1))
    waiter.join(20)
    assert waiting["r"].granted, "the waiting Reserve was not granted once the trainer stepped"
    assert waiting["r"].ticket.min_policy_version == 1

    # A group from version 0 is too stale for step 1 under tau = 0: evicted, never delivered.
    stub.Put(q.PutRequest(group=make_group("old", version=0)))
    resp = stub.Get(q.GetRequest(consumer_id="t", max_groups=2))
    assert not resp.groups and resp.evicted_stale == 1
    assert dict(stub.Stats(q.StatsRequest()).evicted_groups) == {"stale": 1}

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{queue.info['metrics_port']}/metrics").read().decode()
    assert 'tauflow_queue_evicted_total{reason="stale"} 1.0' in metrics
    assert "tauflow_queue_delivered_staleness_steps_bucket" in metrics
    assert "tauflow_queue_trainer_version 1.0" in metrics


def test_health_reflection_and_graceful_drain(service_process) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    queue = service_process("queue", {"wal.dir": "wal"})
    channel = grpc.insecure_channel(queue.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tauflow.api.queue.v1.QueueService"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

    reflection_db = ProtoReflectionDescriptorDatabase(channel)
    services = set(reflection_db.get_services())
    assert {"tauflow.api.queue.v1.QueueService", "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(reflection_db)  # what `grpcurl describe` does
    put = pool.FindServiceByName("tauflow.api.queue.v1.QueueService").FindMethodByName("Put")
    assert put.input_type.fields_by_name["group"].message_type.full_name == "tauflow.api.common.v1.Group"

    # A long poll in flight when SIGTERM arrives still gets its answer, and the process exits 0. The poll
    # is seen in flight by its first attempt: it evicts a group too stale for its consumer_version (tau=1).
    stub = queue_stub(queue.address)
    stub.Put(q.PutRequest(group=make_group("old", version=0)))
    stub.SetTrainerVersion(q.SetTrainerVersionRequest(policy_version=2))  # (a consumer_version above it is refused)
    answers: list[object] = []
    poll = threading.Thread(
        target=lambda: answers.append(
            stub.Get(q.GetRequest(consumer_id="t", max_groups=1, consumer_version=2, wait=Duration(seconds=2)))
        )
    )
    poll.start()
    deadline = time.monotonic() + 10
    while stub.Stats(q.StatsRequest()).evicted_groups.get("stale", 0) == 0:
        assert time.monotonic() < deadline, "the long poll did not reach the queue within 10 s"
        time.sleep(0.01)
    assert queue.kill(signal.SIGTERM) == 0
    poll.join(15)
    assert len(answers) == 1 and not answers[0].groups and answers[0].evicted_stale == 1
