"""The ``close-read`` fault: a reader closes its own cache while one of its reads is running.

A worker shuts down, or a group reader's rescan detaches the shard of a writer that went away,
while another thread reads through the same cache. The read must end with the right bytes or a
typed error (``ClosedCacheError``, ``WriterGoneError``, ...), never a released buffer's
``ValueError`` nor an ``OSError`` from a probe on a closed descriptor; reads that were running
beside it on the same cache likewise. The reader then attaches again (a new session: what the
closed slot owed was dropped by the writer, as for any closed reader).

The close comes from a worker thread (the sync ``ReceiverCache.close``, which is what races a
read; the async face's ``aclose`` would wait for its own operations first) after a random delay:
none, up to 0.2 ms (within the checks of a small read) or up to 2 ms (within a large copy), so
it lands before, during or after the read.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.to_thread

from aioshmcache import AsyncReceiverCache

from .calls import Outcome, guarded

__all__ = ["CLOSE_DELAY_MAX", "read_while_closing"]

#: the close lands up to this long after the read started (seconds)
CLOSE_DELAY_MAX: Final = 0.002


async def read_while_closing(
    rx: AsyncReceiverCache,
    read: Callable[[], Awaitable[Any]],
    *,
    deadline: float,
    rng: random.Random,
) -> Outcome:
    """Run ``read`` while a worker thread closes ``rx``'s cache under it; the read's outcome."""
    receiver = rx.receiver
    delay = rng.choice(
        (0.0, rng.uniform(0.0, CLOSE_DELAY_MAX / 10), rng.uniform(0.0, CLOSE_DELAY_MAX))
    )

    def close_soon() -> None:
        time.sleep(delay)
        receiver.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, close_soon)
        out = await guarded(read, mode="none", deadline=deadline, rng=rng)
    return out
