"""ControllerService over a running Run: its summary, its services, and stopping it.
SetMaxStaleness and ScaleRollout answer UNIMPLEMENTED until the controller can change a live run."""

from __future__ import annotations

import asyncio

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

    async def GetRun(self, request, context):  # type: ignore[no-untyped-def]
        s = self.run.summary
        summary = controller_pb2.RunSummary(
            name=s.name, state=_STATES.get(s.status, controller_pb2.RUN_STATE_RUNNING), launcher=self.run.c.launcher,
            policy_version=self.run.progress.version, total_steps=s.steps_planned, max_staleness=s.max_staleness,
            tokens_trained=sum(x.trained_tokens for x in s.steps), groups_trained=sum(x.groups for x in s.steps),
            message=s.message,
        )
        summary.staleness.violations = s.staleness_violations
        for k, v in s.staleness_histogram.items():
            summary.staleness.histogram[k] = v
        if s.staleness_histogram:
            summary.staleness.max_observed = max(s.staleness_histogram)
        if s.steps:
            summary.last_step_metrics["mean_reward"] = s.steps[-1].mean_reward
            summary.last_step_metrics["loss"] = s.steps[-1].loss
        if s.final_accuracy is not None:
            summary.last_step_metrics["heldout_accuracy"] = s.final_accuracy
        return controller_pb2.GetRunResponse(run=summary)

    async def StopRun(self, request, context):  # type: ignore[no-untyped-def]
        if request.HasField("grace_period"):
            try:
                duration_seconds(request.grace_period, "grace_period")
            except ValueError as e:  # refused before anything stops
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.task is not None and not self.task.done() and not self.stop_requested:
            self.stop_requested = True  # once: the service goes on serving the stopped run's summary
            self.task.cancel()
        return controller_pb2.StopRunResponse()

    async def SetMaxStaleness(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "changing max_staleness of a live run is not built yet")

    async def ScaleRollout(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "scaling rollout is not built yet: set the rollout replicas of the deployment "
                            "(deploy/k8s) or start more rollout servers; each joins the queue and the sidecar on its own")
