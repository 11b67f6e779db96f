"""Cache groups with real processes: shards, sibling look-ups, group readers, deaths, fork."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    CacheConfig,
    CacheMissError,
    FeatureSpec,
    InvalidReferenceError,
    ReaderEvictedError,
    ReaderLimitError,
    ReceiverCache,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    WriterGoneError,
    sweep,
)
from aioshmcache._layout import parse_shard_name, shard_name

from . import _group_procs as gp
from .conftest import RUN_PREFIX
from .helpers import FakeClock

SPAWN = mp.get_context("spawn")


@pytest.fixture
def group() -> str:
    return f"{RUN_PREFIX}g{uuid.uuid4().hex[:10]}"


def _ours(group: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if group in n]


def _stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(10)


def test_shard_names_parse_one_way() -> None:
    assert parse_shard_name(shard_name("a-b_c", 7)) == ("a-b_c", 7)
    assert parse_shard_name("aioshm-a.b.shard1") is None
    assert parse_shard_name("aioshm-a.shard64") is None
    assert parse_shard_name("aioshm-a.shard01") is None
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 19, 1, group="a.b")
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 19, 1, group="a", name="b")


def test_shards_sibling_hits_and_group_reader_in_process(group: str) -> None:
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        assert (a.shard, b.shard) == (0, 1)
        item = gp.make_item("h1")
        [fa] = a.get_and_update_features([FeatureSpec("h1", item)])
        assert b.is_cached("h1") and not b.is_cached("h2")
        [fb] = b.get_and_update_features([FeatureSpec("h1", None)])
        assert fb.data.nonce == b.handle().nonce != fa.data.nonce
        assert b.snapshot().sibling_hits == 1
        with ReceiverCache.attach_group(group) as rx:
            got = rx.get_and_update_features([fa, fb])
            assert all(np.array_equal(f.data["x"], item["x"]) for f in got)
            forged = fa.data._replace(nonce=12345)
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_features([FeatureSpec("h1", forged)])
        a.invalidate("h1")
        b.invalidate("h1")
        assert not b.is_cached("h1")  # the hint went with the item
    assert _ours(group) == []


@pytest.mark.slow
def test_four_writers_two_readers_2000_items(group: str) -> None:
    """4 gateway processes, 2 engine readers, 2,000 items with checksums: 0 wrong; a repeat of
    an item another gateway process put is copied from its shard, not preprocessed again."""
    shared = [f"s{i}" for i in range(100)]
    rng = np.random.default_rng(7)
    plans = []
    for w in range(4):
        own = [shared[i] for i in rng.integers(0, 100, 100)]  # repeats of writer 0's items
        own += [f"w{w}-{i}" for i in range(400)]  # this process's own items
        plans.append((shared, own))
    queues = [SPAWN.Queue(), SPAWN.Queue()]
    out_w, out_r = SPAWN.Queue(), SPAWN.Queue()
    barrier, done = SPAWN.Barrier(4), SPAWN.Event()
    readers = [SPAWN.Process(target=gp.bulk_reader, args=(group, q, 4, out_r)) for q in queues]
    writers = [
        SPAWN.Process(
            target=gp.bulk_writer, args=(group, i, plans[i], queues, barrier, out_w, done)
        )
        for i in range(4)
    ]
    try:
        for p in writers:
            p.start()
        for p in readers:
            p.start()
        counts = [out_w.get(timeout=120) for _ in writers]
        results = [out_r.get(timeout=120) for _ in readers]
    finally:
        done.set()
        _stop(readers + writers)
    assert sorted(c["shard"] for c in counts) == [0, 1, 2, 3]
    assert sum(c["sent"] for c in counts) == 2000
    for r in results:
        assert r == {"seen": 2000, "wrong": 0, "errors": 0}
    # the shared items were preprocessed once, by writer 0; every repeat elsewhere was a copy
    assert sum(c["pre_shared"] for c in counts) == 0
    assert sum(c["pre"] for c in counts) == 100 + 4 * 400
    assert sum(c["sibling_hits"] for c in counts) >= 1
    assert _ours(group) == []


@pytest.mark.slow
def test_killed_gateway_is_seen_dead_reclaimed_and_typed(group: str) -> None:
    pipes, procs = [], []
    try:
        for _ in range(2):
            p, parent, _shard, _name = gp.start_gateway(group)
            pipes.append(parent)
            procs.append(p)
        rx = ReceiverCache.attach_group(group)
        try:
            refs = []
            for i, conn in enumerate(pipes):
                conn.send(("get", f"k{i}"))
                ref, pre = conn.recv()
                assert pre
                refs.append(FeatureSpec(f"k{i}", ShmRef.from_dict(ref)))
            got = rx.get_and_update_features(refs)
            assert all(np.array_equal(f.data["x"], gp.make_item(f.mm_hash)["x"]) for f in got)
            pipes[0].send(("get", "k1"))  # a repeat of writer 1's item: no preprocessing
            ref, pre = pipes[0].recv()
            assert not pre
            again = [FeatureSpec("k0", ShmRef.from_dict(ref)) for _ in range(1)]
            pipes[1].send(("get", "k1"))
            ref1, _ = pipes[1].recv()
            mixed = [*again, FeatureSpec("k1", ShmRef.from_dict(ref1))]
            os.kill(procs[1].pid or 0, signal.SIGKILL)
            procs[1].join(30)
            deadline = time.monotonic() + 30
            while True:  # the reader learns of the death within its probe interval
                try:
                    rx.get_and_update_features(mixed)
                except WriterGoneError as exc:
                    assert exc.mm_hashes == ("k1",)
                    parts: Any = exc.features
                    f0, f1 = parts
                    assert np.array_equal(f0.data["x"], gp.make_item("k1")["x"])
                    assert f1.data is None
                    break
                assert time.monotonic() < deadline
                mixed[0] = FeatureSpec("k0", ShmRef.from_dict(_get(pipes[0], "k1")))
            # a new gateway process takes the dead one's shard index (reclaimed)
            p, parent, shard, _name = gp.start_gateway(group)
            procs.append(p)
            pipes.append(parent)
            assert shard == 1
            parent.send(("get", "k9"))
            ref, _ = parent.recv()
            [f] = rx.get_and_update_features([FeatureSpec("k9", ShmRef.from_dict(ref))])
            assert np.array_equal(f.data["x"], gp.make_item("k9")["x"])  # attached lazily
            with pytest.raises(WriterGoneError):  # the dead shard's references stay typed
                rx.get_and_update_features([mixed[1]])
        finally:
            rx.close()
    finally:
        for conn in pipes:
            try:
                conn.send(None)
            except OSError:
                pass
        _stop(procs)
    sweep(prefix=group)
    assert _ours(group) == []


def _get(conn: Any, h: str) -> dict[str, int]:
    conn.send(("get", h))
    ref, _pre = conn.recv()
    out: dict[str, int] = ref
    return out


def _dead_writer_s_reference(group: str, h: str) -> tuple[int, str, ShmRef]:
    """A gateway process of ``group`` hands out ``h`` and is SIGKILLed: its shard index, its
    segment name (the dead file stays), and the reference."""
    p, parent, shard, name = gp.start_gateway(group)
    try:
        ref = ShmRef.from_dict(_get(parent, h))
    finally:
        p.kill()
        _stop([p])
    return shard, name, ref


def test_forked_gateway_workers_open_their_own_shards(group: str) -> None:
    """gunicorn-style: the config is made in the parent, each forked child opens its shard."""
    fork = mp.get_context("fork")
    cfg = gp.config(group)
    keys = [f"f{i}" for i in range(20)]
    barrier, out = fork.Barrier(2), fork.Queue()
    procs = [
        fork.Process(target=gp.forked_writer, args=(cfg, keys, i == 0, barrier, out))
        for i in range(2)
    ]
    try:
        for p in procs:
            p.start()
        res = sorted(out.get(timeout=60) for _ in procs)
    finally:
        _stop(procs)
    assert [r[0] for r in res] == [0, 1]
    assert sorted(r[1] for r in res) == [0, 20]  # the second child preprocessed nothing
    assert max(r[2] for r in res) == 20
    assert all(p.exitcode == 0 for p in procs)
    assert _ours(group) == []


def test_inspect_lists_the_shards_of_a_group(group: str) -> None:
    from aioshmcache._inspect import inspect_segment

    cfg = gp.config(group)
    with SenderCache(cfg), SenderCache(cfg):
        text = inspect_segment(group)
    assert "2 shard(s)" in text and "--- shard 1" in text and "siblings" in text


async def test_async_group_reader_is_the_same_reader(group: str) -> None:
    from aioshmcache import AsyncReceiverCache, AsyncSenderCache

    cfg = gp.config(group)
    async with AsyncSenderCache.from_config(cfg) as a, AsyncSenderCache.from_config(cfg) as b:
        [fa] = await a.get_and_update_features([FeatureSpec("h", gp.make_item("h"))])
        assert b.is_cached("h")
        [fb] = await b.get_and_update_features([FeatureSpec("h", None)])
        async with AsyncReceiverCache.attach_group(group) as rx:
            got = await rx.get_and_update_features([fa, fb])
        assert all(np.array_equal(f.data["x"], gp.make_item("h")["x"]) for f in got)
        assert b.snapshot().sibling_hits == 1


async def test_concurrent_sibling_copies_of_one_hash_are_misses_not_duplicates(
    group: str,
) -> None:
    """Several requests of this process pass None for a hash only a sibling holds: one copies
    it in, the others see it pending and get the miss a plain cache gives (never a
    DuplicateKeyError)."""
    import asyncio

    from aioshmcache import AsyncSenderCache, CacheMissError

    cfg = gp.config(group)
    async with (
        AsyncSenderCache.from_config(cfg) as a,
        AsyncSenderCache.from_config(
            cfg,
            inline_threshold_bytes=0,  # every copy in a thread: the requests overlap
        ) as b,
    ):
        await a.get_and_update_features([FeatureSpec("h", gp.make_item("h"))])
        results = await asyncio.gather(
            *(b.get_and_update_features([FeatureSpec("h", None)]) for _ in range(4)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(e, CacheMissError) for e in errors), errors
        assert len(errors) < 4 and b.is_cached("h")


def test_a_sibling_copy_keeps_the_look_up_s_prompt_updates(group: str) -> None:
    """A look-up copied from a sibling shard keeps (and returns) the prompt updates its spec
    carries, as a put does: the sibling keeps its own in its own process."""
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("h", gp.make_item("h"), prompt_updates=("u",))])
        [fb] = b.get_and_update_features([FeatureSpec("h", None, prompt_updates=["u"])])
        assert b.snapshot().sibling_hits == 1
        assert fb.prompt_updates == ("u",)
        [again] = b.get_and_update_features([FeatureSpec("h", None)])  # a hit of b's own copy
        assert again.prompt_updates == ("u",)  # the kept ones


async def test_get_or_put_of_a_hash_a_sibling_holds_returns_its_prompt_updates(
    group: str,
) -> None:
    """``get_or_put`` served by a sibling's item (copied as a job: no inline threshold) returns
    the caller's prompt updates, and every later hit the same, not ``()``."""
    from aioshmcache import AsyncSenderCache

    item = gp.make_item("h")
    cfg = gp.config(group)
    async with (
        AsyncSenderCache.from_config(cfg) as a,
        AsyncSenderCache.from_config(cfg, inline_threshold_bytes=0) as b,
    ):
        fa = await a.get_or_put("h", lambda: item, prompt_updates=("u",))
        fb = await b.get_or_put("h", lambda: item, prompt_updates=("u",))
        again = await b.get_or_put("h", lambda: item, prompt_updates=("u",))
        assert b.snapshot().sibling_hits == 1 and b.single_flight_stats().runs == 0
        assert fa.prompt_updates == fb.prompt_updates == again.prompt_updates == ("u",)


