"""``ShardedMap``: the writer's per-item maps, split so that no insert rebuilds a big table."""

from __future__ import annotations

import gc

import pytest

from aioshmcache._sharded_map import SHARD_ENTRIES, SHARDS, ShardedMap, shards_for


def test_it_behaves_as_a_dict() -> None:
    m: ShardedMap[str, int] = ShardedMap()
    model: dict[str, int] = {}
    for i in range(3000):
        k = f"k{i % 1000}"
        if i % 7 == 3 and k in model:
            del m[k]
            del model[k]
        elif i % 11 == 5:
            assert m.pop(k, -1) == model.pop(k, -1)
        else:
            m[k] = i
            model[k] = i
        assert len(m) == len(model)
    assert m.to_dict() == model == dict(m)  # dict(m) through keys() and __getitem__
    assert sorted(m) == sorted(model) and sorted(m.values()) == sorted(model.values())
    assert all(m.get(k) == v and m[k] == v and k in m for k, v in model.items())
    assert m.get("nope") is None and m.get("nope", 7) == 7 and "nope" not in m
    with pytest.raises(KeyError):
        m.pop("nope")
    with pytest.raises(KeyError):
        del m["nope"]
    assert len(m) == len(model)  # a failed delete changes no count
    m.clear()
    assert len(m) == 0 and list(m) == []


def test_entries_spread_over_the_shards_and_stay_untracked() -> None:
    """Sequential ints (chunk ids, addresses / 64) and str keys each fill every shard about
    evenly: no shard holds more than twice its share, so no single rebuild is big."""
    ints: ShardedMap[int, tuple[str, int]] = ShardedMap()
    strs: ShardedMap[str, int] = ShardedMap()
    n = 64 * SHARDS
    for i in range(n):
        ints[1000 + i] = (f"k{i}", i)
        strs[f"key-{i}"] = i
    for m in (ints, strs):
        sizes = [len(d) for d in m.shards]
        assert sum(sizes) == n and max(sizes) <= 2 * n // SHARDS
    gc.collect()  # the collector untracks tuples of atomic values, then dicts of them
    assert not any(gc.is_tracked(d) for d in strs.shards)
    assert not any(gc.is_tracked(v) for v in ints.values())


def test_the_shard_count_is_sized_from_what_the_map_may_hold() -> None:
    """One dict for a small cache; more (powers of two, at most SHARDS) as the most entries
    the map may hold grows, so that no shard holds much more than SHARD_ENTRIES."""
    assert shards_for(0) == shards_for(SHARD_ENTRIES) == 1
    assert shards_for(SHARD_ENTRIES + 1) == 2
    assert shards_for(100 * SHARD_ENTRIES) == 128
    assert shards_for(10**12) == SHARDS
    for bad in (0, 3, 6):
        with pytest.raises(ValueError, match="power of two"):
            ShardedMap(bad)
    m: ShardedMap[int, int] = ShardedMap(4)
    for i in range(100):
        m[i] = i
    assert len(m.shards) == 4 and all(len(d) == 25 for d in m.shards)
