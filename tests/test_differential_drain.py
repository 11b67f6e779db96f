"""The compiled drain of the readers' logs (``core.drain_logs``) against its reference.

``Acknowledgements.drain`` reads every reader slot's new acknowledgements into the hand-out
ledger. The compiled core takes the usual case in one call (no session to sync, every log
sane); the Python loop is the reference, and runs for the rest. Random sequences of readers
attaching, reading (acknowledging), closing and writing nonsense into their logs, with puts
that evict and drains between them, end in the same ledger, the same slot states and the same
published words on both cores; the compiled drain declines what it does not take before
changing anything, and runs the ledger's clock (Python code) with the collector off.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import SenderCache, ShmObjectStore, ShmRef, implementation
from aioshmcache import _layout as L
from aioshmcache._reader_table import ReaderTable, SlotState
from aioshmcache.store import StoreReader

from .test_differential_store import C, _ledger_state, _sender_for, on_both_cores

pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")

READERS = 3
#: each sequence starts with a reader attached; reads and puts are the common steps
OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 11)),
    st.tuples(st.just("read"), st.integers(0, READERS * 16 - 1)),
    st.tuples(st.just("put"), st.integers(0, 11)),
    st.tuples(st.just("read"), st.integers(0, READERS * 16 - 1)),
    st.tuples(st.just("drain"), st.just(0)),
    st.tuples(st.just("attach"), st.just(0)),
    st.tuples(st.just("close"), st.integers(0, READERS - 1)),
    st.tuples(st.just("garble"), st.integers(0, READERS - 1)),
)


def _item(n: int) -> tuple[dict[str, Any], list[int]]:
    """Items of 8-72 KiB: a 256 KiB ring holds a few, so puts evict (and drain first)."""
    return {"x": np.full(1024 * (1 + n % 9), n, dtype=np.uint64)}, [n]


def _run(ops: list[tuple[str, int]], log_entries: int, delivery: str) -> list[object]:
    """The operations on a fresh sender cache with up to three readers, logs of
    ``log_entries``, ``delivery`` broadcast or one-of-N; after each one, its answer and the
    writer's whole state of the readers (``_ledger_state``)."""
    cache = _sender_for("diffdrain", READERS, ack_log_entries=log_entries, delivery=delivery)
    ticks = iter(range(1, 1 << 30))
    cache.store._ledger.clock = lambda: float(next(ticks))
    readers: list[StoreReader | None] = []
    refs: list[ShmRef] = []
    seen: list[object] = []
    try:
        for op, n in ops:
            answer: object = None
            try:
                if op == "attach" and sum(r is not None for r in readers) < READERS:
                    readers.append(ShmObjectStore.from_handle(cache.store.handle()))
                elif op == "close" and n < len(readers) and (r := readers[n]) is not None:
                    r.close()
                    readers[n] = None
                elif op == "put":
                    ref, _ = cache.get_and_update_item(_item(n), f"k{n}")
                    if isinstance(ref, ShmRef):
                        refs.append(ref)
                elif op == "read" and refs and readers:
                    r = readers[n % len(readers)]
                    if r is not None:  # acknowledges (or raises: evicted, revoked)
                        answer = float(r.get(refs[n // READERS % len(refs)])["x"][0])
                elif op == "drain":
                    answer = cache.store.drain()
                elif op == "garble" and n < len(readers) and (r := readers[n]) is not None:
                    # its head far ahead: the writer must not trust it
                    slot = r.read_path.slot.slot  # type: ignore[union-attr]
                    cache.store._readers.set_word(slot, L.RS_HEAD, 1 << 40)
            except Exception as exc:
                answer = type(exc).__name__
            seen.append((op, answer, _ledger_state(cache.store)))
        return seen
    finally:
        for r in readers:
            if r is not None:
                r.close()
        cache.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(OPS, min_size=20, max_size=60).map(lambda ops: [("attach", 0), *ops]),
    st.sampled_from([64, 16384]),
    st.sampled_from(["broadcast", "one_of_n"]),
)
def test_random_drains_keep_the_reference_s_state(
    monkeypatch: pytest.MonkeyPatch, ops: list[tuple[str, int]], log_entries: int, delivery: str
) -> None:
    """Every answer and every state after each step alike on both cores, in broadcast and
    one-of-N. With logs of 64 entries the hand-outs drain too (every 32 since the last drain),
    as well as the puts' eviction passes and the explicit drains."""
    with_c, pure = on_both_cores(monkeypatch, lambda: _run(ops, log_entries, delivery))
    assert with_c == pure


def _sender_with_acks(cache: SenderCache, reader: StoreReader, n: int) -> list[ShmRef]:
    """``n`` puts, each read (acknowledged) by ``reader``."""
    refs = []
    for i in range(n):
        ref, _ = cache.get_and_update_item(_item(i), f"a{i}")
        assert isinstance(ref, ShmRef)
        reader.get(ref)
        refs.append(ref)
    return refs


def test_the_c_drain_takes_the_usual_drain_and_declines_the_rest() -> None:
    """Not vacuous: ``drain_logs`` applied a reader's three acknowledgements (its debts
    settled and published, its cursor and ``WS_CONSUMED`` moved), then declined, changing
    nothing, a session it does not know yet and a log whose head is out of range."""
    assert C is not None
    cache = _sender_for("drainc", 2)
    try:
        store = cache.store
        acks, ledger = store._acks, store._ledger
        with ShmObjectStore.from_handle(store.handle()) as reader:
            acks.drain()  # the new session synced (the reference's)
            assert C.drain_logs(acks) == 0  # nothing new
            _sender_with_acks(cache, reader, 3)
            (session,) = acks.live_sessions
            slot = reader.read_path.slot.slot  # type: ignore[union-attr]
            assert ledger.owed[session] == 3
            assert C.drain_logs(acks) == 3
            assert ledger.owed[session] == 0 and not ledger.entries
            assert store._readers.word(slot, L.WS_OWED) == 0
            head = store._readers.word(slot, L.RS_HEAD)
            assert acks.slots[slot].cursor == head == store._readers.word(slot, L.WS_CONSUMED)
            assert ledger.last_acknowledged(session) is not None
            with ShmObjectStore.from_handle(store.handle()):  # not synced yet
                before = _ledger_state(store)
                assert C.drain_logs(acks) is None
                assert _ledger_state(store) == before
            acks.drain()
            store._readers.set_word(slot, L.RS_HEAD, head + (1 << 40))  # a garbled log
            before = _ledger_state(store)
            assert C.drain_logs(acks) is None
            assert _ledger_state(store) == before
            assert acks.drain() == 0  # the reference: the slot ignored, its cursor moved on
    finally:
        cache.close()


@pytest.mark.parametrize("meanwhile", ["drain", "new_states"])
def test_a_clock_that_drains_again_keeps_the_reference_s_state(
    monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Python code inside the compiled drain (the ledger's clock) that drains the same logs
    again, or replaces every slot's state (a review's case: the cursors are small ints, the
    same objects in the new states): each acknowledgement applied once, the same state and
    count as the reference's, and the collector off while the clock runs (no finalizer can
    reach the ledger mid-drain)."""
    collector: list[bool] = []

    def run() -> tuple[int, list[int], object]:
        cache = _sender_for("drainclock", 2)
        try:
            store = cache.store
            with (
                ShmObjectStore.from_handle(store.handle()) as r1,
                ShmObjectStore.from_handle(store.handle()) as r2,
            ):
                ticks = iter(range(1, 1 << 30))
                nested = [False]

                def clock() -> float:
                    if nested[0]:
                        nested[0] = False
                        collector.append(gc.isenabled())
                        if meanwhile == "drain":
                            store._acks.drain()  # re-entered: the same new entries
                        else:
                            slots = store._acks.slots
                            slots[:] = [SlotState(cursor=st.cursor) for st in slots]
                    return float(next(ticks))

                store._ledger.clock = clock
                store._acks.drain()
                refs = _sender_with_acks(cache, r1, 4)
                for ref in refs[:2]:
                    r2.get(ref)
                nested[0] = True
                n = store._acks.drain()
                return n, list(store._readers.owed_words), _ledger_state(store)
        finally:
            cache.close()

    with_c, pure = on_both_cores(monkeypatch, run)
    assert with_c == pure
    # the outer drain counts the first slot's four (the nested one took both slots), and the
    # second reader still owes the two hand-outs it did not read; with new states (sessionless)
    # the second slot is left as the clock made it and no debt word is published again
    n, owed, _state = with_c
    assert n == 4 and owed == ([0, 2] if meanwhile == "drain" else [4, 4])
    if implementation() == "c":  # the compiled drain's clock ran with the collector off
        assert collector == [False, True]


def test_a_reader_table_of_another_class_is_left_to_the_reference() -> None:
    """A reader table whose class is not the package's own (a subclass could make its words
    properties: Python code, which the core must not run with the collector off): the compiled
    drain and hand-out decline it, changing nothing, and the reference drains it."""

    class Table(ReaderTable):
        __slots__ = ()

    assert C is not None
    cache = _sender_for("draintable", 2)
    try:
        store = cache.store
        acks = store._acks
        with ShmObjectStore.from_handle(store.handle()) as reader:
            acks.drain()
            _sender_with_acks(cache, reader, 2)
            store._readers.__class__ = Table
            try:
                before = _ledger_state(store)
                assert C.drain_logs(acks) is None
                assert C.hand_out(acks, 10**6) is None
                assert _ledger_state(store) == before
                assert acks.drain() == 2
            finally:
                store._readers.__class__ = ReaderTable
            assert C.drain_logs(acks) == 0
    finally:
        cache.close()


def test_a_free_slot_s_entries_are_skipped_as_the_reference_skips_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broadcast slot with no session whose state says alive (a writer's view gone wrong)
    and whose head moved: neither core settles its entries under session 0 (no progress, no
    clock read for it); both move its cursor and count them."""

    def run() -> tuple[int, object]:
        cache = _sender_for("drainfree", 2)
        try:
            store = cache.store
            acks = store._acks
            ticks = iter(range(1, 1 << 30))
            store._ledger.clock = lambda: float(next(ticks))
            with ShmObjectStore.from_handle(store.handle()) as reader:
                acks.drain()
                _sender_with_acks(cache, reader, 2)
                free = 1 - reader.read_path.slot.slot  # type: ignore[union-attr]
                acks.slots[free].alive = True
                head = store._readers.word(free, L.RS_HEAD)
                store._readers.set_word(free, L.RS_HEAD, head + 2)
                n = acks.drain()
                assert store._ledger.last_acknowledged(0) is None
                return n, _ledger_state(store)
        finally:
            cache.close()

    with_c, pure = on_both_cores(monkeypatch, run)
    assert with_c == pure and with_c[0] == 4
