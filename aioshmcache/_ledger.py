"""The writer's hand-out ledger: who owes which hand-out of which entry, and when it lapses.

Pure bookkeeping: no shared memory, no locks, and time comes from an injectable ``clock`` so
that every rule below can be tested deterministically. The store feeds it (hand-outs it makes,
acknowledgements it drains from the readers' logs, sessions that died or were revoked) and asks
it whether an entry may be freed.

A **hand-out** is one reference given out for an entry, numbered by a ``seq`` that increases
over the whole ledger. An entry is **free** when it is not pinned, not touched, and owes nothing.

Rules:

* **Broadcast.** A hand-out is owed by exactly the reader sessions attached when it was made;
  each settles it once by acknowledging ``(id, seq)``. A session that dies, closes or is revoked
  owes nothing any more (:meth:`HandoutLedger.drop_session`); a session attached later owes
  nothing older.
* **One-of-N.** Any one reader settles a hand-out. Each hand-out expires ``handout_ttl``
  seconds after *it* was made (not after the entry's last hand-out): one lost hand-out of a
  frequently requested item pins it for at most ``handout_ttl``.
* **Lost hand-outs in broadcast.** A debt of session ``s`` for hand-out ``seq`` *lapses* once
  ``seq`` is at least ``handout_ttl`` old **and** ``s`` has acknowledged a later hand-out (a
  higher ``seq``): the reader is making progress, so the old reference never reached it (the
  sender lost it and never released it). A reader that acknowledges nothing keeps its debts:
  that is a stuck reader, not a lost hand-out.
* **Stuck readers** (``evict_stuck_readers_after``, see :meth:`HandoutLedger.stuck`): a session
  is stuck on an entry when it owes one of the entry's hand-outs that is older than the limit
  and has acknowledged nothing since that hand-out was made. A healthy reader whose only debt
  is a lost hand-out keeps acknowledging newer ones, so it is never revoked for it.
* **Touch.** :meth:`HandoutLedger.touch` protects an entry until its next hand-out, or for
  ``handout_ttl`` seconds if no hand-out follows.
* **Pins** are counted per entry and block freeing while any is held.

**Only active entries are tracked.** An entry that owes nothing, is not pinned and not touched
has no ``Debts`` object at all: the writer may hold hundreds of thousands of settled items, and
a Python object per item makes every full garbage collection walk them all (~250 ns each here).
``debts_of(cid)`` makes one when needed (a hand-out owed by someone, a pin, a touch); the
ledger drops it again (``_retire``) as soon as it is idle. A ``Debts`` passed in by the caller is
(re-)registered by any operation that gives it something to track.

Acknowledgements are timed when the writer drains them, not when the reader wrote them; a drain
happens at least every time the writer needs room, so the difference is bounded by the writer's
own activity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ._core_api import core

__all__ = ["Debts", "HandoutLedger"]

#: ``settle_all``'s loop in the compiled core, as far as it goes (the pure core's goes nowhere)
_settle_pairs = core.settle_pairs


class Debts:
    """The ledger's part of one entry: its outstanding hand-outs, pins and touch."""

    __slots__ = ("debt", "id", "out", "pins", "touched_at")

    def __init__(self, cid: int) -> None:
        self.id = cid
        #: outstanding hand-outs, in hand-out order: seq -> (owers, when it was handed out). The
        #: owers are the sessions still owing it (broadcast), or None (one-of-N): a tuple,
        #: replaced as they settle; a put's first one is the live sessions' own tuple
        #: (``Acknowledgements.live_sessions``), shared, not copied
        self.out: dict[int, tuple[tuple[int, ...] | None, float]] = {}
        self.debt = 0  # unsettled (hand-out, session) pairs; one per one-of-N hand-out
        self.pins = 0  # request-scoped pins
        self.touched_at: float | None = None  # a standalone touch, until the next hand-out

    @property
    def touched(self) -> bool:
        """Whether a touch is in force (it may have expired: see :meth:`HandoutLedger.is_free`)."""
        return self.touched_at is not None


