"""Trace-driven miss ratios: seeded Zipf traces through the real cache, against an LRU model.

What a cache policy is worth is how many preprocessings it saves on a realistic load, so this
suite replays request traces and counts misses:

* **Traces.** A catalogue of ``trace_items`` images whose sizes are drawn log-uniformly between
  ``trace_sizes`` (0.5-8 MiB in the full run: preprocessed images, from one small tile to a
  many-tile high-resolution one); size and popularity are independent. A trace is
  ``trace_requests`` requests whose image is drawn by a Zipf law of skew ``s`` (rank ``i`` asked
  with probability ∝ 1 / (i+1)^s), for s = 0.8, 1.0, 1.2. Everything is seeded: seed *k* gives
  the same sizes and traces on every machine and every run. The capacity is 5 % and 10 % of
  the *distinct bytes* of the trace (the sizes of the images it actually asks for).
* **Scale.** Sizes, and so the capacity, are divided by ``trace_scale`` (4 in the full run:
  128 KiB-2 MiB; 64 in ``--quick``). A miss ratio depends only on sizes relative to the capacity,
  and the ring's fixed per-item overhead stays under 0.3 % at 128 KiB; at full size one trace
  copies ~30 GiB, and both policies took ~12 minutes here under load.
* **Real cache, both policies.** Each trace is replayed through a ``SenderCache`` (FIFO:
  ``second_chance=False``; second chance: the default) with the gateway's hash-first pattern,
  public API only: ``is_cached_item(h)``; then ``get_and_update_features([FeatureSpec(h,
  None)])`` (a hit) or, for a miss, the same with the item ``{"pixel_values": uint8 array of the
  image's size}`` (a real put: the cache copies that many bytes into its ring). A
  ``ReceiverCache`` in the same process reads every hand-out at once (``lease``: verified views,
  acknowledged at the end of the block), so nothing stays owed and eviction is never held up by
  a reader: the counts measure the policy alone. Misses come from the cache's own
  ``snapshot()``; bytes written are the put chunks' lengths plus, for second chance, the
  snapshot's ``bytes_relocated``.
* **Models (reference only).** A pure-Python LRU of the same capacity in bytes (an
  ``OrderedDict``; a miss evicts least-recently-used items until the new one fits) and the same
  for FIFO. The models count item bytes only; the real ring also spends a 64-byte chunk header,
  the structure header, 64-byte alignment and the tail it skips when it wraps, so it holds a
  little less than its model in the same capacity — the comparison with LRU is conservative for
  the real cache. The FIFO model against the real FIFO shows how much that overhead costs.

Every (trace, capacity) is run with ``trace_seeds`` seeds; a figure is the median over seeds
(the range shows how much the trace's luck moves it). The targets: second chance
misses no more than the LRU model on every trace, and at most 0.92x FIFO's misses at s = 1.0
and 5 % capacity.

``second_chance`` is passed to ``CacheConfig`` only when it has that field: on a build without
it, the real cache runs FIFO only, and the second-chance rows are reported as skipped.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aioshmcache import CacheConfig, FeatureSpec, ReceiverCache, SenderCache, ShmRef

from ..progress import Progress
from ..units import KiB, fmt_bytes
from .params import Params, bench_config
from .report import Report, Target
from .timing import Samples

__all__ = [
    "FIFO",
    "LRU",
    "SECOND_CHANCE",
    "PolicyResult",
    "has_second_chance",
    "item_sizes",
    "replay",
    "run_trace_suite",
    "simulate_fifo",
    "simulate_lru",
    "zipf_trace",
]

S_TRACE = "Trace: miss ratio on seeded Zipf traces, real cache vs LRU model"

SKEWS = (0.8, 1.0, 1.2)
CAPACITY_FRACTIONS = (0.05, 0.10)

FIFO = "FIFO"
SECOND_CHANCE = "second chance"
LRU = "LRU model"
FIFO_MODEL = "FIFO model"

#: the trace the FIFO target names: (skew, capacity fraction) -> second chance ÷ FIFO ≤ 0.92
FIFO_TARGET = ((1.0, 0.05), 0.92)

Indices = npt.NDArray[np.int64]


def has_second_chance() -> bool:
    """Whether this build's ``CacheConfig`` has a ``second_chance`` field."""
    return any(f.name == "second_chance" for f in dataclasses.fields(CacheConfig))


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
    seconds: float = 0.0

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    @property
    def bytes_per_request(self) -> float:
        return self.bytes_written / self.requests if self.requests else 0.0


def _simulate(
    trace: Sequence[int], sizes: Sequence[int], capacity: int, *, lru: bool
) -> PolicyResult:
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


def simulate_lru(trace: Sequence[int], sizes: Sequence[int], capacity: int) -> PolicyResult:
    """An LRU cache of ``capacity`` bytes: a miss evicts least-recently-used items until it fits."""
    return _simulate(trace, sizes, capacity, lru=True)


