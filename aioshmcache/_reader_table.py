"""Layer 3: the reader table — crash-safe reader slots and single-writer acknowledgement logs.

The slot layout (reader-written ``RS_`` and writer-written ``WS_`` words, then the log) is in
``_layout``.

A reader claims a slot by taking the OFD lock on byte ``1 + slot`` of the segment; the kernel
drops the lock when the reader dies, so the writer tests liveness with ``F_OFD_GETLK`` without
the reader's help (a zombie has closed its files: it is dead; pids are never trusted). Every word
has exactly one writing process, so there is no lock and no read-modify-write across processes:
an acknowledgement is one store of the id into the log and one store of the new head. The writer
drains the logs when it needs room; acknowledgements never touch chunk memory, which the writer
may already have reused.

The log's head and the writer's consumed mark are 64-bit counters: a reader computes with them
modulo 2**64, as the compiled core does (``_core_read.c``), so words another process wrote (a
hostile writer can set them to anything) never make an acknowledgement fail; at worst that
reader's acknowledgements are lost to the writer, which then sees it owe.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Final

from ._layout import (
    RS_ATTACHED,
    RS_HEAD,
    RS_PID,
    RS_SESSION,
    RS_START,
    SLOT_HEADER,
    WS_CONSUMED,
    WS_OWED,
    WS_REVOKED,
    WS_SESSION,
)
from ._segment import Segment, ofd_lock, ofd_probe, ofd_unlock
from ._types import ReaderSlotInfo
from .errors import ClosedCacheError, ReaderEvictedError, ReaderLimitError

__all__ = ["ReaderSlot", "ReaderTable", "SlotState", "reader_slots_info"]

_U64: Final = (1 << 64) - 1  # the counters' modulus, less one (see the module docstring)


class ReaderTable:
    """The table of reader slots of one segment (shared by writer and readers)."""

    # the compiled hand-out reads ``_sessions``, ``owed_words`` and ``log_entries`` at the
    # slots' offsets (a look-up by name in an instance dict costs ~150 instructions)
    __slots__ = (
        "_all",
        "_heads",
        "_sessions",
        "_stride",
        "log_entries",
        "n_slots",
        "owed_words",
        "segment",
        "slot_size",
    )

    def __init__(self, segment: Segment) -> None:
        # the geometry checked at attach (or made at create), never the header words again:
        # a process that maps the segment may rewrite them after the check
        layout = segment.layout
        self.segment = segment
        self.n_slots = layout.n_readers
        self.slot_size = layout.slot_size
        self.log_entries = layout.log_entries
        off = layout.reader_off
        region = segment.buf[off : off + self.n_slots * self.slot_size]
        self._all = region.cast("Q")
        self._stride = self.slot_size // 8
        self._sessions = self._all[RS_SESSION :: self._stride]  # one word per slot, strided
        self._heads = self._all[RS_HEAD :: self._stride]
        #: every slot's ``WS_OWED`` word, strided (written by the writer only)
        self.owed_words = self._all[WS_OWED :: self._stride]

    def heads(self) -> list[int]:
        """Every slot's log head, read in one go."""
        return self._heads.tolist()

    def sessions(self) -> list[int]:
        """Every slot's session word (0: free), read in one go."""
        return self._sessions.tolist()

    def word(self, slot: int, index: int) -> int:
        """Word ``index`` (an ``RS_`` or ``WS_`` index) of slot ``slot``."""
        return int(self._all[slot * self._stride + index])

    def set_word(self, slot: int, index: int, value: int) -> None:
        """Store word ``index`` of slot ``slot`` (only the word's one writing process does)."""
        self._all[slot * self._stride + index] = value

    def header_view(self, slot: int) -> memoryview:
        """The slot's header: word ``k`` is its ``RS_`` / ``WS_`` word ``k``."""
        base = slot * self._stride
        return self._all[base : base + SLOT_HEADER // 8]

    def log_view(self, slot: int) -> memoryview:
        """The slot's log: entry ``k`` is words ``2k`` (chunk id) and ``2k + 1`` (seq)."""
        base = slot * self._stride + SLOT_HEADER // 8
        return self._all[base : base + 2 * self.log_entries]

    def probe(self, slot: int) -> bool:
        """Kernel truth: is some process holding slot ``slot``'s lock?"""
        return ofd_probe(self.segment.fd, 1 + slot)

    def release(self) -> None:
        """Release the views of the table (before the segment is closed)."""
        self._sessions.release()
        self._heads.release()
        self.owed_words.release()
        self._all.release()

    # --- reader side -----------------------------------------------------------------------
    def claim(self) -> ReaderSlot:
        """Take a free slot: lock it, then publish a fresh session (``ReaderLimitError``: none)."""
        fd = self.segment.fd
        for slot in range(self.n_slots):
            if not ofd_lock(fd, 1 + slot):
                continue
            session = secrets.randbits(63) | 1
            base = slot * self._stride
            a = self._all
            a[base + RS_PID] = os.getpid()
            a[base + RS_ATTACHED] = time.time_ns()
            a[base + RS_START] = a[base + RS_HEAD]
            a[base + RS_SESSION] = session  # last: the writer sees a complete slot
            return ReaderSlot(self, slot, session)
        raise ReaderLimitError(
            f"all {self.n_slots} reader slots of {self.segment.name!r} are taken"
        )


class ReaderSlot:
    """One claimed slot: this reader's acknowledgement log and its revocation flag."""

    def __init__(self, table: ReaderTable, slot: int, session: int) -> None:
        self.table = table
        self.slot = slot
        self.session = session
        self._words = table.header_view(slot)
        self._log = table.log_view(slot)
        self._n = table.log_entries
        self.closed = False
        # one process, several threads (the asyncio facade reads in worker threads): the log
        # head is a read-modify-write, so acknowledgements from two threads must not interleave
        self._ack_lock = threading.Lock()
        self._overflow: list[tuple[int, int]] = []  # acknowledgements waiting for log room

    @property
    def revoked(self) -> bool:
        """Whether the writer revoked this session."""
        return self._words[WS_REVOKED] == self.session

    def check_revoked(self) -> None:
        """``ReaderEvictedError`` if the writer revoked this session."""
        if self._words[WS_REVOKED] == self.session:
            raise ReaderEvictedError(
                f"reader slot {self.slot} was revoked by the writer (stuck past its deadline)"
            )

    def ready(self) -> bool:
        """Whether a read may acknowledge through this slot as usual: not revoked, and no
        acknowledgement waiting for log room (one call for the read path's usual case)."""
        return self._words[WS_REVOKED] != self.session and not self._overflow

    @property
    def overflowing(self) -> bool:
        """Whether acknowledgements wait for log room (see :meth:`flush`)."""
        return bool(self._overflow)

    @property
    def acknowledged(self) -> int:
        """Acknowledgements written by this session so far."""
        return (self._words[RS_HEAD] - self._words[RS_START]) & _U64

    def ack(self, cid: int, seq: int) -> None:
        """Record that chunk ``cid`` was read and verified: two aligned stores, no syscall.

        Never blocks: if the log is full (the writer has not drained it), the id waits in a
        local overflow list that the next acknowledgement (and the close) flushes first. At
        most one log's worth waits, the newest: a log that stays full that long is one a
        hostile process keeps full (its consumed mark pinned), which would grow the list by one
        per read without bound; the older ones are lost to that writer, which sees them owed.
        """
        lock = self._ack_lock
        lock.acquire()  # not ``with``: measured 0.27 -> 0.10 us, once per read
        try:
            if self.closed:
                raise ClosedCacheError("the reader slot is closed")
            if self._overflow:
                self._overflow.append((cid, seq))
                self._flush()
                if len(self._overflow) > self._n:
                    del self._overflow[0]  # the oldest (see above)
                return
            w = self._words
            head: int = w[RS_HEAD]  # a "Q" view's items are ints already
            n = self._n
            if (head - w[WS_CONSUMED]) & _U64 >= n:  # modulo 2**64 (module docstring)
                self._overflow.append((cid, seq))
                return
            k = 2 * (head % n)
            log = self._log
            log[k] = cid
            log[k + 1] = seq
            w[RS_HEAD] = (head + 1) & _U64
        finally:
            lock.release()

    def _flush(self) -> None:
        """Move overflowed acknowledgements into the log as far as it has room."""
        w = self._words
        head = int(w[RS_HEAD])
        room = self._n - ((head - int(w[WS_CONSUMED])) & _U64)
        k = min(room, len(self._overflow))
        for cid, seq in self._overflow[:k]:
            j = 2 * (head % self._n)
            self._log[j] = cid
            self._log[j + 1] = seq
            head = (head + 1) & _U64
        if k > 0:
            w[RS_HEAD] = head
            del self._overflow[:k]

    def flush(self) -> int:
        """Retry overflowed acknowledgements; returns how many still wait."""
        with self._ack_lock:
            if self._overflow and not self.closed:
                self._flush()
            return len(self._overflow)

    def close(self) -> None:
        """Free the slot: mark every acknowledgement as the start, clear the session, unlock.

        Acknowledgements still waiting for log room are moved into the log first, as far as it
        has room (a one-of-N hand-out is nobody's debt that the closed session's drop settles:
        one lost here stayed unevictable for ``handout_ttl``). ``RS_START = RS_HEAD`` next: the
        writer starts reading a slot whose session changed at its ``RS_START``, so a free slot
        then has nothing to read, however many acknowledgements the closed session wrote (more
        than the log holds is no inconsistency).
        """
        seg = self.table.segment
        if seg.forked:  # a forked child's copy: the lock may have been held by a parent thread
            if self.closed:
                return
            self.closed = True
        else:
            with self._ack_lock:
                if self.closed:
                    return
                self.closed = True
        if not seg.closed and not seg.forked:
            w = self._words
            if w[RS_SESSION] == self.session:
                if self._overflow:
                    self._flush()
                    self._overflow.clear()
                w[RS_START] = w[RS_HEAD]
                w[RS_SESSION] = 0
            ofd_unlock(seg.fd, 1 + self.slot)
        self._words.release()
        self._log.release()


@dataclass(slots=True)
class SlotState:
    """The writer's view of one slot (slotted: the compiled drain reads it at its offsets)."""

    session: int = 0
    cursor: int = 0
    alive: bool = False
    revoked: int = 0


def reader_slots_info(table: ReaderTable, *, probe: bool) -> list[ReaderSlotInfo]:
    """Every reader slot as seen from outside: session, pid, liveness, acknowledgements, lag.

    ``lag`` is the number of hand-outs the slot's reader owes, from shared memory alone: the
    debt the writer last published (``WS_OWED``, kept current at every hand-out) less the
    acknowledgements the reader wrote since the writer last read its log (``RS_HEAD -
    WS_CONSUMED``; every difference of these counters is taken modulo 2**64, as the slot's own
    are). So an idle writer, which drains nothing, is still shown right from outside
    (``inspect``); right after a drain the second term is 0. A difference outside the log's size
    is a slot the writer has not synced yet (a session just changed): nothing is subtracted.
    Until the next drain an acknowledgement of a hand-out the reader did not owe (one made
    before it attached) makes the count one low, never negative. A session the writer has not
    synced yet (``WS_SESSION``, the session ``WS_OWED`` is of, names another) owes nothing: the
    writer hands out only to the sessions it knows, and ``WS_OWED`` is still a closed session's.
    """
    out = []
    for slot in range(table.n_slots):
        session = table.word(slot, RS_SESSION)
        if not session:
            out.append(ReaderSlotInfo(slot, False, False, 0, 0, 0, False))
            continue
        owed = table.word(slot, WS_OWED) if table.word(slot, WS_SESSION) == session else 0
        head = table.word(slot, RS_HEAD)
        unread = (head - table.word(slot, WS_CONSUMED)) & _U64  # modulo 2**64 (module doc)
        if 0 < unread <= table.log_entries:
            owed = max(0, owed - unread)
        out.append(
            ReaderSlotInfo(
                slot=slot,
                attached=True,
                alive=probe and table.probe(slot),
                pid=table.word(slot, RS_PID),
                acknowledged=(head - table.word(slot, RS_START)) & _U64,
                lag=owed,
                revoked=table.word(slot, WS_REVOKED) == session,
            )
        )
    return out
