"""The trainer's side of the weight sidecar (implements ports.PublisherPort): stage the tensors, then Publish.

Where the sidecar broadcasts (gloo, nccl) the tensors are staged in shared memory and Publish returns once the
sidecar has copied them, so the trainer blocks only for two local copies. Where it is colocated (the sidecar's
``ipc`` backend) they are staged on the trainer's own device (``DeviceStager``, two alternating buffers) and
Publish passes the buffer's ``ipc://`` URI on: the engines on this machine copy it device to device."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
import torch

from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.core.telemetry import traceparent_of
from tauflow.trainer.adapters.retry import until_it_works
from tauflow.weightsync import Manifest, Stager
from tauflow.weightsync.ipc import DeviceStager
from tauflow.weightsync.wire import manifest_to_proto

SIDECAR_STATUS_TIMEOUT_S = 5.0  # (asked while the trainer waits for data: a hung sidecar must not hold that)


class SidecarPublisher:
    def __init__(self, address: str, channel: ChannelConfig, model: str = "", device: str = "cpu") -> None:
        self.channel = create_channel(address, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]], channel)
        self.stub = weights_pb2_grpc.WeightsServiceStub(self.channel)
        self.model = model
        self.device = device
        self.stager: Stager | None = None  # made on first use: the sidecar's backend says which
        self.device_stager: DeviceStager | None = None
        self.sidecar_backend: str | None = None  # asked once; again after a refused Publish

    async def _stage(self, version: int, tensors: Mapping[str, torch.Tensor]) -> tuple[Manifest, str]:
        if self.sidecar_backend is None:
            async for attempt in until_it_works():
                with attempt:
                    self.sidecar_backend = (await self.stub.GetStatus(weights_pb2.GetStatusRequest())).backend
        if self.sidecar_backend == "ipc":
            if self.device_stager is None:
                self.device_stager = DeviceStager(self.device, model=self.model)
            return await asyncio.to_thread(self.device_stager.stage, tensors, version)
        if self.stager is None:
            self.stager = Stager(model=self.model)
        manifest = await asyncio.to_thread(self.stager.stage, tensors, version)
        return manifest, self.stager.uri

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> None:
        manifest, staging_uri = await self._stage(version, tensors)
        request = weights_pb2.PublishRequest(
            manifest=manifest_to_proto(manifest), staging_uri=staging_uri, rebase=rebase
        )
        # The current span is the loop's `weights.publish`: the sidecar's `weights.broadcast` links to it.
        traceparent, tracestate = traceparent_of()
        request.trace_context.traceparent, request.trace_context.tracestate = traceparent, tracestate
        try:
            async for attempt in until_it_works():
                with attempt:
                    await self.stub.Publish(request)
        except grpc.aio.AioRpcError:
            self.sidecar_backend = None  # (a sidecar restarted with another backend refuses the other URI)
            raise

    async def latest_version(self) -> int | None:
        try:
            status = await self.stub.GetStatus(weights_pb2.GetStatusRequest(), timeout=SIDECAR_STATUS_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise ConnectionError(f"the weight sidecar: {e.code().name}") from e
        return status.latest_policy_version if status.HasField("latest_policy_version") else None

    async def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        await self.channel.close()
