"""Issue 29: what a big copy costs the work that runs after it (the 1 MiB put's missing ~10 us).

``python bench/bench_core_cold.py [--calls N] [--rounds R]`` times a 1 KiB
``SenderCache.get_and_update_item`` miss (~18k instructions, the same every time) right after
each of these, in turn, ``R`` rounds of ``N`` calls (thread CPU time of the put alone, medians):

- ``warm``: nothing before it;
- ``stream 1 MiB``: the core's streamed copy of a 1 MiB source into a rotating place of a 64 MiB
  mapping (what a 1 MiB put copies);
- ``stream 16 x 64 KiB, hot source``: the same destination bytes from a 64 KiB source that stays
  in the CPU's caches (the destination's share of the cost);
- ``np.copyto 1 MiB``: the same copy through the caches;
- ``read 1 MiB``: the source only read (``sum``), nothing written.

A 1 MiB put's own bookkeeping (~25k instructions around its copy) runs in the state its copy
leaves the caches in, which is what separates the put from the bare copy in
``bench_vllm.py``'s "put 1 MiB ÷ a rotating np.copyto" cell.
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import statistics
import time
from collections.abc import Callable

import numpy as np

from aioshmcache import SenderCache
from aioshmcache._core_api import core
from aioshmcache.tools.bench.params import bench_config
from aioshmcache.tools.bench.timing import source_array

MiB = 1 << 20
KiB = 1 << 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    src, src64 = source_array(MiB), source_array(64 * KiB)
    area = mmap.mmap(-1, 64 * MiB)
    ring = np.frombuffer(area, dtype=np.uint8)
    ring[:] = 0  # every page touched once, as the store's segment is prefaulted (the anonymous
    # mapping goes with the process)

    def place(i: int) -> int:
        return (i * (MiB + 4096)) % (60 * MiB)

    def stream_pieces(i: int) -> None:
        for k in range(16):
            core.copy_into(ring, place(i) + k * 64 * KiB, src64)

    befores: dict[str, Callable[[int], object]] = {
        "warm": lambda i: None,
        "stream 1 MiB": lambda i: core.copy_into(ring, place(i), src),
        "stream 16 x 64 KiB, hot source": stream_pieces,
        "np.copyto 1 MiB": lambda i: np.copyto(ring[place(i) : place(i) + MiB], src),
        "read 1 MiB": lambda i: src.sum(dtype=np.uint64),
    }
    item = {"x": np.arange(256, dtype=np.float32)}  # 1 KiB
    keys = itertools.count()
    with SenderCache(bench_config(64 * MiB, 2 * MiB)) as cache:

        def put() -> None:
            cache.get_and_update_item((item, ()), f"k{next(keys)}")

        for _ in range(a.calls):
            put()  # warm-up: the ring full, every put evicting, as in the rounds
        medians: dict[str, list[float]] = {name: [] for name in befores}
        for _round in range(a.rounds):
            for name, before in befores.items():
                times = []
                for i in range(a.calls):
                    before(i)
                    t0 = time.thread_time_ns()
                    put()
                    times.append(time.thread_time_ns() - t0)
                medians[name].append(statistics.median(times) / 1000)
    print(f"a 1 KiB miss put right after each (median us per round, {a.rounds} rounds):")
    for name, ms in medians.items():
        print(f"  {name:32s} " + " / ".join(f"{m:.2f}" for m in ms))


if __name__ == "__main__":
    main()
