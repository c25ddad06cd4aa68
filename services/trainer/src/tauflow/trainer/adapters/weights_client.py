"""The trainer's side of the weight sidecar (implements ports.PublisherPort): stage the tensors in shared
memory, then Publish. Returns once the sidecar has copied them, so the trainer blocks only for two local
copies."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.channel import create_channel
from tauflow.core.config import ChannelConfig
from tauflow.core.telemetry import traceparent_of
from tauflow.trainer.adapters.retry import until_it_works
from tauflow.weightsync import Stager
from tauflow.weightsync.wire import manifest_to_proto


class SidecarPublisher:
    def __init__(self, address: str, channel: ChannelConfig, model: str = "") -> None:
        self.channel = create_channel(address, [weights_pb2.DESCRIPTOR.services_by_name["WeightsService"]], channel)
        self.stub = weights_pb2_grpc.WeightsServiceStub(self.channel)
        self.stager = Stager(model=model)

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor], rebase: bool = False) -> None:
        manifest = await asyncio.to_thread(self.stager.stage, tensors, version)
        request = weights_pb2.PublishRequest(
            manifest=manifest_to_proto(manifest), staging_uri=self.stager.uri, rebase=rebase
        )
        # The current span is the loop's `weights.publish`: the sidecar's `weights.broadcast` links to it.
        traceparent, tracestate = traceparent_of()
        request.trace_context.traceparent, request.trace_context.tracestate = traceparent, tracestate
        async for attempt in until_it_works():
            with attempt:
                await self.stub.Publish(request)

    async def close(self) -> None:
        self.stager.close()
        await self.channel.close()
