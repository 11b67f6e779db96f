"""``RedisTier`` end to end against a real ``redis-server`` (and a three-master Redis Cluster).

Every server is started by a fixture on a free port without persistence and stopped after; the
tests skip (with the reason) only when ``redis-server`` is not installed. "Hosts" are separate
caches, in this process or in spawned processes, that share nothing but Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from aioshmcache import AsyncSenderCache, CacheConfig, FeatureSpec, ReceiverCache, ShmRef, sweep
from aioshmcache._tier_value import HEADER_SIZE, lease_key, seal_value, value_key
from aioshmcache.cache import GroupReceiverCache
from aioshmcache.metrics import read_snapshot
from aioshmcache.tier import CircuitBreaker, RedisTier, TierConfig, TierPolicy
from aioshmcache.tools.redis_server import RedisCluster, RedisServer, free_port, redis_binaries

from . import _tier_hosts as hosts
from .conftest import RUN_PREFIX
from .test_metrics import scrape, value
from .test_single_flight import _until

pytestmark = pytest.mark.skipif(
    redis_binaries() is None, reason="redis-server / redis-cli are not installed"
)
e2e = pytest.mark.e2e
SECRET = hosts.SECRET
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Any]:
    """A plain client of the server (what an attacker, or another deployment, could do)."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def _tier(url: str, **kw: Any) -> RedisTier:
    return RedisTier(url, **hosts.tier_options(url, **kw))


def _tuned(**tuning: Any) -> dict[str, Any]:
    """A host's tier options with ``TierConfig(**tuning)``."""
    return {"config": TierConfig(**tuning)}


def _cache(make_config: Callable[..., CacheConfig], tier: RedisTier, **kw: Any) -> AsyncSenderCache:
    return AsyncSenderCache.from_config(make_config(16 * MiB, 4 * MiB, 1, **kw), tier=tier)


def _maker(h: str, calls: list[str], nbytes: int = 64 * KiB) -> Callable[[], dict[str, Any]]:
    """A 10 ms preprocessing (20 times what fetching its item costs by the policy's priors)."""

    def make() -> dict[str, Any]:
        calls.append(h)
        time.sleep(0.01)
        return hosts.item_of(h, nbytes)

    return make


def _check(
    rx: ReceiverCache | GroupReceiverCache, f: FeatureSpec, h: str, nbytes: int = 64 * KiB
) -> None:
    """What the reader gets for ``f`` is exactly ``h``'s item."""
    [got] = rx.get_and_update_features([f])
    assert isinstance(got.data, dict) and got.data["hash"] == h
    np.testing.assert_array_equal(
        got.data["pixel_values"], hosts.item_of(h, nbytes)["pixel_values"]
    )


@dataclass
class Hosts:
    """Two hosts sharing one Redis: caches ``a`` and ``b`` with their tiers, a reader of each.

    ``calls`` records every ``make`` run by :meth:`make`; ``started`` is for a claimer's make
    to set once it runs.
    """

    ta: RedisTier
    tb: RedisTier
    a: AsyncSenderCache
    b: AsyncSenderCache
    ra: ReceiverCache
    rb: ReceiverCache
    calls: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def make(self, h: str) -> Callable[[], dict[str, Any]]:
        """A 10 ms preprocessing of ``h``, recorded in ``calls``."""
        return _maker(h, self.calls)

    async def b_asks_while_a_makes(
        self, h: str, a_make: Callable[[], Awaitable[Any]]
    ) -> tuple[asyncio.Future[FeatureSpec], asyncio.Future[FeatureSpec]]:
        """``a`` asks for ``h`` (claims it, runs ``a_make``); once that sets ``started``, ``b``
        asks for ``h`` too. Both requests, running."""
        first = asyncio.ensure_future(self.a.get_or_put(h, a_make))
        await self.started.wait()
        return first, asyncio.ensure_future(self.b.get_or_put(h, self.make(h)))

    async def b_fetches(self, h: str) -> list[tuple[str, Any]]:
        """``a`` makes ``h`` and writes it to Redis; then ``b`` asks for it (and gets exactly
        ``h``'s item). The commands ``b``'s tier sent for it, with their replies."""
        await self.a.get_or_put(h, self.make(h))
        assert await self.ta.flush(30)
        sent = _record_commands(self.tb)
        _check(self.rb, await self.b.get_or_put(h, self.make(h)), h)
        return sent

    async def b_gets(self, request: Awaitable[FeatureSpec], h: str) -> None:
        """``b``'s request is answered (within 20 s) with exactly ``h``'s item."""
        _check(self.rb, await asyncio.wait_for(request, 20), h)


TwoHosts = Callable[..., AbstractAsyncContextManager[Hosts]]


@pytest.fixture
def two_hosts(redis_server: RedisServer, make_config: Any, shm_name: str) -> TwoHosts:
    """``async with two_hosts(a_options, b_options) as h``: :class:`Hosts` on the test's server
    (each dict: options of that host's tier)."""

    @asynccontextmanager
    async def open_hosts(
        a: dict[str, Any] | None = None, b: dict[str, Any] | None = None
    ) -> AsyncIterator[Hosts]:
        ta, tb = _tier(redis_server.url, **(a or {})), _tier(redis_server.url, **(b or {}))
        async with (
            _cache(make_config, ta) as a_,
            _cache(make_config, tb, name=shm_name + "b") as b_,
        ):
            with ReceiverCache.attach(a_.handle()) as ra, ReceiverCache.attach(b_.handle()) as rb:
                yield Hosts(ta, tb, a_, b_, ra, rb)

    return open_hosts


# --- one server --------------------------------------------------------------------------------


@e2e
async def test_a_second_host_is_served_from_the_tier(two_hosts: TwoHosts) -> None:
    async with two_hosts() as h:
        fa = await h.a.get_or_put("h1", h.make("h1"))
        assert h.calls == ["h1"] and isinstance(fa.data, ShmRef)
        assert await h.ta.flush(30)
        fb = await h.b.get_or_put("h1", h.make("h1"), identifier="x")
        assert h.calls == ["h1"], "host b preprocessed an item the tier had"
        assert isinstance(fb.data, ShmRef) and fb.identifier == "x"
        _check(h.ra, fa, "h1")
        _check(h.rb, fb, "h1")
        # a hit in b's shared memory now: neither make nor the tier is asked
        _check(h.rb, await h.b.get_or_put("h1", h.make("h1")), "h1")
    sa, sb = h.ta.stats(), h.tb.stats()
    assert (sa.claims, sa.makes, sa.writes, sa.hits) == (1, 1, 1, 0)
    assert (sb.lookups, sb.hits, sb.makes, sb.misses) == (1, 1, 0, 0)
    assert sb.bytes_read == sa.bytes_written > 64 * KiB
    assert sb.lookup_seconds > 0 and h.b.tier_stats() == sb
    assert not h.ta.is_open and not h.tb.is_open  # the caches closed their tiers


