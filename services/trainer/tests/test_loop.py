"""The training loop against an in-memory queue: acks follow checkpoints, a crash trains nothing twice."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tauflow.core.staleness import UNBOUNDED
from tauflow.trainer.adapters.convert import step_to_proto
from tauflow.trainer.backend import TorchBackend, TorchBackendConfig
from tauflow.trainer.checkpoint import latest_checkpoint
from tauflow.trainer.config import TrainerConfig
from tauflow.trainer.loop import CheckpointBusy, State, TrainerLoop
from tauflow.trainer.optim import OptimConfig
from tauflow.trainer.ports import Batch


class FakeQueue:
    """Leases groups in order; unacked leases come back when ``expire_all`` is called."""

    def __init__(self, groups, max_per_get: int = 1_000_000) -> None:
        self.pending = list(groups)
        self.max_per_get = max_per_get  # a cut batch, as a queue at its message size limit answers
        self.leases: dict[str, list] = {}
        self.acked: list[str] = []
        self.versions: list[tuple[int, bool]] = []
        self.renewed: list[str] = []
        self.nacked: list[str] = []
        self.n = 0

    async def set_version(self, version: int, rebase: bool = False) -> None:
        self.versions.append((version, rebase))

    async def get_batch(self, n_groups, consumer_version, wait_s, lease_s):
        if len(self.pending) < min(n_groups, self.max_per_get):
            await asyncio.sleep(0.01)
            return None
        n_groups = min(n_groups, self.max_per_get)
        batch, self.pending = self.pending[:n_groups], self.pending[n_groups:]
        self.n += 1
        lease = f"lease-{self.n}"
        self.leases[lease] = batch
        return Batch(lease, batch)

    async def ack(self, lease_id: str) -> None:
        self.acked += [g.group_id for g in self.leases.pop(lease_id)]

    async def nack(self, lease_id: str) -> None:
        self.nacked.append(lease_id)
        self.pending = self.leases.pop(lease_id) + self.pending

    async def renew(self, lease_id: str, lease_s: float) -> None:
        self.renewed.append(lease_id)

    def expire_all(self) -> None:
        for lease in sorted(self.leases, reverse=True):
            self.pending = self.leases.pop(lease) + self.pending


class FakePublisher:
    def __init__(self) -> None:
        self.versions: list[tuple[int, bool]] = []
        self.dtypes: set[torch.dtype] = set()

    async def publish(self, version, tensors, rebase=False):
        assert all(t.is_contiguous() for t in tensors.values())
        self.versions.append((version, rebase))
        self.dtypes.update(t.dtype for t in tensors.values())

    async def latest_version(self) -> int | None:
        return self.versions[-1][0] if self.versions else None


def _loop(model_dir: Path, ckpt: Path, queue, publisher, total: int, **overrides) -> TrainerLoop:
    backend_config = TorchBackendConfig(model_path=str(model_dir), optim=OptimConfig(lr=1e-3))
    backend = TorchBackend(backend_config, checkpoint=latest_checkpoint(ckpt) if ckpt.exists() else None)
    settings = {
        "groups_per_step": 2,
        "max_staleness": UNBOUNDED,
        "total_steps": total,
        "checkpoint_dir": str(ckpt),
        "checkpoint_every_steps": 2,
        "lease_s": 60,
        "get_wait_s": 0.1,
        "history_steps": 100,
    }
    return TrainerLoop(backend, queue, publisher, TrainerConfig(backend=backend_config, **{**settings, **overrides}))


async def _until(condition: Callable[[], bool], task: asyncio.Task, timeout_s: float = 30.0) -> None:
    """Waits until ``condition()`` holds (failing after ``timeout_s``, or with the loop's own error)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if task.done():
            task.result()  # the loop ended first: raises its error
            raise AssertionError("the loop finished before the condition held")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.01)


