"""One library call under a deadline, optionally cancelled mid-way (the ``cancel`` fault).

A raw ``Task.cancel()`` lands while the call is suspended (a call that finishes without
suspending cannot be cancelled and is counted as "completed first"); an ``anyio.move_on_after``
scope can only cancel at anyio checkpoints, because ``anyio.to_thread.run_sync`` holds scope
cancellation back until its thread returns.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from .options import StressOptions

__all__ = ["Outcome", "cancel_mode", "guarded"]

T = TypeVar("T")


class Outcome:
    __slots__ = ("exc", "kind", "value")

    def __init__(self, kind: str, value: Any = None, exc: BaseException | None = None) -> None:
        self.kind = kind  # ok | error | cancelled | timeout
        self.value = value
        self.exc = exc


async def guarded(
    make: Callable[[], Awaitable[T]], *, mode: str, deadline: float, rng: random.Random
) -> Outcome:
    """Run one library call under a deadline, optionally cancelling it mid-way.

    ``mode``: ``"none"``; ``"task"`` (a raw ``Task.cancel()`` after a random delay, the call
    already started); ``"scope"`` (an ``anyio.move_on_after`` with a tiny random timeout).
    """
    if mode == "task":
        started = asyncio.Event()

        async def run() -> T:
            started.set()
            return await make()

        task = asyncio.ensure_future(run())
        await started.wait()  # cancel mid-operation, not before the call began
        if not task.done():
            await asyncio.sleep(rng.uniform(0.0, 0.004))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=deadline)
        if not done:
            return Outcome("timeout")
        if task.cancelled():
            return Outcome("cancelled")
        exc = task.exception()
        if exc is not None:
            return Outcome("error", exc=exc)
        return Outcome("ok", task.result())
    t_start = time.monotonic()
    limit = rng.uniform(0.0, 0.006) if mode == "scope" else deadline
    got = False
    value: Any = None
    try:
        with anyio.move_on_after(limit):
            value = await make()
            got = True
    except Exception as exc:
        return Outcome("error", exc=exc)
    if got:
        return Outcome("ok", value)
    if mode == "scope":
        return Outcome("cancelled")
    return Outcome("timeout", value=time.monotonic() - t_start)


def cancel_mode(opts: StressOptions, rng: random.Random) -> str:
    if "cancel" not in opts.faults or rng.random() >= opts.cancel_prob:
        return "none"
    return "task" if rng.random() < 0.5 else "scope"
