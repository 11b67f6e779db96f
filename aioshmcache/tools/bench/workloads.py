"""The store suite: put / get / lease against the memcpy limit, steady state, churn, gc.

Every baseline runs in the same run as its subject, interleaved (:func:`.timing.interleave`).
Items are single-array mappings ``{"data": uint8 array}``; the writer is this process, readers
are an in-process reader store (per-operation timing) or the spawned worker (cross-process
steady state and churn).
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from aioshmcache import SenderCache, ShmObjectStore, ShmRef
from aioshmcache.store import StoreReader, StoreWriter

from ..progress import Progress
from ..units import GiB, KiB, MiB, fmt_bytes
from . import timing as tm
from .params import Params, bench_config
from .procs import Worker
from .report import Report, Target

__all__ = ["run_store_suite"]

S_STORE = "Store: one array item, in-process reader (vs np.copyto into warm shm)"
S_SMALL = "Small items steady state: 1 KiB, ring churning, reader in another process"
S_SENDER = "SenderCache steady state: 1 KiB misses (puts), ring churning, reader process acking"
S_CHURN = "Churn: 64 MiB ring, 1 MiB items, a reader process acknowledging each"
S_GC = "Writer state vs the garbage collector: many live small items"
GC_TARGET_ENTRIES = 250_000  # the figure the target names
BATCH = 256  # references sent to the reader process at a time
_keys = itertools.count()


def _room_for(report: Report, nbytes: int, what: str) -> bool:
    """Whether a segment of ``nbytes`` leaves the machine (and others) some room; else a skip."""
    with open("/proc/meminfo", encoding="ascii") as f:
        avail = next((int(ln.split()[1]) * KiB for ln in f if ln.startswith("MemAvailable:")), 0)
    st = os.statvfs("/dev/shm")
    shm = st.f_bavail * st.f_frsize
    if avail > nbytes + 3 * GiB and shm > nbytes + 1 * GiB:
        return True
    free = f"{fmt_bytes(avail)} available, {fmt_bytes(shm)} in /dev/shm"
    report.skip(f"{what}: not enough free memory for {fmt_bytes(nbytes)} ({free})")
    return False


def _handout(store: StoreWriter, key: str) -> ShmRef:
    """The writer's part of a read: a new hand-out of ``key``."""
    ref = store.get_cached(key)
    if ref is None:
        raise RuntimeError(f"{key!r} is not cached any more")
    return ref


def _lease_once(reader: StoreReader, ref: ShmRef) -> None:
    """A zero-copy read: the view, then the acknowledgement."""
    v = reader.get(ref, copy=False)
    reader.ack(ref)
    del v


#: the store subjects: (label, cell, plot series, the sizes whose target applies, target)
_AT_08 = Target(">=", 0.8, "ratio")
_ROTATING = "np.copyto into rotating places of a ring-sized shm buffer"
_STORE_ROWS: list[tuple[str, str, str, tuple[int, ...] | None, Target | None]] = [
    (_ROTATING, "rotating", "np.copyto, rotating", (), None),
    ("put", "put", "put", (16 * MiB,), _AT_08),
    ("get (copy)", "get", "get (copy)", (MiB, 16 * MiB), _AT_08),
    ("get (lease: view + ack)", "lease", "get (lease)", None, Target("<=", 20e-6)),
    ("np.array(shm view): copy into a fresh array", "copyout", "np.array(shm view)", (), None),
]


def bench_store_ops(p: Params, report: Report, progress: Progress) -> None:
    with tm.ShmBuffer(max(max(64 * MiB, 6 * (s + 4096)) for s in p.sizes)) as shm:
        for size in p.sizes:
            progress(f"store: put / get / lease of {fmt_bytes(size)} ({p.runs} runs)")
            st = _store_ops(p, shm, size)
            add = report.section(S_STORE, fmt_bytes(size), plot="store", x=size)
            add("np.copyto into warm shm (baseline)", st["base"], series="np.copyto (baseline)")
            for label, cell, series, sizes, target in _STORE_ROWS:
                note = f"{st['rotating'].median / st[cell].median:.2f}x the rotating copy"
                note, vs = note if cell == "put" else "", ("np.copyto", st["base"])
                target = target if sizes is None or size in sizes else None
                add(label, st[cell], vs=vs, note=note, target=target, series=series)


