"""The async suite: cache hits, offloaded big puts, loop lag, concurrency, threshold.

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
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from aioshmcache import AsyncSenderCache, ReceiverCache, SenderCache, ShmRef
from aioshmcache.aio import DEFAULT_INLINE_THRESHOLD

from ..lag import LoopLagMeter
from ..progress import Progress
from ..units import KiB, MiB, fmt_bytes
from .params import Params, bench_config
from .procs import LazyWorker, Worker
from .report import Report, Row, Target
from .timing import Samples, ShmBuffer, atimed, memcpy_into, percentile, source_array, timed

__all__ = ["run_async_suite"]

S_HIT = "Async: cache hit of a small item, get_and_update_item(None, h)"
S_PUT = "Async: 16 MiB put through the thread pool"
S_LAG = "Async: loop lag of a 1 ms ticker while 16 MiB items stream"
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
                receiver.release(_as_ref(ref))
                limiter = anyio.CapacityLimiter(1)
                for _ in range(p.runs):
                    run = hit.new_run()
                    for _ in range(n):
                        ref, _ = await atimed(run, cache.get_and_update_item(None, "hit"))
                        receiver.release(_as_ref(ref))
                    run = sync_hit.new_run()
                    for _ in range(n):
                        ref, _ = timed(run, sender.get_and_update_item, None, "hit")
                        receiver.release(_as_ref(ref))
                    run = hop.new_run()
                    for _ in range(max(20, n // 20)):
                        await atimed(run, anyio.to_thread.run_sync(_noop, limiter=limiter))
        finally:
            receiver.close()
            sender.close()

    _run(loop, main)
    hs, ss, ts = hit.stat(), sync_hit.stat(), hop.stat()
    report.row(
        S_HIT,
        f"async hit [{loop}]",
        "1 KiB",
        hs,
        vs=("sync hit", ss),
        target=Target("value", "<=", 20e-6),
    )
    report.row(S_HIT, f"sync SenderCache hit [{loop} run]", "1 KiB", ss)
    report.row(
        S_HIT, f"thread hop: anyio.to_thread.run_sync(noop) [{loop}]", "", ts, vs=("async hit", hs)
    )


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
    put, base, rot = Samples(), Samples(), Samples()
    ring = 8 * size
    shm = ShmBuffer(ring)
    slots = ring // (size + 4096) - 1

    async def main() -> None:
        async with AsyncSenderCache.from_config(bench_config(ring, size + 64 * KiB, 1)) as c:
            seq = 0
            for _ in range(3):
                await c.get_and_update_item((item, ()), f"w{seq}")
                seq += 1
            for _ in range(p.runs):
                memcpy_into(shm.view(size), src, n, base.new_run())
                run = rot.new_run()
                for i in range(n):
                    timed(run, np.copyto, shm.view(size, (i % slots) * (size + 4096) + 128), src)
                run = put.new_run()
                for _ in range(n):
                    seq += 1
                    _as_ref((await atimed(run, c.get_and_update_item((item, ()), f"p{seq}")))[0])

    try:
        _run(loop, main)
    finally:
        shm.close()
    ps, bs, rs = put.stat(), base.stat(), rot.stat()
    vs_copy = ("np.copyto", bs)
    report.row(S_PUT, f"np.copyto into warm shm [{loop} run]", "16 MiB", bs)
    report.row(
        S_PUT,
        f"np.copyto into rotating places of a 128 MiB shm buffer [{loop} run]",
        "16 MiB",
        rs,
        vs=vs_copy,
    )
    report.row(
        S_PUT,
        f"await get_and_update_item (a miss: put) [{loop}]",
        "16 MiB",
        ps,
        vs=vs_copy,
        target=Target("ratio", ">=", 0.7),
        note=f"{rs.median / ps.median:.2f}x the rotating copy",
    )


# --- loop lag ---------------------------------------------------------------------------------


def bench_lag(p: Params, report: Report, progress: Progress, loop: str, worker: Worker) -> None:
    size = 16 * MiB
    item = {"data": source_array(size)}
    modes = ["idle", "thread", "thread + reader process", "inline"]
    p99s = {m: Samples() for m in modes}
    p50s = {m: Samples() for m in modes}
    maxs = {m: Samples() for m in modes}
    ticks = dict.fromkeys(modes, 0)
    puts = {m: [0, 0] for m in modes}  # puts, served inline (full)
    for r in range(p.lag_runs):
        progress(
            f"async [{loop}]: loop lag while 16 MiB items stream, run {r + 1}/{p.lag_runs} "
            f"({len(modes)} modes x {p.lag_seconds:.1f} s)"
        )
        for mode in modes:  # interleaved: the idle baseline sees the same load as the others
            lags = _lag_once(p, loop, worker, mode, item, puts[mode])
            p99s[mode].add_run([percentile(lags, 99)])
            p50s[mode].add_run([percentile(lags, 50)])
            maxs[mode].add_run([max(lags, default=math.nan)])
            ticks[mode] += len(lags)
    idle = p99s["idle"].stat()
    for mode in modes:
        st = p99s[mode].stat()
        tgt = Target("value", "<=", 2e-3) if mode.startswith("thread") else None
        n_puts, n_inline = puts[mode]
        note = f"{ticks[mode]} ticks"
        if mode != "idle":
            note += f", {n_puts} puts in {p.lag_runs * p.lag_seconds:.1f} s"
        if n_inline:
            note += f", {n_inline} served inline (full)"
        label = f"{mode} [{loop}]"
        param = "1 ms ticker"
        report.row(
            S_LAG,
            f"lag p99, {label}",
            param,
            st,
            vs=None if mode == "idle" else ("idle loop p99", idle),
            target=tgt,
            note=note,
            plot="looplag",
            series=f"p99 {mode} [{loop}]",
        )
        report.row(S_LAG, f"lag p50, {label}", param, p50s[mode].stat())
        report.row(S_LAG, f"lag max, {label}", param, maxs[mode].stat())


def _lag_once(
    p: Params, loop: str, worker: Worker, mode: str, item: dict[str, Any], puts: list[int]
) -> list[float]:
    """One run of the ticker beside one streaming mode; returns the ticker's lags."""
    ticker = LoopLagMeter(0.001, window=None)
    size = int(item["data"].nbytes)

    async def main() -> None:
        threshold = NEVER if mode == "inline" else DEFAULT_INLINE_THRESHOLD
        cfg = bench_config(16 * (size + 64 * KiB), size + 64 * KiB, 1)
        async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=threshold) as c:
            reader = mode.endswith("reader process")
            if reader:
                worker.attach(c.handle())
                worker.send("ack_stream", "copy")

            async def stream() -> None:
                deadline = time.monotonic() + p.lag_seconds
                i = 0
                try:
                    while time.monotonic() < deadline:
                        # a server yields between requests (it awaits its sockets)
                        await anyio.sleep(0.01 if mode == "idle" else 0)
                        if mode == "idle":
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
                    tg.cancel_scope.cancel()  # stops the ticker

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker.run)
                    tg.start_soon(stream)
            finally:
                if reader:
                    worker.send_refs(None)
                    worker.reply()
                    worker.detach()

    _run(loop, main)
    return list(ticker.samples)


