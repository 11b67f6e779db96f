"""Trace-driven miss ratios: seeded Zipf traces through the real cache, against an LRU model.

What a cache policy is worth is how many preprocessings it saves on a realistic load:

* **Traces.** ``trace_items`` images of sizes drawn log-uniformly in ``trace_sizes`` (divided by
  ``trace_scale``: a miss ratio depends only on sizes relative to the capacity, and at full size
  one trace copies ~30 GiB); ``trace_requests`` requests whose image is drawn by a Zipf law of
  skew s = 0.8, 1.0, 1.2. Everything is seeded. The capacity is 5 % and 10 % of the distinct
  bytes the trace asks for.
* **Real cache, both policies.** Each trace is replayed through a ``SenderCache`` (FIFO:
  ``second_chance=False``; second chance: the default) with the gateway's hash-first pattern,
  public API only; an in-process ``ReceiverCache`` leases every hand-out at once, so eviction is
  never held up by a reader. Misses come from the cache's ``snapshot()``; bytes written are the
  put chunks plus the snapshot's ``bytes_relocated``.
* **Models (reference only).** Pure-Python LRU and FIFO of the same capacity over item bytes
  only: the real ring also spends headers and the tail it skips when it wraps, so the
  comparison with LRU is conservative for the real cache.

A figure is the median over ``trace_seeds`` seeds. Targets: second chance misses no more than
the LRU model on every trace, and at most 0.92x FIFO's misses at s = 1.0 and 5 % capacity.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aioshmcache import FeatureSpec, ReceiverCache, SenderCache, ShmRef

from ..progress import Progress
from ..units import KiB, fmt_bytes
from . import timing as tm
from .params import Params, bench_config
from .report import Report, Target, md_table

S_TRACE = "Trace: miss ratio on seeded Zipf traces, real cache vs LRU model"

SKEWS = (0.8, 1.0, 1.2)
CAPACITY_FRACTIONS = (0.05, 0.10)

FIFO = "FIFO"
SECOND_CHANCE = "second chance"
LRU = "LRU model"
FIFO_MODEL = "FIFO model"

#: the real cache's policies: (name, ``CacheConfig(second_chance=)``)
POLICIES = ((FIFO, False), (SECOND_CHANCE, True))
#: the trace the FIFO target names: (skew, capacity fraction) -> second chance ÷ FIFO ≤ 0.92
FIFO_TARGET = ((1.0, 0.05), 0.92)

Indices = npt.NDArray[np.int64]


def zipf_trace(requests: int, items: int, s: float, *, seed: int) -> Indices:
    """``requests`` item indices in ``[0, items)``; index ``i`` drawn with probability ∝ 1/(i+1)^s.

    Deterministic: the same arguments give the same trace on every machine (numpy's PCG64).
    """
    if requests < 0 or items < 1:
        raise ValueError("need requests >= 0 and items >= 1")
    weights = 1.0 / np.arange(1, items + 1, dtype=np.float64) ** s
    rng = np.random.default_rng([seed, round(s * 1000), items])
    return rng.choice(items, size=requests, p=weights / weights.sum()).astype(np.int64)


def item_sizes(items: int, lo: int, hi: int, *, seed: int) -> Indices:
    """``items`` sizes in bytes, log-uniform in ``[lo, hi]``, multiples of 64 (seeded)."""
    if not 64 <= lo <= hi:
        raise ValueError("need 64 <= lo <= hi")
    rng = np.random.default_rng([seed, items, 0x512E])
    raw = np.exp(rng.uniform(math.log(lo), math.log(hi), size=items))
    return np.clip(np.round(raw / 64) * 64, lo, hi).astype(np.int64)


@dataclass(frozen=True)
class PolicyResult:
    """What one policy did on one trace."""

    requests: int
    misses: int
    bytes_written: int  # puts (and, for second chance, relocations)
    relocations: int = 0
    bytes_relocated: int = 0
    evictions: int = 0
    inline: int = 0  # misses served inline (not cached: too large or no room)

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    @property
    def bytes_per_request(self) -> float:
        return self.bytes_written / self.requests if self.requests else 0.0


def simulate(
    trace: Sequence[int], sizes: Sequence[int], capacity: int, *, lru: bool
) -> PolicyResult:
    """A model cache of ``capacity`` bytes: a miss evicts the oldest items until it fits; a hit
    makes its item the newest with ``lru`` (LRU), and changes nothing without it (FIFO)."""
    cached: OrderedDict[int, int] = OrderedDict()
    used = misses = written = evictions = inline = 0
    for i in trace:
        if i in cached:
            if lru:
                cached.move_to_end(i)
            continue
        misses += 1
        size = sizes[i]
        if size > capacity:  # can never fit: served without caching
            inline += 1
            continue
        while used + size > capacity:
            _, gone = cached.popitem(last=False)
            used -= gone
            evictions += 1
        cached[i] = size
        used += size
        written += size
    return PolicyResult(len(trace), misses, written, evictions=evictions, inline=inline)


def replay(
    trace: Sequence[int], sizes: Sequence[int], capacity: int, *, second_chance: bool
) -> PolicyResult:
    """Replay ``trace`` through a real ``SenderCache`` of ``capacity`` bytes and a reader."""
    biggest = int(max(sizes))
    config = bench_config(capacity, biggest + 64 * KiB, second_chance=second_chance)
    # one source buffer: an item is a view of its first `size` bytes; the put copies them
    source = np.random.default_rng(1).integers(0, 255, size=biggest, dtype=np.uint8)
    written = 0
    with SenderCache(config) as sender, ReceiverCache.attach(sender.handle()) as reader:
        is_cached, update = sender.is_cached, sender.get_and_update_features
        lease = reader.lease
        for i in trace:
            h = f"img-{i:06d}"
            hit = is_cached(h)
            size = sizes[i]
            spec = FeatureSpec(h, None if hit else {"pixel_values": source[:size]})
            [out] = update([spec])
            data = out.data
            if not isinstance(data, ShmRef):
                continue  # served inline: nothing to read, nothing owed
            if not hit:
                written += data.length
            with lease([out]) as [got]:
                item = got.data
                if not isinstance(item, dict) or item["pixel_values"].nbytes != size:
                    raise RuntimeError(f"{h}: the reader got the wrong item back")
        snap = sender.snapshot()
    if snap.hits + snap.misses != len(trace):
        counted = snap.hits + snap.misses
        raise RuntimeError(f"the cache counted {counted} requests, not {len(trace)}")
    inline = snap.inline_too_large + snap.inline_full + snap.inline_busy
    moved, written = (snap.relocations, snap.bytes_relocated), written + snap.bytes_relocated
    return PolicyResult(len(trace), snap.misses, written, *moved, snap.evictions, inline)


def _param(s: float, fraction: float) -> str:
    return f"s={s:.1f}, {fraction:.0%} capacity"


def run_trace_suite(p: Params, report: Report, progress: Progress) -> None:
    """The trace suite (``--suite trace``)."""
    report.attempt("trace: Zipf miss ratios", lambda: bench_traces(p, report, progress))


Cells = dict[tuple[float, float], Any]


def bench_traces(p: Params, report: Report, progress: Progress) -> None:
    lo, hi = (x // p.trace_scale for x in p.trace_sizes)
    # results[(s, fraction)][policy] = one PolicyResult per seed
    results: Cells = defaultdict(lambda: defaultdict(list))
    distinct: Cells = defaultdict(list)
    capacities: Cells = defaultdict(list)
    for seed in range(p.trace_seeds):
        sizes = [int(x) for x in item_sizes(p.trace_items, lo, hi, seed=seed)]
        for s in SKEWS:
            trace = [int(x) for x in zipf_trace(p.trace_requests, p.trace_items, s, seed=seed)]
            seen = set(trace)
            for fraction in CAPACITY_FRACTIONS:
                capacity = max(int(sum(sizes[i] for i in seen) * fraction), hi + 68 * KiB)
                distinct[(s, fraction)].append(len(seen))
                capacities[(s, fraction)].append(capacity)
                got = results[(s, fraction)]
                for name, lru in ((LRU, True), (FIFO_MODEL, False)):
                    got[name].append(simulate(trace, sizes, capacity, lru=lru))
                for name, sc in POLICIES:
                    progress(
                        f"trace: seed {seed + 1}/{p.trace_seeds}, {_param(s, fraction)} "
                        f"({fmt_bytes(capacity)}), {name}, {len(trace):,} requests"
                    )
                    got[name].append(replay(trace, sizes, capacity, second_chance=sc))
    report_results(p, report, results, distinct, capacities, [n for n, _ in POLICIES])


def _median(values: Any) -> tm.Stat:
    """The median (and range) over seeds: one run per seed."""
    return tm.Samples([[v] for v in values]).stat()


def report_results(
    p: Params, report: Report, results: Cells, distinct: Cells, capacities: Cells, real: list[str]
) -> None:
    """Add the suite's notes, rows and targets to ``report`` from the runs' results (the misses
    of each policy per skew and capacity); ``real``: the policies run through the real cache."""
    (lo, hi), scale, seeds = p.trace_sizes, p.trace_scale, p.trace_seeds
    runs = f"{seeds} seed{'s' if seeds > 1 else ''}"
    scaled = (
        f" scaled 1/{scale} with the capacity ({fmt_bytes(lo // scale)}-{fmt_bytes(hi // scale)})"
    )
    report.notes.append(
        f"trace: {p.trace_items:,} images of {fmt_bytes(lo)}-{fmt_bytes(hi)} (log-uniform),"
        f"{scaled if scale != 1 else ''}; {p.trace_requests:,} Zipf requests per trace, {runs}; "
        "FIFO and second chance through the real cache (a reader leasing every hand-out at "
        "once), LRU and FIFO models in Python over item bytes only"
    )
    summary = []
    for (s, fraction), got in results.items():
        add = report.section(S_TRACE, _param(s, fraction))
        miss: dict[str, tm.Stat] = {}
        per_req: dict[str, tm.Stat] = {}
        for name in (*real, LRU, FIFO_MODEL):
            runs_, reference = got[name], name in (LRU, FIFO_MODEL)
            miss[name] = _median(r.miss_ratio for r in runs_)
            per_req[name] = _median(r.bytes_per_request for r in runs_)
            notes = []
            if name == SECOND_CHANCE:
                reloc = statistics.median(r.relocations / r.requests for r in runs_)
                notes.append(f"{reloc:.3f} relocations per request")
            if not reference and any(r.inline for r in runs_):
                notes.append(f"{max(r.inline for r in runs_)} served inline")
            policy = name + (" (reference)" if reference else "")
            kw: dict[str, Any] = {"series": name, "plot": None if name == FIFO_MODEL else "trace"}
            add(f"miss ratio: {policy}", miss[name], kind="fraction", note="; ".join(notes), **kw)
            add(f"bytes written per request: {policy}", per_req[name], kind="bytes", series=name)
        add("misses: FIFO ÷ LRU model", _median(_ratio(got[FIFO], got[LRU])), kind="ratio")
        vs_fifo = _median(_ratio(got[SECOND_CHANCE], got[FIFO]))
        rel = f"{1 - vs_fifo.median:.1%} fewer misses"
        tgt = Target("<=", FIFO_TARGET[1]) if (s, fraction) == FIFO_TARGET[0] else None
        note = f"{rel} than FIFO"
        add("misses: second chance ÷ FIFO", vs_fifo, kind="ratio", target=tgt, note=note)
        vs_lru = _median(_ratio(got[SECOND_CHANCE], got[LRU]))
        add("misses: second chance ÷ LRU model", vs_lru, kind="ratio", target=Target("<=", 1.0))
        columns = (FIFO, SECOND_CHANCE, LRU)
        summary.append(
            (
                _param(s, fraction),
                f"{statistics.median(distinct[(s, fraction)]):,.0f}",
                fmt_bytes(int(statistics.median(capacities[(s, fraction)]))),
                *(f"{miss[n].median:.1%}" for n in columns),
                rel,
                *(fmt_bytes(int(per_req[n].median)) for n in columns),
            )
        )
    head = ["trace", "distinct images", "capacity", FIFO, SECOND_CHANCE, LRU]
    head += ["second chance vs FIFO", "bytes written / request: FIFO", SECOND_CHANCE, LRU]
    report.blocks.append((f"{S_TRACE} (medians over {runs})", md_table(head, summary)))


def _ratio(a: Sequence[PolicyResult], b: Sequence[PolicyResult]) -> list[float]:
    """Misses of ``a`` ÷ misses of ``b``, seed by seed (1 when neither missed)."""
    inf = math.inf
    return [x.misses / y.misses if y.misses else inf if x.misses else 1.0 for x, y in zip(a, b)]