class HandoutLedger:
    """Debts of hand-outs per entry and session, with the expiry rules of the module docstring."""

    __slots__ = ("_progress", "clock", "entries", "handout_ttl", "next_seq", "one_of_n", "owed")

    def __init__(
        self,
        *,
        one_of_n: bool,
        handout_ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.one_of_n = one_of_n
        self.handout_ttl = handout_ttl
        self.clock = clock
        self.entries: dict[int, Debts] = {}  # chunk id -> its debts (active entries only)
        self.owed: dict[int, int] = {}  # session -> hand-outs it still owes
        # session -> (highest seq it acknowledged, when that acknowledgement was applied)
        self._progress: dict[int, tuple[int, float]] = {}
        self.next_seq = 1

    # --- entries ----------------------------------------------------------------------------
    def add(self, e: Debts) -> None:
        """Track an entry (optional: operations that give it something to track register it)."""
        self.entries[e.id] = e

    def get(self, cid: int) -> Debts | None:
        """The debts of entry ``cid`` if it has any (owed, pinned or touched), else None."""
        return self.entries.get(cid)

    def debts_of(self, cid: int) -> Debts:
        """The debts of entry ``cid``, made (and registered) if it had none."""
        e = self.entries.get(cid)
        if e is None:
            e = self.entries[cid] = Debts(cid)
        return e

    def _track(self, e: Debts) -> None:
        if e.id not in self.entries:
            self.entries[e.id] = e

    def _retire(self, e: Debts) -> None:
        """Stop tracking ``e`` once it is idle (nothing owed, pinned or touched)."""
        if not e.out and not e.pins and e.touched_at is None and self.entries.get(e.id) is e:
            del self.entries[e.id]

    def forget(self, cid: int) -> Debts | None:
        """Stop tracking an entry that was freed; its debts disappear with it."""
        e = self.entries.pop(cid, None)
        if e is not None and e.debt > 0 and not self.one_of_n:
            for owers, _t in e.out.values():
                for s in owers or ():
                    self._owe(s, -1)
        return e

    def clear(self) -> None:
        """Forget every entry and every debt (a new epoch)."""
        self.entries.clear()
        self.owed.clear()

    # --- hand-outs and settlement ---------------------------------------------------------
    def hand_out(self, e: Debts, owers: Iterable[int] = ()) -> int:
        """Record a hand-out of ``e`` owed by ``owers`` (ignored in one-of-N); returns its seq.

        The clock is read first, before anything changes (it may be a test's Python code, which
        may raise or change the ledger), as the compiled hand-out reads it."""
        sessions = () if self.one_of_n else tuple(owers)  # the same tuple if it is one
        now = self.clock() if self.one_of_n or sessions else 0.0
        seq = self.next_seq
        self.next_seq = seq + 1
        if self.one_of_n:
            self._track(e)
            e.out[seq] = (None, now)
            e.debt += 1
        elif sessions:
            self._track(e)
            e.out[seq] = (sessions, now)
            e.debt += len(sessions)
            owed = self.owed
            for s in sessions:
                owed[s] = owed.get(s, 0) + 1
        e.touched_at = None
        self._retire(e)
        return seq

    def hand_out_id(self, cid: int, owers: Sequence[int]) -> int:
        """``hand_out`` by chunk id: makes no ``Debts`` when nobody owes it and none exists."""
        e = self.entries.get(cid)
        if e is not None:
            return self.hand_out(e, owers)
        if not self.one_of_n and not owers:
            seq = self.next_seq
            self.next_seq = seq + 1
            return seq  # owed by nobody, nothing pinned or touched: just a number
        now = self.clock()  # first, as in ``hand_out``
        seq = self.next_seq
        self.next_seq = seq + 1
        e = self.entries[cid] = Debts(cid)
        if self.one_of_n:
            e.out[seq] = (None, now)
            e.debt = 1
        else:  # the common put: a new entry owed by the live sessions, in one go
            owers = tuple(owers)  # the same tuple if it is one
            e.out[seq] = (owers, now)
            e.debt = len(owers)
            owed = self.owed
            for s in owers:
                owed[s] = owed.get(s, 0) + 1
        return seq

    def settle(self, cid: int, seq: int, session: int) -> bool:
        """Session ``session`` acknowledged hand-out ``seq`` of entry ``cid``; True if it owed it.

        Every acknowledgement counts as progress of its session (the lost hand-out rule), even
        one of an entry already freed.
        """
        prev = self._progress.get(session)
        self._progress[session] = (seq if prev is None else max(seq, prev[0]), self.clock())
        e = self.entries.get(cid)
        if e is None or seq not in e.out:
            return False  # not outstanding (released, expired, or never handed to this reader)
        owers, t = e.out[seq]
        if owers is None:  # one-of-N: any reader settles it
            del e.out[seq]
            e.debt -= 1
            self._retire(e)
            return True
        if session not in owers:
            return False
        e.debt -= 1
        self._owe(session, -1)
        if len(owers) > 1:
            e.out[seq] = (_without(owers, session), t)
        else:
            del e.out[seq]
            self._retire(e)
        return True

    def settle_all(self, acks: list[int], session: int) -> int:
        """:meth:`settle` of each ``(cid, seq)`` pair in ``acks`` (flat: cid, seq, cid, ...),
        in order, by ``session``; returns how many it owed. One clock read for the batch (the
        time a drain applied them), and the common case inline: a broadcast hand-out whose
        last debt this is. The compiled core runs the loop below as far as it goes
        (``settle_pairs``: every pair, unless one holds a type it does not know); this loop
        goes on from there.
        """
        if not acks:
            return 0
        now = self.clock()
        prev = self._progress.get(session)
        top = max(acks[1::2])
        self._progress[session] = (top if prev is None else max(top, prev[0]), now)
        settled, start = _settle_pairs(self, acks, session)
        return settled + self.settle_from(acks, session, start)

    def settle_from(self, acks: list[int], session: int, start: int) -> int:
        """``settle_all``'s loop from pair ``acks[start]`` on, its clock and progress already
        recorded: the reference, where the compiled core stopped (or did not start). Returns
        how many of those pairs ``session`` owed."""
        settled = 0
        entries, owed = self.entries, self.owed
        for k in range(start, len(acks), 2):
            cid, seq = acks[k], acks[k + 1]
            e = entries.get(cid)
            if e is None:
                continue
            out = e.out
            pair = out.get(seq)
            if pair is None:
                continue  # not outstanding (released, expired, or never handed to this reader)
            owers = pair[0]
            if owers is None:  # one-of-N: any reader settles it
                del out[seq]
                e.debt -= 1
            elif session in owers:
                e.debt -= 1
                owed[session] = owed.get(session, 0) - 1
                if len(owers) > 1:
                    out[seq] = (_without(owers, session), pair[1])
                    settled += 1
                    continue
                del out[seq]
            else:
                continue
            settled += 1
            if not out and not e.pins and e.touched_at is None:  # _retire, inline
                del entries[cid]
        return settled

    def release(self, cid: int, seq: int) -> bool:
        """Undo hand-out ``seq`` of ``cid`` (it never reached a reader). False if not owed."""
        e = self.entries.get(cid)
        if e is None or seq not in e.out:
            return False
        owers, _t = e.out.pop(seq)
        if owers is None:
            e.debt -= 1
        else:
            e.debt -= len(owers)
            for s in owers:
                self._owe(s, -1)
        self._retire(e)
        return True

    def drop_session(self, session: int) -> None:
        """A reader died, closed or was revoked: it owes nothing any more."""
        self.owed.pop(session, None)
        self._progress.pop(session, None)
        if self.one_of_n:
            return
        emptied: list[Debts] = []
        for e in self.entries.values():
            if not e.debt:
                continue
            for seq, (owers, t) in list(e.out.items()):
                if owers and session in owers:
                    e.debt -= 1
                    if len(owers) > 1:
                        e.out[seq] = (_without(owers, session), t)
                    else:
                        del e.out[seq]
            if not e.out:
                emptied.append(e)
        for e in emptied:
            self._retire(e)

    # --- pins and touches -----------------------------------------------------------------
    def pin(self, e: Debts) -> None:
        """Take one request-scoped pin of ``e``."""
        self._track(e)
        e.pins += 1

    def unpin(self, e: Debts) -> None:
        """Undo one pin of ``e`` (never below zero)."""
        if e.pins > 0:
            e.pins -= 1
            if not e.pins:
                self._retire(e)

    def touch(self, e: Debts) -> None:
        """Protect ``e`` until its next hand-out, or ``handout_ttl`` seconds at most."""
        self._track(e)
        e.touched_at = self.clock()

    def untouch(self, e: Debts) -> None:
        """End a touch (the entry was invalidated)."""
        e.touched_at = None
        self._retire(e)

    # --- freeing --------------------------------------------------------------------------
    def expire(self, e: Debts) -> int:
        """Apply the expiry rules to ``e`` now; returns how many debts lapsed."""
        if not e.out and e.touched_at is None:
            return 0
        now = self.clock()
        ttl = self.handout_ttl
        if e.touched_at is not None and now - e.touched_at >= ttl:
            e.touched_at = None
        lapsed = 0
        for seq, (owers, t) in list(e.out.items()):
            if now - t < ttl:
                break  # seqs are in hand-out order, so the rest are younger
            if owers is None:  # one-of-N: this hand-out was never read
                del e.out[seq]
                e.debt -= 1
                lapsed += 1
                continue
            for s in owers:
                p = self._progress.get(s)
                if p is not None and p[0] > seq:  # s moved on: this hand-out never reached it
                    owers = _without(owers, s)
                    e.debt -= 1
                    self._owe(s, -1)
                    lapsed += 1
            if owers:
                e.out[seq] = (owers, t)
            else:
                del e.out[seq]
        self._retire(e)
        return lapsed

    def is_free(self, e: Debts) -> bool:
        """Whether ``e`` may be freed now (pins, touch and debts, after expiry)."""
        self.expire(e)
        return not e.pins and e.touched_at is None and e.debt <= 0

    def debtors(self, e: Debts) -> dict[int, float]:
        """Sessions owing a hand-out of ``e`` -> when the oldest one they owe was made."""
        since: dict[int, float] = {}
        for owers, t in e.out.values():
            for s in owers or ():
                if t < since.get(s, float("inf")):
                    since[s] = t
        return since

    def stuck(self, e: Debts, after: float) -> list[int]:
        """Sessions owing ``e`` a hand-out older than ``after`` s with no acknowledgement since."""
        now = self.clock()
        out: list[int] = []
        for owers, t in e.out.values():
            if now - t <= after:
                break
            for s in owers or ():
                if s in out:
                    continue
                p = self._progress.get(s)
                if p is None or p[1] < t:
                    out.append(s)
        return out

    def last_acknowledged(self, session: int) -> tuple[int, float] | None:
        """(highest seq, when) of ``session``'s acknowledgements, or None if it made none."""
        return self._progress.get(session)

    # --- internals ------------------------------------------------------------------------
    def _owe(self, session: int, n: int) -> None:
        self.owed[session] = self.owed.get(session, 0) + n


def _without(owers: tuple[int, ...], session: int) -> tuple[int, ...]:
    """``owers`` without its first ``session`` (as ``list.remove``; ``session`` is in it)."""
    i = owers.index(session)
    return owers[:i] + owers[i + 1 :]
