"""ControllerService over a running Run: its summary, its services, and stopping it.
SetMaxStaleness and ScaleRollout answer UNIMPLEMENTED until the controller can change a live run."""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from tauflow.api.controller.v1 import controller_pb2, controller_pb2_grpc
from tauflow.controller.run import Run
from tauflow.core.protobuf import duration_seconds

_STATES = {
    "running": controller_pb2.RUN_STATE_RUNNING,
    "completed": controller_pb2.RUN_STATE_COMPLETED,
    "below_target": controller_pb2.RUN_STATE_COMPLETED,
    "failed": controller_pb2.RUN_STATE_FAILED,
    "interrupted": controller_pb2.RUN_STATE_STOPPED,
}


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, run: Run, task: asyncio.Task[object] | None = None) -> None:
        self.run = run
        self.task = task
        self.stop_requested = False

    async def GetRun(
        self, request: controller_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.GetRunResponse:
        summary = self.run.summary
        reply = controller_pb2.RunSummary(
            name=summary.name,
            state=_STATES.get(summary.status, controller_pb2.RUN_STATE_RUNNING),
            launcher=self.run.config.launcher,
            policy_version=self.run.progress.version,
            total_steps=summary.steps_planned,
            max_staleness=summary.max_staleness,
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
        return controller_pb2.GetRunResponse(run=reply)

    async def StopRun(
        self, request: controller_pb2.StopRunRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.StopRunResponse:
        if request.HasField("grace_period"):
            try:
                duration_seconds(request.grace_period, "grace_period")
            except ValueError as e:  # refused before anything stops
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.task is not None and not self.task.done() and not self.stop_requested:
            self.stop_requested = True  # once: the service goes on serving the stopped run's summary
            self.task.cancel()
        return controller_pb2.StopRunResponse()

    async def SetMaxStaleness(
        self, request: controller_pb2.SetMaxStalenessRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.SetMaxStalenessResponse:
        await _unimplemented(context, "changing max_staleness of a live run is not built yet")

    async def ScaleRollout(
        self, request: controller_pb2.ScaleRolloutRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ScaleRolloutResponse:
        await _unimplemented(
            context,
            "scaling rollout is not built yet: set the rollout replicas of the deployment "
            "(deploy/k8s) or start more rollout servers; each joins the queue and the sidecar "
            "on its own",
        )


async def _unimplemented(context: grpc.aio.ServicerContext, details: str) -> NoReturn:
    """Ends the call UNIMPLEMENTED (``context.abort`` raises; grpc has no type stubs to say so)."""
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)
    raise AssertionError("unreachable: abort raises")