def simulate_fifo(trace: Sequence[int], sizes: Sequence[int], capacity: int) -> PolicyResult:
    """The same with insertion order (a hit changes nothing): FIFO of ``capacity`` bytes."""
    return _simulate(trace, sizes, capacity, lru=False)


def _key(i: int) -> str:
    return f"img-{i:06d}"


def replay(
    trace: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    second_chance: bool | None,
) -> PolicyResult:
    """Replay ``trace`` through a real ``SenderCache`` of ``capacity`` bytes and a reader.

    ``second_chance=None`` passes nothing (the build's default eviction); True/False set
    ``CacheConfig(second_chance=...)``, which needs a build that has it.
    """
    kw: dict[str, object] = {}
    if second_chance is not None:
        if not has_second_chance():
            raise RuntimeError("this build's CacheConfig has no second_chance")
        kw["second_chance"] = second_chance
    biggest = int(max(sizes))
    config = bench_config(capacity, biggest + 64 * KiB, 1, **kw)
    # one source buffer: an item is a view of its first `size` bytes; the put copies them
    source = np.random.default_rng(1).integers(0, 255, size=biggest, dtype=np.uint8)
    written = 0
    t0 = time.perf_counter()
    with SenderCache(config) as sender, ReceiverCache.attach(sender.handle()) as reader:
        is_cached, update = sender.is_cached_item, sender.get_and_update_features
        lease = reader.lease
        for i in trace:
            h = _key(i)
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
    seconds = time.perf_counter() - t0
    if snap.hits + snap.misses != len(trace):
        counted = snap.hits + snap.misses
        raise RuntimeError(f"the cache counted {counted} requests, not {len(trace)}")
    relocated = int(getattr(snap, "bytes_relocated", 0))
    return PolicyResult(
        len(trace),
        snap.misses,
        written + relocated,
        relocations=int(getattr(snap, "relocations", 0)),
        bytes_relocated=relocated,
        evictions=snap.evictions,
        inline=snap.inline_too_large + snap.inline_full + snap.inline_busy,
        seconds=seconds,
    )


def _policies() -> list[tuple[str, bool | None]]:
    """The real-cache policies this build can run (name, ``second_chance=`` to pass)."""
    if has_second_chance():
        return [(FIFO, False), (SECOND_CHANCE, True)]
    return [(FIFO, None)]  # today's only eviction is FIFO


def _param(s: float, fraction: float) -> str:
    return f"s={s:.1f}, {fraction:.0%} capacity"


def run_trace_suite(p: Params, report: Report, progress: Progress) -> None:
    """The trace suite (``--suite trace``)."""
    report.attempt("trace: Zipf miss ratios", lambda: bench_traces(p, report, progress))


