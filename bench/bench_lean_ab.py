"""Issue 20: every entry point against the one-item fast path of an older build, in one process.

``python bench/bench_lean_ab.py OLD_PARENT [ROUNDS]``: ``OLD_PARENT`` holds a copy of an older
``aioshmcache`` package renamed ``aioshm_old`` (``git archive 5348b14 aioshmcache | tar -x -C
/tmp/old && mv /tmp/old/aioshmcache /tmp/old/aioshm_old``; its modules import each other
relatively, so the copy loads beside this one). Each round runs every cell once, in turn
(interleaved), 400 calls of 1 KiB misses per cell; figures are per item in this thread's CPU
time (time descheduled on a shared machine is not the call's), medians over rounds, with ratios
against the old build's ``get_and_update_item`` (its one-item fast path) and this build's.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

import aioshmcache as new

CALLS = 400
ITEM = {"data": np.arange(256, dtype=np.float32)}  # 1 KiB
_keys = itertools.count()


def _key() -> str:
    return f"k{next(_keys)}"


def _cells(
    tag: str, m: Any
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], Awaitable[None]]], list[Any]]:
    """The sync and async cells of one build, and what to close."""

    def config() -> Any:
        return m.CacheConfig(64 << 20, 1 << 20, 1, name=f"bench-lean-ab-{os.getpid()}-{_key()}")

    tx, st = m.SenderCache(config()), m.ShmObjectStore.create(config())
    face = m.AsyncSenderCache(tx)
    it = (ITEM, ())

    def specs(n: int) -> list[Any]:
        return [m.FeatureSpec(_key(), ITEM) for _ in range(n)]

    sync: dict[str, Callable[[], None]] = {
        f"{tag} store.put": lambda: st.put(_key(), ITEM),
        f"{tag} item": lambda: tx.get_and_update_item(it, _key()),
        f"{tag} get_and_update([1])": lambda: tx.get_and_update([it], [_key()]),
        f"{tag} features([1])": lambda: tx.get_and_update_features(specs(1)),
        f"{tag} features([8])/8": lambda: tx.get_and_update_features(specs(8)),
    }

    async def a_item() -> None:
        await face.get_and_update_item(it, _key())

    async def a_f1() -> None:
        await face.get_and_update_features(specs(1))

    async def a_f8() -> None:
        await face.get_and_update_features(specs(8))

    asy: dict[str, Callable[[], Awaitable[None]]] = {
        f"{tag} async item": a_item,
        f"{tag} async features([1])": a_f1,
        f"{tag} async features([8])/8": a_f8,
    }
    return sync, asy, [tx, st]


async def _run(
    rounds: int,
    sync: dict[str, Callable[[], None]],
    asy: dict[str, Callable[[], Awaitable[None]]],
) -> dict[str, list[float]]:
    clock = time.thread_time
    res: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in sync.items():
            per = 8 if "[8]" in name else 1
            n = CALLS // per
            t0 = clock()
            for _ in range(n):
                fn()
            if r:
                res.setdefault(name, []).append((clock() - t0) / (n * per))
        for name, afn in asy.items():
            per = 8 if "[8]" in name else 1
            n = CALLS // per
            t0 = clock()
            for _ in range(n):
                await afn()
            if r:
                res.setdefault(name, []).append((clock() - t0) / (n * per))
    return res


def main(argv: list[str]) -> int:
    sys.path.insert(0, argv[0])
    old = importlib.import_module("aioshm_old")
    rounds = int(argv[1]) if len(argv) > 1 else 9
    s_old, a_old, c_old = _cells("old", old)
    s_new, a_new, c_new = _cells("new", new)
    sync, asy = {}, {}
    for key in s_old:  # old and new of each cell side by side
        sync[key] = s_old[key]
        sync[key.replace("old", "new", 1)] = s_new[key.replace("old", "new", 1)]
    for key in a_old:
        asy[key] = a_old[key]
        asy[key.replace("old", "new", 1)] = a_new[key.replace("old", "new", 1)]
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            res = runner.run(_run(rounds, sync, asy))
    finally:
        for x in c_old + c_new:
            x.close()
    base = statistics.median(res["old item"])
    nbase = statistics.median(res["new item"])
    load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"load {load}; {rounds} rounds x {CALLS} calls; per item, thread CPU time, uvloop")
    print("| cell | median µs | p25 µs | ÷ old item (fast path) | ÷ new sync item |")
    print("|---|---|---|---|---|")
    for name, xs in res.items():
        xs.sort()
        m = statistics.median(xs)
        q1 = xs[len(xs) // 4]
        print(f"| {name} | {m * 1e6:.2f} | {q1 * 1e6:.2f} | {m / base:.2f} | {m / nbase:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