def _record_commands(tier: RedisTier) -> list[tuple[str, Any]]:
    """Every command the (open) tier's client sends from now on, with its reply: a wrapped
    client, so that the round trips of a request can be counted."""
    sent: list[tuple[str, Any]] = []
    client = tier._client
    inner = client.execute_command

    async def execute_command(*args: Any, **kw: Any) -> Any:
        out = await inner(*args, **kw)
        sent.append((str(args[0]).upper(), out))
        return out

    client.execute_command = execute_command
    return sent


class _RecordingPolicy(TierPolicy):
    """The test hosts' policy (priors, no learning) that records what it is taught."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(learn=False, explore_every=0, **kw)
        self.probes: list[float] = []
        self.fetches: list[tuple[float, int]] = []

    def observe_probe(self, seconds: float) -> None:
        self.probes.append(seconds)
        super().observe_probe(seconds)

    def observe_fetch(self, seconds: float, nbytes: int) -> None:
        self.fetches.append((seconds, nbytes))
        super().observe_fetch(seconds, nbytes)


@e2e
async def test_a_tier_hit_is_the_probe_then_one_get(two_hosts: TwoHosts) -> None:
    """A hit: the probe (the value's size), then one GET; the policy learns one of each.

    Not one round trip with the probe carrying the value back: Redis 7.0 copies a value
    returned from Lua several times, and a 4 MiB hit took 12 ms that way against 6 ms for
    the probe and a GET (bench/runs/fleet-3.md).
    """
    policy = _RecordingPolicy()
    async with two_hosts(b={"policy": policy}) as h:
        await h.b.get_or_put("warm", h.make("warm"))  # b's connection and script, a miss
        assert await h.tb.flush(30)
        probes_before = len(policy.probes)
        sent = await h.b_fetches("h1")
    s = h.tb.stats()
    assert h.calls == ["warm", "h1"] and s.hits == 1
    n = h.ta.stats().bytes_written
    assert [name for name, _ in sent] == ["EVALSHA", "GET"]
    assert sent[0][1] == [1, n] and len(sent[1][1]) == n == s.bytes_read  # the size, then it
    assert len(policy.probes) == probes_before + 1
    assert [nbytes for _, nbytes in policy.fetches] == [n]


@e2e
async def test_a_value_over_the_budget_is_not_transferred(two_hosts: TwoHosts) -> None:
    """A value larger than the look-up's budget: the probe answers its size only, no GET."""
    # a make costs 10 ms, a fetch 0.5 ms per KiB: the budget is 16 KiB, the value 64 KiB
    policy = TierPolicy(explore_every=0, warmup=0, min_samples=1)
    for n in (8 * KiB, 32 * KiB):
        policy.observe_make(0.010, n)
        policy.observe_probe(0.0001)
        policy.observe_fetch(0.0005 * n / KiB, n)
    assert 8 * KiB < policy.fetch_budget(64 * MiB) < 32 * KiB
    async with two_hosts(b={"policy": policy}) as h:
        sent = await h.b_fetches("big")
    s = h.tb.stats()
    assert h.calls == ["big", "big"] and s.skipped == 1 and s.hits == 0 and s.bytes_read == 0
    assert sent[0][0] == "EVALSHA" and sent[0][1] == [1, h.ta.stats().bytes_written]
    assert "GET" not in [name for name, _ in sent]


@e2e
async def test_the_snapshot_shows_the_tier_s_counters_as_the_collector_does(
    redis_server: RedisServer, two_hosts: TwoHosts
) -> None:
    """``snapshot().tier`` after a miss, a hit and an error; the scrape shows the same numbers."""
    breaker = CircuitBreaker(failures=5)  # the error below must not open it
    async with two_hosts(b={"breaker": breaker}) as h:
        a, b = h.a, h.b
        await a.get_or_put("h1", h.make("h1"))  # a miss in the tier: claimed, made
        assert await h.ta.flush(30)
        sa = a.snapshot().tier
        assert sa is not None
        assert (sa.lookups, sa.misses, sa.hits, sa.claims, sa.makes) == (1, 1, 0, 1, 1)
        assert sa.writes == 1 and sa.bytes_written > 64 * KiB and sa.lookup_samples == 1
        await b.get_or_put("h1", h.make("h1"))  # a hit in the tier
        hit = b.snapshot().tier
        assert hit is not None and (hit.hits, hit.misses, hit.errors) == (1, 0, 0)
        assert hit.bytes_read == sa.bytes_written and hit.lookup_samples == 1
        assert hit.mean_lookup_s == hit.lookup_seconds > 0
        redis_server.kill()
        await b.get_or_put("h2", h.make("h2"))  # an error: made here
        # counted when the probe fails: at once, or after its deadline on a busy host (late)
        await _until(lambda: h.tb.stats().errors + h.tb.stats().timeouts >= 1)
        down = b.snapshot()
        assert down.tier is not None and down.tier.hits == 1 and down.tier.misses == 1
        assert down.tier.errors + down.tier.timeouts == 1 and h.calls == ["h1", "h2"]
        assert down.to_dict()["tier"]["errors"] == down.tier.errors  # JSON-able, nested
        json.dumps(down.to_dict())
        samples, _types = scrape(b)
        labels = {"cache": b.handle().name, "role": "sender"}
        for series, n in (
            ("hits", down.tier.hits),
            ("misses", down.tier.misses),
            ("errors", down.tier.errors),
            ("timeouts", down.tier.timeouts),
            ("read_bytes", down.tier.bytes_read),
            ("dropped_writes", down.tier.dropped_writes),
        ):
            assert value(samples, f"aioshmcache_tier_{series}_total", **labels) == n
        count = value(samples, "aioshmcache_tier_lookup_seconds_count", **labels)
        assert count == down.tier.lookup_samples == 1  # a failed look-up is not timed
        # counters of this process, not of the segment: a reader of shared memory has none
        assert read_snapshot(b.handle().name)[0].tier is None
        assert b.sender.snapshot().tier is None  # the wrapped sync cache has no tier
    assert b.tier_stats() == down.tier  # the last counts stay readable after close


@e2e
async def test_a_cache_group_shard_with_a_tier(redis_server: RedisServer) -> None:
    """The uvicorn recipe: each gateway process opens its shard of a group with its own tier.

    A hash a sibling shard holds comes from the sibling (same host), not from Redis; a hash
    only another host made comes from Redis.
    """
    group = f"{RUN_PREFIX}g{time.monotonic_ns() % 10**9}"
    cfg = CacheConfig(16 * MiB, 4 * MiB, 1, group=group)
    t0, t1, far = _tier(redis_server.url), _tier(redis_server.url), _tier(redis_server.url)
    calls: list[str] = []
    far_cfg = CacheConfig(16 * MiB, 4 * MiB, 1, name=f"{group}-far")
    async with (
        AsyncSenderCache.from_config(cfg, tier=t0) as s0,
        AsyncSenderCache.from_config(cfg, tier=t1) as s1,
        AsyncSenderCache.from_config(far_cfg, tier=far) as other_host,
    ):
        await s0.get_or_put("sib", _maker("sib", calls))
        await other_host.get_or_put("far", _maker("far", calls))
        assert await far.flush(30) and await t0.flush(30)
        with ReceiverCache.attach_group(group) as rx:
            _check(rx, await s1.get_or_put("sib", _maker("sib", calls)), "sib")
            _check(rx, await s1.get_or_put("far", _maker("far", calls)), "far")
    assert calls == ["sib", "far"]
    assert s1.tier_stats() is not None and t1.stats().hits == 1  # "far" only
    assert t1.stats().lookups == 1


def _run_hosts(
    url: str, orders: list[list[str]], kw: dict[str, Any], make_s: float, **shape: Any
) -> list[Any]:
    """One spawned host per list of hashes asks for them in that order; their reports."""
    ctx = mp.get_context("spawn")
    n_hosts = len(orders)
    barrier, out = ctx.Barrier(n_hosts), ctx.Queue()
    names = [f"{RUN_PREFIX}fleet{k}-{time.monotonic_ns() % 10**6}" for k in range(n_hosts)]
    procs = [
        ctx.Process(
            target=hosts.host,
            args=(url, names[k], orders[k], make_s, barrier, out, kw),
            kwargs={"shape": shape},
        )
        for k in range(n_hosts)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        sweep(prefix=RUN_PREFIX + "fleet")
    assert all(p.exitcode == 0 for p in procs)
    return results


@e2e
@pytest.mark.slow
def test_several_hosts_preprocess_each_item_once(redis_server: RedisServer) -> None:
    """Three host processes ask for the same 12 hashes at once: each is made once, fleet-wide."""
    n_hosts, hashes = 3, [f"img{i}" for i in range(12)]
    orders = [hashes[k:] + hashes[:k] for k in range(n_hosts)]
    results = _run_hosts(redis_server.url, orders, {}, 0.2)
    made = [h for r in results for h in r["made"]]
    assert sorted(made) == sorted(hashes), f"preprocessings per hash: {made}"
    assert all(r["bad"] == 0 for r in results)
    stats = [r["stats"] for r in results]
    assert sum(s["hits"] for s in stats) == (n_hosts - 1) * len(hashes)
    assert sum(s["waits"] for s in stats) >= 1  # the hosts did collide on some hashes


@e2e
@pytest.mark.slow
async def test_redis_killed_and_restarted_mid_run_fails_no_request(
    redis_server: RedisServer, make_config: Any
) -> None:
    breaker = CircuitBreaker(failures=2, retry_after_s=0.2, max_retry_after_s=0.4)
    tier = _tier(redis_server.url, lookup_timeout_s=0.05, breaker=breaker)
    calls: list[str] = []
    served = 0
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:

            async def ask(h: str) -> None:
                nonlocal served
                f = await cache.get_or_put(h, _maker(h, calls, 4 * KiB))
                _check(rx, f, h, 4 * KiB)
                served += 1
                await cache.invalidate(h)  # the next ask misses shared memory again

            for i in range(10):
                await ask(f"a{i}")
            assert await tier.flush(30)
            assert tier.stats().writes == 10
            redis_server.kill()
            for i in range(10):  # Redis is gone: every request is still answered
                await ask(f"a{i}")
            # failures are counted when each probe fails (after its deadline on a busy host)
            await _until(lambda: tier.stats().breaker_opens >= 1)
            down = tier.stats()
            assert down.errors + down.timeouts >= 2 and down.breaker_opens >= 1
            assert down.bypassed >= 1  # the open breaker kept requests away from Redis
            redis_server.start()  # empty: no persistence
            for i in range(10):
                await ask(f"b{i}")
            assert await tier.flush(30)
            before = tier.stats()
            await cache.invalidate("b0")
            for _ in range(100):  # the breaker closes at the first answer after its wait
                await ask("b0")
                if tier.stats().hits > before.hits:
                    break
                await asyncio.sleep(0.05)
    after = tier.stats()
    assert served >= 31
    assert after.hits > before.hits, "the tier was not used again after Redis came back"
    assert after.breaker_state == "closed"


@e2e
async def test_a_slow_redis_is_bounded_by_the_lookup_timeout(
    redis_server: RedisServer, make_config: Any
) -> None:
    tier = _tier(redis_server.url, lookup_timeout_s=0.05)
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            await cache.get_or_put("warm", _maker("warm", calls))  # connect first
            assert redis_server.proc is not None
            redis_server.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
            try:
                for i in range(3):
                    f = await cache.get_or_put(f"s{i}", _maker(f"s{i}", calls))
                    _check(rx, f, f"s{i}")
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)
            # the three probes went on in the background; each is counted when it settles
            # (answered once Redis resumes: late; or at the client's timeout): flush waits
            assert await tier.flush(30)
            assert tier.stats().late + tier.stats().timeouts >= 3
    s = tier.stats()
    assert calls == ["warm", "s0", "s1", "s2"]  # no request waited for the stopped Redis
    assert s.lookups == 4 and s.hits == 0
    # a late answer is not a failure: only the client's own timeout (5 s, a host stalled
    # that long) is, and three of those open the breaker
    assert s.breaker_opens == 0 or s.timeouts >= 3


@e2e
async def test_late_answers_keep_the_breaker_closed_and_no_answer_opens_it(
    redis_server: RedisServer, make_config: Any
) -> None:
    """Redis stopped: look-ups go on at their deadline; the breaker opens only when the
    operations get no answer at all (the client's socket timeout), not at the deadline."""
    tier = _tier(redis_server.url, lookup_timeout_s=0.05, config=TierConfig(write_timeout_s=0.5))
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            await cache.get_or_put("warm", _maker("warm", calls))  # connect first
            assert redis_server.proc is not None
            redis_server.proc.send_signal(signal.SIGSTOP)
            try:
                for i in range(3):
                    _check(rx, await cache.get_or_put(f"s{i}", _maker(f"s{i}", calls)), f"s{i}")
                await _until(lambda: tier.stats().timeouts >= 3)
                assert tier.breaker.state != "closed"  # three failures: Redis did not answer
                assert tier.stats().breaker_opens == 1
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)
            # Redis is back: the breaker's wait (at most 0.8 s) ends, and the next look-up
            # (its probe) finds Redis and closes it
            await _until(lambda: tier.breaker.state != "open")  # read while idle
            _check(rx, await cache.get_or_put("t", _maker("t", calls)), "t")
            # its answer closes it: at once, or when it comes after the deadline (late, a busy
            # host or a Redis just resumed), in the background
            await _until(lambda: tier.breaker.state == "closed")


