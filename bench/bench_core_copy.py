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


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
