"""The suite's own rules (``conftest.py``): load never decides an outcome, Hypothesis's timings
included, and a run ended by SIGTERM (a CI job's timeout) leaves nothing in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import sweep

from .helpers import ROOT, wait_until

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


_HOLDER = """
import time
from pathlib import Path

from aioshmcache import SenderCache


def test_hold_a_segment_until_terminated(make_config):
    with SenderCache(make_config()) as cache:
        Path({ready!r}).write_text(cache.name)
        time.sleep(600)  # until the SIGTERM
"""


@pytest.mark.slow
def test_a_run_ended_by_sigterm_removes_its_segments(tmp_path: Path) -> None:
    """SIGTERM (a CI job's timeout, ``timeout(1)``) ends a run as Ctrl-C does: the test in
    progress unwinds and closes its cache, the session's checks run, nothing stays in
    /dev/shm (the default action killed the process with its segments left for good)."""
    ready = tmp_path / "ready"
    test_file = tmp_path / "test_holder.py"
    test_file.write_text(textwrap.dedent(_HOLDER.format(ready=str(ready))))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    proc = subprocess.Popen(
        [*cmd, "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(test_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    name = ""
    try:
        assert wait_until(lambda: ready.exists() and ready.read_text() != "", timeout=120)
        name = ready.read_text()
        assert os.path.exists(f"/dev/shm/{name}")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
        assert "SIGTERM" in out, out
        assert not os.path.exists(f"/dev/shm/{name}"), out
        assert not [n for n in os.listdir("/dev/shm") if name in n], out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if name:
            sweep(name=name.removeprefix("aioshm-"))
