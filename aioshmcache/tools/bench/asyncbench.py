"""The async suite: cache hits, offloaded big puts, loop lag, the inline-vs-thread threshold.

Runs on asyncio and on uvloop (through anyio). The writer is an ``AsyncSenderCache``; the
readers, where there are any, are the spawned worker process.
"""

from __future__ import annotations

import importlib
import itertools
import math
import time
from contextlib import nullcontext
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from aioshmcache import AsyncSenderCache, ReceiverCache, SenderCache, ShmRef
from aioshmcache.aio import DEFAULT_INLINE_THRESHOLD

from ..lag import LoopLagMeter
from ..progress import Progress
from ..units import KiB, MiB, fmt_bytes
from . import timing as tm
from .params import Params, bench_config
from .procs import Worker
from .report import Report, Target

__all__ = ["run_async_suite"]

S_HIT = "Async: cache hit of a small item, get_and_update_item(None, h)"
S_PUT = "Async: 16 MiB put through the thread pool"
S_LAG = "Async: loop lag of a 1 ms ticker while 16 MiB items stream"
S_THR = "Async: inline vs thread (DEFAULT_INLINE_THRESHOLD = 1 MiB)"

NEVER = 1 << 62
BIG = 16 * MiB
_keys = itertools.count()


def _ref(x: object) -> ShmRef:
    if not isinstance(x, ShmRef):
        raise RuntimeError(f"expected a ShmRef, the cache served {type(x).__name__} inline")
    return x


async def _puts(c: AsyncSenderCache, item: Any, n: int, out: list[float]) -> None:
    """``n`` misses (puts) of new keys through ``c``, each timed."""
    for _ in range(n):
        await tm.atimed(out, c.get_and_update_item((item, ()), f"p{next(_keys)}"))


