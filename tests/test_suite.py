"""The suite's own rules (``conftest.py``): load never decides an outcome, Hypothesis's timings
included."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_stalled: list[int] = []


@settings(max_examples=3)  # the example count only: every other setting is the suite's
@given(st.integers())
def test_an_example_stalled_by_a_busy_machine_is_no_failure(n: int) -> None:
    """A busy machine deschedules this process for longer than Hypothesis's default 200 ms
    deadline: that is no failure ("Unreliable test timings") of the code under test."""
    if not _stalled:
        _stalled.append(n)
        time.sleep(0.3)  # what a descheduled process sees (a stall, not a synchronisation)


def test_hypothesis_takes_no_timing_from_the_machine() -> None:
    now = settings.default
    assert now is not None and now.deadline is None
    assert HealthCheck.too_slow in now.suppress_health_check
