"""The queue's external port: per-client bearer tokens, only the producer's methods, the client recorded on
what it puts and in the metrics; the tokens file, validated and followed without a restart."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tauflow.api.common.v1 import common_pb2
from tauflow.api.info.v1 import info_pb2, info_pb2_grpc
from tauflow.api.queue.v1 import queue_pb2 as q
from tauflow.api.queue.v1 import queue_pb2_grpc
from tauflow.core.config import MIN_MESSAGE_BYTES, ConfigError, load_config
from tauflow.core.status import error_reason
from tauflow.core.testing import ServiceProcess, make_group
from tauflow.queue.adapters import wire
from tauflow.queue.adapters.external import bearer_token, with_client_identity
from tauflow.queue.config import PUT_FRAMING_BYTES, QueueConfig
from tauflow.queue.tokens import TokensError, TokenTable

A_TOKEN, B_TOKEN, C_TOKEN = "a" * 24, "b" * 24, "c" * 24


# -- the tokens file -------------------------------------------------------------------------------


def test_the_token_table_follows_its_file_and_keeps_its_tokens_when_an_edit_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"agent-a: {A_TOKEN}\nagent-b: {B_TOKEN}\n")
    now = [0.0]
    table = TokenTable(path, reload_interval_s=1.0, clock=lambda: now[0])
    assert (table.lookup(A_TOKEN), table.lookup(B_TOKEN), table.lookup(C_TOKEN), table.lookup("")) == (
        "agent-a",
        "agent-b",
        None,
        None,
    )
    path.write_text(f"agent-a: {A_TOKEN}\nagent-c: {C_TOKEN}\n")  # agent-b removed, agent-c added
    assert table.lookup(C_TOKEN) is None  # not re-read before the interval
    now[0] = 1.5
    assert (table.lookup(C_TOKEN), table.lookup(B_TOKEN)) == ("agent-c", None)
    path.write_text("agent-a: short\n")  # a bad edit: logged, the tokens in force stay
    now[0] = 3.0
    assert (table.lookup(A_TOKEN), table.lookup(C_TOKEN)) == ("agent-a", "agent-c")
    path.unlink()
    now[0] = 4.5
    assert table.lookup(A_TOKEN) == "agent-a"
    with pytest.raises(TokensError, match="cannot read the tokens file"):
        TokenTable(path)  # at start, a missing file is an error


def test_the_external_port_needs_a_tokens_file_and_tls_needs_both_files() -> None:
    with pytest.raises(ConfigError, match="external.tokens_file must be set"):
        load_config(QueueConfig, overrides=["external.enabled=true"])
    with pytest.raises(ConfigError, match="tls_cert_file and external.tls_key_file go together"):
        load_config(QueueConfig, overrides=["external.tokens_file=t.yaml", "external.tls_cert_file=c.pem"])


def test_the_external_port_receives_no_more_than_its_largest_put_needs() -> None:
    """It inherited server.max_message_bytes (256 MiB, sized for Get's batches): gRPC receives a whole message
    before the bearer token is checked, so four anonymous 200 MiB Puts made the queue hold 1.6 GiB."""
    default = load_config(QueueConfig)
    assert default.external.max_message_bytes == 64 * 1024 * 1024 + PUT_FRAMING_BYTES  # max_group_bytes + framing
    assert default.server.max_message_bytes == 256 * 1024 * 1024  # (the internal port's stays)
    small = load_config(QueueConfig, overrides=["max_group_bytes=1024"])
    assert small.external.max_message_bytes == MIN_MESSAGE_BYTES  # (health and reflection answers still fit)
    assert load_config(QueueConfig, overrides=["server.max_message_bytes=8388608"]).external.max_message_bytes == (
        8 * 1024 * 1024 + PUT_FRAMING_BYTES  # a group never exceeds the internal port's limit either
    )
    chosen = load_config(QueueConfig, overrides=["external.max_message_bytes=1048576"])
    assert chosen.external.max_message_bytes == 1 << 20
    # Calls one connection may have in progress at once (each may hold a whole message before its token is
    # checked): a producer's few, not the internal port's 1,000.
    assert (default.external.max_concurrent_streams, default.server.max_concurrent_streams) == (32, 1000)


@pytest.mark.parametrize(
    ("metadata", "token", "why"),
    [
        ((("authorization", f"Bearer {A_TOKEN}"),), A_TOKEN, ""),
        ((("authorization", f"bearer   {A_TOKEN} "),), A_TOKEN, ""),
        ((("x-other", "1"),), "", "missing `authorization: Bearer <token>` metadata"),
        ((("authorization", f"Basic {A_TOKEN}"),), "", "must be `Bearer <token>`"),
        ((("authorization", "Bearer "),), "", "must be `Bearer <token>`"),
    ],
)
def test_bearer_token_reading(metadata: tuple[tuple[str, str], ...], token: str, why: str) -> None:
    got, reason = bearer_token(metadata)
    assert got == token and why in reason and bool(reason) == bool(why)


def test_the_client_name_namespaces_the_group_id_and_replaces_the_producer_id() -> None:
    group = make_group("g1")
    group.producer_id = "someone-else"
    raw = with_client_identity(group.SerializeToString(), "agent-a")
    decoded = common_pb2.Group.FromString(raw)
    assert (decoded.group_id, decoded.producer_id) == ("agent-a/g1", "agent-a")
    decoded.group_id, decoded.producer_id = group.group_id, group.producer_id
    assert decoded == group  # nothing else changed
    record = wire.group_record(raw, 1 << 20)
    assert record.payload == raw and record.group_id == "agent-a/g1"
    assert wire.group_record_fast(raw, 1 << 20) is not None  # re-encoded canonically: the fast path reads it
    assert with_client_identity(b"\xff\xff", "agent-a") == b"\xff\xff"  # left for Put to refuse


# -- the port, in a real queue process -------------------------------------------------------------


def _queue(tmp_path: Path, tokens: str, groups_per_step: int = 2) -> ServiceProcess:
    (tmp_path / "tokens.yaml").write_text(tokens)
    settings = {
        "wal.dir": "wal",
        "groups_per_step": groups_per_step,
        "max_staleness": 1,
        "external.enabled": "true",
        "external.port": 0,
        "external.tokens_file": tmp_path / "tokens.yaml",
    }
    return ServiceProcess("queue", tmp_path, settings).start()


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    try:
        call(*args, timeout=5, **kwargs)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _metrics(
    proc: ServiceProcess, prefix: str = "tauflow_queue_external_"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.info['metrics_port']}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def _wait_for_waiting_reserves(proc: ServiceProcess, count: int) -> None:
    """Until ``count`` Reserves wait in line at the queue (a fixed sleep raced the calls' arrival under load)."""
    key = ("tauflow_queue_waiting_calls", (("method", "Reserve"),))
    deadline = time.monotonic() + 10
    while _metrics(proc, "tauflow_queue_waiting_calls").get(key) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metrics(proc, "tauflow_queue_waiting_calls").get(key) == count


def test_the_external_port_serves_producers_with_a_token_and_records_the_client(tmp_path: Path) -> None:
    # (a window of 16 groups: the external clients' share, 8, holds what they put and reserve here)
    proc = _queue(tmp_path, f"agent-a: {A_TOKEN}\nagent-b: {B_TOKEN}\n", groups_per_step=8)
    try:
        assert proc.info["external_port"] != proc.info["grpc_port"]
        external = grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}")
        stub = queue_pb2_grpc.QueueServiceStub(external)
        internal = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(proc.address))
        a = (("authorization", f"Bearer {A_TOKEN}"),)
        b = (("authorization", f"Bearer {B_TOKEN}"),)

        # Probes and the version check need no token.
        health = health_pb2_grpc.HealthStub(external).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        info = info_pb2_grpc.ServerInfoServiceStub(external).GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=5)
        assert info.role == "queue"

        # No token, an unknown one, another scheme: UNAUTHENTICATED, and nothing happens.
        assert _code(stub.Stats, q.StatsRequest()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "missing `authorization: Bearer <token>` metadata",
        )
        assert _code(
            stub.Put, q.PutRequest(group=make_group("sneaky")), metadata=(("authorization", f"Bearer {C_TOKEN}"),)
        ) == (grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not one of the queue's client tokens")
        assert _code(stub.Stats, q.StatsRequest(), metadata=(("authorization", f"Basic {A_TOKEN}"),))[0] == (
            grpc.StatusCode.UNAUTHENTICATED
        )

        # A producer's calls work; the queue records who put the group, whatever it claimed.
        assert stub.Stats(q.StatsRequest(), metadata=a, timeout=5).trainer_version == 0
        claimed = make_group("ext-1")
        claimed.producer_id = "agent-b"
        assert stub.Put(q.PutRequest(group=claimed), metadata=a, timeout=5).outcome == q.PUT_OUTCOME_ACCEPTED
        assert stub.Put(q.PutRequest(group=claimed), metadata=a, timeout=5).outcome == q.PUT_OUTCOME_DUPLICATE
        # Another client's group of the same id is its own group, not a duplicate that would be dropped.
        assert stub.Put(q.PutRequest(group=claimed), metadata=b, timeout=5).outcome == q.PUT_OUTCOME_ACCEPTED

        # Reservations: a client's request id is its own (a repeat is the same ticket, another client's
        # same id is not), and its ticket takes its put.
        t1 = stub.Reserve(q.ReserveRequest(request_id="r1", n_groups=1), metadata=a, timeout=5).ticket
        again = stub.Reserve(q.ReserveRequest(request_id="r1", n_groups=1), metadata=a, timeout=5).ticket
        other = stub.Reserve(q.ReserveRequest(request_id="r1", n_groups=1), metadata=b, timeout=5).ticket
        assert t1.ticket_id == again.ticket_id != other.ticket_id
        # A client can neither release another's ticket nor put on it.
        assert _code(stub.ReleaseReservation, q.ReleaseReservationRequest(ticket_id=t1.ticket_id), metadata=b) == (
            grpc.StatusCode.NOT_FOUND,
            f"ticket {t1.ticket_id!r} is unknown",
        )
        assert (
            stub.ReleaseReservation(
                q.ReleaseReservationRequest(ticket_id=other.ticket_id), metadata=b, timeout=5
            ).released_groups
            == 1
        )
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 1  # a's ticket is still held
        stub.Put(q.PutRequest(group=make_group("ext-b"), ticket_id=t1.ticket_id), metadata=b, timeout=5)
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 1  # b's put did not use it
        stub.Put(q.PutRequest(group=make_group("ext-2"), ticket_id=t1.ticket_id), metadata=a, timeout=5)
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 0
        # Used up, the ticket is still a's alone: b cannot tell it from a made-up one (it existed).
        assert _code(stub.ReleaseReservation, q.ReleaseReservationRequest(ticket_id=t1.ticket_id), metadata=b) == (
            grpc.StatusCode.NOT_FOUND,
            f"ticket {t1.ticket_id!r} is unknown",
        )
        released = stub.ReleaseReservation(q.ReleaseReservationRequest(ticket_id=t1.ticket_id), metadata=a, timeout=5)
        assert released.released_groups == 0

        # A malformed group: INVALID_ARGUMENT naming the field; nothing accepted.
        before = internal.Stats(q.StatsRequest(), timeout=5)
        bad = make_group("ext-bad")
        bad.samples[1].loss_mask.extend([True, False])
        code, details = _code(stub.Put, q.PutRequest(group=bad), metadata=a)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "samples[1].loss_mask has 2 entries for 8 completion tokens" in details
        # An id that fits the queue's 256 characters only without the client's prefix: refused naming both bounds
        # (it would have been refused as "longer than 256", an id the client never sent).
        long_id = make_group("x" * 249)  # "agent-a/": 248 characters are left
        code, details = _code(stub.Put, q.PutRequest(group=long_id), metadata=a)
        expected = (
            "group.group_id is 249 characters, longer than 248 (the limit of 256 less the client's prefix 'agent-a/')"
        )
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
        code, details = _code(stub.Reserve, q.ReserveRequest(request_id="r" * 249, n_groups=1), metadata=a)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id is 249 characters")
        after = internal.Stats(q.StatsRequest(), timeout=5)
        assert (after.accepted_groups, after.depth_groups) == (before.accepted_groups, before.depth_groups) == (4, 4)
        assert after.reserved_groups == before.reserved_groups

        # The external port can neither consume nor steer the training, even with a valid token.
        for method, request in [
            ("Get", q.GetRequest(max_groups=8)),
            ("Ack", q.AckRequest(lease_id="x")),
            ("Nack", q.NackRequest(lease_id="x")),
            ("RenewLease", q.RenewLeaseRequest(lease_id="x")),
            ("SetTrainerVersion", q.SetTrainerVersionRequest(policy_version=99)),
            ("SetMaxStaleness", q.SetMaxStalenessRequest(max_staleness=-1)),
            ("ReleaseProducerReservations", q.ReleaseProducerReservationsRequest(producer_id="agent-b")),
        ]:
            assert _code(getattr(stub, method), request, metadata=a)[0] == grpc.StatusCode.UNIMPLEMENTED, method
        stats = internal.Stats(q.StatsRequest(), timeout=5)
        assert (stats.trainer_version, stats.max_staleness) == (0, 1)

        delivered = internal.Get(q.GetRequest(consumer_id="trainer", max_groups=8), timeout=5)
        assert [(d.group.group_id, d.group.producer_id) for d in delivered.groups] == [
            ("agent-a/ext-1", "agent-a"),
            ("agent-b/ext-1", "agent-b"),
            ("agent-b/ext-b", "agent-b"),
            ("agent-a/ext-2", "agent-a"),
        ]

        metrics = _metrics(proc)
        put, rejected = "tauflow_queue_external_put_groups_total", "tauflow_queue_external_rejected_requests_total"
        assert metrics[(put, (("client", "agent-a"),))] == 2  # a duplicate is not a new group
        assert metrics[(put, (("client", "agent-b"),))] == 2
        assert metrics[(rejected, (("client", "unknown"), ("code", "UNAUTHENTICATED"), ("method", "Stats")))] == 2
        assert metrics[(rejected, (("client", "unknown"), ("code", "UNAUTHENTICATED"), ("method", "Put")))] == 1
        assert metrics[(rejected, (("client", "agent-a"), ("code", "INVALID_ARGUMENT"), ("method", "Put")))] == 2
        assert metrics[(rejected, (("client", "agent-a"), ("code", "INVALID_ARGUMENT"), ("method", "Reserve")))] == 1
        assert (
            metrics[(rejected, (("client", "agent-b"), ("code", "NOT_FOUND"), ("method", "ReleaseReservation")))] == 2
        )
        assert metrics[(rejected, (("client", "agent-a"), ("code", "UNIMPLEMENTED"), ("method", "other")))] == 7
    finally:
        proc.stop()


def test_a_producer_released_by_id_gives_back_its_tickets_and_its_waiting_reserves_get_none(tmp_path: Path) -> None:
    """On the internal port only: the tickets of a killed producer hold pacing room until their TTL; its
    successor releases them by producer id (the chaos run's stall, docs/reliability.md). A stopping rollout
    does the same after giving up on its waiting Reserves: one the queue has not yet seen cancelled must not
    be granted the room the release frees (no one would fill its ticket). Another producer's is."""
    proc = _queue(tmp_path, f"agent-a: {A_TOKEN}\n")
    try:
        internal = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(proc.address))
        for request_id in ("r1", "r2"):
            assert internal.Reserve(
                q.ReserveRequest(request_id=request_id, producer_id="rollout-0", n_groups=2), timeout=5
            ).granted
        full = internal.Reserve(q.ReserveRequest(request_id="r3", producer_id="rollout-0", n_groups=1), timeout=5)
        assert not full.granted  # (0 + 1 + 1) x 2 groups: the pacing limit
        wait = Duration(seconds=20)
        own, other = (
            internal.Reserve.future(
                q.ReserveRequest(request_id=request_id, producer_id=producer, n_groups=2, wait=wait), timeout=30
            )
            for request_id, producer in (("r4", "rollout-0"), ("s1", "rollout-1"))
        )
        _wait_for_waiting_reserves(proc, 2)  # both wait in line
        assert not own.done() and not other.done()
        released = internal.ReleaseProducerReservations(
            q.ReleaseProducerReservationsRequest(producer_id="rollout-0"), timeout=5
        )
        assert (released.released_tickets, released.released_groups) == (2, 4)
        assert not own.result(timeout=5).granted  # answered now, not after its 20 s
        assert other.result(timeout=5).granted
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 2  # rollout-1's ticket only
        assert internal.Reserve(
            q.ReserveRequest(request_id="r5", producer_id="rollout-0", n_groups=2), timeout=5
        ).granted  # the producer's next Reserve (its successor's) is granted as before
        assert _code(internal.ReleaseProducerReservations, q.ReleaseProducerReservationsRequest()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "producer_id must be set",
        )
    finally:
        proc.stop()


