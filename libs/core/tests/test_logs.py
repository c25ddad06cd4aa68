"""LogLimit: what a caller or a fault can repeat at will is logged once per interval, with its count."""

from __future__ import annotations

import pytest

from tauflow.core import logs
from tauflow.core.logs import LogLimit


def test_the_first_event_is_logged_then_one_line_per_interval_counting_those_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    limit = LogLimit(10.0)
    assert limit.due() == 1  # the first at once
    assert [limit.due() for _ in range(4)] == [0, 0, 0, 0]  # within the interval: counted, not logged
    now[0] += 10.0
    assert limit.due() == 5  # the four left out and this one
    now[0] += 9.9
    assert limit.due() == 0
    now[0] += 0.1
    assert limit.due() == 2
