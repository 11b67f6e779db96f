"""Layer 3: readers (and writers) that die, stop or fork — with real processes and signals."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    CacheFullError,
    InvalidReferenceError,
    ReaderLimitError,
    ReceiverCache,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    StaleReferenceError,
    WriterGoneError,
    sweep,
)
from aioshmcache._layout import (
    H_CAPACITY,
    H_HINT_OFF,
    H_HINT_SLOTS,
    H_LOG_ENTRIES,
    H_N_READERS,
    H_READER_OFF,
    H_RING_OFF,
    H_SECRET,
    H_SLOT_SIZE,
    RS_HEAD,
    WS_CONSUMED,
)
from aioshmcache._segment import Segment
from aioshmcache._types import reference_tag

from . import _procs
from .helpers import SPAWN, FakeClock, checksum, gone, random_item, wait_until


def _start_reader(handle: Any) -> tuple[Any, Any]:
    a, b = SPAWN.Pipe()
    p = SPAWN.Process(target=_procs.reader_loop, args=(handle, b), daemon=True)
    p.start()
    assert a.poll(60), "reader did not start"
    tag, _pid = a.recv()
    assert tag == "ready"
    return p, a


def _stop(p: Any, conn: Any) -> None:
    if p.is_alive():
        try:
            conn.send(None)
        except OSError:
            pass
        p.join(10)
    if p.is_alive():
        p.kill()
        p.join(10)


def _put(
    cache: SenderCache, key: str, nbytes: int, rng: np.random.Generator, wait: float = 0.0
) -> Any:
    item = random_item(rng, nbytes)
    out, _ = cache.get_and_update_item((item, ()), key, wait_for_space=wait)
    return out, item


@pytest.mark.slow
def test_sigkilled_readers_never_block_the_writer(make_config: Any) -> None:
    """20+ readers killed at random points during reads: puts go on, the survivor reads right."""
    rng = np.random.default_rng(1)
    cache = SenderCache(make_config(2 << 20, 300 << 10, 3, ack_log_entries=256))
    stable, sconn = _start_reader(cache.handle().to_dict())
    answers: list[tuple[str, str]] = []

    def collect() -> None:  # keep the survivor's reply pipe from filling up
        while sconn.poll(0):
            answers.append(sconn.recv())

    try:
        n = 0
        for round_ in range(21):
            victim, vconn = _start_reader(cache.handle().to_dict())
            kill_at = random.uniform(0.0, 0.05)
            t0 = time.monotonic()
            killed = False
            for j in range(40):
                ref, _item = _put(
                    cache, f"r{round_}-{j}", int(rng.integers(1000, 200_000)), rng, wait=5.0
                )
                assert not isinstance(ref, dict), "put was served inline: the cache is stuck"
                for conn in (sconn, vconn) if not killed else (sconn,):
                    conn.send({"key": f"r{round_}-{j}", "ref": ref.to_dict()})
                n += 1
                collect()
                if not killed and time.monotonic() - t0 > kill_at:
                    os.kill(victim.pid, signal.SIGKILL)
                    killed = True
            if not killed:
                os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            vconn.close()
        # the writer carries on after all those deaths
        for j in range(30):
            ref, _ = _put(cache, f"after{j}", 150_000, rng, wait=5.0)
            assert not isinstance(ref, dict)
            sconn.send({"key": f"after{j}", "ref": ref.to_dict()})
            collect()
        sconn.send(None)
        while True:
            assert sconn.poll(60)
            msg = sconn.recv()
            if msg[0] == "done":
                break
            answers.append(msg)
        assert len(answers) == n + 30
        assert all(a[1] == "ok" for a in answers), [a for a in answers if a[1] != "ok"][:5]
        snap = cache.snapshot()
        assert sum(r.attached for r in snap.readers) <= 3
    finally:
        _stop(stable, sconn)
        cache.close()


def test_sigkilled_writer_is_seen_within_a_second_and_swept(shm_name: str) -> None:
    a, b = SPAWN.Pipe()
    writer = SPAWN.Process(target=_procs.writer_forever, args=(shm_name, b), daemon=True)
    writer.start()
    try:
        assert a.poll(60)
        ref = a.recv()
        rx = ReceiverCache.attach(shm_name)
        time.sleep(0.3)  # mid-put of a 64 MiB item
        writer.kill()
        writer.join(10)
        # the writer's lock is probed at least every 0.25 s: once that much time has passed
        # since the kill, the very next call must know (no timing bound that load could break)
        time.sleep(0.3)
        with pytest.raises(WriterGoneError):
            rx.get_and_update_item(ref, "small")
        rx.close()
        removed = sweep(name=shm_name)
        assert f"aioshm-{shm_name}" in removed
        assert not os.path.exists(f"/dev/shm/aioshm-{shm_name}")
        assert not [n for n in os.listdir("/dev/shm") if shm_name in n]
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join(5)
        sweep(name=shm_name)


def test_a_touch_after_the_writer_closed_is_writer_gone(make_config: Any) -> None:
    """``touch`` is a call like a read: once the writer has closed, a reference it handed out is
    not declared valid (its item can no longer be read), within the probe interval."""
    tx = SenderCache(make_config(1 << 20, 1 << 16, 1))
    try:
        with ReceiverCache.attach(tx.handle()) as rx:
            ref, _ = tx.get_and_update_item(({"x": np.arange(4)}, ()), "h")
            rx.touch("h", ref)  # valid while the writer lives
            tx.close()
            time.sleep(0.3)  # the writer's lock is probed at least every 0.25 s
            with pytest.raises(WriterGoneError):
                rx.touch("h", ref)
    finally:
        tx.close()


def test_stopped_reader_deadline_then_eviction(make_config: Any) -> None:
    rng = np.random.default_rng(2)
    cfg = make_config(1 << 20, 300 << 10, 2, evict_stuck_readers_after=0.5)
    cache = SenderCache(cfg)
    # the ledger's clock is private: a test of its time limits injects it, as the ledger's do
    clock = cache.store._ledger.clock = FakeClock()  # the stuck limit runs on this clock
    p, conn = _start_reader(cache.handle().to_dict())
    try:
        refs = []
        for j in range(3):  # fill the ring with items the reader owes
            ref, _ = _put(cache, f"o{j}", 290_000, rng)
            refs.append(ref)
        os.kill(p.pid, signal.SIGSTOP)
        out, _ = _put(cache, "x", 290_000, rng, wait=0.2)  # not yet stuck long enough
        assert isinstance(out, dict), "should be served inline (full)"
        assert not cache.snapshot().readers[0].revoked
        clock.advance(0.6)  # past evict_stuck_readers_after
        out, _ = _put(cache, "y", 290_000, rng, wait=0.2)  # now the writer revokes the slot
        assert not isinstance(out, dict)
        os.kill(p.pid, signal.SIGCONT)
        conn.send({"key": "o0", "ref": refs[0].to_dict()})
        assert conn.poll(10)
        assert conn.recv() == ("o0", "ReaderEvictedError")
    finally:
        os.kill(p.pid, signal.SIGCONT)
        _stop(p, conn)
        cache.close()


def test_stopped_reader_without_eviction_puts_fail_within_deadline(make_config: Any) -> None:
    rng = np.random.default_rng(3)
    with SenderCache(make_config(1 << 20, 300 << 10, 1)) as cache:
        p, conn = _start_reader(cache.handle().to_dict())
        try:
            for j in range(3):
                _put(cache, f"o{j}", 290_000, rng)
            os.kill(p.pid, signal.SIGSTOP)
            wakeups0 = cache.store.wakeups
            with pytest.raises(CacheFullError):  # a missed deadline is a hang: the test timeout
                cache.store.put("z", random_item(rng, 290_000), wait_for_space=0.5)
            assert cache.store.wakeups > wakeups0  # it did wait for space before giving up
        finally:
            os.kill(p.pid, signal.SIGCONT)
            _stop(p, conn)


def test_zombie_reader_is_dead_and_a_newcomer_owes_nothing(make_config: Any) -> None:
    rng = np.random.default_rng(4)
    with SenderCache(make_config(1 << 20, 300 << 10, 1)) as cache:
        code = (
            "import sys, time; from aioshmcache import ReceiverCache; "
            f"r = ReceiverCache.attach({cache.name!r}); print('up', flush=True); "
            "sys.stdin.readline()"
        )
        with subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as child:
            _zombie_scenario(cache, child, rng)


def _zombie_scenario(cache: SenderCache, child: Any, rng: np.random.Generator) -> None:
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "up"
        wait_until(lambda: cache.snapshot().readers[0].attached)
        for j in range(3):
            _put(cache, f"o{j}", 290_000, rng)  # owed by the child
        assert not cache.is_freeable("o0")
        child.stdin.write("\n")
        child.stdin.flush()
        # wait for exit without reaping: the child is a zombie now
        assert wait_until(lambda: gone(child.pid), timeout=20)  # not reaped: a zombie
        out, _ = _put(cache, "new", 290_000, rng)  # dead debts dropped at this free attempt
        assert not isinstance(out, dict)
        assert cache.snapshot().readers[0].alive is False
        # a new process takes the freed slot and owes nothing older
        newcomer = ReceiverCache.attach(cache.handle())
        try:
            with pytest.raises(ReaderLimitError):
                ReceiverCache.attach(cache.handle())
            assert cache.is_freeable("o1") and cache.is_freeable("o2")
        finally:
            newcomer.close()
    finally:
        child.wait(10)


@pytest.mark.slow
def test_one_of_n_each_handout_read_exactly_once(make_config: Any) -> None:
    cfg = make_config(8 << 20, 64 << 10, 4, delivery="one_of_n", handout_ttl=60.0)
    rng = np.random.default_rng(5)
    with SenderCache(cfg) as cache:
        queue, results = SPAWN.Queue(), SPAWN.Queue()
        procs = [
            SPAWN.Process(
                target=_procs.one_of_n_reader,
                args=(cache.handle().to_dict(), queue, results),
                daemon=True,
            )
            for _ in range(4)
        ]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                assert results.get(timeout=60)[0] == "ready"
            sent = []
            for i in range(2000):
                key = f"h{i % 300}"  # repeated hashes: several hand-outs of one item
                if cache.is_cached(key):
                    ref, _ = cache.get_and_update_item(None, key)
                else:
                    ref, _ = cache.get_and_update_item(
                        (random_item(rng, int(rng.integers(100, 20_000))), ()),
                        key,
                        wait_for_space=10.0,
                    )
                assert not isinstance(ref, dict)
                queue.put({"key": key, "ref": ref.to_dict()})
                sent.append(key)
            for _ in procs:
                queue.put(None)
            seen: list[str] = []
            for _ in procs:
                tag, keys, bad = results.get(timeout=60)
                assert tag == "done" and bad == 0
                seen.extend(keys)
            assert sorted(seen) == sorted(sent)  # every hand-out read exactly once
            cache.store.drain()
            assert all(cache.is_freeable(k) for k in cache.cached_order())
        finally:
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            queue.close()
            results.close()
            queue.join_thread()
            results.join_thread()


def test_one_of_n_undelivered_handouts_expire(make_config: Any) -> None:
    cfg = make_config(1 << 20, 1 << 16, 2, delivery="one_of_n", handout_ttl=0.3)
    with SenderCache(cfg) as cache:
        clock = cache.store._ledger.clock = FakeClock()  # private: injected (a time limit)
        cache.get_and_update_item(({"a": np.zeros(100)}, ()), "lost")  # never delivered
        assert not cache.is_freeable("lost")
        clock.advance(0.29)
        assert not cache.is_freeable("lost")
        clock.advance(0.02)
        assert cache.is_freeable("lost")


def test_torn_reads_are_detected(make_config: Any) -> None:
    """A reader that owes nothing copies while the writer reuses the chunk: never wrong data."""
    cfg = make_config(4 << 20, 1100 << 10, 1)
    writer = ShmObjectStore.create(cfg)
    stop = threading.Event()
    outcomes = {"ok": 0, "stale": 0, "wrong": 0}
    n_reads = [0]
    refs: list[Any] = []

    def reader() -> None:
        rx = ShmObjectStore.from_handle(writer.handle())
        try:
            while not stop.is_set():
                if not refs:
                    continue
                # the newest (live) and the one before (freed and being reused right now)
                ref = refs[-1 - (n_reads[0] % 2)] if len(refs) > 1 else refs[-1]
                n_reads[0] += 1
                try:
                    v = rx.get(ref)
                except StaleReferenceError:
                    outcomes["stale"] += 1
                    continue
                ok = checksum(v["data"]) == v["crc"]
                outcomes["ok" if ok else "wrong"] += 1
        finally:
            rx.close()

    try:
        # the reader attaches after every hand-out it reads: it owes nothing, so the writer frees
        t = threading.Thread(target=reader)
        rng = np.random.default_rng(6)
        items = [random_item(rng, 1 << 20) for _ in range(4)]
        refs.append(writer.put("k0", items[0]))
        writer.release(refs[-1])  # nobody owes it: the writer may reuse it at any time
        t.start()
        wait_until(lambda: writer.reader_info()[0].attached)
        deadline = time.monotonic() + 10
        i = 1
        while time.monotonic() < deadline and (outcomes["stale"] < 20 or outcomes["ok"] < 20):
            writer.evict(0)
            writer.drain()
            writer.invalidate(f"k{i - 1}")
            writer.evict(0)
            refs.append(writer.put(f"k{i}", items[i % 4]))
            writer.release(refs[-1])
            i += 1
            time.sleep(random.uniform(0, 0.002))  # sometimes a read finishes before the reuse
        stop.set()
        t.join(10)
        assert outcomes["wrong"] == 0
        assert outcomes["ok"] > 0
        assert outcomes["stale"] > 0, "the test never caught a reuse mid-read"
    finally:
        stop.set()
        writer.close()


def test_dead_reader_debts_do_not_count_for_is_freeable(make_config: Any) -> None:
    with SenderCache(make_config(1 << 20, 300 << 10, 2)) as cache:
        p, conn = _start_reader(cache.handle().to_dict())
        cache.get_and_update_item(({"a": np.zeros(100)}, ()), "a")
        assert not cache.is_freeable("a")
        p.kill()
        p.join(10)
        conn.close()
        assert cache.is_freeable("a")
        cache.remove_dangling_items()
        assert not cache.is_cached("a")  # freed at the head


def test_full_ack_log_never_blocks_nor_loses(make_config: Any) -> None:
    with SenderCache(make_config(4 << 20, 1 << 20, 1, ack_log_entries=64)) as tx:
        refs = [tx.get_and_update_item(({"i": i}, ()), f"k{i}")[0] for i in range(100)]
        with ReceiverCache.attach(tx.handle()) as rx:
            refs = [tx.get_and_update_item(None, f"k{i}")[0] for i in range(100)]
            for i, r in enumerate(refs):  # the writer is idle: the log fills up
                assert rx.get_and_update_item(r, f"k{i}") == {"i": i}
            assert rx.store.read_path.slot is not None and rx.store.read_path.slot.flush() > 0
            tx.store.drain()  # the writer drains; the next reader call flushes the rest
            rx.get_and_update_features([])
            assert rx.store.read_path.slot.flush() == 0
            assert all(tx.is_freeable(f"k{i}") for i in range(100))


def test_a_one_of_n_reader_closed_with_acknowledgements_waiting_hands_them_to_the_writer(
    make_config: Any,
) -> None:
    """One-of-N: a reader's acknowledgements waiting for log room (the writer was idle) were
    dropped at its close even once the writer had drained its log, and a one-of-N hand-out is
    nobody's debt that a closed session's drop settles: those items stayed unevictable for
    ``handout_ttl``. The close now moves what fits into the log first."""
    cfg = make_config(4 << 20, 1 << 20, 1, ack_log_entries=64, delivery="one_of_n")
    with SenderCache(cfg) as tx:
        rx = ReceiverCache.attach(tx.handle())
        refs = [tx.get_and_update_item(({"i": i}, ()), f"k{i}")[0] for i in range(100)]
        for i, r in enumerate(refs):  # the writer is idle: the log fills up
            assert rx.get_and_update_item(r, f"k{i}") == {"i": i}
        slot = rx.store.read_path.slot
        assert slot is not None and slot.flush() > 0
        tx.store.drain()  # the writer drains; the reader reads nothing more
        rx.close()
        tx.store.drain()
        assert all(tx.is_freeable(f"k{i}") for i in range(100))


def test_a_log_a_hostile_writer_keeps_full_bounds_the_waiting_acknowledgements(
    make_config: Any,
) -> None:
    """A process that keeps the writer's consumed mark pinned so that the reader's log always
    looks full: every acknowledgement waited in the reader's memory, one more per read, without
    bound. At most one log's worth waits now (the newest); older ones are lost to that writer,
    which then sees the reader owe, as the guarantees say of counters a hostile writer sets."""
    with (
        SenderCache(make_config(4 << 20, 1 << 20, 1, ack_log_entries=64)) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
    ):
        ref = tx.get_and_update_item(({"i": 1}, ()), "k")[0]
        slot = rx.store.read_path.slot
        assert slot is not None
        table = slot.table
        for _ in range(300):
            head = table.word(slot.slot, RS_HEAD)
            table.set_word(slot.slot, WS_CONSUMED, (head + 1) % (1 << 64))  # full
            assert rx.get_and_update_item(ref, "k") == {"i": 1}
        assert slot.flush() == 64


def test_closing_a_reader_that_acknowledged_more_than_its_log_holds_logs_nothing(
    make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19 item 6: a normal close is not an "inconsistent log" (a false WARNING)."""
    caplog.set_level(logging.WARNING, logger="aioshmcache")
    with SenderCache(make_config(4 << 20, 1 << 20, 1, ack_log_entries=64)) as tx:
        rx = ReceiverCache.attach(tx.handle())
        for i in range(3 * 64):  # three times the log: the writer drains as it hands out
            ref = tx.get_and_update_item(({"i": i}, ()), f"k{i}")[0]
            assert rx.get_and_update_item(ref, f"k{i}") == {"i": i}
        slot = rx.store.read_path.slot
        assert slot is not None and slot.acknowledged == 3 * 64
        rx.close()
        snap = tx.snapshot()  # the writer drains and notices the closed slot
        assert not snap.readers[0].attached
        with ReceiverCache.attach(tx.handle()) as rx2:  # the slot is reused cleanly
            ref = tx.get_and_update_item(None, "k0")[0]
            assert rx2.get_and_update_item(ref, "k0") == {"i": 0}
            assert tx.snapshot().readers[0].lag == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _forged_copies(writer: Any, ref: Any) -> list[Any]:
    """Copies of a genuine reference that are not it: another segment's nonce, a garbage tag,
    and an older epoch re-tagged with the secret (a forger who read the header)."""
    old = ref.epoch - 1
    secret = int(writer.words[H_SECRET])
    tag = reference_tag(secret, old, ref.address, ref.id, ref.length, ref.position, ref.seq)
    return [
        ref._replace(nonce=ref.nonce ^ 2),
        ref._replace(tag=ref.tag ^ 1),
        ref._replace(epoch=old, tag=tag),
    ]