@e2e
@pytest.mark.parametrize("answer", ["while_making", "after_making"])
async def test_a_probe_answering_after_its_deadline_is_late_and_its_claim_not_lost(
    redis_server: RedisServer, make_config: Any, raw: Any, answer: str
) -> None:
    """The probe is held past its deadline (as a busy host's loop holds it): the request makes
    the item without waiting; the answer, when it comes, is counted ``late`` (not a failure:
    the breaker stays closed), and the claim it took is adopted while ``make`` runs (the item
    is then written for the hosts that wait on the lease) or given up after (nobody waits on
    a lease that no make will fill)."""
    policy = TierPolicy(learn=False, explore_every=0, first_deadline_s=0.0)
    tier = _tier(redis_server.url, lookup_timeout_s=0.05, policy=policy)
    gate, making, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    async with _cache(make_config, tier) as cache:
        real = tier._scripts["probe"]

        async def held_probe(*, keys: list[str], args: list[Any]) -> Any:
            await gate.wait()
            return await real(keys=keys, args=args)

        tier._scripts["probe"] = held_probe

        async def make() -> dict[str, Any]:
            making.set()
            await release.wait()
            return hosts.item_of("h")

        task = asyncio.create_task(cache.get_or_put("h", make))
        await making.wait()  # the deadline passed: making it without a claim
        if answer == "after_making":
            release.set()
            await task
        assert not await tier.flush(0.05)  # the probe is still out: the counters not final
        gate.set()  # the probe answers now, and claims "h"
        assert await tier.flush(30)  # it settled (and a claim it took after the make, given up)
        assert tier.stats().late == 1
        lkey, vkey = lease_key(tier.keyspace, "h"), value_key(tier.keyspace, "h")
        if answer == "while_making":
            assert (await raw.get(lkey)).startswith(b"c:")  # adopted: other hosts wait on it
            release.set()
            await task
            assert await tier.flush(30)
            assert await raw.exists(vkey) == 1  # written for them
        else:
            assert await raw.exists(lkey) == 0  # given up at once
        s = tier.stats()
        assert s.errors == s.timeouts == s.breaker_opens == 0 and s.breaker_state == "closed"
        assert s.claims == (1 if answer == "while_making" else 0)  # an adopted claim counts