def test_after_invalidate_a_shard_copies_no_sibling_s_old_item(group: str) -> None:
    """``invalidate(h)``: the next request of this writer for ``h`` is a miss and puts a new
    item, although a sibling still holds the old one; once put again, look-ups hit it."""
    old, new = {"x": np.zeros(8)}, {"x": np.ones(8)}
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("k", old)])
        b.get_and_update_features([FeatureSpec("k", None)])  # b copies the old item
        assert a.invalidate("k")
        assert not a.is_cached("k") and b.is_cached("k")
        with pytest.raises(CacheMissError):
            a.get_and_update_features([FeatureSpec("k", None)])
        [fa] = a.get_and_update_features([FeatureSpec("k", new)])
        [again] = a.get_and_update_features([FeatureSpec("k", None)])
        with ReceiverCache.attach_group(group) as rx:
            got = rx.get_and_update_features([fa, again])
        assert all(np.array_equal(f.data["x"], new["x"]) for f in got)
        assert a.snapshot().sibling_hits == 0


def test_invalidate_during_a_sibling_copy_publishes_no_old_item(group: str) -> None:
    """``invalidate(h)`` while a request copies a sibling's chunk of ``h`` (a copy job, outside
    the lock): the copy is the old item, so it is not published (a miss, rolled back), and the
    next put of ``h`` puts the new item instead of hitting the old copy."""
    old, new = {"x": np.zeros(1 << 16)}, {"x": np.ones(1 << 16)}
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("k", old)])
        req = b._request([None], ["k"], copy_inline_below=0)  # the copy is a job
        req.begin()
        b.invalidate("k")
        with pytest.raises(CacheMissError):
            req.run_jobs()
            req.finish()
        req.abandon()
        assert not b.is_cached("k") and not b.store._pending
        [f] = b.get_and_update_features([FeatureSpec("k", new)])
        with ReceiverCache.attach_group(group) as rx:
            [got] = rx.get_and_update_features([f])
        assert np.array_equal(got.data["x"], new["x"])


@pytest.mark.parametrize("how", ["cleared", "invalidated"])
def test_a_sibling_copy_that_fails_counts_no_hit(group: str, how: str) -> None:
    """A look-up whose copy from a sibling fails (the sibling cleared during the copy, or this
    writer invalidating the hash meanwhile) is the caller's ``CacheMissError``: counted as no
    hit and no sibling hit, in the snapshot and in the words the metrics read."""
    from aioshmcache.metrics import read_snapshot

    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.zeros(1 << 16)})])
        req = b._request([None], ["k"], copy_inline_below=0)  # the copy is a job
        req.begin()
        if how == "cleared":
            a.clear()
        else:
            b.invalidate("k")
        with pytest.raises(CacheMissError):
            req.run_jobs()
            req.finish()
        req.abandon()
        snap, _alive = read_snapshot(b.name)
        for s in (b.snapshot(), snap):
            assert (s.hits, s.sibling_hits) == (0, 0), s
        a.get_and_update_features([FeatureSpec("j", {"x": np.ones(8)})])
        b.get_and_update_features([FeatureSpec("j", None)])  # a copy that succeeds: one hit
        assert (b.snapshot().hits, b.snapshot().sibling_hits) == (1, 1)


def _look_ups_of_k_take_and_count_nothing(b: SenderCache) -> None:
    """Requests looking ``k`` up (alone, after a hit of ``own``, after a new item) each raise
    the ``CacheMissError`` of ``k`` and take, put and count nothing: ``b`` holds ``own`` only."""
    before = b.snapshot()
    for specs in (
        [FeatureSpec("own", None), FeatureSpec("k", None)],
        [FeatureSpec("new", {"x": np.ones(8)}), FeatureSpec("k", None)],
        [FeatureSpec("k", None)],
    ):
        with pytest.raises(CacheMissError) as ei:
            b.get_and_update_features(specs)
        assert ei.value.mm_hashes == ("k",)
        after = b.snapshot()
        assert (after.hits, after.misses, after.items) == (before.hits, before.misses, before.items)
    assert b.cached_order() == ["own"]  # nothing of the failed requests was put


