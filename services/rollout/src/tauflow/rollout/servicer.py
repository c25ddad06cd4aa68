"""The rollout service's gRPC layer: Generate for outside programs, status, and the weight-receiving
control plane the sidecar drives (SGLang's init_weights_update_group / update_weights_from_distributed)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from tauflow.api.common.v1 import common_pb2
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.api.weights.v1 import weights_pb2, weights_pb2_grpc
from tauflow.core.protobuf import seconds
from tauflow.core.telemetry import set_error, span_context_of, traceparent_of
from tauflow.rollout.convert import sample_to_proto, sampling_from_proto
from tauflow.rollout.engine.base import EngineClosedError, GenerationEngine, InvalidRequestError, WeightUpdateError
from tauflow.rollout.producer import Producer
from tauflow.weightsync import (
    ChecksumMismatch,
    PhaseError,
    ReceivedVersion,
    ReceiveError,
    WeightReceiver,
)
from tauflow.weightsync.wire import bucket_request_from_proto, group_spec_from_proto

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tauflow.rollout")
_RECEIVE_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
}


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server: completions per call, calls at once, and the longest wait."""

    max_n: int = 64
    max_in_flight: int = 64
    max_wait_s: float = 600.0


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        server_id: str,
        engine: GenerationEngine,
        encode,  # type: ignore[no-untyped-def]
        decode,  # type: ignore[no-untyped-def]
        default_max_new_tokens: int,
        sidecar: weights_pb2_grpc.WeightsServiceStub | None,
        producer: Producer | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.limits = limits
        # The receiver's calls are serialized by its lock and may block for a whole rendezvous: on a thread of
        # their own they never take the default pool's threads, which Generate's waits need.
        self._weights_thread = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self.server_id = server_id
        self.engine = engine
        self.encode = encode
        self.decode = decode
        self.default_max_new_tokens = default_max_new_tokens
        self.sidecar = sidecar
        self.producer = producer
        self.receiver = WeightReceiver(label=server_id)
        self._checksum_algorithms: dict[tuple[int, str], str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._load_started: dict[tuple[int, int], int] = {}  # (version, epoch) -> first bucket's time, ns
        self.in_flight = 0

    # -- data plane ------------------------------------------------------------------------

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        if bool(request.prompt_token_ids) == bool(request.prompt_text):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of prompt_token_ids and prompt_text")
        if request.sampling.stop:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop (stop strings) is not supported yet")
        if request.prompt_text and self.encode is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_text needs a model with a tokenizer")
        if request.sampling.n > self.limits.max_n:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"sampling.n {request.sampling.n} is over this server's maximum of {self.limits.max_n}")
        if self.in_flight >= self.limits.max_in_flight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.in_flight} Generate calls in flight, this server's maximum")
        prompt = list(request.prompt_token_ids) or self.encode(request.prompt_text)
        started = time.monotonic()
        self.in_flight += 1
        try:
            params = sampling_from_proto(request.sampling, self.default_max_new_tokens)
            if self.engine.policy_version < request.min_policy_version:
                remaining = min(context.time_remaining() or self.limits.max_wait_s, self.limits.max_wait_s)
                ok = await asyncio.to_thread(self.engine.wait_for_version, request.min_policy_version, remaining)
                if not ok:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "min_policy_version not reached in time")
            queued = time.monotonic()
            [completions] = await self.engine.generate([prompt], params)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineClosedError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            self.in_flight -= 1
        resp = rollout_pb2.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            samples=[sample_to_proto(i, prompt, c, self.decode(c.token_ids)) for i, c in enumerate(completions)],
            engine_id=self.engine.stats().engine_id,
        )
        resp.queue_duration.FromNanoseconds(int((queued - started) * 1e9))
        resp.generation_duration.FromNanoseconds(int((time.monotonic() - queued) * 1e9))
        return resp

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        s = self.engine.stats()
        group = self.receiver.group
        engine = rollout_pb2.EngineStatus(
            engine_id=s.engine_id, backend=s.backend, model=s.model, state=int(s.state),
            policy_version=s.policy_version, in_flight_requests=s.in_flight_requests,
            running_sequences=s.running_sequences, waiting_sequences=s.waiting_sequences,
            last_error=s.last_error or "", num_ranks=1,
        )
        receiving = self.receiver.receiving_version
        if receiving is not None:
            engine.weight_update_in_progress = True
            engine.receiving_policy_version = receiving
        return rollout_pb2.GetStatusResponse(
            server_id=self.server_id, engines=[engine], in_flight_requests=self.in_flight,
            in_flight_groups=self.producer.groups_in_flight if self.producer else 0,
            groups_produced=self.producer.groups_produced if self.producer else 0,
            membership_epoch=group.spec.membership_epoch if group else 0,
            weights_group_name=group.name if group else "",
        )

    # -- weights -----------------------------------------------------------------------------

    async def _refuse(self, context, err: Exception) -> None:  # type: ignore[no-untyped-def]
        if isinstance(err, ReceiveError):
            code = _RECEIVE_STATUS[err.kind]
        elif isinstance(err, PhaseError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED if err.timed_out else grpc.StatusCode.ABORTED
        elif isinstance(err, (ChecksumMismatch,)):
            code = grpc.StatusCode.DATA_LOSS
        else:
            code = grpc.StatusCode.INVALID_ARGUMENT
        await context.abort(code, str(err))

    async def _on_weights_thread(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._weights_thread, fn, *args)

    async def InitWeightsUpdateGroup(self, request, context):  # type: ignore[no-untyped-def]
        if request.HasField("timeout") and not 0 < seconds(request.timeout) <= self.limits.max_wait_s:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"timeout must be positive and at most {self.limits.max_wait_s:g}s")
        spec = group_spec_from_proto(request, default_timeout_s=min(60.0, self.limits.max_wait_s))
        try:
            n = await self._on_weights_thread(self.receiver.init_group, spec)
        except (ReceiveError, PhaseError) as e:
            await self._refuse(context, e)
        return rollout_pb2.InitWeightsUpdateGroupResponse(num_ranks=n)

    async def _checksum_algorithm(self, version: int, checksum: str) -> str:
        key = (version, checksum)
        if key not in self._checksum_algorithms and self.sidecar is not None:
            resp = await self.sidecar.GetManifest(weights_pb2.GetManifestRequest(policy_version=version))
            self._checksum_algorithms[key] = resp.manifest.checksum_algorithm
        return self._checksum_algorithms.get(key, "")

    async def UpdateWeightsFromDistributed(self, request, context):  # type: ignore[no-untyped-def]
        key = (request.policy_version, request.membership_epoch)
        self._load_started.setdefault(key, time.time_ns())
        version = None
        try:
            bucket = bucket_request_from_proto(
                request, await self._checksum_algorithm(request.policy_version, request.manifest_checksum)
            )
            version = await self._on_weights_thread(self.receiver.receive_bucket, bucket)
            if version is not None:
                # Swapped in at the engine's next safe point, between two decoding steps (a re-base drops
                # what was staged after it: see stage_broadcast).
                await asyncio.wrap_future(self.engine.stage_broadcast(version.policy_version, version.tensors))
        except (ReceiveError, PhaseError, ChecksumMismatch, WeightUpdateError) as e:
            self._load_span(request, None, e)
            await self._refuse(context, e)
        if version is not None:
            load_context = self._load_span(request, version)
            task = asyncio.get_running_loop().create_task(self._confirm(version, load_context))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return rollout_pb2.UpdateWeightsFromDistributedResponse(
            policy_version=request.policy_version, bucket_index=request.bucket_index,
            version_complete=version is not None,
        )

    def _load_span(
        self, request, version: ReceivedVersion | None, error: BaseException | None = None  # type: ignore[no-untyped-def]
    ) -> common_pb2.TraceContext:
        """Records ``weights.load`` (first bucket received -> version swapped in, or the failure) with a
        link to the trainer's ``weights.publish`` of the version; returns its trace context."""
        key = (request.policy_version, request.membership_epoch)
        started = self._load_started.pop(key, None) or time.time_ns()
        for k in [k for k in self._load_started if k[0] <= key[0]]:  # older or failed versions' leftovers
            del self._load_started[k]
        publish = span_context_of(request.trace_context.traceparent, request.trace_context.tracestate)
        span = tracer.start_span(
            "weights.load", start_time=started, links=[trace.Link(publish)] if publish is not None else [],
            attributes={"rl.policy_version": request.policy_version, "weights.member_id": self.server_id,
                        "weights.membership_epoch": request.membership_epoch,
                        "weights.buckets": request.bucket_count},
        )
        if version is not None:
            span.set_attribute("weights.bytes", version.nbytes)
        if error is not None:
            set_error(span, error)
        span.end()
        traceparent, tracestate = traceparent_of(span)
        return common_pb2.TraceContext(traceparent=traceparent, tracestate=tracestate)

    async def _confirm(self, v: ReceivedVersion, load_context: common_pb2.TraceContext | None = None) -> None:
        if self.sidecar is None:
            return
        request = weights_pb2.ConfirmVersionRequest(
            member_id=self.server_id, policy_version=v.policy_version, manifest_checksum=v.manifest_checksum,
            loaded_checksum=v.loaded_checksum, membership_epoch=v.membership_epoch, trace_context=load_context,
        )
        request.load_duration.FromNanoseconds(int(v.load_duration_s * 1e9))
        try:
            await self.sidecar.ConfirmVersion(request)
        except grpc.aio.AioRpcError as e:
            log.warning("confirm failed", extra={"version": v.policy_version, "code": e.code().name})

    async def DestroyWeightsUpdateGroup(self, request, context):  # type: ignore[no-untyped-def]
        try:
            destroyed = await self._on_weights_thread(self.receiver.destroy_group, request.group_name)
        except ReceiveError as e:
            await self._refuse(context, e)
        return rollout_pb2.DestroyWeightsUpdateGroupResponse(destroyed=destroyed)
