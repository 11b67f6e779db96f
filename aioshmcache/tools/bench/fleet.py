"""``bench --suite fleet``: the Redis tier (``aioshmcache.tier``) across simulated hosts.

* **Preprocessings per distinct item.** A Zipf trace over ``items`` images of 0.5-8 MiB
  (log-uniform sizes; ``--quick``: fewer, smaller) is split round-robin over 4 *hosts*: spawned
  processes, each with its own ``AsyncSenderCache`` and nothing shared but a private
  ``redis-server``. Every host serves its share through ``get_or_put`` (a few requests at once)
  with a preprocessing that burns 20 ms of CPU. Counted: preprocessings per distinct item
  requested, without a tier (about 4: every host makes what it sees) and with a ``RedisTier``
  (target <= 1.05), split by the cost policy's decision: items it fetches and items it makes
  because fetching them would lose.
* **A tier hit.** ``get_or_put`` on a second host of an item another host made, 1 / 4 / 16 MiB
  (a policy that always fetches, to show the raw cost), next to a local hit (shared memory)
  and the preprocessing; and the fetch budget a learning policy arrives at (the largest item it
  still fetches rather than makes).
* **Redis killed halfway.** One host serves a Zipf trace while Redis holds what another host
  made; Redis is SIGKILLed halfway: failed requests (target 0), requests per second before and
  after, and the p99 latency after the kill against the same trace served without a tier
  (target: added latency <= ``lookup_timeout_s`` + 5 ms).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from aioshmcache import AsyncSenderCache, CacheConfig
from aioshmcache.tier import RedisTier, TierPolicy

from ..progress import Progress
from ..redis_server import RedisServer, redis_binaries
from ..units import KiB, MiB
from .params import Params, segment_prefix
from .report import Report, Row, Target
from .timing import Samples, percentile

__all__ = ["run_fleet_suite"]

S_ZIPF = "Fleet: preprocessings per distinct item, 4 hosts, Zipf trace"
S_HIT = "Fleet: a tier hit (second host) vs a local hit and the preprocessing"
S_KILL = "Fleet: Redis killed halfway through a run"

MAKE_S = 0.020  # CPU seconds of one preprocessing
ZIPF_S = 1.1
HOSTS = 4
SECRET = b"aioshmcache-bench-fleet-secret!!"
LOOKUP_TIMEOUT_S = 0.05


_BLOCK = bytes(256 * KiB)


def spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time without holding the GIL (a preprocessing).

    Real preprocessing (image decoding, resizing, normalising in numpy) runs mostly in C with
    the GIL released; a pure-Python busy loop would instead starve the host's event loop and
    measure the GIL, not the tier. Hashing 256 KiB blocks releases the GIL for each block.
    """
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(_BLOCK).digest()


def item_sizes(items: int, lo: int, hi: int, seed: int = 7) -> list[int]:
    """Per item, a log-uniform size in ``[lo, hi]`` (multiples of 4 KiB)."""
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(math.log(lo), math.log(hi), items))
    return [int(x) // (4 * KiB) * (4 * KiB) for x in raw]


def zipf_trace(n: int, items: int, *, seed: int = 0) -> list[int]:
    """``n`` item indices, item ``i`` with probability proportional to 1 / (i+1)^s."""
    w = 1.0 / np.arange(1, items + 1, dtype=np.float64) ** ZIPF_S
    return [int(i) for i in np.random.default_rng(seed).choice(items, size=n, p=w / w.sum())]


def preprocess(i: int, size: int) -> dict[str, Any]:
    """20 ms of CPU, then the item (deterministic bytes)."""
    spin(MAKE_S)
    return {"pixel_values": np.full(size, i % 251, np.uint8), "image_size": np.array([224, 224])}


#: the Zipf hosts' look-up deadline: 4 hosts x 4 preprocessings on a 2-CPU machine (plus Redis)
#: delay a process's scheduling by more than the default 50 ms, which is not what is measured
ZIPF_LOOKUP_TIMEOUT_S = 0.5


def always_fetch() -> TierPolicy:
    """The cost policy switched off: every item is stored, every value fetched."""
    return TierPolicy(learn=False, explore_every=0, prior_fixed_s=0.0, prior_per_byte_s=0.0)


def _tier(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("lookup_timeout_s", LOOKUP_TIMEOUT_S)
    return RedisTier(url, secret=SECRET, max_wait_s=10.0, **kw)


async def _serve(
    cache: AsyncSenderCache, trace: Sequence[int], sizes: Sequence[int], concurrency: int
) -> dict[str, Any]:
    """Serve ``trace`` with ``concurrency`` requests at once; per-request latency and makes."""
    made: list[int] = []
    latencies: list[float] = [math.nan] * len(trace)
    failures = 0
    nxt = 0

    async def worker() -> None:
        nonlocal nxt, failures
        while nxt < len(trace):
            k = nxt
            nxt += 1
            i = trace[k]

            def make(i: int = i) -> dict[str, Any]:
                made.append(i)
                return preprocess(i, sizes[i])

            t0 = time.perf_counter()
            try:
                await cache.get_or_put(f"img{i}", make)
            except Exception:
                failures += 1
            latencies[k] = time.perf_counter() - t0

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "made": made,
        "latencies": latencies,
        "failures": failures,
        "seconds": time.perf_counter() - t0,
    }


def _host(
    url: str | None,
    always: bool,
    name: str,
    trace: list[int],
    sizes: list[int],
    capacity: int,
    barrier: Any,
    out: Any,
) -> None:
    """One simulated host (a spawned process): its own cache, the shared Redis if any."""

    async def main() -> None:
        policy = always_fetch() if always else None
        tier = _tier(url, policy=policy, lookup_timeout_s=ZIPF_LOOKUP_TIMEOUT_S) if url else None
        cfg = CacheConfig(capacity, max(sizes) + MiB, 1, name=name)
        async with AsyncSenderCache.from_config(cfg, tier=tier) as cache:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 300)
            res = await _serve(cache, trace, sizes, 4)
            if tier is not None:
                await tier.flush(60)
                st = tier.stats()
                res["tier"] = st.to_dict()
                res["budget"] = st.policy.budget_bytes if st.policy else 0
        out.put(res)

    asyncio.run(main())


