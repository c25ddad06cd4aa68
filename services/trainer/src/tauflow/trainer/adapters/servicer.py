"""The thin gRPC layer of the trainer: status, steps, checkpoints, pause/resume, the staleness dial."""

from __future__ import annotations

from pathlib import Path

import grpc

from tauflow.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tauflow.trainer.adapters.convert import checkpoint_to_proto, step_to_proto
from tauflow.trainer.adapters.retry import recent_failure
from tauflow.trainer.loop import CheckpointBusy, ExportRefused, State, TrainerLoop

PAGE = 1000
MAX_DIRECTORY_PARTS = 32  # a SaveCheckpoint directory's folders below the checkpoint area


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, loop: TrainerLoop, algorithm: str) -> None:
        self.loop = loop
        self.algorithm = algorithm

    async def GetStatus(self, request, context):
        loop = self.loop
        resp = trainer_pb2.GetStatusResponse(
            state=trainer_pb2.TrainerState.ValueType(loop.state.value),
            policy_version=loop.version,
            published_policy_version=max(loop.published_version, 0),
            max_staleness=loop.max_staleness,
            backend="torch",
            algorithm=self.algorithm,
            world_size=loop.backend.world_size,
            last_error=recent_failure() or loop.last_error,  # (what fails now before an older failure)
        )
        if loop.history:
            last = loop.history[-1]
            resp.last_step.CopyFrom(step_to_proto(last, loop.groups_by_staleness.get(last.step)))
        if loop.last_checkpoint is not None:
            resp.last_checkpoint.CopyFrom(checkpoint_to_proto(loop.last_checkpoint))
        return resp

    async def ListSteps(self, request, context):
        steps, dropped = self.loop.steps_from(request.from_step, request.max_steps or PAGE)
        return trainer_pb2.ListStepsResponse(
            steps=[step_to_proto(r, self.loop.groups_by_staleness.get(r.step)) for r in steps], dropped_steps=dropped
        )

    async def SaveCheckpoint(self, request, context):
        if self.loop.state in (State.STARTING, State.FAILED):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"trainer is {self.loop.state.name.lower()}")
        try:
            directory = self._directory(request.directory)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            info = await self.loop.checkpoint(directory)
        except CheckpointBusy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}: retry when it is done")
        except ExportRefused as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.out_of_space else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, str(e))
        except OSError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.errno == 28 else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, f"cannot write a checkpoint to {request.directory!r}: {e.strerror}")
        return trainer_pb2.SaveCheckpointResponse(checkpoint=checkpoint_to_proto(info))

    def _directory(self, requested: str) -> Path | None:
        """The parent directory a client asked for, which must lie inside the one that holds the configured
        checkpoint directory: a client chooses it, and the trainer must not write wherever it is told."""
        if not requested:
            return None
        if len(Path(requested).parts) > MAX_DIRECTORY_PARTS:  # (each a level of mkdir's recursion)
            raise ValueError(f"directory has more than {MAX_DIRECTORY_PARTS} parts")
        area = self.loop.checkpoint_dir.resolve().parent
        try:
            path = (area / requested).resolve()  # relative: inside the area; ".." and links are resolved first
        except (ValueError, OSError) as e:  # e.g. an embedded NUL byte
            raise ValueError(f"directory {requested!r} is not a usable path: {e}") from None
        if not path.is_relative_to(area):
            raise ValueError(f"directory {requested!r} is outside {str(area)!r}, where checkpoints may be written")
        return path

    async def Pause(self, request, context):
        if self.loop.state in (State.FAILED, State.STOPPING):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"trainer is {self.loop.state.name.lower()}")
        return trainer_pb2.PauseResponse(policy_version=await self.loop.pause())

    async def Resume(self, request, context):
        if self.loop.state in (State.FAILED, State.STOPPING):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"trainer is {self.loop.state.name.lower()}")
        self.loop.resume()
        return trainer_pb2.ResumeResponse(policy_version=self.loop.version)

    async def SetMaxStaleness(self, request, context):
        previous = self.loop.max_staleness
        try:
            tau = self.loop.set_max_staleness(request.max_staleness)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return trainer_pb2.SetMaxStalenessResponse(previous_max_staleness=previous, max_staleness=tau)
