"""The store suite: put / get / lease against the memcpy limit, steady state, churn and scaling.

Each workload measures its baseline in the same run, interleaved with the subject (run 1:
baseline, subject; run 2: baseline, subject; ...), so that a load spike from the other users of
this machine slows both. Items are single-array mappings ``{"data": uint8 array}``; the writer
is this process, readers are an in-process reader store (for per-operation timing) or the
spawned worker (for cross-process steady state, churn and scaling).
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

from aioshmcache import SenderCache, ShmObjectStore, ShmRef

from ..progress import Progress
from ..units import GiB, KiB, MiB, fmt_bytes
from .params import Params, bench_config
from .procs import LazyWorker, Worker
from .report import Report, Target
from .timing import (
    Cell,
    Samples,
    ShmBuffer,
    Stat,
    each,
    interleave,
    memcpy_into,
    source_array,
    timed,
)

__all__ = ["run_store_suite"]

S_STORE = "Store: one array item, in-process reader (vs np.copyto into warm shm)"
S_SMALL = "Small items steady state: 1 KiB, ring churning, reader in another process"
S_SENDER = "SenderCache steady state: 1 KiB misses (puts), ring churning, reader process acking"
S_FRESH = "Fresh cache: first put vs warm put"
S_CHURN = "Churn: 64 MiB ring, 1 MiB items, a reader process acknowledging each"
S_READERS = "Read path vs attached readers"
S_CACHE = "Cost vs cache size"
S_GC = "Writer state vs the garbage collector: many live small items"
GC_TARGET_ENTRIES = 250_000  # the figure the target names
BATCH = 256  # references sent to the reader process at a time

_clock = time.perf_counter_ns


def _ring_for(size: int) -> int:
    """A ring larger than the CPU caches (as real caches are), holding at least 6 items."""
    return max(64 * MiB, 6 * (size + 4096))


def _free_memory() -> tuple[int, int]:
    """(MemAvailable, free bytes in /dev/shm)."""
    avail = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(
                (int(ln.split()[1]) * KiB for ln in f if ln.startswith("MemAvailable:")), 0
            )
    except OSError:
        pass
    st = os.statvfs("/dev/shm")
    return avail, st.f_bavail * st.f_frsize


def _room_for(report: Report, nbytes: int, what: str) -> bool:
    """Whether a segment of ``nbytes`` leaves the machine (and others) some room; else a skip."""
    avail, shm = _free_memory()
    if avail > nbytes + 3 * GiB and shm > nbytes + 1 * GiB:
        return True
    report.skip(
        f"{what}: not enough free memory for {fmt_bytes(nbytes)} "
        f"({fmt_bytes(avail)} available, {fmt_bytes(shm)} in /dev/shm)"
    )
    return False


@contextmanager
def _store_and_reader(cfg: Any) -> Iterator[tuple[ShmObjectStore, ShmObjectStore]]:
    with ShmObjectStore.create(cfg) as store, ShmObjectStore.from_handle(store.handle()) as rd:
        yield store, rd


def _handout(store: ShmObjectStore, key: str) -> ShmRef:
    """The writer's part of a read: a new hand-out of ``key``."""
    ref = store.get_cached(key)
    if ref is None:
        raise RuntimeError(f"{key!r} is not cached any more")
    return ref


def _lease_once(reader: ShmObjectStore, ref: ShmRef) -> None:
    """A zero-copy read: the view, then the acknowledgement."""
    v = reader.get(ref, copy=False)
    reader.ack(ref)
    del v


# --- put / get / lease per size: the table of subjects, each against np.copyto -----------------

