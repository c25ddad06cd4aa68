"""The rollout service's gRPC layer: Generate for outside programs, status, and the weight-receiving
control plane the sidecar drives (SGLang's init_weights_update_group / update_weights_from_distributed),
which ``tauflow.rollout.weights.WeightLoader`` serves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NoReturn

import grpc
import torch

from tauflow import media
from tauflow.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from tauflow.core.protobuf import seconds
from tauflow.core.threads import started_executor
from tauflow.media import wire as media_wire
from tauflow.media.dataset import checked_messages
from tauflow.models.processor import Processed
from tauflow.rollout.adapters.convert import engine_status_to_proto, sample_to_proto, sampling_from_proto
from tauflow.rollout.config import RolloutConfig
from tauflow.rollout.engine.base import (
    EngineClosedError,
    EngineUnavailableError,
    GenerationEngine,
    InvalidRequestError,
    ScoredSequence,
)
from tauflow.rollout.ports import SidecarUnavailable
from tauflow.rollout.producer import Producer
from tauflow.rollout.text import ChatTemplateError, PromptTooLong, TextCodec
from tauflow.rollout.weights import LOAD_ERRORS, GroupBuildBusy, LoadExpired, WeightLoader
from tauflow.weightsync import ChecksumMismatch, PhaseError, ReceiveError
from tauflow.weightsync.wire import bucket_request_from_proto, group_spec_from_proto, shared_request_from_proto

_RECEIVE_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
}


def _refusal_code(err: Exception) -> grpc.StatusCode:
    if isinstance(err, ReceiveError):
        return _RECEIVE_STATUS[err.kind]
    if isinstance(err, PhaseError):
        return grpc.StatusCode.DEADLINE_EXCEEDED if err.timed_out else grpc.StatusCode.ABORTED
    if isinstance(err, ChecksumMismatch):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(err, LoadExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INVALID_ARGUMENT  # WeightUpdateError: a version the engine refuses


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a ``time.monotonic()`` instant; None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Ends the call with ``code`` (``context.abort`` raises; grpc has no type stubs to say so)."""
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


