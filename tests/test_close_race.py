"""Closing a reader while other threads read from it: typed errors only (issue 19, item 3).

A reader (or a group reader's rescan, which closes the shard of a writer that went away) may be
closed by one thread while others are in the middle of a read. Those reads must end with a
typed error of ``aioshmcache.errors`` or a correct item: never a released buffer's
``ValueError``, nor an ``OSError`` from a liveness probe on a closed (or reused) descriptor.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    CacheConfig,
    ClosedCacheError,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
    ShmCacheError,
    ShmObjectStore,
    ShmRef,
)
from aioshmcache._read_path import ReadPath

from .conftest import RUN_PREFIX, SHM

ROUNDS = 8
THREADS = 3


class ParkingClock:
    """Stands in for ``time`` in ``_read_path``: the first clock read of the thread named
    ``parked-reader`` (armed) parks until the reader is closed under it.

    The read path reads the clock after its ``closed`` checks and before it touches the
    reader slot and the mapping, so this makes "closed during a read" deterministic.
    """

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.parked = threading.Event()
        self.closed: Callable[[], bool] = lambda: False

    def monotonic(self) -> float:
        if self.armed.is_set() and threading.current_thread().name == "parked-reader":
            self.armed.clear()
            self.parked.set()
            deadline = time.monotonic() + 10
            while not self.closed() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.1)  # let the closer go as far as it will
        return time.monotonic()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ParkingClock:
    from aioshmcache import _read_path

    c = ParkingClock()
    monkeypatch.setattr(_read_path, "time", c)
    return c


def _park_and_close(clock: ParkingClock, read: Callable[[], Any], close: Callable[[], None]) -> Any:
    """Run ``read`` in a thread, park it inside the read path, close meanwhile; its outcome."""
    outcome: list[Any] = []

    def reader() -> None:
        try:
            outcome.append(read())
        except BaseException as exc:  # the outcome is what the test checks
            outcome.append(exc)

    clock.armed.set()
    th = threading.Thread(target=reader, name="parked-reader")
    th.start()
    assert clock.parked.wait(30)
    closer = threading.Thread(target=close)
    closer.start()
    th.join(30)
    closer.join(30)
    assert not th.is_alive() and not closer.is_alive()
    return outcome[0]


def _item(i: int) -> dict[str, Any]:
    return {"x": np.full(2048 + 64 * i, i, dtype=np.int32)}


def _check(item: Any, i: int) -> None:
    if not (isinstance(item, dict) and np.array_equal(item["x"], _item(i)["x"])):
        raise AssertionError(f"wrong bytes for item {i}")


def _race(
    read: Callable[[int], Any], close: Callable[[], None], n_items: int
) -> tuple[list[BaseException], int]:
    """Threads read items ``0 .. n_items-1`` over and over until the cache is closed under them.

    Returns the untyped errors they met and how many reads succeeded.
    """
    untyped: list[BaseException] = []
    ok = [0]
    started = threading.Barrier(THREADS + 1)
    stop = threading.Event()

    def reader(t: int) -> None:
        started.wait(30)
        i = t
        while not stop.is_set():
            try:
                _check(read(i % n_items), i % n_items)
                ok[0] += 1
            except ShmCacheError:
                pass  # typed: closed, writer gone, stale...
            except BaseException as exc:  # what the test is looking for
                untyped.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    started.wait(30)
    # let every thread be inside a read, then close under them
    deadline_reads = ok[0] + 3 * THREADS
    for _ in range(200_000):
        if ok[0] >= deadline_reads or untyped:
            break
    close()
    for _ in range(50):  # reads after the close: typed errors too
        if untyped:
            break
        threading.Event().wait(0.001)
    stop.set()
    for th in threads:
        th.join(30)
        assert not th.is_alive()
    return untyped, ok[0]


@pytest.mark.parametrize("how", ["item", "features"])
def test_a_reader_closed_during_a_read_gives_the_item_or_a_typed_error(
    how: str, clock: ParkingClock
) -> None:
    name = f"{RUN_PREFIX}cr{uuid.uuid4().hex[:8]}"
    with SenderCache(CacheConfig(8 << 20, 1 << 20, 2, name=name)) as tx:
        rx = ReceiverCache.attach(tx.handle())
        clock.closed = lambda: rx.closed
        ref = tx.get_and_update_item((_item(3), []), "h3")[0]

        def read() -> Any:
            if how == "item":
                return rx.get_and_update_item(ref, "h3")
            return rx.get_and_update_features([FeatureSpec("h3", ref)])[0].data

        out = _park_and_close(clock, read, rx.close)
        if isinstance(out, BaseException):
            assert isinstance(out, ShmCacheError), repr(out)
        else:
            _check(out, 3)
        assert rx.closed and rx.store.closed


def test_a_writer_probe_during_a_close_never_uses_a_closed_descriptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The liveness probe of a read in flight runs on the descriptor it was given, open."""
    from aioshmcache import _segment

    name = f"{RUN_PREFIX}cr{uuid.uuid4().hex[:8]}"
    with SenderCache(CacheConfig(8 << 20, 1 << 20, 2, name=name)) as tx:
        rx = ReceiverCache.attach(tx.handle())
        ref = tx.get_and_update_item((_item(1), []), "h1")[0]
        real_probe = _segment.ofd_probe
        parked = threading.Event()

        def parking_probe(fd: int, byte: int) -> bool:
            if threading.current_thread().name == "probing-reader" and not parked.is_set():
                parked.set()
                deadline = time.monotonic() + 10
                while not rx.closed and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.1)  # let the closer go as far as it will
            return real_probe(fd, byte)

        monkeypatch.setattr(_segment, "ofd_probe", parking_probe)
        rx.store.read_path._last_writer_probe = 0.0  # the next read probes the writer
        outcome: list[Any] = []

        def reader() -> None:
            try:
                outcome.append(rx.get_and_update_item(ref, "h1"))
            except BaseException as exc:  # the outcome is what the test checks
                outcome.append(exc)

        th = threading.Thread(target=reader, name="probing-reader")
        th.start()
        assert parked.wait(30)
        rx.close()
        th.join(30)
        [out] = outcome
        if isinstance(out, BaseException):
            assert isinstance(out, ShmCacheError), repr(out)
        else:
            _check(out, 1)


