"""ControllerService over a running Run: its summary, its services, the live τ, rollout scaling, stopping."""

from __future__ import annotations

import asyncio
import re
from typing import NoReturn

import grpc

from tauflow.api.controller.v1 import controller_pb2, controller_pb2_grpc
from tauflow.controller.ports import PeerError
from tauflow.controller.run import MAX_TAU, Run, RunNotLive, TauChangeUnderWay
from tauflow.controller.scaling import ScalingRefused, ServiceView
from tauflow.controller.secrets import redacted
from tauflow.core.protobuf import duration_seconds, timestamp

_STATES = {
    "running": controller_pb2.RUN_STATE_RUNNING,
    "completed": controller_pb2.RUN_STATE_COMPLETED,
    "below_target": controller_pb2.RUN_STATE_COMPLETED,
    "failed": controller_pb2.RUN_STATE_FAILED,
    "stalled": controller_pb2.RUN_STATE_FAILED,
    "interrupted": controller_pb2.RUN_STATE_STOPPED,
}
# C0 and C1 control characters and DEL; a tab is allowed
_CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
MAX_GRACE_S = 3600.0  # StopRun's grace_period: how long the services may take to stop, at most

_KINDS = {
    "queue": controller_pb2.SERVICE_KIND_QUEUE,
    "rollout": controller_pb2.SERVICE_KIND_ROLLOUT,
    "reward": controller_pb2.SERVICE_KIND_REWARD,
    "trainer": controller_pb2.SERVICE_KIND_TRAINER,
    "weights": controller_pb2.SERVICE_KIND_WEIGHTS,
}
_HEALTH = {
    "starting": controller_pb2.SERVICE_HEALTH_STARTING,
    "serving": controller_pb2.SERVICE_HEALTH_SERVING,
    "not_serving": controller_pb2.SERVICE_HEALTH_NOT_SERVING,
    "restarting": controller_pb2.SERVICE_HEALTH_RESTARTING,
    "failed": controller_pb2.SERVICE_HEALTH_FAILED,
    "stopped": controller_pb2.SERVICE_HEALTH_STOPPED,
}


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, run: Run, task: asyncio.Task[object] | None = None) -> None:
        self.run = run
        self.task = task
        self.stop_requested = False

    def _state(self) -> controller_pb2.RunState:
        """The run's life-cycle state: a final one once its task has ended, else STOPPING after StopRun,
        STARTING until every role has been launched, RUNNING."""
        status = self.run.summary.status
        if status != "running" and (self.task is None or self.task.done()):
            return _STATES.get(status, controller_pb2.RUN_STATE_FAILED)
        if self.stop_requested:
            return controller_pb2.RUN_STATE_STOPPING
        return controller_pb2.RUN_STATE_RUNNING if self.run.following else controller_pb2.RUN_STATE_STARTING

    async def GetRun(
        self, request: controller_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.GetRunResponse:
        summary = self.run.summary
        reply = controller_pb2.RunSummary(
            run_id=self.run.run_id,
            name=summary.name,
            state=self._state(),
            launcher=self.run.config.launcher,
            policy_version=self.run.progress.version,
            total_steps=summary.steps_planned,
            max_staleness=self.run.tau,
            tokens_trained=sum(step.trained_tokens for step in summary.steps),
            groups_trained=sum(step.groups for step in summary.steps),
            message=summary.message,
        )
        reply.staleness.violations = summary.staleness_violations
        for staleness, groups in summary.staleness_histogram.items():
            reply.staleness.histogram[staleness] = groups
        if summary.staleness_histogram:
            reply.staleness.max_observed = max(summary.staleness_histogram)
        if summary.steps:
            reply.last_step_metrics["mean_reward"] = summary.steps[-1].mean_reward
            reply.last_step_metrics["loss"] = summary.steps[-1].loss
        if summary.final_accuracy is not None:
            reply.last_step_metrics["heldout_accuracy"] = summary.final_accuracy
        reply.started_at.CopyFrom(timestamp(self.run.started_wall))
        if self.run.ended_wall is not None:
            reply.ended_at.CopyFrom(timestamp(self.run.ended_wall))
        reply.config.update(redacted(self.run.config.model_dump(mode="json")))  # (secrets.py: what is one)
        return controller_pb2.GetRunResponse(run=reply)

    async def StopRun(
        self, request: controller_pb2.StopRunRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.StopRunResponse:
        grace_s: float | None = None
        if _CONTROL_CHARACTER.search(request.reason):  # (it reaches a terminal and the logs: no escape or forged line)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "reason holds a control character")
        if request.HasField("grace_period"):
            try:  # refused before anything stops
                grace_s = duration_seconds(request.grace_period, "grace_period")
                if not 0 <= grace_s <= MAX_GRACE_S:
                    raise ValueError(f"grace_period={grace_s:g}s must be between 0 and {MAX_GRACE_S:g}s")
            except ValueError as e:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.task is not None and not self.task.done() and not self.stop_requested:
            self.stop_requested = True  # once: the service goes on serving the stopped run's summary
            self.run.request_stop(request.reason, 0.0 if request.immediate else grace_s)
            self.task.cancel()
        return controller_pb2.StopRunResponse(state=self._state())

    async def SetMaxStaleness(
        self, request: controller_pb2.SetMaxStalenessRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.SetMaxStalenessResponse:
        tau = request.max_staleness
        if not -1 <= tau <= MAX_TAU:  # (the bounds of the contract; the run checks them again)
            await _abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"max_staleness={tau} must be -1 (unbounded) or 0..{MAX_TAU}"
            )
        try:
            previous, version = await self.run.set_max_staleness(tau)
        except ValueError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RunNotLive as e:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TauChangeUnderWay as e:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except PeerError as e:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"could not set max_staleness on the {e.role} ({e.code}); the τ in force is {self.run.tau}: retry",
            )
        return controller_pb2.SetMaxStalenessResponse(
            previous_max_staleness=previous, max_staleness=tau, policy_version=version
        )

    async def ListServices(
        self, request: controller_pb2.ListServicesRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ListServicesResponse:
        if request.kind not in controller_pb2.ServiceKind.values():  # (proto3 keeps an unknown number as it is)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"kind: {request.kind} is not a ServiceKind")
        views = [v for v in self.run.services() if request.kind in (0, _KINDS.get(v.role))]
        return controller_pb2.ListServicesResponse(services=[_service_info(v) for v in views])

    async def ScaleRollout(
        self, request: controller_pb2.ScaleRolloutRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ScaleRolloutResponse:
        try:
            previous = self.run.scale_rollout(request.replicas)
        except ValueError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ScalingRefused, RunNotLive) as e:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return controller_pb2.ScaleRolloutResponse(previous_replicas=previous, replicas=request.replicas)


def _service_info(view: ServiceView) -> controller_pb2.ServiceInfo:
    info = controller_pb2.ServiceInfo(
        name=view.name,
        kind=_KINDS.get(view.role, controller_pb2.SERVICE_KIND_UNSPECIFIED),
        address=view.address,
        health=_HEALTH[view.health],
        restarts=view.restarts,
        last_error=view.last_error,
        launcher_handle=view.handle,
        role=view.role,
        replica=view.index,
        build_version=view.build_version,
        contract_revisions=view.contracts,
        replicas=view.replicas,
    )
    if view.started_at:
        info.started_at.CopyFrom(timestamp(view.started_at))
    return info


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Ends the call with ``code`` (``context.abort`` raises; grpc has no type stubs to say so)."""
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")
