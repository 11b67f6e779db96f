"""``bench --suite fleet``: the Redis tier (``aioshmcache.tier``) across simulated hosts.

* **Preprocessings per distinct item.** A Zipf trace over 2,000 images of 0.5-8 MiB is split
  over 4 *hosts* (spawned processes with their own caches, sharing only a ``redis-server``),
  each serving its share through ``get_or_put`` (4 at once) with a 20 ms CPU preprocessing:
  without a tier, with a ``RedisTier`` (target <= 1.05; split by the policy's fetch budget) and
  with the cost policy off (store and fetch everything).
* **A tier hit** on a second host, 1 / 4 / 16 MiB (a policy that always fetches: the raw cost),
  next to a local hit and the preprocessing; and the budget a learning policy arrives at.
* **Items of one size** (where a regression of cost on size has nothing to fit): 3 hosts each
  ask for every one of 40 (quick) or 120 items of 256 KiB, in their own shuffled order, 8 at a
  time, a 50 ms CPU preprocessing, the tier at its defaults; quiet, then *loaded* beside a CPU
  hog (4 busy processes), each with its no-tier baseline in the same run (target <= 1.1).
* **Redis killed halfway.** One host serves a Zipf trace from Redis; Redis is SIGKILLed
  halfway: failed requests (target 0), req/s, and the p99 after the kill against the same
  requests without a tier run next to it (target: added <= ``lookup_timeout_s`` + 5 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from aioshmcache import AsyncSenderCache, CacheConfig
from aioshmcache.tier import RedisTier, TierConfig, TierPolicy

from ..progress import Progress
from ..redis_server import RedisServer
from ..units import KiB, MiB
from .params import Params, bench_config
from .peers import redis_missing
from .procs import run_spawned
from .report import Report, Target
from .timing import Samples, atimed, percentile, timed
from .trace import item_sizes, zipf_trace

__all__ = ["run_fleet_suite"]

S_ZIPF = "Fleet: preprocessings per distinct item, 4 hosts, Zipf trace"
S_HIT = "Fleet: a tier hit (second host) vs a local hit and the preprocessing"
S_KILL = "Fleet: Redis killed halfway through a run"
S_ONE = "Fleet: items of one size, 3 hosts, each asks for every item"
PER_ITEM = "preprocessings per distinct item"

MAKE_S = 0.020  # CPU seconds of one preprocessing
HOSTS = 4
ZIPF_S = 1.1  # the skew of every trace
SECRET = b"aioshmcache-bench-fleet-secret!!"
LOOKUP_TIMEOUT_S = 0.05
#: the Zipf hosts' look-up deadline: 4 hosts x 4 preprocessings on a 2-CPU machine (plus Redis)
#: delay a process's scheduling by more than the default 50 ms, which is not what is measured
ZIPF_LOOKUP_TIMEOUT_S = 0.5
_BLOCK = bytes(256 * KiB)


def spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time without holding the GIL (a preprocessing).

    Real preprocessing runs mostly in C with the GIL released; a pure-Python loop would measure
    the GIL, not the tier. Hashing 256 KiB blocks releases the GIL for each block.
    """
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(_BLOCK).digest()


def preprocess(i: int, size: int, make_s: float = MAKE_S) -> dict[str, Any]:
    """``make_s`` (20 ms) of CPU, then the item (deterministic bytes)."""
    spin(make_s)
    return {"pixel_values": np.full(size, i % 251, np.uint8), "image_size": np.array([224, 224])}