async def test_a_look_up_that_waits_on_another_host_s_lease_is_one_latency_sample(
    redis_server: RedisServer, raw: Any, make_config: Any
) -> None:
    """A look-up that polls another host's lease until it expires, then claims the hash: one
    look-up, one latency sample, the wait included (each poll was counted a sample of its own
    round trip, reporting many fast look-ups where there was one slow one)."""
    tier = _tier(redis_server.url, config=TierConfig(max_wait_s=30.0))
    lkey = lease_key(tier.keyspace, "w9")
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            await raw.set(lkey, b"c:" + b"0" * 24, px=400)  # a host's lease, expiring unfilled
            _check(rx, await cache.get_or_put("w9", _maker("w9", calls)), "w9")
    s = tier.stats()
    assert calls == ["w9"] and s.waits == 1 and s.takeovers == 1 and s.lookups == 1
    assert s.lookup_samples == 1 and s.lookup_seconds >= 0.3  # the wait is in it


@e2e
async def test_redis_that_never_ran_costs_requests_nothing(make_config: Any) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens
    tier = _tier(
        url, breaker=CircuitBreaker(failures=2, retry_after_s=60.0, max_retry_after_s=60.0)
    )
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            for i in range(6):
                _check(rx, await cache.get_or_put(f"d{i}", _maker(f"d{i}", calls)), f"d{i}")
    s = tier.stats()
    assert len(calls) == 6 and s.errors == 2 and s.breaker_opens == 1 and s.bypassed == 4


def _tampered(kind: str, key: str, h: str) -> bytes:
    good = seal_value(SECRET, key, h, {"pixel_values": np.full(64 * KiB, 7, np.uint8), "hash": h})
    if kind == "another_secret":
        return seal_value(b"another-secret-of-32-bytes......", key, h, hosts.item_of(h))
    if kind == "truncated":
        return good[: len(good) - 100]
    if kind == "forged":
        bad = bytearray(good)
        bad[HEADER_SIZE + len(bad) // 2] ^= 0xFF  # one payload byte changed
        return bytes(bad)
    if kind == "garbage":
        return b"\x80\x04pickle?" * 10
    raise AssertionError(kind)


@e2e
@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("another_secret", "signature"),
        ("truncated", "truncated"),
        ("forged", "signature"),
        ("garbage", "malformed"),
    ],
)
async def test_a_value_that_fails_a_check_is_never_served(
    redis_server: RedisServer, raw: Any, make_config: Any, kind: str, reason: str
) -> None:
    tier = _tier(redis_server.url)
    key = value_key(tier.keyspace, "t1")
    await raw.set(key, _tampered(kind, key, "t1"))
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            f = await cache.get_or_put("t1", _maker("t1", calls))
            _check(rx, f, "t1")  # make's item, not the one in Redis
            assert calls == ["t1"]
            assert await tier.flush(30)
    s = tier.stats()
    assert s.rejected[reason] == 1 and s.rejected_total == 1 and s.hits == 0
    # the bad value was replaced by a good one
    fresh = _tier(redis_server.url)
    async with _cache(make_config, fresh, name=make_config().name + "2") as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            _check(rx, await cache.get_or_put("t1", _maker("t1", calls)), "t1")
    assert calls == ["t1"] and fresh.stats().hits == 1


@e2e
@pytest.mark.parametrize("at", ["value", "lease"])
async def test_a_key_of_another_type_is_replaced_not_made_forever(
    redis_server: RedisServer, raw: Any, make_config: Any, shm_name: str, at: str
) -> None:
    """Before: STRLEN (or GET) failed with WRONGTYPE on every look-up, and the item was made
    on every request for as long as the key lived. Now the look-up deletes it and claims."""
    tier = _tier(redis_server.url, breaker=CircuitBreaker(failures=1))
    vkey, lkey = value_key(tier.keyspace, "w1"), lease_key(tier.keyspace, "w1")
    await raw.rpush(vkey if at == "value" else lkey, b"not a string")
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            _check(rx, await cache.get_or_put("w1", _maker("w1", calls)), "w1")
            assert await tier.flush(30)
        other = _tier(redis_server.url)
        async with _cache(make_config, other, name=shm_name + "b") as second:
            with ReceiverCache.attach(second.handle()) as rx:
                _check(rx, await second.get_or_put("w1", _maker("w1", calls)), "w1")
    s = tier.stats()
    assert calls == ["w1"]  # made once, then served from the tier
    assert s.errors == 0 and s.claims == 1 and s.writes == 1 and s.breaker_state == "closed"
    assert await raw.type(vkey) == b"string" and other.stats().hits == 1


