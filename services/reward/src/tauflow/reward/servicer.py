"""The thin gRPC layer of the reward service: protobuf in, domain calls, protobuf out."""

from __future__ import annotations

import logging

import grpc

from tauflow.api.reward.v1 import reward_pb2, reward_pb2_grpc
from tauflow.reward import convert
from tauflow.reward.config import RewardConfig
from tauflow.reward.errors import DeadlineExceeded, Exhausted, InvalidRequest, NotFound, RewardError
from tauflow.reward.metrics import RewardMetrics
from tauflow.reward.registry import Registry
from tauflow.reward.runner import Scorer, Status

log = logging.getLogger(__name__)

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_MARGIN_S = 0.05  # answer this long before the caller's deadline

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
add_reward_servicer_to_server = reward_pb2_grpc.add_RewardServiceServicer_to_server


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, registry: Registry, scorer: Scorer, config: RewardConfig, metrics: RewardMetrics) -> None:
        self.registry = registry
        self.scorer = scorer
        self.config = config
        self.metrics = metrics
        self.inflight = 0

    async def Score(self, request, context):  # type: ignore[no-untyped-def]
        with self.metrics.rpc_duration.labels("Score").time():
            try:
                return await self._score(request, context)
            except RewardError as err:
                code = _STATUS[type(err)]
                self.metrics.rejected.labels("Score", code.name).inc()
                await context.abort(code, str(err))

    async def _score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        limit = self.config.max_concurrent_requests
        if self.inflight >= limit:
            raise Exhausted(
                f"{self.inflight} Score calls are in progress, this service's limit (max_concurrent_requests); "
                "retry later"
            )
        n = convert.count_samples(request, self.config.max_samples_per_request)
        fn = self.registry.get(request.reward_fn)
        job = convert.score_job(request, fn, self.config.max_sample_timeout_s, n)
        remaining = context.time_remaining()
        deadline_s = None if remaining is None else max(remaining - _MARGIN_S, 0.0)
        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            results = await self.scorer.score(fn, job.groups, job.config, job.timeout_s, deadline_s)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
        self.metrics.observe(fn.name, results)
        self._log_failures(fn.name, results)
        return convert.score_response(fn, job.groups, results)

    def _log_failures(self, fn: str, results) -> None:  # type: ignore[no-untyped-def]
        """One log line per call that had failures (the first one's detail), not one per sample."""
        failed = [r for group in results for r in group if r.status is not Status.OK]
        if failed:
            first = failed[0]
            log.warning(
                "reward function failed on %d sample(s): %s",
                len(failed), first.message,
                extra={"fn": fn, "failed": len(failed), "reason": first.reason, "detail": first.detail[-2000:]},
            )

    async def ListRewardFunctions(self, request, context):  # type: ignore[no-untyped-def]
        with self.metrics.rpc_duration.labels("ListRewardFunctions").time():
            return reward_pb2.ListRewardFunctionsResponse(
                reward_functions=[convert.function_info(fn) for fn in self.registry.functions()],
                default_reward_fn=self.registry.default_name,
            )