def bench_hit(p: Params, report: Report, progress: Progress, loop: str) -> None:
    progress(f"async [{loop}]: small cache hit ({p.runs} runs)")
    item, n = {"data": tm.source_array(1024)}, p.n_ops(1024)

    async def main() -> dict[str, tm.Stat]:
        sender = SenderCache(bench_config(8 * MiB, 1 * MiB))
        # a live reader: hand-outs owe it
        with sender, ReceiverCache.attach(sender.handle()) as rx:
            async with AsyncSenderCache(sender) as c:
                rx.release(_ref((await c.get_and_update_item((item, ()), "h"))[0]))

                async def hit(out: list[float]) -> None:
                    for _ in range(n):
                        ref, _ = await tm.atimed(out, c.get_and_update_item(None, "h"))
                        rx.release(_ref(ref))

                async def sync_hit(out: list[float]) -> None:
                    for _ in range(n):
                        rx.release(_ref(tm.timed(out, sender.get_and_update_item, None, "h")[0]))

                one = anyio.CapacityLimiter(1)

                async def hop(out: list[float]) -> None:  # to a worker thread and back, for nothing
                    for _ in range(max(20, n // 20)):
                        await tm.atimed(out, anyio.to_thread.run_sync(lambda: None, limiter=one))

                return await tm.ainterleave(p.runs, {"hit": hit, "sync": sync_hit, "hop": hop})

    st = tm.run_on(loop, main)
    add = report.section(S_HIT, "1 KiB")
    add(f"async hit [{loop}]", st["hit"], vs=("sync hit", st["sync"]), target=Target("<=", 2e-5))
    add(f"sync SenderCache hit [{loop} run]", st["sync"])
    label = f"thread hop: anyio.to_thread.run_sync(noop) [{loop}]"
    add(label, st["hop"], param="", vs=("async hit", st["hit"]))


# --- loop lag -------------------------------------------------------------------------------

_LAG_MODES = ("idle", "thread", "thread + reader process", "inline")


def bench_lag(p: Params, report: Report, progress: Progress, loop: str, worker: Worker) -> None:
    item = {"data": tm.source_array(16 * MiB)}
    quantiles = {"p99": 99, "p50": 50, "max": 100}
    lag = {(m, q): tm.Samples() for m in _LAG_MODES for q in quantiles}
    ticks, puts = dict.fromkeys(_LAG_MODES, 0), {m: [0, 0] for m in _LAG_MODES}
    for r in range(p.lag_runs):
        progress(
            f"async [{loop}]: loop lag while 16 MiB items stream, run {r + 1}/{p.lag_runs} "
            f"({len(_LAG_MODES)} modes x {p.lag_seconds:.1f} s)"
        )
        for mode in _LAG_MODES:  # interleaved: the idle baseline sees the same load as the others
            lags = _lag_once(p, loop, worker, mode, item, puts[mode])
            for q, at in quantiles.items():
                lag[(mode, q)].add_run([tm.percentile(lags, at)])
            ticks[mode] += len(lags)
    idle, add = lag[("idle", "p99")].stat(), report.section(S_LAG, "1 ms ticker")
    for mode in _LAG_MODES:
        (n_puts, n_inline), label = puts[mode], f"{mode} [{loop}]"
        note = f"{ticks[mode]} ticks, {n_puts} puts, {n_inline} served inline (the ring full)"
        kw: dict[str, Any] = {"vs": None if mode == "idle" else ("idle loop p99", idle)}
        kw["target"] = Target("<=", 2e-3) if mode.startswith("thread") else None
        kw |= {"note": note, "plot": "looplag", "series": f"p99 {label}"}
        add(f"lag p99, {label}", lag[(mode, "p99")].stat(), **kw)
        add(f"lag p50, {label}", lag[(mode, "p50")].stat())
        add(f"lag max, {label}", lag[(mode, "max")].stat())


def _lag_once(
    p: Params, loop: str, worker: Worker, mode: str, item: dict[str, Any], puts: list[int]
) -> list[float]:
    """One run of the ticker beside one streaming mode; returns the ticker's lags."""
    ticker = LoopLagMeter(0.001, window=None)
    size = int(item["data"].nbytes) + 64 * KiB
    reader = mode.endswith("reader process")

    async def stream(c: AsyncSenderCache, scope: anyio.CancelScope) -> None:
        deadline = time.monotonic() + p.lag_seconds
        try:
            while time.monotonic() < deadline:
                # a server yields between requests (it awaits its sockets)
                await anyio.sleep(0.01 if mode == "idle" else 0)
                if mode == "idle":
                    continue
                wait = 5.0 if reader else None
                key = f"lag{next(_keys)}"
                ref, _ = await c.get_and_update_item((item, ()), key, wait_for_space=wait)
                puts[0] += 1
                puts[1] += not isinstance(ref, ShmRef)
                if reader and isinstance(ref, ShmRef):
                    worker.conn.send([ref])
        finally:
            scope.cancel()  # stops the ticker

    async def main() -> None:
        threshold = NEVER if mode == "inline" else DEFAULT_INLINE_THRESHOLD
        cfg = bench_config(16 * size, size)
        async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=threshold) as c:
            serve = worker.attached(c.handle(), reads="copy")
            with serve if reader else nullcontext(), anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker.run)
                    tg.start_soon(stream, c, scope)

    tm.run_on(loop, main)
    return list(ticker.samples)


# --- puts inline and in a worker thread -----------------------------------------------------


