"""Issue 20, big copies: 1 and 16 MiB puts and churn of this build against an older one, in one run.

``python bench/bench_lean_big_ab.py OLD_PARENT [ROUNDS]``: ``OLD_PARENT`` holds a copy of an
older ``aioshmcache`` package renamed ``aioshm_old`` (``git archive REV aioshmcache | tar -x -C
/tmp/old && mv /tmp/old/aioshmcache /tmp/old/aioshm_old``; as for ``bench_lean_ab.py``). Each
round runs every cell once, in turn (interleaved): a rotating ``np.copyto`` into a warm /dev/shm
mapping of the ring's size (the physical limit), ``ShmObjectStore.put`` of each build into a full
ring (every put makes room), and churn — ``SenderCache.get_and_update_item`` then
``ReceiverCache.get_and_update_item`` of the reference (read back and acknowledged), as
``bench --suite vllm`` runs it. Figures are per operation in this thread's CPU time (on a shared
machine, time descheduled is not the call's; the copies run in this thread), medians over
rounds, with ratios against the copies of the same run (a put: one copy in; a churn step: one
in and one out into a new array, as its read makes) and old ÷ new; the last column compares the
fastest round of each cell (the least disturbed by the machine's other work).
"""

from __future__ import annotations

import importlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import aioshmcache as new
from aioshmcache.tools.bench.timing import ShmBuffer

KiB, MiB = 1 << 10, 1 << 20
_keys = itertools.count()
_clock = time.thread_time


def _per_op(fn: Callable[[], None], n: int) -> float:
    t0 = _clock()
    for _ in range(n):
        fn()
    return (_clock() - t0) / n


def _cells(
    tag: str, m: Any, size: int, capacity: int, item: Any
) -> tuple[dict[str, Any], list[Any]]:
    """One build's put and churn cells for ``size``, and what to close."""

    def config() -> Any:
        return m.CacheConfig(
            capacity, 2 * size, 1, name=f"bench-big-ab-{os.getpid()}-{next(_keys)}"
        )

    store = m.ShmObjectStore.create(config())
    tx = m.SenderCache(config())
    rx = m.ReceiverCache.attach(tx.handle())
    it = (item, ())

    def put() -> None:
        store.put(f"p{next(_keys)}", item)

    def churn() -> None:
        k = f"c{next(_keys)}"
        ref, _u = tx.get_and_update_item(it, k)
        rx.get_and_update_item(ref, k)

    return {f"{tag} store.put": put, f"{tag} churn": churn}, [rx, tx, store]


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    sys.path.insert(0, argv[0])
    old = importlib.import_module("aioshm_old")
    rounds = int(argv[1]) if len(argv) > 1 else 7
    for size in (1 * MiB, 16 * MiB):
        n = 16 if size == MiB else 4
        capacity = 64 * MiB + 8 * size
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        item = {"data": src}
        target = ShmBuffer(capacity)
        slots = capacity // (size + 4 * KiB) - 1
        slot = itertools.count()

        def copy() -> None:
            np.copyto(target.view(size, (next(slot) % slots) * (size + 4 * KiB)), src)  # noqa: B023

        def copy_in_out() -> None:  # churn's limit: a copy in, then one out into a new array
            off = (next(slot) % slots) * (size + 4 * KiB)  # noqa: B023
            np.copyto(target.view(size, off), src)  # noqa: B023
            target.view(size, off).copy()  # noqa: B023

        cells: dict[str, Any] = {"np.copyto": copy, "np.copyto + copy out": copy_in_out}
        closing: list[Any] = []
        for tag, m in (("old", old), ("new", new)):
            c, cl = _cells(tag, m, size, capacity, item)
            cells.update(c)
            closing += cl
        res: dict[str, list[float]] = {name: [] for name in cells}
        loads = [os.getloadavg()[0]]
        try:
            for _ in range(capacity // size + 8):  # a lap: every later put makes room
                for name, fn in cells.items():
                    if not name.startswith("np."):
                        fn()
            for _r in range(rounds):
                for name, fn in cells.items():
                    res[name].append(_per_op(fn, n))
                loads.append(os.getloadavg()[0])
        finally:
            for x in closing:
                x.close()
            target.close()
        med = {name: statistics.median(xs) for name, xs in res.items()}
        low = {name: min(xs) for name, xs in res.items()}
        print(
            f"## {size >> 20} MiB ({rounds} interleaved rounds x {n}, thread CPU time; "
            f"load {min(loads):.2f}-{max(loads):.2f})"
        )
        print("| cell | µs (median) | ÷ its copy limit | old ÷ new | ÷ limit, fastest rounds |")
        print("|---|---|---|---|---|")
        for name, t in med.items():
            pair = name.replace("new ", "old ") if name.startswith("new ") else None
            ab = f"{med[pair] / t:.2f}" if pair else ""
            lim = "np.copyto + copy out" if name.endswith(("churn", "copy out")) else "np.copyto"
            fast = low[name] / low[lim]
            print(f"| {name} | {t * 1e6:.0f} | {t / med[lim]:.2f} | {ab} | {fast:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