def test_acks_wait_for_checkpoints_and_a_crash_trains_nothing_twice(tiny_model_dir, make_groups, tmp_path) -> None:
    groups = make_groups(1, 12)
    queue, publisher = FakeQueue(groups), FakePublisher()
    ckpt = tmp_path / "ckpt"
    first = _loop(tiny_model_dir, ckpt, queue, publisher, total=3)
    asyncio.run(first.run())
    assert first.state is State.FINISHED and first.version == 3
    # Steps 1-2 were checkpointed at version 2 and acked; step 3 was checkpointed at the end.
    assert len(queue.acked) == 6 and not queue.leases
    assert publisher.versions == [(0, True), (1, False), (2, False), (3, False)]
    assert queue.versions[0] == (0, True) and queue.versions[-1] == (3, False)
    for result in first.history:  # each step says where its time went
        timing = {k: v for k, v in result.metrics.items() if k.startswith("time/")}
        assert set(timing) == {"time/wait_s", "time/train_s", "time/publish_s"}
        assert all(v >= 0 for v in timing.values()) and timing["time/train_s"] > 0
    commits = [r.committed_at for r in first.history]
    assert None not in commits and commits == sorted(commits)
    assert step_to_proto(first.history[0]).committed_at.ToNanoseconds() == int(commits[0] * 1e9)

    # Now a crash: the trainer trains step 4 (version 4) and dies before its checkpoint.
    crashed = _loop(tiny_model_dir, ckpt, queue, publisher, total=4, checkpoint_every_steps=100)
    crashed.checkpoint = _killed
    with pytest.raises(RuntimeError, match="killed"):
        asyncio.run(crashed.run())
    assert crashed.state is State.FAILED and "killed" in crashed.last_error
    assert crashed.version == 4 and len(queue.leases) == 1  # held, not acked
    held = [g.group_id for g in next(iter(queue.leases.values()))]

    # The restarted trainer resumes from version 3; the queue redelivers the unacked lease.
    queue.expire_all()
    resumed = _loop(tiny_model_dir, ckpt, queue, publisher, total=5)
    assert resumed.version == 3
    asyncio.run(resumed.run())
    assert resumed.version == 5
    assert queue.versions[-3][1] is True  # the resumed trainer re-based the queue on version 3
    trained = resumed.backend.trained_group_ids
    assert set(held) <= trained  # retrained once, after the crash lost that step
    assert len(queue.acked) == len(set(queue.acked)) == 10


def test_a_lease_with_nothing_new_to_make_durable_is_acked_at_once(tiny_model_dir, make_groups, tmp_path) -> None:
    """Groups trained and checkpointed before a restart, redelivered after it, are skipped as duplicates; their
    lease is acked right away. Held for a checkpoint, it would wait for one that a step with no new data never
    brings, and keep its room in the queue's pacing: the chaos run stalled so (docs/reliability.md)."""
    groups = make_groups(1, 4)
    queue, publisher = FakeQueue(groups), FakePublisher()
    ckpt = tmp_path / "ckpt"
    asyncio.run(_loop(tiny_model_dir, ckpt, queue, publisher, total=2).run())  # checkpointed at version 2
    assert len(queue.acked) == 4
    queue.pending = list(groups[:2])  # a lease of those groups comes back (its ack was lost with the queue)
    resumed = _loop(tiny_model_dir, ckpt, queue, publisher, total=3, checkpoint_every_steps=100)

    async def scenario() -> None:
        task = asyncio.create_task(resumed.run())
        await _until(lambda: len(queue.acked) == 6, task)  # acked without a step or a checkpoint
        assert resumed.version == 2 and not resumed._held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_a_step_takes_a_full_batch_from_cut_responses(tiny_model_dir, make_groups, tmp_path) -> None:
    queue, publisher = FakeQueue(make_groups(1, 9), max_per_get=1), FakePublisher()
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=3, groups_per_step=3)
    asyncio.run(loop.run())
    assert loop.version == 3 and [r.groups for r in loop.history] == [3, 3, 3]
    assert len(queue.acked) == len(set(queue.acked)) == 9 and not queue.leases  # every part acked


def test_the_leases_of_a_partial_step_are_renewed_while_the_rest_is_generated(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    groups = make_groups(1, 2)
    queue, publisher = FakeQueue(groups[:1], max_per_get=1), FakePublisher()
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=1, lease_s=0.1)  # renewed at half

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: "lease-1" in queue.renewed, task)  # the first part, leased while the second is missing
        assert loop.version == 0 and queue.pending == []
        queue.pending.append(groups[1])
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert loop.version == 1 and loop.history[0].groups == 2