def test_a_sibling_item_too_large_here_is_a_miss_that_takes_and_counts_nothing(
    group: str,
) -> None:
    """A request whose look-up finds its hash only in a sibling, in a chunk over this shard's
    ``max_object_bytes``, is the ``CacheMissError`` a plain cache gives a look-up it does not
    hold: raised before anything is taken, put or counted (its other items too)."""
    big = gp.config(group)
    small = CacheConfig(32 << 20, 1 << 16, 4, group=group)
    with SenderCache(big) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.zeros(1 << 16)})])
        b.get_and_update_features([FeatureSpec("own", {"x": np.zeros(8)})])
        _look_ups_of_k_take_and_count_nothing(b)


def test_a_sibling_item_too_large_here_is_not_cached_here(group: str) -> None:
    """``is_cached`` answers what a look-up would find: a hash only a sibling holds, in a chunk
    over this shard's ``max_object_bytes``, is not cached here (a look-up of it is a plain miss),
    so the hash-first pattern preprocesses it at once instead of sending ``None``."""
    big = gp.config(group)
    small = CacheConfig(32 << 20, 1 << 16, 4, group=group)
    with SenderCache(big) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.zeros(1 << 16)})])
        a.get_and_update_features([FeatureSpec("fits", {"x": np.zeros(8)})])
        assert a.is_cached("k") is True
        assert b.is_cached("k") is False
        assert b.is_cached("k", rescan=True) is False
        assert b.is_cached(["k", "fits"]) == [False, True]  # a small one is copied as before
        with pytest.raises(CacheMissError):
            b.get_and_update_features([FeatureSpec("k", None)])


def test_a_look_up_of_a_sibling_item_being_copied_in_takes_and_counts_nothing(
    group: str,
) -> None:
    """A request whose look-up finds its hash only in a sibling while another request of this
    process copies it in is the ``CacheMissError`` of a plain miss (a plain cache's look-up of
    a hash being put): raised before anything is taken, put or counted (its other items too),
    not after its earlier items were decided."""
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.zeros(1 << 16)})])
        b.get_and_update_features([FeatureSpec("own", {"x": np.zeros(8)})])
        first = b._request([None], ["k"], copy_inline_below=0)  # copying k in: a job
        first.begin()
        _look_ups_of_k_take_and_count_nothing(b)
        first.run_jobs()
        first.finish()
        [f] = b.get_and_update_features([FeatureSpec("k", None)])  # copied in now: a hit
        assert isinstance(f.data, ShmRef)
        assert (b.snapshot().hits, b.snapshot().sibling_hits) == (2, 1)


def _full_of_its_own(group: str) -> tuple[CacheConfig, list[FeatureSpec]]:
    """A shard config and two new items that fill it: a request putting both has no room left
    for a third item (a request never evicts its own)."""
    own = [FeatureSpec(f"own{n}", {"x": np.full(12_000, n, np.float64)}) for n in range(2)]
    return CacheConfig(256 << 10, 100 << 10, 1, group=group), own


def _begin_own_then_k(b: SenderCache, own: list[FeatureSpec], **kw: Any) -> Any:
    """``b``'s request putting ``own`` (which fills its shard) and then looking ``k`` up,
    begun (``kw``: the request's ``copy_inline_below`` and ``wait_for_space``)."""
    items = [(f.data, ()) for f in own] + [None]
    req = b._request(items, [f.mm_hash for f in own] + ["k"], **kw)
    req.begin()
    return req


@pytest.mark.parametrize("wait", [None, 0.05], ids=["no-wait", "after-a-wait"])
@pytest.mark.parametrize("threshold", [1 << 20, 0], ids=["now", "job"])
def test_a_sibling_item_with_no_room_here_is_served_inline(
    group: str, threshold: int, wait: float | None
) -> None:
    """A look-up of an item only a sibling holds, when this shard has no room for its copy (its
    ring full of the request's own items): served inline, as a plain cache serves an item it has
    no room for, with the sibling's bytes (copied out and verified: in the request's step when
    small, as a copy job when not; after ``wait_for_space`` found no room either), counted as a
    hit from a sibling served inline for want of room; the request's other items are cached as
    usual and nothing of ``k`` is."""
    k = {"x": np.arange(10_240, dtype=np.float64)}  # 80 KiB: no room after the two own items
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", k, prompt_updates=("a's",))])
        req = _begin_own_then_k(b, own, copy_inline_below=threshold, wait_for_space=wait)
        assert req.has_jobs is (threshold == 0 or wait is not None)
        req.run_jobs()
        out = req.finish()
        assert [type(d) for d, _u in out] == [ShmRef, ShmRef, dict]
        got, updates = out[2]
        assert np.array_equal(got["x"], k["x"]) and updates == ()
        got["x"][0] = -1.0  # objects of its own: the sibling's chunk is untouched
        snap = b.snapshot()
        assert (snap.hits, snap.sibling_hits, snap.inline_full, snap.misses) == (1, 1, 1, 2)
        assert b.cached_order() == ["own0", "own1"]
        with ReceiverCache.attach_group(group) as rx:
            [fa] = a.get_and_update_features([FeatureSpec("k", None)])
            [back] = rx.get_and_update_features([fa])
        assert np.array_equal(back.data["x"], k["x"])


def test_a_sibling_item_served_inline_keeps_the_look_up_s_prompt_updates(group: str) -> None:
    """The features face: the sibling's item served inline (no room here) comes back as the
    spec's data, with the prompt updates the look-up's spec carries."""
    k = {"x": np.arange(10_240, dtype=np.float64)}
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", k)])
        out = b.get_and_update_features([*own, FeatureSpec("k", None, prompt_updates=["u"])])
        assert isinstance(out[0].data, ShmRef) and isinstance(out[1].data, ShmRef)
        assert np.array_equal(out[2].data["x"], k["x"]) and out[2].prompt_updates == ("u",)


async def test_an_async_sibling_item_with_no_room_here_is_served_inline(group: str) -> None:
    """The async face runs the copy out of the sibling as a job (off the loop) and serves it."""
    from aioshmcache import AsyncSenderCache

    k = {"x": np.arange(10_240, dtype=np.float64)}
    small, own = _full_of_its_own(group)
    async with (
        AsyncSenderCache.from_config(gp.config(group)) as a,
        AsyncSenderCache.from_config(small, inline_threshold_bytes=0) as b,
    ):
        await a.get_and_update_features([FeatureSpec("k", k)])
        out = await b.get_and_update_features([*own, FeatureSpec("k", None)])
        assert np.array_equal(out[2].data["x"], k["x"])
        assert (b.snapshot().sibling_hits, b.snapshot().inline_full) == (1, 1)


@pytest.mark.parametrize("how", ["cleared", "invalidated"])
def test_a_sibling_item_served_inline_that_changed_is_a_miss(group: str, how: str) -> None:
    """A sibling's item to serve inline (a copy job) whose chunk goes before the copy (the
    sibling cleared) or that this writer invalidates meanwhile (the old item) is the look-up's
    ``CacheMissError``, counted as no hit, as a copy into this shard that fails."""
    k = {"x": np.arange(10_240, dtype=np.float64)}
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", k)])
        req = _begin_own_then_k(b, own, copy_inline_below=0)
        if how == "cleared":
            a.clear()
        else:
            b.invalidate("k")
        with pytest.raises(CacheMissError) as ei:
            req.run_jobs()
            req.finish()
        req.abandon()
        assert ei.value.mm_hashes == ("k",)
        assert (b.snapshot().hits, b.snapshot().sibling_hits, b.snapshot().inline_full) == (0, 0, 0)


@pytest.mark.parametrize("error", ["SerdeError", "ValueError"])
@pytest.mark.parametrize("changed", [True, False], ids=["torn", "unchanged"])
def test_a_sibling_item_that_fails_to_decode_is_a_miss_only_if_it_changed(
    group: str, changed: bool, error: str
) -> None:
    """Served inline, the sibling's item is decoded out of its chunk, which its writer may
    reuse meanwhile: a decode error of a chunk that changed during the decode is the look-up's
    ``CacheMissError`` (torn bytes, not a bad payload), while one of a chunk that did not
    change is the error it is (the shards' serdes differ), whatever a custom serde raises."""
    from aioshmcache import MsgpackSerde, SerdeError

    raised = {"SerdeError": SerdeError, "ValueError": ValueError}[error]

    class Failing(MsgpackSerde):  # the reuse happens during the decode, then the decode fails
        def read(self, buf: memoryview, *, copy: bool = True) -> object:
            if changed:
                a.clear()
            raise raised("cannot decode payload")

    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small, serde=Failing()) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.zeros(10_240)})])
        with pytest.raises(CacheMissError if changed else raised):
            b.get_and_update([(f.data, ()) for f in own] + [None], ["own0", "own1", "k"])


