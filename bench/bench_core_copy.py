"""The compiled core's copy into the ring: which streaming stores, and from which size.

``python bench/bench_core_copy.py [ROUNDS]``: copies of each size into a rotating place of a
256 MiB /dev/shm mapping (as a ring's next put lands: cold lines), by numpy (``dst[...] = src``,
the pure path), by the C core with plain ``memcpy`` and with each streaming kind this CPU has
(``stream_kinds()``: AVX-512, AVX2, SSE2). Each round runs every cell once, in turn
(interleaved); figures are per copy in this thread's CPU time, medians over rounds, each as a
ratio to numpy's copy of the same run. The last two columns add the copy out that a reader's get
makes right after, in this thread (streamed bytes are in no cache then), for the kind the core
picked. The C core's choice of kind and its ``stream_min`` (``aioshmcache/_core.c``) were made
from these figures.

``python bench/bench_core_copy.py pair [ROUNDS]``: the same choice as a gateway and an engine
worker meet it: a ``SenderCache`` puts an item and a ``ReceiverCache`` in another process reads
it (a copy) right after, for each size, with the core's threshold (streamed) and with streaming
off (plain ``memcpy``), interleaved; medians of the put's and the read's thread CPU time, each
in its own process, and their sum.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from aioshmcache import CacheConfig, ReceiverCache, SenderCache, _core_api
from aioshmcache.tools.bench.timing import ShmBuffer

KiB, MiB = 1 << 10, 1 << 20
SIZES = [16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
RING = 256 * MiB


def _cell(ring: ShmBuffer, src: np.ndarray, how: str, picked: str) -> Callable[[int], None]:
    """One copy in by ``how`` (``numpy`` or a core kind); with ``+read``, the copy out that a
    reader's get makes next."""
    core = _core_api.core
    kind = how.removesuffix("+read")
    read = how.endswith("+read")
    out = np.empty_like(src)

    def copy(i: int) -> None:
        dst = ring.rotating(src.nbytes, i)
        if kind == "numpy":
            dst[...] = src
        else:
            core.set_stream_kind(kind)
            core.set_stream_min(0)
            core.copy_into(dst, 0, src)
        if read:
            out[...] = dst

    return copy


def main(rounds: int = 7) -> None:
    core = _core_api.core
    if _core_api.implementation() != "c":
        sys.exit("the C core is not in use (not built, or AIOSHM_PURE is set)")
    picked, default_min = core.copy_info()
    kinds = list(core.stream_kinds())  # the streaming ones, widest first, then "memcpy"
    hows = ["numpy", *kinds, "numpy+read", f"{picked}+read"]
    per: dict[tuple[int, str], list[float]] = {}
    i = 0
    try:
        with ShmBuffer(RING) as ring:
            for _ in range(rounds):
                for size in SIZES:
                    src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                    n = max(4, min(400, (64 * MiB) // size))  # ~64 MiB of ring per cell
                    for how in hows:
                        copy = _cell(ring, src, how, picked)
                        t0 = time.thread_time()
                        for _ in range(n):
                            copy(i)
                            i += 1
                        per.setdefault((size, how), []).append((time.thread_time() - t0) / n)
    finally:
        core.set_stream_kind(picked)
        core.set_stream_min(default_min)
    print(
        f"the core streams with {picked} from {default_min // KiB} KiB; medians of {rounds} "
        "rounds; every column but the first is a ratio to numpy's copy of the same size"
    )
    cols = [f"{k}/numpy" for k in kinds] + ["in+out: numpy us", f"{picked}+out/numpy"]
    print(f"{'size':>8} {'numpy us':>9} " + " ".join(f"{c:>16}" for c in cols))
    for size in SIZES:
        med = {h: statistics.median(per[(size, h)]) for h in hows}
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        ratios = [med[k] / med["numpy"] for k in kinds]
        cells = [f"{r:16.2f}" for r in ratios]
        cells += [f"{med['numpy+read'] * 1e6:16.1f}"]
        cells += [f"{med[f'{picked}+read'] / med['numpy+read']:16.2f}"]
        print(f"{label:>8} {med['numpy'] * 1e6:9.1f} " + " ".join(cells))


PAIR_SIZES = [64 * KiB, 256 * KiB, 600 * KiB, 1 * MiB, 4 * MiB]


def _reader(handle: Any, conn: Connection) -> None:
    """The engine worker's side: read each reference sent (a copy), answer its CPU time."""
    rx = ReceiverCache.attach(handle)
    try:
        while (msg := conn.recv()) is not None:
            ref, key = msg
            t0 = time.thread_time()
            out = rx.get_and_update_item(ref, key)
            conn.send(time.thread_time() - t0)
            del out
    finally:
        rx.close()


def pair(rounds: int = 6, per_cell: int = 40) -> None:
    """A put, then a read of it by another process, streamed and not (module docstring)."""
    core = _core_api.core
    if _core_api.implementation() != "c":
        sys.exit("the C core is not in use (not built, or AIOSHM_PURE is set)")
    picked, default_min = core.copy_info()
    tx = SenderCache(CacheConfig(256 * MiB, 32 * MiB, 1, name=f"bench-copy-pair-{os.getpid()}"))
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_reader, args=(tx.handle(), theirs))
    proc.start()
    per: dict[tuple[int, str], list[tuple[float, float]]] = {}
    n = 0
    try:
        for _ in range(rounds):
            for size in PAIR_SIZES:
                src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                for how, stream_min in (("streamed", default_min), ("memcpy", 1 << 62)):
                    core.set_stream_min(stream_min)
                    puts, reads = [], []
                    for _ in range(per_cell):
                        n += 1
                        t0 = time.thread_time()
                        ref, _u = tx.get_and_update_item(({"x": src}, ()), f"k{n}")
                        puts.append(time.thread_time() - t0)
                        ours.send((ref, f"k{n}"))
                        reads.append(ours.recv())
                    per.setdefault((size, how), []).append(
                        (statistics.median(puts), statistics.median(reads))
                    )
    finally:
        core.set_stream_min(default_min)
        ours.send(None)
        proc.join(30)
        tx.close()
    print(
        f"put, then a read by another process right after (the core streams with {picked} from "
        f"{default_min // KiB} KiB); medians of {rounds} rounds x {per_cell}, thread CPU µs"
    )
    print(
        f"{'size':>8} | {'streamed: put':>13} {'read':>7} {'sum':>7} | "
        f"{'memcpy: put':>11} {'read':>7} {'sum':>7} | {'sum ratio':>9}"
    )
    for size in PAIR_SIZES:
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        got = {}
        for how in ("streamed", "memcpy"):
            rows = per[(size, how)]
            put = statistics.median(r[0] for r in rows) * 1e6
            read = statistics.median(r[1] for r in rows) * 1e6
            got[how] = (put, read, put + read)
        s, m = got["streamed"], got["memcpy"]
        print(
            f"{label:>8} | {s[0]:13.1f} {s[1]:7.1f} {s[2]:7.1f} | "
            f"{m[0]:11.1f} {m[1]:7.1f} {m[2]:7.1f} | {s[2] / m[2]:9.2f}"
        )


if __name__ == "__main__":  # the guard matters: ``pair`` spawns its reader process
    if sys.argv[1:2] == ["pair"]:
        pair(*(int(a) for a in sys.argv[2:3]))
    else:
        main(*(int(a) for a in sys.argv[1:2]))