def bench_traces(p: Params, report: Report, progress: Progress) -> None:
    policies = _policies()
    if not has_second_chance():
        report.skip(
            "trace: second chance — this build's CacheConfig has no second_chance (FIFO only)"
        )
    lo, hi = (x // p.trace_scale for x in p.trace_sizes)
    # results[(s, fraction)][policy] = one PolicyResult per seed
    results: dict[tuple[float, float], dict[str, list[PolicyResult]]] = {}
    distinct: dict[tuple[float, float], list[int]] = {}
    capacities: dict[tuple[float, float], list[int]] = {}
    for seed in range(p.trace_seeds):
        sizes_arr = item_sizes(p.trace_items, lo, hi, seed=seed)
        sizes = [int(x) for x in sizes_arr]
        for s in SKEWS:
            trace = [int(x) for x in zipf_trace(p.trace_requests, p.trace_items, s, seed=seed)]
            seen = set(trace)
            distinct_bytes = sum(sizes[i] for i in seen)
            for fraction in CAPACITY_FRACTIONS:
                cell = (s, fraction)
                capacity = max(int(distinct_bytes * fraction), hi + 64 * KiB + 4096)
                distinct.setdefault(cell, []).append(len(seen))
                capacities.setdefault(cell, []).append(capacity)
                got = results.setdefault(cell, {})
                got.setdefault(LRU, []).append(simulate_lru(trace, sizes, capacity))
                got.setdefault(FIFO_MODEL, []).append(simulate_fifo(trace, sizes, capacity))
                for name, sc in policies:
                    progress(
                        f"trace: seed {seed + 1}/{p.trace_seeds}, {_param(s, fraction)} "
                        f"({fmt_bytes(capacity)}), {name}, {len(trace):,} requests"
                    )
                    done = replay(trace, sizes, capacity, second_chance=sc)
                    got.setdefault(name, []).append(done)
    _report(p, report, results, distinct, capacities, [n for n, _ in policies])


def _per_seed(values: Sequence[float]) -> Samples:
    samples = Samples()
    for v in values:
        samples.add_run([v])
    return samples


def _report(
    p: Params,
    report: Report,
    results: dict[tuple[float, float], dict[str, list[PolicyResult]]],
    distinct: dict[tuple[float, float], list[int]],
    capacities: dict[tuple[float, float], list[int]],
    real: list[str],
) -> None:
    lo, hi = p.trace_sizes
    scale = p.trace_scale
    runs = f"{p.trace_seeds} seed{'s' if p.trace_seeds > 1 else ''}"
    scaled = (
        f" scaled 1/{scale} with the capacity ({fmt_bytes(lo // scale)}-{fmt_bytes(hi // scale)})"
        if scale != 1
        else ""
    )
    report.notes.append(
        f"trace: {p.trace_items:,} images of {fmt_bytes(lo)}-{fmt_bytes(hi)} (log-uniform),"
        f"{scaled}; {p.trace_requests:,} Zipf requests per trace, {runs}; FIFO and second chance "
        "through the real cache (a reader leasing every hand-out at once), LRU and FIFO models "
        "in Python over item bytes only"
    )
    summary = [
        "| trace | distinct images | capacity | FIFO | second chance | LRU model | "
        "second chance vs FIFO | bytes written / request: FIFO | second chance | LRU model |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (s, fraction), got in results.items():
        param = _param(s, fraction)
        cap = statistics.median(capacities[(s, fraction)])
        med: dict[str, float] = {}
        bpr: dict[str, float] = {}
        for name in (*real, LRU, FIFO_MODEL):
            runs_ = got[name]
            miss = _per_seed([r.miss_ratio for r in runs_]).stat()
            per_req = _per_seed([r.bytes_per_request for r in runs_]).stat()
            med[name], bpr[name] = miss.median, per_req.median
            reference = name in (LRU, FIFO_MODEL)
            note = ""
            if name == SECOND_CHANCE:
                reloc = statistics.median(r.relocations / r.requests for r in runs_)
                note = f"{reloc:.3f} relocations per request"
            if not reference and any(r.inline for r in runs_):
                note += f"{'; ' if note else ''}{max(r.inline for r in runs_)} served inline"
            policy = name + (" (reference)" if reference else "")
            report.row(
                S_TRACE,
                f"miss ratio: {policy}",
                param,
                miss,
                kind="fraction",
                note=note,
                plot="trace" if name != FIFO_MODEL else None,
                series=name,
                x=s,
            )
            report.row(
                S_TRACE,
                f"bytes written per request: {policy}",
                param,
                per_req,
                kind="bytes",
                series=name,
            )
        fifo_vs_lru = _per_seed(
            [_ratio(f.misses, m.misses) for f, m in zip(got[FIFO], got[LRU])]
        ).stat()
        report.row(S_TRACE, "misses: FIFO ÷ LRU model", param, fifo_vs_lru, kind="ratio")
        sc_vs_fifo = math.nan
        if SECOND_CHANCE in got:
            pairs = list(zip(got[SECOND_CHANCE], got[FIFO], got[LRU]))
            vs_fifo = _per_seed([_ratio(a.misses, f.misses) for a, f, _ in pairs]).stat()
            vs_lru = _per_seed([_ratio(a.misses, m.misses) for a, _, m in pairs]).stat()
            sc_vs_fifo = vs_fifo.median
            on_target = (s, fraction) == FIFO_TARGET[0]
            report.row(
                S_TRACE,
                "misses: second chance ÷ FIFO",
                param,
                vs_fifo,
                kind="ratio",
                target=Target("value", "<=", FIFO_TARGET[1]) if on_target else None,
                note=f"{1 - vs_fifo.median:.1%} fewer misses than FIFO",
            )
            report.row(
                S_TRACE,
                "misses: second chance ÷ LRU model",
                param,
                vs_lru,
                kind="ratio",
                target=Target("value", "<=", 1.0),
            )
        dist = statistics.median(distinct[(s, fraction)])

        pct = {n: f"{v:.1%}" for n, v in med.items()}
        per = {n: fmt_bytes(int(v)) for n, v in bpr.items()}
        rel = "—" if math.isnan(sc_vs_fifo) else f"{1 - sc_vs_fifo:.1%} fewer misses"
        summary.append(
            f"| {param} | {dist:,.0f} | {fmt_bytes(int(cap))} | {pct[FIFO]} | "
            f"{pct.get(SECOND_CHANCE, '—')} | {pct[LRU]} | {rel} | {per[FIFO]} | "
            f"{per.get(SECOND_CHANCE, '—')} | {per[LRU]} |"
        )
    report.blocks.append((f"{S_TRACE} (medians over {runs})", summary))


def _ratio(a: int, b: int) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b
