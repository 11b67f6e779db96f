"""How late the event loop wakes up: a blocked loop shows up here.

One meter for every tool: the gateway's ``/stats``, the stress writer's lag bound and the
benchmark's ticker. It sleeps ``interval`` in a loop and records how much later than asked it
woke up.
"""

from __future__ import annotations

import time
from collections import deque

import anyio
import numpy as np

__all__ = ["LoopLagMeter"]


class LoopLagMeter:
    """Event-loop lag samples (seconds), their maximum and a count of the large ones."""

    def __init__(
        self, interval: float = 0.02, *, window: int | None = 30_000, large: float = 0.1
    ) -> None:
        self.interval = interval
        self.large = large
        self.samples: deque[float] = deque(maxlen=window)
        self.max = 0.0
        self.n_large = 0

    async def run(self) -> None:
        """Measure until cancelled."""
        clock, interval = time.perf_counter, self.interval
        while True:
            t = clock()
            await anyio.sleep(interval)
            self.record(max(0.0, clock() - t - interval))

    def record(self, lag: float) -> None:
        self.samples.append(lag)
        if lag > self.max:
            self.max = lag
        if lag > self.large:
            self.n_large += 1

    def reset(self) -> None:
        self.samples.clear()
        self.max = 0.0
        self.n_large = 0

    def summary(self) -> dict[str, float]:
        """p50, p99 and max in milliseconds, and the number of samples."""
        if not self.samples:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "samples": 0}
        p50, p99 = np.percentile(np.fromiter(self.samples, dtype=np.float64), [50, 99])
        return {
            "p50_ms": float(p50) * 1e3,
            "p99_ms": float(p99) * 1e3,
            "max_ms": self.max * 1e3,
            "samples": len(self.samples),
        }
