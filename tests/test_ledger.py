"""The hand-out ledger, pure: a state machine against a plain model, then one test per rule.

The store-level tests at the end show the same rules through a real segment (each failed before
the ledger: one-of-N expiry ran from the entry's *last* hand-out, a touch lasted forever, a lost
broadcast hand-out pinned forever and got healthy readers revoked).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aioshmcache import CacheConfig, ShmObjectStore
from aioshmcache._ledger import Debts, HandoutLedger

from .helpers import FakeClock

TTL = 10.0


class _Handout:
    def __init__(self, owers: set[int] | None, t: float) -> None:
        self.owers = owers  # None: one-of-N
        self.t = t


class LedgerModel(RuleBasedStateMachine):
    """The ledger against dicts and sets, with the rules written out the plain way."""

    @initialize(one_of_n=st.booleans())
    def setup(self, one_of_n: bool) -> None:
        self.one_of_n = one_of_n
        self.clock = FakeClock(0.0)
        self.ledger = HandoutLedger(one_of_n=one_of_n, handout_ttl=TTL, clock=self.clock)
        self.entries: dict[int, Debts] = {}
        self.handouts: dict[int, dict[int, _Handout]] = {}  # cid -> seq -> hand-out
        self.pins: dict[int, int] = {}
        self.touched: dict[int, float | None] = {}
        self.progress: dict[int, tuple[int, float]] = {}
        self.sessions: set[int] = set()
        self.next_cid = 1
        self.next_session = 1
        self.next_seq = 1

    # --- model helpers ---------------------------------------------------------------------
    def _lapsed(self, seq: int, h: _Handout, s: int | None) -> bool:
        if self.clock.now - h.t < TTL:
            return False
        if s is None:
            return True
        p = self.progress.get(s)
        return p is not None and p[0] > seq

    def _expire(self, cid: int) -> None:
        t = self.touched[cid]
        if t is not None and self.clock.now - t >= TTL:
            self.touched[cid] = None
        for seq, h in list(self.handouts[cid].items()):
            if h.owers is None:
                if self._lapsed(seq, h, None):
                    del self.handouts[cid][seq]
                continue
            h.owers = {s for s in h.owers if not self._lapsed(seq, h, s)}
            if not h.owers:
                del self.handouts[cid][seq]

    def _model_free(self, cid: int) -> bool:
        self._expire(cid)
        return not self.pins[cid] and self.touched[cid] is None and not self.handouts[cid]

    # --- rules -----------------------------------------------------------------------------
    @rule()
    def add_entry(self) -> None:
        cid = self.next_cid
        self.next_cid += 1
        e = Debts(cid)
        self.ledger.add(e)
        self.entries[cid] = e
        self.handouts[cid] = {}
        self.pins[cid] = 0
        self.touched[cid] = None

    @rule()
    def attach_session(self) -> None:
        self.sessions.add(self.next_session)
        self.next_session += 1

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def drop_session(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.sessions)))
        self.sessions.discard(s)
        self.ledger.drop_session(s)
        self.progress.pop(s, None)
        if not self.one_of_n:
            for hs in self.handouts.values():
                for seq, h in list(hs.items()):
                    if h.owers is not None and s in h.owers:
                        h.owers.discard(s)
                        if not h.owers:
                            del hs[seq]

    def _expect_hand_out(self, cid: int, seq: int) -> None:
        """The model's side of a hand-out ``seq`` of ``cid``: next in order, owed by whom."""
        assert seq == self.next_seq
        self.next_seq += 1
        self.touched[cid] = None  # a hand-out ends a touch (an untracked entry has none)
        if self.one_of_n:
            self.handouts[cid][seq] = _Handout(None, self.clock.now)
        elif self.sessions:
            self.handouts[cid][seq] = _Handout(set(self.sessions), self.clock.now)

    def _acknowledger(self, data: st.DataObject) -> tuple[int, st.SearchStrategy[tuple[int, int]]]:
        """A session that acknowledges, and what it acknowledges: a (cid, seq) owed now, or any
        (settled already, never made, or owed by another session)."""
        s = data.draw(st.sampled_from(sorted(self.sessions)))
        owed = [(c, q) for c, hs in self.handouts.items() for q in hs]
        pick_owed: bool = data.draw(st.booleans())
        if owed and pick_owed:
            return s, st.sampled_from(owed)
        return s, st.tuples(st.integers(1, self.next_cid), st.integers(1, self.next_seq))

    def _expect_settle(self, s: int, cid: int, seq: int) -> bool:
        """The model's acknowledgement of (cid, seq) by session ``s``: whether it settles a debt
        (a one-of-N hand-out, or one ``s`` owes), which goes once no session owes it."""
        h = self.handouts.get(cid, {}).get(seq)
        if h is None or (h.owers is not None and s not in h.owers):
            return False
        if h.owers is not None:
            h.owers.discard(s)
        if not h.owers:
            del self.handouts[cid][seq]
        return True

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def hand_out(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        seq = self.ledger.hand_out(self.entries[cid], sorted(self.sessions))
        self._expect_hand_out(cid, seq)

    @precondition(lambda self: self.sessions and self.next_seq > 1)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        """A session acknowledges some (cid, seq): owed, not owed, or never made."""
        s, pair = self._acknowledger(data)
        cid, seq = data.draw(pair)
        expected = self._expect_settle(s, cid, seq)
        p = self.progress.get(s)
        self.progress[s] = (seq if p is None else max(p[0], seq), self.clock.now)
        assert self.ledger.settle(cid, seq, s) is expected

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def hand_out_by_id(self, data: st.DataObject) -> None:
        """The store's path: by chunk id, a ``Debts`` made only when something is owed."""
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        seq = self.ledger.hand_out_id(cid, sorted(self.sessions))
        tracked = self.ledger.get(cid)
        if tracked is not None:
            self.entries[cid] = tracked  # made by the ledger if it had none
        self._expect_hand_out(cid, seq)

    @precondition(lambda self: self.sessions and self.next_seq > 1)
    @rule(data=st.data())
    def settle_batch(self, data: st.DataObject) -> None:
        """A drain: one session's acknowledgements applied in order by ``settle_all``."""
        s, one = self._acknowledger(data)
        pairs = data.draw(st.lists(one, max_size=5))
        expected = sum(self._expect_settle(s, cid, seq) for cid, seq in pairs)
        if pairs:
            top = max(q for _c, q in pairs)
            p = self.progress.get(s)
            self.progress[s] = (top if p is None else max(p[0], top), self.clock.now)
        flat = [x for pair in pairs for x in pair]
        assert self.ledger.settle_all(flat, s) == expected

    @precondition(lambda self: self.next_seq > 1)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owed = [(c, q) for c, hs in self.handouts.items() for q in hs]
        pick: bool = data.draw(st.booleans())
        if owed and pick:
            cid, seq = data.draw(st.sampled_from(owed))
        else:
            cid = data.draw(st.integers(1, self.next_cid))
            seq = data.draw(st.integers(1, self.next_seq))
        expected = self.handouts.get(cid, {}).pop(seq, None) is not None
        assert self.ledger.release(cid, seq) is expected

    @rule(dt=st.sampled_from([0.0, 1.0, TTL / 2, TTL, 3 * TTL]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def expire_and_check_free(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        assert self.ledger.is_free(self.entries[cid]) == self._model_free(cid)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def pin_or_unpin(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        if data.draw(st.booleans()):
            self.ledger.pin(self.entries[cid])
            self.pins[cid] += 1
        else:
            self.ledger.unpin(self.entries[cid])
            self.pins[cid] = max(0, self.pins[cid] - 1)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        self.ledger.touch(self.entries[cid])
        self.touched[cid] = self.clock.now

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def forget_a_free_entry(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.entries)))
        free = self._model_free(cid)
        assert self.ledger.is_free(self.entries[cid]) == free
        if free:
            self.ledger.forget(cid)
            del self.entries[cid], self.handouts[cid], self.pins[cid], self.touched[cid]

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def debts_match(self) -> None:
        if not hasattr(self, "ledger"):
            return
        owed: dict[int, int] = {}
        for cid, e in self.entries.items():
            hs = self.handouts[cid]
            assert sorted(e.out) == sorted(hs)
            n = 0
            for seq, h in hs.items():
                got = e.out[seq][0]
                if h.owers is None:
                    assert got is None
                    n += 1
                else:
                    assert got is not None and set(got) == h.owers
                    n += len(h.owers)
                    for s in h.owers:
                        owed[s] = owed.get(s, 0) + 1
            assert e.debt == n
            assert e.pins == self.pins[cid]
        if not self.one_of_n:
            assert {s: n for s, n in self.ledger.owed.items() if n} == owed

    @invariant()
    def debtors_and_stuck_match(self) -> None:
        if not hasattr(self, "ledger") or self.one_of_n:
            return
        now = self.clock.now
        for cid, e in self.entries.items():
            since: dict[int, float] = {}
            stuck: set[int] = set()
            for h in self.handouts[cid].values():
                for s in h.owers or ():
                    since[s] = min(since.get(s, h.t), h.t)
                    p = self.progress.get(s)
                    if now - h.t > TTL and (p is None or p[1] < h.t):
                        stuck.add(s)
            assert self.ledger.debtors(e) == since
            assert set(self.ledger.stuck(e, TTL)) == stuck


TestLedgerModel = LedgerModel.TestCase
TestLedgerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- the rules, one by one ----------------------------------------------------------------------
def _ledger(*, one_of_n: bool) -> tuple[HandoutLedger, FakeClock, Debts]:
    clock = FakeClock(0.0)
    ledger = HandoutLedger(one_of_n=one_of_n, handout_ttl=TTL, clock=clock)
    e = Debts(1)
    ledger.add(e)
    return ledger, clock, e


def test_one_of_n_expiry_runs_per_handout() -> None:
    """One lost hand-out of a frequently requested item pins it for ``handout_ttl`` at most."""
    ledger, clock, e = _ledger(one_of_n=True)
    ledger.hand_out(e)  # lost: nobody will ever read it
    for _ in range(5):  # the item stays popular: every hand-out after it is read at once
        clock.now += TTL / 4
        seq = ledger.hand_out(e)
        assert ledger.settle(1, seq, 7)
    assert clock.now > TTL  # the lost one is older than the TTL, the last hand-out is not
    assert ledger.is_free(e)


def test_one_of_n_unread_handout_pins_until_its_own_ttl() -> None:
    ledger, clock, e = _ledger(one_of_n=True)
    ledger.hand_out(e)
    clock.now += TTL / 2
    ledger.hand_out(e)
    clock.now += TTL / 2
    assert not ledger.is_free(e)  # the second is not yet TTL old
    assert e.debt == 1
    clock.now += TTL / 2
    assert ledger.is_free(e)


def test_a_touch_without_a_handout_expires() -> None:
    ledger, clock, e = _ledger(one_of_n=False)
    ledger.touch(e)
    clock.now += TTL / 2
    assert not ledger.is_free(e)
    clock.now += TTL / 2
    assert ledger.is_free(e)


def test_a_touch_ends_at_the_next_handout() -> None:
    ledger, _clock, e = _ledger(one_of_n=False)
    ledger.touch(e)
    seq = ledger.hand_out(e, [5])
    assert ledger.settle(1, seq, 5)
    assert ledger.is_free(e)


def test_lost_broadcast_handout_lapses_once_its_readers_moved_on() -> None:
    ledger, clock, e = _ledger(one_of_n=False)
    other = Debts(2)
    ledger.add(other)
    ledger.hand_out(e, [5, 6])  # lost in transit: never read, never released
    clock.now += TTL
    assert not ledger.is_free(e)  # old enough, but nobody has shown progress yet
    seq = ledger.hand_out(other, [5, 6])
    assert ledger.settle(2, seq, 5)
    assert not ledger.is_free(e)  # session 6 has not moved on: it may still read it
    assert ledger.debtors(e) == {6: 0.0}
    assert ledger.settle(2, seq, 6)
    assert ledger.is_free(e)
    assert ledger.owed == {5: 0, 6: 0}


def test_a_young_handout_never_lapses_even_if_later_ones_were_read() -> None:
    """Readers may finish out of order: only ``handout_ttl`` makes a hand-out count as lost."""
    ledger, clock, e = _ledger(one_of_n=False)
    other = Debts(2)
    ledger.add(other)
    ledger.hand_out(e, [5])
    clock.now += TTL / 2
    assert ledger.settle(2, ledger.hand_out(other, [5]), 5)
    assert not ledger.is_free(e)


def test_stuck_means_acknowledged_nothing_since_the_handout() -> None:
    ledger, clock, e = _ledger(one_of_n=False)
    other = Debts(2)
    ledger.add(other)
    ledger.hand_out(e, [5, 6])  # lost for 5 and 6 alike
    clock.now += 1.0
    for _ in range(3):  # 5 keeps reading; 6 reads nothing
        clock.now += 1.0
        assert ledger.settle(2, ledger.hand_out(other, [5, 6]), 5)
    clock.now += 1.0
    assert ledger.stuck(e, after=2.0) == [6]
    assert ledger.stuck(e, after=60.0) == []


def test_a_dropped_session_owes_nothing() -> None:
    ledger, _clock, e = _ledger(one_of_n=False)
    ledger.hand_out(e, [5, 6])
    ledger.drop_session(6)
    assert e.debt == 1 and ledger.owed == {5: 1}
    assert ledger.settle(1, 1, 5)
    assert ledger.is_free(e)


def test_release_and_forget_undo_debts() -> None:
    ledger, _clock, e = _ledger(one_of_n=False)
    s1 = ledger.hand_out(e, [5, 6])
    ledger.hand_out(e, [5])
    assert ledger.release(1, s1) and not ledger.release(1, s1)
    assert ledger.owed == {5: 1, 6: 0}
    ledger.forget(1)
    assert ledger.owed == {5: 0, 6: 0}
    assert not ledger.settle(1, 2, 5)


# --- the same rules through a real segment ------------------------------------------------------
def _item() -> dict[str, Any]:
    return {"x": np.arange(100)}


def test_store_one_of_n_lost_handout_does_not_pin_a_popular_item(shm_name: str) -> None:
    cfg = CacheConfig(1 << 20, 1 << 18, 1, name=shm_name, delivery="one_of_n", handout_ttl=0.3)
    with ShmObjectStore.create(cfg) as w, ShmObjectStore.from_handle(w.handle()) as r:
        clock = w._ledger.clock = FakeClock()
        w.put("a", _item())  # handed out, lost

        def popular_and_freeable() -> bool:
            ref = w.get_cached("a")
            assert ref is not None
            r.get(ref)  # every later hand-out is read at once
            return w.is_freeable("a")

        assert not popular_and_freeable()  # the lost hand-out is young: it still counts
        while not popular_and_freeable():
            clock.advance(0.05)
        assert clock.now - 1000.0 >= 0.3  # freed by the TTL of the lost hand-out, no sooner


def test_store_touch_expires(shm_name: str) -> None:
    cfg = CacheConfig(1 << 20, 1 << 18, 1, name=shm_name, handout_ttl=0.2)
    with ShmObjectStore.create(cfg) as w:
        clock = w._ledger.clock = FakeClock()
        w.put("a", _item())
        assert w.touch("a")
        assert not w.is_freeable("a")
        clock.advance(0.25)
        assert w.is_freeable("a")


def test_store_lost_broadcast_handout_neither_pins_nor_revokes(shm_name: str) -> None:
    cfg = CacheConfig(
        1 << 20, 1 << 18, 1, name=shm_name, handout_ttl=0.3, evict_stuck_readers_after=0.2
    )
    with ShmObjectStore.create(cfg) as w, ShmObjectStore.from_handle(w.handle()) as r:
        clock = w._ledger.clock = FakeClock()
        w.put("lost", _item())  # the sender never delivers it and never releases it
        i = 0

        def reader_progresses_and_lost_lapses() -> bool:
            nonlocal i
            i += 1
            r.get(w.put(f"k{i}", _item()))  # a healthy reader reads everything it gets
            w.evict()  # probes the head's debtors: must not revoke the healthy reader
            return "lost" not in w

        t0 = clock.now
        while not reader_progresses_and_lost_lapses():
            clock.advance(0.05)
        assert clock.now - t0 > 0.2  # the revocation limit passed meanwhile
        assert not r.read_path.slot.revoked  # type: ignore[union-attr]
        assert r.get(w.put("after", _item()))["x"][5] == 5