def test_external_clients_cannot_take_the_room_of_tauflows_own_producers(tmp_path: Path) -> None:
    """The hostile-client probe: one external client held every ticket of the pacing window (the rollout's
    Reserve got granted=False for the ticket TTL), or with tau = -1 the whole capacity with one Reserve; it could
    park any number of Reserves; and anyone could send 256 MiB messages to the port."""
    (tmp_path / "tokens.yaml").write_text(f"agent-a: {A_TOKEN}\nagent-b: {B_TOKEN}\n")
    settings = {
        "wal.dir": "wal",
        "groups_per_step": 8,
        "max_staleness": 1,  # a window of 16 groups: 8 for the external clients
        "capacity_groups": 1000,
        "max_group_bytes": 1 << 20,
        "external.enabled": "true",
        "external.port": 0,
        "external.tokens_file": tmp_path / "tokens.yaml",
        "external.max_waiting_reserves": 2,
    }
    proc = ServiceProcess("queue", tmp_path, settings).start()
    try:
        external = grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}")
        stub = queue_pb2_grpc.QueueServiceStub(external)
        internal = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(proc.address))
        a = (("authorization", f"Bearer {A_TOKEN}"),)
        b = (("authorization", f"Bearer {B_TOKEN}"),)

        held = 0
        while stub.Reserve(q.ReserveRequest(request_id=f"hog-{held}", n_groups=1), metadata=a, timeout=5).granted:
            held += 1
            assert held <= 16
        assert held == 8  # before: 16, every ticket of the window
        rollout = q.ReserveRequest(request_id="rollout-0/1", producer_id="rollout-0", n_groups=8)
        assert internal.Reserve(rollout, timeout=5).granted  # before: granted=False for 600 s
        # Over the share of the window at this tau: not granted now (it waits as any Reserve does; tau may rise).
        assert not stub.Reserve(q.ReserveRequest(request_id="big", n_groups=9), metadata=a, timeout=5).granted

        # A client's long polls: two wait (for 2 s), a third is answered at once.
        wait = Duration(seconds=2)
        parked = [
            stub.Reserve.future(q.ReserveRequest(request_id=f"w{i}", n_groups=1, wait=wait), metadata=b, timeout=10)
            for i in range(2)
        ]
        _wait_for_waiting_reserves(proc, 2)
        started = time.monotonic()
        code, details = _code(stub.Reserve, q.ReserveRequest(request_id="w2", n_groups=1, wait=wait), metadata=b)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "external.max_waiting_reserves" in details
        assert time.monotonic() - started < 1.5
        assert [f.result().granted for f in parked] == [False, False]

        # tau = -1: the capacity is the bound; a client holds at most external.max_reserved_groups (256).
        internal.SetMaxStaleness(q.SetMaxStalenessRequest(max_staleness=-1), timeout=5)
        for i in range(4):
            assert stub.Reserve(q.ReserveRequest(request_id=f"cap-{i}", n_groups=64), metadata=b, timeout=5).granted
        code, details = _code(stub.Reserve, q.ReserveRequest(request_id="cap-4", n_groups=1), metadata=b)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "external.max_reserved_groups=256" in details
        code, details = _code(stub.Reserve, q.ReserveRequest(request_id="hog", n_groups=500), metadata=a)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "external.max_reserve_groups=64" in details
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 8 + 8 + 256
        assert internal.Put(q.PutRequest(group=make_group("rollout-0/g0")), timeout=5).outcome == (
            q.PUT_OUTCOME_ACCEPTED
        )

        # Anonymous bytes: refused at their headers, before any of the message is read (it was read whole, up to
        # what the largest group needs, before the refusal).
        body = b"\x0a" + b"\x80\x80\x80\x01" + b"\x00" * (2 << 20)  # field 1, 2 MiB
        big = grpc.insecure_channel(
            f"127.0.0.1:{proc.info['external_port']}", options=[("grpc.max_send_message_length", 8 << 20)]
        )
        try:
            big.unary_unary("/tauflow.api.queue.v1.QueueService/Put")(body, timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
        else:
            raise AssertionError("a 2 MiB message was answered OK")
        metrics = _metrics(proc)
        rejected = "tauflow_queue_external_rejected_requests_total"
        assert metrics[(rejected, (("client", "agent-b"), ("code", "RESOURCE_EXHAUSTED"), ("method", "Reserve")))] == 2
    finally:
        proc.stop()


def test_a_client_added_to_the_tokens_file_is_admitted_without_a_restart(tmp_path: Path) -> None:
    proc = _queue(tmp_path, f"agent-a: {A_TOKEN}\nagent-b: {B_TOKEN}\n")
    try:
        stub = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}"))
        c = (("authorization", f"Bearer {C_TOKEN}"),)
        b = (("authorization", f"Bearer {B_TOKEN}"),)
        assert _code(stub.Stats, q.StatsRequest(), metadata=c)[0] == grpc.StatusCode.UNAUTHENTICATED
        (tmp_path / "tokens.yaml").write_text(f"agent-a: {A_TOKEN}\nagent-c: {C_TOKEN}\n")  # b revoked, c added
        deadline = time.monotonic() + 10
        while _code(stub.Stats, q.StatsRequest(), metadata=c)[0] != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the new token was never admitted"
            time.sleep(0.2)
        assert _code(stub.Stats, q.StatsRequest(), metadata=b)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert proc.proc is not None and proc.proc.poll() is None and proc.starts == 1
    finally:
        proc.stop()


