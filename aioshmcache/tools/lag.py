"""How late the event loop wakes up: a blocked loop shows up here.

The stress writer's lag bound and the async benchmark's ticker: it sleeps ``interval`` in a loop
and records how much later than asked it woke up.
"""

from __future__ import annotations

import time
from collections import deque

import anyio

__all__ = ["LoopLagMeter"]


class LoopLagMeter:
    """Event-loop lag samples (seconds, the last ``window``) and their maximum."""

    def __init__(self, interval: float = 0.02, *, window: int | None = 30_000) -> None:
        self.interval = interval
        self.samples: deque[float] = deque(maxlen=window)
        self.max = 0.0

    async def run(self) -> None:
        """Measure until cancelled."""
        clock, interval = time.perf_counter, self.interval
        while True:
            t = clock()
            await anyio.sleep(interval)
            lag = max(0.0, clock() - t - interval)
            self.samples.append(lag)
            self.max = max(self.max, lag)