@contextlib.contextmanager
def _a_lease(make_config: Any) -> Iterator[tuple[Any, Any, ShmRef, dict[str, Any]]]:
    """A writer at epoch 1 (so that a forged copy can claim epoch 0), a reader, and the
    reader's lease (``copy=False``: owed until acknowledged) of one put's reference; on exit
    the lease must have been settled by the genuine reference alone."""
    writer = ShmObjectStore.create(make_config(64 << 10, 16 << 10, 1))
    try:
        writer.clear()
        reader = ShmObjectStore.from_handle(writer.handle())
        try:
            ref = writer.put("k", {"a": np.arange(10)})
            leased = reader.get(ref, copy=False)
            yield writer, reader, ref, leased
            assert np.array_equal(leased["a"], np.arange(10))
            reader.ack(ref)  # the lease ends: the genuine reference settles it
            assert writer.is_freeable("k")
        finally:
            reader.close()
    finally:
        writer.close()


def test_a_forged_copy_given_back_settles_no_lease(make_config: Any) -> None:
    """A reader's ``release`` acknowledged whatever (id, seq) it was given, unchecked: a copy of
    a leased reference with another nonce, a wrong tag or an older epoch settled the lease's
    hand-out, the writer reused the chunk and the lease's views showed another item's bytes.
    Only a genuine, live reference is given back (as the docstring always said)."""
    with _a_lease(make_config) as (writer, reader, ref, _leased):
        for forged in _forged_copies(writer, ref):
            reader.release(forged)  # never raises; settles nothing
            assert not writer.is_freeable("k")
        assert writer.evict() == []  # still owed: the leased chunk stays
        assert writer.put("x", {"b": np.full(10, 7)}) is not None