async def _killed(directory=None):
    raise RuntimeError("killed before the checkpoint")


def test_the_staleness_dial_takes_only_a_tau(tiny_model_dir, tmp_path) -> None:
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", FakeQueue([]), None, total=1, max_staleness=1)
    assert loop.max_staleness == 1 and loop.set_max_staleness(UNBOUNDED) == UNBOUNDED == loop.max_staleness
    with pytest.raises(ValueError, match=r"max_staleness=-2 must be -1 \(unbounded\) or at least 0"):
        loop.set_max_staleness(-2)
    assert loop.max_staleness == UNBOUNDED


def test_a_batch_is_judged_by_the_tau_it_was_delivered_under(tiny_model_dir, make_groups, tmp_path) -> None:
    """τ lowered between a delivery and its step (a live SetMaxStaleness): the step trains what the queue
    delivered under the old τ (no group delivered is dropped), and a later batch obeys the new one."""
    stale = make_groups(5, 2, prefix="old", version=0)  # staleness 2 at step 2
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", FakeQueue([]), None, total=1, max_staleness=2)
    loop.backend.version = 2
    loop.set_max_staleness(0)
    assert loop.delivered_tau([Batch("l1", stale, max_staleness=2)]) == 2
    assert (
        loop.delivered_tau([Batch("l1", stale, max_staleness=0), Batch("l2", stale, max_staleness=UNBOUNDED)])
        == UNBOUNDED
    )
    assert loop.delivered_tau([Batch("l1", stale)]) == 0  # the queue did not say: the trainer's own τ
    trained = loop.backend.train_step(stale, max_staleness=loop.delivered_tau([Batch("l1", stale, max_staleness=2)]))
    assert trained.committed and trained.groups == 2 and trained.max_staleness == 2
    later = make_groups(6, 2, prefix="later", version=0)  # staleness 3 now, delivered under τ = 0: dropped
    dropped = loop.backend.train_step(later, max_staleness=loop.delivered_tau([Batch("l3", later, max_staleness=0)]))
    assert not dropped.committed and dropped.skipped_stale_group_ids == [g.group_id for g in later]