@pytest.mark.parametrize("ttl_ms", [None, 3_600_000])
async def test_a_garbage_lease_that_never_expires_costs_no_wait(
    redis_server: RedisServer, raw: Any, make_config: Any, ttl_ms: int | None
) -> None:
    """Someone with write access sets a lease with no expiry (or one longer than any lease
    the tier sets): before, every host waited ``max_wait_s`` on each look-up and made the item
    anyway, for as long as the key lived. Now it is replaced: claimed at once, made, stored."""
    tier = _tier(redis_server.url, config=TierConfig(max_wait_s=60.0))
    lkey = lease_key(tier.keyspace, "g1")
    await raw.set(lkey, b"garbage", px=ttl_ms)
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            _check(rx, await cache.get_or_put("g1", _maker("g1", calls)), "g1")
            assert await tier.flush(30)
    s = tier.stats()
    assert calls == ["g1"] and s.waits == 0 and s.claims == 1 and s.writes == 1
    assert await raw.exists(value_key(tier.keyspace, "g1")) == 1


async def test_a_garbage_lease_that_looks_like_one_costs_at_most_max_wait_s(
    redis_server: RedisServer, raw: Any, make_config: Any
) -> None:
    """A lease that expires as ours do cannot be told from a host's: a waiter waits for it at
    most ``max_wait_s`` (then makes the item); it never waits beyond that bound."""
    tier = _tier(redis_server.url, config=TierConfig(max_wait_s=0.3, lease_s=60.0))
    lkey = lease_key(tier.keyspace, "g2")
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            # as long as a lease of ours: it outlives the wait however slow the host (with 2 s,
            # a host 2 s late found it expired and claimed the hash: no wait to bound)
            await raw.set(lkey, b"garbage", px=60_000)
            _check(rx, await cache.get_or_put("g2", _maker("g2", calls)), "g2")
    s = tier.stats()
    assert calls == ["g2"] and s.waits == 1 and s.wait_timeouts == 1
    assert s.lookup_samples == 1 and s.lookup_seconds >= 0.3  # the wait, as one sample


async def test_a_host_with_another_secret_cannot_hurt_the_others(
    redis_server: RedisServer, raw: Any, make_config: Any, shm_name: str
) -> None:
    """A host configured with a wrong secret writes under its own namespace: the others never
    read its values (nothing rejected) and it never overwrites theirs (they still hit)."""
    good = _tier(redis_server.url)
    wrong = _tier(redis_server.url, secret=b"another-secret-0123456789abcdef")
    later = _tier(redis_server.url)
    assert good.keyspace == later.keyspace != wrong.keyspace
    calls: list[str] = []
    for k, tier in enumerate((good, wrong, later)):
        async with _cache(make_config, tier, name=f"{shm_name}{k}") as cache:
            with ReceiverCache.attach(cache.handle()) as rx:
                for h in ("s1", "s2"):
                    _check(rx, await cache.get_or_put(h, _maker(h, calls)), h)
                assert await tier.flush(30)
    assert calls == ["s1", "s2", "s1", "s2"]  # the wrong host made its own; nobody else did
    assert later.stats().hits == 2 and later.stats().rejected_total == 0
    assert wrong.stats().hits == 0 and wrong.stats().rejected_total == 0


@e2e
async def test_an_oversized_value_is_never_fetched(
    redis_server: RedisServer, raw: Any, make_config: Any
) -> None:
    tier = _tier(redis_server.url, max_item_bytes=128 * KiB)
    key = value_key(tier.keyspace, "big")
    big = {"pixel_values": np.zeros(256 * KiB, np.uint8), "hash": "big"}
    await raw.set(key, seal_value(SECRET, key, "big", big))  # well signed, but too large
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            _check(rx, await cache.get_or_put("big", _maker("big", calls)), "big")
    s = tier.stats()
    assert calls == ["big"] and s.rejected["oversized"] == 1 and s.bytes_read == 0


@e2e
async def test_a_claimer_killed_while_computing_lets_one_waiter_take_over(
    redis_server: RedisServer, two_hosts: TwoHosts
) -> None:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    name = f"{RUN_PREFIX}claimer-{time.monotonic_ns() % 10**6}"
    proc = ctx.Process(target=hosts.claimer, args=(redis_server.url, name, "k1", ready))
    # both hosts wait on the claimer's lease before it is killed: opened after the kill, a
    # loaded host found the lease expired already (the first to ask claimed, nobody took over)
    patient = {"lease_s": 1.0, "max_wait_s": 60.0}  # whatever the load, the wait is not the subject
    async with two_hosts(_tuned(**patient), _tuned(**patient)) as h:
        proc.start()
        both: asyncio.Future[tuple[FeatureSpec, FeatureSpec]] | None = None
        try:
            assert await asyncio.to_thread(ready.wait, 60), "the claimer never started its make"
            both = asyncio.gather(
                h.a.get_or_put("k1", h.make("k1")), h.b.get_or_put("k1", h.make("k1"))
            )
            await _until(lambda: h.ta.stats().waits + h.tb.stats().waits == 2)
            proc.kill()  # -9 while computing: its lease is never released
            await asyncio.to_thread(proc.join, 30)
        except BaseException:
            if both is not None:
                both.cancel()
                await asyncio.gather(both, return_exceptions=True)
            raise
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            sweep(prefix=name)
        assert both is not None
        fa, fb = await asyncio.wait_for(both, 60)
        _check(h.ra, fa, "k1")
        _check(h.rb, fb, "k1")
    s1, s2 = h.ta.stats(), h.tb.stats()
    assert h.calls == ["k1"], "both waiters computed after the claimer died"
    assert s1.takeovers + s2.takeovers == 1 and s1.waits + s2.waits == 2
    assert s1.hits + s2.hits == 1 and s1.wait_timeouts + s2.wait_timeouts == 0


@e2e
@pytest.mark.parametrize("how", ["fails", "is cancelled"])
async def test_a_claimer_whose_make_fails_or_is_cancelled_releases_the_claim_at_once(
    two_hosts: TwoHosts, how: str
) -> None:
    # a lease that would outlive the test's patience: only a release lets b take over in time
    async with two_hosts(_tuned(lease_s=60.0), _tuned(lease_s=60.0, max_wait_s=30.0)) as h:
        fail = asyncio.Event()

        async def claimers_make() -> dict[str, Any]:
            h.started.set()
            await fail.wait()  # set only if it fails: cancelled, it waits here
            raise RuntimeError("preprocessing failed")

        first, second = await h.b_asks_while_a_makes("f1", claimers_make)
        await _until(lambda: h.tb.stats().waits == 1)  # b waits on a's claim
        if how == "fails":
            fail.set()
        else:
            first.cancel()
        with pytest.raises(RuntimeError if how == "fails" else asyncio.CancelledError):
            await first
        await h.b_gets(second, "f1")
    s2 = h.tb.stats()
    assert h.calls == ["f1"] and s2.waits == 1 and s2.takeovers == 1 and s2.wait_timeouts == 0


