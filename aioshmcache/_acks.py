"""Layer 5, acknowledgements: the writer's side of the readers' logs and liveness.

``Acknowledgements`` is the part of the writer (``StoreWriter``) that connects the hand-out
ledger to shared memory: it drains the readers' acknowledgement logs into the ledger, notices
sessions that attach, close, die (their kernel lock is free) or are revoked, and publishes each
slot's debt (``WS_OWED``) for ``inspect``. The writer inherits it; it works on the
writer's state, declared below for the type checker.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ._layout import RS_HEAD, RS_SESSION, RS_START, WS_CONSUMED, WS_OWED
from ._ledger import HandoutLedger
from ._readers import ReaderTable, SlotState

__all__ = ["Acknowledgements"]

log = logging.getLogger("aioshmcache")


class Acknowledgements:
    """The writer's reading of the readers' logs (see the module docstring)."""

    if TYPE_CHECKING:  # the writer's state this part works on (set by ``StoreWriter``)
        _readers: ReaderTable
        _ledger: HandoutLedger
        one_of_n: bool
        _slots: list[SlotState]
        _known_sessions: list[int]
        _live_slots: list[tuple[int, int]]
        _live_sessions: list[int]
        _undrained: int
        _lock: threading.RLock

        def _check_writer(self) -> None: ...
    else:  # no state of its own: the writer's (hidden from the checker, which
        __slots__ = ()  # would then refuse every assignment to the writer's state here)

    def _sync_sessions(self) -> None:
        """Notice slots whose session changed (attach, close, a replacement after a death)."""
        t = self._readers
        now = t.sessions()
        if now == self._known_sessions:
            return
        self._known_sessions = now
        for slot, st in enumerate(self._slots):
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
        self._refresh_live()

    def _refresh_live(self) -> None:
        """Recompute the live sessions a broadcast hand-out is owed by (after any change)."""
        self._live_slots = [(i, st.session) for i, st in enumerate(self._slots) if st.alive]
        self._live_sessions = [s for _i, s in self._live_slots]

    def _publish_owed(self) -> None:
        """Publish each live slot's debt for ``inspect`` and ``reader_info`` (``WS_OWED``)."""
        owed = self._ledger.owed
        t = self._readers
        for slot, st in enumerate(self._slots):
            if st.session:
                t.set_word(slot, WS_OWED, max(0, owed.get(st.session, 0)))

    def drain(self) -> int:
        """Apply every acknowledgement written since the last drain; returns how many."""
        self._check_writer()
        with self._lock:
            t = self._readers
            n_total = 0
            self._undrained = 0
            if t.sessions() == self._known_sessions and t.heads() == [
                st.cursor for st in self._slots
            ]:
                return 0  # nothing new: the common case, two strided reads
            settle_all = self._ledger.settle_all
            for slot, st in enumerate(self._slots):
                for _ in range(3):
                    s = t.word(slot, RS_SESSION)
                    if s != st.session:
                        self._sync_sessions()
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
            self._publish_owed()
            return n_total
