"""The Prometheus collector: its output, parsed by prometheus_client's own parser, is true."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aioshmcache import AsyncSenderCache, FeatureSpec, ReceiverCache, SenderCache, ShmRef
from aioshmcache.metrics import CacheCollector

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(registry: CollectorRegistry, types: set[str] | None = None) -> Samples:
    """Render the registry's exposition text and parse it back with prometheus_client's parser."""
    samples: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if types is not None:
            types.add(f"{family.name}:{family.type}")
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def scrape(*caches: Any) -> tuple[Samples, set[str]]:
    """Register a collector for ``caches`` in a fresh registry and parse what it exports."""
    registry = CollectorRegistry()
    registry.register(CacheCollector(*caches))
    types: set[str] = set()
    return parse(registry, types), types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def item(n: int) -> dict[str, Any]:
    return {"pixel_values": np.full(n, 7, np.uint8), "grid": np.array([1, 2, 3])}


@pytest.fixture
def pair(make_config: Any) -> Any:
    sender = SenderCache(make_config(256 << 10, 64 << 10, 2))
    receiver = ReceiverCache.attach(sender.handle())
    yield sender, receiver
    receiver.close()
    sender.close()


def test_sender_and_receiver_metrics_match_what_happened(pair: Any) -> None:
    sender, receiver = pair
    name = sender.handle().name
    request = [
        FeatureSpec("a", item(10_000)),
        FeatureSpec("big", item(100_000)),  # over max_object_bytes: served inline
        FeatureSpec("b", item(20_000)),
    ]
    first = sender.get_and_update_features(request)
    again = sender.get_and_update_features([FeatureSpec("a", None)])  # a hit
    assert isinstance(first[0].data, ShmRef) and isinstance(first[1].data, dict)

    s, types = scrape(sender, receiver)
    snap = sender.snapshot()
    sl = {"cache": name, "role": "sender"}
    assert value(s, "aioshmcache_hits_total", **sl) == snap.hits == 1
    assert value(s, "aioshmcache_misses_total", **sl) == snap.misses == 3
    assert value(s, "aioshmcache_inline_serves_total", cause="too_large", **sl) == 1
    assert value(s, "aioshmcache_inline_serves_total", cause="full", **sl) == 0
    assert value(s, "aioshmcache_items", **sl) == snap.items == 2
    assert value(s, "aioshmcache_used_bytes", **sl) == snap.bytes_used > 30_000
    assert value(s, "aioshmcache_capacity_bytes", **sl) == snap.capacity_bytes
    assert value(s, "aioshmcache_evictions_total", **sl) == snap.evictions == 0
    assert value(s, "aioshmcache_epoch", **sl) == snap.epoch
    assert value(s, "aioshmcache_reader_slots", **sl) == 2
    assert value(s, "aioshmcache_open", **sl) == 1
    (slot,) = [r for r in snap.readers if r.attached]
    rl = {"cache": name, "role": "sender", "slot": str(slot.slot)}
    assert value(s, "aioshmcache_reader_alive", **rl) == 1
    assert value(s, "aioshmcache_reader_revoked", **rl) == 0
    assert value(s, "aioshmcache_reader_acknowledged_total", **rl) == 0

    # the reader reads one of its three hand-outs: it owes two
    receiver.get_and_update_features(first[:1])
    s, _ = scrape(sender, receiver)
    assert value(s, "aioshmcache_reader_lag", **rl) == 2
    assert value(s, "aioshmcache_handouts_owed", **sl) == 2
    assert value(s, "aioshmcache_reader_acknowledged_total", **rl) == 1
    assert not any(k[0] == "aioshmcache_reader_alive" and ("slot", "1") in k[1] for k in s)
    assert "aioshmcache_hits:counter" in types and "aioshmcache_used_bytes:gauge" in types
    assert value(s, "aioshmcache_wait_for_space_seconds_total", **sl) == 0  # nobody waited

    receiver.get_and_update_features([*first[1:], *again, FeatureSpec("none", None)])
    s, _ = scrape(sender, receiver)
    rinfo = receiver.make_stats()
    assert value(s, "aioshmcache_hits_total", cache=name, role="receiver") == rinfo.hits == 3
    assert value(s, "aioshmcache_misses_total", cache=name, role="receiver") == rinfo.misses
    assert value(s, "aioshmcache_open", cache=name, role="receiver") == 1
    assert value(s, "aioshmcache_reader_lag", **rl) == 0
    assert value(s, "aioshmcache_handouts_owed", **sl) == 0
    assert value(s, "aioshmcache_reader_acknowledged_total", **rl) == 3
    assert ("aioshmcache_items", frozenset({"cache": name, "role": "receiver"}.items())) not in s


def test_closed_caches_report_closed_and_never_raise(pair: Any) -> None:
    sender, receiver = pair
    name = sender.handle().name
    sender.get_and_update_features([FeatureSpec("a", item(100))])
    collector = CacheCollector(sender, receiver)
    receiver.close()
    sender.close()
    registry = CollectorRegistry()
    registry.register(collector)
    s = parse(registry)
    assert value(s, "aioshmcache_open", cache=name, role="sender") == 0
    assert value(s, "aioshmcache_open", cache=name, role="receiver") == 0
    assert value(s, "aioshmcache_misses_total", cache=name, role="sender") == 1


async def test_async_sender_cache(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config(256 << 10, 64 << 10, 1)) as cache:
        name = cache.handle().name
        registry = CollectorRegistry()
        registry.register(CacheCollector(cache))
        await cache.get_and_update_features([FeatureSpec("a", item(1000))])
        await cache.get_and_update_features([FeatureSpec("a", None)])
        s, _ = scrape(cache)
        assert value(s, "aioshmcache_hits_total", cache=name, role="sender") == 1
        assert value(s, "aioshmcache_items", cache=name, role="sender") == 1
    s = parse(registry)
    assert value(s, "aioshmcache_open", cache=name, role="sender") == 0


async def test_single_flight_counters_of_an_async_sender(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config(256 << 10, 64 << 10, 1)) as cache:
        name = cache.handle().name
        await cache.get_or_put("a", lambda: item(1000))
        await cache.get_or_put("a", lambda: item(1000))  # a hit: make not run
        s, types = scrape(cache)
        labels = {"cache": name, "role": "sender"}
        assert value(s, "aioshmcache_single_flight_calls_total", **labels) == 2
        assert value(s, "aioshmcache_single_flight_runs_total", **labels) == 1
        assert value(s, "aioshmcache_single_flight_saved_total", **labels) == 0
        assert "aioshmcache_single_flight_saved:counter" in types


def test_one_collector_per_registry_and_per_cache(pair: Any) -> None:
    sender, receiver = pair
    registry = CollectorRegistry()
    registry.register(CacheCollector(sender))
    with pytest.raises(ValueError):  # duplicate metric names: give one collector every cache
        registry.register(CacheCollector(receiver))
    collector = CacheCollector(sender)
    with pytest.raises(ValueError):
        collector.add(sender)
    collector.add(receiver)  # same segment, other role: fine


def test_time_spent_waiting_for_space_is_exported(make_config: Any) -> None:
    with (
        SenderCache(make_config(1 << 20, 700 << 10, 1)) as sender,
        ReceiverCache.attach(sender.handle()),  # attached, never reads: everything owed
    ):
        held = sender.get_and_update_features([FeatureSpec("a", item(500 << 10))])
        assert isinstance(held[0].data, ShmRef)
        out = sender.get_and_update_features(
            [FeatureSpec("b", item(600 << 10))], wait_for_space=0.2
        )
        assert not isinstance(out[0].data, ShmRef)  # no room came: inline after the wait
        s, types = scrape(sender)
        seconds = sender.snapshot().wait_for_space_seconds
    waited = value(s, "aioshmcache_wait_for_space_seconds_total", cache=sender.name, role="sender")
    # the time the call spent waiting, as the snapshot counts it (not a bound on how long: the
    # wait starts a little after the call's deadline does)
    assert waited > 0 and waited == pytest.approx(seconds)
    assert "aioshmcache_wait_for_space_seconds:counter" in types


def test_snapshot_to_dict_of_a_real_cache(pair: Any) -> None:
    sender, _ = pair
    sender.get_and_update_features([FeatureSpec("a", item(100))])
    d = sender.snapshot().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["items"] == 1 and len(d["readers"]) == 2 and d["readers"][0]["attached"] in (0, 1)


def test_import_without_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in [m for m in sys.modules if m.startswith("prometheus_client")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "aioshmcache.metrics")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[metrics\]' in a clone"):
        importlib.import_module("aioshmcache.metrics")
