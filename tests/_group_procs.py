"""Child-process bodies for the cache-group tests (spawned, so they must be importable)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def make_item(h: str) -> dict[str, Any]:
    """The deterministic item of hash ``h`` (4 KiB): readers recompute it to check the bytes."""
    seed = int(hashlib.blake2b(h.encode(), digest_size=8).hexdigest(), 16)
    return {"x": np.random.default_rng(seed).integers(0, 2**31, 1024, dtype=np.int32)}


def config(group: str) -> Any:
    from aioshmcache import CacheConfig

    return CacheConfig(32 << 20, 1 << 20, 4, group=group)  # 8192 hint slots


def hash_first(cache: Any, h: str) -> tuple[Any, bool]:
    """The gateway pattern: send ``None`` if the group holds ``h``, else preprocess and put.

    Returns the feature and whether this call preprocessed.
    """
    from aioshmcache import CacheMissError, FeatureSpec

    if cache.is_cached(h):
        try:
            [f] = cache.get_and_update_features([FeatureSpec(h, None)])
            return f, False
        except CacheMissError:
            pass  # a torn or stale sibling read: preprocess as for any miss
    [f] = cache.get_and_update_features([FeatureSpec(h, make_item(h))])
    return f, True


def bulk_writer(
    group: str, index: int, plan: Any, queues: Any, barrier: Any, out: Any, done: Any
) -> None:
    """Phase 1: writer 0 puts the shared keys; phase 2: every writer runs its own hashes."""
    from aioshmcache import SenderCache

    with SenderCache(config(group)) as cache:
        counts: dict[str, Any] = {"pre": 0, "pre_shared": 0, "sent": 0}
        shared, own = plan
        if index == 0:
            for h in shared:
                f, pre = hash_first(cache, h)
                counts["pre"] += pre
        barrier.wait(60)
        batch: list[tuple[str, dict[str, int]]] = []
        for h in own:
            f, pre = hash_first(cache, h)
            counts["pre"] += pre
            counts["pre_shared"] += pre and h in shared
            batch.append((h, f.data.to_dict()))
            if len(batch) == 50:
                for q in queues:
                    q.put(batch)
                counts["sent"] += len(batch)
                batch = []
        if batch:
            for q in queues:
                q.put(batch)
            counts["sent"] += len(batch)
        for q in queues:
            q.put(None)  # after this writer's batches (one feeder thread: in order)
        counts["sibling_hits"] = cache.snapshot().sibling_hits
        counts["shard"] = cache.shard
        out.put(counts)
        done.wait(120)  # keep the shard alive until the readers have read everything


def bulk_reader(group: str, queue: Any, n_writers: int, out: Any) -> None:
    """Read every reference sent; count wrong bytes and errors."""
    from aioshmcache import FeatureSpec, ReceiverCache, ShmCacheError, ShmRef

    rx = ReceiverCache.attach_group(group, wait_for_shard=60)  # may start before the writers
    seen = wrong = errors = 0
    stops = 0
    while stops < n_writers:
        batch = queue.get(timeout=120)
        if batch is None:
            stops += 1
            continue
        specs = [FeatureSpec(h, ShmRef.from_dict(r)) for h, r in batch]
        try:
            got = rx.get_and_update_features(specs)
        except ShmCacheError:
            errors += len(specs)
            continue
        for f in got:
            seen += 1
            wrong += not np.array_equal(f.data["x"], make_item(f.mm_hash)["x"])
    rx.close()
    out.put({"seen": seen, "wrong": wrong, "errors": errors})


def command_writer(group: str, conn: Any) -> None:
    """A gateway process driven over a pipe: ("get", h) -> (ref dict, preprocessed)."""
    from aioshmcache import SenderCache

    with SenderCache(config(group)) as cache:
        conn.send(("ready", cache.shard, cache.name))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            f, pre = hash_first(cache, msg[1])
            conn.send((f.data.to_dict(), pre))


def start_gateway(group: str) -> tuple[Any, Any, int, str]:
    """Start a ``command_writer`` of ``group`` and wait until it is ready: the process, the
    test's end of its pipe, its shard index and its segment name. A process that never gets
    ready is killed before the failure is raised."""
    from .helpers import SPAWN, kill_and_reap

    parent, child = SPAWN.Pipe()
    p = SPAWN.Process(target=command_writer, args=(group, child))
    p.start()
    try:
        assert parent.poll(60), "the gateway process never got ready"
        _ready, shard, name = parent.recv()
    except BaseException:
        kill_and_reap(p)
        raise
    return p, parent, shard, name


def forked_writer(cfg: Any, keys: list[str], first: bool, barrier: Any, out: Any) -> None:
    """Open the group's shard in a forked child (the config came from the parent)."""
    from aioshmcache import SenderCache

    with SenderCache(cfg) as cache:
        pres = 0
        barrier.wait(60)  # both shards open
        if not first:
            barrier.wait(60)  # the first child has put the keys
        for h in keys:
            _f, pre = hash_first(cache, h)
            pres += pre
        if first:
            barrier.wait(60)
        out.put((cache.shard, pres, cache.snapshot().sibling_hits))
        barrier.wait(60)  # both done before either closes its shard