@pytest.mark.parametrize("how", ["rescan", "close"])
def test_a_group_shard_detached_during_a_read_gives_the_item_or_a_typed_error(
    clock: ParkingClock, how: str
) -> None:
    """The shard closed under a read by a rescan (its writer went away) or by the group
    reader's own ``close``."""
    group = f"{RUN_PREFIX}gcr{uuid.uuid4().hex[:8]}"
    cfg = CacheConfig(8 << 20, 1 << 20, 2, group=group)
    with SenderCache(cfg) as keep, ReceiverCache.attach_group(group) as rx:
        tx = SenderCache(cfg)
        try:
            rx.rescan()
            ref = tx.get_and_update_item((_item(2), []), "h2")[0]
            assert keep.shard != tx.shard
            store = rx._shards.store(ref.nonce)
            assert store is not None
            clock.closed = lambda: store.read_path.closed

            def writer_goes_then_rescan() -> None:
                tx.close()  # its references now raise WriterGoneError...
                rx.rescan()  # ...and the rescan detaches (closes) its shard

            out = _park_and_close(
                clock,
                lambda: rx.get_and_update_item(ref, "h2"),
                writer_goes_then_rescan if how == "rescan" else rx.close,
            )
        finally:
            tx.close()
        if isinstance(out, BaseException):
            assert isinstance(out, ShmCacheError), repr(out)
        else:
            _check(out, 2)
        assert store.closed