#: a busy loop that also ends when its parent is gone, however that ended
_BUSY = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@contextlib.contextmanager
def cpu_hog(n: int = 4) -> Iterator[list[int]]:
    """``n`` busy-loop processes while the block runs (a loaded host); their pids.

    Killed on every path (an exception, a timeout), and each ends by itself if its parent dies.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.extend(
            subprocess.Popen([sys.executable, "-c", _BUSY], start_new_session=True)
            for _ in range(n)
        )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(30)


def always_fetch() -> TierPolicy:
    """The cost policy switched off: every item is stored, every value fetched."""
    return TierPolicy(learn=False, explore_every=0, prior_fixed_s=0.0, prior_per_byte_s=0.0)


def _tier(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("lookup_timeout_s", LOOKUP_TIMEOUT_S)
    return RedisTier(url, secret=SECRET, config=TierConfig(max_wait_s=10.0), **kw)


async def _serve(
    cache: AsyncSenderCache,
    trace: Sequence[int],
    sizes: Sequence[int],
    concurrency: int = 4,
    make_s: float = MAKE_S,
) -> dict[str, Any]:
    """Serve ``trace`` with ``concurrency`` requests at once; per-request latency and makes."""
    made: list[int] = []
    latencies = [math.nan] * len(trace)
    failures = 0
    todo = iter(enumerate(trace))

    async def worker() -> None:
        nonlocal failures
        for k, i in todo:

            def make(i: int = i) -> dict[str, Any]:
                made.append(i)
                return preprocess(i, sizes[i], make_s)

            t0 = time.perf_counter()
            try:
                await cache.get_or_put(f"img{i}", make)
            except Exception:
                failures += 1
            latencies[k] = time.perf_counter() - t0

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    return {"made": made, "latencies": latencies, "failures": failures, "seconds": seconds}


def _host(
    url: str | None, always: bool, cfg: CacheConfig, work: Any, barrier: Any, out: Any
) -> None:
    """One simulated host (a spawned process): its own cache, the shared Redis if any.

    ``work``: its trace, every item's size, its requests at a time, its look-up deadline and
    the CPU seconds of a preprocessing;
    ``barrier`` and ``out``: see :func:`.run_spawned`.
    """
    trace, sizes, concurrency, lookup_timeout_s, make_s = work

    async def main() -> None:
        policy = always_fetch() if always else None
        tier = _tier(url, policy=policy, lookup_timeout_s=lookup_timeout_s) if url else None
        async with AsyncSenderCache.from_config(cfg, tier=tier) as cache:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 300)
            res = await _serve(cache, trace, sizes, concurrency, make_s)
            if tier is not None:
                await tier.flush(60)
                res["tier"] = tier.stats().to_dict()
        out.put(res)

    asyncio.run(main())


def _fleet_run(
    url: str | None, trace: list[int], sizes: list[int], capacity: int, always: bool = False
) -> list[dict[str, Any]]:
    cfg = functools.partial(bench_config, capacity, max(sizes) + MiB)
    work = [(trace[k::HOSTS], sizes, 4, ZIPF_LOOKUP_TIMEOUT_S, MAKE_S) for k in range(HOSTS)]
    return run_spawned(_host, [(url, always, cfg(), w) for w in work], timeout=1800)


def bench_one_size(p: Params, report: Report, progress: Progress) -> None:
    """Items of one size: the cost policy's fits have one point (see the module docstring)."""
    items, size, hosts = (40 if p.quick else 120), 256 * KiB, 3
    sizes = [size] * items
    orders = [random.Random(k).sample(range(items), items) for k in range(hosts)]
    cfg = functools.partial(bench_config, 64 * MiB, 2 * MiB)

    def run(url: str | None) -> list[dict[str, Any]]:
        args = [(url, False, cfg(), (o, sizes, 8, LOOKUP_TIMEOUT_S, 0.05)) for o in orders]
        return run_spawned(_host, args, timeout=1800)

    param = f"{items} items of {size // KiB} KiB, {hosts} hosts, 8 at a time, 50 ms CPU makes"
    add = report.section(S_ONE, param, kind="ratio")
    for load in ("quiet", "loaded (4 busy processes beside)"):
        hog: contextlib.AbstractContextManager[list[int]]
        hog = cpu_hog() if load != "quiet" else contextlib.nullcontext([])
        with hog:
            progress(f"fleet: one size, {load}, no tier")
            runs = {"no tier": run(None)}
            progress(f"fleet: one size, {load}, RedisTier")
            with RedisServer() as r:
                runs["RedisTier"] = run(r.url)
        for label, results in runs.items():
            if sum(res["failures"] for res in results):
                raise RuntimeError("requests failed")
            made = sum(len(res["made"]) for res in results)
            wall = max(res["seconds"] for res in results)
            note = f"wall {wall:.1f} s"
            if label != "no tier":
                note += _tier_note([res["tier"] for res in results])
            target = None if label == "no tier" else Target("<=", 1.1)
            add(f"{PER_ITEM}, {label}, {load}", made / items, note=note, target=target)


def _tier_note(tiers: list[dict[str, Any]]) -> str:
    """What the hosts' tiers counted (the non-zero counters, summed) and what their policies
    learned (median)."""
    counted = (k for k, v in tiers[0].items() if isinstance(v, int) and not isinstance(v, bool))
    sums = {k: sum(t[k] for t in tiers) for k in counted}
    note = "; tier " + ", ".join(f"{k} {v}" for k, v in sums.items() if v)
    views = [t["policy"] for t in tiers if t["policy"] and t["policy"]["makes_seen"]]
    if views:  # a learning policy (one that does not learn has seen no make)
        med = {k: float(np.median([v[k] for v in views])) for k in views[0]}
        note += (
            f"; learned (median of hosts): make {med['make_fixed_s'] * 1e3:.0f} ms, probe "
            f"{med['probe_s'] * 1e3:.1f} ms, fetch {med['fetch_fixed_s'] * 1e3:.1f} ms + "
            f"{med['fetch_per_byte_s'] * MiB * 1e3:.1f} ms/MiB"
        )
    return note