def bench_puts(p: Params, report: Report, progress: Progress, loop: str, sizes: list[int]) -> None:
    """Puts of each size inline on the loop and in a worker thread, against ``np.copyto``.

    Two ``AsyncSenderCache`` faces over one ``SenderCache``: one copies every item inline, one
    hands every copy to a worker thread. A 16 MiB put (always a thread's by default) is also set
    against a copy into rotating places of a ring-sized buffer: where a put really lands.
    """
    progress(f"async [{loop}]: inline vs thread put for {', '.join(map(fmt_bytes, sizes))}")
    slot = max(sizes) + 64 * KiB
    by_size: dict[int, dict[str, tm.Stat]] = {}

    async def main(shm: tm.ShmBuffer) -> None:
        with SenderCache(bench_config(8 * slot, slot)) as s:
            ci = AsyncSenderCache(s, inline_threshold_bytes=NEVER)
            ct = AsyncSenderCache(s, inline_threshold_bytes=0)
            async with ci, ct:
                for size in sizes:
                    src = tm.source_array(size)
                    item, n = {"data": src}, max(6, p.n_ops(size) // 2)
                    for c in (ci, ct, ci, ct):  # warm both paths and the worker threads
                        await _puts(c, item, 1, [])
                    cells: dict[str, tm.Cell] = {
                        "copy": tm.copy_into(shm, src, n),
                        "inline": partial(_puts, ci, item, n),
                        "thread": partial(_puts, ct, item, n),
                    }
                    if size == BIG:
                        cells["rotating"] = tm.copy_into(shm, src, n, rotating=True)
                    by_size[size] = await tm.ainterleave(p.runs, cells)

    with tm.ShmBuffer(8 * slot) as shm:
        tm.run_on(loop, partial(main, shm))
    if BIG in by_size:
        st, add = by_size[BIG], report.section(S_PUT, "16 MiB")
        vs = ("np.copyto", st["copy"])
        add(f"np.copyto into warm shm [{loop} run]", st["copy"])
        label = f"np.copyto into rotating places of a ring-sized shm buffer [{loop} run]"
        add(label, st["rotating"], vs=vs)
        note = f"{st['rotating'].median / st['thread'].median:.2f}x the rotating copy"
        label = f"await get_and_update_item (a miss: put in a worker thread) [{loop}]"
        add(label, st["thread"], vs=vs, target=Target(">=", 0.7, "ratio"), note=note)
    if len(by_size) > 1:
        _threshold_rows(report, loop, by_size)


def _threshold_rows(report: Report, loop: str, by_size: dict[int, dict[str, tm.Stat]]) -> None:
    """The sweep, and where a worker thread starts to pay (against ``DEFAULT_INLINE_THRESHOLD``).

    Latency crossover: the first size whose put is faster in a thread. Break-even: the size where
    an inline put stalls the loop as long as the hop delays the request (inline = thread - inline),
    interpolated on log scales; below it a copy is cheaper for everyone inline, above it the loop
    is better off handing the copy to a thread.
    """
    add = report.section(S_THR, plot="threshold")
    for size, st in by_size.items():
        for label, key, vs, series in (
            (f"np.copyto [{loop}]", "copy", None, "np.copyto (baseline)"),
            (f"put inline on the loop [{loop}]", "inline", ("np.copyto", "copy"), "inline put"),
            (f"put in a worker thread [{loop}]", "thread", ("inline put", "inline"), "thread put"),
        ):
            base = None if vs is None else (vs[0], st[vs[1]])
            add(label, st[key], param=fmt_bytes(size), vs=base, series=series, x=size)
    sizes = np.array(list(by_size), dtype=np.float64)
    inline = np.array([st["inline"].median for st in by_size.values()])
    thread = np.array([st["thread"].median for st in by_size.values()])
    faster = np.flatnonzero(thread <= inline)
    crossover = float(sizes[faster[0]]) if faster.size else math.nan
    stall_minus_hop = inline - (thread - inline)
    even = math.nan
    if (stall_minus_hop >= 0).any():
        i = int(np.argmax(stall_minus_hop >= 0))  # the first size where the stall is the larger
        around = slice(max(0, i - 1), i + 1)
        even = float(np.exp(np.interp(0.0, stall_minus_hop[around], np.log(sizes[around]))))
    note = f"DEFAULT_INLINE_THRESHOLD = {fmt_bytes(DEFAULT_INLINE_THRESHOLD)}"
    add = report.section(S_THR, kind="bytes", note=note)
    add(f"latency crossover: first size where thread <= inline [{loop}]", crossover)
    add(f"break-even: inline put time = thread put - inline put [{loop}]", even)


def run_async_suite(p: Params, report: Report, progress: Progress) -> None:
    loops = ["asyncio"]
    try:
        importlib.import_module("uvloop")
        loops.append("uvloop")
    except ImportError:
        report.skip("uvloop: not installed; async figures on asyncio only")
    for loop in loops:
        report.attempt(f"async hit [{loop}]", partial(bench_hit, p, report, progress, loop))
    with Worker() as worker:
        for loop in (lp for lp in p.lag_loops if lp in loops):
            worker.attempt(
                report, f"loop lag [{loop}]", partial(bench_lag, p, report, progress, loop)
            )
    for loop in loops:  # the 16 MiB put on every loop, the whole sweep on the last
        sizes = sorted({*p.threshold_sizes, BIG}) if loop == loops[-1] else [BIG]
        puts = partial(bench_puts, p, report, progress, loop, sizes)
        report.attempt(f"async puts [{loop}]", puts)