#: (label, cell, plot series, target for a size or None)
_STORE_ROWS: list[tuple[str, str, str, Callable[[int], Target | None]]] = [
    (
        "np.copyto into rotating places of a ring-sized shm buffer",
        "rotating",
        "np.copyto, rotating",
        lambda s: None,
    ),
    ("put", "put", "put", lambda s: Target("ratio", ">=", 0.8) if s == 16 * MiB else None),
    (
        "get (copy)",
        "get",
        "get (copy)",
        lambda s: Target("ratio", ">=", 0.8) if s in (MiB, 16 * MiB) else None,
    ),
    ("get (lease: view + ack)", "lease", "get (lease)", lambda s: Target("value", "<=", 20e-6)),
    (
        "np.array(shm view): copy into a fresh array",
        "copyout",
        "np.array(shm view)",
        lambda s: None,
    ),
]


def bench_store_ops(p: Params, report: Report, progress: Progress) -> None:
    shm = ShmBuffer(max(_ring_for(s) for s in p.sizes))
    try:
        for size in p.sizes:
            progress(f"store: put / get / lease of {fmt_bytes(size)} ({p.runs} runs)")
            stats = _store_ops(p, shm, size)
            sz, b = fmt_bytes(size), stats["base"]
            label = "np.copyto into warm shm (baseline)"
            kw: dict[str, Any] = {"plot": "store", "x": size}
            report.row(S_STORE, label, sz, b, series="np.copyto (baseline)", **kw)
            for label, cell, series, target in _STORE_ROWS:
                st = stats[cell]
                note = f"{stats['rotating'].median / st.median:.2f}x the rotating copy"
                note = note if cell == "put" else ""
                kw |= {"target": target(size), "series": series, "note": note}
                report.row(S_STORE, label, sz, st, vs=("np.copyto", b), **kw)
    finally:
        shm.close()