def _store_ops(p: Params, shm: tm.ShmBuffer, size: int) -> dict[str, tm.Stat]:
    n, src = p.n_ops(size), tm.source_array(size)
    item, ring = {"data": src}, max(64 * MiB, 6 * (size + 4096))  # a ring beyond the CPU caches
    store = ShmObjectStore.create(bench_config(ring, size + 64 * KiB))
    with store, ShmObjectStore.from_handle(store.handle()) as reader:
        last = ""

        def put(out: list[float]) -> None:
            nonlocal last
            for _ in range(n):
                last = f"k{next(_keys)}"
                reader.ack(tm.timed(out, store.put, last, item))

        for _ in range(max(3, n // 10)):  # warm-up: the ring wraps at least once for big items
            put([])
        cells: dict[str, tm.Cell] = {
            "base": tm.copy_into(shm, src, n),
            # what a put's copy meets: a new place in the ring each time
            "rotating": tm.copy_into(shm, src, n, rotating=True, span=ring),
            "put": put,
            # a new hand-out (untimed: the writer's part), then the read
            "get": tm.each(n, reader.get, lambda i: (_handout(store, last),)),
            "lease": tm.each(n, _lease_once, lambda i: (reader, _handout(store, last))),
            "copyout": tm.each(n, np.array, lambda i: (shm.view(size),)),  # into a fresh array
        }
        return tm.interleave(p.runs, cells)


def _gc_note(evictions: int) -> str:
    return f"{evictions:,} evictions, gc {'on' if gc.isenabled() else 'OFF'}"


def bench_small_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    """1 KiB puts in batches of 256 into a 2 MiB ring (~1,700 items: it churns continuously),
    the reader process timing each get (copy, then lease) with one batch in flight."""
    progress(f"small items: 1 KiB steady state, reader process ({p.runs} runs)")
    item = {"data": tm.source_array(1024)}
    put, got = tm.Samples(), {"copy": tm.Samples(), "lease": tm.Samples()}
    with ShmObjectStore.create(bench_config(2 * MiB, 64 * KiB)) as store:
        for mode, samples in got.items():
            with worker.attached(store.handle(), reads=mode, reply=True) as conn:
                for r in range(p.runs + 1):  # run 0 warms up
                    putrun: list[float] = []
                    getrun: list[float] = []
                    for b in range(p.small_batches if r else 4):
                        keys = [f"s{next(_keys)}" for _ in range(BATCH)]
                        conn.send([tm.timed(putrun, store.put, k, item) for k in keys])
                        if b:  # keep one batch in flight while putting the next
                            getrun += _times(conn.recv())
                    getrun += _times(conn.recv())
                    if r:
                        samples.add_run(getrun)
                    if r and mode == "copy":
                        put.add_run(putrun)
        evictions = store.evictions
    add = report.section(S_SMALL, "1 KiB", plot="small")
    for label, st, series, limit in (
        ("put (writer process)", put, "put", 10e-6),
        ("get (copy, reader process)", got["copy"], "get (copy)", 8e-6),
        ("get (lease: view + ack, reader process)", got["lease"], "get (lease)", 8e-6),
    ):
        note = _gc_note(evictions) if series == "put" else ""
        add(label, st.stat(), target=Target("<=", limit), series=series, note=note)


def _times(reply: Any) -> list[float]:
    if isinstance(reply, tuple):  # ("error", msg): the worker's loop failed
        raise RuntimeError(f"bench worker: {reply}")
    return [ns * 1e-9 for ns in reply]


def bench_sender_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    """1 KiB items through ``SenderCache.get_and_update_item``: every call a miss (a put) into a
    2 MiB ring that evicts all the time, a reader process acknowledging each reference; and a
    hit of a cached item.

    The put latency's maximum is over every put of every run (no eviction bursts), measured
    twice: as is, where the worst puts are the ones a full garbage collection of this whole
    process lands in (the process's heap, not the cache's: the writer keeps no object per
    item), and after ``gc.freeze()`` (what a server does once its start-up objects exist)."""
    progress(f"SenderCache: {p.runs} x {p.sender_puts:,} steady-state 1 KiB puts, reader acking")
    item = ({"data": tm.source_array(1024)}, ())
    put, hit = tm.Samples(), tm.Samples()
    worst, fulls = {"as is": 0.0, "frozen": 0.0}, {"as is": 0, "frozen": 0}
    with SenderCache(bench_config(2 * MiB, 64 * KiB)) as cache:
        with worker.attached(cache.handle(), reads="copy") as conn:
            for mode in ("as is", "frozen"):
                if mode == "frozen":
                    gc.freeze()
                fulls[mode] = -gc.get_stats()[2]["collections"]  # full collections from here
                try:
                    for r in range(p.runs + 1):  # run 0 warms up
                        run: list[float] = []
                        for i in range(0, p.sender_puts, BATCH):
                            keys = [f"m{next(_keys)}" for _ in range(min(BATCH, p.sender_puts - i))]
                            miss = cache.get_and_update_item
                            conn.send([tm.timed(run, miss, item, k)[0] for k in keys])
                        if r:
                            worst[mode] = max(worst[mode], max(run))
                        if r and mode == "as is":
                            put.add_run(run)
                            tm.each(1000, partial(_hit_release, cache, keys[-1]))(hit.new_run())
                finally:
                    fulls[mode] += gc.get_stats()[2]["collections"]
                    gc.unfreeze()
        evictions = cache.snapshot().evictions
    ps, n, add = put.stat(), p.runs * p.sender_puts, report.section(S_SENDER, "1 KiB")
    tgt = Target("<=", 10e-6)
    add("get_and_update_item, miss (put)", ps, note=_gc_note(evictions), target=tgt)
    label = f"put latency, max over {n:,} puts, after gc.freeze()"
    note = f"{fulls['frozen']} full collections of the unfrozen rest"
    add(label, worst["frozen"], target=Target("<=", 5e-3), note=note)
    note = f"p99 {ps.p99 * 1e6:.1f} us; {fulls['as is']} full collections of this process "
    note += f"({len(gc.get_objects()):,} tracked objects)"
    add(f"put latency, max over {n:,} puts, as is", worst["as is"], note=note)
    add("get_and_update_item, hit (then release)", hit.stat())


def _hit_release(cache: SenderCache, key: str) -> None:
    cache.release(cache.get_and_update_item(None, key)[0])


def bench_churn(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    size, ring = 1 * MiB, 64 * MiB
    item, base = {"data": tm.source_array(size)}, tm.Samples()
    add = report.section(S_CHURN, "1 MiB")
    with tm.ShmBuffer(ring) as shm:
        for mode in ("copy", "lease"):
            progress(f"churn: {p.churn_puts:,} puts of 1 MiB, reader {mode} ({p.churn_runs} runs)")
            rates, lat, waits = tm.Samples(), tm.Samples(), 0
            for _ in range(p.churn_runs):
                # the limit: np.copyto into rotating places of 64 MiB
                tm.copy_into(shm, item["data"], 400, rotating=True)(base.new_run())
                cfg = bench_config(ring, 2 * MiB, wait_for_space=5.0)
                with ShmObjectStore.create(cfg) as store:
                    with worker.attached(store.handle(), reads=mode) as conn:
                        run, t0 = lat.new_run(), time.perf_counter()
                        for i in range(p.churn_puts):  # each reference on its own, no batching
                            conn.send([tm.timed(run, store.put, f"c{i}", item)])
                    # every item read and acknowledged
                    rates.add_run([p.churn_puts / (time.perf_counter() - t0)])
                    waits += store.wakeups
            rs, bs = rates.stat(), base.stat()
            who = "reader copies each item" if mode == "copy" else "reader leases (no copy)"
            kw: dict[str, Any] = {"kind": "rate"}
            kw["target"] = Target(">=", 10_000) if mode == "copy" else None
            kw |= {"note": f"writer waited for room {waits} times", "ratio": rs.median * bs.median}
            add(f"puts/s ({who})", rs, baseline="1 / rotating np.copyto", **kw)
            add(f"put latency ({who})", lat.stat(), vs=("rotating np.copyto", bs))
        add("np.copyto into rotating places of a 64 MiB shm buffer (baseline)", base.stat())


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
    item, base, full = {"data": tm.source_array(size)}, tm.Samples(), tm.Samples()
    sender = SenderCache(bench_config(cap, 64 * KiB))
    with sender, ShmObjectStore.from_handle(sender.handle()) as reader:
        for _ in range(p.runs):
            tm.each(3, gc.collect)(base.new_run())
        for i in range(n):
            reader.ack(sender.get_and_update_item((item, ()), f"g{i}")[0])
            reader.ack(sender.get_and_update_item(None, f"g{i}")[0])
        sender.is_freeable("g0")  # drains the last acknowledgements
        tracked = len(gc.get_objects())
        for _ in range(p.runs):
            tm.each(3, gc.collect)(full.new_run())
        live = sender.snapshot().items
    add = report.section(S_GC, f"{n:,} items")
    add("gc.collect(), no items yet (baseline)", base.stat())
    tgt = Target("<=", 30e-3) if n >= GC_TARGET_ENTRIES else None
    note = f"{live:,} items cached, {tracked:,} objects tracked by gc"
    add(f"gc.collect() with {n:,} live entries", full.stat(), note=note, target=tgt)


#: the suite in order; a workload taking the worker gets a fresh one after a failure
_SUITE: list[tuple[str, Callable[..., None], bool]] = [
    ("store ops", bench_store_ops, False),
    ("gc live entries", bench_gc_live_entries, False),
    ("small steady state", bench_small_steady, True),
    ("sender steady state", bench_sender_steady, True),
    ("churn", bench_churn, True),
]


def run_store_suite(p: Params, report: Report, progress: Progress) -> None:
    with Worker() as worker:
        for name, fn, needs_worker in _SUITE:
            run = partial(fn, p, report, progress)
            worker.attempt(report, name, run) if needs_worker else report.attempt(name, run)
