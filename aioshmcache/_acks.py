"""Layer 5, acknowledgements: the writer's side of the readers' logs and liveness.

``Acknowledgements`` is the part of the writer (``StoreWriter``) that connects the hand-out
ledger to shared memory. It owns what it knows of each reader slot (session, cursor, alive,
revoked: ``SlotState``) and the live sessions a broadcast hand-out is owed by; it drains the
readers' acknowledgement logs into the ledger, records each hand-out (:meth:`hand_out`), notices
sessions that attach, close, die (their kernel lock is free) or are revoked, and publishes each
slot's debt (``WS_OWED``) for ``inspect``.

It holds no lock of its own: the writer calls it holding the writer lock.
"""

from __future__ import annotations

import logging

from ._core_api import core
from ._layout import (
    RS_HEAD,
    RS_PID,
    RS_SESSION,
    RS_START,
    WS_CONSUMED,
    WS_OWED,
    WS_REVOKED,
    WS_SESSION,
)
from ._ledger import Debts, HandoutLedger
from ._reader_table import ReaderTable, SlotState

__all__ = ["Acknowledgements"]

log = logging.getLogger("aioshmcache")

_NOBODY: tuple[int, ...] = ()  # the owers of a one-of-N hand-out

#: the drain in the compiled core, or None where it leaves it to the reference (the pure core
#: always does)
_drain_logs = core.drain_logs


class Acknowledgements:
    """The writer's reading of the readers' logs (see the module docstring)."""

    __slots__ = (
        "_known_sessions",
        "_ledger",
        "_readers",
        "_undrained",
        "live_sessions",
        "live_slots",
        "one_of_n",
        "slots",
    )

    def __init__(self, readers: ReaderTable, ledger: HandoutLedger, *, one_of_n: bool) -> None:
        self._readers = readers
        self._ledger = ledger
        self.one_of_n = one_of_n
        self.slots = [SlotState() for _ in range(readers.n_slots)]
        self._known_sessions = [0] * readers.n_slots
        #: (slot, session) of the live readers, and their sessions alone: the tuple each
        #: broadcast hand-out records as its owers (the ledger replaces, never changes, it)
        self.live_slots: list[tuple[int, int]] = []
        self.live_sessions: tuple[int, ...] = ()
        self._undrained = 0  # hand-outs since the last drain

    def hand_out(self, cid: int) -> int:
        """Record a hand-out of chunk ``cid`` (owed by the live sessions); its sequence number.

        Drains the logs once the hand-outs since the last drain could fill half a log.
        """
        ledger = self._ledger
        if self.one_of_n:
            seq = ledger.hand_out_id(cid, _NOBODY)
        else:
            if self._readers.sessions() != self._known_sessions:
                self.sync_sessions()
            live = self.live_sessions
            seq = ledger.hand_out_id(cid, live)
            if live:
                owed, words = ledger.owed, self._readers.owed_words
                for i, s in self.live_slots:  # the owing slots' debts, for inspect
                    words[i] = owed[s]
        self._undrained += 1
        if self._undrained * 2 >= self._readers.log_entries:
            self.drain()
        return seq

    def sync_sessions(self) -> None:
        """Notice slots whose session changed (attach, close, a replacement after a death)."""
        t = self._readers
        now = t.sessions()
        if now == self._known_sessions:
            return
        self._known_sessions = now
        for slot, st in enumerate(self.slots):
            s = now[slot]
            if s == st.session:
                continue
            if st.session:
                self._ledger.drop_session(st.session)
            st.session = s
            st.alive = s != 0
            st.revoked = 0
            if not self.one_of_n:
                st.cursor = t.word(slot, RS_START)
                t.set_word(slot, WS_CONSUMED, st.cursor)
            t.set_word(slot, WS_OWED, 0)
            t.set_word(slot, WS_SESSION, s)  # last: WS_OWED is this session's from now on
        self._refresh_live()

    def _refresh_live(self) -> None:
        """Recompute the live sessions a broadcast hand-out is owed by (after any change)."""
        self.live_slots = [(i, st.session) for i, st in enumerate(self.slots) if st.alive]
        self.live_sessions = tuple(s for _i, s in self.live_slots)

    def publish_owed(self) -> None:
        """Publish each live slot's debt for ``inspect`` and ``reader_info`` (``WS_OWED``)."""
        owed = self._ledger.owed
        t = self._readers
        for slot, st in enumerate(self.slots):
            if st.session:
                t.set_word(slot, WS_OWED, max(0, owed.get(st.session, 0)))

    def drain(self) -> int:
        """Apply every acknowledgement written since the last drain; returns how many.

        The compiled core drains in one call when no slot's session changed and every log is
        sane (``drain_logs``); the loop below is the reference, and runs for everything else.
        """
        n = _drain_logs(self)
        if n is not None:
            return n
        t = self._readers
        n_total = 0
        self._undrained = 0
        if t.sessions() == self._known_sessions and t.heads() == [st.cursor for st in self.slots]:
            return 0  # nothing new: the common case, two strided reads
        settle_all = self._ledger.settle_all
        for slot, st in enumerate(self.slots):
            for _ in range(3):
                s = t.word(slot, RS_SESSION)
                if s != st.session:
                    self.sync_sessions()
                head = t.word(slot, RS_HEAD)
                if t.word(slot, RS_SESSION) == st.session:
                    break
            else:
                continue
            cur = st.cursor
            if head == cur:
                continue
            n = head - cur
            if n < 0 or n > t.log_entries:  # a corrupted slot: never trust it
                log.warning("reader slot %d has an inconsistent log; ignoring it", slot)
                st.cursor = head
                t.set_word(slot, WS_CONSUMED, head)
                continue
            logv = t.log_view(slot)
            n_log = t.log_entries
            start = cur % n_log  # entries cur..head-1, flat (id, seq, id, seq, ...)
            if start + n <= n_log:
                acks = logv[2 * start : 2 * (start + n)].tolist()
            else:
                acks = logv[2 * start :].tolist() + logv[: 2 * (start + n - n_log)].tolist()
            logv.release()
            if self.one_of_n or (st.session and st.alive):
                settle_all(acks, st.session)
            st.cursor = head
            t.set_word(slot, WS_CONSUMED, head)
            n_total += n
        self.publish_owed()
        return n_total

    def probe_debtors(self, e: Debts, evict_after: float | None) -> bool:
        """Probe the readers owing ``e``: drop dead ones' debts, revoke the ones stuck longer
        than ``evict_after`` seconds (None: never). True if any was dropped."""
        since = self._ledger.debtors(e)
        if not since:
            return False
        changed = False
        stuck = set(self._ledger.stuck(e, evict_after)) if evict_after is not None else set()
        for slot, st in enumerate(self.slots):
            s = st.session
            if not s or not st.alive or s not in since:
                continue
            if not self._readers.probe(slot):
                log.info(
                    "reader slot %d (pid %d) is dead: dropping its debts",
                    slot,
                    self._readers.word(slot, RS_PID),
                )
                st.alive = False
                self._ledger.drop_session(s)
                changed = True
            elif s in stuck:
                log.warning(
                    "reader slot %d acknowledged nothing for %.1f s while owing: revoking it",
                    slot,
                    evict_after,
                )
                self._readers.set_word(slot, WS_REVOKED, s)
                st.alive = False
                st.revoked = s
                self._ledger.drop_session(s)
                changed = True
        if changed:
            self._refresh_live()
            self.publish_owed()
        return changed
