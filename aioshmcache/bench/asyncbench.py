"""The async suite (issue 5): cache hits, offloaded big puts, loop lag, concurrency, threshold.

Runs on asyncio and on uvloop (through anyio). The writer is an ``AsyncSenderCache``; the
readers, where there are any, are the spawned worker process. The inline-vs-thread threshold is
measured with two ``AsyncSenderCache`` objects wrapping one ``SenderCache``: one that copies
everything inline on the loop, one that sends every copy to a worker thread.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from aioshmcache import AsyncSenderCache, ReceiverCache, SenderCache, ShmRef
from aioshmcache.aio import DEFAULT_INLINE_THRESHOLD

from .params import Params, bench_config
from .procs import Worker
from .report import Report, Row, Target
from .timing import (
    KiB,
    MiB,
    Progress,
    Samples,
    ShmBuffer,
    fmt_bytes,
    memcpy_into,
    percentile,
    source_array,
)

__all__ = ["run_async_suite"]

S_HIT = "Async: cache hit of a small item, get_and_update_item(None, h) (issue 5)"
S_PUT = "Async: 16 MiB put through the thread pool (issue 5)"
S_LAG = "Async: loop lag of a 1 ms ticker while 16 MiB items stream (issue 5)"
S_CONC = "Async: many small concurrent requests"
S_THR = "Async: inline vs thread (DEFAULT_INLINE_THRESHOLD = 1 MiB)"

_clock = time.perf_counter_ns
NEVER = 1 << 62


def _run(loop: str, fn: Callable[[], Awaitable[None]]) -> None:
    options: dict[str, Any] = {}
    if loop == "uvloop":
        uvloop: Any = importlib.import_module("uvloop")
        options["loop_factory"] = uvloop.new_event_loop
    anyio.run(fn, backend="asyncio", backend_options=options)


def _loops(report: Report, wanted: list[str]) -> list[str]:
    out = []
    for name in wanted:
        if name == "uvloop":
            try:
                importlib.import_module("uvloop")
            except ImportError:
                report.skip("uvloop: not installed; async figures on asyncio only")
                continue
        out.append(name)
    return out


# --- cache hit ------------------------------------------------------------------------------


def bench_hit(p: Params, report: Report, progress: Progress, loop: str) -> None:
    progress(f"async [{loop}]: small cache hit ({p.runs} runs)")
    item = {"data": source_array(1024)}
    n = p.n_ops(1024)
    hit, sync_hit, hop = Samples(), Samples(), Samples()

    async def main() -> None:
        sender = SenderCache(bench_config(8 * MiB, 1 * MiB, 1))
        receiver = ReceiverCache.attach(sender.handle())  # a live reader: hand-outs owe it
        try:
            cache = AsyncSenderCache(sender)
            async with cache:
                ref, _ = await cache.get_and_update_item((item, ()), "hit")
                receiver.store.ack(_as_ref(ref))
                limiter = anyio.CapacityLimiter(1)
                for _ in range(p.runs):
                    run = hit.new_run()
                    for _ in range(n):
                        t0 = _clock()
                        ref, _ = await cache.get_and_update_item(None, "hit")
                        run.append((_clock() - t0) * 1e-9)
                        receiver.store.ack(_as_ref(ref))
                    run = sync_hit.new_run()
                    for _ in range(n):
                        t0 = _clock()
                        ref, _ = sender.get_and_update_item(None, "hit")
                        run.append((_clock() - t0) * 1e-9)
                        receiver.store.ack(_as_ref(ref))
                    run = hop.new_run()
                    for _ in range(max(20, n // 20)):
                        t0 = _clock()
                        await anyio.to_thread.run_sync(_noop, limiter=limiter)
                        run.append((_clock() - t0) * 1e-9)
        finally:
            receiver.close()
            sender.close()

    _run(loop, main)
    hs, ss, ts = hit.stat(), sync_hit.stat(), hop.stat()
    report.add(Row(S_HIT, f"async hit [{loop}]", "1 KiB", hs.median, stat=hs,
                   baseline="sync hit", ratio=ss.median / hs.median,
                   target=Target("value", "<=", 20e-6, "issues 5, 7")))
    report.add(Row(S_HIT, f"sync SenderCache hit [{loop} run]", "1 KiB", ss.median, stat=ss))
    report.add(Row(S_HIT, f"thread hop: anyio.to_thread.run_sync(noop) [{loop}]", "", ts.median,
                   stat=ts, baseline="async hit", ratio=hs.median / ts.median))


def _noop() -> None:
    return None


def _as_ref(x: object) -> ShmRef:
    if not isinstance(x, ShmRef):
        raise RuntimeError(f"expected a ShmRef, the cache served {type(x).__name__} inline")
    return x


# --- 16 MiB put through the thread pool ---------------------------------------------------------


def bench_big_put(p: Params, report: Report, progress: Progress, loop: str) -> None:
    progress(f"async [{loop}]: 16 MiB put through the thread pool ({p.runs} runs)")
    size = 16 * MiB
    src = source_array(size)
    item = {"data": src}
    n = p.n_ops(size)
    put, base = Samples(), Samples()
    shm = ShmBuffer(size)

    async def main() -> None:
        async with AsyncSenderCache.from_config(bench_config(8 * size, size + 64 * KiB, 1)) as c:
            seq = 0
            for _ in range(3):
                await c.get_and_update_item((item, ()), f"w{seq}")
                seq += 1
            for _ in range(p.runs):
                memcpy_into(shm.view(size), src, n, base.new_run())
                run = put.new_run()
                for _ in range(n):
                    t0 = _clock()
                    ref, _ = await c.get_and_update_item((item, ()), f"p{seq}")
                    run.append((_clock() - t0) * 1e-9)
                    _as_ref(ref)
                    seq += 1

    try:
        _run(loop, main)
    finally:
        shm.close()
    ps, bs = put.stat(), base.stat()
    report.add(Row(S_PUT, f"np.copyto into warm shm [{loop} run]", "16 MiB", bs.median, stat=bs))
    report.add(Row(S_PUT, f"await get_and_update_item (a miss: put) [{loop}]", "16 MiB",
                   ps.median, stat=ps, baseline="np.copyto", ratio=bs.median / ps.median,
                   target=Target("ratio", ">=", 0.7, "issue 5")))


# --- loop lag ---------------------------------------------------------------------------------


def bench_lag(p: Params, report: Report, progress: Progress, loop: str, worker: Worker) -> None:
    size = 16 * MiB
    item = {"data": source_array(size)}
    modes = ["idle", "thread", "thread + reader process", "inline"]
    for mode in modes:
        progress(f"async [{loop}]: loop lag, 16 MiB stream, {mode} ({p.lag_seconds:.1f} s)")
        lags: list[float] = []
        puts = [0, 0]  # puts, served inline (full)

        async def main(mode: str = mode, lags: list[float] = lags, puts: list[int] = puts) -> None:
            threshold = NEVER if mode == "inline" else DEFAULT_INLINE_THRESHOLD
            cfg = bench_config(16 * (size + 64 * KiB), size + 64 * KiB, 1)
            async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=threshold) as c:
                reader = mode.endswith("reader process")
                if reader:
                    worker.attach(c.handle())
                    worker.send("ack_stream", "copy")
                stop = anyio.Event()

                async def ticker() -> None:
                    while not stop.is_set():
                        t0 = _clock()
                        await anyio.sleep(0.001)
                        lags.append(max(0.0, (_clock() - t0) * 1e-9 - 0.001))

                async def stream() -> None:
                    deadline = time.monotonic() + p.lag_seconds
                    i = 0
                    try:
                        while time.monotonic() < deadline:
                            if mode == "idle":
                                await anyio.sleep(0.01)
                                continue
                            ref, _ = await c.get_and_update_item(
                                (item, ()), f"lag{i}", wait_for_space=5.0 if reader else None
                            )
                            i += 1
                            puts[0] += 1
                            if isinstance(ref, ShmRef):
                                if reader:
                                    worker.send_refs([ref])
                            else:
                                puts[1] += 1
                    finally:
                        stop.set()

                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(ticker)
                        tg.start_soon(stream)
                finally:
                    if reader:
                        worker.send_refs(None)
                        worker.reply()
                        worker.detach()

        _run(loop, main)
        p50, p99, mx = percentile(lags, 50), percentile(lags, 99), max(lags, default=math.nan)
        tgt = Target("value", "<=", 2e-3, "issue 5") if mode.startswith("thread") else None
        note = "" if mode == "idle" else f"{puts[0]} puts in {p.lag_seconds:.1f} s"
        if puts[1]:
            note += f", {puts[1]} served inline (full)"
        label = f"{mode} [{loop}]"
        report.add(Row(S_LAG, f"lag p99, {label}", f"{len(lags)} ticks", p99, target=tgt,
                       note=note, plot="looplag", series=f"p99 {mode} [{loop}]"))
        report.add(Row(S_LAG, f"lag p50, {label}", f"{len(lags)} ticks", p50))
        report.add(Row(S_LAG, f"lag max, {label}", f"{len(lags)} ticks", mx))


# --- many small concurrent requests ---------------------------------------------------------


def bench_concurrent(p: Params, report: Report, progress: Progress, loop: str) -> None:
    tasks, per_task = p.concurrent_tasks, p.concurrent_requests
    progress(f"async [{loop}]: {tasks} concurrent tasks x {per_task} small requests")
    n_items = 64
    items = [{"data": source_array(1024, seed=i)} for i in range(n_items)]
    total = tasks * per_task
    conc_rate, seq_rate, lat, put_rate = Samples(), Samples(), Samples(), Samples()

    async def main() -> None:
        sender = SenderCache(bench_config(16 * MiB, 1 * MiB, 1))
        try:
            async with AsyncSenderCache(sender) as c:
                for i, it in enumerate(items):
                    await c.get_and_update_item((it, ()), f"h{i}")
                seq = [0]

                async def client(k: int, out: list[float]) -> None:
                    for j in range(per_task):
                        await anyio.sleep(0)  # a server awaits its socket between requests
                        t0 = _clock()
                        await c.get_and_update_item(None, f"h{(k * 7 + j) % n_items}")
                        out.append((_clock() - t0) * 1e-9)

                async def putter(k: int) -> None:
                    for _ in range(per_task):
                        await anyio.sleep(0)
                        i = seq[0]
                        seq[0] += 1
                        await c.get_and_update_item((items[i % n_items], ()), f"new{i}")

                for _ in range(p.runs):
                    run = lat.new_run()
                    t0 = _clock()
                    async with anyio.create_task_group() as tg:
                        for k in range(tasks):
                            tg.start_soon(client, k, run)
                    conc_rate.add_run([total / ((_clock() - t0) * 1e-9)])
                    t0 = _clock()
                    for k in range(tasks):
                        await client(k, [])
                    seq_rate.add_run([total / ((_clock() - t0) * 1e-9)])
                    t0 = _clock()
                    async with anyio.create_task_group() as tg:
                        for k in range(tasks):
                            tg.start_soon(putter, k)
                    put_rate.add_run([total / ((_clock() - t0) * 1e-9)])
        finally:
            sender.close()

    _run(loop, main)
    cs, ss, ls, ps = conc_rate.stat(), seq_rate.stat(), lat.stat(), put_rate.stat()
    param = f"{tasks} tasks × {per_task}"
    report.add(Row(S_CONC, f"hits/s, concurrent tasks [{loop}]", param, cs.median, kind="rate",
                   stat=cs, baseline="one task, same requests", ratio=cs.median / ss.median))
    report.add(Row(S_CONC, f"hits/s, one task [{loop}]", param, ss.median, kind="rate", stat=ss))
    report.add(Row(S_CONC, f"hit latency under concurrency [{loop}]", param, ls.median, stat=ls))
    report.add(Row(S_CONC, f"new 1 KiB items (puts)/s, concurrent tasks [{loop}]", param,
                   ps.median, kind="rate", stat=ps))


# --- inline vs thread threshold -------------------------------------------------------------


def bench_threshold(p: Params, report: Report, progress: Progress, loop: str) -> None:
    sizes = p.threshold_sizes
    progress(f"async [{loop}]: inline vs thread put for {', '.join(map(fmt_bytes, sizes))}")
    biggest = max(sizes)
    shm = ShmBuffer(biggest)
    inline: dict[int, Samples] = {s: Samples() for s in sizes}
    thread: dict[int, Samples] = {s: Samples() for s in sizes}
    base: dict[int, Samples] = {s: Samples() for s in sizes}
    hop = Samples()

    async def main() -> None:
        sender = SenderCache(bench_config(8 * (biggest + 64 * KiB), biggest + 64 * KiB, 1))
        try:
            ci = AsyncSenderCache(sender, inline_threshold_bytes=NEVER)
            ct = AsyncSenderCache(sender, inline_threshold_bytes=0)
            limiter = anyio.CapacityLimiter(4)
            seq = 0
            for size in sizes:
                src = source_array(size)
                item = {"data": src}
                n = max(6, p.n_ops(size) // 2)
                for _ in range(2):  # warm both paths and the worker threads
                    for c in (ci, ct):
                        await c.get_and_update_item((item, ()), f"w{seq}")
                        seq += 1
                for _ in range(p.runs):
                    memcpy_into(shm.view(size), src, n, base[size].new_run())
                    for c, out in ((ci, inline[size]), (ct, thread[size])):
                        run = out.new_run()
                        for _ in range(n):
                            t0 = _clock()
                            await c.get_and_update_item((item, ()), f"t{seq}")
                            run.append((_clock() - t0) * 1e-9)
                            seq += 1
                    run = hop.new_run()
                    for _ in range(10):
                        t0 = _clock()
                        await anyio.to_thread.run_sync(_noop, limiter=limiter)
                        run.append((_clock() - t0) * 1e-9)
            await ci.aclose()
            await ct.aclose()
        finally:
            sender.close()

    try:
        _run(loop, main)
    finally:
        shm.close()
    hs = hop.stat()
    report.add(Row(S_THR, f"thread hop (noop) [{loop}]", "", hs.median, stat=hs))
    crossover: int | None = None
    for size in sizes:
        ins, ths, bs = inline[size].stat(), thread[size].stat(), base[size].stat()
        sz = fmt_bytes(size)
        report.add(Row(S_THR, f"np.copyto [{loop}]", sz, bs.median, stat=bs, plot="threshold",
                       series="np.copyto (baseline)", x=size))
        report.add(Row(S_THR, f"put inline on the loop [{loop}]", sz, ins.median, stat=ins,
                       baseline="np.copyto", ratio=bs.median / ins.median, plot="threshold",
                       series="inline put", x=size))
        report.add(Row(S_THR, f"put in a worker thread [{loop}]", sz, ths.median, stat=ths,
                       baseline="inline put", ratio=ins.median / ths.median, plot="threshold",
                       series="thread put", x=size))
        if crossover is None and ths.median <= ins.median:
            crossover = size
    thr = DEFAULT_INLINE_THRESHOLD
    if crossover is None:
        verdict = (f"the thread never beat inline up to {fmt_bytes(max(sizes))}: the threshold "
                   "is set by loop lag, not latency")
    elif crossover > thr:
        verdict = (f"latency crossover at {fmt_bytes(crossover)} (> {fmt_bytes(thr)}): inline is "
                   f"faster below it, so {fmt_bytes(thr)} is conservative — it trades a little "
                   "latency between the two for a shorter loop stall")
    elif crossover == thr:
        verdict = f"latency crossover at {fmt_bytes(crossover)}: supports {fmt_bytes(thr)}"
    else:
        verdict = (f"latency crossover at {fmt_bytes(crossover)} (< {fmt_bytes(thr)}): threads "
                   f"already win below the {fmt_bytes(thr)} threshold")
    report.add(Row(S_THR, f"measured crossover (first size where thread ≤ inline) [{loop}]",
                   "", float(crossover or math.nan), kind="bytes", note=verdict))
    report.notes.append(f"inline/thread threshold [{loop}]: {verdict}")


def run_async_suite(p: Params, report: Report, progress: Progress) -> None:
    loops = _loops(report, ["asyncio", "uvloop"])
    lag_loops = [lp for lp in p.lag_loops if lp in loops]
    for loop in loops:
        bench_hit(p, report, progress, loop)
    for loop in loops:
        bench_big_put(p, report, progress, loop)
    with Worker() as worker:
        for loop in lag_loops:
            bench_lag(p, report, progress, loop, worker)
    for loop in loops:
        bench_concurrent(p, report, progress, loop)
    bench_threshold(p, report, progress, loops[-1])