class _Hooked:
    """A serde (the default one's) whose next ``read`` runs ``hook`` first: what happens while
    a sibling's item is decoded to be served inline."""

    def __init__(self) -> None:
        from aioshmcache import MsgpackSerde

        self.serde = MsgpackSerde()
        self.hook: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.serde, name)

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.serde.read(buf, copy=copy)


def test_a_sibling_item_served_inline_after_an_invalidate_and_a_new_put_is_a_miss(
    group: str,
) -> None:
    """This writer invalidates ``k`` and puts its new item while a request decodes the
    sibling's (old) ``k`` to serve it inline: the look-up is a ``CacheMissError``, as when it is
    only invalidated meanwhile, never the old item (the new put ended the withholding of ``k``
    before the decode ended); the new ``k`` stays cached."""
    serde = _Hooked()
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small, serde=serde) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.arange(10_240.0)})])
        req = _begin_own_then_k(b, own, copy_inline_below=0)

        def invalidate_and_put_anew() -> None:
            assert b.invalidate("k") is False  # k is not cached here: only withheld
            [new] = b.get_and_update_features([FeatureSpec("k", {"x": np.full(8, -1.0)})])
            assert isinstance(new.data, ShmRef)

        serde.hook = invalidate_and_put_anew
        with pytest.raises(CacheMissError) as ei:
            req.run_jobs()
            req.finish()
        req.abandon()
        assert ei.value.mm_hashes == ("k",)
        assert (b.snapshot().sibling_hits, b.snapshot().inline_full) == (0, 0)
        assert "k" in b.cached_order()


def test_a_sibling_item_served_inline_for_an_abandoned_request_counts_nothing(group: str) -> None:
    """A request abandoned while its look-up's sibling item is decoded (a copy job): nothing is
    served nor counted for it (no hit, sibling hit or inline serve, in ``snapshot()`` or the
    segment's header words), as a copy into this shard abandoned meanwhile is never committed;
    its pins are given back."""
    from aioshmcache.metrics import read_snapshot

    serde = _Hooked()
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small, serde=serde) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.arange(10_240.0)})])
        req = _begin_own_then_k(b, own, copy_inline_below=0)
        serde.hook = req.abandon
        req.run_jobs()
        assert req.abandoned
        snap, (shm, _alive) = b.snapshot(), read_snapshot(b.name)
        for s in (snap, shm):
            assert (s.hits, s.sibling_hits, s.inline_full, s.misses) == (0, 0, 0, 2)
        assert b.store._pending == {}
        assert b.is_freeable("own0") and b.is_freeable("own1")