@pytest.mark.parametrize("when", ["first_probe", "after_a_wait"])
async def test_a_request_cancelled_once_its_probe_claimed_releases_the_claim_at_once(
    redis_server: RedisServer, make_config: Any, raw: Any, when: str
) -> None:
    """Review: the probe's script had run (the hash claimed in Redis) and its answer was on its
    way when the request was cancelled (a client that went away): the operation was cancelled
    with it, nobody knew of the claim, and every host waited on it for ``lease_s``. The probe
    now goes on and its claim is given up when it answers."""
    tier = _tier(redis_server.url, **_tuned(lease_s=60.0))
    lkey = lease_key(tier.keyspace, "k1")
    if when == "after_a_wait":  # another host's claim, expiring unfilled: a takeover claims
        await raw.set(lkey, b"c:" + b"0" * 24, px=300)
    async with _cache(make_config, tier) as cache:
        real = tier._scripts["probe"]
        claimed, answer = asyncio.Event(), asyncio.Event()

        async def probe(*, keys: list[str], args: list[Any]) -> Any:
            out = await real(keys=keys, args=args)  # run by Redis
            if out[0] == 2:  # claimed: the answer is on its way while the request is cancelled
                claimed.set()
                await answer.wait()
            return out

        tier._scripts["probe"] = probe

        async def make() -> dict[str, Any]:
            raise AssertionError("cancelled before its make")

        task = asyncio.ensure_future(cache.get_or_put("k1", make))
        await asyncio.wait_for(claimed.wait(), 20)
        assert (await raw.get(lkey)).startswith(b"c:")  # claimed: its lease of 60 s
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        answer.set()
        assert await tier.flush(30)
        assert await raw.get(lkey) is None  # given up: no host waits on it
        s = tier.stats()
        assert s.late == s.errors == s.timeouts == s.makes == 0 and s.breaker_state == "closed"


@e2e
async def test_a_failed_claim_is_released_while_writes_are_stuck(
    two_hosts: TwoHosts,
) -> None:
    """The release of a failed make's claim does not queue behind the writes.

    Before, it went through the write queue: while a write was stuck (a slow Redis, up to
    ``write_timeout_s`` each), a host waiting on the claim waited for it too, up to
    ``max_wait_s``, for a make that had already failed.
    """
    stuck = _tuned(lease_s=60.0, write_timeout_s=120.0)  # a's write will be stuck for good
    async with two_hosts(stuck, _tuned(lease_s=60.0, max_wait_s=60.0)) as h:
        gate, real_set = asyncio.Event(), h.ta._client.set

        async def stalled_set(*args: Any, **kw: Any) -> Any:
            await gate.wait()
            return await real_set(*args, **kw)

        async def failing() -> dict[str, Any]:
            h.started.set()
            await asyncio.sleep(0.1)
            raise RuntimeError("preprocessing failed")

        h.ta._client.set = stalled_set
        await h.a.get_or_put("s0", h.make("s0"))  # its write is now stuck
        await _until(lambda: h.ta.stats().queued_writes == 0)  # in flight, not queued
        first, second = await h.b_asks_while_a_makes("s1", failing)
        with pytest.raises(RuntimeError, match="preprocessing failed"):
            await first
        await h.b_gets(second, "s1")
        assert h.ta.stats().writes == 0  # the write was still stuck all along
        gate.set()
    s2 = h.tb.stats()
    assert h.calls == ["s0", "s1"] and s2.takeovers == 1 and s2.wait_timeouts == 0


@e2e
async def test_a_value_redis_refuses_to_store_releases_the_claim_at_once(
    two_hosts: TwoHosts, raw: Any
) -> None:
    """A value write that Redis refuses (out of memory) gives the claim up at once: a host
    waiting on it takes over, instead of waiting out the lease (``lease_s``) or its own
    ``max_wait_s`` for a value that will never come."""
    async with two_hosts(_tuned(lease_s=60.0), _tuned(lease_s=60.0, max_wait_s=60.0)) as h:
        go = asyncio.Event()

        async def claimers_make() -> dict[str, Any]:
            h.started.set()
            await go.wait()
            return h.make("m1")()

        first, second = await h.b_asks_while_a_makes("m1", claimers_make)
        await _until(lambda: h.tb.stats().waits == 1)  # b waits on a's claim
        await raw.config_set("maxmemory", 1)  # every write that may grow memory is refused
        try:
            go.set()
            _check(h.ra, await asyncio.wait_for(first, 20), "m1")
            await h.b_gets(second, "m1")
        finally:
            await raw.config_set("maxmemory", 0)
    assert h.ta.stats().writes == 0 and h.ta.stats().errors >= 1  # refused, not written
    s2 = h.tb.stats()
    assert h.calls == ["m1", "m1"] and s2.waits == 1 and s2.wait_timeouts == 0


@e2e
@pytest.mark.slow
async def test_a_claim_is_renewed_while_make_runs_longer_than_its_lease(
    two_hosts: TwoHosts,
) -> None:
    # without renewal the 3 s lease would lapse during the 6 s make and b would make it too;
    # renewed every second, it outlives a host stalled 2 s (with 0.5 s, a 0.6 s stall let it
    # lapse: b took over and made it too)
    async with two_hosts(_tuned(lease_s=3.0), _tuned(lease_s=3.0, max_wait_s=60.0)) as h:

        async def slow() -> dict[str, Any]:
            h.calls.append("r1")
            h.started.set()
            await asyncio.sleep(6.0)
            return hosts.item_of("r1")

        first, second = await h.b_asks_while_a_makes("r1", slow)
        await h.b_gets(second, "r1")
        await first
    s2 = h.tb.stats()
    assert h.calls == ["r1"] and s2.waits == 1 and s2.hits == 1 and s2.takeovers == 0