# --- many small concurrent requests ---------------------------------------------------------


def bench_concurrent(p: Params, report: Report, progress: Progress, loop: str) -> None:
    tasks, per_task = p.concurrent_tasks, p.concurrent_requests
    progress(f"async [{loop}]: {tasks} concurrent tasks x {per_task} small requests")
    n_items = 64
    items = [{"data": source_array(1024, seed=i)} for i in range(n_items)]
    total = tasks * per_task
    conc_rate, seq_rate, lat, put_rate = Samples(), Samples(), Samples(), Samples()

    async def main() -> None:
        sender = SenderCache(bench_config(16 * MiB, 1 * MiB, 1))  # the hits: never evicted
        fresh = SenderCache(bench_config(16 * MiB, 1 * MiB, 1))  # the puts churn this one
        try:
            async with AsyncSenderCache(sender) as c, AsyncSenderCache(fresh) as cf:
                for i, it in enumerate(items):
                    await c.get_and_update_item((it, ()), f"h{i}")
                seq = [0]

                async def client(k: int, out: list[float]) -> None:
                    for j in range(per_task):
                        # a server awaits its socket between requests
                        await anyio.lowlevel.checkpoint()
                        t0 = _clock()
                        await c.get_and_update_item(None, f"h{(k * 7 + j) % n_items}")
                        out.append((_clock() - t0) * 1e-9)

                async def putter(k: int) -> None:
                    for _ in range(per_task):
                        await anyio.lowlevel.checkpoint()
                        i = seq[0]
                        seq[0] += 1
                        await cf.get_and_update_item((items[i % n_items], ()), f"new{i}")

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
            fresh.close()
            sender.close()

    _run(loop, main)
    cs, ss, ls, ps = conc_rate.stat(), seq_rate.stat(), lat.stat(), put_rate.stat()
    param = f"{tasks} tasks x {per_task}"
    report.row(
        S_CONC,
        f"hits/s, concurrent tasks [{loop}]",
        param,
        cs,
        kind="rate",
        baseline="one task, same requests",
        ratio=cs.median / ss.median,
    )
    report.row(S_CONC, f"hits/s, one task [{loop}]", param, ss, kind="rate")
    report.row(S_CONC, f"hit latency under concurrency [{loop}]", param, ls)
    report.row(
        S_CONC, f"new 1 KiB items (puts)/s, concurrent tasks [{loop}]", param, ps, kind="rate"
    )


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
                            seq += 1
                            await atimed(run, c.get_and_update_item((item, ()), f"t{seq}"))
                    run = hop.new_run()
                    for _ in range(10):
                        await atimed(run, anyio.to_thread.run_sync(_noop, limiter=limiter))
            await ci.aclose()
            await ct.aclose()
        finally:
            sender.close()

    try:
        _run(loop, main)
    finally:
        shm.close()
    hs = hop.stat()
    report.row(S_THR, f"thread hop (noop) [{loop}]", "", hs)
    crossover: int | None = None
    for size in sizes:
        ins, ths, bs = inline[size].stat(), thread[size].stat(), base[size].stat()
        for label, st, vs, series in (
            (f"np.copyto [{loop}]", bs, None, "np.copyto (baseline)"),
            (f"put inline on the loop [{loop}]", ins, ("np.copyto", bs), "inline put"),
            (f"put in a worker thread [{loop}]", ths, ("inline put", ins), "thread put"),
        ):
            report.row(
                S_THR, label, fmt_bytes(size), st, vs=vs, plot="threshold", series=series, x=size
            )
        if crossover is None and ths.median <= ins.median:
            crossover = size
    medians = [(size, inline[size].stat().median, thread[size].stat().median) for size in sizes]
    thr = DEFAULT_INLINE_THRESHOLD
    if crossover is None:
        latency = (
            f"a worker thread never made the put itself faster (up to {fmt_bytes(max(sizes))}): "
            "the hop is pure overhead for the request"
        )
    else:
        latency = f"the put itself is faster in a thread from {fmt_bytes(crossover)} on"
    report.add(
        Row(
            S_THR,
            f"latency crossover: first size where thread <= inline [{loop}]",
            "",
            float(crossover or math.nan),
            kind="bytes",
            note=latency,
        )
    )
    even = _break_even(medians)
    if even is None:
        stall = "no break-even in the sizes measured"
        verdict = "cannot tell"
    else:
        stall = (
            f"an inline put stalls the loop as long as the hop delays the request at "
            f"~{fmt_bytes(int(even))}"
        )
        if even / 2 <= thr <= even * 2:
            verdict = f"supports {fmt_bytes(thr)} (within 2x of the break-even)"
        elif thr > even * 2:
            verdict = (
                f"{fmt_bytes(thr)} is high: inline copies above ~{fmt_bytes(int(even))} stall "
            )
            verdict += "the loop longer than a hop costs"
        else:
            verdict = f"{fmt_bytes(thr)} is low: hops below ~{fmt_bytes(int(even))} cost more than "
            verdict += "the stall they avoid"
    report.add(
        Row(
            S_THR,
            f"break-even: inline put time = thread put - inline put [{loop}]",
            "",
            float(even if even is not None else math.nan),
            kind="bytes",
            note=stall,
        )
    )
    report.notes.append(
        f"inline/thread threshold [{loop}]: {latency}; {stall}: {verdict} "
        f"(DEFAULT_INLINE_THRESHOLD = {fmt_bytes(thr)})"
    )