@pytest.mark.slow
def test_closing_a_reader_during_reads_gives_typed_errors_only() -> None:
    name = f"{RUN_PREFIX}cr{uuid.uuid4().hex[:8]}"
    untyped: list[BaseException] = []
    with SenderCache(CacheConfig(8 << 20, 1 << 20, 2, name=name)) as tx:
        refs = [tx.get_and_update_item((_item(i), []), f"h{i}")[0] for i in range(8)]
        for rnd in range(ROUNDS):
            rx = ReceiverCache.attach(tx.handle())
            for i in range(8):  # every hand-out is owed by this reader now
                refs[i] = tx.get_and_update_item(None, f"h{i}")[0]

            if rnd % 2:

                def read(i: int, rx: ReceiverCache = rx) -> Any:
                    return rx.get_and_update_item(refs[i], f"h{i}")
            else:

                def read(i: int, rx: ReceiverCache = rx) -> Any:
                    [f] = rx.get_and_update_features([FeatureSpec(f"h{i}", refs[i])])
                    return f.data

            got, _n = _race(read, rx.close, 8)
            untyped += got
            assert rx.closed
            with pytest.raises(ClosedCacheError):
                rx.get_and_update_item(refs[0], "h0")
            if untyped:
                break
    assert not untyped, f"untyped errors: {untyped[:3]!r}"


