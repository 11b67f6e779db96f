"""Shared fixtures: unique segment names, event loops (asyncio and uvloop), and a leak check.

Every async test runs on both asyncio and uvloop (``pytest_asyncio_loop_factories``). At the end
of the session the suite fails if /dev/shm holds an ``aioshm-`` segment or semaphore that was not
there when it started.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import uvloop

SHM = "/dev/shm"


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(("aioshm-", "sem.aioshm-"))}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments() -> Iterator[None]:
    before = _ours()
    yield
    left = _ours() - before
    if left:
        pytest.fail(f"left behind in /dev/shm: {sorted(left)}", pytrace=False)


@pytest.fixture
def shm_name() -> str:
    """A unique segment name for one test."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_config(shm_name: str) -> Callable[..., Any]:
    from aioshmcache import CacheConfig

    def make(
        capacity: int = 1 << 20, max_object: int | None = None, n_readers: int = 2, **kw: Any
    ) -> CacheConfig:
        kw.setdefault("name", shm_name)
        return CacheConfig(capacity, max_object or capacity // 2, n_readers, **kw)

    return make
