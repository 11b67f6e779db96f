"""The compiled core against the pure-Python one, in one process: puts of each size.

``python bench/bench_core_put.py [ROUNDS]``: ``SenderCache.get_and_update_item`` misses (a new
hash each time, a full ring: every put makes room) and ``ShmObjectStore.put`` of a flat item
(one uint8 array) with the C core and with the pure-Python one (every entry point of the C core
into the write path swapped for the reference's), and a rotating ``np.copyto`` of the same bytes
into a 256 MiB /dev/shm mapping. Each round runs every cell once, in turn (interleaved); figures
are per put in this thread's CPU time, medians over rounds; ratios within the same run only.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from aioshmcache import CacheConfig, SenderCache, _core_api, _core_py, _serde, _store
from aioshmcache.tools.bench.timing import ShmBuffer

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]
_keys = itertools.count()


@contextmanager
def pure_core() -> Iterator[None]:
    """The pure-Python core's entry points for the duration (as ``AIOSHM_PURE=1`` would)."""
    swapped = [
        (_store, "_put_plain", _core_py.put_plain),
        (_store, "_publish_plain", _core_py.publish_plain),
        (_store, "_make_ref", _core_py.make_ref),
        (_serde, "_copy_into", _core_py.copy_into),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swapped]
    for mod, name, fn in swapped:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _per_op(fn: Callable[[], None], n: int) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n


def _measure(
    ring: ShmBuffer, size: int, rounds: int, per: dict[tuple[int, str], list[float]]
) -> None:
    """Every cell of one item size, ``rounds`` times, interleaved."""
    cap = max(64 * MiB, 8 * size)
    cfg = CacheConfig(cap, 2 * size + MiB, 1, name=f"benchcore-{uuid.uuid4().hex[:8]}")
    arr = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    item: tuple[dict[str, np.ndarray], list[object]] = ({"pixel_values": arr}, [])
    n = max(20, min(2000, (32 * MiB) // size))
    places = itertools.count()
    with SenderCache(cfg) as cache:
        store = cache.store

        def cache_put() -> None:
            cache.get_and_update_item(item, f"h{next(_keys)}")

        def store_put() -> None:
            store.put(f"s{next(_keys)}", item[0])

        def copy() -> None:
            ring.rotating(size, next(places))[...] = arr

        for fn in (cache_put, store_put):  # fill the ring: every later put evicts
            _per_op(fn, max(n, cap // size + 10))
        for _ in range(rounds):
            per.setdefault((size, "copy"), []).append(_per_op(copy, n))
            for name, fn in (("cache", cache_put), ("store", store_put)):
                per.setdefault((size, f"{name} c"), []).append(_per_op(fn, n))
                with pure_core():
                    per.setdefault((size, f"{name} py"), []).append(_per_op(fn, n))


def main(rounds: int = 7) -> None:
    if _core_api.implementation() != "c":
        sys.exit("the C core is not in use (not built, or AIOSHM_PURE is set)")
    per: dict[tuple[int, str], list[float]] = {}
    with ShmBuffer(256 * MiB) as ring:
        for size in SIZES:
            _measure(ring, size, rounds, per)
    print(f"medians of {rounds} interleaved rounds, per put, thread CPU time")
    print(
        f"{'size':>7} {'copy us':>8} | {'cache: c us':>11} {'py us':>7} {'c/py':>5} {'c/copy':>6}"
        f" | {'store: c us':>11} {'py us':>7} {'c/py':>5} {'c/copy':>6}"
    )
    for size in SIZES:
        m = {k[1]: statistics.median(v) for k, v in per.items() if k[0] == size}
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        row = f"{label:>7} {m['copy'] * 1e6:8.1f}"
        for name in ("cache", "store"):
            c, py = m[f"{name} c"], m[f"{name} py"]
            row += f" | {c * 1e6:11.1f} {py * 1e6:7.1f} {c / py:5.2f} {c / m['copy']:6.2f}"
        print(row)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
