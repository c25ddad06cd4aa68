"""The thin gRPC layer of the reward service: protobuf in, domain calls, protobuf out.

Requests are registered with a parser that cannot fail (``add_reward_servicer_to_server``): bytes that are
not the method's message (corrupt wire format, a string that is not UTF-8, nesting past protobuf's limit)
reach the handler as ``Undecodable`` and are refused with INVALID_ARGUMENT naming ``request``, where
gRPC's own parsing would answer UNKNOWN with the exception's text.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn, TypeVar

import grpc

from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.core.decoding import OutOfBounds, Undecodable, checked_deserializer, field_wire_bytes, wire_bounds
from tauflow.core.logs import LogLimit
from tauflow.core.runtoken import from_the_run
from tauflow.reward.adapters import convert
from tauflow.reward.config import RewardConfig
from tauflow.reward.errors import DeadlineExceeded, Exhausted, InvalidRequest, NotFound, RewardError
from tauflow.reward.metrics import RewardMetrics
from tauflow.reward.registry import Registry
from tauflow.reward.runner import SampleResult, Scorer, Status

log = logging.getLogger(__name__)
Request = TypeVar("Request")

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_MARGIN_S = 0.05  # answer this long before the caller's deadline

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]


# Counted on a Score's wire bytes before it is decoded (tauflow.core.decoding.wire_bounds): a group of 10 M
# empty samples (19 MiB) took 1.3 GB and 1.4 s of the event loop to decode before its refusal. Only the bound
# of a group's samples is walked: the reward's strings and other lists have bounds of their own, checked after
# the decode (convert.py), so the walk's generic ones are lifted.
_UNBOUNDED = 1 << 62
_WIRE_WALKS = {
    "ScoreRequest": wire_bounds(
        reward_pb2.ScoreRequest.DESCRIPTOR,
        {"groups.samples": convert.MAX_SAMPLES_PER_GROUP},
        max_string=_UNBOUNDED,
        max_items=_UNBOUNDED,
    )
}


# A Score's config (a Struct) is measured on the wire too: its lists and maps nest without a bound the walk
# knows, and a config of 4 M nulls in one list (`{"a": [null, ...]}`, 15 MiB; ~0.2 GB) was decoded whole before the
# max_config_bytes check refused it. The bound now applies to the config as sent (the sum of its parts: a
# message field sent in parts is merged) before the decode, and to the decoded one after it.
_CONFIG_FIELD = reward_pb2.ScoreRequest.DESCRIPTOR.fields_by_name["config"].number


def _deserializer(message_class: Any, max_config_bytes: int) -> Any:
    decode, walk = checked_deserializer(message_class), _WIRE_WALKS.get(message_class.DESCRIPTOR.name)
    if walk is None:
        return decode

    def parse(raw: bytes) -> Any:
        reason = walk(raw)
        if reason is None and len(raw) > max_config_bytes:
            sent = field_wire_bytes(raw, _CONFIG_FIELD)
            if sent is not None and sent > max_config_bytes:
                reason = (
                    f"config {sent} bytes as sent, over this service's limit of {max_config_bytes} "
                    "(limits.max_config_bytes)"
                )
        return decode(raw) if reason is None else OutOfBounds(reason)

    return parse


def add_reward_servicer_to_server(servicer: Any, server: Any) -> None:
    """What the generated ``add_RewardServiceServicer_to_server`` does, with requests that do not decode in full
    handed to the handler as ``Undecodable`` (tauflow.core.decoding), which refuses and counts them."""
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_deserializer(
                getattr(reward_pb2, method.input_type.name), servicer.config.limits.max_config_bytes
            ),
            response_serializer=getattr(reward_pb2, method.output_type.name).SerializeToString,
        )
        for method in SERVICE.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _decoded(request: Request | Undecodable | OutOfBounds) -> Request:
    if isinstance(request, Undecodable):
        raise InvalidRequest("request", f"not a valid {request.message}: {request.reason}")
    if isinstance(request, OutOfBounds):  # (its reason starts with the field's unindexed path)
        field, _, problem = request.reason.partition(" ")
        raise InvalidRequest(field, problem)
    return request


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, registry: Registry, scorer: Scorer, config: RewardConfig, metrics: RewardMetrics) -> None:
        self.registry = registry
        self.scorer = scorer
        self.config = config
        self.metrics = metrics
        self.inflight = 0
        self._full_log = LogLimit(60.0)  # calls refused while every slot is taken: a line a minute, counted

    async def Score(
        self, request: reward_pb2.ScoreRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        with self.metrics.rpc_duration.labels("Score").time():
            try:
                return await self._score(_decoded(request), context)
            except RewardError as err:
                await self._refuse("Score", err, context)

    async def _refuse(self, method: str, err: RewardError, context: grpc.aio.ServicerContext) -> NoReturn:
        code = _STATUS[type(err)]
        self.metrics.rejected.labels(method, code.name).inc()
        if isinstance(err, InvalidRequest):
            self.metrics.count_invalid(method, err.field)
        await context.abort(code, str(err))
        raise AssertionError("unreachable: abort raises") from err

    async def _score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        limit = self.config.max_concurrent_requests
        own = from_the_run(context.invocation_metadata())
        if not own:  # (the run's own calls keep run_reserved_requests of the slots, at most half: anyone may call)
            limit -= min(self.config.run_reserved_requests, limit // 2)
        if self.inflight >= limit:
            if refused := self._full_log.due():
                log.warning(
                    "every Score slot is taken (max_concurrent_requests): calls are refused RESOURCE_EXHAUSTED",
                    extra={"limit": limit, "refused": refused, "peer": context.peer(), "run": own},
                )
            which = "max_concurrent_requests" if own else "max_concurrent_requests less run_reserved_requests"
            raise Exhausted(f"{self.inflight} Score calls are in progress, this service's limit ({which}); retry later")
        n = convert.count_samples(request, self.config.max_samples_per_request)
        fn = self.registry.get(convert.reward_fn_name(request.reward_fn, self.config.limits))
        job = convert.score_job(request, fn, self.config, n)
        remaining = context.time_remaining()
        deadline_s = None if remaining is None else max(remaining - _MARGIN_S, 0.0)
        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            results = await self.scorer.score(
                fn, job.groups, job.config, job.timeout_s, deadline_s, job.executor, first=own
            )
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
        self.metrics.observe(fn.name, results)
        self._log_failures(fn.name, results)
        return convert.score_response(fn, job.groups, results)

    def _log_failures(self, fn: str, results: list[list[SampleResult]]) -> None:
        """One log line per call that had failures (the first one's detail), not one per sample."""
        failed = [r for group in results for r in group if r.status is not Status.OK]
        if failed:
            first = failed[0]
            log.warning(
                "reward function failed on %d sample(s): %s",
                len(failed),
                first.message,
                extra={"fn": fn, "failed": len(failed), "reason": first.reason, "detail": first.detail[-2000:]},
            )

    async def ListRewardFunctions(
        self, request: reward_pb2.ListRewardFunctionsRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListRewardFunctionsResponse:
        with self.metrics.rpc_duration.labels("ListRewardFunctions").time():
            try:
                _decoded(request)
            except RewardError as err:
                await self._refuse("ListRewardFunctions", err, context)
            return reward_pb2.ListRewardFunctionsResponse(
                reward_functions=[convert.function_info(fn) for fn in self.registry.functions()],
                default_reward_fn=self.registry.default_name,
            )
