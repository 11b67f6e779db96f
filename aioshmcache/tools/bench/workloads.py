"""The store suite: put / get / lease against the memcpy limit, steady state, churn and scaling.

Each workload measures its baseline in the same run, interleaved with the subject (run 1:
baseline, subject; run 2: baseline, subject; ...), so that a load spike from the other users of
this machine slows both. Items are single-array mappings ``{"data": uint8 array}``; the writer
is this process, readers are an in-process reader store (for per-operation timing) or the
spawned worker (for cross-process steady state, churn and scaling).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aioshmcache import SenderCache, ShmObjectStore, ShmRef, StoreReader, StoreWriter

from ..progress import Progress
from ..units import GiB, MiB, fmt_bytes
from .params import Params, bench_config, open_store
from .procs import LazyWorker, Worker
from .report import Report, Target
from .timing import Samples, ShmBuffer, memcpy_into, source_array, timed

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

_clock = time.perf_counter_ns


def _ring_for(size: int, *, items: int = 6, minimum: int = 64 * MiB) -> int:
    """A ring larger than the CPU caches (as real caches are), holding at least ``items``."""
    return max(minimum, items * (size + 4096))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def _room_for(nbytes: int) -> bool:
    """Whether creating a segment of ``nbytes`` leaves the machine (and others) some room."""
    return _mem_available() > nbytes + 3 * GiB and _shm_free() > nbytes + 1 * GiB


def _handout(store: StoreWriter, key: str) -> ShmRef:
    ref = store.get_cached(key)
    if ref is None:
        raise RuntimeError(f"{key!r} is not cached any more")
    return ref


# --- put / get / lease per size ------------------------------------------------------------


def bench_store_ops(p: Params, report: Report, progress: Progress) -> None:
    shm = ShmBuffer(max(_ring_for(s) for s in p.sizes))
    try:
        for size in p.sizes:
            progress(f"store: put / get / lease of {fmt_bytes(size)} ({p.runs} runs)")
            _store_ops_one(p, report, shm, size)
    finally:
        shm.close()


def _store_ops_one(p: Params, report: Report, shm: ShmBuffer, size: int) -> None:
    n = p.n_ops(size)
    src = source_array(size)
    item = {"data": src}
    dst = shm.view(size)
    base, put, get, lease, copyout = Samples(), Samples(), Samples(), Samples(), Samples()
    rotating = Samples()
    ring = _ring_for(size)
    stride = (size + 4096 + 63) // 64 * 64
    slots = max(1, (ring - 256) // stride)
    cfg = bench_config(ring, size + 64 * 1024, 1)
    with open_store(cfg) as store:
        reader = ShmObjectStore.from_handle(store.handle())
        try:
            seq = 0
            for _ in range(max(3, n // 10)):  # warm-up: the ring wraps at least once for big items
                reader.ack(store.put(f"w{seq}", item))
                seq += 1
            for _ in range(p.runs):
                memcpy_into(dst, src, n, base.new_run())
                run = rotating.new_run()
                for i in range(n):  # what a put's copy meets: a new place in the ring each time
                    timed(run, np.copyto, shm.view(size, (i % slots) * stride + 128), src)
                run = put.new_run()
                for _ in range(n):
                    seq += 1
                    reader.ack(timed(run, store.put, f"k{seq}", item))
                last = f"k{seq}"
                run = get.new_run()
                for _ in range(n):  # a new hand-out (untimed: the writer's part), then the read
                    timed(run, reader.get, _handout(store, last))
                run = lease.new_run()
                for _ in range(n):
                    timed(run, _lease_once, reader, _handout(store, last))
                run = copyout.new_run()
                for _ in range(n):  # copy out of shared memory into a fresh private array
                    timed(run, np.array, dst)
        finally:
            reader.close()
    sz, b, rs = fmt_bytes(size), base.stat(), rotating.stat()
    at_least_08 = Target("ratio", ">=", 0.8)
    report.row(
        S_STORE,
        "np.copyto into warm shm (baseline)",
        sz,
        b,
        plot="store",
        series="np.copyto (baseline)",
        x=size,
    )
    # (label, samples, plot series, target)
    for label, samples, series, target in (
        (
            "np.copyto into rotating places of a ring-sized shm buffer",
            rotating,
            "np.copyto, rotating",
            None,
        ),
        ("put", put, "put", at_least_08 if size == 16 * MiB else None),
        ("get (copy)", get, "get (copy)", at_least_08 if size in (MiB, 16 * MiB) else None),
        ("get (lease: view + ack)", lease, "get (lease)", Target("value", "<=", 20e-6)),
        ("np.array(shm view): copy into a fresh array", copyout, "np.array(shm view)", None),
    ):
        st = samples.stat()
        note = f"{rs.median / st.median:.2f}x the rotating copy" if series == "put" else ""
        report.row(
            S_STORE,
            label,
            sz,
            st,
            vs=("np.copyto", b),
            target=target,
            plot="store",
            series=series,
            x=size,
            note=note,
        )


def _lease_once(reader: StoreReader, ref: ShmRef) -> None:
    """A zero-copy read: the view, then the acknowledgement."""
    v = reader.get(ref, copy=False)
    reader.ack(ref)
    del v


# --- small items steady state -------------------------------------------------------

BATCH = 256


def bench_small_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    progress(f"small items: 1 KiB steady state, reader process ({p.runs} runs)")
    size = 1024
    item = {"data": source_array(size)}
    # a 2 MiB ring holds ~1,700 items: with two batches of 256 in flight it churns continuously
    cfg = bench_config(2 * MiB, 64 * 1024, 1)
    put, get, lease_get = Samples(), Samples(), Samples()
    with open_store(cfg) as store:
        worker.attach(store.handle())
        try:
            seq = 0
            for mode, samples in (("copy", get), ("lease", lease_get)):
                worker.send("timed_gets", mode)
                pending = 0
                warm = 4
                for r in range(p.runs + 1):
                    putrun: list[float] = []
                    getrun: list[float] = []
                    for _ in range(p.small_batches if r else warm):
                        refs: list[ShmRef] = []
                        for _ in range(BATCH):
                            seq += 1
                            refs.append(timed(putrun, store.put, f"s{seq}", item))
                        worker.send_refs(refs)
                        pending += 1
                        if pending >= 2:  # keep one batch in flight while putting the next
                            getrun += [ns * 1e-9 for ns in _recv_list(worker)]
                            pending -= 1
                    while pending:
                        getrun += [ns * 1e-9 for ns in _recv_list(worker)]
                        pending -= 1
                    if r:  # run 0 is the warm-up
                        if mode == "copy":
                            put.add_run(putrun)
                        samples.add_run(getrun)
                worker.send_refs(None)
                worker.reply()
            evictions = store.evictions
        finally:
            worker.detach()
    ps, gs, ls = put.stat(), get.stat(), lease_get.stat()
    note = f"{evictions:,} evictions, gc {'on' if gc.isenabled() else 'OFF'}"
    for label, st, series, limit, extra in (
        ("put (writer process)", ps, "put", 10e-6, note),
        ("get (copy, reader process)", gs, "get (copy)", 8e-6, ""),
        ("get (lease: view + ack, reader process)", ls, "get (lease)", 8e-6, ""),
    ):
        report.row(
            S_SMALL,
            label,
            "1 KiB",
            st,
            target=Target("value", "<=", limit),
            plot="small",
            series=series,
            note=extra,
        )


class _FullCollections:
    """Counts the garbage collector's full (generation 2) collections while installed."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.n += 1

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def bench_sender_steady(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    """1 KiB items through ``SenderCache.get_and_update_item``: every call a miss (a put) into a
    2 MiB ring that evicts all the time, a reader process reading and acknowledging each
    reference in batches of 256; and a hit of a cached item. The put latency's maximum is over
    every put of every run (the issue's "no eviction bursts"), measured twice: as is, where the
    worst puts are the ones a full garbage collection of this whole process lands in (its cost
    is the process's heap, not the cache's: the writer keeps no object per item), and after
    ``gc.freeze()`` (what a server does once its start-up objects exist), which leaves the
    cache's own worst case."""
    progress(f"SenderCache: {p.runs} x {p.sender_puts:,} steady-state 1 KiB puts, reader acking")
    item = ({"data": source_array(1024)}, ())
    put, hit = Samples(), Samples()
    worst = {"as is": 0.0, "frozen": 0.0}
    fulls = {"as is": 0, "frozen": 0}
    with SenderCache(bench_config(2 * MiB, 64 * 1024, 1)) as cache:
        worker.attach(cache.handle())
        try:
            worker.send("ack_stream", "copy")
            seq = 0
            for mode in ("as is", "frozen"):
                if mode == "frozen":
                    gc.freeze()
                try:
                    with _FullCollections() as counted:
                        for r in range(p.runs + 1):  # run 0 warms up
                            run: list[float] = []
                            refs: list[ShmRef] = []
                            for _ in range(p.sender_puts):
                                seq += 1
                                key = f"m{seq}"
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
                                    cache.release(
                                        timed(hot, cache.get_and_update_item, None, key)[0]
                                    )
                    fulls[mode] = counted.n
                finally:
                    gc.unfreeze()
            worker.send_refs(None)
            worker.reply()
            evictions = cache.snapshot().evictions
        finally:
            worker.detach()
    ps, hs = put.stat(), hit.stat()
    note = f"{evictions:,} evictions, gc {'on' if gc.isenabled() else 'OFF'}"
    n = p.runs * p.sender_puts
    report.row(
        S_SENDER,
        "get_and_update_item, miss (put)",
        "1 KiB",
        ps,
        note=note,
        target=Target("value", "<=", 10e-6),
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
    report.row(S_SENDER, "get_and_update_item, hit (then release)", "1 KiB", hs)


def _recv_list(worker: Worker) -> list[int]:
    r = worker.conn.recv()
    if isinstance(r, tuple):  # ("error", msg): the worker's loop failed
        raise RuntimeError(f"bench worker: {r[1] if len(r) > 1 else r}")
    out: list[int] = r
    return out


# --- fresh vs warm put ---------------------------------------------------------------


def bench_fresh_vs_warm(p: Params, report: Report, progress: Progress) -> None:
    cache = p.fresh_cache
    if not _room_for(cache):
        report.skip(f"fresh vs warm put: not enough free memory for a {fmt_bytes(cache)} cache")
        return
    progress(f"fresh {fmt_bytes(cache)} cache: first 16 MiB put vs warm put ({p.fresh_runs} runs)")
    size = 16 * MiB
    item = {"data": source_array(size)}
    create, first, fresh, warm, hot = Samples(), Samples(), Samples(), Samples(), Samples()
    per_ring = cache // (size + 64 * 1024)
    for _ in range(p.fresh_runs):
        store = timed(create.new_run(), ShmObjectStore.create, bench_config(cache, size + 65536, 1))
        try:
            timed(first.new_run(), store.put, "first", item)
            run = fresh.new_run()
            for j in range(1, 8):  # more puts into pages no put has written yet
                timed(run, store.put, f"fresh{j}", item)
            for j in range(per_ring + 2):  # wrap the ring: from here on, pages written before
                store.put(f"wrap{j}", item)
            run = warm.new_run()
            for j in range(5):  # steady state: written once, long out of the CPU caches
                timed(run, store.put, f"warm{j}", item)
            run = hot.new_run()
            for j in range(3):
                store.clear()  # the ring starts again at address 0: the very same pages, hot
                timed(run, store.put, f"hot{j}", item)
        finally:
            store.close()
    cs, fs, rs, ws, hs = create.stat(), first.stat(), fresh.stat(), warm.stat(), hot.stat()
    param = f"{fmt_bytes(cache)} cache, 16 MiB item"
    cache_s, vs_warm = fmt_bytes(cache), ("warm put", ws)
    report.row(S_FRESH, "create the cache (fallocate + prefault)", cache_s, cs)
    report.row(S_FRESH, "first put into the fresh cache", param, fs, vs=vs_warm)
    report.row(
        S_FRESH, "puts 2-8 into the fresh cache (pages not yet written)", param, rs, vs=vs_warm
    )
    report.row(S_FRESH, "warm put (after the ring wrapped: pages written before)", param, ws)
    report.row(S_FRESH, "hot put (the same pages again right after clear)", param, hs, vs=vs_warm)
    first_vs_warm = fs.median / ws.median
    report.row(
        S_FRESH,
        "first put ÷ warm put",
        param,
        first_vs_warm,
        kind="ratio",
        target=Target("value", "<=", 1.5),
    )


# --- churn ------------------------------------------------------------------------------


def bench_churn(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    size = 1 * MiB
    ring = 64 * MiB
    item = {"data": source_array(size)}
    src = item["data"]
    shm = ShmBuffer(ring)
    stride = size + 4096
    slots = ring // stride
    try:
        for mode in ("copy", "lease"):
            progress(f"churn: {p.churn_puts:,} puts of 1 MiB, reader {mode} ({p.churn_runs} runs)")
            rates, lat, base = Samples(), Samples(), Samples()
            waits = 0
            for _ in range(p.churn_runs):
                run = base.new_run()  # the limit: np.copyto into rotating places of 64 MiB
                for i in range(400):
                    timed(run, np.copyto, shm.view(size, (i % slots) * stride + 128), src)
                cfg = bench_config(ring, 2 * MiB, 1, wait_for_space=5.0)
                with open_store(cfg) as store:
                    worker.attach(store.handle())
                    try:
                        worker.send("ack_stream", mode)
                        run = lat.new_run()
                        t_start = _clock()
                        for i in range(p.churn_puts):  # each reference on its own, no batching
                            worker.send_refs([timed(run, store.put, f"c{i}", item)])
                        worker.send_refs(None)
                        worker.reply()  # every item read and acknowledged
                        elapsed = (_clock() - t_start) * 1e-9
                        rates.add_run([p.churn_puts / elapsed])
                        waits += store.wakeups
                    finally:
                        worker.detach()
            rs, ls, bs = rates.stat(), lat.stat(), base.stat()
            who = "reader copies each item" if mode == "copy" else "reader leases (no copy)"
            target = Target("value", ">=", 10_000) if mode == "copy" else None
            report.row(
                S_CHURN,
                f"puts/s ({who})",
                "1 MiB",
                rs,
                kind="rate",
                target=target,
                baseline="1 / rotating np.copyto",
                ratio=rs.median * bs.median,
                note=f"writer waited for room {waits} times",
            )
            report.row(S_CHURN, f"put latency ({who})", "1 MiB", ls, vs=("rotating np.copyto", bs))
        base_label = "np.copyto into rotating places of a 64 MiB shm buffer (baseline)"
        report.row(S_CHURN, base_label, "1 MiB", bs)
    finally:
        shm.close()


# --- readers scaling ----------------------------------------------------------------


def bench_readers(p: Params, report: Report, progress: Progress, worker: Worker) -> None:
    progress(f"readers: get with {p.readers} attached readers ({p.runs} runs)")
    n_slots = max(p.readers)
    sizes = (1024, 1 * MiB)
    items = {s: {"data": source_array(s)} for s in sizes}
    cfg = bench_config(8 * MiB, 2 * MiB, n_slots)
    results: dict[tuple[int, int], Samples] = {}
    handouts: dict[int, Samples] = {}
    with open_store(cfg) as store:
        reader = ShmObjectStore.from_handle(store.handle())
        try:
            for s in sizes:
                reader.ack(store.put(f"r{s}", items[s]))
            for _ in range(p.runs):
                for k in p.readers:
                    if k > 1:
                        worker.attach(store.handle(), k - 1)  # idle readers in another process
                    try:
                        h = handouts.setdefault(k, Samples()).new_run()
                        for s in sizes:
                            run = results.setdefault((k, s), Samples()).new_run()
                            n = p.n_ops(s)
                            for _ in range(n):  # the hand-out and the read, timed apart
                                timed(run, reader.get, timed(h, _handout, store, f"r{s}"))
                    finally:
                        if k > 1:
                            worker.detach()
        finally:
            reader.close()
    kmax = max(p.readers)
    for s in sizes:
        one = results[(1, s)].stat()
        for k in p.readers:
            report.row(
                S_READERS,
                f"get (copy) of {fmt_bytes(s)}",
                f"{k} readers",
                results[(k, s)].stat(),
                vs=("1 reader", one),
                plot="readers",
                series=f"get {fmt_bytes(s)}",
                x=k,
            )
        worst = results[(kmax, s)].stat().median / one.median
        report.row(
            S_READERS,
            f"get {fmt_bytes(s)}: {kmax} readers ÷ 1 reader",
            f"{kmax} vs 1",
            worst,
            kind="ratio",
            target=Target("value", "<=", 1.10),
        )
    h1 = handouts[1].stat()
    for k in p.readers:
        report.row(
            S_READERS,
            "writer hand-out (get_cached)",
            f"{k} readers",
            handouts[k].stat(),
            vs=("1 reader", h1),
            plot="readers",
            series="writer hand-out",
            x=k,
        )


# --- cost vs cache size -----------------------------------------------------------------------


def bench_cache_size(p: Params, report: Report, progress: Progress) -> None:
    small = {"data": source_array(1024)}
    big = {"data": source_array(1 * MiB)}
    for cache in p.cache_sizes:
        if not _room_for(cache):
            report.skip(
                f"cache size {fmt_bytes(cache)}: not enough free memory "
                f"({fmt_bytes(_mem_available())} available, {fmt_bytes(_shm_free())} in /dev/shm)"
            )
            continue
        progress(f"cache size {fmt_bytes(cache)}: create, attach, put, get")
        create, attach = Samples(), Samples()
        ops: dict[str, Samples] = {k: Samples() for k in ("put 1 KiB", "get 1 KiB", "get 1 MiB")}
        runs = 1 if cache >= 4 * GiB else min(p.runs, 3)
        for _ in range(runs):
            store = timed(create.new_run(), ShmObjectStore.create, bench_config(cache, 2 * MiB, 1))
            try:
                reader = timed(attach.new_run(), ShmObjectStore.from_handle, store.handle())
                try:
                    _cache_ops(p, store, reader, small, big, ops)
                finally:
                    reader.close()
            finally:
                store.close()
        for label, samples in (
            ("create (fallocate + prefault)", create),
            ("reader attach (maps and populates the segment)", attach),
            *ops.items(),
        ):
            series = label.split(" (")[0]  # "create", "reader attach", "put 1 KiB", ...
            report.row(
                S_CACHE,
                label,
                fmt_bytes(cache),
                samples.stat(),
                plot="cache_size",
                series=series,
                x=cache,
            )


def _cache_ops(
    p: Params,
    store: StoreWriter,
    reader: StoreReader,
    small: dict[str, Any],
    big: dict[str, Any],
    ops: dict[str, Samples],
) -> None:
    n = p.n_ops(1024)
    run = ops["put 1 KiB"].new_run()
    for i in range(n):
        reader.ack(timed(run, store.put, f"p{i}", small))
    for label, key, value in (("get 1 KiB", "g1", small), ("get 1 MiB", "g2", big)):
        reader.ack(store.put(key, value))
        run = ops[label].new_run()
        for _ in range(p.n_ops(len(value["data"]))):
            timed(run, reader.get, _handout(store, key))


# --- a full garbage collection in a writer holding many live items ---------------------------


def bench_gc_live_entries(p: Params, report: Report, progress: Progress) -> None:
    """``gc.collect()`` in a writer holding ``p.gc_entries`` live small items.

    The items go through ``SenderCache.get_and_update_item`` (a put, then a hit of each), and an
    in-process reader acknowledges every hand-out: the state a busy gateway holds. The baseline
    is the same collection before the items exist (the interpreter and the libraries alone).
    """
    n = p.gc_entries
    size = 512
    progress(f"gc: full collection with {n:,} live {fmt_bytes(size)} items ({p.runs} runs)")
    item = {"data": source_array(size)}
    cap = n * (size + 1024) + 64 * MiB
    if not _room_for(cap):
        report.skip(f"gc: not enough free memory for a {fmt_bytes(cap)} cache")
        return
    base, full = Samples(), Samples()

    def collect(samples: Samples) -> None:
        run = samples.new_run()
        for _ in range(3):
            timed(run, gc.collect)

    sender = SenderCache(bench_config(cap, 64 * 1024, 1))
    try:
        reader = ShmObjectStore.from_handle(sender.handle())
        try:
            for _ in range(p.runs):
                collect(base)
            for i in range(n):
                key = f"g{i}"
                ref, _ = sender.get_and_update_item((item, ()), key)
                reader.ack(ref)
                ref, _ = sender.get_and_update_item(None, key)
                reader.ack(ref)
            sender.is_freeable("g0")  # drains the last acknowledgements
            tracked = len(gc.get_objects())
            for _ in range(p.runs):
                collect(full)
            live = sender.snapshot().items
        finally:
            reader.close()
    finally:
        sender.close()
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


def run_store_suite(p: Params, report: Report, progress: Progress) -> None:
    report.attempt("store ops", lambda: bench_store_ops(p, report, progress))
    report.attempt("gc live entries", lambda: bench_gc_live_entries(p, report, progress))
    report.attempt("fresh vs warm", lambda: bench_fresh_vs_warm(p, report, progress))
    with LazyWorker() as lw:
        for name, fn in (
            ("small steady state", bench_small_steady),
            ("sender steady state", bench_sender_steady),
            ("churn", bench_churn),
            ("readers", bench_readers),
        ):

            def one(fn: Callable[[Params, Report, Progress, Worker], None] = fn) -> None:
                fn(p, report, progress, lw.get())

            if not report.attempt(name, one):
                lw.reset()
    report.attempt("cache size", lambda: bench_cache_size(p, report, progress))