def _fleet_run(
    url: str | None, trace: list[int], sizes: list[int], capacity: int, *, always: bool = False
) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(HOSTS), ctx.Queue()
    tag = f"{segment_prefix()}fl{'t' if url else 'n'}{time.monotonic_ns() % 10**6}"
    procs = [
        ctx.Process(
            target=_host,
            args=(url, always, f"{tag}-{k}", trace[k::HOSTS], sizes, capacity, barrier, out),
        )
        for k in range(HOSTS)
    ]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)


def bench_zipf(p: Params, report: Report, progress: Progress) -> None:
    items, n_req = (200, 1600) if p.quick else (2000, 8000)
    lo, hi = (256 * KiB, 2 * MiB) if p.quick else (MiB // 2, 8 * MiB)
    sizes = item_sizes(items, lo, hi)
    trace = zipf_trace(n_req, items)
    distinct = sorted(set(trace))
    capacity = (256 if p.quick else 768) * MiB
    param = f"{n_req} req, {len(distinct)} of {items} items, {lo // KiB} KiB-{hi // MiB} MiB"
    progress(f"fleet: {param}, 4 hosts without a tier")
    runs = {"no tier": _fleet_run(None, trace, sizes, capacity)}
    redis_args = ["--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"]
    for label, always in (("RedisTier", False), ("RedisTier, policy off (always fetch)", True)):
        progress(f"fleet: the same with a {label}")
        with RedisServer(extra_args=redis_args) as r:
            runs[label] = _fleet_run(r.url, trace, sizes, capacity, always=always)
    failures = sum(res["failures"] for results in runs.values() for res in results)
    if failures:
        raise RuntimeError(f"{failures} requests failed")
    base_s = max(res["seconds"] for res in runs["no tier"])
    for label, results in runs.items():
        made = [i for res in results for i in res["made"]]
        lat = [x for res in results for x in res["latencies"]]
        wall = max(res["seconds"] for res in results)
        tiers = [res["tier"] for res in results if "tier" in res]
        note = f"wall {wall:.1f} s ({base_s / wall:.2f}x the no-tier run), mean request "
        note += f"{float(np.mean(lat)) * 1e3:.1f} ms"
        if tiers:
            hits = sum(t["hits"] for t in tiers)
            waits = sum(t["waits"] for t in tiers)
            skips = sum(t["skipped"] + t["skipped_writes"] for t in tiers)
            fails = sum(t["errors"] + t["timeouts"] for t in tiers)
            bypassed = sum(t["bypassed"] for t in tiers)
            dropped = sum(t["dropped_writes"] for t in tiers)
            note += f"; {hits} tier hits, {waits} waits for another host, {skips} policy skips, "
            note += f"{fails} Redis errors/timeouts, {bypassed} bypassed, {dropped} dropped writes"
        report.add(
            Row(
                S_ZIPF,
                f"preprocessings per distinct item, {label}",
                param,
                len(made) / len(distinct),
                kind="ratio",
                target=Target("value", "<=", 1.05) if label.startswith("RedisTier") else None,
                note=note,
            )
        )
    # the policy's decision: the items it fetches and the items it makes on every host
    learned = runs["RedisTier"]
    budget = min(res.get("budget", 0) for res in learned)
    counts = dict.fromkeys(distinct, 0)
    for res in learned:
        for i in res["made"]:
            counts[i] += 1
    for label, group in (
        (
            f"RedisTier, items under the learned budget ({budget / MiB:.1f} MiB)",
            [i for i in distinct if sizes[i] < budget],
        ),
        (
            "RedisTier, items over it (fetching would lose)",
            [i for i in distinct if sizes[i] >= budget],
        ),
    ):
        if group:
            report.add(
                Row(
                    S_ZIPF,
                    f"preprocessings per distinct item, {label}",
                    f"{len(group)} items",
                    sum(counts[i] for i in group) / len(group),
                    kind="ratio",
                )
            )


def bench_hit(p: Params, report: Report, progress: Progress) -> None:
    sizes = [MiB, 4 * MiB, 16 * MiB]
    reps = 3 if p.quick else 10
    progress("fleet: tier hit latency, 1 / 4 / 16 MiB")
    with RedisServer() as r:
        asyncio.run(_hit(r.url, sizes, reps, max(3, p.runs), report))


def _not_made() -> None:
    raise RuntimeError("a tier hit ran make (the tier missed)")


async def _hit(url: str, sizes: list[int], reps: int, runs: int, report: Report) -> None:
    tag = f"{segment_prefix()}flh{time.monotonic_ns() % 10**6}"
    # the raw cost of a hit: a policy that always fetches, and a deadline no fetch here reaches
    always = {"policy": always_fetch(), "lookup_timeout_s": 5.0}
    cfg = CacheConfig(160 * MiB, 20 * MiB, 1)
    a_tier, b_tier, c_tier = _tier(url, **always), _tier(url, **always), _tier(url)
    a = AsyncSenderCache.from_config(dataclasses.replace(cfg, name=f"{tag}a"), tier=a_tier)
    b = AsyncSenderCache.from_config(dataclasses.replace(cfg, name=f"{tag}b"), tier=b_tier)
    c = AsyncSenderCache.from_config(dataclasses.replace(cfg, name=f"{tag}c"), tier=c_tier)
    async with a, b, c:
        for size in sizes:
            h = f"hit{size}"
            make_it = functools.partial(preprocess, 1, size)
            await a.get_or_put(h, make_it)
            await a_tier.flush(60)
            tier_hit, local_hit, make = Samples(), Samples(), Samples()
            for _ in range(runs):
                trun, lrun, mrun = tier_hit.new_run(), local_hit.new_run(), make.new_run()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    await b.get_or_put(h, _not_made)  # the tier has it
                    trun.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    await b.get_or_put(h, _not_made)  # in shared memory now
                    lrun.append(time.perf_counter() - t0)
                    await b.invalidate(h)
                    t0 = time.perf_counter()
                    preprocess(1, size)
                    mrun.append(time.perf_counter() - t0)
                    await c.get_or_put(h, make_it)
                    await c.invalidate(h)  # the learning policy sees fetches and makes
            param = f"{size // MiB} MiB"
            ms, ts, ls = make.stat(), tier_hit.stat(), local_hit.stat()
            report.add(
                Row(S_HIT, "the preprocessing (20 ms CPU + fill)", param, ms.median, stat=ms)
            )
            report.add(
                Row(
                    S_HIT,
                    "tier hit: get_or_put on a second host",
                    param,
                    ts.median,
                    stat=ts,
                    baseline="preprocessing",
                    ratio=ms.median / ts.median,
                    target=Target("ratio", ">=", 2.0) if size == 4 * MiB else None,
                )
            )
            report.add(
                Row(
                    S_HIT,
                    "local hit: get_or_put, in shared memory",
                    param,
                    ls.median,
                    stat=ls,
                    baseline="preprocessing",
                    ratio=ms.median / ls.median,
                )
            )
        view = c_tier.policy.view(c_tier.max_item_bytes)
        report.add(
            Row(
                S_HIT,
                "learned fetch budget: the largest item fetched rather than made",
                f"fetch {view.fetch_fixed_s * 1e3:.2f} ms + {view.fetch_per_byte_s * 1e9:.2f} ns/B",
                view.budget_bytes,
                kind="bytes",
                note=f"make {view.make_fixed_s * 1e3:.1f} ms; margin {c_tier.policy.margin}",
            )
        )


def bench_kill(p: Params, report: Report, progress: Progress) -> None:
    items, n_req = (60, 240) if p.quick else (300, 1500)
    sizes = item_sizes(items, 256 * KiB, MiB, seed=3)
    trace = zipf_trace(n_req, items, seed=5)
    progress(f"fleet: {n_req} requests, Redis killed halfway")
    with RedisServer() as r:
        asyncio.run(_kill(r, trace, sizes, report))


async def _kill(r: RedisServer, trace: list[int], sizes: list[int], report: Report) -> None:
    tag = f"{segment_prefix()}flk{time.monotonic_ns() % 10**6}"
    cfg = CacheConfig(256 * MiB, 2 * MiB, 1)
    half = len(trace) // 2
    # another host has made every item already: Redis holds them
    maker = _tier(r.url)
    async with AsyncSenderCache.from_config(
        dataclasses.replace(cfg, name=f"{tag}w"), tier=maker
    ) as w:
        await _serve(w, sorted(set(trace)), sizes, 4)
        await maker.flush(120)
    async with AsyncSenderCache.from_config(dataclasses.replace(cfg, name=f"{tag}n")) as plain:
        base = await _serve(plain, trace, sizes, 4)
    tier = _tier(r.url)
    async with AsyncSenderCache.from_config(
        dataclasses.replace(cfg, name=f"{tag}t"), tier=tier
    ) as cache:
        first = await _serve(cache, trace[:half], sizes, 4)
        r.kill()
        second = await _serve(cache, trace[half:], sizes, 4)
    failures = first["failures"] + second["failures"]
    param = f"{len(trace)} req, {len(set(trace))} items 256 KiB-1 MiB, 4 at once"
    report.add(
        Row(
            S_KILL,
            "failed requests",
            param,
            failures,
            kind="count",
            target=Target("value", "<=", 0),
        )
    )
    base_rate = len(trace) / base["seconds"]
    for label, res, n in (
        ("req/s with the tier, Redis up (first half)", first, half),
        ("req/s with the tier, Redis killed (second half)", second, len(trace) - half),
    ):
        report.add(
            Row(
                S_KILL,
                label,
                param,
                n / res["seconds"],
                kind="rate",
                baseline="no tier",
                ratio=n / res["seconds"] / base_rate,
            )
        )
    p99_base = percentile(base["latencies"][half:], 99)
    p99_dead = percentile(second["latencies"], 99)
    st = tier.stats()
    report.add(
        Row(
            S_KILL,
            "added p99 latency after the kill (vs the same requests without a tier)",
            param,
            max(0.0, p99_dead - p99_base),
            target=Target("value", "<=", LOOKUP_TIMEOUT_S + 0.005),
            note=f"p99 {p99_dead * 1e3:.1f} ms vs {p99_base * 1e3:.1f} ms; {st.errors} errors, "
            f"{st.timeouts} timeouts, breaker opened {st.breaker_opens}x, {st.bypassed} bypassed",
        )
    )


def run_fleet_suite(p: Params, report: Report, progress: Progress) -> None:
    """The fleet suite (``--suite fleet``)."""
    if redis_binaries() is None:
        report.skip("fleet: redis-server is not installed (apt-get install redis-server)")
        return
    try:
        import redis
        import redis.asyncio
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        report.skip("fleet: the redis client is not installed (pip install 'aioshmcache[fleet]')")
        return
    report.notes.append(
        f"fleet: preprocessing = {MAKE_S * 1e3:.0f} ms of CPU (GIL released); {HOSTS} hosts = "
        f"{HOSTS} processes on this machine ({os.cpu_count()} CPUs); Redis on localhost; "
        f"lookup_timeout_s {ZIPF_LOOKUP_TIMEOUT_S} s for the Zipf hosts, else "
        f"{LOOKUP_TIMEOUT_S} s (the default); redis-py {redis.__version__} with "
        f"{'hiredis' if HIREDIS_AVAILABLE else 'its pure-Python parser (hiredis not installed)'}"
    )
    report.attempt("fleet: tier hit latency", lambda: bench_hit(p, report, progress))
    report.attempt("fleet: Redis killed", lambda: bench_kill(p, report, progress))
    report.attempt("fleet: Zipf preprocessings", lambda: bench_zipf(p, report, progress))