def test_a_version_the_sidecar_lost_is_published_again_while_the_trainer_waits_for_data(
    tiny_model_dir: Path, make_groups: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar killed after it took version v and before the engines loaded it restarts with no version: the
    engines waited for v, the queue for their groups, and the run stalled."""
    monkeypatch.setattr("tauflow.trainer.loop.SIDECAR_CHECK_S", 0.05)
    queue, publisher = FakeQueue(make_groups(1, 2)), FakePublisher()
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=2, groups_per_step=2)

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: loop.version == 1 and publisher.versions[-1] == (1, False), task)
        await asyncio.sleep(0.3)
        assert publisher.versions == [(0, True), (1, False)]  # asked, and it held version 1: nothing again
        publisher.versions.clear()  # the sidecar restarts, holding none
        await _until(lambda: publisher.versions == [(1, False)], task)
        queue.pending += make_groups(2, 2, prefix="h")  # (the engines load it and generate again)
        await task

    asyncio.run(scenario())
    assert loop.version == 2 and publisher.versions == [(1, False), (2, False)]


def test_versions_are_published_in_publish_dtype(
    tiny_model_dir: Path, make_groups: Callable[..., Any], tmp_path: Path
) -> None:
    queue, publisher = FakeQueue(make_groups(1, 4), max_per_get=2), FakePublisher()
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=1, groups_per_step=2,
                 publish_dtype="bfloat16")  # fmt: skip
    asyncio.run(loop.run())
    assert publisher.versions[-1] == (1, False) and publisher.dtypes == {torch.bfloat16}
    assert next(loop.backend.model.parameters()).dtype == torch.float32  # the trainer's own stay float32


def test_only_a_checkpoint_in_the_own_directory_acks_and_an_export_removes_nothing(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    # SaveCheckpoint(directory=elsewhere) acked the leases while a restart resumes from checkpoint_dir only: the
    # groups were lost; and it pruned and cleaned the folder it was told, as if it were its own.
    queue = FakeQueue(make_groups(1, 4))
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=3, checkpoint_every_steps=100)
    export = tmp_path / "export"
    planted = ["v00000000", "v00000001", "v00000005", ".tmp-v00000009-dead"]  # another run's, and a leftover
    for old in planted:  # (4 checkpoints with the export's: more than keep_checkpoints, 3)
        (export / old).mkdir(parents=True)
        (export / old / "trainer_state.json").write_text('{"format": 1, "policy_version": 0}')

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: loop.version == 2 and not loop._lock.locked(), task, timeout_s=60)
        await asyncio.sleep(0.05)
        info = await loop.checkpoint(export)
        assert info.path == export / "v00000002" and info.policy_version == 2
        assert queue.acked == [] and loop.last_checkpoint is None and len(loop._held) == 2
        assert sorted(p.name for p in export.iterdir()) == sorted([*planted, "v00000002"])
        assert (await loop.checkpoint(export)).created_at == info.created_at  # a retry: the same one
        own = await loop.checkpoint()
        assert len(queue.acked) == 4 and loop.last_checkpoint == own and not loop._held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    # another checkpoint of the same version in an export folder is refused, never returned as if written
    (export / "v00000002" / "trainer_state.json").write_text(
        '{"format": 1, "policy_version": 2, "trained_group_ids": []}'
    )
    with pytest.raises(FileExistsError, match="another checkpoint of version 2"):
        loop.backend.save_checkpoint(export, own=False)
    (export / "v00000002" / "trainer_state.json").write_text("{damaged")
    with pytest.raises(FileExistsError):
        loop.backend.save_checkpoint(export, own=False)
    # ... while in the trainer's own folder a damaged one of this version is written anew
    own_state = tmp_path / "ckpt" / "v00000002" / "trainer_state.json"
    own_state.write_text("{damaged")
    assert loop.backend.save_checkpoint(tmp_path / "ckpt").policy_version == 2
    assert json.loads(own_state.read_text())["policy_version"] == 2


def test_exports_are_one_per_version_and_leave_the_own_checkpoints_room(
    tiny_model_dir, make_groups, tmp_path, monkeypatch
) -> None:
    # 50 SaveCheckpoint(directory=exports/<i>) wrote 50 whole checkpoints at one version, each holding training,
    # until the disk the trainer's own checkpoints need was full.
    import shutil

    from tauflow.trainer.loop import ExportRefused

    queue = FakeQueue(make_groups(1, 4))
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=3, checkpoint_every_steps=100)

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: loop.version == 2 and not loop._lock.locked(), task, timeout_s=60)
        first = await loop.checkpoint(tmp_path / "exports" / "0")
        assert (await loop.checkpoint(tmp_path / "exports" / "0")).created_at == first.created_at  # a retry
        with pytest.raises(ExportRefused, match=r"version 2 was exported already .*exports/0"):
            await loop.checkpoint(tmp_path / "exports" / "1")
        assert not (tmp_path / "exports" / "1").exists()
        own = await loop.checkpoint()  # the trainer's own: never refused
        free = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: free._replace(free=int(2.5 * own.size_bytes)))
        loop._exported.clear()  # (as at the next version)
        with pytest.raises(ExportRefused, match=r"would leave .* bytes free, less than the 2 checkpoints") as e:
            await loop.checkpoint(tmp_path / "exports" / "2")
        assert e.value.out_of_space and not (tmp_path / "exports" / "2").exists()
        assert (await loop.checkpoint()).policy_version == 2  # own checkpoints go on
        monkeypatch.undo()
        done = await loop.checkpoint(tmp_path / "exports" / "2")
        assert done.policy_version == 2
        # a retry of a finished export (its caller's deadline passed) is the same checkpoint, however full the disk
        monkeypatch.setattr(shutil, "disk_usage", lambda path: free._replace(free=0))
        assert (await loop.checkpoint(tmp_path / "exports" / "2")).created_at == done.created_at
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_a_checkpoint_whose_caller_leaves_finishes_before_the_next_step_and_acks(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    # A SaveCheckpoint cut short by its deadline let the next step run beside the write (a torn checkpoint) and
    # never acked. The write now finishes under the lock, acks and shows in last_checkpoint. A second export
    # meanwhile is refused; a call for the folder being written waits for that write.
    groups = make_groups(1, 4)
    queue = FakeQueue(groups[:2])
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=2, checkpoint_every_steps=100)
    save, writing = loop.backend.save_checkpoint, []

    def slow_save(root, **kw):
        writing.append(loop.version)
        time.sleep(0.5)
        out = save(root, **kw)
        writing.append(loop.version)
        return out

    loop.backend.save_checkpoint = slow_save

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: loop.version == 1 and not loop._lock.locked(), task, timeout_s=60)
        caller = asyncio.create_task(loop.checkpoint())
        await _until(lambda: bool(writing), task)
        caller.cancel()  # its deadline passed
        queue.pending += groups[2:]  # the next step's batch arrives meanwhile
        with pytest.raises(CheckpointBusy):
            await asyncio.gather(loop.checkpoint(tmp_path / "a"), loop.checkpoint(tmp_path / "b"))
        joined = await loop.checkpoint()  # the write under way
        assert writing[:2] == [1, 1] and joined.policy_version == 1  # no step ran during the write
        assert loop.last_checkpoint == joined and len(queue.acked) == 2
        await asyncio.wait_for(task, 60)

    asyncio.run(scenario())
    assert loop.version == 2

    # A loop stopped while its own checkpoint is written stays STOPPING when the write ends (the write used to
    # put back the state it had seen: TRAINING on a stopped trainer, which Pause and Resume then accepted).
    stopped = _loop(tiny_model_dir, tmp_path / "stopped", FakeQueue(groups[:2]), None, total=1)
    save_stopped = stopped.backend.save_checkpoint

    def slow_save_stopped(root, **kw):
        writing.append(stopped.version)
        time.sleep(0.5)
        out = save_stopped(root, **kw)
        writing.append(stopped.version)
        return out

    stopped.backend.save_checkpoint = slow_save_stopped

    async def stop_during_the_final_checkpoint() -> None:
        writing.clear()
        task = asyncio.create_task(stopped.run())
        await _until(lambda: bool(writing), task, timeout_s=60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: len(writing) == 2 and not stopped._lock.locked(), asyncio.ensure_future(asyncio.sleep(60)))
        assert stopped.state is State.STOPPING and stopped.last_checkpoint is not None

    asyncio.run(stop_during_the_final_checkpoint())


def test_a_trainer_started_paused_takes_no_batch_until_resumed(tiny_model_dir, make_groups, tmp_path) -> None:
    # start_paused: tauflow run holds the trainer until its first evaluation (of the starting weights) is done
    groups = make_groups(1, 2)
    queue = FakeQueue(list(groups))
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=1, start_paused=True)
    keepalives: list[float] = []
    loop.backend.keepalive = lambda: keepalives.append(time.monotonic())  # type: ignore[method-assign]

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: loop.state is State.PAUSED, task, timeout_s=60)
        await asyncio.sleep(0.35)
        assert loop.version == 0 and queue.pending == groups  # nothing leased, nothing trained
        # the other ranks of a gang hear that rank 0 lives while it waits (they give up on a silent one)
        assert len(keepalives) >= 2
        loop.resume()
        await asyncio.wait_for(task, 60)
        assert loop.version == 1 and loop.state is State.FINISHED

    asyncio.run(scenario())


def test_a_pause_during_the_long_poll_gives_the_batch_back_and_a_finished_trainer_stays_finished(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    groups = make_groups(1, 2)

    class LongPollQueue(FakeQueue):
        polling = False

        async def get_batch(self, n_groups, consumer_version, wait_s, lease_s):
            self.polling = True
            while len(self.pending) < n_groups:  # a long poll: until the groups are there
                await asyncio.sleep(0.01)
            self.polling = False
            return await super().get_batch(n_groups, consumer_version, wait_s, lease_s)

    queue = LongPollQueue([])
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=1)

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        await _until(lambda: queue.polling, task, timeout_s=60)
        assert await loop.pause() == 0
        queue.pending += groups  # the poll begun before the pause brings a batch
        await _until(lambda: queue.nacked == ["lease-1"], task)
        await asyncio.sleep(0.2)
        assert loop.version == 0 and loop.state is State.PAUSED and queue.pending == groups
        loop.resume()
        await asyncio.wait_for(task, 60)
        assert loop.version == 1 and loop.state is State.FINISHED
        assert await loop.pause() == 1 and loop.state is State.FINISHED  # the controller waits for FINISHED
        loop.resume()
        assert loop.state is State.FINISHED

    asyncio.run(scenario())


def test_a_checkpoint_directory_of_too_many_parts_is_refused_before_any_mkdir(tmp_path) -> None:
    # 1,500 levels made Path.mkdir recurse past Python's limit: INTERNAL and MBs of traceback per call.
    from types import SimpleNamespace

    from tauflow.trainer.adapters.servicer import TrainerServicer

    servicer = TrainerServicer(SimpleNamespace(checkpoint_dir=tmp_path / "ckpt"), "grpo")  # type: ignore[arg-type]
    assert servicer._directory("a/" * 32) == tmp_path / ("a/" * 32)
    with pytest.raises(ValueError, match="more than 32 parts"):
        servicer._directory("y/" * 1500)
    assert sorted(tmp_path.iterdir()) == []


def test_a_checkpoint_the_disk_refuses_does_not_end_the_trainer(
    tiny_model_dir, make_groups, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full checkpoint disk made the trainer exit (OSError 28), and its restarts fail alike until max_restarts
    # failed the run. The steps' leases now stay held until a checkpoint is written; the last one is retried.
    import errno

    import tauflow.trainer.loop as loop_module

    monkeypatch.setattr(loop_module, "CHECKPOINT_RETRY_S", 0.01)
    queue = FakeQueue(make_groups(1, 6))
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=3, checkpoint_every_steps=1)
    save, refusals = loop.backend.save_checkpoint, [0]

    def full_disk(root, **kw):
        if refusals[0] < 4:  # the checkpoints of steps 1 and 2, then the last one twice
            refusals[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(root, **kw)

    loop.backend.save_checkpoint = full_disk
    asyncio.run(loop.run())
    assert loop.state is State.FINISHED and loop.version == 3 and refusals[0] == 4
    assert len(queue.acked) == 6 and loop.last_checkpoint is not None and loop.last_checkpoint.policy_version == 3
    assert loop.last_error == ""  # (said while the disk was full; cleared once a checkpoint was written)


def test_a_checkpoint_directory_the_trainer_cannot_use_still_fails_it(tiny_model_dir, make_groups, tmp_path) -> None:
    # Only a full disk is waited out: a directory it may not write (EACCES, ENOTDIR) fails the trainer, saying so,
    # rather than training a whole run with nothing durable.
    import errno

    loop = _loop(tiny_model_dir, tmp_path / "ckpt", FakeQueue(make_groups(1, 2)), None, total=1)

    def denied(root, **kw):
        raise OSError(errno.EACCES, "Permission denied")

    loop.backend.save_checkpoint = denied
    with pytest.raises(OSError, match="Permission denied"):
        asyncio.run(loop.run())
    assert loop.state is State.FAILED


def test_a_checkpoint_folder_made_read_only_for_a_while_is_waited_out_then_fails_it(
    tiny_model_dir, make_groups, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint folder remounted read-only for 45 s mid-run crash-looped the trainer until max_restarts failed the
    # run. A folder that held checkpoints and is refused is now waited out (bounded); one refused for longer fails.
    import errno

    import tauflow.trainer.loop as loop_module

    monkeypatch.setattr(loop_module, "CHECKPOINT_RETRY_S", 0.01)
    queue = FakeQueue(make_groups(1, 8))
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, None, total=4, checkpoint_every_steps=1)
    save, refusals = loop.backend.save_checkpoint, [0]

    def read_only_for_a_while(root, **kw):
        if loop.version >= 2 and refusals[0] < 3:  # steps 2 and 3's checkpoints, then the last one once
            refusals[0] += 1
            raise OSError(errno.EROFS, "Read-only file system")
        return save(root, **kw)

    loop.backend.save_checkpoint = read_only_for_a_while
    asyncio.run(loop.run())
    assert loop.state is State.FINISHED and refusals[0] == 3 and len(queue.acked) == 8 and loop.last_error == ""

    # refused for longer than REFUSED_FOR_AT_MOST_S: the trainer fails, saying so
    monkeypatch.setattr(loop_module, "REFUSED_FOR_AT_MOST_S", -1.0)  # (already past at the first refusal)
    again = _loop(
        tiny_model_dir, tmp_path / "ckpt2", FakeQueue(make_groups(2, 8)), None, total=4, checkpoint_every_steps=1
    )
    save2 = again.backend.save_checkpoint

    def refused_after_the_first(root, **kw):
        if again.version >= 2:
            raise OSError(errno.EROFS, "Read-only file system")
        return save2(root, **kw)

    again.backend.save_checkpoint = refused_after_the_first
    with pytest.raises(OSError, match="Read-only"):
        asyncio.run(again.run())
    assert again.state is State.FAILED


@pytest.mark.parametrize(
    ("refusal", "code"),
    [
        ("one", "FAILED_PRECONDITION"),
        ("space", "RESOURCE_EXHAUSTED"),
    ],
)
def test_a_refused_export_answers_its_documented_code(tmp_path, refusal: str, code: str) -> None:
    import grpc

    from tauflow.api.trainer.v1 import trainer_pb2
    from tauflow.trainer.adapters.servicer import TrainerServicer
    from tauflow.trainer.loop import ExportRefused, State

    class Loop:
        state = State.TRAINING
        checkpoint_dir = tmp_path / "ckpt"

        async def checkpoint(self, directory):
            raise ExportRefused("refused", out_of_space=refusal == "space")

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, status, message):
            raise Aborted(status, message)

    servicer = TrainerServicer(Loop(), "grpo")  # type: ignore[arg-type]
    with pytest.raises(Aborted) as e:
        asyncio.run(servicer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(directory="exports/1"), Context()))
    assert e.value.args == (getattr(grpc.StatusCode, code), "refused")


def test_groups_the_trainer_cannot_take_are_consumed_with_their_lease_and_counted(
    tiny_model_dir, make_groups, tmp_path
) -> None:
    """A lease whose groups do not convert (the queue client leaves them out, naming them) is acked with the
    step, and the step still takes its full count of groups: before, the conversion's error ended the trainer,
    and the group, redelivered to each restart, ended the run."""

    class PoisonFirst(FakeQueue):
        async def get_batch(self, n_groups, consumer_version, wait_s, lease_s):
            if "lease-bad" not in self.acked_leases and "lease-bad" not in self.leases:
                self.leases["lease-bad"] = []
                return Batch("lease-bad", [], invalid={"poison": "sample '0': 0 behaviour log-probs for 8 tokens"})
            return await super().get_batch(n_groups, consumer_version, wait_s, lease_s)

        async def ack(self, lease_id: str) -> None:
            self.acked_leases.append(lease_id)
            await super().ack(lease_id)

    queue, publisher = PoisonFirst(make_groups(1, 4)), FakePublisher()
    queue.acked_leases = []
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=2)
    asyncio.run(loop.run())
    assert loop.version == 2 and [r.groups for r in loop.history] == [2, 2]
    assert (
        loop.history[0].metrics["skipped_invalid_groups"] == 1
        and "skipped_invalid_groups" not in loop.history[1].metrics
    )
    assert "lease-bad" in queue.acked_leases and not queue.leases and len(queue.acked) == 4


def test_a_step_that_commits_nothing_still_reports_what_it_skipped(tiny_model_dir, make_groups, tmp_path) -> None:
    # A batch of groups no step can train commits nothing; its skipped groups were counted only for steps that
    # committed (Prometheus never saw them).
    poison = make_groups(7, 2, prefix="p")
    for g in poison:
        g.samples[0].completion_ids[0] = 10**6  # a token id past the vocabulary
    queue, publisher = FakeQueue([*poison, *make_groups(1, 2)]), FakePublisher()
    skipped: list = []
    loop = _loop(tiny_model_dir, tmp_path / "ckpt", queue, publisher, total=1)
    loop.on_skip = skipped.append
    asyncio.run(loop.run())
    assert loop.version == 1 and [r.metrics.get("skipped_invalid_groups") for r in skipped] == [2.0]
    assert len(queue.acked) == 4  # the poison lease consumed with the step's
