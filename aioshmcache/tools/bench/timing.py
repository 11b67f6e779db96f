"""Measurement helpers: samples, medians over runs, a warm shared-memory baseline.

Every figure of the benchmark is a :class:`Stat`: the median of all samples, plus the spread of
the per-run medians (how much one run differs from the next on a noisy, shared machine). Ratios
are taken between stats measured in the same run, interleaved where possible, so that a load
spike slows baseline and subject alike.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "ShmBuffer",
    "Stat",
    "atimed",
    "Samples",
    "memcpy_into",
    "percentile",
    "source_array",
    "timed",
    "timed_calls",
]

Array = npt.NDArray[np.uint8]
R = TypeVar("R")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; NaN when empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass(frozen=True)
class Stat:
    """A measured quantity: the median of the per-run medians, their range, and p99.

    The headline is the median over runs of each run's median, so that one run hit by a burst
    of load from another user of the machine does not move it; ``lo``/``hi`` show how far the
    runs disagree, ``p99`` is taken over all samples pooled.
    """

    median: float
    lo: float  # smallest per-run median
    hi: float  # largest per-run median
    p99: float
    n: int  # samples
    runs: int

    @property
    def spread(self) -> float:
        """(hi - lo) / median: run-to-run noise, relative."""
        return (self.hi - self.lo) / self.median if self.median else math.nan


@dataclass
class Samples:
    """Per-run lists of samples (seconds per operation, or any other unit)."""

    runs: list[list[float]] = field(default_factory=list)

    def new_run(self) -> list[float]:
        run: list[float] = []
        self.runs.append(run)
        return run

    def add_run(self, values: Sequence[float]) -> None:
        self.runs.append(list(values))

    @property
    def all(self) -> list[float]:
        return [v for run in self.runs for v in run]

    def stat(self) -> Stat:
        values = self.all
        if not values:
            return Stat(math.nan, math.nan, math.nan, math.nan, 0, 0)
        meds = [statistics.median(r) for r in self.runs if r]
        return Stat(
            statistics.median(meds),
            min(meds),
            max(meds),
            percentile(values, 99),
            len(values),
            len(meds),
        )


class ShmBuffer:
    """A warm mapping of a /dev/shm file: the destination of the physical-limit baseline.

    The file is unlinked right after mapping (the mapping stays valid), so nothing is left in
    /dev/shm even if the benchmark is killed.
    """

    def __init__(self, nbytes: int) -> None:
        path = f"/dev/shm/aioshmbench-{os.getpid()}-{time.monotonic_ns()}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.unlink(path)
            os.posix_fallocate(fd, 0, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: Array = np.frombuffer(self._mm, dtype=np.uint8)
        self.array[:] = 1  # warm: every page faulted in and written once

    def view(self, nbytes: int, offset: int = 0) -> Array:
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        del self.array
        with contextlib.suppress(BufferError):
            self._mm.close()


def source_array(nbytes: int, seed: int = 0) -> Array:
    """A warm, private uint8 array of ``nbytes`` (random content, touched once)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, size=nbytes, dtype=np.uint8)


def memcpy_into(dst: Array, src: Array, n: int, out: list[float]) -> None:
    """Time ``n`` ``np.copyto(dst, src)`` calls, one sample each."""
    copyto = np.copyto
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        copyto(dst, src)
        out.append((clock() - t0) * 1e-9)


def timed(run: list[float], fn: Callable[..., R], *args: Any) -> R:
    """Call ``fn(*args)`` once, append its time in seconds to ``run``, return its result."""
    t0 = time.perf_counter_ns()
    out = fn(*args)
    run.append((time.perf_counter_ns() - t0) * 1e-9)
    return out


async def atimed(run: list[float], aw: Awaitable[R]) -> R:
    """Await ``aw``, append the time it took in seconds to ``run``, return its result."""
    t0 = time.perf_counter_ns()
    out = await aw
    run.append((time.perf_counter_ns() - t0) * 1e-9)
    return out


def timed_calls(fn: Callable[[], object], n: int, out: list[float]) -> None:
    """Time ``n`` calls of ``fn``, one sample each."""
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e-9)
