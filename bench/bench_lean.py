"""Issue 20 ("one lean path"): every entry point's cost for a 1 KiB miss, per item, against the
sync one-item call measured in the same run; the growth stall of a first lap; big copies against
a rotating ``np.copyto`` into shared memory.

``python bench/bench_lean.py [entry|lap|big] [--rounds N]``. Rounds are interleaved (every cell
once per round, in turn) and each figure is the median over rounds of the mean per call of a
batch; the ratio is against the ``sync item`` cell of the same run. The machine's load average is
printed with the results. Uses only the public API.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aioshmcache import (
    AsyncSenderCache,
    CacheConfig,
    FeatureSpec,
    SenderCache,
    ShmObjectStore,
)
from aioshmcache.tools.bench.timing import ShmBuffer

KiB, MiB = 1 << 10, 1 << 20
#: the entry cells are timed in this thread's CPU time: on a shared machine, time the process
#: spends descheduled is not the call's (the loop runs in this thread, so the async face's work
#: is counted in full)
_clock = time.thread_time
_names = itertools.count()


def _config(capacity: int, max_object: int, **kw: Any) -> CacheConfig:
    return CacheConfig(
        capacity, max_object, 1, name=f"bench-lean-{os.getpid()}-{next(_names)}", **kw
    )


def _load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def entry(rounds: int, batch: int) -> None:
    """1 KiB misses through every entry point (one writer, one reader slot, none attached)."""
    import uvloop

    item = {"data": np.arange(256, dtype=np.float32)}  # 1 KiB
    tx = SenderCache(_config(64 * MiB, 1 * MiB))
    store = ShmObjectStore.create(_config(64 * MiB, 1 * MiB))
    face = AsyncSenderCache(tx)
    keys = itertools.count()
    results: dict[str, list[float]] = {}

    def key() -> str:
        return f"k{next(keys)}"

    def sync_cells() -> dict[str, Callable[[], int]]:
        def put() -> int:
            for _ in range(batch):
                store.put(key(), item)
            return batch

        def one() -> int:
            for _ in range(batch):
                tx.get_and_update_item((item, ()), key())
            return batch

        def upd() -> int:
            for _ in range(batch):
                tx.get_and_update([(item, ())], [key()])
            return batch

        def feats() -> int:
            for _ in range(batch):
                tx.get_and_update_features([FeatureSpec(key(), item)])
            return batch

        def feats8() -> int:
            for _ in range(batch // 8):
                tx.get_and_update_features([FeatureSpec(key(), item) for _ in range(8)])
            return (batch // 8) * 8

        return {
            "store.put": put,
            "sync item": one,
            "sync get_and_update([1])": upd,
            "sync features([1])": feats,
            "sync features([8]) per item": feats8,
        }

    def async_cells() -> dict[str, Callable[[], Awaitable[int]]]:
        async def one() -> int:
            for _ in range(batch):
                await face.get_and_update_item((item, ()), key())
            return batch

        async def feats() -> int:
            for _ in range(batch):
                await face.get_and_update_features([FeatureSpec(key(), item)])
            return batch

        async def feats8() -> int:
            for _ in range(batch // 8):
                await face.get_and_update_features([FeatureSpec(key(), item) for _ in range(8)])
            return (batch // 8) * 8

        return {
            "async item": one,
            "async features([1])": feats,
            "async features([8]) per item": feats8,
        }

    async def main() -> None:
        sc, ac = sync_cells(), async_cells()
        for fn in sc.values():  # warm up
            fn()
        for afn in ac.values():
            await afn()
        for _ in range(rounds):
            for name, fn in sc.items():
                t0 = _clock()
                n = fn()
                results.setdefault(name, []).append((_clock() - t0) / n)
            for name, afn in ac.items():
                t0 = _clock()
                n = await afn()
                results.setdefault(name, []).append((_clock() - t0) / n)

    try:
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        with runner:
            runner.run(main())
    finally:
        tx.close()
        store.close()
    base = statistics.median(results["sync item"])
    print(
        f"## 1 KiB miss per item ({rounds} rounds x {batch} calls, uvloop, "
        f"thread CPU time; {_load()})"
    )
    print("| call | µs (median) | min..max | ÷ sync item |")
    print("|---|---|---|---|")
    for name, xs in results.items():
        m = statistics.median(xs)
        print(
            f"| {name} | {m * 1e6:.2f} | {min(xs) * 1e6:.2f}..{max(xs) * 1e6:.2f} "
            f"| {m / base:.2f} |"
        )
    sync1 = statistics.median(results["sync features([1])"])
    async1 = statistics.median(results["async features([1])"])
    print(f"async inline overhead (features([1])): {(async1 - sync1) * 1e6:.2f} µs")


def lap(capacity: int, item_bytes: int) -> None:
    """Fill a cache once with small items: the slowest puts (no ``gc.freeze()``)."""
    item = {"data": np.zeros(item_bytes // 4, dtype=np.float32)}
    tx = SenderCache(_config(capacity, 1 * MiB))
    wall, cpu, gcs = [], [], []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        gcs.append((phase, info["generation"], time.perf_counter()))

    gc.callbacks.append(on_gc)
    try:
        n = 0
        t_start = time.perf_counter()
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            tx.get_and_update_item((item, ()), f"lap{n}")
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            n += 1
            if tx.snapshot().evictions if n % 4096 == 0 else False:
                break
        total = time.perf_counter() - t_start
    finally:
        gc.callbacks.remove(on_gc)
        tx.close()
    pairs = itertools.pairwise(gcs)
    full = [t1 - t0 for (p0, g0, t0), (_p, _g, t1) in pairs if p0 == "start" and g0 == 2]
    print(f"## first lap: {capacity >> 20} MiB, {item_bytes} B items, gc enabled ({_load()})")
    for what, xs in (("wall", wall), ("thread CPU", cpu)):
        arr = np.array(xs)
        order = np.argsort(arr)[::-1][:5]
        print(
            f"{what}: puts {n}, median {np.median(arr) * 1e6:.1f} µs, "
            f"worst {arr[order[0]] * 1e3:.2f} ms, > 5 ms: {(arr > 5e-3).sum()}, "
            f"> 1 ms: {(arr > 1e-3).sum()}; worst five (ms @ put #): "
            + ", ".join(f"{arr[i] * 1e3:.2f} @ {i}" for i in order)
        )
    print(f"total {total:.1f} s; full collections: {[round(t * 1e3, 1) for t in full]} ms")


def big(rounds: int) -> None:
    """put / get of 1 and 16 MiB against a rotating np.copyto into a warm /dev/shm mapping."""
    for size in (1 * MiB, 16 * MiB):
        n = 16 if size == 1 * MiB else 4
        capacity = 64 * MiB + 8 * size
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        item = {"data": src}
        store = ShmObjectStore.create(_config(capacity, 2 * size))
        target = ShmBuffer(capacity)
        slots = capacity // (size + 4 * KiB) - 1
        res: dict[str, list[float]] = {}
        try:
            k = itertools.count()
            for r in range(rounds + 1):
                t0 = time.perf_counter()
                for i in range(n):
                    j = (r * n + i) % slots
                    np.copyto(target.view(size, j * (size + 4 * KiB)), src)
                t_copy = (time.perf_counter() - t0) / n
                t0 = time.perf_counter()
                refs = [store.put(f"b{next(k)}", item) for _ in range(n)]
                t_put = (time.perf_counter() - t0) / n
                t0 = time.perf_counter()
                for ref in refs:
                    store.get(ref)
                t_get = (time.perf_counter() - t0) / n
                if r:  # the first round warms up
                    res.setdefault("np.copyto", []).append(t_copy)
                    res.setdefault("put", []).append(t_put)
                    res.setdefault("get (copy)", []).append(t_get)
        finally:
            store.close()
            target.close()
        base = statistics.median(res["np.copyto"])
        print(f"## {size >> 20} MiB ({rounds} rounds x {n}, wall time; {_load()})")
        print("| op | µs (median) | ÷ np.copyto |")
        print("|---|---|---|")
        for name, xs in res.items():
            m = statistics.median(xs)
            print(f"| {name} | {m * 1e6:.0f} | {m / base:.2f} |")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["entry"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--capacity-mib", type=int, default=256)
    a = ap.parse_args(argv)
    for w in a.what:
        if w == "entry":
            entry(a.rounds, a.batch)
        elif w == "lap":
            lap(a.capacity_mib * MiB, 1 * KiB)
        elif w == "big":
            big(a.rounds)
        else:
            ap.error(f"unknown {w!r}")
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