@pytest.mark.slow
def test_a_group_rescan_closing_a_shard_during_reads_gives_typed_errors_only() -> None:
    untyped: list[BaseException] = []
    for _rnd in range(ROUNDS // 2):
        group = f"{RUN_PREFIX}gcr{uuid.uuid4().hex[:8]}"
        cfg = CacheConfig(8 << 20, 1 << 20, 2, group=group)
        with SenderCache(cfg) as keep, ReceiverCache.attach_group(group) as rx:
            tx = SenderCache(cfg)
            try:
                rx.rescan()
                refs = [tx.get_and_update_item((_item(i), []), f"h{i}")[0] for i in range(8)]
                del keep  # the other shard keeps the group alive; not read here

                def read(i: int, refs: list[ShmRef] = refs) -> Any:
                    return rx.get_and_update_item(refs[i], f"h{i}")

                def writer_goes_then_rescan(tx: SenderCache = tx) -> None:
                    tx.close()  # its references now raise WriterGoneError...
                    rx.rescan()  # ...and the rescan detaches (closes) its shard

                got, _n = _race(read, writer_goes_then_rescan, 8)
                untyped += got
            finally:
                tx.close()
        if untyped:
            break
    assert not untyped, f"untyped errors: {untyped[:3]!r}"


def test_a_close_waits_for_a_read_in_flight_in_another_thread() -> None:
    """The mechanism: while a read is in flight, nothing it uses is released under it."""
    name = f"{RUN_PREFIX}cr{uuid.uuid4().hex[:8]}"
    with SenderCache(CacheConfig(8 << 20, 1 << 20, 2, name=name)) as tx:
        ref = tx.get_and_update_item((_item(0), []), "h0")[0]
        rx = ReceiverCache.attach(tx.handle())
        reading: ReadPath = rx.store.read_path
        entered, closing = threading.Event(), threading.Event()
        seen: list[bool] = []

        def read_in_flight() -> None:
            with reading.in_use():
                entered.set()
                closing.wait(30)
                threading.Event().wait(0.2)  # give the close every chance to release early
                seen.append(rx.store.closed)  # still open: the read holds it

        th = threading.Thread(target=read_in_flight)
        th.start()
        assert entered.wait(30)
        closing.set()
        rx.close()
        th.join(30)
        assert seen == [False]
        assert rx.closed and rx.store.closed  # released once the read ended
        with pytest.raises(ClosedCacheError):
            rx.get_and_update_item(ShmRef(*ref), "h0")  # no read starts after a close


def test_a_close_that_cannot_wait_leaves_the_release_to_the_last_read() -> None:
    name = f"{RUN_PREFIX}cr{uuid.uuid4().hex[:8]}"
    with SenderCache(CacheConfig(8 << 20, 1 << 20, 2, name=name)) as tx:
        ref = tx.get_and_update_item((_item(0), []), "h0")[0]
        rx = ReceiverCache.attach(tx.handle())
        reading: ReadPath = rx.store.read_path
        with reading.in_use():  # a read in flight (this thread)
            assert reading.close_when_idle(rx.store.close, wait=0.0) is False
            assert rx.closed and not rx.store.closed  # mapping and slot kept for the read
            assert [r.attached for r in tx.snapshot().readers].count(True) == 1
            with pytest.raises(ClosedCacheError):
                rx.get_and_update_item(ShmRef(*ref), "h0")  # no read starts after a close
        assert rx.store.closed  # the last read out released everything
        assert [r.attached for r in tx.snapshot().readers].count(True) == 0


def test_a_group_reader_closed_while_it_looks_for_a_new_shard_is_closed_not_forged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reference of a shard the reader has not adopted yet makes the read rescan; a close
    from another thread right after drops what the rescan adopted, and the look-up is skipped.
    The read must say the reader is closed, not that a genuine reference is forged (the group
    stress run at seed 1543538767: a reader closing itself during reads got
    ``InvalidReferenceError``)."""
    group = f"{RUN_PREFIX}gcl{uuid.uuid4().hex[:8]}"
    cfg = CacheConfig(8 << 20, 1 << 20, 2, group=group)
    # one shard the reader attached, and one it has not seen yet
    with SenderCache(cfg), ReceiverCache.attach_group(group) as rx, SenderCache(cfg) as second:
        ref = second.get_and_update_item((_item(0), []), "h0")[0]
        shards = rx._shards
        rescan = shards.rescan

        def rescan_then_close(**kw: Any) -> None:
            rescan(**kw)  # adopts the new shard...
            rx.close()  # ...and another thread's close drops it before the look-up

        monkeypatch.setattr(shards, "rescan", rescan_then_close)
        with pytest.raises(ClosedCacheError):
            rx.get_and_update_item(ref, "h0")


def test_a_writer_closed_during_a_put_in_another_thread_closes_whole() -> None:
    """A review closed a store while another thread's big put copied without the GIL: the
    close raised ``BufferError`` half-way (the ring's views were exported for the copy), left
    the segment linked and readers reading, and the put failed with an untyped error. The
    close now takes the writer lock: it waits for the put that holds it, then closes whole."""
    import os

    name = f"{RUN_PREFIX}wclose-{uuid.uuid4().hex[:8]}"
    store = ShmObjectStore.create(CacheConfig(96 << 20, 80 << 20, 1, name=name, prefault=False))
    try:
        ref0 = store.put("k0", {"x": np.arange(10)})
        big = np.ones(64 << 20, np.uint8)
        holding, release = threading.Event(), threading.Event()
        out: dict[str, Any] = {}

        def put() -> None:
            with store.lock:  # the put's own step, held from before the close starts
                holding.set()
                release.wait(60)
                try:
                    out["ref"] = store.put("big", {"a": big})
                except BaseException as exc:
                    out["put"] = exc

        def close() -> None:
            try:
                store.close()
                out["closed"] = True
            except BaseException as exc:
                out["close"] = exc

        putter = threading.Thread(target=put)
        putter.start()
        assert holding.wait(60)
        closer = threading.Thread(target=close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive() and "closed" not in out  # waits for the writer lock
        release.set()
        putter.join(60)
        closer.join(60)
        assert out.get("closed") is True, out
        assert isinstance(out.get("ref"), ShmRef), out  # the put ended before the close
        assert name not in os.listdir(SHM)
        with pytest.raises(ShmCacheError):
            store.get(ref0)
    finally:
        store.close()


@pytest.mark.parametrize("entry", ["put", "request"])
def test_a_writer_closed_before_a_copy_outside_the_lock_gives_closed_cache_error(
    entry: str,
) -> None:
    """A big put that may wait for space (``put(..., wait_for_space=)``, a sender request's copy
    job) copies outside the writer lock, so a close in another thread does not wait for it. A
    review closed the store between the reservation and the copy: the copy took its view of a
    released ring and the put raised the memoryview's ``ValueError``. It now raises
    ``ClosedCacheError``, and the close is whole."""
    import os
    import sys

    name = f"{RUN_PREFIX}wcopy-{uuid.uuid4().hex[:8]}"
    cache = SenderCache(CacheConfig(8 << 20, 4 << 20, 1, name=name, prefault=False))
    big = {"a": np.ones(2 << 20, np.uint8)}  # over the 1 MiB copied under the lock

    def close_at_the_copy(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "write_reserved":
            sys.setprofile(None)
            closer = threading.Thread(target=cache.close)  # another thread's close, whole
            closer.start()
            closer.join(60)

    try:
        sys.setprofile(close_at_the_copy)
        with pytest.raises(ClosedCacheError):
            if entry == "put":
                cache.store.put("big", big, wait_for_space=0.5)
            else:
                cache.get_and_update_item((big, ()), "big", wait_for_space=0.0)
        sys.setprofile(None)
        assert cache.closed
        assert name not in os.listdir(SHM)
    finally:
        sys.setprofile(None)
        cache.close()


def test_a_group_shard_closed_before_a_sibling_copy_gives_closed_cache_error() -> None:
    """As above, for a copy from a sibling shard (the item is passed as None: only a sibling
    holds it). The request turned every error of a sibling's copy into a miss, so the close of
    its own store, found by the copy, read as ``CacheMissError`` (the caller would preprocess
    and send the item for a cache that is gone). It is ``ClosedCacheError``, as for a put."""
    import sys

    group = f"{RUN_PREFIX}gsib{uuid.uuid4().hex[:8]}"
    cfg = CacheConfig(8 << 20, 4 << 20, 1, group=group, prefault=False)
    big = {"a": np.ones(2 << 20, np.uint8)}  # over the 1 MiB copied under the lock
    with SenderCache(cfg) as a, SenderCache(cfg) as b:
        a.get_and_update_item((big, ()), "big")

        def close_at_the_copy(frame: Any, event: str, arg: object) -> None:
            if event == "call" and frame.f_code.co_name == "write_reserved":
                sys.setprofile(None)
                closer = threading.Thread(target=b.close)
                closer.start()
                closer.join(60)

        try:
            sys.setprofile(close_at_the_copy)
            with pytest.raises(ClosedCacheError):
                b.get_and_update_item(None, "big")
        finally:
            sys.setprofile(None)
        assert b.closed


def test_a_closed_cache_s_handle_is_kept_and_its_epoch_is_a_typed_error() -> None:
    """A review read a closed sender's ``handle()`` (and its store's ``nonce`` and ``epoch``):
    each read the header words the close had released and raised the memoryview's
    ``ValueError``. The handle and nonce are the instance's, kept at open; the epoch, which
    only the mapping holds, is ``ClosedCacheError``."""
    name = f"{RUN_PREFIX}hclose-{uuid.uuid4().hex[:8]}"
    cache = SenderCache(CacheConfig(1 << 16, 1 << 15, 1, name=name, prefault=False))
    handle, nonce = cache.handle(), cache.store.nonce
    rx = ReceiverCache.attach(handle)
    rx_handle = rx.store.handle()
    cache.close()
    rx.close()
    assert cache.handle() == handle and cache.store.nonce == nonce
    assert rx.store.handle() == rx_handle
    for store in (cache.store, rx.store):
        with pytest.raises(ClosedCacheError):
            _ = store.epoch


@pytest.mark.parametrize("delivery", ["broadcast", "one_of_n"])
def test_a_closed_writer_s_hand_out_and_publish_usage_are_closed_cache_error(
    delivery: Any,
) -> None:
    """``StoreWriter.hand_out`` and ``publish_usage`` (public steps a caller runs holding
    ``lock``) read the words and views the close released: a review saw the memoryview's
    ``ValueError``. They raise ``ClosedCacheError``, as every writer method does."""
    name = f"{RUN_PREFIX}hout-{uuid.uuid4().hex[:8]}"
    store = ShmObjectStore.create(CacheConfig(1 << 16, 1 << 15, 1, name=name, delivery=delivery))
    ref = store.put("a", {"x": 1})
    store.close()
    with pytest.raises(ClosedCacheError):
        store.hand_out(ref.id)
    with pytest.raises(ClosedCacheError):
        store.publish_usage()
