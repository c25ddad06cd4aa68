"""FAKE rollout server, for the sidecar's tests only — not the rollout service.

A real gRPC server that implements the weight-receiving RPCs of RolloutService
(InitWeightsUpdateGroup, UpdateWeightsFromDistributed, DestroyWeightsUpdateGroup, and a
minimal GetStatus) with ``tauflow.weightsync.WeightReceiver`` over gloo, for real. It
Joins the sidecar at start, keeps every version it receives (``--out``:
``<member>-v<version>.pt``; ``--discard``: in memory only), calls ConfirmVersion after the last bucket, and Leaves on
SIGTERM. It generates nothing. The real rollout service wires the same receiver.

``python fake_rollout.py --sidecar HOST:PORT --member-id ID --out DIR --ready-file F``
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import torch

from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.files import write_atomic
from tauflow.weightsync import (
    ChecksumMismatch,
    PhaseError,
    ReceivedVersion,
    ReceiveError,
    SharedReader,
    WeightReceiver,
)
from tauflow.weightsync.wire import bucket_request_from_proto, group_spec_from_proto, shared_request_from_proto

_KINDS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
}


def _seconds(d) -> float:
    return d.seconds + d.nanos / 1e9


class FakeRollout(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self, member_id: str, out: Path, sidecar: weights_pb2_grpc.WeightsServiceStub, keep: bool = True
    ) -> None:
        self.member_id = member_id
        self.keep = keep
        self.out = out
        self.sidecar = sidecar
        self.receiver = WeightReceiver(label=member_id)
        self.shared_reader = SharedReader(label=member_id)
        self.algorithms: dict[tuple[int, str], str] = {}
        self.served_version: int | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def _abort(self, context, err: Exception) -> None:
        if isinstance(err, ReceiveError):
            code = _KINDS[err.kind]
        elif isinstance(err, PhaseError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED if err.timed_out else grpc.StatusCode.ABORTED
        elif isinstance(err, ChecksumMismatch):
            code = grpc.StatusCode.DATA_LOSS
        else:
            code = grpc.StatusCode.INTERNAL
        await context.abort(code, str(err))

    async def InitWeightsUpdateGroup(self, request, context):
        spec = group_spec_from_proto(request)
        try:
            n = await asyncio.to_thread(self.receiver.init_group, spec)
        except (ReceiveError, PhaseError) as e:
            await self._abort(context, e)
        return rollout_pb2.InitWeightsUpdateGroupResponse(num_ranks=n)

    async def _algorithm(self, version: int, checksum: str) -> str:
        key = (version, checksum)
        if key not in self.algorithms:
            resp = await self.sidecar.GetManifest(weights_pb2.GetManifestRequest(policy_version=version), timeout=10)
            self.algorithms[key] = resp.manifest.checksum_algorithm
        return self.algorithms[key]

    async def UpdateWeightsFromDistributed(self, request, context):
        if os.environ.get("FAKE_ROLLOUT_STALL") == "1":
            await asyncio.sleep(3600)  # a server that never posts its receives
        if os.environ.get("FAKE_ROLLOUT_EXIT") == "1":
            os._exit(1)  # a server that dies as a transfer starts (after the sidecar's probe)
        if os.environ.get("FAKE_ROLLOUT_REFUSE") == "1":  # a server that refuses every bucket, posting nothing
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused (FAKE_ROLLOUT_REFUSE)")
        try:
            req = bucket_request_from_proto(
                request, await self._algorithm(request.policy_version, request.manifest_checksum)
            )
            version = await asyncio.to_thread(self.receiver.receive_bucket, req)
        except (ReceiveError, PhaseError, ChecksumMismatch) as e:
            await self._abort(context, e)
        if version is not None:
            if self.keep:
                await asyncio.to_thread(self._keep, version)
            task = asyncio.get_running_loop().create_task(self._confirm(version))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return rollout_pb2.UpdateWeightsFromDistributedResponse(
            policy_version=request.policy_version,
            bucket_index=request.bucket_index,
            version_complete=version is not None,
        )

    async def UpdateWeightsFromTensor(self, request, context):
        """The sidecar's ipc backend: the version read whole from the trainer's shared buffer (as the real
        rollout service's WeightLoader.load_shared does, minus the engine)."""
        try:
            version = await asyncio.to_thread(self.shared_reader.read, shared_request_from_proto(request))
        except (ReceiveError, ChecksumMismatch) as e:
            await self._abort(context, e)
        if self.keep:
            await asyncio.to_thread(self._keep, version)
        task = asyncio.get_running_loop().create_task(self._confirm(version))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return rollout_pb2.UpdateWeightsFromTensorResponse(policy_version=version.policy_version)

    def _keep(self, v: ReceivedVersion) -> None:
        tensors = {k: t.clone() for k, t in v.tensors.items()}
        data = io.BytesIO()
        torch.save(
            {"tensors": tensors, "loaded_checksum": v.loaded_checksum, "membership_epoch": v.membership_epoch}, data
        )
        write_atomic(self.out / f"{self.member_id}-v{v.policy_version}.pt", data.getvalue())

    async def _confirm(self, v: ReceivedVersion) -> None:
        self.served_version = v.policy_version  # the "swap at a safe point"
        req = weights_pb2.ConfirmVersionRequest(
            member_id=self.member_id,
            policy_version=v.policy_version,
            manifest_checksum=v.manifest_checksum,
            loaded_checksum=v.loaded_checksum,
            membership_epoch=v.membership_epoch,
        )
        req.load_duration.FromNanoseconds(int(v.load_duration_s * 1e9))
        if os.environ.get("FAKE_ROLLOUT_FORGET_GROUP") == "1":
            # a server that leaves its weight group (its connections close) once it confirmed, but still answers
            await asyncio.to_thread(self.receiver.reset)
        await self.sidecar.ConfirmVersion(req, timeout=10)

    async def DestroyWeightsUpdateGroup(self, request, context):
        try:
            destroyed = await asyncio.to_thread(self.receiver.destroy_group, request.group_name)
        except ReceiveError as e:
            await self._abort(context, e)
        return rollout_pb2.DestroyWeightsUpdateGroupResponse(destroyed=destroyed)

    async def GetStatus(self, request, context):
        g = self.receiver.group
        return rollout_pb2.GetStatusResponse(
            server_id=self.member_id,
            membership_epoch=g.spec.membership_epoch if g else 0,
            weights_group_name=g.name if g else "",
        )


async def serve(args: argparse.Namespace) -> None:
    channel = create_channel(args.sidecar, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]])
    sidecar = weights_pb2_grpc.WeightsServiceStub(channel)
    fake = FakeRollout(args.member_id, Path(args.out), sidecar, keep=not args.discard)
    server = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await sidecar.Join(
        weights_pb2.JoinRequest(
            member_id=args.member_id,
            address=f"127.0.0.1:{port}",
            num_ranks=1,
            backends=["gloo", "ipc"],
            model=args.model,
        ),
        timeout=10,
    )
    write_atomic(args.ready_file, json.dumps({"grpc_port": port, "pid": os.getpid()}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await sidecar.Leave(weights_pb2.LeaveRequest(member_id=args.member_id, reason="shutdown"), timeout=5)
    await server.stop(1)
    await channel.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sidecar", required=True)
    ap.add_argument("--member-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (a restarted server reuses its port)")
    ap.add_argument("--discard", action="store_true", help="keep received versions in memory only (benchmarks)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
