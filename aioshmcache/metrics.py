"""Prometheus metrics for sender and receiver caches: :class:`CacheCollector` (``metrics`` extra).

A custom collector rather than counters updated on every call: the caches already count
everything (``SenderCache.snapshot()``, ``make_stats()``), so a scrape reads those numbers and
the request path pays nothing. Register one collector per registry; it takes every cache the
process owns (a sender, receivers, the shards of a group), each sample labelled with the cache's
segment name and role::

    from prometheus_client import CollectorRegistry, generate_latest
    from aioshmcache.metrics import CacheCollector

    registry = CollectorRegistry()
    registry.register(CacheCollector(sender))
    text = generate_latest(registry)

The metrics (counters end in ``_total``, sizes in ``_bytes``; labels ``cache`` and ``role``):

==========================================  =======  =============================================
``aioshmcache_hits_total``                  counter  sender: items handed out from the cache;
                                                     receiver: references resolved from memory
``aioshmcache_misses_total``                counter  sender: items that were not cached when
                                                     asked; receiver: features that came inline
                                                     or without data
``aioshmcache_inline_serves_total``         counter  items served inline, label ``cause``:
                                                     ``too_large``, ``full`` or ``busy``
``aioshmcache_evictions_total``             counter  items evicted to make room
``aioshmcache_used_bytes``                  gauge    bytes of the ring in use
``aioshmcache_capacity_bytes``              gauge    the ring's capacity
``aioshmcache_items``                       gauge    items cached
``aioshmcache_epoch``                       gauge    clear generation (``clear_cache`` bumps it)
``aioshmcache_handouts_owed``               gauge    hand-outs not yet acknowledged, summed over
                                                     the attached readers
``aioshmcache_reader_slots``                gauge    reader slots of the segment
``aioshmcache_reader_alive``                gauge    per attached slot (label ``slot``): 1 alive
``aioshmcache_reader_lag``                  gauge    per slot: hand-outs the reader owes
``aioshmcache_reader_revoked``              gauge    per slot: 1 if the writer revoked it
``aioshmcache_reader_acknowledged_total``   counter  per slot: acknowledgements since it attached
``aioshmcache_wait_for_space_seconds_total`` counter time requests spent waiting for space
``aioshmcache_open``                        gauge    1 while the cache is open, 0 once closed
``aioshmcache_single_flight_calls_total``   counter  ``AsyncSenderCache.get_or_put`` calls
``aioshmcache_single_flight_runs_total``    counter  preprocessings (``make()``) it ran
``aioshmcache_single_flight_saved_total``   counter  preprocessings single flight saved (calls
                                                     served by another caller's ``make``)
==========================================  =======  =============================================

Only the sender's metrics come from its ``snapshot()``; a receiver has no snapshot, so it reports
hits and misses (from ``make_stats()``) and ``aioshmcache_open``. The single-flight counters come
from ``single_flight_stats()``, for the caches that have it (``AsyncSenderCache``). A closed
cache reports ``aioshmcache_open 0`` and its last counts; a scrape never raises because of a
cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
except ImportError as exc:  # pragma: no cover - exercised in a test with the import blocked
    raise ImportError(
        "aioshmcache.metrics needs prometheus_client, which comes with the 'metrics' extra: "
        "pip install 'aioshmcache[metrics]'"
    ) from exc

from ._types import CacheHandle, CacheInfo, CacheSnapshot
from .errors import ShmCacheError

__all__ = ["CacheCollector"]

_PREFIX = "aioshmcache_"
_CACHE_LABELS = ["cache", "role"]
_SLOT_LABELS = ["cache", "slot"]
# What reading a closed cache raises: ClosedCacheError, or ValueError from a released mapping.
_CLOSED = (ShmCacheError, ValueError)


class StatsCache(Protocol):
    """What every cache offers (``SenderCache``, ``ReceiverCache`` and their async twins)."""

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hit counters (the collector only ever reads them: ``delta=False``)."""
        ...

    def handle(self) -> CacheHandle:
        """The cache's handle (the collector takes the segment name from it)."""
        ...


@runtime_checkable
class SnapshotCache(Protocol):
    """A cache that also offers ``snapshot()``: the sender side."""

    def snapshot(self) -> CacheSnapshot:
        """What an operator watches (see ``CacheSnapshot``)."""
        ...


