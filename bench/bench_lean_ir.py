"""Issue 20, second pass: machine instructions per call of the one request path (callgrind).

``python bench/bench_lean_ir.py [--calls N] [CELL ...]`` runs each cell under ``valgrind
--tool=callgrind`` twice, with ``N`` calls and with none (same set-up and warm-up), and prints
``(Ir(N) - Ir(0)) / N``: instructions per call, which do not depend on the machine's load (the
figure the wall clock cannot give on a shared machine). ``OPENBLAS_NUM_THREADS=1``: numpy's BLAS
threads otherwise spin, and their instructions grow with the run's length.

``python bench/bench_lean_ir.py --inner CELL N`` is one such run (what valgrind executes).
Cells: a 1 KiB miss and a hit, through ``get_and_update_item`` (``item_miss_rx``: the miss with a
reader attached, as ``bench_vllm.py`` runs it: each put is then owed by that reader, which never
reads here, so the acknowledgements ``bench_vllm.py``'s puts settle are not counted; the ``_hit``
cells are look-ups, ``mm_item`` None; ``item_hit_item``, the hit of a given item),
``get_and_update_features([spec])`` and their awaited twins on ``AsyncSenderCache``; ``put_1m``, a
1 MiB ``ShmObjectStore.put`` into a full 72 MiB ring (every put evicts, in steady state), and
``copy_1m``, a rotating ``np.copyto`` of 1 MiB into a /dev/shm mapping of the same size: their
difference is what a big put costs beyond its copy. Receiver cells (1 KiB reads of distinct
references by a reader in the same process): ``rx_get``, the reader store's own ``get`` (the
floor); ``rx_item``, ``ReceiverCache.get_and_update_item``; ``rx_feat``,
``get_and_update_features([spec])``; ``arx_item``, the awaited
``AsyncReceiverCache.get_and_update_item``.
Uses only the public API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CELLS = (
    "item_miss",
    "item_miss_rx",
    "item_hit",
    "item_hit_item",
    "feat_miss",
    "feat_hit",
    "aitem_miss",
    "aitem_hit",
    "afeat_miss",
)
BIG_CELLS = ("put_1m", "copy_1m")
RX_CELLS = ("rx_get", "rx_item", "rx_feat", "arx_item")
WARM = 200


def inner_big(cell: str, calls: int) -> None:
    """``put_1m`` / ``copy_1m``: set up, fill the ring once (warm-up), then ``calls`` calls."""
    import numpy as np

    from aioshmcache import CacheConfig, ShmObjectStore
    from aioshmcache.tools.bench.timing import ShmBuffer

    mib = 1 << 20
    capacity = 72 * mib
    src = np.random.default_rng(0).integers(0, 255, mib, dtype=np.uint8)
    item = {"data": src}
    warm = capacity // mib + 8  # a lap and then some: every later put evicts
    if cell == "put_1m":
        cfg = CacheConfig(capacity, 2 * mib, 1, name=f"bench-ir-{os.getpid()}")
        with ShmObjectStore.create(cfg) as store:
            for i in range(warm + calls):
                store.put(f"b{i}", item)
        return
    if cell != "copy_1m":
        raise SystemExit(f"unknown cell {cell!r}")
    target = ShmBuffer(capacity)
    slots = capacity // (mib + 4096) - 1
    try:
        for i in range(warm + calls):
            np.copyto(target.view(mib, (i % slots) * (mib + 4096)), src)
    finally:
        target.close()


def _on_loop(run: Callable[[int, int], Coroutine[Any, Any, None]], calls: int) -> None:
    """The warm-up calls, then ``calls`` more, awaited on a fresh asyncio loop."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run(0, WARM))
        loop.run_until_complete(run(WARM, WARM + calls))
    finally:
        loop.close()


def inner_rx(cell: str, calls: int, setup: int) -> None:
    """A receiver cell: ``WARM + setup`` references put first (the same in both runs), then the
    first ``WARM + calls`` read once each."""
    import numpy as np

    from aioshmcache import AsyncReceiverCache, CacheConfig, FeatureSpec, ReceiverCache, SenderCache

    item = {"data": np.arange(256, dtype=np.float32)}  # 1 KiB
    n = WARM + max(calls, setup)
    cfg = CacheConfig(64 << 20, 1 << 20, 1, name=f"bench-ir-{os.getpid()}")
    with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
        refs = [(f"k{i:08d}", tx.get_and_update_item((item, ()), f"k{i:08d}")[0]) for i in range(n)]
        specs = [[FeatureSpec(k, r)] for k, r in refs]
        one: Callable[[int], object]
        if cell == "rx_get":
            one = lambda i: rx.store.get(refs[i][1])  # noqa: E731
        elif cell == "rx_item":
            one = lambda i: rx.get_and_update_item(refs[i][1], refs[i][0])  # noqa: E731
        elif cell == "rx_feat":
            one = lambda i: rx.get_and_update_features(specs[i])  # noqa: E731
        elif cell == "arx_item":
            face = AsyncReceiverCache(rx)

            async def run(lo: int, hi: int) -> None:
                for i in range(lo, hi):
                    await face.get_and_update_item(refs[i][1], refs[i][0])

            _on_loop(run, calls)
            return
        else:
            raise SystemExit(f"unknown cell {cell!r}")
        for i in range(WARM + calls):
            one(i)


