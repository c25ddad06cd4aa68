"""The staleness rule (tauflow.core.staleness): the definition, the bound and pacing, at their edges, and
against a brute-force reading of the rule on random cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tauflow.core.staleness import (
    UNBOUNDED,
    check_tau,
    is_bounded,
    most_ahead,
    pacing_limit,
    staleness,
    too_stale,
)


def test_staleness_counts_steps_since_the_oldest_behaviour_version() -> None:
    assert staleness(7, 4) == 3
    assert staleness(4, 4) == 0
    assert staleness(3, 5) == 0  # from a version the consumer has not reached: never negative
    assert staleness(9, None) == 0  # no version known


def test_exactly_tau_is_trained_one_more_is_too_stale() -> None:
    assert not too_stale(5, 4, 1) and too_stale(6, 4, 1)
    assert not too_stale(4, 4, 0) and too_stale(5, 4, 0)  # on-policy
    assert not too_stale(10**9, 0, UNBOUNDED)
    assert not too_stale(10, None, 0)


def test_pacing_allows_tau_plus_one_steps_of_groups_ahead_of_the_trainer() -> None:
    assert pacing_limit(0, 0, 8) == 8  # on-policy: the step being made
    assert pacing_limit(3, 1, 8) == 40
    assert pacing_limit(3, UNBOUNDED, 8) is None
    assert most_ahead(2, 4) == 12 and most_ahead(UNBOUNDED, 4) is None


def test_only_minus_one_spells_unbounded() -> None:
    assert UNBOUNDED == -1 and not is_bounded(-1) and is_bounded(0)
    assert check_tau(-1) == -1 and check_tau(0) == 0 and check_tau(5, largest=5) == 5
    for bad, match in (
        (-2, "max_staleness=-2 must be -1 \\(unbounded\\) or at least 0"),
        (6, "tau=6 must be -1 \\(unbounded\\) or between 0 and 5"),
    ):
        with pytest.raises(ValueError, match=match):
            check_tau(bad, largest=5 if bad == 6 else None, name="tau" if bad == 6 else "max_staleness")
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="must be an integer"):
            check_tau(bad)  # what a caller with an untyped config could pass


@given(st.integers(0, 50), st.integers(0, 50), st.integers(-1, 5), st.integers(1, 8))
def test_no_group_that_pacing_admits_is_ever_too_stale_for_its_step(
    version: int, made_at: int, tau: int, gps: int
) -> None:
    """The reason for pacing: the n-th group accepted (0-based) is consumed by step n // gps at the latest
    in FIFO order, so a group admitted while the trainer is at ``made_at`` is within τ of its step."""
    limit = pacing_limit(made_at, tau, gps)
    if limit is None:
        return
    consumed_by = (limit - 1) // gps  # the step that trains the last group the limit admits
    assert not too_stale(consumed_by, made_at, tau)
    assert too_stale(consumed_by + 1, made_at, tau) == (consumed_by + 1 - made_at > tau)
    assert staleness(version, made_at) == max(0, version - made_at)