@e2e
async def test_a_request_running_when_its_tier_closes_leaves_nothing_behind(
    redis_server: RedisServer, raw: Any
) -> None:
    """After ``aclose`` a request still on the tier claims, renews and queues nothing.

    Before, a request that was waiting on another host's claim when its tier closed went on
    probing through the closed client (which connected again), claimed the hash once the lease
    was free, and renewed that claim forever (the writer that cancels renewals was gone): every
    other host then waited ``max_wait_s`` for that hash. A write queued after close stayed in
    the queue for good, holding its item.
    """
    a = _tier(redis_server.url, config=TierConfig(lease_s=60.0))
    b = _tier(redis_server.url, config=TierConfig(lease_s=60.0, max_wait_s=30.0))
    c = _tier(redis_server.url, config=TierConfig(lease_s=60.0))
    fail, made, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def failing() -> dict[str, Any]:
        made.set()
        await fail.wait()
        raise RuntimeError("a's preprocessing failed")

    async def held() -> dict[str, Any]:
        made.set()
        await release.wait()
        return hosts.item_of("z2")

    async def plain() -> dict[str, Any]:
        return hosts.item_of("z1")

    async with a:
        await b.__aenter__()  # closed below, inside the block
        first = asyncio.ensure_future(a.fetch_or_make("z1", failing))
        await made.wait()
        second = asyncio.ensure_future(b.fetch_or_make("z1", plain))
        await _until(lambda: b.stats().waits == 1)  # b waits on a's claim
        await b.aclose()
        fail.set()  # a releases its claim; b must not take it over through a closed client
        with pytest.raises(RuntimeError, match="preprocessing failed"):
            await first
        assert (await asyncio.wait_for(second, 20))["hash"] == "z1"
        assert b.stats().claims == 0 and b.stats().queued_writes == 0
        assert await raw.get(lease_key(b.keyspace, "z1")) is None

        made.clear()
        await c.__aenter__()
        third = asyncio.ensure_future(c.fetch_or_make("z2", held))
        await made.wait()  # c claimed z2 and runs its make
        await c.aclose()
        release.set()
        assert (await asyncio.wait_for(third, 20))["hash"] == "z2"
        s = c.stats()
        assert s.claims == 1 and s.queued_writes == 0 and s.dropped_writes == 1 and s.writes == 0
        assert not c._tasks  # no renewal left running


@e2e
async def test_a_request_never_waits_for_its_write(
    redis_server: RedisServer, make_config: Any
) -> None:
    tier = _tier(redis_server.url)
    calls: list[str] = []
    gate = asyncio.Event()
    async with _cache(make_config, tier) as cache:
        real_set = tier._client.set

        async def stalled_set(*args: Any, **kw: Any) -> Any:
            await gate.wait()  # a write that takes as long as the test likes
            return await real_set(*args, **kw)

        tier._client.set = stalled_set
        with ReceiverCache.attach(cache.handle()) as rx:
            for i in range(3):  # answered while the first write is still stuck
                _check(rx, await cache.get_or_put(f"g{i}", _maker(f"g{i}", calls)), f"g{i}")
            stuck = tier.stats()
            assert stuck.writes == 0 and stuck.queued_writes == 2  # one in flight, two queued
            gate.set()
            assert await tier.flush(30)
    assert tier.stats().writes == 3 and len(calls) == 3


@e2e
async def test_the_write_queue_s_byte_bound_counts_tensors_buffers_and_strings(
    redis_server: RedisServer,
) -> None:
    """Items whose bulk is not a numpy array count against ``write_queue_bytes`` too.

    Before, a torch tensor, a memoryview or a str counted as 0 bytes: 32 queued items of any
    size passed a byte bound meant to cap what the queue keeps alive.
    """
    torch = pytest.importorskip("torch")
    tier = _tier(redis_server.url, config=TierConfig(write_queue_bytes=64 * KiB))
    items: list[Any] = [
        {"t": torch.zeros(128 * KiB, dtype=torch.uint8)},
        [memoryview(bytes(128 * KiB))],
        {"s": "x" * (128 * KiB)},
    ]
    async with tier:
        for i, item in enumerate(items):

            async def make(item: Any = item) -> Any:
                return item

            assert await tier.fetch_or_make(f"b{i}", make) is item
        assert await tier.flush(30)
    s = tier.stats()
    assert s.claims == 3 and s.dropped_writes == 3 and s.writes == 0


@e2e
async def test_a_full_write_queue_drops_the_write_and_releases_the_claim(
    redis_server: RedisServer, raw: Any, make_config: Any
) -> None:
    tier = _tier(redis_server.url, config=TierConfig(write_queue_bytes=1))  # every item is larger
    calls: list[str] = []
    async with _cache(make_config, tier) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            for i in range(3):
                _check(rx, await cache.get_or_put(f"q{i}", _maker(f"q{i}", calls)), f"q{i}")
            assert await tier.flush(30)
    s = tier.stats()
    assert len(calls) == 3 and s.dropped_writes == 3 and s.writes == 0 and s.claims == 3
    for i in range(3):
        keys = value_key(tier.keyspace, f"q{i}"), lease_key(tier.keyspace, f"q{i}")
        assert await raw.exists(*keys) == 0


@e2e
async def test_an_item_not_worth_fetching_is_not_stored_and_nobody_waits_for_it(
    raw: Any, two_hosts: TwoHosts
) -> None:
    def slow_net() -> dict[str, Any]:  # fetching costs 1 s per MiB; the make ~0: never pays
        return {"policy": TierPolicy(learn=False, prior_per_byte_s=1e-6, explore_every=0)}

    async with two_hosts(slow_net(), slow_net()) as h:
        await h.a.get_or_put("n1", h.make("n1"))
        assert await h.ta.flush(30)
        assert await raw.get(lease_key(h.ta.keyspace, "n1")) == b"skip"
        _check(h.rb, await h.b.get_or_put("n1", h.make("n1")), "n1")
    assert h.calls == ["n1", "n1"]
    assert h.ta.stats().skipped_writes == 1
    assert await raw.exists(value_key(h.ta.keyspace, "n1")) == 0
    s2 = h.tb.stats()
    assert s2.skipped == 1 and s2.waits == 0 and s2.claims == 0


@e2e
@pytest.mark.slow
def test_the_fleet_example_preprocesses_each_image_once(redis_server: RedisServer) -> None:
    hosts_out = _run_fleet_example(redis_server.url, images=6, extra=["--lookup-timeout", "2"])
    assert sum(h["from_redis"] for h in hosts_out) == 2 * 6
    assert all(h["redis_errors"] == 0 for h in hosts_out)


@e2e
@pytest.mark.slow
def test_the_fleet_example_passes_at_its_defaults_beside_a_cpu_hog(
    redis_server: RedisServer, cpu_hog: list[int]
) -> None:
    """Before: it exited 1 in 8 of 8 runs so (look-ups timed out on the host's own loop lag,
    the breaker opened while Redis was up). The hog is the condition, not a timing."""
    hosts_out = _run_fleet_example(redis_server.url, images=8, extra=[])
    assert all(h["redis_errors"] == 0 for h in hosts_out)