def inner(cell: str, calls: int, setup: int) -> None:
    """Set up, warm up, then ``calls`` calls of ``cell`` (the run valgrind counts). The keys and
    specs are made for ``WARM + setup`` calls in both runs, so their making is not counted."""
    import numpy as np

    from aioshmcache import AsyncSenderCache, CacheConfig, FeatureSpec, ReceiverCache, SenderCache

    item = {"data": np.arange(256, dtype=np.float32)}  # 1 KiB
    n = WARM + max(calls, setup, 1)
    keys = [f"k{i:08d}" for i in range(n)]
    cfg = CacheConfig(64 << 20, 1 << 20, 1, name=f"bench-ir-{os.getpid()}")
    with SenderCache(cfg) as tx, contextlib.ExitStack() as stack:
        if cell == "item_miss_rx":  # a reader that owes every put (it never reads here)
            stack.enter_context(ReceiverCache.attach(tx.handle()))
        face = AsyncSenderCache(tx)
        tx.get_and_update_item((item, ()), "hot")
        hot_spec = [FeatureSpec("hot", None)]
        specs = [[FeatureSpec(k, item)] for k in keys]
        miss = (item, ())
        one: Callable[[int], object]
        if cell in ("item_miss", "item_miss_rx"):
            one = lambda i: tx.get_and_update_item(miss, keys[i])  # noqa: E731
        elif cell == "item_hit":
            one = lambda i: tx.get_and_update_item(None, "hot")  # noqa: E731
        elif cell == "item_hit_item":
            one = lambda i: tx.get_and_update_item(miss, "hot")  # noqa: E731
        elif cell == "feat_miss":
            one = lambda i: tx.get_and_update_features(specs[i])  # noqa: E731
        elif cell == "feat_hit":
            one = lambda i: tx.get_and_update_features(hot_spec)  # noqa: E731
        elif cell.startswith("a"):

            async def run(lo: int, hi: int) -> None:
                for i in range(lo, hi):
                    if cell == "aitem_miss":
                        await face.get_and_update_item(miss, keys[i])
                    elif cell == "aitem_hit":
                        await face.get_and_update_item(None, "hot")
                    else:
                        await face.get_and_update_features(specs[i])

            _on_loop(run, calls)
            return
        else:
            raise SystemExit(f"unknown cell {cell!r}")
        for i in range(WARM):
            one(i)
        for i in range(WARM, WARM + calls):
            one(i)


def _ir(cell: str, calls: int, setup: int) -> int:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                *(sys.executable, __file__, "--inner", cell, str(calls), str(setup)),
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        return callgrind_total(out)


def callgrind_total(out: str) -> int:
    """The instructions a callgrind run counted (its output file's ``summary`` line)."""
    with open(out) as f:
        m = re.search(r"^summary:\s+(\d+)", f.read(), re.M)
    if m is None:
        raise SystemExit("no summary line in callgrind's output")
    return int(m.group(1))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("cells", nargs="*")
    a = ap.parse_args(argv)
    if a.inner:
        cell, calls = a.cells[0], int(a.cells[1])
        if cell in RX_CELLS:
            inner_rx(cell, calls, int(a.cells[2]))
        elif cell in BIG_CELLS:
            inner_big(cell, calls)
        else:
            inner(cell, calls, int(a.cells[2]) if len(a.cells) > 2 else calls)
        return 0
    cells = a.cells or list(CELLS)
    runs = [(c, n) for c in cells for n in (a.calls, 0)]
    with ThreadPoolExecutor(a.jobs) as pool:
        irs = dict(zip(runs, pool.map(lambda r: _ir(r[0], r[1], a.calls), runs)))
    print("load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for c in cells:
        per = (irs[(c, a.calls)] - irs[(c, 0)]) / a.calls
        print(f"{c:12s} {per / 1000:8.1f} k instructions/call")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
