"""The staleness dial of a live run: τ in force, its changes, and the bound each step's groups must keep.

``tauflow set max-staleness K`` (ControllerService.SetMaxStaleness) changes τ while the run goes on. The
controller reads the trainer's version, sets the new τ on the queue and the trainer (lowering: the queue
first; raising: the trainer first, so that neither ever delivers or trains under a looser τ than the
other allows), and reads the version again: a :class:`TauChange` records both. The queue names the τ each
batch was delivered under and the trainer judges the batch by it, so the run's invariant is: **no group
is trained with a staleness above the τ in force at its delivery.** The summary checks it from outside,
with :func:`bound_for_step`: a step whose version came before the change began kept the old τ, one that
began after it took effect the new τ, and a step in between either (the looser).

A run counts its violations as its steps come (:class:`StalenessLedger`): each step is judged once, when
it is recorded, against the changes made until then (and a change under way, which the step waits for),
so that reading the count costs nothing however many changes a client made; changes that every step to
come is past are folded into the τ in force, and changes that began and took effect at the same versions
into one window.
"""

from __future__ import annotations

from collections import deque
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
    """Groups trained with a staleness above their bound, over ``(step, {staleness: groups})`` records (the
    definition; a run counts them as they come with :class:`StalenessLedger`)."""
    return sum(
        groups
        for step, counts in steps
        for staleness, groups in counts.items()
        if exceeds(staleness, bound_for_step(step, initial, changes))
    )


@dataclass
class _Window:
    """Changes made one after another that began at ``from_version`` and took effect at ``to_version``."""

    from_version: int
    to_version: int
    tau: int  # the last one's: in force once a step is past the window
    loosest: int  # the loosest of theirs: a step inside the window may have been delivered under any


class StalenessLedger:
    """:func:`violations` counted as the steps come, in increasing order: each step is judged once, by
    :func:`bound_for_step` over the changes made so far, and the work is bounded by the changes a step can
    still race, not by every change the run had.

    A change under way (:meth:`begin` with the trainer's version when it began, then :meth:`changed` or
    :meth:`abandoned`) holds the steps from that version on until it is known, so that a step that raced
    it is judged with it. A step recorded with no change under way is past every change still to come (each
    begins at the trainer's version, after the steps already listed), so its verdict is final."""

    def __init__(self, initial: int) -> None:
        self.violations = 0
        self.judged = 0  # steps judged (a test counts the work)
        self.looked_at = 0  # windows looked at while judging them
        self._in_force = initial  # τ of the changes every step to come is past
        self._windows: deque[_Window] = deque()
        self._pending_from: int | None = None
        self._held: list[tuple[int, dict[int, int]]] = []

    @property
    def windows(self) -> int:
        """Windows of changes kept: those a step to come may still race."""
        return len(self._windows)

    def begin(self, from_version: int) -> None:
        self._pending_from = from_version

    def changed(self, change: TauChange) -> None:
        last = self._windows[-1] if self._windows else None
        if last is not None and (last.from_version, last.to_version) == (change.from_version, change.to_version):
            last.tau, last.loosest = change.tau, loosest([last.loosest, change.tau])
        else:
            self._windows.append(_Window(change.from_version, change.to_version, change.tau, change.tau))
        self.abandoned()

    def abandoned(self) -> None:
        """The change under way is done (recorded, or failed): the steps it held are judged."""
        self._pending_from = None
        held, self._held = self._held, []
        for step, counts in held:
            self._judge(step, counts)

    def step(self, step: int, counts: Mapping[int, int]) -> None:
        if self._pending_from is not None and step >= self._pending_from:
            self._held.append((step, dict(counts)))
        else:
            self._judge(step, counts)

    def _judge(self, step: int, counts: Mapping[int, int]) -> None:
        windows = self._windows
        while windows and windows[0].to_version < step:  # in force for this step and every one after it
            self._in_force = windows.popleft().tau
        tau, racing = self._in_force, []
        for window in windows:  # (as bound_for_step, over what is left)
            self.looked_at += 1
            if window.to_version < step:
                tau = window.tau
            elif window.from_version <= step:
                racing.append(window.loosest)
        bound = loosest([tau, *racing])
        self.violations += sum(groups for staleness, groups in counts.items() if exceeds(staleness, bound))
        self.judged += 1
