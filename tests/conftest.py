"""Shared fixtures: unique segment names, event loops (asyncio and uvloop), and a leak check.

Every async test runs on both asyncio and uvloop (``pytest_asyncio_loop_factories``). At the end
of the session the suite fails if /dev/shm holds a segment (or semaphore) that this run created
and did not remove: one named with this run's prefix (``RUN_PREFIX``, every fixture name has it)
or one whose header names this process as its writer. Other programs' segments (another test
run, a developer's gateway) are never looked at: the machine may be shared.
"""

from __future__ import annotations

import asyncio
import os
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop

SHM = "/dev/shm"
#: every segment name made by the fixtures starts with this (unique per test run)
RUN_PREFIX = f"t{uuid.uuid4().hex[:6]}-"
_WRITER_PID_WORD = 10  # the segment header word that holds the writer's pid


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


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments() -> Iterator[None]:
    before = frozenset(os.listdir(SHM))
    yield
    left = _ours(before)
    if left:
        pytest.fail(f"left behind in /dev/shm: {sorted(left)}", pytrace=False)


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