def _break_even(medians: list[tuple[int, float, float]]) -> float | None:
    """Size where an inline put's loop stall equals the latency a thread hop adds.

    Below it a put is cheaper for everyone inline (the stall is shorter than the hop's cost);
    above it the loop is better off handing the copy to a thread. Interpolated on log scales
    between the two measured sizes around the sign change.
    """
    prev: tuple[float, float] | None = None
    for size, ins, ths in medians:
        diff = ins - (ths - ins)  # stall minus the hop's extra latency
        if diff >= 0:
            if prev is None:
                return float(size)
            ps, pd = prev
            frac = -pd / (diff - pd) if diff != pd else 0.0
            return math.exp(math.log(ps) + frac * (math.log(size) - math.log(ps)))
        prev = (float(size), diff)
    return None


def run_async_suite(p: Params, report: Report, progress: Progress) -> None:
    loops = _loops(report, ["asyncio", "uvloop"])
    lag_loops = [lp for lp in p.lag_loops if lp in loops]
    for loop in loops:
        report.attempt(f"async hit [{loop}]", partial(bench_hit, p, report, progress, loop))
    for loop in loops:
        report.attempt(
            f"async 16 MiB put [{loop}]", partial(bench_big_put, p, report, progress, loop)
        )
    with LazyWorker() as lw:
        for loop in lag_loops:

            def lag(loop: str = loop) -> None:
                bench_lag(p, report, progress, loop, lw.get())

            if not report.attempt(f"loop lag [{loop}]", lag):
                lw.reset()
    for loop in loops:
        report.attempt(
            f"concurrent requests [{loop}]", partial(bench_concurrent, p, report, progress, loop)
        )
    report.attempt(
        f"inline vs thread [{loops[-1]}]", partial(bench_threshold, p, report, progress, loops[-1])
    )
