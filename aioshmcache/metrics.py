"""Prometheus metrics for sender and receiver caches: :class:`CacheCollector` (``metrics`` extra).

A custom collector rather than counters updated on every call: the caches already count
everything (``SenderCache.snapshot()``, ``make_stats()``), so a scrape reads those numbers and
the request path pays nothing. Register one collector per registry; it takes every cache the
process owns (a sender, receivers, the shards of a group), each sample labelled with the cache's
segment name and role (and, for caches of a group, the group and the shard)::

    from prometheus_client import CollectorRegistry, generate_latest
    from aioshmcache.metrics import CacheCollector

    registry = CollectorRegistry()
    registry.register(CacheCollector(sender))
    text = generate_latest(registry)

The metrics (counters end in ``_total``, sizes in ``_bytes``; labels ``cache`` and ``role``):

==========================================  =======  =============================================
``aioshmcache_hits_total``                  counter  sender: items handed out from the cache
                                                     (or a group's sibling item served inline);
                                                     receiver: references resolved from memory
``aioshmcache_misses_total``                counter  sender: items that were not cached when
                                                     asked; receiver: features that came inline
                                                     or without data
``aioshmcache_inline_serves_total``         counter  items served inline, label ``cause``:
                                                     ``too_large``, ``full`` or ``busy``
``aioshmcache_evictions_total``             counter  items evicted to make room
``aioshmcache_relocations_total``           counter  second chance: hit items moved to the tail
                                                     of the ring instead of evicted
``aioshmcache_relocated_bytes_total``       counter  their payload bytes
``aioshmcache_used_bytes``                  gauge    bytes of the ring in use
``aioshmcache_capacity_bytes``              gauge    the ring's capacity
``aioshmcache_items``                       gauge    items cached
``aioshmcache_epoch``                       gauge    clear generation (``clear`` bumps it)
``aioshmcache_handouts_owed``               gauge    hand-outs not yet acknowledged, summed over
                                                     the attached readers
``aioshmcache_reader_slots``                gauge    reader slots of the segment
``aioshmcache_reader_alive``                gauge    per attached slot (labels ``cache``,
                                                     ``role`` and ``slot``): 1 alive
``aioshmcache_reader_lag``                  gauge    per slot: hand-outs the reader owes
``aioshmcache_reader_revoked``              gauge    per slot: 1 if the writer revoked it
``aioshmcache_reader_acknowledged_total``   counter  per slot: acknowledgements since it attached
``aioshmcache_wait_for_space_seconds_total`` counter time requests spent waiting for space
``aioshmcache_open``                        gauge    1 while the cache is open, 0 once closed
``aioshmcache_single_flight_calls_total``   counter  ``AsyncSenderCache.get_or_put`` calls
``aioshmcache_single_flight_runs_total``    counter  preprocessings (``make()``) it ran
``aioshmcache_single_flight_saved_total``   counter  preprocessings single flight saved (calls
                                                     served by another caller's ``make``)
``aioshmcache_sibling_hits_total``          counter  a shard of a cache group: items served from a
                                                     sibling shard instead of preprocessed (also
                                                     counted in ``aioshmcache_hits_total``)
``aioshmcache_group_shards``                gauge    a reader of a cache group: the shards it is
                                                     attached to now
``aioshmcache_tier_*``                      mixed    a sender with a second tier
                                                     (``aioshmcache.tier``): see below
==========================================  =======  =============================================

The second tier (``AsyncSenderCache(tier=RedisTier(...))``), from ``snapshot().tier`` (a
``TierSnapshot``; once the cache is closed, its last counts from ``tier_stats()``): counters
``aioshmcache_tier_lookups_total``, ``_hits_total``, ``_misses_total``, ``_errors_total``,
``_timeouts_total``, ``_late_total`` (answered after the request's deadline: not a failure),
``_rejected_total`` (label ``reason``: ``truncated``, ``malformed``, ``oversized``,
``signature``, ``decoding``), ``_skipped_total`` (the cost policy skipped the tier),
``_bypassed_total`` (the circuit breaker was open), ``_claims_total``, ``_waits_total``,
``_takeovers_total``, ``_writes_total``, ``_dropped_writes_total``, ``_skipped_writes_total``,
``_read_bytes_total``, ``_written_bytes_total``, ``_breaker_opens_total``; a summary
``aioshmcache_tier_lookup_seconds`` (``_count``, ``_sum``: look-up latency); gauges
``aioshmcache_tier_breaker_open`` (1 unless closed), ``_queued_writes`` and
``_fetch_budget_bytes`` (the largest value the cost policy would fetch now).

Cache groups. :class:`GroupCollector` (``GroupCollector("G", cache)``) reads every live shard
of group ``G`` from shared memory at each scrape, so that a scrape of any gateway process of a
``uvicorn --workers N`` app shows all shards; use it instead of ``CacheCollector`` there (one
per registry). A shard's writer (``CacheConfig(group="G")``) is labelled ``cache`` = its segment
name (``aioshm-G.shard1``), plus ``group="G"`` and ``shard="1"``: sum by ``group`` for the whole
group. A reader of the group (``ReceiverCache.attach_group("G")`` or its async twin) has no
single segment: it is labelled ``cache="G"``, ``role="receiver"``, ``group="G"`` and no
``shard`` (its counts cover every shard). A plain cache carries neither label; Prometheus treats
an absent label as an empty one, so ``sum by (group)`` puts plain caches in ``group=""``.

Only the sender's metrics come from its ``snapshot()``; a receiver has no snapshot, so it reports
hits and misses (from ``make_stats()``) and ``aioshmcache_open``. The single-flight counters come
from ``single_flight_stats()``, for the caches that have it (``AsyncSenderCache``). A closed
cache reports ``aioshmcache_open 0`` and its last counts; a scrape never raises because of a
cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample
except ImportError as exc:  # pragma: no cover - exercised in a test with the import blocked
    raise ImportError(
        "aioshmcache.metrics needs prometheus_client, which comes with the 'metrics' extra: "
        "pip install -e '.[metrics]' in a clone of aioshmcache"
    ) from exc

from ._inspect import read_snapshot
from ._segment import list_shards
from ._types import CacheHandle, CacheInfo, CacheSnapshot, TierSnapshot
from .errors import ShmCacheError

__all__ = ["CacheCollector", "GroupCollector", "read_snapshot"]

_PREFIX = "aioshmcache_"
_CACHE_LABELS = ["cache", "role"]
_SLOT_LABELS = ["cache", "role", "slot"]
_GROUP_LABELS = ["group", "shard"]  # only on the samples of a group's caches
# What reading a closed cache raises: ClosedCacheError, or ValueError from a released mapping.
_CLOSED = (ShmCacheError, ValueError)


class StatsCache(Protocol):
    """What every cache offers (the sync caches, a group reader and the async twins)."""

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hit counters (the collector only ever reads them: ``delta=False``)."""
        ...