def test_a_forged_copy_acknowledged_settles_no_lease_and_raises_typed(make_config: Any) -> None:
    """A reader's ``ack`` re-checked only the chunk a reference names, not the reference: a copy
    of a leased reference with another nonce, a wrong tag or an older epoch was acknowledged
    and settled the lease's hand-out; one with an address past the ring or a field that is not
    an int raised an untyped ``IndexError`` / ``TypeError``. Now each is refused with the typed
    error a read gives it, and settles nothing."""
    with _a_lease(make_config) as (writer, reader, ref, _leased):
        bad = [*_forged_copies(writer, ref), ref._replace(address=1 << 40)]
        bad.append(ref._replace(address="0"))  # type: ignore[arg-type]
        for forged in bad:
            with pytest.raises((InvalidReferenceError, StaleReferenceError)):
                reader.ack(forged)
            assert not writer.is_freeable("k")


def test_header_words_rewritten_after_the_attach_check_are_not_trusted(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that maps the segment rewrote its geometry words (ring offset, capacity,
    reader table, hints) between the attach's check of the header and the reader's use of
    them: the reader sized its views from the live words, so a ring offset past the end gave
    reads an untyped ``IndexError`` (seen with a real process flipping the word). The reader
    now places every region from the geometry the attach checked."""
    attach = Segment.attach

    def attach_then_garble(name: str, **kw: Any) -> Segment:
        seg = attach(name, **kw)
        for word, value in (
            (H_RING_OFF, 1 << 50),
            (H_CAPACITY, 1 << 40),
            (H_READER_OFF, 1 << 50),
            (H_SLOT_SIZE, 8),
            (H_LOG_ENTRIES, 1 << 40),
            (H_N_READERS, 255),
            (H_HINT_OFF, 1 << 50),
            (H_HINT_SLOTS, 1 << 20),
        ):
            seg.words[word] = value
        return seg

    writer = ShmObjectStore.create(make_config(64 << 10, 16 << 10, 2))
    try:
        first = ShmObjectStore.from_handle(writer.handle())  # slot 0 taken
        monkeypatch.setattr(Segment, "attach", attach_then_garble)
        reader = ShmObjectStore.from_handle(writer.handle())
        try:
            for i in range(3):
                ref = writer.put(f"k{i}", {"a": np.arange(10) + i})
                first.release(ref)
                got = reader.get(ref)  # the copy path (core or Python), acknowledged
                assert np.array_equal(got["a"], np.arange(10) + i)
                leased = reader.get(ref, copy=False) if i else None
                if leased is not None:
                    reader.ack(ref)
            assert all(writer.is_freeable(f"k{i}") for i in range(3))
        finally:
            reader.close()
            first.close()
    finally:
        writer.close()