def test_reflection_on_the_external_port_needs_no_token(tmp_path: Path) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha import reflection_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    proc = _queue(tmp_path, f"agent-a: {A_TOKEN}\n")
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}")
        database = ProtoReflectionDescriptorDatabase(channel)  # v1alpha, as grpcurl used to speak it
        assert "tauflow.api.queue.v1.QueueService" in set(database.get_services())
        put = DescriptorPool(database).FindServiceByName("tauflow.api.queue.v1.QueueService").FindMethodByName("Put")
        assert put.input_type.full_name == "tauflow.api.queue.v1.PutRequest"
        # v1 (current grpcurl and buf curl): the same messages under the v1 name
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        [answer] = list(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert "tauflow.api.queue.v1.QueueService" in {s.name for s in answer.list_services_response.service}
        # the producer's methods still need a token
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        assert _code(stub.Stats, q.StatsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.stop()


def test_external_puts_without_a_ticket_stop_at_the_external_share_also_after_a_restart(tmp_path: Path) -> None:
    """The hostile-client probe (round 5): one client's 20 Puts without a ticket filled the whole capacity (20
    groups), and the run's own rollout then got Reserve not granted and Put RESOURCE_EXHAUSTED. A Reserve that
    reused a request id with another n_groups was answered OK with the first, smaller ticket."""
    (tmp_path / "tokens.yaml").write_text(f"agent-a: {A_TOKEN}\nagent-b: {B_TOKEN}\n")
    settings = {
        "wal.dir": "wal",
        "capacity_groups": 20,
        "groups_per_step": 4,
        "max_staleness": 1,  # a window of 8 groups: 4 for the external clients
        "external.enabled": "true",
        "external.port": 0,
        "external.tokens_file": tmp_path / "tokens.yaml",
    }
    proc = ServiceProcess("queue", tmp_path, settings).start()
    a = (("authorization", f"Bearer {A_TOKEN}"),)
    b = (("authorization", f"Bearer {B_TOKEN}"),)
    try:
        stub = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}"))
        internal = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(proc.address))
        ticket = stub.Reserve(q.ReserveRequest(request_id="r", n_groups=1), metadata=b, timeout=5).ticket
        # The same request id with other content: refused naming it, changing nothing; an exact repeat is the same.
        code, details = _code(stub.Reserve, q.ReserveRequest(request_id="r", n_groups=5), metadata=b)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id 'agent-b/r' was already used" in details
        assert stub.Reserve(q.ReserveRequest(request_id="r", n_groups=1), metadata=b, timeout=5).ticket == ticket
        assert internal.Stats(q.StatsRequest(), timeout=5).reserved_groups == 1

        accepted = 0
        while True:
            try:
                stub.Put(q.PutRequest(group=make_group(f"g{accepted}")), metadata=a, timeout=5)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert error_reason(e) == "ERROR_REASON_QUEUE_FULL" and "external.reserved_share=0.5" in e.details()
                break
            accepted += 1
            assert accepted <= 20
        assert accepted == 3  # before: 20, the whole capacity (b's ticket holds the fourth)
        rollout = q.ReserveRequest(request_id="rollout-0/1", producer_id="rollout-0", n_groups=4)
        assert internal.Reserve(rollout, timeout=5).granted  # before: granted=False
        assert internal.Put(q.PutRequest(group=make_group("rollout-0/g0")), timeout=5).outcome == (
            q.PUT_OUTCOME_ACCEPTED  # before: RESOURCE_EXHAUSTED "queue is full"
        )

        proc.stop()  # a restart counts the same (from the log)
        proc.start()
        stub = queue_pb2_grpc.QueueServiceStub(grpc.insecure_channel(f"127.0.0.1:{proc.info['external_port']}"))
        code, details = _code(stub.Put, q.PutRequest(group=make_group("g3")), metadata=a)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "external.reserved_share" in details
        assert (
            stub.ReleaseReservation(
                q.ReleaseReservationRequest(ticket_id=ticket.ticket_id), metadata=b, timeout=5
            ).released_groups
            == 1
        )
        assert stub.Put(q.PutRequest(group=make_group("g3")), metadata=a, timeout=5).outcome == q.PUT_OUTCOME_ACCEPTED
    finally:
        proc.stop()
