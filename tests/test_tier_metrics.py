"""The tier's Prometheus series: what ``tier_stats()`` counted, parsed back from the exposition.

No Redis server needed: the tier points at a port nobody listens on, so every look-up fails
fast and the breaker opens, which is exactly what these series must show.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aioshmcache import AsyncSenderCache
from aioshmcache.tier import CircuitBreaker, RedisTier, TierPolicy
from aioshmcache.tools.redis_server import free_port

from .test_metrics import scrape, value


async def test_tier_series_follow_tier_stats(make_config: Any) -> None:
    tier = RedisTier(
        f"redis://127.0.0.1:{free_port()}/0",
        secret=b"metrics-test-secret-0123456789",
        breaker=CircuitBreaker(failures=2, retry_after_s=60.0, max_retry_after_s=60.0),
        policy=TierPolicy(learn=False),
        lookup_timeout_s=2.0,
    )
    async with AsyncSenderCache.from_config(make_config(4 << 20, 1 << 20, 1), tier=tier) as cache:
        for i in range(5):
            await cache.get_or_put(f"m{i}", lambda: {"x": np.zeros(16)})
        samples, types = scrape(cache)
        name = cache.handle().name
        st = tier.stats()
        assert cache.snapshot().tier == st  # the collector's numbers are the snapshot's
    labels = {"cache": name, "role": "sender"}
    assert (st.lookups, st.errors, st.bypassed, st.makes) == (2, 2, 3, 5)
    assert value(samples, "aioshmcache_tier_lookups_total", **labels) == 2
    assert value(samples, "aioshmcache_tier_errors_total", **labels) == 2
    assert value(samples, "aioshmcache_tier_bypassed_total", **labels) == 3
    assert value(samples, "aioshmcache_tier_hits_total", **labels) == 0
    assert value(samples, "aioshmcache_tier_breaker_open", **labels) == 1
    assert value(samples, "aioshmcache_tier_breaker_opens_total", **labels) == 1
    assert value(samples, "aioshmcache_tier_rejected_total", reason="signature", **labels) == 0
    assert value(samples, "aioshmcache_tier_fetch_budget_bytes", **labels) == 64 << 20
    count = value(samples, "aioshmcache_tier_lookup_seconds_count", **labels)
    assert count == st.lookup_samples == 0
    assert "aioshmcache_tier_lookup_seconds:summary" in types
    assert "aioshmcache_tier_lookups:counter" in types
    assert cache.tier_stats() == st


async def test_a_cache_without_a_tier_has_no_tier_series(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config(4 << 20, 1 << 20, 1)) as cache:
        await cache.get_or_put("x", lambda: {"x": np.zeros(16)})
        samples, _types = scrape(cache)
        assert cache.tier is None and cache.tier_stats() is None
        snap = cache.snapshot()
        assert snap.tier is None and snap.to_dict()["tier"] is None
    assert not [k for k in samples if k[0].startswith("aioshmcache_tier_")]