async def test_a_cancelled_async_look_up_served_inline_counts_nothing(group: str) -> None:
    """The async face: a request cancelled while its worker thread decodes a sibling's item to
    serve inline counts no hit for it, and gives back every hand-out and pin."""
    import threading

    import anyio

    from aioshmcache import AsyncSenderCache

    serde = _Hooked()
    started, go = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        go.wait(30)

    small, own = _full_of_its_own(group)
    async with (
        AsyncSenderCache.from_config(gp.config(group)) as a,
        AsyncSenderCache.from_config(small, serde=serde, inline_threshold_bytes=0) as b,
    ):
        await a.get_and_update_features([FeatureSpec("k", {"x": np.arange(10_240.0)})])
        serde.hook = block
        task = asyncio.ensure_future(b.get_and_update_features([*own, FeatureSpec("k", None)]))
        assert await anyio.to_thread.run_sync(started.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        assert await anyio.to_thread.run_sync(b._inflight.idle.wait, 30)
        snap = b.snapshot()
        assert (snap.hits, snap.sibling_hits, snap.inline_full, snap.misses) == (0, 0, 0, 2)
        assert b.sender.store._pending == {}
        assert b.sender.is_freeable("own0") and b.sender.is_freeable("own1")


def test_a_sibling_item_served_inline_when_this_writer_closes_meanwhile_is_closed(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This writer closed (by another thread) after the sibling's item was decoded and verified,
    before it is served inline: ``ClosedCacheError``, as for a copy into this shard whose
    commit finds the store closed (not the ``ValueError`` of the closed header's words)."""
    from aioshmcache import ClosedCacheError
    from aioshmcache._group import Sibling

    decode = Sibling.decode
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small) as b:
        a.get_and_update_features([FeatureSpec("k", {"x": np.arange(10_240.0)})])
        req = _begin_own_then_k(b, own, copy_inline_below=0)

        def decode_then_close(self: Sibling, ref: ShmRef, serde: Any) -> object:
            value = decode(self, ref, serde)
            b.close()
            return value

        monkeypatch.setattr(Sibling, "decode", decode_then_close)
        with pytest.raises(ClosedCacheError):
            req.run_jobs()
        req.abandon()
    assert _ours(group) == []


def test_a_sibling_look_up_never_waits_for_space_only_its_own_pins_hold(group: str) -> None:
    """A look-up of a sibling's item when the head of this shard's ring is the request's own
    (pinned) item: waiting cannot make room, so it is served inline at once, as a new item is
    (``test_cache.py::test_a_request_never_waits_for_space_only_its_own_pins_hold``), not after
    the whole ``wait_for_space``."""
    small, own = _full_of_its_own(group)
    with SenderCache(gp.config(group)) as a, SenderCache(small) as b:
        k = {"x": np.arange(10_240.0)}
        a.get_and_update_features([FeatureSpec("k", k)])
        t0 = time.monotonic()
        out = b.get_and_update_features([*own, FeatureSpec("k", None)], wait_for_space=10)
        assert time.monotonic() - t0 < 5
        assert b.store.wakeups == 0  # it never went to sleep waiting for room it holds
        assert np.array_equal(out[2].data["x"], k["x"])
        assert (b.snapshot().sibling_hits, b.snapshot().inline_full) == (1, 1)
        assert b.is_freeable("own0") and b.is_freeable("own1")


async def test_invalidate_then_get_or_put_makes_the_new_item_in_a_group(group: str) -> None:
    """``get_or_put`` after ``invalidate`` runs ``make`` (the new bytes), not a sibling's copy
    of the old item."""
    from aioshmcache import AsyncSenderCache

    old, new = {"x": np.zeros(8)}, {"x": np.ones(8)}
    cfg = gp.config(group)
    async with AsyncSenderCache.from_config(cfg) as a, AsyncSenderCache.from_config(cfg) as b:
        await a.get_or_put("k", lambda: old)
        await b.get_or_put("k", lambda: old)  # a sibling hit: b holds the old item too
        assert await a.invalidate("k")
        f = await a.get_or_put("k", lambda: new)
        with ReceiverCache.attach_group(group) as rx:
            [got] = rx.get_and_update_features([f])
        assert np.array_equal(got.data["x"], new["x"])
        assert a.single_flight_stats().runs == 2


def test_a_reader_attaches_a_shard_recreated_under_the_same_name(group: str) -> None:
    """A shard reclaimed under the same name (new nonce) is attached by the next rescan even if
    the old writer's lock was probed alive a moment ago."""
    cfg = gp.config(group)
    with SenderCache(cfg) as a:
        rx = ReceiverCache.attach_group(group)
        try:
            [fa] = a.get_and_update_features([FeatureSpec("x", gp.make_item("x"))])
            rx.get_and_update_features([fa])  # the old shard is attached and just probed
            name = a.name
        finally:
            a.close()
        try:
            with SenderCache(cfg) as b:  # takes the same shard name back, a new instance
                assert b.name == name
                [fb] = b.get_and_update_features([FeatureSpec("y", gp.make_item("y"))])
                [got] = rx.get_and_update_features([fb])
                assert np.array_equal(got.data["x"], gp.make_item("y")["x"])
        finally:
            rx.close()
    assert _ours(group) == []


def test_a_reference_of_a_shard_that_died_before_the_reader_attached_is_writer_gone(
    group: str,
) -> None:
    """A reader that never attached to a shard gets a reference it handed out after the
    shard's writer died: that is ``WriterGoneError`` (typed as a dead writer), not "no such
    shard" (stress --group found it: a writer killed right after its first request)."""
    from aioshmcache import WriterGoneError

    p, parent, _shard, _name = gp.start_gateway(group)
    try:
        parent.send(("get", "k"))
        ref, _pre = parent.recv()
        p.kill()
        p.join(30)
        with ReceiverCache.attach_group(group) as rx:  # the dead shard is never attached
            with pytest.raises(WriterGoneError):
                rx.get_and_update_features([FeatureSpec("k", ShmRef.from_dict(ref))])
            forged = ShmRef.from_dict(ref)._replace(nonce=12345)
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_features([FeatureSpec("k", forged)])
    finally:
        _stop([p])
        from aioshmcache import sweep

        for name in _ours(group):
            if not name.startswith("sem."):
                sweep(name=name)
    assert _ours(group) == []


@pytest.mark.slow
def test_a_reference_of_a_dead_instance_reclaimed_before_the_reader_started_is_writer_gone(
    group: str,
) -> None:
    """A shard's writer dies, a new writer reclaims the name (new nonce), and only then does a
    reader start and meet a reference the dead instance handed out: the shard file remembers
    the instances it was reclaimed from, so that is ``WriterGoneError``, not "no live shard"
    (CI's stress --group found it: a restarted reader got a reference queued before a writer
    kill). A nonce that no shard file ever held stays ``InvalidReferenceError``."""

    def writer_of_shard0() -> tuple[Any, Any]:
        p, parent, shard, _name = gp.start_gateway(group)
        assert shard == 0  # the dead instances' file, reclaimed each time
        return p, parent

    refs = []
    for gen in range(3):  # three instances of shard 0, each killed and reclaimed
        p, parent = writer_of_shard0()
        try:
            refs.append(ShmRef.from_dict(_get(parent, f"k{gen}")))
        finally:
            p.kill()
            _stop([p])
    p, parent = writer_of_shard0()
    try:
        with ReceiverCache.attach_group(group) as rx:  # it never saw the dead instances
            for i, ref in enumerate(refs):
                with pytest.raises(WriterGoneError):
                    rx.get_and_update_features([FeatureSpec(f"k{i}", ref)])
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_features([FeatureSpec("k0", refs[0]._replace(nonce=12345))])
            live = ShmRef.from_dict(_get(parent, "live"))
            [got] = rx.get_and_update_features([FeatureSpec("live", live)])
            assert np.array_equal(got.data["x"], gp.make_item("live")["x"])
    finally:
        try:
            parent.send(None)
        except OSError:
            pass
        _stop([p])
    sweep(prefix=group)
    assert _ours(group) == []


def test_a_group_reader_revoked_by_one_shard_learns_it_from_that_shard_s_references(
    group: str,
) -> None:
    """A stuck group reader is revoked by one shard only: a request that routes a reference to
    that shard raises ``ReaderEvictedError`` (even a stale one: the revocation freed it), the
    other shard still serves it, and a request routing nothing to the shard cannot know (the
    stress harness used an empty request to ask, and missed a revocation by one shard)."""
    cfg = CacheConfig(1 << 20, 1 << 18, 2, group=group, evict_stuck_readers_after=0.05)
    with SenderCache(cfg) as a, SenderCache(cfg) as b, ReceiverCache.attach_group(group) as rx:
        # the ledger's clock is private: a test of its time limits injects it
        clock = a.store._ledger.clock = FakeClock()  # shard a's stuck limit runs on it
        [fb0] = b.get_and_update_features([FeatureSpec("hb0", gp.make_item("hb0"))])
        rx.get_and_update_features([fb0])  # attached to both shards, b's slot in use
        [fa] = a.get_and_update_features([FeatureSpec("ha", gp.make_item("ha"))])
        [fb] = b.get_and_update_features([FeatureSpec("hb", gp.make_item("hb"))])
        clock.advance(0.2)  # the reader owes "ha" and acknowledges nothing: stuck
        assert a.is_freeable("ha")  # probing the debtors revoked the reader on shard a
        assert a.snapshot().readers[0].revoked
        a.invalidate("ha")
        a.remove_dangling_items()  # the chunk is freed: the reference is stale now
        assert rx.get_and_update_features([]) == []  # routes to no shard: nothing to say
        with pytest.raises(ReaderEvictedError):
            rx.get_and_update_features([fa])
        [got] = rx.get_and_update_features([fb])  # shard b never revoked it
        assert np.array_equal(got.data["x"], gp.make_item("hb")["x"])
    assert _ours(group) == []


def test_a_plain_cache_named_like_a_shard_is_not_a_member(group: str) -> None:
    """``G.shard0`` created as a plain cache is not shard 0 of ``G`` (issue 19, item 8): group
    readers claim no slot on it, sibling writers never look into it, its references are not
    the group's, and its own puts keep being cached."""
    from aioshmcache._group import shard_identity
    from aioshmcache._layout import group_word

    plain_cfg = CacheConfig(4 << 20, 1 << 20, 1, name=f"{group}.shard0")
    with SenderCache(plain_cfg) as plain, SenderCache(gp.config(group)) as member:
        assert member.shard == 1  # the name of shard 0 is taken (by a live writer)
        assert shard_identity(plain.name) == (plain.handle().nonce, 0)
        assert shard_identity(member.name) == (member.handle().nonce, group_word(group))
        ref_plain, _ = plain.get_and_update_item((gp.make_item("p"), []), "p")
        with ReceiverCache.attach_group(group) as rx:
            assert [h.name for h in rx.shard_handles()] == [member.name]
            assert not any(r.attached for r in plain.snapshot().readers)
            with pytest.raises(InvalidReferenceError):
                rx.get_and_update_features([FeatureSpec("p", ref_plain)])
            assert [h.name for h in rx.shard_handles()] == [member.name]  # the rescan, too
            # the plain cache's own single reader slot is still free for its own reader
            with ReceiverCache.attach(plain.handle()) as own:
                for i in range(20):  # puts keep being cached, and are read by its reader
                    ref, _ = plain.get_and_update_item((gp.make_item(f"q{i}"), []), f"q{i}")
                    assert type(ref) is ShmRef
                    got = own.get_and_update_item(ref, f"q{i}")
                    assert np.array_equal(got["x"], gp.make_item(f"q{i}")["x"])
        # a sibling writer never maps the plain cache, so never finds its keys
        assert not member.is_cached("p")
        assert member._siblings is not None and member._siblings.names() == []


def test_attach_group_to_no_such_group_fails_when_asked_to_wait(group: str) -> None:
    """A mistyped group name fails at attach, by default at once (issue 19, item 11)."""
    from aioshmcache import SegmentNotFoundError

    with pytest.raises(SegmentNotFoundError, match="no shard"):
        ReceiverCache.attach_group(group)
    with pytest.raises(SegmentNotFoundError, match="no shard"):
        ReceiverCache.attach_group(group, wait_for_shard=0)
    with pytest.raises(SegmentNotFoundError, match=r"after waiting 0\.2 s"):
        ReceiverCache.attach_group(group, wait_for_shard=0.2)
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="wait_for_shard"):
            ReceiverCache.attach_group(group, wait_for_shard=bad)  # type: ignore[arg-type]
    # a plain cache named like a shard is no shard of the group
    with SenderCache(CacheConfig(1 << 20, 1 << 19, 1, name=f"{group}.shard0")) as plain:
        with pytest.raises(SegmentNotFoundError):
            ReceiverCache.attach_group(group, wait_for_shard=0)
        assert not any(r.attached for r in plain.snapshot().readers)
    # None accepts a group with no shard yet (an engine started before its gateways), and
    # the first reference then says the group has no shard at all
    with ReceiverCache.attach_group(group, wait_for_shard=None) as rx:
        assert rx.shard_handles() == []
        with pytest.raises(InvalidReferenceError, match="no shard"):
            rx.get_and_update_features([FeatureSpec("h", ShmRef(1, 0, 0, 1, 1, 0, 0, 0))])


def test_attach_group_waits_for_the_first_shard(group: str) -> None:
    import threading

    opened = threading.Event()
    stop = threading.Event()

    def gateway() -> None:
        time.sleep(0.3)  # after the reader started waiting (most likely; either way it works)
        with SenderCache(gp.config(group)):
            opened.set()
            stop.wait(60)

    th = threading.Thread(target=gateway)
    th.start()
    try:
        with ReceiverCache.attach_group(group, wait_for_shard=60) as rx:
            # the shard is there once its constructor made it, maybe before the gateway thread
            # runs its next line (a descheduled thread): wait for that line, do not read it
            assert opened.wait(60)
            assert [h.name for h in rx.shard_handles()] == [shard_name(group, 0)]
    finally:
        stop.set()
        th.join(30)


async def test_async_attach_group_passes_wait_for_shard(group: str) -> None:
    from aioshmcache import AsyncReceiverCache, SegmentNotFoundError

    with pytest.raises(SegmentNotFoundError):
        async with AsyncReceiverCache.attach_group(group, wait_for_shard=0):
            pass


def test_a_sibling_detached_during_a_copy_is_stale_not_a_released_buffer(group: str) -> None:
    """A writer copying from a sibling while a rescan detaches it: the copy's checks say
    stale (the request turns it into a miss), under the sibling's lock, so they never touch
    the released mapping (a ``ValueError``) half-way."""
    from aioshmcache import StaleReferenceError

    with SenderCache(gp.config(group)) as a, SenderCache(gp.config(group)) as b:
        a.get_and_update_item((gp.make_item("k"), []), "k")
        assert b._siblings is not None
        found = b._siblings.find("k")
        assert found is not None
        src = found.sibling.payload(found.ref)  # the copy has begun...
        b._siblings.close()  # ...and the sibling is detached under it
        try:
            copied = bytes(src)  # the view still reads mapped pages
        finally:
            src.release()
        assert len(copied) == found.ref.length
        with pytest.raises(StaleReferenceError):
            found.sibling.verify(found.ref)
        with pytest.raises(StaleReferenceError):
            found.sibling.payload(found.ref)


def test_a_dead_instance_s_reference_is_writer_gone_while_its_reclaimer_initialises(
    group: str,
) -> None:
    """A new writer reclaims a dead shard's file and writes its group word just after: in
    between, the file is not yet a proven member, but it already names the dead instances it
    was reclaimed from, so their references are still ``WriterGoneError``, never reported as
    forged (the group stress run: genuine references of a killed writer raised
    ``InvalidReferenceError`` while its replacement started)."""
    from aioshmcache._layout import H_GROUP, SHM_DIR

    shard, name, ref = _dead_writer_s_reference(group, "k")
    with SenderCache(gp.config(group)) as again:
        assert (again.shard, again.name) == (shard, name)  # the dead shard's file, reclaimed
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        word = os.pread(fd, 8, 8 * H_GROUP)
        try:
            os.pwrite(fd, bytes(8), 8 * H_GROUP)  # as before the reclaimer writes its word
            with (
                ReceiverCache.attach_group(group, wait_for_shard=None) as rx,
                pytest.raises(WriterGoneError),
            ):
                rx.get_and_update_features([FeatureSpec("k", ref)])
        finally:
            os.pwrite(fd, word, 8 * H_GROUP)
            os.close(fd)
    sweep(prefix=group)
    assert _ours(group) == []


def _creating(group: str, k: int) -> int:
    """A shard file of ``group`` as a live writer leaves it mid-creation: no header yet, the
    writer lock held (by the descriptor returned; closing it is the creator's death)."""
    from aioshmcache._layout import SHM_DIR
    from aioshmcache._segment import ofd_lock

    fd = os.open(os.path.join(SHM_DIR, shard_name(group, k)), os.O_CREAT | os.O_EXCL | os.O_RDWR)
    assert ofd_lock(fd, 0)
    return fd


def _counting_finds(shards: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    looks: list[int] = []
    find = shards.find

    def counting_find(nonce: int) -> None:
        looks.append(nonce)
        find(nonce)

    monkeypatch.setattr(shards, "find", counting_find)
    return looks


def test_a_read_decides_an_unknown_instance_at_its_first_look(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference naming an instance no shard file names is decided at the first look, with
    nothing to wait for: a header-less file nobody is creating (a writer SIGKILLed while
    creating it), a plain cache named like a shard, and a file a live writer is creating right
    now (a name nobody held: it names no instance; a reclaimer renames its whole file over the
    dead one, so a dead instance's file never goes missing) (issue 28, D5: the two first cost
    every read 2 s; the last made a read wait for the creation, on an async lease's loop)."""
    from aioshmcache._layout import SHM_DIR

    plain_cfg = CacheConfig(1 << 20, 1 << 19, 1, name=f"{group}.shard5")
    with (
        SenderCache(gp.config(group)) as tx,
        SenderCache(plain_cfg),
        ReceiverCache.attach_group(group) as rx,
    ):
        ref = tx.get_and_update_item((gp.make_item("k"), []), "k")[0]
        forged = ref._replace(nonce=12345)
        looks = _counting_finds(rx._shards, monkeypatch)
        dead = os.path.join(SHM_DIR, shard_name(group, 7))
        os.close(os.open(dead, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # its creator died
        fd = _creating(group, 6)
        try:
            for read in (rx.get_and_update_features, rx.lease):
                looks.clear()
                with pytest.raises(InvalidReferenceError):
                    if read is rx.lease:
                        with rx.lease([FeatureSpec("k", forged)]):
                            pass
                    else:
                        rx.get_and_update_features([FeatureSpec("k", forged)])
                assert looks == [12345]  # one look, while the creation still runs
        finally:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, shard_name(group, 6)))
            os.unlink(dead)
        tx.release(ref)


async def test_an_async_group_read_never_holds_its_loop_between_two_looks(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28, D5, and an async ``lease``: a reference naming an instance no shard file
    names, while a live writer creates a shard file of the group, used to be looked for again
    until the creation ended, with ``time.sleep`` on the event loop for a lease. A ticker task
    counts the loop's turns; each look records the count: no read, plain or lease, ever looks
    twice without the loop turning in between, and each read ends, typed, while the creation
    still runs (it waits for nothing)."""
    import asyncio

    from aioshmcache import AsyncReceiverCache, AsyncSenderCache
    from aioshmcache._layout import SHM_DIR
    from aioshmcache.cache import GroupReceiverCache

    cfg = gp.config(group)
    async with (
        AsyncSenderCache.from_config(cfg) as tx,
        AsyncReceiverCache.attach_group(group) as rx,
    ):
        [f] = await tx.get_and_update_features([FeatureSpec("k", gp.make_item("k"))])
        assert isinstance(f.data, ShmRef)
        forged = [FeatureSpec("k", f.data._replace(nonce=12345))]
        assert isinstance(rx.receiver, GroupReceiverCache)
        shards = rx.receiver._shards
        turns = 0
        at: list[int] = []  # the loop's turn at each look
        find = shards.find

        def looking(nonce: int) -> None:
            at.append(turns)
            find(nonce)

        monkeypatch.setattr(shards, "find", looking)

        async def ticker() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        tick = asyncio.create_task(ticker())
        fd = _creating(group, 6)
        try:
            for lease in (True, False, True, False):
                at.clear()
                with pytest.raises(InvalidReferenceError):
                    if lease:
                        async with rx.lease(forged):
                            pass
                    else:
                        await rx.get_and_update_features(forged)
                assert at and at == sorted(set(at)), at  # a turn between any two looks
                await asyncio.sleep(0)
        finally:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, shard_name(group, 6)))
            tick.cancel()
        # the item's own reference still reads (it was owed to this reader)
        [got] = await rx.get_and_update_features([f])
        assert np.array_equal(got.data["x"], gp.make_item("k")["x"])


def test_a_genuine_reference_read_while_the_writer_reuses_its_place_is_stale_not_forged(
    group: str,
) -> None:
    """The cause of the group stress run's "genuine reference rejected as forged" (issue 28).

    To reuse a freed chunk's place the writer writes the state word (*writing*) first, then
    the id, length and check word. A reader of an evicted item's reference that reads the
    header between those stores sees the old id, length and check word with the state
    *writing*: that was ``InvalidReferenceError`` ("not committed"), a forged reference, for
    a genuine one. The memory is put in exactly that state here (the interleaving a loaded
    machine produces when the writer is descheduled between its two stores).
    """
    from aioshmcache import CacheMissError, StaleReferenceError
    from aioshmcache._layout import C_STATE, WRITING

    with SenderCache(gp.config(group)) as tx:
        [f] = tx.get_and_update_features([FeatureSpec("k", gp.make_item("k"))])
        ref = f.data
        assert isinstance(ref, ShmRef)
        tx.invalidate("k")
        tx.remove_dangling_items()  # freed (nobody owes it), the reuse fence published past it
        # the ring's words, through its public buffer (released before the cache closes)
        with tx.store.ring.buf.cast("Q") as words:
            words[(ref.address >> 3) + C_STATE] = WRITING  # the writer's first store of the reuse
            rx = ReceiverCache.attach_group(group)
            try:
                with pytest.raises(CacheMissError) as got:
                    rx.get_and_update_features([FeatureSpec("k", ref)])
                assert list(got.value.mm_hashes) == ["k"]
                with pytest.raises(StaleReferenceError):
                    rx.get_and_update_item(ref, "k")
                # a chunk at or past the reuse fence that is still being written is not stale
                [g] = tx.get_and_update_features([FeatureSpec("g", gp.make_item("g"))])
                assert isinstance(g.data, ShmRef)
                at = (g.data.address >> 3) + C_STATE
                committed, words[at] = words[at], WRITING
                with pytest.raises(InvalidReferenceError, match="not committed"):
                    rx.get_and_update_features([FeatureSpec("g", g.data)])
                words[at] = committed
                [got_g] = rx.get_and_update_features([g])
                assert np.array_equal(got_g.data["x"], gp.make_item("g")["x"])
            finally:
                rx.close()
    assert _ours(group) == []


class _StepsOfReclaim:
    """Stands in for ``os`` in ``_segment``: after every call that changes what ``path`` leads
    to (``unlink``, ``rename``, ``link``, an ``open`` that may create), runs ``look`` there and
    then, before the reclaimer takes its next step (a fake step: no thread, no timing)."""

    def __init__(self, path: str, look: Any) -> None:
        self._path = path
        self._look = look
        self._looking = False
        self.steps: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _after(self, step: str, *paths: Any) -> None:
        if self._path in paths and not self._looking:
            self.steps.append(step)
            self._looking = True
            try:
                self._look()
            finally:
                self._looking = False

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = os.open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT:
            self._after("open(O_CREAT)", path)
        return fd

    def unlink(self, path: Any, *args: Any, **kwargs: Any) -> None:
        os.unlink(path, *args, **kwargs)
        self._after("unlink", path)

    def rename(self, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        os.rename(src, dst, *args, **kwargs)
        self._after("rename", dst)

    def replace(self, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        os.replace(src, dst, *args, **kwargs)
        self._after("replace", dst)

    def link(self, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        os.link(src, dst, *args, **kwargs)
        self._after("link", dst)


def test_a_reclaim_shows_readers_the_dead_file_or_a_whole_new_one_never_none(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: a reclaimer removed the dead shard's file and then created its own under the
    name, so a reader that never saw the dead instance and met one of its references in
    between found no file naming it and called the genuine reference forged. Now the new
    segment is made whole under a name of its own and renamed over the dead one: after every
    step of the reclaim that changes what the name leads to, a reader started then finds a
    complete header there, and the dead instance's reference is ``WriterGoneError``."""
    from aioshmcache import _segment
    from aioshmcache._layout import SHM_DIR
    from aioshmcache._segment import writer_state

    shard, name, ref = _dead_writer_s_reference(group, "k")
    path = os.path.join(SHM_DIR, name)
    seen: list[tuple[bool, str]] = []  # (a whole file under the name, what the read raised)

    def look() -> None:  # a reader that starts now: it never saw the dead instance
        st = writer_state(path)
        with ReceiverCache.attach_group(group, wait_for_shard=None) as rx:
            try:
                rx.get_and_update_features([FeatureSpec("k", ref)])
            except (WriterGoneError, InvalidReferenceError) as exc:
                seen.append((st.exists and st.initialised, type(exc).__name__))

    steps = _StepsOfReclaim(path, look)
    monkeypatch.setattr(_segment, "os", steps)
    with SenderCache(gp.config(group)) as again:
        monkeypatch.undo()
        assert (again.shard, again.name) == (shard, name)  # the dead shard's file, reclaimed
        assert steps.steps  # the reclaim changed what the name leads to, and a reader looked
        assert seen == [(True, "WriterGoneError")] * len(steps.steps), steps.steps
        look()  # and once it is done
        assert seen[-1] == (True, "WriterGoneError")
    sweep(prefix=group)
    assert _ours(group) == []


def test_a_shard_reclaimed_while_a_reader_finds_it_dead_is_not_taken_for_gone(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's rescan attaches a shard whose writer is dead (its instance is remembered as
    gone), and a new writer reclaims the name right then: the instance remembered is the dead
    one the reader read, not the live one a fresh look at the name finds (which was taken for
    gone, and its genuine references refused as a dead writer's for good)."""
    from aioshmcache import _group_receiver

    _shard, _name, old = _dead_writer_s_reference(group, "k")
    made: list[SenderCache] = []
    real = ShmObjectStore  # what ``_group_receiver`` attaches shards with

    class Reclaiming:  # stands in for ``ShmObjectStore`` there: the reclaim comes right after
        @staticmethod
        def from_handle(*args: Any, **kwargs: Any) -> Any:
            try:
                return real.from_handle(*args, **kwargs)
            except WriterGoneError:
                if not made:
                    made.append(SenderCache(gp.config(group)))
                raise

    monkeypatch.setattr(_group_receiver, "ShmObjectStore", Reclaiming)
    try:
        with ReceiverCache.attach_group(group, wait_for_shard=None) as rx:
            monkeypatch.undo()
            [again] = made
            [f] = again.get_and_update_features([FeatureSpec("y", gp.make_item("y"))])
            [got] = rx.get_and_update_features([f])
            assert np.array_equal(got.data["x"], gp.make_item("y")["x"])
            with pytest.raises(WriterGoneError):
                rx.get_and_update_features([FeatureSpec("k", old)])
    finally:
        for cache in made:
            cache.close()
    sweep(prefix=group)
    assert _ours(group) == []


def test_a_shard_closed_while_a_reader_finds_it_is_writer_gone(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reference of a shard the reader has not attached: the request's rescan skips it (here:
    its reader slots are taken), then ``find`` reads the file's writer state (alive, this very
    instance) and attaches by nonce; the writer closes (unlinks) in between. The request got
    the attach's ``SegmentNotFoundError``; the instance was seen, so it is ``WriterGoneError``
    (its hash listed), as for any reference of a shard whose writer closed."""
    from aioshmcache import _group_receiver

    cfg = gp.config(group)
    real = ShmObjectStore  # what ``_group_receiver`` attaches shards with
    with SenderCache(cfg), ReceiverCache.attach_group(group) as rx:
        late = SenderCache(cfg)
        [f] = late.get_and_update_features([FeatureSpec("k", gp.make_item("k"))])
        calls: list[str] = []

        class Racing:  # stands in for ``ShmObjectStore`` there
            @staticmethod
            def from_handle(*args: Any, **kwargs: Any) -> Any:
                calls.append("attach")
                if len(calls) == 1:  # the rescan's: skipped, as a shard with no free slot
                    raise ReaderLimitError("all reader slots are taken")
                late.close()  # find's: the writer closes right after its state was read
                return real.from_handle(*args, **kwargs)

        monkeypatch.setattr(_group_receiver, "ShmObjectStore", Racing)
        try:
            with pytest.raises(WriterGoneError) as info:
                rx.get_and_update_features([f])
            assert list(info.value.mm_hashes) == ["k"]
        finally:
            late.close()
        assert calls == ["attach", "attach"]
    sweep(prefix=group)
    assert _ours(group) == []


@pytest.mark.parametrize(
    "how",
    [
        "a read fails",
        "a reference is forged",
        "a feature is not a FeatureSpec",
        "a hash is not a str",
        "a reference is malformed",
    ],
)
def test_a_failed_group_read_gives_back_every_shard_s_references(group: str, how: str) -> None:
    """A group request that fails gives back the references of every shard, not only those of
    the shard whose read failed: the shards read after it never began (a read failing in the
    core's call), or none began (a reference naming no shard, a feature a single cache's request
    rejects too: every feature is looked at, then the valid references are given back)."""
    cfg = gp.config(group)
    with SenderCache(cfg) as a, SenderCache(cfg) as b, ReceiverCache.attach_group(group) as rx:
        [fa] = a.get_and_update_features([FeatureSpec("ha", gp.make_item("ha"))])
        [fb] = b.get_and_update_features([FeatureSpec("hb", gp.make_item("hb"))])
        assert not a.is_freeable("ha") and not b.is_freeable("hb")  # owed to the reader
        assert isinstance(fa.data, ShmRef) and isinstance(fb.data, ShmRef)
        request = [fa, fb]
        if how == "a read fails":
            store = rx._shards.store(fa.data.nonce)
            assert store is not None
            store.check_writer()  # probed now: the core's call takes the read

            def fails(ctx: Any, ref: object, copy: bool) -> Any:
                raise RuntimeError("bug")

            store.read_path._read_item = fails
            expected: type[Exception] = RuntimeError
        elif how == "a reference is forged":
            request.append(FeatureSpec("hf", fb.data._replace(nonce=12345)))
            expected = InvalidReferenceError
        elif how == "a feature is not a FeatureSpec":
            request.insert(1, ("hx", fb.data))  # type: ignore[arg-type]
            expected = TypeError
        elif how == "a hash is not a str":
            request.insert(1, FeatureSpec(b"hx", None))  # type: ignore[arg-type]
            expected = TypeError
        else:
            request.insert(1, FeatureSpec("hx", {"nonce": fa.data.nonce}))
            expected = InvalidReferenceError
        with pytest.raises(expected):
            rx.get_and_update_features(request)
        assert a.is_freeable("ha") and b.is_freeable("hb")


def test_a_touch_of_a_closed_shard_s_reference_is_writer_gone(group: str) -> None:
    """A group reader's ``touch`` is a call like a read: a reference of a shard whose writer
    has closed is not declared valid, within the probe interval."""
    tx = SenderCache(CacheConfig(1 << 20, 1 << 16, 1, group=group))
    try:
        with ReceiverCache.attach_group(group) as rx:
            ref, _ = tx.get_and_update_item(({"x": np.arange(4)}, ()), "h")
            rx.touch("h", ref)  # valid while the shard's writer lives
            tx.close()
            time.sleep(0.3)  # a shard's writer lock is probed at least every 0.25 s
            with pytest.raises(WriterGoneError):
                rx.touch("h", ref)
    finally:
        tx.close()


def test_a_touch_of_a_gone_shard_s_reference_lists_its_hash(group: str) -> None:
    """A group reader's ``WriterGoneError`` lists the hashes of the shard that is gone
    (``mm_hashes``, what a gateway resends): a ``touch``'s lists its hash too, as a read's
    does, before and after the rescan that detaches the shard."""
    tx = SenderCache(CacheConfig(1 << 20, 1 << 16, 1, group=group))
    try:
        with ReceiverCache.attach_group(group) as rx:
            ref, _ = tx.get_and_update_item(({"x": np.arange(4)}, ()), "h")
            tx.close()
            for _ in range(2):
                with pytest.raises(WriterGoneError) as info:
                    rx.touch("h", ref)
                assert info.value.mm_hashes == ("h",)
                rx.rescan()
    finally:
        tx.close()


def test_a_release_after_the_writer_is_gone_gives_back_nothing(group: str) -> None:
    """``release`` of a genuine hand-out whose writer closed answers False (nothing is owed to
    a writer that is gone), for a plain reader and a group reader alike, as the group reader
    answers for a shard it meets gone; while the writer lives it is True once."""
    item = {"x": np.zeros(8)}
    with (
        SenderCache(CacheConfig(4 << 20, 1 << 20, 1, name=f"{group}p")) as plain,
        SenderCache(gp.config(group)) as shard,  # (closed in the loop: close is idempotent)
        ReceiverCache.attach(plain.handle()) as rx,
        ReceiverCache.attach_group(group) as grx,
    ):
        for sender, reader in ((plain, rx), (shard, grx)):
            live, _ = sender.get_and_update_item((item, []), "k")
            assert reader.release(live) is True
            assert reader.release(live) is False  # released already
            ref, _ = sender.get_and_update_item((item, []), "k")
            sender.close()
            assert reader.release(ref) is False
            with pytest.raises(WriterGoneError):  # what a read of it says
                reader.get_and_update_item(ref, "k")
    assert _ours(group) == []


def test_a_release_racing_the_detach_of_its_shard_gives_back_nothing(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group reader's ``release`` whose shard is detached (its writer seen gone by another
    thread) between routing the reference and giving it back answers False, as for a writer
    gone before, instead of the detached store's ``ClosedCacheError``; a release on the group
    reader closed by its owner is still that error, as a plain reader's is."""
    from aioshmcache import ClosedCacheError

    with SenderCache(gp.config(group)) as s, ReceiverCache.attach_group(group) as grx:
        refs = [s.get_and_update_item(({"x": np.zeros(8)}, []), k)[0] for k in ("k", "j")]
        shards = grx._shards
        route = shards.route

        def route_then_detach(ref: ShmRef) -> Any:
            store = route(ref)
            shards.detach(ref.nonce)
            return store

        monkeypatch.setattr(shards, "route", route_then_detach)
        assert grx.release(refs[0]) is False
        monkeypatch.undo()
        grx.close()
        with pytest.raises(ClosedCacheError):
            grx.release(refs[1])
    assert _ours(group) == []


def test_a_shard_without_a_free_reader_slot_fails_only_its_own_references(group: str) -> None:
    """A group reader that cannot attach one shard opened after it (every reader slot taken)
    still attaches the shards opened later, and a request that names the full shard fails owing
    nothing: a request's rescan skips the full shard, and only a reference of that shard raises
    why (as attaching the group, or an explicit ``rescan()``, does)."""
    cfg = CacheConfig(32 << 20, 1 << 20, 1, group=group)
    with (
        SenderCache(cfg) as a,
        ReceiverCache.attach_group(group) as rx,
        SenderCache(cfg) as b,
        ReceiverCache.attach(b.handle()),  # takes b's only reader slot
        SenderCache(cfg) as c,
    ):
        [fa] = a.get_and_update_features([FeatureSpec("ha", gp.make_item("ha"))])
        [fb] = b.get_and_update_features([FeatureSpec("hb", gp.make_item("hb"))])
        [fc] = c.get_and_update_features([FeatureSpec("hc", gp.make_item("hc"))])
        assert isinstance(fb.data, ShmRef) and not a.is_freeable("ha")
        # a reference of a shard with room is read, though the full one sorts before it
        [got] = rx.get_and_update_features([fc])
        assert np.array_equal(got.data["x"], gp.make_item("hc")["x"])
        with pytest.raises(ReaderLimitError):
            rx.get_and_update_features([fa, fb])
        assert a.is_freeable("ha")  # the failed request owes nothing
        assert rx.release(fb.data) is False  # never handed to this reader: not an error
        assert sorted(h.name for h in rx.shard_handles()) == sorted([a.name, c.name])
        with pytest.raises(ReaderLimitError):
            rx.rescan()
        with pytest.raises(ReaderLimitError):
            ReceiverCache.attach_group(group)
