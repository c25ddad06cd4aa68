"""The staleness rule, once: what staleness is, what τ bounds, and how far producers may run ahead.

A trajectory group made by policy versions ``v_1 … v_n`` (its samples' behaviour versions) has, for a
consumer at policy version ``k``, the **staleness** ``k - min(v_i)``: how many optimizer steps lie
between the oldest policy that wrote part of it and the policy that trains on it. It is never negative
(a group from a version the consumer has not reached counts 0) and is 0 when no version is known.

The bound **τ** (``max_staleness``) is ``0`` (synchronous, on-policy), a positive ``N``, or
:data:`UNBOUNDED` (``-1``, fully asynchronous); nothing else is a τ. A group is **too stale** for ``k``
when τ is bounded and its staleness exceeds τ: the queue evicts it before delivery and the trainer skips
it (the second check covers groups leased before a change of τ or version).

**Pacing** keeps producers from making groups that could only be evicted: with ``groups_per_step`` groups
per optimizer step and the trainer at version ``k``, at most ``(k + τ + 1) · groups_per_step`` groups may
have been accepted (or reserved) in the run so far, so no group is ever generated more than τ versions
behind the step that consumes it. Unbounded τ means no pacing limit. The queue service enforces all
three; the trainer checks staleness again; docs/design.md ("Staleness") says why.
"""

from __future__ import annotations

from collections.abc import Iterable

UNBOUNDED = -1  # τ = -1: no bound on staleness, no pacing limit


def check_tau(tau: int, *, largest: int | None = None, name: str = "max_staleness") -> int:
    """``tau`` when it is a τ (:data:`UNBOUNDED`, or 0 … ``largest``); raises ValueError (TypeError for a non-integer) naming ``name``."""
    if isinstance(tau, bool) or not isinstance(tau, int):
        raise TypeError(f"{name} must be an integer, got {type(tau).__name__}")
    if tau < UNBOUNDED or (largest is not None and tau > largest):
        upper = "" if largest is None else f" and {largest}"
        between = f"between 0{upper}" if largest is not None else "at least 0"
        raise ValueError(f"{name}={tau} must be {UNBOUNDED} (unbounded) or {between}")
    return tau


def is_bounded(tau: int) -> bool:
    return tau != UNBOUNDED


def staleness(consumer_version: int, behaviour_version: int | None) -> int:
    """Steps between the oldest behaviour version of a group and the consumer's version (≥ 0; 0 when the
    behaviour version is unknown)."""
    if behaviour_version is None:
        return 0
    return max(0, consumer_version - behaviour_version)


def too_stale(consumer_version: int, behaviour_version: int | None, tau: int) -> bool:
    """Whether a group of ``behaviour_version`` may not be trained at ``consumer_version`` under ``tau``."""
    return exceeds(staleness(consumer_version, behaviour_version), tau)


def exceeds(staleness_steps: int, tau: int) -> bool:
    """Whether a staleness of ``staleness_steps`` breaks the bound ``tau`` (the check of a run's summary)."""
    return is_bounded(tau) and staleness_steps > tau


def pacing_limit(trainer_version: int, tau: int, groups_per_step: int) -> int | None:
    """Most groups the run may have accepted (or reserved) with the trainer at ``trainer_version``; None
    when τ is unbounded."""
    if not is_bounded(tau):
        return None
    return (trainer_version + tau + 1) * groups_per_step


def most_ahead(tau: int, groups_per_step: int) -> int | None:
    """Most groups that can ever be reserved at once (the pacing window at version 0); None: unbounded."""
    return pacing_limit(0, tau, groups_per_step)


def loosest(taus: Iterable[int]) -> int:
    """The most permissive of the bounds ``taus`` (:data:`UNBOUNDED` above any N); ValueError when empty."""
    values = list(taus)
    if not values:
        raise ValueError("loosest() of no bounds")
    return UNBOUNDED if any(not is_bounded(t) for t in values) else max(values)