def _run_fleet_example(url: str, *, images: int, extra: list[str]) -> list[dict[str, Any]]:
    """Run examples/fleet_app.py with three hosts (its process group killed on every path);
    check its summary (each image preprocessed once in the fleet); the hosts' lines."""
    root = Path(__file__).resolve().parent.parent
    args = ["--redis", url, "--hosts", "3", "--images", str(images), *extra]
    with subprocess.Popen(
        [sys.executable, str(root / "examples" / "fleet_app.py"), *args],
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the example and the hosts it started
    sweep(prefix="fleet-example-")
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    lines = [json.loads(line) for line in out.splitlines()]
    hosts_out, summary = lines[:-1], lines[-1]
    assert summary == {"images": images, "hosts": 3, "preprocessings_in_the_fleet": images}
    return hosts_out


# --- a Redis Cluster ---------------------------------------------------------------------------


@e2e
@pytest.mark.slow
async def test_a_redis_cluster_serves_as_the_tier(make_config: Any, shm_name: str) -> None:
    try:
        cluster = RedisCluster(3)
    except RuntimeError as exc:  # pragma: no cover - the machine cannot run one
        pytest.skip(f"a Redis Cluster would not start here: {exc}")
    with cluster:
        calls: list[str] = []
        hashes = [f"c{i}" for i in range(8)]  # spread over the masters' slots
        # the subject is the cluster, not the machine's load: the clients discover the nodes
        # before the look-ups, and a look-up has a deadline a busy machine does not reach (one
        # answered late is made instead: host b "preprocessed" c0 in a loaded CI run, its
        # look-up late beside another run's stress tests, load ~20 on two CPUs)
        t1 = _tier(cluster.url, cluster=True, lookup_timeout_s=60.0)
        t2 = _tier(cluster.url, cluster=True, lookup_timeout_s=60.0)
        async with _cache(make_config, t1) as a, _cache(make_config, t2, name=shm_name + "b") as b:
            for t in (t1, t2):  # (the client's own socket timeouts may fire on a busy machine)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        await t._client.initialize()
                        break
                    except aioredis.RedisError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
            with ReceiverCache.attach(b.handle()) as rb:
                for h in hashes:
                    await a.get_or_put(h, _maker(h, calls))
                assert await t1.flush(60)
                sent = _record_commands(t2)
                for h in hashes:
                    _check(rb, await b.get_or_put(h, _maker(h, calls)), h)
        assert calls == hashes, "host b preprocessed items the cluster had"
        assert [name for name, _ in sent] == ["EVALSHA", "GET"] * len(hashes)  # one slot each
        assert t1.stats().writes == len(hashes) and t2.stats().hits == len(hashes)
        assert t1.stats().errors == t2.stats().errors == 0
        slots = set()
        client = aioredis.RedisCluster.from_url(cluster.url)
        try:
            for h in hashes:
                v, lk = value_key(t1.keyspace, h), lease_key(t1.keyspace, h)
                assert client.keyslot(v) == client.keyslot(lk)
                slots.add(client.keyslot(v))
        finally:
            await client.aclose()
        assert len(slots) > 1


@e2e
@pytest.mark.slow
@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "cpu_hog"])
def test_three_hosts_share_items_of_one_size_with_the_learned_policy(
    redis_server: RedisServer, request: pytest.FixtureRequest, loaded: bool
) -> None:
    """40 items of 256 KiB, 50 ms makes, 8 requests at a time per host, the default policy
    and deadlines: every item is made once, and every make beyond that is one the tier
    counted a reason for (a look-up answered after its deadline, a wait that timed out, a
    Redis error; never a skip or a bypass), quiet or beside a CPU hog.

    Load decides how many look-ups are late (beside this CI's own load, 45 of 40 were seen
    once, each extra make a counted late answer), so the bound is the counted reasons, not a
    fixed number; the per-item figure is the fleet benchmark's (1.00 quiet and beside a hog).
    Before: 94-98 of 120 on a quiet machine (the one-size fit gave a budget of 0: the extra
    makes were skips, which this test counts as no reason). A make is 50 ms of CPU work, as a
    preprocessing is: on a loaded host it takes longer, as a fetch does."""
    if loaded:
        request.getfixturevalue("cpu_hog")
    hashes = [f"one{i}" for i in range(40)]
    kw = {"policy": None, "lookup_timeout_s": 0.05}  # the defaults a user gets
    orders = [random.Random(k).sample(hashes, len(hashes)) for k in range(3)]
    results = _run_hosts(redis_server.url, orders, kw, 0.05, nbytes=256 * KiB, at_once=8, cpu=1)
    made = [h for r in results for h in r["made"]]
    assert all(r["bad"] == 0 for r in results)
    keys = ("hits", "claims", "waits", "wait_timeouts", "late", "timeouts", "skipped", "bypassed")
    seen = [{k: r["stats"][k] for k in keys} | r["stats"]["policy"] for r in results]
    reasons = sum(
        st[k] for st in seen for k in ("late", "wait_timeouts", "timeouts")
    )  # not a skip or a bypass: with make >> fetch and Redis up, neither is right
    assert set(made) == set(hashes), seen
    assert len(made) - len(hashes) <= reasons, (
        f"{len(made)} preprocessings of 40 items, {reasons} counted reasons; tier stats {seen}"
    )
    assert sum(st["hits"] for st in seen) > 0, seen  # the hosts shared through Redis


@e2e
def test_a_redis_server_never_takes_another_s_on_its_port_for_its_own(
    redis_server: RedisServer,
) -> None:
    """A port free a moment ago may be another run's server by the time ours starts (or
    restarts after ``kill``): ours then exits, and the start says so instead of passing the
    other's answers off as its own (two runs would share one Redis, each one's data the
    other's)."""
    with pytest.raises(RuntimeError, match="exited at start"):
        RedisServer(port=redis_server.port)
    assert redis_server.proc is not None and redis_server.proc.poll() is None


@pytest.mark.parametrize(
    ("args", "secret", "what"),
    [
        (["--lookup-timeout", "-1"], None, "lookup_timeout_s"),
        (["--redis", "http://127.0.0.1:6379/0"], None, "scheme"),
        (["--hosts", "0"], None, "--hosts"),
        ([], "short", "secret"),
    ],
    ids=["timeout", "url", "hosts", "secret"],
)
def test_the_fleet_example_refuses_a_bad_argument_in_one_line_at_once(
    args: list[str], secret: str | None, what: str
) -> None:
    """Before: each host process died on it with a traceback, and the example waited 120 s for
    their results, then crashed with ``queue.Empty``. Now: one usage line, exit 2, no host."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("AIOSHM_TIER_SECRET", None)
    if secret is not None:
        env["AIOSHM_TIER_SECRET"] = secret
    cmd = [sys.executable, str(root / "examples" / "fleet_app.py"), "--images", "1", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "error:" in last and what in last, last
