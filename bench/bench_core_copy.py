"""The compiled core's copy into the ring: where streaming stores start to pay.

``python bench/bench_core_copy.py [ROUNDS]``: copies of each size into a rotating place of a
256 MiB /dev/shm mapping (as a ring's next put lands: cold lines), by numpy (``dst[...] = src``,
the pure path), by the C core with plain ``memcpy`` and with streaming stores. Each round runs
every cell once, in turn (interleaved); figures are per copy in this thread's CPU time, medians
over rounds, each as a ratio to numpy's copy of the same run. The last two columns add the copy
out that a reader's get makes right after, in this thread (streamed bytes are in no cache then).
The C core's ``stream_min`` (``aioshmcache._core``) was chosen from these figures.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from aioshmcache import _core_api
from aioshmcache.tools.bench.timing import ShmBuffer

KiB, MiB = 1 << 10, 1 << 20
SIZES = [16 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
RING = 256 * MiB


def _cell(ring: ShmBuffer, src: np.ndarray, how: str) -> Callable[[int], None]:
    """One copy in by ``how``; with ``+read``, the copy out that a reader's get makes next."""
    core = _core_api.core
    stream_min = 0 if how.startswith("stream") else 1 << 62
    read = how.endswith("+read")
    out = np.empty_like(src)

    def copy(i: int) -> None:
        dst = ring.rotating(src.nbytes, i)
        if how.startswith("numpy"):
            dst[...] = src
        else:
            core.set_stream_min(stream_min)
            core.copy_into(dst, 0, src)
        if read:
            out[...] = dst

    return copy


def main(rounds: int = 7) -> None:
    if _core_api.implementation() != "c":
        sys.exit("the C core is not in use (not built, or AIOSHM_PURE is set)")
    kind, default_min = _core_api.core.copy_info()
    hows = ["numpy", "memcpy", "stream", "numpy+read", "stream+read"]
    per: dict[tuple[int, str], list[float]] = {}
    i = 0
    with ShmBuffer(RING) as ring:
        for _ in range(rounds):
            for size in SIZES:
                src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                n = max(4, min(400, (64 * MiB) // size))  # ~64 MiB of ring per cell
                for how in hows:
                    copy = _cell(ring, src, how)
                    t0 = time.thread_time()
                    for _ in range(n):
                        copy(i)
                        i += 1
                    per.setdefault((size, how), []).append((time.thread_time() - t0) / n)
    _core_api.core.set_stream_min(default_min)
    print(f"streaming stores: {kind}; stream_min now {default_min // KiB} KiB; medians of {rounds}")
    print(
        f"{'size':>8} {'numpy us':>10} {'memcpy/numpy':>13} {'stream/numpy':>13} "
        f"{'in+out: numpy us':>17} {'stream/numpy':>13}"
    )
    for size in SIZES:
        med = {h: statistics.median(per[(size, h)]) for h in hows}
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        print(
            f"{label:>8} {med['numpy'] * 1e6:10.1f} {med['memcpy'] / med['numpy']:13.2f} "
            f"{med['stream'] / med['numpy']:13.2f} {med['numpy+read'] * 1e6:17.1f} "
            f"{med['stream+read'] / med['numpy+read']:13.2f}"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
