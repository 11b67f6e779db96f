"""Shared fixtures: unique segment names, event loops (asyncio and uvloop), and leak checks.

Every async test runs on both asyncio and uvloop (``pytest_asyncio_loop_factories``). At the end
of the session the suite fails if /dev/shm holds a segment (or semaphore) that this run created
and did not remove: one named with this run's prefix (``RUN_PREFIX``, every fixture name has it;
the tools behind ``python -m aioshmcache demo|stress`` that the tests start put it in front of
the names they make up, through ``AIOSHM_NAME_PREFIX``, which every child process of the run
inherits) or one whose header names this process as its writer. It fails too if a process of
this run is still alive (one whose environment carries this run's ``AIOSHM_NAME_PREFIX``: a
gateway, an engine worker, a stress child, wherever it went), and kills it. Other programs'
segments and processes (another test run, a developer's gateway) are never looked at: the
machine may be shared. What it reports left in /dev/shm it then removes (a failed run leaks
nothing), and SIGTERM or SIGHUP end the run as Ctrl-C does, so those checks run then too.
Hypothesis times nothing here (no deadline, no ``too_slow`` health check): load never decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from aioshmcache.tools.shm import NAME_PREFIX_ENV

from ._procs import kill_pids, pids_with_env

SHM = "/dev/shm"
#: every segment name made by the fixtures starts with this (unique per test run)
RUN_PREFIX = f"t{uuid.uuid4().hex[:6]}-"
#: and every name the tools make up in this run's child processes (see the module docstring)
os.environ[NAME_PREFIX_ENV] = RUN_PREFIX
_WRITER_PID_WORD = 10  # the segment header word that holds the writer's pid

# Load never decides an outcome, Hypothesis's timings included: a busy machine stalls an example
# past the default 200 ms deadline ("Unreliable test timings", a FlakyFailure) or slows the
# generation past the ``too_slow`` health check. A test's own ``@settings`` keeps what it sets
# and takes the rest from here.
settings.register_profile(
    "aioshmcache", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("aioshmcache")


def _written_by_us(name: str) -> bool:
    try:
        with open(os.path.join(SHM, name), "rb") as f:
            head = f.read(8 * (_WRITER_PID_WORD + 1))
    except OSError:
        return False
    if len(head) < 8 * (_WRITER_PID_WORD + 1):
        return False
    pid: int = struct.unpack_from("=Q", head, 8 * _WRITER_PID_WORD)[0]
    return pid == os.getpid()


def _ours(before: frozenset[str] = frozenset()) -> set[str]:
    """This run's segments and semaphores in /dev/shm (never another program's)."""
    names = set(os.listdir(SHM)) - before
    segs = {
        n
        for n in names
        if n.startswith("aioshm-" + RUN_PREFIX) or (n.startswith("aioshm-") and _written_by_us(n))
    }
    sems = {n for n in names if n.startswith("sem.") and n[4:].split(".")[0] in segs}
    sems |= {n for n in names if n.startswith("sem.aioshm-" + RUN_PREFIX)}
    return segs | sems


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run_processes() -> list[int]:
    """This run's processes still alive, but for multiprocessing's resource tracker (it lives
    as long as this process)."""
    pids = []
    for pid in pids_with_env(f"{NAME_PREFIX_ENV}={RUN_PREFIX}"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"resource_tracker" not in cmd:
            pids.append(pid)
    return pids


def _stop_as_ctrl_c(main_pid: int) -> Callable[[int, FrameType | None], None]:
    """A SIGTERM or SIGHUP handler: in the run's own process, the signal ends the run as Ctrl-C
    does (the test in progress unwinds, closing what it opened, and the session's checks and
    clean-up below run); a second one, or one a forked child of a test gets, kills at once."""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if os.getpid() != main_pid:
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    return handler


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments(request: pytest.FixtureRequest) -> Iterator[None]:
    # A CI job's timeout or a closed terminal ends a run with SIGTERM or SIGHUP, whose default
    # kills this process at once: every segment it had open would stay in /dev/shm for good.
    stop = _stop_as_ctrl_c(os.getpid())
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, was in kept.items():
        if was is signal.SIG_DFL:
            signal.signal(s, stop)
    before = frozenset(os.listdir(SHM))
    try:
        yield
    finally:
        for s, was in kept.items():
            if was is signal.SIG_DFL:
                signal.signal(s, signal.SIG_DFL)
        procs = _run_processes()
        if procs:
            kill_pids(procs)  # first: a live writer's segment is no orphan to report or remove
        left = _ours(before)
        for name in left:  # reported, then removed: a failed run leaks nothing either
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))
    problems = [f"processes of this run still running (killed now): {procs}"] if procs else []
    problems += [f"left behind in /dev/shm (removed now): {sorted(left)}"] if left else []
    if problems and request.session.exitstatus == pytest.ExitCode.INTERRUPTED:
        print("\n" + "; ".join(problems), file=sys.stderr)  # a test cut short leaves them
    elif problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def shm_name() -> str:
    """A unique segment name for one test."""
    return f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_config(shm_name: str) -> Callable[..., Any]:
    from aioshmcache import CacheConfig

    def make(
        capacity: int = 1 << 20, max_object: int | None = None, n_readers: int = 2, **kw: Any
    ) -> CacheConfig:
        kw.setdefault("name", shm_name)
        return CacheConfig(capacity, max_object or capacity // 2, n_readers, **kw)

    return make


@pytest.fixture
def cpu_hog() -> Iterator[list[int]]:
    """Four busy-loop processes beside the test (on a 2-core machine: a loaded host).

    A condition to survive, never a timing to assert. Every process is killed on every path
    (the test's failure or timeout included), and ends by itself if the test run dies.
    """
    from aioshmcache.tools.bench.fleet import cpu_hog as hog

    with hog(4) as pids:
        yield pids