@runtime_checkable
class SegmentCache(Protocol):
    """A cache of one segment (any but a group reader): it has a handle."""

    def handle(self) -> CacheHandle:
        """The cache's handle (the collector takes the segment name from it)."""
        ...


@runtime_checkable
class SnapshotCache(SegmentCache, Protocol):
    """A cache that also offers ``snapshot()``: the sender side."""

    def snapshot(self) -> CacheSnapshot:
        """What an operator watches (see ``CacheSnapshot``)."""
        ...


@dataclass(frozen=True)
class _Identity:
    """How one cache's samples are labelled."""

    name: str  # the segment's name, or a group reader's group name
    role: str  # "sender" or "receiver"
    group: str | None = None
    shard: int | None = None

    def labels(self, **extra: str) -> dict[str, str]:
        """The cache's labels (``cache``, ``role``, group ones), plus ``extra``."""
        out = {"cache": self.name, "role": self.role, **extra}
        return self._grouped(out)

    def slot_labels(self, slot: int) -> dict[str, str]:
        """The labels of a reader slot of this (sender's) segment."""
        return self._grouped({"cache": self.name, "role": self.role, "slot": str(slot)})

    def _grouped(self, out: dict[str, str]) -> dict[str, str]:
        if self.group is not None:
            out["group"] = self.group
            if self.shard is not None:
                out["shard"] = str(self.shard)
        return out


