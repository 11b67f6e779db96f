"""Spawned "hosts" for the fleet tests: each its own process, cache and tier (spawn imports it)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

SECRET = b"fleet-test-secret-0123456789abcdef"


def item_of(h: str, nbytes: int = 64 * 1024) -> dict[str, Any]:
    """The item a host makes for ``h`` (deterministic: every host makes the same bytes)."""
    seed = int.from_bytes(h.encode()[:8].ljust(8, b"\0"), "little")
    x = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return {"pixel_values": x, "hash": h}


def tier_options(url: str, **kw: Any) -> dict[str, Any]:
    """The tier of every test host: a deterministic policy (the priors, no learning)."""
    from aioshmcache.tier import TierPolicy

    opts: dict[str, Any] = {
        "secret": SECRET,
        "policy": TierPolicy(learn=False, explore_every=0),
        "lookup_timeout_s": 2.0,  # a loaded CI machine: failures here are not the subject
    }
    opts.update(kw)
    return opts


def host(*args: Any, shape: dict[str, int] | None = None) -> None:
    """Serve hashes through ``get_or_put`` with a tiered cache; report makes and mismatches.

    ``args``: those of ``_host`` up to ``kw``. ``shape``: ``nbytes`` per item (64 KiB),
    ``at_once`` requests at a time (0: all at once), ``cpu`` (1: ``make`` is ``make_s`` of
    CPU work, not a sleep).
    """
    shape = shape or {}
    asyncio.run(
        _host(
            *args,
            nbytes=shape.get("nbytes", 64 * 1024),
            at_once=shape.get("at_once", 0),
            cpu=bool(shape.get("cpu", 0)),
        )
    )


async def _host(
    url: str,
    name: str,
    hashes: list[str],
    make_s: float,
    barrier: Any,
    out: Any,
    kw: Any,
    *,
    nbytes: int,
    at_once: int,
    cpu: bool,
) -> None:
    from aioshmcache import AsyncSenderCache, CacheConfig, ReceiverCache
    from aioshmcache.tier import RedisTier

    made: list[str] = []
    bad = 0
    tier = RedisTier(url, **tier_options(url, **kw))
    async with AsyncSenderCache.from_config(
        CacheConfig(32 << 20, 4 << 20, 1, name=name), tier=tier
    ) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 60)

            slots = asyncio.Semaphore(at_once or len(hashes) or 1)

            async def one(h: str) -> None:
                nonlocal bad

                def make() -> dict[str, Any]:
                    made.append(h)
                    if cpu:  # make_s of CPU work: on a busy host it takes longer, as a real one
                        end = time.thread_time() + make_s
                        while time.thread_time() < end:
                            pass
                    else:
                        time.sleep(make_s)
                    return item_of(h, nbytes)

                async with slots:
                    f = await cache.get_or_put(h, make)
                [got] = rx.get_and_update_features([f])
                want = item_of(h, nbytes)
                data = got.data
                if not (
                    isinstance(data, dict)
                    and data["hash"] == h
                    and np.array_equal(data["pixel_values"], want["pixel_values"])
                ):
                    bad += 1

            await asyncio.gather(*(one(h) for h in hashes))
            await tier.flush(30)  # every operation settled: the counters are final
            out.put({"pid": os.getpid(), "made": made, "bad": bad, "stats": tier.stats().to_dict()})


def claimer(url: str, name: str, h: str, ready: Any) -> None:
    """Claim ``h`` and never finish its make (the test SIGKILLs this process)."""
    asyncio.run(_claimer(url, name, h, ready))


async def _claimer(url: str, name: str, h: str, ready: Any) -> None:
    from aioshmcache import AsyncSenderCache, CacheConfig
    from aioshmcache.tier import RedisTier, TierConfig

    tier = RedisTier(url, **tier_options(url, config=TierConfig(lease_s=1.0)))
    async with AsyncSenderCache.from_config(
        CacheConfig(8 << 20, 4 << 20, 1, name=name), tier=tier
    ) as cache:

        async def make() -> dict[str, Any]:
            ready.set()
            await asyncio.sleep(3600)
            return item_of(h)

        await cache.get_or_put(h, make)