def bench_zipf(p: Params, report: Report, progress: Progress) -> None:
    items, n_req = (200, 1600) if p.quick else (2000, 8000)
    lo, hi = (256 * KiB, 2 * MiB) if p.quick else (MiB // 2, 8 * MiB)
    sizes = item_sizes(items, lo, hi, seed=7).tolist()
    trace = zipf_trace(n_req, items, ZIPF_S, seed=0).tolist()
    distinct = sorted(set(trace))
    capacity = (256 if p.quick else 768) * MiB
    param = f"{n_req} req, {len(distinct)} of {items} items, {lo // KiB} KiB-{hi // MiB} MiB"
    add = report.section(S_ZIPF, param, kind="ratio")
    progress(f"fleet: {param}, 4 hosts without a tier")
    runs = {"no tier": _fleet_run(None, trace, sizes, capacity)}
    redis_args = ["--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"]
    for label, always in (("RedisTier", False), ("RedisTier, policy off (always fetch)", True)):
        progress(f"fleet: the same with a {label}")
        with RedisServer(extra_args=redis_args) as r:
            runs[label] = _fleet_run(r.url, trace, sizes, capacity, always)
    failures = sum(res["failures"] for results in runs.values() for res in results)
    if failures:
        raise RuntimeError(f"{failures} requests failed")
    base_s = max(res["seconds"] for res in runs["no tier"])
    for label, results in runs.items():
        made = [i for res in results for i in res["made"]]
        lat = [x for res in results for x in res["latencies"]]
        wall = max(res["seconds"] for res in results)
        note = f"wall {wall:.1f} s ({base_s / wall:.2f}x the no-tier run), mean request "
        note += f"{float(np.mean(lat)) * 1e3:.1f} ms"
        if label != "no tier":
            note += _tier_note([res["tier"] for res in results])
        target = None if label == "no tier" else Target("<=", 1.05)
        add(f"{PER_ITEM}, {label}", len(made) / len(distinct), note=note, target=target)
    # the policy's decision: the items it fetches and the items it makes on every host
    learned = runs["RedisTier"]
    budget = min(res["tier"]["policy"]["budget_bytes"] for res in learned)
    makes = Counter(i for res in learned for i in res["made"])
    under = [i for i in distinct if sizes[i] < budget]
    for label, group in (
        (f"under the learned budget ({budget / MiB:.1f} MiB)", under),
        ("over it (fetching would lose)", [i for i in distinct if sizes[i] >= budget]),
    ):
        if group:
            n = sum(makes[i] for i in group) / len(group)
            add(f"{PER_ITEM}, RedisTier, items {label}", n, param=f"{len(group)} items")


def _not_made() -> None:
    raise RuntimeError("a tier hit ran make (the tier missed)")


async def bench_hit(p: Params, report: Report, progress: Progress) -> None:
    progress("fleet: tier hit latency, 1 / 4 / 16 MiB")
    reps, runs = 3 if p.quick else 10, max(3, p.runs)
    with RedisServer() as r:
        # the raw cost of a hit: a policy that always fetches, and a deadline no fetch here reaches
        a_tier, b_tier = (_tier(r.url, policy=always_fetch(), lookup_timeout_s=5.0) for _ in "ab")
        c_tier = _tier(r.url)
        a, b, c = (
            AsyncSenderCache.from_config(bench_config(160 * MiB, 20 * MiB), tier=t)
            for t in (a_tier, b_tier, c_tier)
        )
        async with a, b, c:
            for size in (MiB, 4 * MiB, 16 * MiB):
                h, make_it = f"hit{size}", functools.partial(preprocess, 1, size)
                await a.get_or_put(h, make_it)
                await a_tier.flush(60)
                tier_hit, local_hit, make = Samples(), Samples(), Samples()
                for _ in range(runs):
                    trun, lrun, mrun = tier_hit.new_run(), local_hit.new_run(), make.new_run()
                    for _ in range(reps):
                        for run in (trun, lrun):  # the tier has it; then shared memory has it
                            await atimed(run, b.get_or_put(h, _not_made))
                        await b.invalidate(h)
                        timed(mrun, preprocess, 1, size)
                        await c.get_or_put(h, make_it)
                        await c.invalidate(h)  # the learning policy sees fetches and makes
                param, ms = f"{size // MiB} MiB", make.stat()
                target = Target(">=", 2.0, "ratio") if size == 4 * MiB else None
                add, vs = report.section(S_HIT, param), ("preprocessing", ms)
                add("the preprocessing (20 ms CPU + fill)", ms)
                add("tier hit: get_or_put on a second host", tier_hit.stat(), vs=vs, target=target)
                add("local hit: get_or_put, in shared memory", local_hit.stat(), vs=vs)
            v = c_tier.policy.view(c_tier.max_item_bytes)
            fetch = f"fetch {v.fetch_fixed_s * 1e3:.2f} ms + {v.fetch_per_byte_s * 1e9:.2f} ns/B"
            note = f"make {v.make_fixed_s * 1e3:.1f} ms; probe {v.probe_s * 1e3:.2f} ms; margin "
            note += f"{c_tier.policy.margin}"
            label = "learned fetch budget: the largest item fetched rather than made"
            report.section(S_HIT, fetch)(label, v.budget_bytes, kind="bytes", note=note)


async def bench_kill(p: Params, report: Report, progress: Progress) -> None:
    items, n_req = (60, 240) if p.quick else (300, 1500)
    progress(f"fleet: {n_req} requests, Redis killed halfway")
    trace = zipf_trace(n_req, items, ZIPF_S, seed=5).tolist()
    sizes = item_sizes(items, 256 * KiB, MiB, seed=3).tolist()
    with RedisServer() as r:
        cfg = functools.partial(bench_config, 256 * MiB, 2 * MiB)
        half = len(trace) // 2
        maker = _tier(r.url)  # another host has made every item already: Redis holds them
        async with AsyncSenderCache.from_config(cfg(), tier=maker) as w:
            await _serve(w, sorted(set(trace)), sizes)
            await maker.flush(120)
        # each half without a tier beside it with one: p99s minutes apart compare the machine's load
        tier = _tier(r.url)
        async with (
            AsyncSenderCache.from_config(cfg()) as plain,
            AsyncSenderCache.from_config(cfg(), tier=tier) as cache,
        ):
            base_first = await _serve(plain, trace[:half], sizes)
            first = await _serve(cache, trace[:half], sizes)
            r.kill()
            second = await _serve(cache, trace[half:], sizes)
            base_second = await _serve(plain, trace[half:], sizes)
    param = f"{len(trace)} req, {len(set(trace))} items 256 KiB-1 MiB, 4 at once"
    add = report.section(S_KILL, param)
    failures = first["failures"] + second["failures"]
    add("failed requests", failures, kind="count", target=Target("<=", 0))
    for label, res, base in (
        ("req/s with the tier, Redis up (first half)", first, base_first),
        ("req/s with the tier, Redis killed (second half)", second, base_second),
    ):
        rate, ratio = len(res["latencies"]) / res["seconds"], base["seconds"] / res["seconds"]
        add(label, rate, kind="rate", baseline="no tier", ratio=ratio)
    p99_base, p99_dead = (percentile(res["latencies"], 99) for res in (base_second, second))
    st = tier.stats()
    note = f"p99 {p99_dead * 1e3:.1f} ms vs {p99_base * 1e3:.1f} ms; {st.errors} errors, "
    note += f"{st.timeouts} timeouts, breaker opened {st.breaker_opens}x, {st.bypassed} bypassed"
    label = "added p99 latency after the kill (vs the same requests without a tier)"
    added, target = max(0.0, p99_dead - p99_base), Target("<=", LOOKUP_TIMEOUT_S + 0.005)
    add(label, added, target=target, note=note)


def run_fleet_suite(p: Params, report: Report, progress: Progress) -> None:
    """The fleet suite (``--suite fleet``)."""
    if missing := redis_missing("fleet"):
        report.skip(f"fleet: {missing}")
        return
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    parser = "hiredis" if HIREDIS_AVAILABLE else "its pure-Python parser (hiredis not installed)"
    report.notes.append(
        f"fleet: preprocessing = {MAKE_S * 1e3:.0f} ms of CPU (GIL released); {HOSTS} hosts = "
        f"{HOSTS} processes on this machine ({os.cpu_count()} CPUs); Redis on localhost; "
        f"lookup_timeout_s {ZIPF_LOOKUP_TIMEOUT_S} s for the Zipf hosts, else "
        f"{LOOKUP_TIMEOUT_S} s (the default); redis-py {redis.__version__} with {parser}"
    )
    report.attempt("fleet: tier hit latency", lambda: asyncio.run(bench_hit(p, report, progress)))
    report.attempt("fleet: Redis killed", lambda: asyncio.run(bench_kill(p, report, progress)))
    report.attempt("fleet: one size", lambda: bench_one_size(p, report, progress))
    report.attempt("fleet: Zipf preprocessings", lambda: bench_zipf(p, report, progress))
