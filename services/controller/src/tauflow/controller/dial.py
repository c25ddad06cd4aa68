"""The staleness dial of a live run: τ in force, its changes, and the bound each step's groups must keep.

``tauflow set max-staleness K`` (ControllerService.SetMaxStaleness) changes τ while the run goes on. The
controller reads the trainer's version, sets the new τ on the queue and the trainer (lowering: the queue
first; raising: the trainer first, so that neither ever delivers or trains under a looser τ than the
other allows), and reads the version again: a :class:`TauChange` records both. The queue names the τ each
batch was delivered under and the trainer judges the batch by it, so the run's invariant is: **no group
is trained with a staleness above the τ in force at its delivery.** The summary checks it from outside,
with :func:`bound_for_step`: a step whose version came before the change began kept the old τ, one that
began after it took effect the new τ, and a step in between either (the looser).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tauflow.core.staleness import exceeds, loosest


@dataclass(frozen=True)
class TauChange:
    previous: int
    tau: int
    from_version: int  # the trainer's version when the change began
    to_version: int  # ... and once both the queue and the trainer had the new τ
    at_s: float  # since the run started


def bound_for_step(step: int, initial: int, changes: Sequence[TauChange]) -> int:
    """The τ that the groups of step ``step`` (trained at version ``step``) were delivered under, or the
    looser of two where the step's delivery raced a change."""
    tau, racing = initial, []
    for change in changes:
        if change.to_version < step:
            tau = change.tau  # in force before the step's first Get
        elif change.from_version <= step:
            racing.append(change.tau)
    return loosest([tau, *racing])


def violations(steps: Sequence[tuple[int, Mapping[int, int]]], initial: int, changes: Sequence[TauChange]) -> int:
    """Groups trained with a staleness above their bound, over ``(step, {staleness: groups})`` records."""
    return sum(
        groups
        for step, counts in steps
        for staleness, groups in counts.items()
        if exceeds(staleness, bound_for_step(step, initial, changes))
    )
