"""The reader face's inline threshold: reads below 2 MiB copy on the loop, bigger ones in a thread.

``AsyncReceiverCache``'s default (``DEFAULT_READ_INLINE_THRESHOLD``) is its own, measured for the
read (bench/README.md, the channel section): a 1 MiB item is read on the loop, with no thread
hop, while a bigger one still leaves the loop free. An explicit ``inline_threshold_bytes`` wins.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aioshmcache import AsyncReceiverCache, AsyncSenderCache, FeatureSpec, ReceiverCache
from aioshmcache.aio import DEFAULT_READ_INLINE_THRESHOLD

MiB = 1 << 20


async def _reads_in_a_thread(
    make_config: Any, monkeypatch: pytest.MonkeyPatch, nbytes: int, **face: Any
) -> bool:
    """Read one ``nbytes`` item through an ``AsyncReceiverCache(**face)``: whether a thread ran."""
    hops: list[object] = []
    item = {"x": np.arange(nbytes, dtype=np.uint8)}
    async with AsyncSenderCache.from_config(make_config(16 * MiB, 8 * MiB, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as sync_rx:
            async with AsyncReceiverCache(sync_rx, **face) as rx:
                jobs = rx._inflight  # the jobs the reader face hands to worker threads
                add = jobs.add

                def counted(fn: Any) -> Any:
                    hops.append(fn)
                    return add(fn)

                monkeypatch.setattr(jobs, "add", counted)
                [ref] = await cache.get_and_update_features([FeatureSpec("h", item)])
                [got] = await rx.get_and_update_features([ref])
                assert np.array_equal(got.data["x"], item["x"])
                assert rx.receiver.make_stats().hits == 1
    return bool(hops)


def test_the_default_is_two_mib() -> None:
    assert 2 * MiB == DEFAULT_READ_INLINE_THRESHOLD
    assert AsyncReceiverCache.attach("x").inline_threshold_bytes == DEFAULT_READ_INLINE_THRESHOLD
    assert AsyncReceiverCache.attach_group("g").inline_threshold_bytes == (
        DEFAULT_READ_INLINE_THRESHOLD
    )


async def test_a_one_mib_read_runs_on_the_loop(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not await _reads_in_a_thread(make_config, monkeypatch, MiB)


async def test_a_bigger_read_runs_in_a_thread(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await _reads_in_a_thread(make_config, monkeypatch, 3 * MiB)


async def test_an_explicit_threshold_wins(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await _reads_in_a_thread(make_config, monkeypatch, MiB, inline_threshold_bytes=64 << 10)
