"""A hostile client against a real queue process, on the internal and the external port (issue #11):
poison groups are refused (and a stored one is quarantined, not delivered), refused requests change no
state and are never UNKNOWN."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families

from tauflow.api.common.v1 import common_pb2
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.core.protobuf import varint
from tauflow.core.testing import make_group, queue_stub
from tauflow.queue import model
from tauflow.queue.config import QueueConfig
from tauflow.queue.state import QueueState
from tauflow.queue.wal import WriteAheadLog

TOKEN = "t" * 32


def _field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _poison(gid: str) -> bytes:
    """A group whose first sample's completion_text is not UTF-8: no consumer can decode it."""
    return make_group(gid).SerializeToString() + _field(3, _field(1, b"9") + _field(10, b"\xff\xfe"))


def _raw_put(channel: grpc.Channel, group: bytes, metadata=()) -> grpc.StatusCode:
    put = channel.unary_unary("/tauflow.api.queue.v1.QueueService/Put")  # bytes in, bytes out
    try:
        put(_field(1, group), metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _code(call, request, **kw) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, timeout=10, **kw)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _evicted(metrics_port: object) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "tauflow_queue_evicted"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_poison_groups_are_refused_on_both_ports_and_training_goes_on(service_process, tmp_path: Path) -> None:
    (tmp_path / "tokens.yaml").write_text(f"agent: {TOKEN}\n")
    queue = service_process(
        "queue",
        {
            "max_staleness": -1,
            "wal.dir": "wal",
            "external.enabled": "true",
            "external.port": 0,
            "external.tokens_file": str(tmp_path / "tokens.yaml"),
            "max_lease_s": 3600,
        },
    )
    internal = grpc.insecure_channel(queue.address)
    external = grpc.insecure_channel(f"127.0.0.1:{queue.info['external_port']}")
    auth = (("authorization", f"Bearer {TOKEN}"),)
    stub = queue_stub(queue.address)
    assert _raw_put(internal, make_group("good-1").SerializeToString()) == grpc.StatusCode.OK
    assert _raw_put(internal, _poison("bad-1")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw_put(external, _poison("bad-2"), auth) == grpc.StatusCode.INVALID_ARGUMENT
    assert _raw_put(external, make_group("good-2").SerializeToString(), auth) == grpc.StatusCode.OK
    # The generated stubs decode what Get delivers: only the good groups were stored.
    resp = stub.Get(q.GetRequest(consumer_id="trainer", max_groups=8))
    assert [d.group.group_id for d in resp.groups] == ["good-1", "agent/good-2"]

    # Refused requests change no state and name the field; none is UNKNOWN.
    before = stub.Stats(q.StatsRequest())
    huge = Duration(seconds=10**11)  # a deadline in the year 5138
    assert _code(stub.Get, q.GetRequest(max_groups=1, lease_duration=huge))[0] == grpc.StatusCode.INVALID_ARGUMENT
    bad_nanos = Duration(seconds=1, nanos=-5)
    code, details = _code(stub.Get, q.GetRequest(max_groups=1, wait=bad_nanos))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "wait" in details
    code, details = _code(stub.Reserve, q.ReserveRequest(request_id="r" * (3 << 20), n_groups=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in details
    code, details = _code(stub.RenewLease, q.RenewLeaseRequest(lease_id=resp.lease.lease_id, lease_duration=huge))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lease_duration" in details
    future = make_group("future", version=2**64 - 1)
    code, details = _code(stub.Put, q.PutRequest(group=future))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "newer than the trainer's version 0" in details
    code, details = _code(stub.SetTrainerVersion, q.SetTrainerVersionRequest(policy_version=2**64 - 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "policy_version" in details
    after = stub.Stats(q.StatsRequest())
    assert after == before
    stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))


def test_a_stored_group_no_consumer_can_decode_is_quarantined(service_process, tmp_path: Path) -> None:
    # The log of an older build that accepted a poison group between two good ones.
    wal = WriteAheadLog(tmp_path / "wal" / "queue.wal")
    old = QueueState(QueueConfig(max_staleness=-1), wal)
    for gid, raw in (
        ("a", make_group("a").SerializeToString()),
        ("bad", _poison("bad")),
        ("b", make_group("b").SerializeToString()),
    ):
        old.put(model.GroupRecord(gid, raw, 0, 10))
    wal.close()
    queue = service_process("queue", {"max_staleness": -1, "wal.dir": "wal"})
    stub = queue_stub(queue.address)
    got = []
    for _ in range(2):  # the poison group blocks no Get: one group per Get, both good ones come out
        resp = stub.Get(q.GetRequest(consumer_id="trainer", max_groups=1))
        got += [d.group.group_id for d in resp.groups]
        stub.Ack(q.AckRequest(lease_id=resp.lease.lease_id))
    assert got == ["a", "b"]
    assert stub.Stats(q.StatsRequest()).evicted_groups == {"invalid": 1}
    assert _evicted(queue.info["metrics_port"])["invalid"] == 1
    kept = list((tmp_path / "wal" / "quarantine").glob("*.group"))
    assert len(kept) == 1 and kept[0].read_bytes() == _poison("bad")
    assert "quarantined" in queue.log_text()
    with pytest.raises(Exception):  # noqa: B017 - it really is undecodable
        common_pb2.Group.FromString(kept[0].read_bytes())


def test_a_port_that_grpcio_stops_on_a_bad_path_ends_the_process_for_its_launcher_to_restart(
    service_process, tmp_path: Path
) -> None:
    """grpcio's asyncio server shuts down for good on one request whose method path is not UTF-8 (before any
    interceptor or token check): the queue went on without its port, nothing restarted it, and the run
    stalled. Now the process exits (code 1) saying why, and a restart recovers what it had accepted."""
    import time

    from tauflow.core.testing import raw_http2_request

    settings = {"max_staleness": -1, "wal.dir": str(tmp_path / "wal")}
    queue = service_process("queue", settings)
    stub = queue_stub(queue.address)
    assert stub.Put(q.PutRequest(group=make_group("kept"))).outcome == q.PUT_OUTCOME_ACCEPTED
    raw_http2_request(int(queue.address.rsplit(":", 1)[1]), b"/x\xff")
    deadline = time.monotonic() + 30
    while queue.proc.poll() is None:
        assert time.monotonic() < deadline, "the queue went on without its port"
        time.sleep(0.1)
    assert queue.proc.returncode == 1
    assert "stopped by itself" in queue.log_text() and "restarts this process" in queue.log_text()
    again = service_process("queue", settings)  # what its launcher does
    assert queue_stub(again.address).Stats(q.StatsRequest()).depth_groups == 1
