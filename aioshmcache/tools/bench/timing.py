"""The one timing harness: samples per run, numpy statistics, interleaved cells, a warm baseline.

Every figure is a :class:`Stat`: the median over runs of each run's median (one run hit by a
burst of load from another user of the machine does not move it), the range of those per-run
medians (the noise between runs) and the p99 of all samples pooled. :func:`interleave` runs
every subject once per run, in turn, with its baseline, so that a load spike slows baseline and
subject alike and their ratio holds.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.uint8]
R = TypeVar("R")
#: one subject of an interleaved measurement: appends its samples (seconds) to the list given
#: (for :func:`ainterleave`, it may be a coroutine function)
Cell = Callable[[list[float]], object]
_ns = time.perf_counter_ns


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; NaN when empty."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass(frozen=True)
class Stat:
    """A measured quantity: median of the per-run medians, their range, p99 of all samples."""

    median: float
    lo: float
    hi: float
    p99: float
    n: int  # samples
    runs: int


@dataclass
class Samples:
    """Per-run lists of samples (seconds per operation, or any other unit)."""

    runs: list[list[float]] = field(default_factory=list)

    def new_run(self) -> list[float]:
        self.runs.append([])
        return self.runs[-1]

    def add_run(self, values: Sequence[float]) -> None:
        self.runs.append(list(values))

    def stat(self) -> Stat:
        meds = np.array([np.median(r) for r in self.runs if r])
        pooled = [v for r in self.runs for v in r]
        if not pooled:
            return Stat(math.nan, math.nan, math.nan, math.nan, 0, 0)
        p99 = percentile(pooled, 99)
        lo, hi = float(meds.min()), float(meds.max())
        return Stat(float(np.median(meds)), lo, hi, p99, len(pooled), len(meds))


def interleave(runs: int, cells: dict[str, Cell], *, warmup: int = 0) -> dict[str, Stat]:
    """Every cell once per run, in turn (the first ``warmup`` runs discarded); their stats."""
    samples = {name: Samples() for name in cells}
    for r in range(warmup + runs):
        for name, cell in cells.items():
            cell(samples[name].new_run() if r >= warmup else [])
    return {name: s.stat() for name, s in samples.items()}


async def ainterleave(runs: int, cells: dict[str, Cell]) -> dict[str, Stat]:
    """:func:`interleave` for coroutine functions too: each call awaited if it is awaitable."""
    samples = {name: Samples() for name in cells}
    for _ in range(runs):
        for name, cell in cells.items():
            if inspect.isawaitable(result := cell(samples[name].new_run())):
                await result
    return {name: s.stat() for name, s in samples.items()}


def each(
    n: int, fn: Callable[..., object], args: Callable[[int], tuple[Any, ...]] | None = None
) -> Cell:
    """A cell timing ``n`` calls of ``fn``, one sample each; ``args(i)`` (untimed) gives the
    arguments of call ``i``. Results are dropped at once (a kept copy would change the next)."""

    def cell(out: list[float]) -> None:
        for i in range(n):
            a = args(i) if args is not None else ()
            t0 = _ns()
            fn(*a)
            out.append((_ns() - t0) * 1e-9)

    return cell


def copy_into(buf: ShmBuffer, src: Array, n: int, *, rotating: bool = False, span: int = 0) -> Cell:
    """A cell timing ``n`` ``np.copyto`` of ``src`` into ``buf``: the physical limit of a copy.

    Into the same place each time (for items up to a few MiB it stays in the CPU caches), or
    with ``rotating`` into rotating places of its first ``span`` bytes, as a ring's puts land.
    """

    def dst(i: int) -> tuple[Array, Array]:
        place = buf.rotating(len(src), i, span=span) if rotating else buf.view(len(src))
        return place, src

    return each(n, np.copyto, dst)


def timed(run: list[float], fn: Callable[..., R], *args: Any) -> R:
    """Call ``fn(*args)`` once, append its time in seconds to ``run``, return its result."""
    t0 = _ns()
    out = fn(*args)
    run.append((_ns() - t0) * 1e-9)
    return out


async def atimed(run: list[float], aw: Awaitable[R]) -> R:
    """Await ``aw``, append the time it took in seconds to ``run``, return its result."""
    t0 = _ns()
    out = await aw
    run.append((_ns() - t0) * 1e-9)
    return out


def run_on(loop: str, fn: Callable[[], Awaitable[R]]) -> R:
    """Run ``fn()`` to its end on a new ``asyncio`` or ``uvloop`` event loop (through anyio)."""
    options: dict[str, Any] = {}
    if loop == "uvloop":
        options["loop_factory"] = importlib.import_module("uvloop").new_event_loop
    return anyio.run(fn, backend="asyncio", backend_options=options)


def source_array(nbytes: int, seed: int = 0) -> Array:
    """A warm, private uint8 array of ``nbytes`` (random content, touched once)."""
    return np.random.default_rng(seed).integers(0, 255, size=nbytes, dtype=np.uint8)


class ShmBuffer(contextlib.AbstractContextManager["ShmBuffer"]):
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

    def rotating(self, size: int, i: int, *, span: int = 0) -> Array:
        """The ``i``-th place of ``size`` bytes round the first ``span`` bytes (default: all),
        64-byte aligned with a page between: where a ring's next put lands."""
        stride = (size + 4096 + 63) // 64 * 64
        slots = max(1, min(span or len(self.array), len(self.array)) // stride - 1)
        return self.view(size, (i % slots) * stride + 128)

    def close(self) -> None:
        del self.array
        with contextlib.suppress(BufferError):
            self._mm.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