def _store_ops(p: Params, shm: ShmBuffer, size: int) -> dict[str, Stat]:
    n, src = p.n_ops(size), source_array(size)
    item, ring, keys = {"data": src}, _ring_for(size), itertools.count()
    with _store_and_reader(bench_config(ring, size + 64 * KiB, 1)) as (store, reader):
        last = ""

        def put(out: list[float]) -> None:
            nonlocal last
            for _ in range(n):
                last = f"k{next(keys)}"
                reader.ack(timed(out, store.put, last, item))

        for _ in range(max(3, n // 10)):  # warm-up: the ring wraps at least once for big items
            put([])
        cells: dict[str, Cell] = {
            "base": partial(memcpy_into, shm.view(size), src, n),
            # what a put's copy meets: a new place in the ring each time
            "rotating": each(n, np.copyto, lambda i: (shm.rotating(size, i, span=ring), src)),
            "put": put,
            # a new hand-out (untimed: the writer's part), then the read
            "get": each(n, reader.get, lambda i: (_handout(store, last),)),
            "lease": each(n, _lease_once, lambda i: (reader, _handout(store, last))),
            "copyout": each(n, np.array, lambda i: (shm.view(size),)),  # into a fresh array
        }
        return interleave(p.runs, cells)


# --- steady state of small items --------------------------------------------------------------


def bench_small_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    progress(f"small items: 1 KiB steady state, reader process ({p.runs} runs)")
    item = {"data": source_array(1024)}
    keys = itertools.count()
    # a 2 MiB ring holds ~1,700 items: with two batches of 256 in flight it churns continuously
    put = Samples()
    got = {"copy": Samples(), "lease": Samples()}
    with ShmObjectStore.create(bench_config(2 * MiB, 64 * KiB, 1)) as store:
        worker.attach(store.handle())
        try:
            for mode, samples in got.items():
                worker.send("timed_gets", mode)
                for r in range(p.runs + 1):  # run 0 warms up
                    putrun: list[float] = []
                    getrun: list[float] = []
                    pending = 0
                    for _ in range(p.small_batches if r else 4):
                        put1 = store.put
                        worker.send_refs(
                            [timed(putrun, put1, f"s{next(keys)}", item) for _ in range(BATCH)]
                        )
                        pending += 1
                        if pending >= 2:  # keep one batch in flight while putting the next
                            getrun += _recv_times(worker)
                            pending -= 1
                    for _ in range(pending):
                        getrun += _recv_times(worker)
                    if r and mode == "copy":
                        put.add_run(putrun)
                    if r:
                        samples.add_run(getrun)
                worker.send_refs(None)
                worker.reply()
            evictions = store.evictions
        finally:
            worker.detach()
    note = f"{evictions:,} evictions, gc {'on' if gc.isenabled() else 'OFF'}"
    for label, st, series, limit, extra in (
        ("put (writer process)", put.stat(), "put", 10e-6, note),
        ("get (copy, reader process)", got["copy"].stat(), "get (copy)", 8e-6, ""),
        ("get (lease: view + ack, reader process)", got["lease"].stat(), "get (lease)", 8e-6, ""),
    ):
        kw: dict[str, Any] = {"target": Target("value", "<=", limit), "note": extra}
        report.row(S_SMALL, label, "1 KiB", st, plot="small", series=series, **kw)


def _recv_times(worker: Worker) -> list[float]:
    r = worker.conn.recv()
    if isinstance(r, tuple):  # ("error", msg): the worker's loop failed
        raise RuntimeError(f"bench worker: {r[1] if len(r) > 1 else r}")
    return [ns * 1e-9 for ns in r]


class _FullCollections:
    """Counts the garbage collector's full (generation 2) collections while installed."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        self.n += phase == "start" and info["generation"] == 2

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def bench_sender_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    """1 KiB items through ``SenderCache.get_and_update_item``: every call a miss (a put) into a
    2 MiB ring that evicts all the time, a reader process reading and acknowledging each
    reference in batches of 256; and a hit of a cached item.

    The put latency's maximum is over every put of every run (the issue's "no eviction
    bursts"), measured twice: as is, where the worst puts are the ones a full garbage collection
    of this whole process lands in (its cost is the process's heap, not the cache's: the writer
    keeps no object per item), and after ``gc.freeze()`` (what a server does once its start-up
    objects exist), which leaves the cache's own worst case."""
    progress(f"SenderCache: {p.runs} x {p.sender_puts:,} steady-state 1 KiB puts, reader acking")
    item = ({"data": source_array(1024)}, ())
    put, hit = Samples(), Samples()
    worst, fulls = {"as is": 0.0, "frozen": 0.0}, {"as is": 0, "frozen": 0}
    keys = itertools.count()
    with SenderCache(bench_config(2 * MiB, 64 * KiB, 1)) as cache:
        worker.attach(cache.handle())
        try:
            worker.send("ack_stream", "copy")
            for mode in ("as is", "frozen"):
                if mode == "frozen":
                    gc.freeze()
                try:
                    with _FullCollections() as counted:
                        for r in range(p.runs + 1):  # run 0 warms up
                            run: list[float] = []
                            refs: list[ShmRef] = []
                            for _ in range(p.sender_puts):
                                key = f"m{next(keys)}"
                                refs.append(timed(run, cache.get_and_update_item, item, key)[0])
                                if len(refs) == BATCH:
                                    worker.send_refs(refs)
                                    refs = []
                            worker.send_refs(refs)
                            if r:
                                worst[mode] = max(worst[mode], max(run))
                            if r and mode == "as is":
                                put.add_run(run)
                                hot = hit.new_run()
                                for _ in range(1000):
                                    ref, _ = timed(hot, cache.get_and_update_item, None, key)
                                    cache.release(ref)
                    fulls[mode] = counted.n
                finally:
                    gc.unfreeze()
            worker.send_refs(None)
            worker.reply()
            evictions = cache.snapshot().evictions
        finally:
            worker.detach()
    ps, n = put.stat(), p.runs * p.sender_puts
    gc_note = f"{evictions:,} evictions, gc {'on' if gc.isenabled() else 'OFF'}"
    target = Target("value", "<=", 10e-6)
    report.row(
        S_SENDER, "get_and_update_item, miss (put)", "1 KiB", ps, note=gc_note, target=target
    )
    report.row(
        S_SENDER,
        f"put latency, max over {n:,} puts, after gc.freeze()",
        "1 KiB",
        worst["frozen"],
        target=Target("value", "<=", 5e-3),
        note=f"{fulls['frozen']} full collections of the unfrozen rest",
    )
    report.row(
        S_SENDER,
        f"put latency, max over {n:,} puts, as is",
        "1 KiB",
        worst["as is"],
        note=f"p99 {ps.p99 * 1e6:.1f} us; {fulls['as is']} full collections of this "
        f"process ({len(gc.get_objects()):,} tracked objects)",
    )
    report.row(S_SENDER, "get_and_update_item, hit (then release)", "1 KiB", hit.stat())


# --- fresh vs warm put -----------------------------------------------------------------------


def bench_fresh_vs_warm(p: Params, report: Report, progress: Progress) -> None:
    cache, size = p.fresh_cache, 16 * MiB
    if not _room_for(report, cache, "fresh vs warm put"):
        return
    progress(f"fresh {fmt_bytes(cache)} cache: first 16 MiB put vs warm put ({p.fresh_runs} runs)")
    item = {"data": source_array(size)}
    s = {k: Samples() for k in ("create", "first", "fresh", "warm", "hot")}
    for _ in range(p.fresh_runs):
        cfg = bench_config(cache, size + 64 * KiB, 1)
        with timed(s["create"].new_run(), ShmObjectStore.create, cfg) as store:
            timed(s["first"].new_run(), store.put, "first", item)
            run = s["fresh"].new_run()
            for j in range(1, 8):  # more puts into pages no put has written yet
                timed(run, store.put, f"fresh{j}", item)
            for j in range(cache // (size + 64 * KiB) + 2):  # wrap the ring: pages written before
                store.put(f"wrap{j}", item)
            run = s["warm"].new_run()
            for j in range(5):  # steady state: written once, long out of the CPU caches
                timed(run, store.put, f"warm{j}", item)
            run = s["hot"].new_run()
            for j in range(3):
                store.clear()  # the ring starts again at address 0: the very same pages, hot
                timed(run, store.put, f"hot{j}", item)
    st = {k: v.stat() for k, v in s.items()}
    param, vs = f"{fmt_bytes(cache)} cache, 16 MiB item", ("warm put", st["warm"])
    for label, key, base in (
        ("create the cache (fallocate + prefault)", "create", None),
        ("first put into the fresh cache", "first", vs),
        ("puts 2-8 into the fresh cache (pages not yet written)", "fresh", vs),
        ("warm put (after the ring wrapped: pages written before)", "warm", None),
        ("hot put (the same pages again right after clear)", "hot", vs),
    ):
        what = fmt_bytes(cache) if key == "create" else param
        report.row(S_FRESH, label, what, st[key], vs=base)
    first_vs_warm = st["first"].median / st["warm"].median
    target = Target("value", "<=", 1.5)
    report.row(S_FRESH, "first put ÷ warm put", param, first_vs_warm, kind="ratio", target=target)


# --- churn --------------------------------------------------------------------------------------


def bench_churn(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    size, ring = 1 * MiB, 64 * MiB
    item = {"data": source_array(size)}
    shm = ShmBuffer(ring)
    base = Samples()
    try:
        for mode in ("copy", "lease"):
            progress(f"churn: {p.churn_puts:,} puts of 1 MiB, reader {mode} ({p.churn_runs} runs)")
            rates, lat, waits = Samples(), Samples(), 0
            for _ in range(p.churn_runs):
                run = base.new_run()  # the limit: np.copyto into rotating places of 64 MiB
                for i in range(400):
                    timed(run, np.copyto, shm.rotating(size, i), item["data"])
                cfg = bench_config(ring, 2 * MiB, 1, wait_for_space=5.0)
                with ShmObjectStore.create(cfg) as store:
                    worker.attach(store.handle())
                    try:
                        worker.send("ack_stream", mode)
                        run, t_start = lat.new_run(), _clock()
                        for i in range(p.churn_puts):  # each reference on its own, no batching
                            worker.send_refs([timed(run, store.put, f"c{i}", item)])
                        worker.send_refs(None)
                        worker.reply()  # every item read and acknowledged
                        rates.add_run([p.churn_puts / ((_clock() - t_start) * 1e-9)])
                        waits += store.wakeups
                    finally:
                        worker.detach()
            rs, ls, bs = rates.stat(), lat.stat(), base.stat()
            who = "reader copies each item" if mode == "copy" else "reader leases (no copy)"
            report.row(
                S_CHURN,
                f"puts/s ({who})",
                "1 MiB",
                rs,
                kind="rate",
                target=Target("value", ">=", 10_000) if mode == "copy" else None,
                baseline="1 / rotating np.copyto",
                ratio=rs.median * bs.median,
                note=f"writer waited for room {waits} times",
            )
            report.row(S_CHURN, f"put latency ({who})", "1 MiB", ls, vs=("rotating np.copyto", bs))
        label = "np.copyto into rotating places of a 64 MiB shm buffer (baseline)"
        report.row(S_CHURN, label, "1 MiB", base.stat())
    finally:
        shm.close()


# --- readers scaling ------------------------------------------------------------------------------


def bench_readers(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    progress(f"readers: get with {p.readers} attached readers ({p.runs} runs)")
    sizes = (1024, 1 * MiB)
    gets: dict[tuple[int, int], Samples] = {(k, s): Samples() for k in p.readers for s in sizes}
    handouts = {k: Samples() for k in p.readers}
    with _store_and_reader(bench_config(8 * MiB, 2 * MiB, max(p.readers))) as (store, reader):
        for s in sizes:
            reader.ack(store.put(f"r{s}", {"data": source_array(s)}))
        for _ in range(p.runs):
            for k in p.readers:
                if k > 1:
                    worker.attach(store.handle(), k - 1)  # idle readers in another process
                try:
                    h = handouts[k].new_run()
                    for s in sizes:  # the hand-out and the read, timed apart
                        run = gets[(k, s)].new_run()
                        for _ in range(p.n_ops(s)):
                            timed(run, reader.get, timed(h, _handout, store, f"r{s}"))
                finally:
                    if k > 1:
                        worker.detach()
    kmax = max(p.readers)
    for s in sizes:
        one, what = gets[(1, s)].stat(), fmt_bytes(s)
        for k in p.readers:
            st = gets[(k, s)].stat()
            kw: dict[str, Any] = {"plot": "readers", "series": f"get {what}", "x": k}
            kw["vs"] = ("1 reader", one)
            report.row(S_READERS, f"get (copy) of {what}", f"{k} readers", st, **kw)
        worst = gets[(kmax, s)].stat().median / one.median
        label, tgt = f"get {what}: {kmax} readers ÷ 1 reader", Target("value", "<=", 1.10)
        report.row(S_READERS, label, f"{kmax} vs 1", worst, kind="ratio", target=tgt)
    h1 = handouts[1].stat()
    for k in p.readers:
        kw = {"plot": "readers", "series": "writer hand-out", "x": k, "vs": ("1 reader", h1)}
        report.row(
            S_READERS, "writer hand-out (get_cached)", f"{k} readers", handouts[k].stat(), **kw
        )


# --- cost vs cache size -------------------------------------------------------------------------


def bench_cache_size(p: Params, report: Report, progress: Progress) -> None:
    small, big = {"data": source_array(1024)}, {"data": source_array(1 * MiB)}
    for cache in p.cache_sizes:
        if not _room_for(report, cache, f"cache size {fmt_bytes(cache)}"):
            continue
        progress(f"cache size {fmt_bytes(cache)}: create, attach, put, get")
        s = {k: Samples() for k in ("create", "attach", "put 1 KiB", "get 1 KiB", "get 1 MiB")}
        for _ in range(1 if cache >= 4 * GiB else min(p.runs, 3)):
            cfg = bench_config(cache, 2 * MiB, 1)
            with timed(s["create"].new_run(), ShmObjectStore.create, cfg) as store:
                attach = ShmObjectStore.from_handle
                with timed(s["attach"].new_run(), attach, store.handle()) as reader:
                    run = s["put 1 KiB"].new_run()
                    for i in range(p.n_ops(1024)):
                        reader.ack(timed(run, store.put, f"p{i}", small))
                    for label, value in (("get 1 KiB", small), ("get 1 MiB", big)):
                        reader.ack(store.put(label, value))
                        run = s[label].new_run()
                        for _ in range(p.n_ops(len(value["data"]))):
                            timed(run, reader.get, _handout(store, label))
        for key, label in (
            ("create", "create (fallocate + prefault)"),
            ("attach", "reader attach (maps and populates the segment)"),
            *((k, k) for k in ("put 1 KiB", "get 1 KiB", "get 1 MiB")),
        ):
            kw: dict[str, Any] = {"plot": "cache_size", "series": label.split(" (")[0], "x": cache}
            report.row(S_CACHE, label, fmt_bytes(cache), s[key].stat(), **kw)


# --- a full garbage collection in a writer holding many live items ------------------------------


def bench_gc_live_entries(p: Params, report: Report, progress: Progress) -> None:
    """``gc.collect()`` in a writer holding ``p.gc_entries`` live small items.

    The items go through ``SenderCache.get_and_update_item`` (a put, then a hit of each), and an
    in-process reader acknowledges every hand-out: the state a busy gateway holds. The baseline
    is the same collection before the items exist (the interpreter and the libraries alone).
    """
    n, size = p.gc_entries, 512
    cap = n * (size + 1024) + 64 * MiB
    if not _room_for(report, cap, "gc"):
        return
    progress(f"gc: full collection with {n:,} live {fmt_bytes(size)} items ({p.runs} runs)")
    item = {"data": source_array(size)}
    base, full = Samples(), Samples()
    sender = SenderCache(bench_config(cap, 64 * KiB, 1))
    with sender, ShmObjectStore.from_handle(sender.handle()) as reader:
        for _ in range(p.runs):
            each(3, gc.collect)(base.new_run())
        for i in range(n):
            reader.ack(sender.get_and_update_item((item, ()), f"g{i}")[0])
            reader.ack(sender.get_and_update_item(None, f"g{i}")[0])
        sender.is_freeable("g0")  # drains the last acknowledgements
        tracked = len(gc.get_objects())
        for _ in range(p.runs):
            each(3, gc.collect)(full.new_run())
        live = sender.snapshot().items
    param = f"{n:,} items"
    report.row(S_GC, "gc.collect(), no items yet (baseline)", param, base.stat())
    report.row(
        S_GC,
        f"gc.collect() with {n:,} live entries",
        param,
        full.stat(),
        note=f"{live:,} items cached, {tracked:,} objects tracked by gc",
        target=Target("value", "<=", 30e-3) if n >= GC_TARGET_ENTRIES else None,
    )


#: the suite in order; a workload taking the worker gets a fresh one after a failure
_SUITE: list[tuple[str, Callable[..., None], bool]] = [
    ("store ops", bench_store_ops, False),
    ("gc live entries", bench_gc_live_entries, False),
    ("fresh vs warm", bench_fresh_vs_warm, False),
    ("small steady state", bench_small_steady, True),
    ("sender steady state", bench_sender_steady, True),
    ("churn", bench_churn, True),
    ("readers", bench_readers, True),
    ("cache size", bench_cache_size, False),
]


def run_store_suite(p: Params, report: Report, progress: Progress) -> None:
    with LazyWorker() as lw:
        for name, fn, needs_worker in _SUITE:

            def one(fn: Callable[..., None] = fn, needs: bool = needs_worker) -> None:
                fn(p, report, progress, *([lw.get()] if needs else []))

            if not report.attempt(name, one) and needs_worker:
                lw.reset()
