"""Items that cannot be cached: over ``max_object_bytes``, preprocessed on every request.

Through ``get_or_put`` (the path the example gateways use): every request runs ``make`` and is
served the item inline, each is counted (``snapshot().inline_too_large`` and the collector's
``aioshmcache_inline_serves_total{cause="too_large"}``), one warning names the size and the
limit however many requests and hashes follow, and nothing is cached.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import numpy as np
import pytest

from aioshmcache import AsyncSenderCache, ReceiverCache, ShmRef

from .test_metrics import scrape, value


async def test_an_item_too_large_is_made_counted_and_served_each_time_logged_once(
    make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[str] = []

    def maker(h: str) -> Any:
        def make() -> dict[str, Any]:
            made.append(h)
            return {"pixel_values": np.full(100_000, len(made), np.float32), "hash": h}

        return make

    config = make_config(1 << 20, 64 << 10, 1)
    async with AsyncSenderCache.from_config(config) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            with caplog.at_level(logging.WARNING, logger="aioshmcache"):
                features = [await cache.get_or_put("big", maker("big")) for _ in range(3)]
                features += await asyncio.gather(
                    cache.get_or_put("big", maker("big")), cache.get_or_put("huge", maker("huge"))
                )
                small = await cache.get_or_put("small", lambda: {"x": np.arange(4)})
            assert isinstance(small.data, ShmRef)  # the cache itself works
            assert made.count("big") >= 4 and made.count("huge") == 1  # made on every request
            for f in features:
                assert isinstance(f.data, dict)  # the item itself, served inline
                [got] = rx.get_and_update_features([f])  # what the engine reads
                assert got.data["hash"] == f.mm_hash
                np.testing.assert_array_equal(got.data["pixel_values"], f.data["pixel_values"])
            snap = cache.snapshot()
            assert snap.inline_too_large == len(features) == 5
            assert snap.items == 1 and not cache.is_cached("big") and not cache.is_cached("huge")
            samples, _ = scrape(cache)
            name = "aioshmcache_inline_serves_total"
            who = {"cache": cache.handle().name, "role": "sender"}
            assert value(samples, name, cause="too_large", **who) == 5
    warnings = [r for r in caplog.records if "max_object_bytes" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    size = re.search(r"\((\d+) bytes\)", text)
    assert size and int(size[1]) >= 400_000 and f"max_object_bytes={64 << 10}" in text