class _Families:
    """The metric families of one scrape, filled cache by cache."""

    def __init__(self) -> None:
        def counter(name: str, doc: str, labels: list[str] = _CACHE_LABELS) -> CounterMetricFamily:
            return CounterMetricFamily(_PREFIX + name, doc, labels=labels)

        def gauge(name: str, doc: str, labels: list[str] = _CACHE_LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(_PREFIX + name, doc, labels=labels)

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

    def all(self) -> list[Metric]:
        return [
            self.open,
            self.hits,
            self.misses,
            self.inline,
            self.evictions,
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
        ]

    def add_snapshot(self, name: str, snap: CacheSnapshot) -> None:
        labels = [name, "sender"]
        self.hits.add_metric(labels, snap.hits)
        self.misses.add_metric(labels, snap.misses)
        self.inline.add_metric([*labels, "too_large"], snap.inline_too_large)
        self.inline.add_metric([*labels, "full"], snap.inline_full)
        self.inline.add_metric([*labels, "busy"], snap.inline_busy)
        self.evictions.add_metric(labels, snap.evictions)
        self.used.add_metric(labels, snap.bytes_used)
        self.capacity.add_metric(labels, snap.capacity_bytes)
        self.items.add_metric(labels, snap.items)
        self.epoch.add_metric(labels, snap.epoch)
        self.slots.add_metric(labels, len(snap.readers))
        owed = 0
        for r in snap.readers:
            if not r.attached:
                continue
            slot = [name, str(r.slot)]
            owed += r.lag
            self.alive.add_metric(slot, 1.0 if r.alive else 0.0)
            self.lag.add_metric(slot, r.lag)
            self.revoked.add_metric(slot, 1.0 if r.revoked else 0.0)
            self.acked.add_metric(slot, r.acknowledged)
        self.owed.add_metric(labels, owed)
        self.waited.add_metric(labels, snap.wait_for_space_seconds)

    def add_stats(self, name: str, role: str, info: CacheInfo) -> None:
        labels = [name, role]
        self.hits.add_metric(labels, info.hits)
        self.misses.add_metric(labels, info.misses)

    def add_single_flight(self, name: str, cache: object) -> None:
        """The ``get_or_put`` counters, if ``cache`` has them (kept in memory: closed or not)."""
        read = getattr(cache, "single_flight_stats", None)
        if not callable(read):
            return
        stats = read()
        labels = [name, "sender"]
        self.sf_calls.add_metric(labels, stats.calls)
        self.sf_runs.add_metric(labels, stats.runs)
        self.sf_saved.add_metric(labels, stats.saved)


class CacheCollector:
    """A Prometheus collector for sender and receiver caches, sync or async.

    ``CacheCollector(cache, *more)``: every cache is read at each scrape through its public API
    only (``snapshot()`` for a sender, ``make_stats()`` for any cache). Register it with a
    ``prometheus_client.CollectorRegistry``; ``describe()`` names its metrics, so registering a
    second collector in the same registry fails loudly instead of emitting duplicates: give one
    collector all the caches (:meth:`add` takes more later).
    """

    def __init__(self, cache: StatsCache, *more: StatsCache) -> None:
        self._caches: list[tuple[str, StatsCache]] = []
        for c in (cache, *more):
            self.add(c)

    def add(self, cache: StatsCache) -> None:
        """Export one more cache (its segment name is read now, while it is open)."""
        name = cache.handle().name
        role = "sender" if isinstance(cache, SnapshotCache) else "receiver"
        if any(n == name and r == role for n, r in self._roles()):
            raise ValueError(f"the {role} of {name!r} is already collected")
        self._caches.append((name, cache))

    def _roles(self) -> Iterator[tuple[str, str]]:
        for name, cache in self._caches:
            yield name, "sender" if isinstance(cache, SnapshotCache) else "receiver"

    def describe(self) -> Iterable[Metric]:
        """The metric families this collector emits (without samples), for the registry."""
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        """Read every cache now and return its metric families (never raises for a cache)."""
        fam = _Families()
        for name, cache in self._caches:
            fam.add_single_flight(name, cache)
            is_sender = isinstance(cache, SnapshotCache)
            role = "sender" if is_sender else "receiver"
            is_open = not bool(getattr(cache, "closed", False))
            if is_open and isinstance(cache, SnapshotCache):
                try:
                    fam.add_snapshot(name, cache.snapshot())
                except _CLOSED:  # closed (the async twins have no ``closed`` to ask first)
                    is_open = False
                else:
                    fam.open.add_metric([name, role], 1.0)
                    continue
            try:
                fam.add_stats(name, role, cache.make_stats())
            except _CLOSED:
                pass
            fam.open.add_metric([name, role], 1.0 if is_open else 0.0)
        return [f for f in fam.all() if f.samples]