MAX_CHAT_CHARS = 1 << 18  # prompt_messages: their content in all (as prompt_text's bound)
MAX_SCORE_SEQUENCES = 4096  # ComputeLogprobs: sequences per call (the contract's bound)
# prompt_text, or prompt_messages' content in all, over this many characters is tokenized on the long texts'
# thread; shorter ones on their own two (tokenizing 4096 characters takes 10 ms at most on a byte-level BPE)
LONG_TEXT_CHARS = 4096


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        config: RolloutConfig,
        engine: GenerationEngine,
        weights: WeightLoader,
        producer: Producer | None,
        codec: TextCodec | None,
        processor: Callable[[list[media.PromptPart]], Processed] | None = None,
    ) -> None:
        # max_n, max_in_flight, max_version_waiters, max_version_lead, max_wait_s: what one client may ask of the server
        self.config = config
        self.engine = engine
        self.weights = weights
        self.producer = producer
        self.codec = codec  # None: a model folder without a tokenizer takes and gives token ids only
        self.processor = processor  # a multimodal model's (prompt_parts); None: a text model
        self.in_flight = 0  # Generate and ComputeLogprobs calls holding one of max_in_flight's slots
        # Generate calls admitted to wait for their min_policy_version: they hold no slot of max_in_flight (a
        # caller that asks for a version that never comes would otherwise keep every other caller out for
        # max_wait_s), but one of max_version_waiters' own, and take a slot once their version is loaded
        self.version_waiters = 0
        # Tokenizing takes CPU time in proportion to the text: on threads of its own, never the default pool's
        # (which min_policy_version's waits and media decoding use), and a long text on one thread of its own, so
        # that long texts (262,144 characters: 0.56 s each) never hold up short ones, and use one core at most.
        # Started now: a thread that cannot start mid-run (memory short for a moment) leaves its call waiting.
        self._tokenize = started_executor(2, "tokenize")
        self._tokenize_long = started_executor(1, "tokenize-long")

    def close(self) -> None:
        """Lets the tokenizing threads go (at the service's end)."""
        for pool in (self._tokenize, self._tokenize_long):
            pool.shutdown(wait=False, cancel_futures=True)

    # -- data plane ------------------------------------------------------------------------

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        forms = (request.prompt_token_ids, request.prompt_text, request.prompt_parts, request.prompt_messages)
        if sum(map(bool, forms)) != 1:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "set exactly one of prompt_token_ids, prompt_text, prompt_parts and prompt_messages",
            )
        parts: list[media.PromptPart] = []
        if request.prompt_parts:
            try:
                parts = media_wire.checked_parts(request.prompt_parts)
            except media.InvalidMedia as e:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if self.processor is None:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt_parts needs a multimodal model")
        if (request.prompt_text or request.prompt_messages) and self.codec is None:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "prompt_text and prompt_messages need a model with a tokenizer",
            )
        messages: list[dict[str, str]] = []
        if request.prompt_messages:
            try:
                messages = checked_messages(
                    [{"role": m.role, "content": m.content} for m in request.prompt_messages], "prompt_messages"
                )
            except ValueError as e:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            assert self.codec is not None  # refused above
            if not self.codec.has_chat_template:
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "prompt_messages: the model's tokenizer has no chat template",
                )
        if request.sampling.n > self.config.max_n:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sampling.n {request.sampling.n} is over this server's maximum of {self.config.max_n}",
            )
        ahead = request.min_policy_version - self.engine.policy_version
        if ahead > self.config.max_version_lead:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"min_policy_version {request.min_policy_version} is {ahead} versions ahead of this server's "
                f"version {self.engine.policy_version}, more than its max_version_lead of "
                f"{self.config.max_version_lead}: it has not loaded that version (call again later)",
            )
        waits = ahead > 0  # (counted against max_version_waiters until its version is loaded)
        if waits and self.version_waiters >= self.config.max_version_waiters:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.version_waiters} Generate calls waiting for a min_policy_version, this server's "
                f"max_version_waiters",
            )
        if not waits and self.in_flight >= self.config.max_in_flight:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.in_flight} Generate calls in flight, this server's maximum",
            )
        if sum(len(m["content"]) for m in messages) > MAX_CHAT_CHARS:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_messages: over {MAX_CHAT_CHARS} characters of content in all",
            )
        prompt = list(request.prompt_token_ids)
        started = time.monotonic()
        # from here: tokenizing counts too
        if waits:
            self.version_waiters += 1
        else:
            self.in_flight += 1
        inputs = None
        try:
            params = sampling_from_proto(request.sampling, self.config.sampling.max_new_tokens)
            if request.prompt_text or messages:
                assert self.codec is not None  # text without a tokenizer was refused above
                max_context = getattr(self.engine, "max_context", None)
                max_tokens = None if max_context is None else max_context - params.max_new_tokens
                chars = len(request.prompt_text) + sum(len(m["content"]) for m in messages)
                pool = self._tokenize_long if chars > LONG_TEXT_CHARS else self._tokenize
                loop = asyncio.get_running_loop()
                # (off the event loop; a text surely too long for the context is refused before it is tokenized,
                # a chat once its template is rendered)
                if messages:
                    prompt = await loop.run_in_executor(pool, self.codec.encode_chat, messages, max_tokens)
                else:
                    self.codec.check_length(request.prompt_text, max_tokens)
                    prompt = await loop.run_in_executor(pool, self.codec.encode, request.prompt_text)
            if parts:
                assert self.processor is not None  # refused above
                processed = await asyncio.to_thread(self.processor, parts)  # decodes media: off the event loop
                prompt, inputs = processed.token_ids, [processed.inputs]
            if self.engine.policy_version < request.min_policy_version:
                remaining = context.time_remaining()
                remaining = self.config.max_wait_s if remaining is None else min(remaining, self.config.max_wait_s)
                # (no thread held while waiting: a client that goes away ends its wait)
                ok = await self.engine.reach_version(request.min_policy_version, remaining)
                if not ok:
                    await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "min_policy_version not reached in time")
            # (a call that waited keeps its waiter's slot to the end: so at most max_in_flight +
            # max_version_waiters calls run, however often the version moves)
            queued = time.monotonic()
            [completions] = await self.engine.generate([prompt], params, inputs)
        except (InvalidRequestError, media.InvalidMedia) as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ChatTemplateError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"prompt_messages: {e}")
        except PromptTooLong as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{e} (the model's context less max_new_tokens)")
        except (EngineClosedError, EngineUnavailableError) as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            if waits:
                self.version_waiters -= 1
            else:
                self.in_flight -= 1
        resp = rollout_pb2.GenerateResponse(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            samples=[
                sample_to_proto(i, prompt, c, self.codec.decode(c.token_ids) if self.codec else "")
                for i, c in enumerate(completions)
            ],
            engine_id=self.engine.stats().engine_id,
        )
        resp.queue_duration.FromNanoseconds(int((queued - started) * 1e9))
        resp.generation_duration.FromNanoseconds(int((time.monotonic() - queued) * 1e9))
        return resp

    async def ComputeLogprobs(
        self, request: rollout_pb2.ComputeLogprobsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ComputeLogprobsResponse:
        n = len(request.sequences)
        if n == 0:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "sequences is empty")
        if n > MAX_SCORE_SEQUENCES:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequences has {n} entries, more than {MAX_SCORE_SEQUENCES}",
            )
        tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in request.sequences)
        if tokens > self.config.max_score_tokens:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequences hold {tokens} tokens, over this server's max_score_tokens of {self.config.max_score_tokens}",
            )
        if self.in_flight >= self.config.max_in_flight:
            await _abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.in_flight} calls in flight, this server's maximum"
            )
        temperature = request.temperature if request.HasField("temperature") else 1.0
        sequences = [ScoredSequence(list(s.prompt_token_ids), list(s.completion_token_ids)) for s in request.sequences]
        self.in_flight += 1
        try:
            scores = await self.engine.score(sequences, temperature)
        except InvalidRequestError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (EngineClosedError, EngineUnavailableError) as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except NotImplementedError as e:
            await _abort(context, grpc.StatusCode.UNIMPLEMENTED, str(e))
        except torch.OutOfMemoryError as e:  # a long sequence on a device with too little room
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory while scoring: {e}"[:1024])
        except Exception as e:  # noqa: BLE001 - the engine failed: say so (its log has the traceback), never UNKNOWN
            await _abort(context, grpc.StatusCode.INTERNAL, f"scoring failed: {type(e).__name__}: {e}"[:1024])
        finally:
            self.in_flight -= 1
        return rollout_pb2.ComputeLogprobsResponse(
            sequences=[rollout_pb2.CompletionLogprobs(logprobs=lp) for lp in scores.logprobs],
            policy_version=scores.policy_version,
            engine_id=self.engine.engine_id,
        )

    async def GetStatus(
        self, request: rollout_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetStatusResponse:
        group = self.weights.group
        return rollout_pb2.GetStatusResponse(
            server_id=self.config.server_id,
            engines=[engine_status_to_proto(self.engine.stats(), self.weights.receiving_version)],
            in_flight_requests=self.in_flight + self.version_waiters,
            in_flight_groups=self.producer.groups_in_flight if self.producer else 0,
            groups_produced=self.producer.groups_produced if self.producer else 0,
            groups_filtered=(self.producer.groups_filtered + self.producer.groups_surplus) if self.producer else 0,
            membership_epoch=group.spec.membership_epoch if group else 0,
            weights_group_name=group.name if group else "",
        )

    # -- weights -----------------------------------------------------------------------------

    async def InitWeightsUpdateGroup(
        self, request: rollout_pb2.InitWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.InitWeightsUpdateGroupResponse:
        max_wait_s = self.config.max_wait_s
        if request.HasField("timeout") and not 0 < seconds(request.timeout) <= max_wait_s:
            await _abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"timeout must be positive and at most {max_wait_s:g}s"
            )
        spec = group_spec_from_proto(request, default_timeout_s=min(60.0, max_wait_s))
        try:
            num_ranks = await self.weights.init_group(spec)
        except (ReceiveError, PhaseError) as e:
            await _abort(context, _refusal_code(e), str(e))
        except GroupBuildBusy as e:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return rollout_pb2.InitWeightsUpdateGroupResponse(num_ranks=num_ranks)

    async def UpdateWeightsFromDistributed(
        self, request: rollout_pb2.UpdateWeightsFromDistributedRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsFromDistributedResponse:
        try:
            # (the checksum algorithm is the manifest's: the loader asks the sidecar for it)
            bucket = bucket_request_from_proto(request, checksum_algorithm="")
            version = await self.weights.receive(bucket, _deadline(context))
        except LOAD_ERRORS as e:
            await _abort(context, _refusal_code(e), str(e))
        except SidecarUnavailable as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"the weight sidecar did not answer: {e}"[:1024])
        return rollout_pb2.UpdateWeightsFromDistributedResponse(
            policy_version=request.policy_version,
            bucket_index=request.bucket_index,
            version_complete=version is not None,
        )

    async def UpdateWeightsFromTensor(
        self, request: rollout_pb2.UpdateWeightsFromTensorRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UpdateWeightsFromTensorResponse:
        try:
            version = await self.weights.load_shared(shared_request_from_proto(request), _deadline(context))
        except LOAD_ERRORS as e:
            await _abort(context, _refusal_code(e), str(e))
        except (EngineClosedError, EngineUnavailableError) as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        return rollout_pb2.UpdateWeightsFromTensorResponse(
            policy_version=version.policy_version, loaded_bytes=version.nbytes
        )

    async def DestroyWeightsUpdateGroup(
        self, request: rollout_pb2.DestroyWeightsUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.DestroyWeightsUpdateGroupResponse:
        try:
            destroyed = await self.weights.destroy_group(request.group_name)
        except ReceiveError as e:
            await _abort(context, _refusal_code(e), str(e))
        return rollout_pb2.DestroyWeightsUpdateGroupResponse(destroyed=destroyed)
