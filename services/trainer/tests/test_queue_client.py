"""The trainer's queue client against a real gRPC queue stand-in: a queue whose disk is full (RESOURCE_EXHAUSTED,
as its write-ahead log answers then) is waited out, not a reason to exit (the trainer crash-looped on it)."""

from __future__ import annotations

import grpc
import pytest

from tauflow.api.queue.v1 import queue_pb2, queue_pb2_grpc
from tauflow.core.config import ChannelConfig
from tauflow.trainer.adapters.queue_client import GrpcQueue

FULL = "the queue's disk is full: retry when space comes back"


class FullDiskQueue(queue_pb2_grpc.QueueServiceServicer):
    """Answers each method RESOURCE_EXHAUSTED ``full_for`` times, then as a queue with nothing to give."""

    def __init__(self, full_for: int) -> None:
        self.full_for = full_for
        self.calls: list[str] = []

    async def _full(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append(method)
        if self.calls.count(method) <= self.full_for:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, FULL)

    async def Get(self, request, context):
        await self._full("Get", context)
        return queue_pb2.GetResponse()

    async def Deliver(self, request_iterator, context):  # (the client falls back to Get)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Deliver")

    async def Ack(self, request, context):
        await self._full("Ack", context)
        return queue_pb2.AckResponse(acked_groups=1)

    async def SetTrainerVersion(self, request, context):
        await self._full("SetTrainerVersion", context)
        return queue_pb2.SetTrainerVersionResponse()


async def test_a_queue_whose_disk_is_full_is_waited_out(caplog: pytest.LogCaptureFixture) -> None:
    server = grpc.aio.server()
    queue = FullDiskQueue(full_for=2)
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcQueue(f"127.0.0.1:{port}", "trainer", ChannelConfig(default_timeout_s=5))
    try:
        assert await client.get_batch(2, 0, wait_s=0.1, lease_s=10) is None  # full: nothing this time, no error
        await client.ack("lease-1")  # retried until the disk has room again
        await client.set_version(3)
        assert queue.calls.count("Ack") == 3 and queue.calls.count("SetTrainerVersion") == 3
        assert FULL in caplog.text  # the wait is in the log, one line a retry (not a five-line repr of "<unknown>")
        retries = [r for r in caplog.records if r.getMessage().startswith("peer call failed (RESOURCE_EXHAUSTED")]
        assert len(retries) == 4 and "<unknown>" not in caplog.text and "\n" not in retries[0].getMessage()
    finally:
        await client.close()
        await server.stop(0)


async def test_a_batch_over_the_channels_message_limit_is_an_error_not_a_wait() -> None:
    # gRPC answers RESOURCE_EXHAUSTED too for a message over the channel's limit: it never fits, so retrying it
    # would lease and lose batch after batch (the queue's own limit above the trainer's).
    class BigBatchQueue(queue_pb2_grpc.QueueServiceServicer):
        async def Get(self, request, context):
            group = queue_pb2.DeliveredGroup()
            group.group.group_id = "g" * 200_000
            return queue_pb2.GetResponse(groups=[group])

    server = grpc.aio.server()
    queue_pb2_grpc.add_QueueServiceServicer_to_server(BigBatchQueue(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcQueue(f"127.0.0.1:{port}", "trainer", ChannelConfig(default_timeout_s=5, max_message_bytes=64 * 1024))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.get_batch(2, 0, wait_s=0.1, lease_s=10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await client.close()
        await server.stop(0)


async def test_a_queue_that_lost_the_trainers_version_is_told_it_again() -> None:
    # A power cut under wal.fsync interval can lose the queue's last SetTrainerVersion; its Get then refuses
    # the trainer's consumer_version as from the future (FAILED_PRECONDITION). The trainer sets it again.
    class BehindQueue(queue_pb2_grpc.QueueServiceServicer):
        def __init__(self) -> None:
            self.version = 2
            self.set_to: list[int] = []

        async def Deliver(self, request_iterator, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Deliver")

        async def Get(self, request, context):
            if request.consumer_version > self.version:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"consumer_version {request.consumer_version} is above the trainer's version {self.version}",
                )
            return queue_pb2.GetResponse()

        async def SetTrainerVersion(self, request, context):
            self.version = request.policy_version
            self.set_to.append(request.policy_version)
            return queue_pb2.SetTrainerVersionResponse()

    server = grpc.aio.server()
    queue = BehindQueue()
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcQueue(f"127.0.0.1:{port}", "trainer", ChannelConfig(default_timeout_s=5))
    try:
        assert await client.get_batch(2, 5, wait_s=0.1, lease_s=10) is None
        assert queue.set_to == [5]
        assert await client.get_batch(2, 5, wait_s=0.1, lease_s=10) is None and queue.set_to == [5]
    finally:
        await client.close()
        await server.stop(0)


async def test_a_group_the_trainer_cannot_take_is_skipped_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    # A group without behaviour log-probs (a queue of an earlier build took it): converting it raised, which
    # ended the trainer, and each restart was handed it again until the run failed (one external Put did it).
    from tauflow.core.testing import make_group

    class PoisonQueue(queue_pb2_grpc.QueueServiceServicer):
        async def Deliver(self, request_iterator, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Deliver")

        async def Get(self, request, context):
            poison = make_group("poison")
            del poison.samples[0].behaviour_logprobs[:]
            return queue_pb2.GetResponse(
                lease=queue_pb2.Lease(lease_id="L"),
                groups=[queue_pb2.DeliveredGroup(group=g) for g in (make_group("a"), poison, make_group("b"))],
            )

    server = grpc.aio.server()
    queue_pb2_grpc.add_QueueServiceServicer_to_server(PoisonQueue(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcQueue(f"127.0.0.1:{port}", "trainer", ChannelConfig(default_timeout_s=5))
    try:
        # (None is "ask again", as the trainer's loop does: under load the first call, the Deliver stream this
        # queue refuses, was once answered as a transient failure before the client fell back to Get)
        batch = None
        for _ in range(5):
            if (batch := await client.get_batch(3, 0, wait_s=0.1, lease_s=10)) is not None:
                break
        assert batch is not None and [g.group_id for g in batch.groups] == ["a", "b"] and batch.lease_id == "L"
        assert len(batch.trace_contexts) == 2
        assert batch.invalid == {"poison": "sample '0': 0 behaviour log-probs for 8 completion tokens"}
        assert "group skipped: the trainer cannot take it" in caplog.text
    finally:
        await client.close()
        await server.stop(0)