def _group_reader_of(cache: object) -> str | None:
    """The group name if ``cache`` reads a whole cache group (sync, or an async face over one)."""
    for obj in (cache, getattr(cache, "receiver", None)):
        if callable(getattr(obj, "shard_handles", None)):
            group = getattr(obj, "group", None)
            if isinstance(group, str):
                return group
    return None


def _identify(cache: StatsCache) -> _Identity:
    """Name, role, group and shard of a cache (read now, while it is open)."""
    if isinstance(cache, SnapshotCache):
        snap = cache.snapshot()
        return _Identity(cache.handle().name, "sender", snap.group, snap.shard)
    group = _group_reader_of(cache)
    if group is not None:
        return _Identity(group, "receiver", group)
    if not isinstance(cache, SegmentCache):
        raise TypeError(f"not a cache: {type(cache).__name__} has no handle()")
    return _Identity(cache.handle().name, "receiver")


def _put(family: Metric, labels: dict[str, str], value: float) -> None:
    """One sample of ``family`` (counters get their ``_total`` suffix)."""
    suffix = "_total" if family.type == "counter" else ""
    family.samples.append(Sample(family.name + suffix, labels, value))


class _Families:
    """The metric families of one scrape, filled cache by cache."""

    def __init__(self) -> None:
        def counter(name: str, doc: str, labels: list[str] = _CACHE_LABELS) -> CounterMetricFamily:
            return CounterMetricFamily(_PREFIX + name, doc, labels=[*labels, *_GROUP_LABELS])

        def gauge(name: str, doc: str, labels: list[str] = _CACHE_LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(_PREFIX + name, doc, labels=[*labels, *_GROUP_LABELS])

        self.open = gauge("open", "1 while the cache is open, 0 once it is closed")
        self.hits = counter(
            "hits", "Sender: items handed out from the cache; receiver: references resolved"
        )
        self.misses = counter(
            "misses", "Sender: items not cached when asked; receiver: features not read from shm"
        )
        self.inline = counter(
            "inline_serves",
            "Items served inline instead of cached, by cause (too_large, full, busy)",
            [*_CACHE_LABELS, "cause"],
        )
        self.evictions = counter("evictions", "Items evicted to make room")
        self.relocations = counter(
            "relocations", "Second chance: hit items moved to the ring's tail instead of evicted"
        )
        self.relocated_bytes = counter("relocated_bytes", "Payload bytes of relocated items")
        self.used = gauge("used_bytes", "Bytes of the ring in use")
        self.capacity = gauge("capacity_bytes", "Capacity of the ring in bytes")
        self.items = gauge("items", "Items cached")
        self.epoch = gauge("epoch", "Clear generation")
        self.owed = gauge("handouts_owed", "Hand-outs not yet acknowledged, over attached readers")
        self.slots = gauge("reader_slots", "Reader slots of the segment")
        self.alive = gauge("reader_alive", "1 if the reader in this slot is alive", _SLOT_LABELS)
        self.lag = gauge("reader_lag", "Hand-outs the reader in this slot owes", _SLOT_LABELS)
        self.revoked = gauge("reader_revoked", "1 if the writer revoked this slot", _SLOT_LABELS)
        self.acked = counter(
            "reader_acknowledged", "Acknowledgements by the reader in this slot", _SLOT_LABELS
        )
        self.waited = counter("wait_for_space_seconds", "Seconds puts spent waiting for space")
        self.sf_calls = counter("single_flight_calls", "get_or_put calls")
        self.sf_runs = counter("single_flight_runs", "Preprocessings get_or_put ran")
        self.sf_saved = counter(
            "single_flight_saved", "Preprocessings saved: get_or_put calls served by another's"
        )
        self.sibling_hits = counter(
            "sibling_hits", "Group shard: items served from a sibling shard (also counted as hits)"
        )
        self.shards = gauge("group_shards", "Group reader: shards it is attached to now")

    def all(self) -> list[Metric]:
        return [
            self.open,
            self.hits,
            self.misses,
            self.inline,
            self.evictions,
            self.relocations,
            self.relocated_bytes,
            self.used,
            self.capacity,
            self.items,
            self.epoch,
            self.owed,
            self.slots,
            self.alive,
            self.lag,
            self.revoked,
            self.acked,
            self.waited,
            self.sf_calls,
            self.sf_runs,
            self.sf_saved,
            self.sibling_hits,
            self.shards,
        ]

    def add_snapshot(self, who: _Identity, snap: CacheSnapshot) -> None:
        labels = who.labels()
        _put(self.hits, labels, snap.hits)
        _put(self.misses, labels, snap.misses)
        _put(self.inline, who.labels(cause="too_large"), snap.inline_too_large)
        _put(self.inline, who.labels(cause="full"), snap.inline_full)
        _put(self.inline, who.labels(cause="busy"), snap.inline_busy)
        _put(self.evictions, labels, snap.evictions)
        _put(self.relocations, labels, snap.relocations)
        _put(self.relocated_bytes, labels, snap.bytes_relocated)
        _put(self.used, labels, snap.bytes_used)
        _put(self.capacity, labels, snap.capacity_bytes)
        _put(self.items, labels, snap.items)
        _put(self.epoch, labels, snap.epoch)
        _put(self.slots, labels, len(snap.readers))
        owed = 0
        for r in snap.readers:
            if not r.attached:
                continue
            slot = who.slot_labels(r.slot)
            owed += r.lag
            _put(self.alive, slot, 1.0 if r.alive else 0.0)
            _put(self.lag, slot, r.lag)
            _put(self.revoked, slot, 1.0 if r.revoked else 0.0)
            _put(self.acked, slot, r.acknowledged)
        _put(self.owed, labels, owed)
        _put(self.waited, labels, snap.wait_for_space_seconds)
        if who.group is not None:
            _put(self.sibling_hits, labels, snap.sibling_hits)

    def add_stats(self, who: _Identity, info: CacheInfo) -> None:
        labels = who.labels()
        _put(self.hits, labels, info.hits)
        _put(self.misses, labels, info.misses)

    def add_group_reader(self, who: _Identity, cache: object) -> None:
        """The shards a group reader is attached to (skipped once it is closed)."""
        inner = cache if callable(getattr(cache, "shard_handles", None)) else None
        inner = inner or getattr(cache, "receiver", None)
        read = getattr(inner, "shard_handles", None)
        if callable(read):
            _put(self.shards, who.labels(), len(read()))

    def add_single_flight(self, who: _Identity, cache: object) -> None:
        """The ``get_or_put`` counters, if ``cache`` has them (kept in memory: closed or not)."""
        read = getattr(cache, "single_flight_stats", None)
        if not callable(read):
            return
        stats = read()
        labels = who.labels()
        _put(self.sf_calls, labels, stats.calls)
        _put(self.sf_runs, labels, stats.runs)
        _put(self.sf_saved, labels, stats.saved)


class CacheCollector:
    """A Prometheus collector for sender and receiver caches, sync or async.

    ``CacheCollector(cache, *more)``: every cache is read at each scrape through its public API
    only (``snapshot()`` for a sender, ``make_stats()`` for any cache). Register it with a
    ``prometheus_client.CollectorRegistry``; ``describe()`` names its metrics, so registering a
    second collector in the same registry fails loudly instead of emitting duplicates: give one
    collector all the caches (:meth:`add` takes more later). A reader of a cache group
    (``ReceiverCache.attach_group``) is accepted like any reader (see the module docstring).
    """

    def __init__(self, cache: StatsCache, *more: StatsCache) -> None:
        self._caches: list[tuple[_Identity, StatsCache]] = []
        for c in (cache, *more):
            self.add(c)

    def add(self, cache: StatsCache) -> None:
        """Export one more cache (its name, group and shard are read now, while it is open)."""
        who = _identify(cache)
        if any(w.name == who.name and w.role == who.role for w, _c in self._caches):
            raise ValueError(f"the {who.role} of {who.name!r} is already collected")
        self._caches.append((who, cache))

    def describe(self) -> Iterable[Metric]:
        """The metric families this collector emits (without samples), for the registry."""
        return [*_Families().all(), *_TierFamilies().all()]

    def collect(self) -> Iterable[Metric]:
        """Read every cache now and return its metric families (never raises for a cache)."""
        fam, tiers = _Families(), _TierFamilies()
        for who, cache in self._caches:
            fam.add_single_flight(who, cache)
            is_open = not bool(getattr(cache, "closed", False))
            if is_open and isinstance(cache, SnapshotCache):
                try:
                    snap = cache.snapshot()
                except _CLOSED:  # closed (the async twins have no ``closed`` to ask first)
                    is_open = False
                else:
                    fam.add_snapshot(who, snap)
                    tiers.add(who, snap.tier)
                    _put(fam.open, who.labels(), 1.0)
                    continue
            tiers.add(who, _tier_of(cache))
            try:
                fam.add_stats(who, cache.make_stats())
                if is_open and who.group is not None:
                    fam.add_group_reader(who, cache)
            except _CLOSED:
                pass
            _put(fam.open, who.labels(), 1.0 if is_open else 0.0)
        return [f for f in (*fam.all(), *tiers.all()) if f.samples]


# --- the second tier (``aioshmcache.tier``) -------------------------------------------------------


class _TierFamilies:
    """The ``aioshmcache_tier_*`` families of one scrape."""

    _COUNTERS = (
        ("lookups", "lookups", "Tier look-ups that asked Redis"),
        ("hits", "hits", "Tier values fetched, verified and served"),
        ("misses", "misses", "Tier look-ups without a usable value"),
        ("errors", "errors", "Redis operations of the tier that failed"),
        ("timeouts", "timeouts", "Redis operations of the tier never answered (failures)"),
        ("late", "late", "Redis operations of the tier answered after their request's deadline"),
        ("skipped", "skipped", "Look-ups the cost policy skipped (fetching would not pay)"),
        ("bypassed", "bypassed", "Tier operations skipped while the circuit breaker was open"),
        ("claims", "claims", "Hashes this process claimed to make for the fleet"),
        ("waits", "waits", "Look-ups that waited for another host's make"),
        ("takeovers", "takeovers", "Claims taken over from a claimer whose lease expired"),
        ("writes", "writes", "Values written to the tier"),
        ("dropped_writes", "dropped_writes", "Tier writes dropped: the write queue was full"),
        ("skipped_writes", "skipped_writes", "Items not written: fetching would not pay"),
        ("read_bytes", "bytes_read", "Bytes of tier values fetched and served"),
        ("written_bytes", "bytes_written", "Bytes of tier values written"),
        ("breaker_opens", "breaker_opens", "Times the tier's circuit breaker opened"),
    )

    def __init__(self) -> None:
        labels = [*_CACHE_LABELS, *_GROUP_LABELS]
        self.counters = [
            (attr, CounterMetricFamily(f"{_PREFIX}tier_{name}", doc, labels=labels))
            for name, attr, doc in self._COUNTERS
        ]
        self.rejected = CounterMetricFamily(
            f"{_PREFIX}tier_rejected",
            "Tier values refused by a check, by reason",
            labels=[*_CACHE_LABELS, "reason", *_GROUP_LABELS],
        )
        self.latency = SummaryMetricFamily(
            f"{_PREFIX}tier_lookup_seconds", "Latency of tier look-ups", labels=labels
        )
        self.breaker = GaugeMetricFamily(
            f"{_PREFIX}tier_breaker_open",
            "1 while the circuit breaker is not closed",
            labels=labels,
        )
        self.queued = GaugeMetricFamily(
            f"{_PREFIX}tier_queued_writes", "Tier writes waiting in the queue", labels=labels
        )
        self.budget = GaugeMetricFamily(
            f"{_PREFIX}tier_fetch_budget_bytes",
            "The largest value the cost policy would fetch now",
            labels=labels,
        )

    def all(self) -> list[Metric]:
        return [
            *(f for _a, f in self.counters),
            self.rejected,
            self.latency,
            self.breaker,
            self.queued,
            self.budget,
        ]

    def add(self, who: _Identity, tier: TierSnapshot | None) -> None:
        """The series of one cache's tier (nothing for a cache without one)."""
        if tier is None:
            return
        labels = who.labels()
        for attr, family in self.counters:
            _put(family, labels, float(getattr(tier, attr)))
        for reason, n in tier.rejected.items():
            _put(self.rejected, who.labels(reason=reason), n)
        self.latency.samples.append(
            Sample(self.latency.name + "_count", labels, tier.lookup_samples)
        )
        self.latency.samples.append(Sample(self.latency.name + "_sum", labels, tier.lookup_seconds))
        _put(self.breaker, labels, 0.0 if tier.breaker_state == "closed" else 1.0)
        _put(self.queued, labels, float(tier.queued_writes))
        if tier.policy is not None:
            _put(self.budget, labels, float(tier.policy.budget_bytes))


def _tier_of(cache: object) -> TierSnapshot | None:
    """A cache's tier counters: ``snapshot().tier``, or once closed its last counts.

    ``tier_stats()`` is the same ``TierSnapshot`` read from the tier, which keeps its counters
    after close (a closed cache's ``snapshot()`` raises).
    """
    if isinstance(cache, SnapshotCache):
        try:
            return cache.snapshot().tier
        except _CLOSED:
            pass
    read = getattr(cache, "tier_stats", None)
    tier = read() if callable(read) else None
    return tier if isinstance(tier, TierSnapshot) else None


class GroupCollector:
    """A Prometheus collector for every live shard of a cache group, read from shared memory.

    Why: under ``uvicorn --workers N`` each process writes its own shard, and a scrape reaches
    whichever process the kernel picks. A ``CacheCollector`` of the process's own cache shows one
    shard per scrape; this collector lists the group's shards at every scrape and reads each
    from shared memory (:func:`read_snapshot`, the package's one reader of a segment from
    outside its writer, which this module re-exports), so a scrape of any process shows them
    all, with the same labels a ``CacheCollector`` gives a shard (``cache``, ``role="sender"``,
    ``group``, ``shard``; reader slots add ``slot``). A shard whose writer died shows
    ``aioshmcache_open 0`` until it is reclaimed or swept.

    ``caches`` are this process's own caches: their process-local counters (single flight, the
    second tier's) are added under their labels; everything in shared memory comes from the
    shards. Register one collector per registry (its ``describe`` names the same families as
    ``CacheCollector``).
    """

    def __init__(self, group: str, *caches: StatsCache) -> None:
        self.group = group
        self._local = [(_identify(c), c) for c in caches]

    def describe(self) -> Iterable[Metric]:
        """The metric families this collector emits (without samples), for the registry."""
        return [*_Families().all(), *_TierFamilies().all()]

    def collect(self) -> Iterable[Metric]:
        """Read every shard of the group now (never raises because of a shard)."""
        fam, tiers = _Families(), _TierFamilies()
        for who, cache in self._local:
            fam.add_single_flight(who, cache)
            tiers.add(who, _tier_of(cache))
        for k, name in list_shards(self.group):
            try:
                snap, alive = read_snapshot(name)
            except (ShmCacheError, OSError, ValueError):
                continue  # gone, being created or reclaimed right now
            if snap.group != self.group:
                continue  # a plain cache named like a shard: its header proves no membership
            who = _Identity(name, "sender", self.group, k)
            fam.add_snapshot(who, snap)
            _put(fam.open, who.labels(), 1.0 if alive else 0.0)
        return [f for f in (*fam.all(), *tiers.all()) if f.samples]
