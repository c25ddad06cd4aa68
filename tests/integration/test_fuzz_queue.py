"""Fuzzes every QueueService RPC of a real queue process (issue #11): generated and mutated requests get OK or a
documented code, never UNKNOWN or INTERNAL; a refused one changes neither the trainer version, the bound, nor
what was accepted, acked or reserved. SetTrainerVersion moves the pacing of every producer: it comes last."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.testing import make_group, queue_stub
from tests.fuzz import C, Fuzzer, Method, budget

SERVICE = q.DESCRIPTOR.services_by_name["QueueService"]


def test_every_queue_rpc_survives_generated_and_mutated_requests(service_process, tmp_path: Path) -> None:
    queue = service_process(
        "queue",
        {
            "wal.dir": "wal",
            "max_staleness": -1,
            "max_wait_s": 1,
            "capacity_groups": 500,
            "max_group_bytes": 1 << 20,
            "groups_per_step": 4,
        },
    )
    stub = queue_stub(queue.address)
    stub.Put(q.PutRequest(group=make_group("seed-0")))
    stub.Put(q.PutRequest(group=make_group("seed-1")))
    lease = stub.Get(q.GetRequest(consumer_id="t", max_groups=1, lease_duration=Duration(seconds=3600))).lease
    ticket = stub.Reserve(q.ReserveRequest(request_id="r0", producer_id="p", n_groups=1)).ticket

    def observe() -> tuple[object, ...]:
        # Leases and tickets expire, and expired ones are redelivered, in the background: left out.
        s = stub.Stats(q.StatsRequest())
        return s.trainer_version, s.max_staleness, s.accepted_groups, s.acked_groups

    short = Duration(nanos=100_000_000)
    methods = [
        Method("Stats", set(), [q.StatsRequest()]),
        Method(
            "Reserve",
            set(),
            [q.ReserveRequest(request_id="r1", producer_id="p", n_groups=1, wait=short)],
            timeout_s=3,
            waits=True,
        ),
        Method("ReleaseReservation", {C.NOT_FOUND}, [q.ReleaseReservationRequest(ticket_id=ticket.ticket_id)]),
        Method("Put", {C.FAILED_PRECONDITION, C.UNAVAILABLE}, [q.PutRequest(group=make_group("g1"))]),
        Method("Get", {C.FAILED_PRECONDITION}, [q.GetRequest(consumer_id="t", max_groups=2, wait=short)], timeout_s=3, waits=True),
        Method(
            "RenewLease",
            {C.NOT_FOUND, C.FAILED_PRECONDITION},
            [q.RenewLeaseRequest(lease_id=lease.lease_id, lease_duration=Duration(seconds=60))],
        ),
        Method("Nack", {C.NOT_FOUND, C.FAILED_PRECONDITION}, [q.NackRequest(lease_id=lease.lease_id)]),
        Method("Ack", {C.NOT_FOUND, C.FAILED_PRECONDITION}, [q.AckRequest(lease_id=lease.lease_id)]),
        Method("SetMaxStaleness", set(), [q.SetMaxStalenessRequest(max_staleness=2)]),
        Method("SetTrainerVersion", set(), [q.SetTrainerVersionRequest(policy_version=1)]),
    ]
    fuzzer = Fuzzer(queue.address, SERVICE, observe, queue.log_text)
    try:
        for method in methods:
            fuzzer.fuzz(method, budget(100))
        print(fuzzer.summary())
    finally:
        fuzzer.close()
    assert queue.proc.poll() is None
    assert "Traceback" not in queue.log_text(), queue.log_text()[-5000:]
