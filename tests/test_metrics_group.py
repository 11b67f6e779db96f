"""The Prometheus collector over a cache group: samples per shard, sibling hits, group readers."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
)
from aioshmcache.metrics import CacheCollector, GroupCollector

from . import _group_procs as gp
from .conftest import RUN_PREFIX
from .test_metrics import parse, scrape, value


@pytest.fixture
def group() -> str:
    return f"{RUN_PREFIX}m{uuid.uuid4().hex[:10]}"


def test_shards_are_labelled_by_group_and_shard(group: str) -> None:
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b, ReceiverCache.attach_group(group) as rx:
        [fa] = a.get_and_update_features([FeatureSpec("h1", gp.make_item("h1"))])
        [fb] = b.get_and_update_features([FeatureSpec("h1", None)])  # copied from shard 0
        b.get_and_update_features([FeatureSpec("h1", None)])  # now an own hit
        rx.get_and_update_features([fa, fb])
        s, types = scrape(a, b, rx)

        la = {"cache": a.handle().name, "role": "sender", "group": group, "shard": "0"}
        lb = {"cache": b.handle().name, "role": "sender", "group": group, "shard": "1"}
        assert la["cache"].endswith(".shard0") and lb["cache"].endswith(".shard1")
        assert value(s, "aioshmcache_sibling_hits_total", **lb) == b.snapshot().sibling_hits == 1
        assert value(s, "aioshmcache_sibling_hits_total", **la) == 0
        assert value(s, "aioshmcache_hits_total", **lb) == 2  # a sibling hit is also a hit
        assert value(s, "aioshmcache_items", **la) == value(s, "aioshmcache_items", **lb) == 1
        assert value(s, "aioshmcache_open", **la) == 1
        assert "aioshmcache_sibling_hits:counter" in types
        # the reader slots of each shard carry the shard too
        slot_b = {**lb, "slot": "0"}
        assert value(s, "aioshmcache_reader_acknowledged_total", **slot_b) == 1

        # the group reader: one series for the whole group, no shard label
        lr = {"cache": group, "role": "receiver", "group": group}
        assert value(s, "aioshmcache_hits_total", **lr) == rx.make_stats().hits == 2
        assert value(s, "aioshmcache_group_shards", **lr) == 2
        assert value(s, "aioshmcache_open", **lr) == 1
        # summing by group gives the group's figures (what a dashboard does)
        total = sum(
            v
            for (n, labels), v in s.items()
            if n == "aioshmcache_hits_total"
            and ("group", group) in labels
            and ("role", "sender") in labels
        )
        assert total == a.snapshot().hits + b.snapshot().hits
        collector = CacheCollector(rx)
        with pytest.raises(ValueError, match="already collected"):
            collector.add(rx)
    registry = CollectorRegistry()
    registry.register(collector)
    s = parse(registry)
    assert value(s, "aioshmcache_open", **lr) == 0  # closed: still reported, never raises
    assert [n for n in os.listdir("/dev/shm") if group in n] == []


def test_plain_caches_carry_no_group_labels(make_config: Callable[..., Any]) -> None:
    with SenderCache(make_config(256 << 10, 64 << 10, 1)) as tx:
        s, _ = scrape(tx)
        assert value(s, "aioshmcache_open", cache=tx.handle().name, role="sender") == 1
        assert not any(n == "aioshmcache_sibling_hits_total" for n, _l in s)
        assert not any(dict(labels).keys() & {"group", "shard"} for _n, labels in s)


async def test_async_group_faces(group: str) -> None:
    cfg = gp.config(group)
    async with (
        AsyncSenderCache.from_config(cfg) as a,
        AsyncSenderCache.from_config(cfg) as b,
        AsyncReceiverCache.attach_group(group) as rx,
    ):
        [fa] = await a.get_and_update_features([FeatureSpec("h", gp.make_item("h"))])
        [fb] = await b.get_and_update_features([FeatureSpec("h", None)])
        await rx.get_and_update_features([fa, fb])
        s, _ = scrape(a, b, rx)
        lb = {"cache": b.handle().name, "role": "sender", "group": group, "shard": "1"}
        assert value(s, "aioshmcache_sibling_hits_total", **lb) == 1
        lr = {"cache": group, "role": "receiver", "group": group}
        assert value(s, "aioshmcache_hits_total", **lr) == 2
        assert value(s, "aioshmcache_group_shards", **lr) == 2


def test_group_collector_shows_every_shard_as_its_writer_would(group: str) -> None:
    """Read from shared memory, a shard's series equal its writer's own ``CacheCollector``'s.

    Shard 1's writer is another process: this process sees it only through shared memory.
    """
    from .helpers import kill_and_reap

    with SenderCache(gp.config(group)) as a, ReceiverCache.attach_group(group) as rx:
        proc, parent, shard, name = gp.start_gateway(group)
        try:
            assert shard == 1
            for h in ("h1", "h2"):
                parent.send(("get", h))
                assert parent.poll(60)
                parent.recv()
            [fa] = a.get_and_update_features([FeatureSpec("h1", None)])  # from the sibling
            rx.get_and_update_features([fa])
            registry = CollectorRegistry()
            registry.register(GroupCollector(group, a))
            s = parse(registry)
            la = {"cache": a.handle().name, "role": "sender", "group": group, "shard": "0"}
            lb = {"cache": name, "role": "sender", "group": group, "shard": "1"}
            assert value(s, "aioshmcache_items", **lb) == 2
            assert value(s, "aioshmcache_misses_total", **lb) == 2
            assert value(s, "aioshmcache_open", **lb) == 1
            assert value(s, "aioshmcache_sibling_hits_total", **la) == 1
            # parity: shard 0's series as its own writer reports them (none of its
            # process-local counters, inline "busy" and waits for space, is nonzero here)
            own, _ = scrape(a)
            assert {k: v for k, v in s.items() if ("shard", "0") in k[1]} == own
            # the slot series carry the role like every other series
            slot = {**la, "slot": "0"}
            assert value(s, "aioshmcache_reader_alive", **slot) == 1
        finally:
            parent.send(None)
            proc.join(30)
            kill_and_reap(proc)
        s = parse(registry)
        assert not any(("shard", "1") in k[1] for k in s)  # closed and unlinked: gone


def test_group_collector_and_inspect_show_members_only(group: str) -> None:
    """A plain cache named like shard 0 of the group, and a shard of a group whose name starts
    with this one's, are not shards of it: the collector, ``inspect`` and ``read_snapshot``
    (whose labels the collector gives) say so, as the plain cache's own snapshot does."""
    from aioshmcache import CacheConfig
    from aioshmcache._inspect import inspect_segment
    from aioshmcache.metrics import read_snapshot

    plain_cfg = CacheConfig(4 << 20, 1 << 20, 1, name=f"{group}.shard0")
    with (
        SenderCache(plain_cfg) as plain,
        SenderCache(gp.config(group)) as member,
        SenderCache(gp.config(f"{group}-y")) as other,
    ):
        assert (member.shard, other.shard) == (1, 0)
        snap, _alive = read_snapshot(plain.name)
        assert (snap.group, snap.shard) == (plain.snapshot().group, plain.snapshot().shard)
        assert (snap.group, snap.shard) == (None, None)
        registry = CollectorRegistry()
        registry.register(GroupCollector(group))
        s = parse(registry)
        caches = {dict(labels)["cache"] for n, labels in s if n == "aioshmcache_open"}
        assert caches == {member.name}
        report = inspect_segment(group)
        assert member.name in report and plain.name not in report and other.name not in report
