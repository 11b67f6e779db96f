"""Layer 7: the asyncio facade — lifetime, cancellation safety, concurrency, loop lag, waits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aioshmcache
from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheMissError,
    ClosedCacheError,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
    SerdeError,
    ShmRef,
    _core_api,
    _core_py,
    _request,
)
from aioshmcache._evict import WAIT_POLL
from aioshmcache.aio import CHECKPOINT_EVERY, read_after_wait

from . import _procs
from .helpers import SPAWN, checksum, count_sender_requests, random_item, wait_until

MiB = 1 << 20
#: heartbeat turns over eight 64 MiB copies in threads (a copy made on the loop gives a handful)
HEARTBEAT_TURNS = 200


async def _until(pred: Callable[[], bool], deadline: float = 60.0) -> None:
    """Wait on the loop until ``pred()`` holds (a generous deadline: a hang, not a speed)."""
    with anyio.fail_after(deadline):
        while not pred():  # noqa: ASYNC110 - library state that signals nothing: polled
            await anyio.sleep(0.001)


def test_constructors_do_no_loop_bound_work(make_config: Any) -> None:
    cache = AsyncSenderCache.from_config(make_config())  # no running loop here: must not fail
    rx = AsyncReceiverCache.attach("whatever")
    assert cache._limiter is None and rx._limiter is None


async def test_lifetime_owned_and_borrowed(make_config: Any) -> None:
    cfg = make_config()
    async with AsyncSenderCache.from_config(cfg) as cache:
        name = cache.handle().name
        async with AsyncReceiverCache.attach(cache.handle()) as rx:
            out = await cache.get_and_update_item(({"a": np.arange(5)}, ["u"]), "h")
            assert isinstance(out[0], ShmRef) and out[1] == ["u"]
            got = await rx.get_and_update_item(out[0], "h")
            assert np.array_equal(got["a"], np.arange(5))
            assert cache.make_stats().total == 1 and cache.is_cached("h")
        await rx.aclose()  # idempotent
        with pytest.raises(ClosedCacheError):
            await rx.get_and_update_features([])
    await cache.aclose()
    with pytest.raises(ClosedCacheError):
        await cache.get_and_update_item(None, "h")
    assert name not in await anyio.to_thread.run_sync(os.listdir, "/dev/shm")
    # wrapping borrows: aclose leaves the sync cache open
    sync = SenderCache(make_config(name=cfg.name + "b"))
    try:
        async with AsyncSenderCache(sync) as wrapped:
            await wrapped.get_and_update_item(({"a": 1}, ()), "k")
        assert not sync.closed and sync.is_cached("k")
    finally:
        sync.close()


async def test_a_declined_one_spec_put_keeps_updates_given_as_an_iterator(
    make_config: Any,
) -> None:
    """A review's case: the async face's one-spec call reads a spec's updates, declines (a copy
    over its inline threshold goes to a thread) and its request read them again: a one-shot
    iterator gave the put no updates. The spec now keeps them whole."""
    cfg = make_config(8 << 20, 4 << 20)
    async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=1024) as cache:
        spec = FeatureSpec("h", {"b": np.zeros(100_000)}, prompt_updates=iter([1]))
        [out] = await cache.get_and_update_features([spec])
        assert isinstance(out.data, ShmRef) and tuple(out.prompt_updates) == (1,)
        [again] = await cache.get_and_update_features([FeatureSpec("h", None)])
        assert tuple(again.prompt_updates) == (1,)  # the kept ones


@pytest.mark.parametrize("call", ["item", "list", "features"])
async def test_a_one_item_put_over_the_threshold_is_copied_off_the_loop(
    make_config: Any, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Each async one-item entry point: an item of ``inline_threshold_bytes`` or more is
    reserved on the loop, copied into its chunk in a worker thread, and committed; a smaller one
    is put on the loop in one step (no copy job). The bytes read back are the put's."""
    from aioshmcache.store import StoreWriter

    copies: list[int] = []  # the thread of each copy into a reserved chunk
    write = StoreWriter.write_reserved

    def spy(self: StoreWriter, res: Any) -> None:
        copies.append(threading.get_ident())
        write(self, res)

    monkeypatch.setattr(StoreWriter, "write_reserved", spy)
    cfg = make_config(16 * MiB, 4 * MiB, 1)
    async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=MiB) as cache:
        for key, nbytes in (("big", 2 * MiB), ("small", MiB // 2)):
            item = {"x": np.arange(nbytes, dtype=np.uint8)}
            if call == "item":
                ref, _u = await cache.get_and_update_item((item, ()), key)
            elif call == "list":
                [(ref, _u)] = await cache.get_and_update([(item, ())], [key])
            else:
                [f] = await cache.get_and_update_features([FeatureSpec(key, item)])
                ref = f.data
            assert isinstance(ref, ShmRef)
            assert np.array_equal(cache.sender.store.get(ref)["x"], item["x"])
        assert len(copies) == 1 and copies[0] != threading.get_ident()  # the big one only


async def test_hits_are_inline_and_lease(make_config: Any) -> None:
    async with (
        AsyncSenderCache.from_config(make_config(8 * MiB, 4 * MiB, 1)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        item = {"x": np.arange(1000, dtype=np.float32)}
        [f] = await cache.get_and_update_features([FeatureSpec("a", item)])
        [f2] = await cache.get_and_update_features([FeatureSpec("a", None)])
        assert f.data.id == f2.data.id and f.data.seq != f2.data.seq
        async with rx.lease([f, f2]) as leased:
            assert not leased[0].data["x"].flags.writeable
            assert np.array_equal(leased[1].data["x"], item["x"])
            assert not cache.is_freeable("a")
        assert cache.is_freeable("a")


async def _drain_everything(cache: AsyncSenderCache, rx: AsyncReceiverCache) -> None:
    """Read (and so acknowledge) every outstanding hand-out the writer still tracks."""
    store = cache.sender.store
    store.drain()
    assert isinstance(rx.receiver, ReceiverCache)
    session = rx.receiver.store.read_path.slot.session  # type: ignore[union-attr]
    # the writer's ledger and its references by hand-out (private): this helper settles exactly
    # what the ledger says this reader still owes, which no public call lists
    for key in cache.cached_order():
        cid = store.index[key]
        e = store._ledger.get(cid)  # None: nothing owed on it
        for seq, (owers, _t) in list(e.out.items()) if e is not None else []:
            if owers and session in owers:
                await rx.get_and_update_item(store._ref(cid, seq), key)


@pytest.mark.parametrize("how", ["move_on_after", "task_cancel", "asyncio_timeout"])
async def test_cancellation_at_every_await_point_leaks_nothing(make_config: Any, how: str) -> None:
    cfg = make_config(96 * MiB, 24 * MiB, 1)
    rng = np.random.default_rng(0)
    items = [random_item(rng, int(s)) for s in (2 * MiB, 8 * MiB, 16 * MiB, 3 * MiB)]
    async with (
        AsyncSenderCache.from_config(cfg, inline_threshold_bytes=MiB) as cache,
        AsyncReceiverCache.attach(cache.handle(), inline_threshold_bytes=MiB) as rx,
    ):
        for k, delay in enumerate([0, 0.0001, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.02]):
            feats = [FeatureSpec(f"c{k}-{j}", it) for j, it in enumerate(items)]
            if how == "move_on_after":
                with anyio.move_on_after(delay):
                    await cache.get_and_update_features(feats)
            else:
                task = asyncio.ensure_future(cache.get_and_update_features(feats))
                if how == "task_cancel":
                    await asyncio.sleep(delay)
                    task.cancel()
                    try:
                        await task  # it may have finished before the cancel arrived
                    except asyncio.CancelledError:
                        pass
                else:
                    try:
                        async with asyncio.timeout(delay):
                            await task
                    except TimeoutError:
                        pass
            # the reader side too: cancel a read of what is cached
            refs = [FeatureSpec(h, cache.sender.store.ref_of(h)) for h in cache.cached_order()]
            handed = await cache.get_and_update_features(
                [FeatureSpec(f.mm_hash, None) for f in refs]
            )
            rtask = asyncio.ensure_future(rx.get_and_update_features(handed))
            await asyncio.sleep(delay)
            rtask.cancel()
            try:
                out = await rtask
                for f in out:  # a read that finished is right
                    assert checksum(f.data["data"]) == f.data["crc"]
            except asyncio.CancelledError:
                pass
        # let threads finish, then: every item freeable once the reader drained
        for face in (cache, rx):
            assert await anyio.to_thread.run_sync(face._inflight.idle.wait, 60)
        await _drain_everything(cache, rx)
        assert await anyio.to_thread.run_sync(rx._inflight.idle.wait, 60)
        cache.sender.store.drain()
        assert all(cache.is_freeable(h) for h in cache.cached_order()), cache.snapshot()
        store = cache.sender.store
        assert not store._pending, "a reservation was left half-done"
        # every committed chunk holds exactly what was put: no half-written one is readable
        cached = cache.cached_order()
        assert cached
        handed = await cache.get_and_update_features([FeatureSpec(h, None) for h in cached])
        for f in await rx.get_and_update_features(handed):
            assert checksum(f.data["data"]) == f.data["crc"]
        # the next operation succeeds
        out = await cache.get_and_update_features([FeatureSpec("final", items[0])])
        assert isinstance(out[0].data, ShmRef)
        [back] = await rx.get_and_update_features(out)
        assert checksum(back.data["data"]) == items[0]["crc"]


async def test_200_concurrent_tasks_two_receiver_processes(make_config: Any) -> None:
    cfg = make_config(64 * MiB, 4 * MiB, 2)
    rng = np.random.default_rng(3)
    pool = [random_item(rng, int(rng.integers(1000, 3 * MiB))) for _ in range(40)]
    async with AsyncSenderCache.from_config(cfg) as cache:
        pipes, procs = [], []
        for _ in range(2):
            a, b = SPAWN.Pipe()
            p = SPAWN.Process(
                target=_procs.async_receiver, args=(cache.handle().to_dict(), b), daemon=True
            )
            p.start()
            pipes.append(a)
            procs.append(p)
        try:
            for a in pipes:
                assert await anyio.to_thread.run_sync(a.poll, 60)
                assert a.recv() == "ready"
            lock = anyio.Lock()  # one request at a time on each pipe; the cache work overlaps
            results: list[bool] = []

            async def one(i: int) -> None:
                j = int(rng.integers(0, len(pool)))
                h = f"p{j}"
                data = None if cache.is_cached(h) else pool[j]
                [f] = await cache.get_and_update_features([FeatureSpec(h, data)], wait_for_space=20)
                if not isinstance(f.data, ShmRef):
                    results.append(checksum(f.data["data"]) == pool[j]["crc"])
                    return
                async with lock:
                    for a in pipes:
                        a.send([(h, f.data.to_dict(), pool[j]["crc"])])
                    for a in pipes:
                        assert await anyio.to_thread.run_sync(a.poll, 60)
                        results.extend(a.recv())

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
            assert len(results) >= 200 and all(results)
        finally:
            for a in pipes:
                a.send(None)
            for p in procs:
                await anyio.to_thread.run_sync(p.join, 20)
                if p.is_alive():
                    p.kill()


async def test_wait_for_space_wakes_on_acknowledgement(make_config: Any) -> None:
    cfg = make_config(4 * MiB, MiB + 4096, 1)
    rng = np.random.default_rng(4)
    async with AsyncSenderCache.from_config(cfg) as cache:
        a, b = SPAWN.Pipe()
        p = SPAWN.Process(target=_procs.slow_acker, args=(cache.handle().to_dict(), b), daemon=True)
        p.start()
        try:
            assert await anyio.to_thread.run_sync(a.poll, 60)
            assert a.recv() == "ready"
            refs = []
            for i in range(3):  # full of unread items
                [f] = await cache.get_and_update_features(
                    [FeatureSpec(f"f{i}", random_item(rng, MiB))]
                )
                assert isinstance(f.data, ShmRef)
                refs.append(f.data.to_dict())
            [inline] = await cache.get_and_update_features(
                [FeatureSpec("x", random_item(rng, MiB))]
            )
            assert not isinstance(inline.data, ShmRef)  # wait_for_space=0: inline at once
            store = cache.sender.store
            wakeups0 = store.wakeups

            def ack_once_the_writer_waits() -> None:
                # the writer counts one wake-up each time it goes to sleep waiting for space
                if wait_until(lambda: store.wakeups > wakeups0, timeout=60):
                    a.send((0, refs))

            acker = threading.Thread(target=ack_once_the_writer_waits, daemon=True)
            acker.start()
            t0 = time.monotonic()
            [f] = await cache.get_and_update_features(
                [FeatureSpec("y", random_item(rng, MiB))], wait_for_space=60
            )
            elapsed = time.monotonic() - t0
            await anyio.to_thread.run_sync(acker.join, 60)
            # it waited, and the acknowledgement (sent only once it waited) made the room
            assert store.wakeups > wakeups0
            assert isinstance(f.data, ShmRef)
            assert await anyio.to_thread.run_sync(a.poll, 60)
            a.recv()  # the acker's "done"
            # woken by the readers' posts, not busy-polling: at most one sleep per poll interval
            # of the time it waited, plus one per post (a rate, whatever the machine's load)
            wakeups = store.wakeups - wakeups0
            assert wakeups <= elapsed / WAIT_POLL + len(refs) + 2, wakeups
        finally:
            a.send(None)
            await anyio.to_thread.run_sync(p.join, 10)
            if p.is_alive():
                p.kill()


class _Beat:
    ticks = 0


@contextlib.asynccontextmanager
async def _heartbeat() -> AsyncIterator[_Beat]:
    """A task that counts the event loop's turns (``beat.ticks``) while the block runs."""
    beat = _Beat()

    async def heartbeat() -> None:
        while True:
            await anyio.lowlevel.checkpoint()
            beat.ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        yield beat
        tg.cancel_scope.cancel()


@pytest.mark.slow
async def test_heartbeat_keeps_ticking_during_64mib_copies(make_config: Any) -> None:
    cfg = make_config(200 * MiB, 70 * MiB, 1)
    big = {"data": np.ones(64 * MiB, np.uint8)}
    async with (
        AsyncSenderCache.from_config(cfg) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        during: list[int] = []  # heartbeat turns while each call (one 64 MiB copy) ran
        async with _heartbeat() as beat:
            for i in range(4):
                before = beat.ticks
                [f] = await cache.get_and_update_features([FeatureSpec(f"b{i}", big)])
                during.append(beat.ticks - before)
                before = beat.ticks
                [back] = await rx.get_and_update_features([f])
                during.append(beat.ticks - before)
                assert back.data["data"].shape == (64 * MiB,)
        # Counted in loop turns, not milliseconds: a copy made on the loop lets the heartbeat
        # turn only at the call's few checkpoints; a copy in a thread leaves the loop free to
        # turn for as long as the copy takes, however slow a loaded machine makes it.
        assert sum(during) >= HEARTBEAT_TURNS, during


@pytest.mark.slow
async def test_a_big_bytes_value_is_read_without_holding_the_loop(make_config: Any) -> None:
    """Review: a reader's big ``bytes`` value was copied out of the chunk (in the worker
    thread) by ``memoryview.tobytes``, which holds the GIL for the whole copy: the event loop
    stood still as long (~50-100 ms for 64 MiB here; a handful of heartbeat turns per read,
    against thousands for an array of the same size). The core's ``bytes_of`` copies a big one
    with the GIL released, as arrays are copied. (The pure core copies under the GIL.)"""
    if aioshmcache.implementation() != "c":
        pytest.skip("the pure core's bytes_of copies under the GIL (no GIL-free bytes in Python)")
    async with (
        AsyncSenderCache.from_config(make_config(200 * MiB, 70 * MiB, 1)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        turns = {"array": 0, "bytes": 0}
        async with _heartbeat() as beat:
            for i in range(3):
                for kind, value in (
                    ("array", np.full(64 * MiB, i, np.uint8)),
                    ("bytes", bytes([i]) * (64 * MiB)),
                ):
                    item = {"x": value}
                    [f] = await cache.get_and_update_features([FeatureSpec(f"{kind}{i}", item)])
                    before = beat.ticks
                    [back] = await rx.get_and_update_features([f])
                    turns[kind] += beat.ticks - before
                    assert type(back.data["x"]) is type(value) and back.data["x"][-1] == i
        # in loop turns, not milliseconds (see the heartbeat test above): a copy in a thread
        # that lets go of the GIL leaves the loop turning for as long as the copy takes
        # (here: bytes 28-50k turns against arrays' 10-20k; under the GIL 3-6k against 12-79k)
        assert turns["bytes"] * 2 >= turns["array"], turns


async def test_lease_data_intact_under_eviction_pressure(make_config: Any) -> None:
    cfg = make_config(8 * MiB, 2 * MiB, 1)
    rng = np.random.default_rng(5)
    async with (
        AsyncSenderCache.from_config(cfg) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        for i in range(3):  # older items the pressure can evict
            [g] = await cache.get_and_update_features(
                [FeatureSpec(f"old{i}", random_item(rng, MiB))]
            )
            await rx.get_and_update_features([g])
        first = random_item(rng, MiB)
        [f] = await cache.get_and_update_features([FeatureSpec("leased", first)])

        async def pressure() -> None:
            for i in range(60):
                [g] = await cache.get_and_update_features(
                    [FeatureSpec(f"p{i}", random_item(rng, MiB))]
                )
                if isinstance(g.data, ShmRef):
                    await rx.get_and_update_features([g])

        async with rx.lease([f]) as leased:
            view = leased[0].data["data"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(pressure)
            assert checksum(view) == first["crc"]  # never reused while leased
            assert cache.is_cached("leased")
        snap = cache.sender.snapshot()
        # FIFO: everything older than the leased item was evicted; it then blocks the ring, so
        # newer puts are served inline rather than overwrite it
        assert snap.evictions >= 3 and snap.inline_full > 0


@pytest.mark.timeout(120)
def test_loop_shutdown_with_copies_in_flight_is_bounded(make_config: Any) -> None:
    """asyncio.run() waits for executor threads: ours finish (or abandon) quickly."""
    cfg = make_config(300 * MiB, 80 * MiB, 1)
    big = {"data": np.ones(64 * MiB, np.uint8)}

    async def main() -> None:
        cache = AsyncSenderCache.from_config(cfg)
        await cache.__aenter__()
        try:
            tasks = [
                asyncio.ensure_future(cache.get_and_update_features([FeatureSpec(f"b{i}", big)]))
                for i in range(3)
            ]
            await asyncio.sleep(0.005)
            for t in tasks:
                t.cancel()
        finally:
            await cache.aclose()

    # not hung (the test's timeout is the bound): aclose waited for the threads (each stops
    # after the copy it is in) and closed the segment
    asyncio.run(main())
    assert not os.path.exists(f"/dev/shm/aioshm-{cfg.name}")


async def test_a_stream_of_hits_does_not_starve_the_loop(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config()) as cache:
        await cache.get_and_update_item(({"a": 1}, ()), "h")
        calls = 25 * CHECKPOINT_EVERY
        ticks = await _turns_of_others(calls, _hits_of(cache))
        # at least one turn of the other tasks per CHECKPOINT_EVERY calls (the ticker starts
        # on the first one)
        assert ticks >= calls // CHECKPOINT_EVERY - 1


async def test_a_stream_of_one_spec_reads_does_not_starve_the_loop(make_config: Any) -> None:
    """A reader's one-spec reads by reference (one core call each when no yield is due) still
    let the other tasks run at least once per ``CHECKPOINT_EVERY`` reads."""
    async with (
        AsyncSenderCache.from_config(make_config()) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        await cache.get_and_update_item(({"a": np.arange(8)}, ()), "h")
        calls = 10 * CHECKPOINT_EVERY
        specs = [
            (await cache.get_and_update_features([FeatureSpec("h", None)]))[0] for _ in range(calls)
        ]

        async def read(i: int) -> None:
            [got] = await rx.get_and_update_features([specs[i]])
            assert got.data["a"].tolist() == list(range(8))

        assert await _turns_of_others(calls, read) >= calls // CHECKPOINT_EVERY - 1


async def test_the_one_item_hand_out_checks_as_the_request_does(make_config: Any) -> None:
    """The async sender's one-spec hand-out (its look-up checked inline, the face's state read
    without ``_wrapped``'s frame) refuses what the request refuses, and a face not open yet or
    closed says so, as every other call does."""
    face = AsyncSenderCache.from_config(make_config())
    with pytest.raises(ClosedCacheError, match="not open yet"):
        await face.get_and_update_features([FeatureSpec("h", None)])
    async with face as cache:
        item = {"a": np.arange(4)}
        [put] = await cache.get_and_update_features([FeatureSpec("h", item, identifier="i")])
        [got] = await cache.get_and_update_features([FeatureSpec("h", None, identifier="i")])
        assert isinstance(got.data, ShmRef) and got.identifier == "i" and got.mm_hash == "h"
        assert got.data.id == put.data.id
        with pytest.raises(TypeError, match="expected FeatureSpec"):
            await cache.get_and_update_features([("h", None)])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            await cache.get_and_update_features([FeatureSpec(7, None)])  # type: ignore[arg-type]
        with pytest.raises(CacheMissError):
            await cache.get_and_update_features([FeatureSpec("absent", None)])
    with pytest.raises(ClosedCacheError, match="closed"):
        await face.get_and_update_features([FeatureSpec("h", None)])


async def test_read_after_wait_reads_as_the_face_does_or_declines_doing_nothing(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_after_wait`` (an engine worker's read of a call it waited for) gives the spec the
    face's ``get_and_update_features`` gives, read, acknowledged and counted as a hit, with no
    turn noted; anything it does not take (two specs, an item over the face's threshold, a
    face of another kind; every read on the pure core) is ``None`` with nothing read. (Its
    errors are the face's one-spec read's: ``tests/test_parity.py``; closed, it raises
    ``ClosedCacheError`` as the face does.)"""
    dues: list[int] = []
    due = AsyncReceiverCache._due

    def counted_due(face: AsyncReceiverCache) -> bool:
        dues.append(1)
        return due(face)

    monkeypatch.setattr(AsyncReceiverCache, "_due", counted_due)
    async with (
        AsyncSenderCache.from_config(make_config()) as cache,
        AsyncReceiverCache.attach(cache.handle(), inline_threshold_bytes=4096) as rx,
    ):
        small, big = {"a": np.arange(8)}, {"a": np.arange(1024)}  # 64 and 8192 bytes
        await cache.get_and_update_features([FeatureSpec("s", small), FeatureSpec("b", big)])

        async def ref(h: str) -> FeatureSpec:
            return (await cache.get_and_update_features([FeatureSpec(h, None)]))[0]

        await rx.get_and_update_features([await ref("s")])  # the first read probes the writer
        assert dues == [1]  # the face asks whether its turn to yield is due
        hits = rx.make_stats().hits
        got = read_after_wait(rx, [await ref("s")])
        if aioshmcache.implementation() == "c":
            assert got is not None and got[0].data["a"].tolist() == list(range(8))
            hits += 1  # read and counted, no turn asked
        else:  # the pure core's read goes through the face: it declines this one too
            assert got is None
        assert rx.make_stats().hits == hits and dues == [1]
        assert read_after_wait(cache, [await ref("s")]) is None  # not a reader face
        declined = [[await ref("s"), await ref("s")], [await ref("b")]]
        for features in declined:
            assert read_after_wait(rx, features) is None
        assert rx.make_stats().hits == hits  # nothing read by the declines ...
        for features, sizes in zip(declined, ([8, 8], [1024]), strict=True):
            out = await rx.get_and_update_features(features)  # ... which the face then reads
            assert [len(f.data["a"]) for f in out] == sizes
        # owed and unread: the first put's two hand-outs, the reference given to ``cache``, and
        # with the pure core the one it declined
        assert cache.snapshot().readers[0].lag == (3 if aioshmcache.implementation() == "c" else 4)
        await rx.aclose()  # closed: it raises what the face's own call raises
        late = [await ref("s")]
        with pytest.raises(ClosedCacheError):
            read_after_wait(rx, late)
        with pytest.raises(ClosedCacheError):
            await rx.get_and_update_features(late)


async def _turns_of_others(calls: int, step: Callable[[int], Awaitable[None]]) -> int:
    """How often another task ran while this one awaited ``step(i)`` ``calls`` times in a row."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        for i in range(calls):
            await step(i)
        tg.cancel_scope.cancel()
    return ticks


def _hits_of(cache: AsyncSenderCache) -> Callable[[int], Awaitable[None]]:
    """A step of hits of "h" (no thread: every few calls must still yield)."""

    async def hit(_: int) -> None:
        await cache.get_and_update_item(None, "h")

    return hit


def _clock_of(monkeypatch: pytest.MonkeyPatch, step: float) -> list[float]:
    """The async faces' clock made to move ``step`` seconds per reading: ``[now, step]``, both
    for the test to change."""
    import aioshmcache.aio as aio_module

    state = [0.0, step]

    def clock() -> float:
        state[0] += state[1]
        return state[0]

    monkeypatch.setattr(aio_module, "_monotonic", clock)
    return state


def _yields_of(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """The faces' yields to the loop (``anyio.lowlevel.checkpoint``), one entry each."""
    yields: list[None] = []
    checkpoint = anyio.lowlevel.checkpoint

    async def counted() -> None:
        yields.append(None)
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)
    return yields


async def test_inline_calls_yield_once_half_a_millisecond_has_passed(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Besides every ``CHECKPOINT_EVERY`` calls, an inline call yields when 0.5 ms passed since
    the face last yielded (slow inline copies): with a clock that moves 1 ms per reading, every
    call yields. (Loop turns the channel counted before the face was made, as a channel test
    earlier in this thread leaves, are not a turn since its last call: its first calls yield
    too.)"""
    from aioshmcache._loop_turns import turned

    turned()
    _clock_of(monkeypatch, 0.001)
    # the request's path (``_due``): the core's one-item call declines every call, as it does
    # a call it does not take (it takes these hits, in one reading of the clock per call)
    monkeypatch.setattr(_request, "_put_item", _core_py.put_item)
    async with AsyncSenderCache.from_config(make_config()) as cache:
        await cache.get_and_update_item(({"a": 1}, ()), "h")
        calls = 2 * CHECKPOINT_EVERY
        assert await _turns_of_others(calls, _hits_of(cache)) >= calls - 1


async def test_a_loop_turn_between_inline_calls_starts_a_new_count(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline calls each followed by an await that lets the loop turn (a channel's answer) do
    not yield on their own: the turn gave the other tasks theirs, so the count and the half
    millisecond start again (with a clock moving 0.2 ms per reading, calls in a row without a
    turn yield every few calls, as the test above shows for 1 ms)."""
    _clock_of(monkeypatch, 0.0002)
    yields = _yields_of(monkeypatch)
    async with AsyncSenderCache.from_config(make_config()) as cache:
        await cache.get_and_update_item(({"a": 1}, ()), "h")
        await asyncio.sleep(0)
        yields.clear()
        for _ in range(4 * CHECKPOINT_EVERY):
            await cache.get_and_update_item(None, "h")
            await asyncio.sleep(0)  # the loop turns
        assert yields == []
        for _ in range(CHECKPOINT_EVERY):  # no turn between the calls: they yield
            await cache.get_and_update_item(None, "h")
        assert len(yields) >= CHECKPOINT_EVERY // 4


async def test_after_a_due_yield_sparse_calls_do_not_yield_at_every_call(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call preempted for a millisecond between its first step and its request (a loaded
    host) finds its turn due and yields; the calls after it, further apart than
    ``CHECKPOINT_AFTER`` (a server at a low rate: the loop waits between them), start a new
    count each, since the due yield notes its turn. It did not: from such a yield on, every
    sparse call was due again and paid a loop round and the request path."""
    clock = _clock_of(monkeypatch, 0.0)
    yields = _yields_of(monkeypatch)
    # a call whose first step declines (the core's one-item call, made to decline every call
    # as it does a call it does not take: it takes these hits) goes on to its request
    monkeypatch.setattr(_request, "_put_item", _core_py.put_item)
    async with AsyncSenderCache.from_config(make_config()) as cache:
        await cache.get_and_update_item(({"a": 1}, ()), "h")
        await asyncio.sleep(0)
        clock[1] = 0.001  # each reading of the clock a millisecond later: preempted
        await cache.get_and_update_item(None, "h")
        clock[1] = 0.0
        assert len(yields) == 1
        for _ in range(2 * CHECKPOINT_EVERY):
            await asyncio.sleep(0)  # the loop turns between the calls ...
            clock[0] += 0.001  # ... and they come 1 ms apart
            await cache.get_and_update_item(None, "h")
        assert len(yields) == 1


def _callbacks_of(monkeypatch: pytest.MonkeyPatch, owner: object) -> list[object]:
    """The callbacks the running loop is asked to queue (``call_soon``) that are ``owner``'s
    bound methods (an async face's way to learn that the loop turned)."""
    loop = asyncio.get_running_loop()
    queued: list[object] = []
    real = loop.call_soon

    def call_soon(callback: Any, *args: Any, **kw: Any) -> asyncio.Handle:
        if getattr(callback, "__self__", None) is owner:
            queued.append(callback)
        return real(callback, *args, **kw)

    monkeypatch.setattr(loop, "call_soon", call_soon)
    return queued


async def test_a_turn_the_channel_witnessed_restarts_the_count_with_nothing_queued(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline calls between which the package's I/O callbacks ran (``_loop_turns.turned``, which
    an engine channel's ``data_received`` counts: here counted by hand, with no other turn)
    start a new count each, as a turn the face learnt of itself does, and queue nothing on
    the loop to learn of the next turn. The call after one that relied on the count (no other
    witness of a turn since) does not apply the time bound; it queues its witness, and the
    call after it does apply it (with a clock moving 0.4 ms per reading)."""
    from aioshmcache._loop_turns import turned

    clock = _clock_of(monkeypatch, 0.0004)
    yields = _yields_of(monkeypatch)
    async with AsyncSenderCache.from_config(make_config()) as cache:
        await cache.get_and_update_item(({"a": 1}, ()), "h")
        await asyncio.sleep(0)
        queued = _callbacks_of(monkeypatch, cache)
        yields.clear()
        for _ in range(4 * CHECKPOINT_EVERY):
            turned()  # an answer came: the loop turned
            await cache.get_and_update_item(None, "h")
        assert yields == [] and queued == []
        turned()
        await cache.get_and_update_item(None, "h")
        clock[0] += 0.001  # no turn witnessed since, 1 ms later: not the time bound's call yet
        await cache.get_and_update_item(None, "h")
        assert yields == [] and len(queued) == 1  # ... but it watches for the next turn
        await cache.get_and_update_item(None, "h")  # no turn since, 1.4 ms: it yields
        assert len(yields) == 1


@pytest.mark.parametrize("impl", ["c", "python"])
def test_each_thread_counts_its_own_loop_turns(impl: str) -> None:
    """A turn witnessed in another thread (another loop) says nothing of this thread's, in
    either core."""
    if impl == "c" and aioshmcache.implementation() != "c":
        pytest.skip("the compiled core is not in use")
    core = _core_py if impl == "python" else _core_api.core
    before = core.loop_turns()
    core.loop_turned()
    assert core.loop_turns() == before + 1
    seen: list[int] = []

    def other() -> None:
        seen.append(core.loop_turns())
        for _ in range(5):
            core.loop_turned()
        seen.append(core.loop_turns())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [0, 5] and core.loop_turns() == before + 1


async def test_async_rejected_request_owes_nothing(make_config: Any) -> None:
    async with (
        AsyncSenderCache.from_config(make_config()) as tx,
        AsyncReceiverCache.attach(tx.handle()) as rx,
    ):
        [f] = await tx.get_and_update_features([FeatureSpec("a", {"a": np.ones(10)})])
        with pytest.raises(TypeError):
            await rx.get_and_update_features([f, "junk"])  # type: ignore[list-item]
        assert tx.is_freeable("a")


async def test_a_failing_item_aborts_the_request_s_allocations(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config(8 * MiB, 2 * MiB, 1)) as tx:
        with pytest.raises(SerdeError):
            await tx.get_and_update_features(
                [FeatureSpec("a", {"x": np.ones(100)}), FeatureSpec("b", {"x": {1, 2}})]
            )
        store = tx.sender.store
        assert not store._pending and not store.is_pending("a")
        store.evict(0)
        assert store.ring.n_chunks == 0  # nothing left in WRITING state at the head
        [f] = await tx.get_and_update_features([FeatureSpec("a", {"x": np.ones(100)})])
        assert isinstance(f.data, ShmRef)


async def test_a_failing_big_copy_aborts_the_rest(make_config: Any) -> None:
    from aioshmcache import MsgpackSerde

    class FailingSerde(MsgpackSerde):
        calls = 0

        def write(self, plan: Any, buf: memoryview) -> None:
            FailingSerde.calls += 1
            if FailingSerde.calls == 1:
                raise SerdeError("injected")
            super().write(plan, buf)

    sender = SenderCache(make_config(16 * MiB, 4 * MiB, 1), serde=FailingSerde())
    try:
        async with AsyncSenderCache(sender, inline_threshold_bytes=1) as tx:
            big = [FeatureSpec(k, {"x": np.ones(MiB, np.uint8)}) for k in "ab"]
            with pytest.raises(SerdeError):
                await tx.get_and_update_features(big)
            assert not sender.store._pending
            sender.store.evict(0)
            assert sender.store.ring.n_chunks == 0
    finally:
        sender.close()


async def test_a_job_cancelled_before_its_thread_started_does_not_hold_aclose(
    make_config: Any,
) -> None:
    """Review: a job withdrawn while waiting for the thread limiter stayed counted in flight."""
    cache = AsyncSenderCache.from_config(
        make_config(64 * MiB, 32 * MiB, 1), max_threads=1, inline_threshold_bytes=MiB
    )
    await cache.__aenter__()
    try:
        a = asyncio.ensure_future(
            cache.get_and_update_features([FeatureSpec("a", {"x": np.ones(24 * MiB, np.uint8)})])
        )
        b = asyncio.ensure_future(
            cache.get_and_update_features([FeatureSpec("b", {"x": np.ones(24 * MiB, np.uint8)})])
        )
        # "a" holds the only thread; "b" waits for the limiter
        await _until(lambda: cache._inflight.count >= 2 or a.done())
        b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b
        await a
        assert await anyio.to_thread.run_sync(cache._inflight.idle.wait, 30)
    finally:
        await cache.aclose()


async def test_aclose_wakes_a_job_waiting_for_space_and_waits_for_it(make_config: Any) -> None:
    """A request waiting for space in a worker thread when its owned cache closes: the close
    wakes it (it ends with ``ClosedCacheError``) and ``aclose`` returns once the job is done.
    A review's ``aclose`` waited ``CLOSE_TIMEOUT`` for the job first, then closed under it."""
    from aioshmcache import ClosedCacheError

    cache = AsyncSenderCache.from_config(
        make_config(4 * MiB, 2 * MiB, 1), inline_threshold_bytes=MiB
    )
    await cache.__aenter__()
    rx = ReceiverCache.attach(cache.handle())
    try:
        for k in range(3):  # owed to the reader, never read: no room without it
            await cache.get_and_update_features(
                [FeatureSpec(f"f{k}", {"x": np.ones(MiB, np.uint8)})]
            )
        big = {"x": np.ones(MiB + 500_000, np.uint8)}
        task = asyncio.ensure_future(
            cache.get_and_update_features([FeatureSpec("big", big)], wait_for_space=60)
        )
        store = cache.sender.store
        await _until(lambda: store.wakeups > 0)  # it waits for space in its thread
        await cache.aclose()
        assert cache._inflight.idle.is_set()  # the job ended before aclose returned
        with pytest.raises(ClosedCacheError):
            await task
    finally:
        rx.close()
        await cache.aclose()


async def test_stop_waits_fails_a_waiting_request_and_later_waits_but_not_puts_that_fit(
    make_config: Any,
) -> None:
    """``stop_waits`` (both faces): the request waiting for space ends with ``ClosedCacheError``
    at once, a later one that would wait too; a put that fits still goes in."""
    from aioshmcache import ClosedCacheError

    async with AsyncSenderCache.from_config(
        make_config(4 * MiB, 2 * MiB, 1), inline_threshold_bytes=MiB
    ) as cache:
        rx = ReceiverCache.attach(cache.handle())
        try:
            for k in range(3):
                await cache.get_and_update_features(
                    [FeatureSpec(f"f{k}", {"x": np.ones(MiB, np.uint8)})]
                )
            big = [FeatureSpec("big", {"x": np.ones(MiB + 500_000, np.uint8)})]
            task = asyncio.ensure_future(cache.get_and_update_features(big, wait_for_space=60))
            store = cache.sender.store
            await _until(lambda: store.wakeups > 0)
            await cache.stop_waits()
            with pytest.raises(ClosedCacheError):
                await task
            with pytest.raises(ClosedCacheError):
                cache.sender.get_and_update_item(
                    ({"x": np.ones(MiB + 500_000, np.uint8)}, ()), "b2", wait_for_space=60
                )
            [small] = await cache.get_and_update_features([FeatureSpec("s", {"x": np.ones(8)})])
            assert isinstance(small.data, ShmRef)
        finally:
            rx.close()


@pytest.mark.parametrize("delay_ms", [0, 1, 3, 8])
async def test_aclose_lets_the_copies_in_progress_finish(make_config: Any, delay_ms: int) -> None:
    """``aclose`` of an owned sender while its requests copy big items in worker threads: each
    request gets its references or a typed error, never a released buffer's ``ValueError``
    (a first version of the fix above closed the store before waiting for the jobs, and a
    job that had not started its copy yet indexed the released ring)."""
    from aioshmcache import ShmCacheError

    cache = AsyncSenderCache.from_config(
        make_config(512 * MiB, 64 * MiB, 1), inline_threshold_bytes=256 * 1024
    )
    await cache.__aenter__()
    try:
        items = [FeatureSpec(f"i{k}", {"x": np.full(48 * MiB, k, np.uint8)}) for k in range(4)]
        task = asyncio.ensure_future(cache.get_and_update_features(items))
        await asyncio.sleep(delay_ms / 1000)
        await cache.aclose()
        try:
            out = await task
        except ShmCacheError:
            pass  # closed before it was done: typed
        else:
            assert all(isinstance(f.data, ShmRef) for f in out)
    finally:
        await cache.aclose()


async def test_aclose_of_an_owned_receiver_lets_reads_in_progress_finish(make_config: Any) -> None:
    """An owned receiver's ``aclose`` waits for the reads in its worker threads before it frees
    its slot: they give their items (a first version of the fix above cut them off)."""
    async with AsyncSenderCache.from_config(
        make_config(256 * MiB, 64 * MiB, 1), inline_threshold_bytes=256 * 1024
    ) as tx:
        refs = await tx.get_and_update_features(
            [FeatureSpec(f"r{k}", {"x": np.full(32 * MiB, k, np.uint8)}) for k in range(4)]
        )
        rx = AsyncReceiverCache.attach(tx.handle())
        await rx.__aenter__()
        task = asyncio.ensure_future(rx.get_and_update_features(refs))
        await _until(lambda: rx._inflight.count > 0 or task.done())
        await rx.aclose()
        got = await task
        assert [int(f.data["x"][-1]) for f in got] == [0, 1, 2, 3]


async def test_an_abandoned_request_stops_waiting_for_space(make_config: Any) -> None:
    """Review: a cancelled request went on waiting, then evicted and copied for nobody."""
    async with AsyncSenderCache.from_config(
        make_config(4 * MiB, 2 * MiB, 1), inline_threshold_bytes=MiB
    ) as cache:
        rx = ReceiverCache.attach(cache.handle())
        try:
            owed = []
            for k in range(3):
                owed += await cache.get_and_update_features(
                    [FeatureSpec(f"f{k}", {"x": np.ones(MiB, np.uint8)})]
                )
            big = {"x": np.ones(MiB + 500_000, np.uint8)}
            store = cache.sender.store
            task = asyncio.ensure_future(
                cache.get_and_update_features([FeatureSpec("big", big)], wait_for_space=30)
            )
            await _until(lambda: store.wakeups > 0)  # it waits for space in its thread
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            rx.get_and_update_features(owed)  # room now: nobody must use it for "big"
            assert await anyio.to_thread.run_sync(cache._inflight.idle.wait, 30)
            assert "big" not in cache.cached_order()
            assert cache.snapshot().evictions == 0
        finally:
            rx.close()


@pytest.mark.parametrize("how", ["features", "item", "group"])
async def test_a_read_cancelled_at_its_turn_to_yield_gives_its_references_back(
    make_config: Any, shm_name: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Review: a read whose face yielded to the loop first (its turn was due) and was cancelled
    there never began, and gave nothing back: its references stayed owed, and the writer could
    not free their chunks (until ``handout_ttl`` and a later acknowledgement). A read cancelled
    in its worker thread gave them back; now one cancelled before it began does too."""
    from aioshmcache._loop_turns import turned

    from . import _group_procs as gp

    turned()
    _clock_of(monkeypatch, 0.001)  # every inline call's turn to yield is due
    group = shm_name + "g"
    cfg = gp.config(group) if how == "group" else make_config(8 * MiB, 2 * MiB, 1)
    async with (
        AsyncSenderCache.from_config(cfg) as cache,
        (
            AsyncReceiverCache.attach_group(group)
            if how == "group"
            else AsyncReceiverCache.attach(cache.handle())
        ) as rx,
    ):
        [f] = await cache.get_and_update_features([FeatureSpec("h", gp.make_item("h"))])
        assert not cache.is_freeable("h")  # owed by the reader
        task = asyncio.ensure_future(
            rx.get_and_update_item(f.data, "h")
            if how == "item"
            else rx.get_and_update_features([f])
        )
        await asyncio.sleep(0)  # it runs up to its yield
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # at the yield: nothing read
            await task
        cache.sender.store.drain()
        assert cache.is_freeable("h")  # given back: nothing owed
        [g] = await cache.get_and_update_features([FeatureSpec("h", None)])
        [back] = await rx.get_and_update_features([g])  # and the reader goes on
        assert np.array_equal(back.data["x"], gp.make_item("h")["x"])


async def test_a_cancelled_leader_s_finished_make_is_kept_for_the_waiter(
    make_config: Any,
) -> None:
    """Review: with one waiter, a cancelled leader's result was dropped and made again."""
    async with AsyncSenderCache.from_config(
        make_config(64 * MiB, 40 * MiB, 1), inline_threshold_bytes=MiB
    ) as cache:
        calls = 0
        gate = anyio.Event()

        async def make() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            await gate.wait()
            return {"x": np.ones(32 * MiB, np.uint8)}

        lead = asyncio.ensure_future(cache.get_or_put("h", make))
        await _until(lambda: calls == 1)  # the leader runs make
        waiter = asyncio.ensure_future(cache.get_or_put("h", make))
        await _until(lambda: cache._flight.waiters("h") == 1)
        gate.set()
        while calls == 0 or (not lead.done() and cache.sender.store.is_pending("h") is False):
            await asyncio.sleep(0)
            if lead.done():
                break
        lead.cancel()  # while its 32 MiB copy runs in a thread (or, if too late, done)
        with contextlib.suppress(asyncio.CancelledError):
            await lead
        out = await waiter
        assert out.mm_hash == "h" and calls == 1


@pytest.mark.parametrize("updates", [(), ["u"]])
async def test_async_one_item_misses_take_the_one_item_path(
    make_config: Any, monkeypatch: pytest.MonkeyPatch, updates: Any
) -> None:
    """The awaitable one-item miss, and a list or a features call of one item to put, answer as
    the request does; on the compiled core they make no request (the core's one-item miss runs
    on the loop), on the pure core the request answers the same. A hit takes it too."""
    import aioshmcache.aio

    made = count_sender_requests(monkeypatch)
    # no turn to yield falls due in these few calls, however slow the machine (a due turn
    # sends a call through the request, which takes it)
    monkeypatch.setattr(aioshmcache.aio, "CHECKPOINT_AFTER", 1e9)
    x = {"x": np.arange(1024, dtype=np.uint8)}
    async with AsyncSenderCache.from_config(make_config(4 << 20, 1 << 20, 1)) as tx:
        ref1, got1 = await tx.get_and_update_item((x, updates), "a")
        [(ref2, got2)] = await tx.get_and_update([(x, updates)], ["b"])
        [spec] = await tx.get_and_update_features(
            [FeatureSpec("c", x, prompt_updates=tuple(updates))]
        )
        assert got1 is updates and got2 is updates and spec.prompt_updates == tuple(updates)
        assert tx.is_cached(["a", "b", "c"]) == [True, True, True]
        assert made == [] if aioshmcache.implementation() == "c" else len(made) == 3
        ref3, got3 = await tx.get_and_update_item((x, updates), "a")  # a hit: the core's too
        assert got3 is updates
        assert made == [] if aioshmcache.implementation() == "c" else len(made) == 4
        [(ref4, got4)] = await tx.get_and_update([(x, updates)], ["b"])  # a hit, as a list
        assert got4 is updates and ref4.id == ref2.id and ref4.seq != ref2.seq
        for r in (ref1, ref2, spec.data, ref3, ref4):
            assert isinstance(r, ShmRef)
            await tx.release(r)
