"""Layer 5: ``ShmObjectStore`` — keys to chunks, hand-outs, acknowledgements and FIFO eviction.

The public face of one segment, writer or reader. It is made of three parts:

* the **writer's** index ``key -> chunk id`` and a row per chunk (key, address, length,
  position, tag) over the ring (see "Compact writer state" below), with puts in
  three short steps so that the asyncio facade can copy outside its lock: :meth:`reserve`
  (check, allocate), :meth:`write_reserved` (the copy, no shared state), and :meth:`commit`
  (publish, index, first hand-out) or :meth:`abort`;
* the **hand-out ledger** (``_ledger.HandoutLedger``, pure bookkeeping): who owes which
  hand-out, pins, touches, and the rules by which debts lapse (one-of-N expiry per hand-out,
  lost hand-outs in broadcast, stuck readers);
* the **read path** (``_reading.ReadPath``): resolve, verify, copy or view, acknowledge.

A **hand-out** is one ``ShmRef`` returned by :meth:`put` or :meth:`get_cached`, numbered by its
``seq``; every reader that owes it acknowledges exactly that hand-out, ``(id, seq)``, once, after
reading and verifying the bytes (:meth:`get`). Here the writer connects the ledger to shared
memory: it drains the readers' acknowledgement logs into it, notices sessions that attach,
close, die (their kernel lock is free) or are revoked, and publishes each slot's debt
(``WS_OWED``) for ``inspect``.

Eviction is FIFO in allocation order: under put pressure the writer drains the logs, frees free
chunks from the head until the new chunk fits contiguously, probes the kernel locks of the
readers owing the head entry (a dead one's debts are dropped at once), optionally revokes a stuck
one, and waits (up to ``wait_for_space``) on a named semaphore that readers post after
acknowledging while the writer waits. The semaphore only wakes the writer; correctness never
depends on it (a lost post costs one poll interval).

**Second chance** (``CacheConfig(second_chance=True)``, the default). A hit (:meth:`get_cached`,
a hand-out after the put's own) marks the entry. When a put needs room and the head entry is
free (``HandoutLedger.is_free``: nothing owed, pinned, leased or touched; indexed and not being
put), marked, and the put's relocation budget allows, the head chunk is moved to the tail
(``ShmRingBuffer.relocate_head``) instead of freed: the index entry (and its key hint, for a
group shard) then names the new chunk, and the new entry starts unmarked. References to the old
chunk are stale exactly as for an evicted one. Each put relocates at most
:data:`RELOCATE_BUDGET` bytes (chunk sizes) and :data:`RELOCATE_MAX_ITEMS` items; past that,
marked heads are evicted as in plain FIFO.
The pass always ends: a relocated entry is unmarked (it is evicted when the head comes round to
it again) and every relocation spends budget. Before moving anything the pass looks ahead over
the chunks it would visit: when an item that cannot be freed (owed, pinned, being written) comes
before enough room, it evicts in plain FIFO order instead — rotating hot items past a blocked one
would leave the put without room where FIFO finds some.

**Batch eviction.** Once the put fits, the same pass frees a few more free head chunks (at most
:data:`EVICT_SLACK_CHUNKS`, until :data:`EVICT_SLACK_BYTES` beyond the put are free, never more
than 1/16 of the ring), so a run of small puts evicts once per batch instead of at every put.
Both bounds are small on purpose: a burst of lazy frees is what makes a put stall.

**Compact writer state.** A full garbage collection walks every tracked object; a Python object
per cached item costs ~250 ns each (65-90 ms for 250,000 items here, more with the dicts that
point at them). So the writer keeps no object per item: the index maps key -> chunk id, and
each chunk's row is a tuple of str and ints (``_rows``), which the collector untracks, as it
does dicts holding only such values. Only *active* entries (owed, pinned or touched) have a
``Debts`` object in the ledger, and it is dropped again once settled. The second-chance marks
are a dict of chunk id -> None (a set would be walked member by member), and the ring keeps its
FIFO in ``array('q')`` columns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import posix_ipc

from ._hints import Hint, HintTable
from ._layout import (
    DELIVERY_CODES,
    H_BYTES_RELOCATED,
    H_BYTES_USED,
    H_DELIVERY,
    H_EPOCH,
    H_EVICTIONS,
    H_HANDOUT_TTL_MS,
    H_ITEMS,
    H_MAX_OBJECT,
    H_RELOCATIONS,
    H_SECRET,
    H_WAITING,
    LAYOUT_VERSION,
    RS_HEAD,
    RS_PID,
    RS_SESSION,
    RS_START,
    WS_CONSUMED,
    WS_OWED,
    WS_REVOKED,
    Layout,
    chunk_size,
    semaphore_name,
)
from ._ledger import Debts, HandoutLedger
from ._readers import ReaderSlot, ReaderTable, SlotState, reader_slots_info
from ._reading import ReadPath, check_ref_fields
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import EncodePlan, MsgpackSerde, Serde
from ._types import (
    CacheConfig,
    CacheHandle,
    ReaderSlotInfo,
    ShmRef,
    finish_tag,
    reference_tag,
    tag_base,
)
from .errors import (
    CacheFullError,
    ClosedCacheError,
    DuplicateKeyError,
    InvalidReferenceError,
    ObjectTooLargeError,
    RoleError,
    ShmCacheError,
    WriterGoneError,
)

__all__ = ["RawPlan", "Reservation", "ShmObjectStore"]

log = logging.getLogger("aioshmcache")

WAIT_POLL: Final = 0.1  # the longest a waiting writer sleeps between checks (lost-post bound)
INLINE_COPY_UNDER_LOCK: Final = 64 << 10  # put copies this small without letting go the lock
#: Second chance: bytes (chunk sizes) one put may relocate before marked heads are evicted.
#: Relocation copies run where the put reserves, on the event loop for the async facade: 8 MiB
#: moves in 0.3 ms warm (40 us/MiB) to 1.6 ms at cold memory bandwidth here, under the 5 ms a
#: put may take and far under a miss (a preprocessing, milliseconds to tens of milliseconds);
#: it is also the largest preprocessed image the benchmark traces use, so any hot item can get
#: its second chance. In a full ring a move is a short shift back (by the gap between tail and
#: head), and nothing at all when the ring is exactly full.
RELOCATE_BUDGET: Final = 8 << 20
#: ...and at most this many relocations per put (each costs a few microseconds of bookkeeping
#: besides its copy): a relocation is charged at least ``RELOCATE_BUDGET / RELOCATE_MAX_ITEMS``
#: bytes, so a ring of tiny hot items cannot make one put move thousands of them.
RELOCATE_MAX_ITEMS: Final = 32
#: Batch eviction: free up to this many bytes beyond a put's own need in the same pass...
EVICT_SLACK_BYTES: Final = 256 << 10
#: ...but at most this many extra chunks (each costs a few microseconds): never a burst.
EVICT_SLACK_CHUNKS: Final = 16


#: A cached item's row, by chunk id: ``(key, address, length, position, tag_base, tag_epoch)``.
#: A plain tuple of str and ints on purpose (see "Compact writer state" in the module docstring).
_Row = tuple[str, int, int, int, int, int]
_new_ref: Final = tuple.__new__  # ShmRef's fields in order, without its Python-level __new__
_NOBODY: Final[list[int]] = []  # the owers of a one-of-N hand-out (never appended to)


@dataclass(frozen=True)
class RawPlan:
    """A payload copied byte for byte from another segment (a sibling shard's chunk).

    ``source()`` gives a view of the bytes, ``verify()`` raises ``StaleReferenceError`` if they
    changed during the copy: the copy is committed only if it did not.
    """

    nbytes: int
    source: Callable[[], memoryview]
    verify: Callable[[], None]


@dataclass(slots=True)
class Reservation:
    """An allocated chunk whose copy has not been committed yet."""

    key: str
    address: int
    id: int
    plan: EncodePlan | RawPlan
    done: bool = False


class ShmObjectStore:
    """Single-writer / multi-reader object store in one shared-memory segment.

    Create the writer with :meth:`create`; readers attach with :meth:`from_handle` (a
    ``CacheHandle`` or the segment name) and each claims a reader slot.
    """

    def __init__(
        self,
        segment: Segment,
        *,
        writer: bool,
        serde: Serde | None = None,
        config: CacheConfig | None = None,
        probe_interval: float = 0.25,
    ) -> None:
        self._seg = segment
        self._hw = segment.words
        self.ring = ShmRingBuffer(segment, writer=writer)
        self.readers = ReaderTable(segment)
        self.serde: Serde = serde if serde is not None else MsgpackSerde()
        self.is_writer = writer
        self.max_object_bytes = int(self._hw[H_MAX_OBJECT])
        self.one_of_n = int(self._hw[H_DELIVERY]) == DELIVERY_CODES["one_of_n"]
        self.handout_ttl = int(self._hw[H_HANDOUT_TTL_MS]) / 1000.0
        self._secret = int(self._hw[H_SECRET])
        self._nonce = segment.nonce
        self._closed = False
        self._reading = ReadPath(segment, self.ring, self.serde, probe_interval=probe_interval)
        self.hints = HintTable(segment)  # empty unless the segment is a group shard
        self._has_hints = bool(self.hints)  # its size is fixed with the segment
        # writer state
        self._sem: Any = None
        self._config = config
        self.ledger = HandoutLedger(one_of_n=self.one_of_n, handout_ttl=self.handout_ttl)
        self._index: dict[str, int] = {}  # key -> chunk id
        self._rows: dict[int, _Row] = {}  # chunk id -> its row, until the chunk is freed
        # second chance: chunk ids hit since written or moved. A dict of int -> None, not a set:
        # the collector untracks such a dict, while it walks every member of a set (12 ms per
        # full collection with 250,000 marked items)
        self._marked: dict[int, None] = {}
        self._by_id: dict[int, Debts] = self.ledger.entries  # the same dict: active entries only
        self._pending: dict[str, Reservation] = {}
        self._waiting_keys: set[str] = set()
        self._waiters = 0  # threads asleep in _wait (they own the semaphore handle then)
        self._slots = [SlotState() for _ in range(self.readers.n_slots)]
        self._known_sessions = [0] * self.readers.n_slots
        self._live_slots: list[tuple[int, int]] = []  # (slot, session) of live readers
        self._live_sessions: list[int] = []
        self._undrained = 0
        self.evictions = 0
        self.wakeups = 0
        self.relocations = 0  # second chance: chunks moved to the tail instead of evicted
        self.bytes_relocated = 0  # their payload bytes
        self.second_chance = config.second_chance if config is not None else False
        self.relocate_budget = RELOCATE_BUDGET  # per put (tests lower it)
        self.evict_slack = min(EVICT_SLACK_BYTES, self.ring.capacity // 16)
        self.on_evict: Callable[[str], None] | None = None
        self._lock = threading.Lock()  # serialises writer state changes between threads

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        config: CacheConfig,
        *,
        serde: Serde | None = None,
        name: str | None = None,
        hint_slots: int = 0,
    ) -> ShmObjectStore:
        """Create the segment and become its writer (``close`` unlinks it).

        With a fixed name whose previous writer is provably dead, the old segment and its
        semaphore are reclaimed first when ``config.reclaim_dead`` (the default). ``name``
        overrides ``config.name``; ``hint_slots`` sizes the key-hint region (group shards).
        """
        layout = Layout(config.capacity_bytes, config.n_readers, config.ack_log_entries, hint_slots)
        seg = Segment.create(
            name if name is not None else config.name,
            layout,
            max_object_bytes=config.max_object_bytes,
            delivery=config.delivery,
            handout_ttl=config.handout_ttl,
            prefault=config.prefault,
            reclaim_dead=config.reclaim_dead or name is not None,
        )
        try:
            store = cls(seg, writer=True, serde=serde, config=config)
            store._sem = posix_ipc.Semaphore(
                semaphore_name(seg.name, seg.nonce), posix_ipc.O_CREX, 0o600, 0
            )
        except BaseException:
            seg.close()
            raise
        return store

    @classmethod
    def from_handle(
        cls,
        handle: CacheHandle | str | dict[str, Any],
        *,
        serde: Serde | None = None,
        probe_interval: float = 0.25,
    ) -> ShmObjectStore:
        """Attach to a writer's segment as a reader and claim a reader slot.

        ``probe_interval`` bounds how often a read probes the writer's kernel lock (and so how
        long a dead writer can go unnoticed).
        """
        if isinstance(handle, dict):
            handle = CacheHandle.from_dict(handle)
        if isinstance(handle, CacheHandle):
            if handle.layout_version != LAYOUT_VERSION:
                raise InvalidReferenceError(
                    f"handle layout version {handle.layout_version} unknown"
                )
            seg = Segment.attach(handle.name, nonce=handle.nonce)
        else:
            seg = Segment.attach(handle)
        try:
            store = cls(seg, writer=False, serde=serde, probe_interval=probe_interval)
            if not seg.writer_alive():
                raise WriterGoneError(f"the writer of {seg.name!r} is gone")
            store._reading.slot = store.readers.claim()
        except BaseException:
            seg.close()
            raise
        return store

    def handle(self) -> CacheHandle:
        """What a reader needs to attach: name, nonce and layout version."""
        return CacheHandle(self._seg.name, self._seg.nonce, LAYOUT_VERSION)

    @property
    def name(self) -> str:
        """The segment's name in /dev/shm."""
        return self._seg.name

    @property
    def nonce(self) -> int:
        """The random number of this instance of the segment."""
        return self._seg.nonce

    @property
    def epoch(self) -> int:
        """The current epoch (:meth:`clear` starts a new one)."""
        return int(self._hw[H_EPOCH])

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def lock(self) -> threading.Lock:
        """The writer lock: every writer state change holds it (re-entrant use is a bug)."""
        return self._lock

    @property
    def slot(self) -> ReaderSlot | None:
        """This reader's slot (None for the writer)."""
        return self._reading.slot

    def _check_open(self) -> None:
        self._reading.check_open()

    def check_owner(self) -> None:
        """``RoleError`` unless this is the writer, in the process that created it (not a
        forked child); ``ClosedCacheError`` once closed. Every writer method checks it first,
        before it touches shared memory or takes :attr:`lock`."""
        if self._reading.closed or self._seg.forked or not self.is_writer:  # one call when fine
            self._check_open()
            raise RoleError("this is a reader: only the writer puts, hands out and evicts")

    _check_writer = check_owner  # the name the store's own methods use

    # --- writer: look-ups ------------------------------------------------------------------
    def is_cached(self, key: str) -> bool:
        """Pure look-up: no hand-out, no change to eviction order."""
        return key in self._index

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        """Cached keys in FIFO (eviction) order, oldest first."""
        self._check_writer()
        order = {c: i for i, c in enumerate(self.ring.chunk_ids())}
        return sorted(self._index, key=lambda k: order.get(self._index[k], -1))

    def ref_of(self, key: str) -> ShmRef | None:
        """The reference of a cached key, without a hand-out (for inspection and tests)."""
        self._check_writer()
        cid = self._index.get(key)
        return None if cid is None else self._ref(cid)

    def key_of(self, cid: int) -> str | None:
        """The key a live chunk was put under (None once freed; it may be invalidated)."""
        row = self._rows.get(cid)
        return None if row is None else row[0]

    def _ref(self, cid: int, seq: int = 0) -> ShmRef:
        epoch = self._hw[H_EPOCH]  # a "Q" view: already an int
        row = self._rows[cid]
        key, address, length, position, base, tag_epoch = row
        if tag_epoch != epoch:  # the seq-independent part of the tag, once per epoch
            base = tag_base(self._secret, epoch, address, cid, length, position)
            self._rows[cid] = (key, address, length, position, base, epoch)
        return _new_ref(
            ShmRef, (self._nonce, epoch, address, cid, length, finish_tag(base, seq), position, seq)
        )

    # --- writer: put -------------------------------------------------------------------------
    def plan(self, value: object) -> EncodePlan:
        """Serialise the structure (no array bytes copied) and check the size limit."""
        plan = self.serde.plan(value)
        if plan.nbytes > self.max_object_bytes:
            raise ObjectTooLargeError(
                f"object of {plan.nbytes} bytes exceeds max_object_bytes={self.max_object_bytes}",
                nbytes=plan.nbytes,
            )
        return plan

    def put(self, key: str, value: object, *, wait_for_space: float | None = None) -> ShmRef:
        """Store ``value`` under ``key`` and return its first hand-out.

        ``ObjectTooLargeError`` (before any copy), ``DuplicateKeyError``, or ``CacheFullError``
        when no room exists even after evicting every free item and waiting ``wait_for_space``
        seconds (default: the config's, 0 for a store created without one).
        """
        plan = self.plan(value)
        if wait_for_space is None:
            wait_for_space = self._config.wait_for_space if self._config else 0.0
        with self._lock:
            if plan.nbytes <= INLINE_COPY_UNDER_LOCK and not wait_for_space:
                return self.put_locked(key, plan)  # small, no wait: one step, the copy is µs
            res = self.reserve(key, plan, wait_for_space=wait_for_space)
            if plan.nbytes <= INLINE_COPY_UNDER_LOCK:
                try:
                    self.write_reserved(res)
                except BaseException:
                    self.abort(res)
                    raise
                return self.commit(res)
        try:
            self.write_reserved(res)
        except BaseException:
            with self._lock:
                self.abort(res)
            raise
        with self._lock:
            return self.commit(res)

    def put_locked(self, key: str, plan: EncodePlan) -> ShmRef:
        """``reserve`` + ``write_reserved`` + ``commit`` of a small value in one step, without
        waiting for space. Hold :attr:`lock` (it is never let go: the copy runs under it).

        For copies of microseconds (the sender's one-item path, :meth:`put` of a small value):
        no ``Reservation`` is made, since nothing can see the chunk before it is committed.
        ``DuplicateKeyError``, ``CacheFullError`` (nothing allocated: eviction made no room), or
        the copy's error (the chunk is abandoned, reclaimed in FIFO order). ``plan`` was made by
        :meth:`plan` (the size limit is checked there).
        """
        self._check_writer()  # closed, a reader, or a forked child: the typed error first
        if type(key) is not str and not isinstance(key, str):
            raise TypeError(f"keys are str, not {type(key).__name__}")
        if key in self._index or key in self._pending or key in self._waiting_keys:
            raise DuplicateKeyError(f"key {key!r} is already cached")
        ring = self.ring
        nbytes = plan.nbytes
        got = ring.try_allocate(nbytes)
        if got is None:
            self._make_room(nbytes, 0.0, {})  # no wait: the lock is never let go
            got = ring.allocate(nbytes)
        address, cid = got
        try:
            self.serde.write(plan, ring.payload(address))
        except BaseException:
            ring.abandon(address)
            raise
        return self._publish_put(key, address, cid, nbytes)

    def reserve(
        self,
        key: str,
        plan: EncodePlan | RawPlan,
        *,
        wait_for_space: float | None = None,
        own_pins: Mapping[object, int] | None = None,
        abort: Callable[[], bool] | None = None,
    ) -> Reservation:
        """Allocate a chunk for ``plan`` (evicting FIFO as needed). Hold :attr:`lock`.

        ``own_pins``: the caller's pins (entry -> count, as returned by :meth:`pin_entry`). When
        only those hold the head of the ring, nothing can make room while the caller waits, so
        ``CacheFullError`` comes at once instead of after ``wait_for_space``. ``abort``: asked
        after every wake-up while waiting; true ends the wait with ``CacheFullError`` (the caller
        gave up, e.g. a cancelled request).
        """
        self._check_writer()
        if type(key) is not str and not isinstance(key, str):
            raise TypeError(f"keys are str, not {type(key).__name__}")
        if key in self._index or key in self._pending or key in self._waiting_keys:
            raise DuplicateKeyError(f"key {key!r} is already cached")
        if plan.nbytes > self.max_object_bytes:
            raise ObjectTooLargeError(
                f"object of {plan.nbytes} bytes exceeds max_object_bytes={self.max_object_bytes}",
                nbytes=plan.nbytes,
            )
        got = self.ring.try_allocate(plan.nbytes)
        if got is None:  # the slow path: evict, maybe wait
            if wait_for_space is None:
                wait_for_space = self._config.wait_for_space if self._config else 0.0
            self._waiting_keys.add(key)  # the lock may be let go while waiting: claim the key
            try:
                self._make_room(plan.nbytes, wait_for_space, own_pins or {}, abort)
            finally:
                self._waiting_keys.discard(key)
            self._check_writer()  # closed while we waited?
            got = self.ring.allocate(plan.nbytes)
        res = Reservation(key, got[0], got[1], plan)
        self._pending[key] = res
        return res

    def write_reserved(self, res: Reservation) -> None:
        """Copy the value into its chunk. Touches only that chunk: no lock needed.

        A ``RawPlan`` is copied byte for byte (a numpy copy: the GIL is let go for big ones),
        then verified at its source (``StaleReferenceError`` if the source changed meanwhile).
        """
        plan = res.plan
        if not isinstance(plan, RawPlan):
            self.serde.write(plan, self.ring.payload(res.address))
            return
        src = plan.source()
        try:
            dst = np.frombuffer(self.ring.payload(res.address), dtype=np.uint8)
            dst[...] = np.frombuffer(src, dtype=np.uint8)
        finally:
            src.release()
        plan.verify()

    def commit(self, res: Reservation) -> ShmRef:
        """Publish a written chunk, index it and take the first hand-out. Hold :attr:`lock`."""
        if res.done:
            raise ShmCacheError("reservation already finished")
        res.done = True
        del self._pending[res.key]
        if self._closed:
            raise ClosedCacheError("store closed during the put")
        return self._publish_put(res.key, res.address, res.id, res.plan.nbytes)

    def _publish_put(self, key: str, address: int, cid: int, length: int) -> ShmRef:
        """Commit a written chunk, index it under ``key`` and take its first hand-out."""
        ring, hw = self.ring, self._hw
        position = ring.commit(address)
        epoch = hw[H_EPOCH]
        base = tag_base(self._secret, epoch, address, cid, length, position)
        self._rows[cid] = (key, address, length, position, base, epoch)
        self._index[key] = cid
        if self._has_hints:
            self.hints.publish(key, Hint(epoch, address, cid, length, position))
        hw[H_BYTES_USED] = ring.used_bytes  # _publish_usage, inline: every put (evictions are
        hw[H_ITEMS] = len(self._index)  # published where they happen, by _forget)
        return self._hand_out(cid)

    def abort(self, res: Reservation) -> None:
        """Abandon a reservation whose copy failed or was cancelled. Hold :attr:`lock`."""
        if res.done:
            return
        res.done = True
        self._pending.pop(res.key, None)
        if not self._closed:
            self.ring.abandon(res.address)

    def is_pending(self, key: str) -> bool:
        """A put of ``key`` is in progress (allocated, or waiting for room)."""
        return key in self._pending or key in self._waiting_keys

    # --- writer: hand-outs, pins, release -------------------------------------------------
    def get_cached(self, key: str) -> ShmRef | None:
        """A new hand-out of a cached key, or None if it is not cached."""
        self._check_writer()
        cid = self._index.get(key)
        if cid is None:
            return None
        if self.second_chance:
            self._marked[cid] = None  # a hit: second chance
        return self._hand_out(cid)

    def _hand_out(self, cid: int) -> ShmRef:
        if self.one_of_n:
            seq = self.ledger.hand_out_id(cid, _NOBODY)
        else:
            if self.readers.sessions() != self._known_sessions:
                self._sync_sessions()
            seq = self.ledger.hand_out_id(cid, self._live_sessions)
            if self._live_sessions:
                owed, words = self.ledger.owed, self.readers.owed_words
                for i, s in self._live_slots:  # the owing slots' debts, for inspect
                    words[i] = owed[s]
        self._undrained += 1
        if self._undrained * 2 >= self.readers.log_entries:
            self.drain()
        return self._ref(cid, seq)

    def touch(self, key: str) -> bool:
        """Protect a cached key from eviction until its next hand-out (``handout_ttl`` at most).

        Returns False if ``key`` is not cached.
        """
        self._check_writer()
        cid = self._index.get(key)
        if cid is None:
            return False
        self.ledger.touch(self.ledger.debts_of(cid))
        return True

    def pin(self, key: str) -> bool:
        """Request-scoped pin (counted) of the entry cached under ``key``; pair with
        :meth:`unpin`. False if ``key`` is not cached."""
        self._check_writer()
        cid = self._index.get(key)
        if cid is None:
            return False
        self.ledger.pin(self.ledger.debts_of(cid))
        return True

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of the entry cached under ``key`` now."""
        if self._seg.forked:  # not when closed: a request's cleanup may run after a close
            self._check_writer()
        cid = self._index.get(key)
        if cid is not None and (e := self.ledger.get(cid)) is not None:
            self.ledger.unpin(e)

    def pin_entry(self, key: str) -> Debts | None:
        """Request-scoped pin of the entry cached under ``key`` now (see :meth:`unpin_entry`).

        Returns the entry's debts (``id`` is its chunk id), which hold the pin.
        """
        self._check_writer()
        cid = self._index.get(key)
        if cid is None:
            return None
        e = self.ledger.debts_of(cid)
        self.ledger.pin(e)
        return e

    def unpin_entry(self, e: Debts) -> None:
        """Undo one :meth:`pin_entry` of ``e`` (whatever key names it by now)."""
        self.ledger.unpin(e)

    @contextlib.contextmanager
    def pinned(self, keys: list[str]) -> Iterator[list[str]]:
        """Pin the cached ones of ``keys`` for the block; yields the list of keys pinned.

        Keys appended to that list (pinned later in the block with :meth:`pin`) are unpinned on
        exit too. Pins belong to entries: an entry invalidated and re-put meanwhile keeps the
        pins of its own requests, and the new entry is not unpinned by mistake.
        """
        entries = [(k, e) for k in keys if (e := self.pin_entry(k)) is not None]
        done = [k for k, _e in entries]
        n0 = len(done)
        try:
            yield done
        finally:
            for _k, e in entries:
                self.unpin_entry(e)
            for k in done[n0:]:
                self.unpin(k)

    def release(self, ref: ShmRef) -> bool:
        """Undo one hand-out that never reached the readers. False if unknown or none left."""
        self._check_writer()
        if not isinstance(ref, ShmRef) or not check_ref_fields(ref):
            return False
        if ref.tag != reference_tag(
            self._secret, ref.epoch, ref.address, ref.id, ref.length, ref.position, ref.seq
        ):
            return False
        row = self._rows.get(ref.id)
        if row is None or ref.nonce != self._nonce:
            return False
        if row[1] != ref.address or not self.ledger.release(ref.id, ref.seq):
            return False  # unknown, already released, or already read by everyone
        self._publish_owed()
        return True

    def invalidate(self, key: str) -> bool:
        """Forget ``key``: it is no longer handed out; its chunk is freed once its debts settle.

        Request pins on the old entry stay until their requests end (they unpin that entry).
        """
        self._check_writer()
        cid = self._index.pop(key, None)
        if cid is None:
            return False
        if self.hints:
            self.hints.remove(key, cid)
        if (e := self.ledger.get(cid)) is not None:
            self.ledger.untouch(e)
        self._publish_usage()
        return True

    # --- writer: readers' acknowledgements and liveness -----------------------------------
    def _sync_sessions(self) -> None:
        """Notice slots whose session changed (attach, close, a replacement after a death)."""
        t = self.readers
        now = t.sessions()
        if now == self._known_sessions:
            return
        self._known_sessions = now
        for slot, st in enumerate(self._slots):
            s = now[slot]
            if s == st.session:
                continue
            if st.session:
                self.ledger.drop_session(st.session)
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
        owed = self.ledger.owed
        t = self.readers
        for slot, st in enumerate(self._slots):
            if st.session:
                t.set_word(slot, WS_OWED, max(0, owed.get(st.session, 0)))

    def drain(self) -> int:
        """Apply every acknowledgement written since the last drain; returns how many."""
        self._check_writer()
        t = self.readers
        n_total = 0
        self._undrained = 0
        if t.sessions() == self._known_sessions and t.heads() == [st.cursor for st in self._slots]:
            return 0  # nothing new: the common case, two strided reads
        settle_all = self.ledger.settle_all
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

    def _probe_debtors(self, e: Debts) -> bool:
        """Probe the readers owing ``e``; drop dead ones, revoke stuck ones. True if any dropped."""
        since = self.ledger.debtors(e)
        if not since:
            return False
        changed = False
        evict_after = self._config.evict_stuck_readers_after if self._config else None
        stuck = set(self.ledger.stuck(e, evict_after)) if evict_after is not None else set()
        for slot, st in enumerate(self._slots):
            s = st.session
            if not s or not st.alive or s not in since:
                continue
            if not self.readers.probe(slot):
                log.info(
                    "reader slot %d (pid %d) is dead: dropping its debts",
                    slot,
                    self.readers.word(slot, RS_PID),
                )
                st.alive = False
                self.ledger.drop_session(s)
                changed = True
            elif s in stuck:
                log.warning(
                    "reader slot %d acknowledged nothing for %.1f s while owing: revoking it",
                    slot,
                    evict_after,
                )
                self.readers.set_word(slot, WS_REVOKED, s)
                st.alive = False
                st.revoked = s
                self.ledger.drop_session(s)
                changed = True
        if changed:
            self._refresh_live()
            self._publish_owed()
        return changed

    def _is_free(self, cid: int) -> bool:
        e = self._by_id.get(cid)
        return e is None or self.ledger.is_free(e)

    def is_freeable(self, key: str) -> bool:
        """Whether ``key``'s chunk could be evicted now.

        Drains the acknowledgement logs first and probes the readers still owing it, so a dead
        reader's debts do not count.
        """
        self._check_writer()
        self.drain()
        cid = self._index.get(key)
        if cid is None:
            return False
        e = self.ledger.get(cid)
        if e is None:
            return True  # nothing owed, pinned or touched
        if e.debt > 0 and not self.one_of_n:
            self._probe_debtors(e)
        return self.ledger.is_free(e)

    def _forget(self, freed: list[int]) -> None:
        """Drop the rows, index entries, marks and debts of freed chunks; count evictions."""
        index, rows, marked, entries = self._index, self._rows, self._marked, self._by_id
        hints, on_evict = self.hints, self.on_evict
        evicted = self.evictions
        for cid in freed:
            if cid in entries:
                self.ledger.forget(cid)
            if cid in marked:
                del marked[cid]
            row = rows.pop(cid, None)
            if row is None:
                continue  # a dead allocation: never indexed
            key = row[0]
            if index.get(key) == cid:
                del index[key]
                if hints:
                    hints.remove(key, cid)
                self.evictions += 1
                if on_evict is not None:
                    on_evict(key)
        if self.evictions != evicted:
            self._hw[H_EVICTIONS] = self.evictions

    def _head_entry(self) -> Debts | None:
        cid = self.ring.head_id
        return None if cid is None else self._by_id.get(cid)

    def evict(self, nbytes: int = 0) -> list[str]:
        """Free free chunks from the head (all of them, or until ``nbytes`` fit).

        Readers owing the head item are probed first: a dead one's debts are dropped. An explicit
        eviction: hit items are evicted too (second chance applies to puts that need room).
        """
        self._check_writer()
        self.drain()
        head = self._head_entry()
        if head is not None and head.debt > 0:
            self._probe_debtors(head)
        freed = self.ring.free(self._is_free, nbytes)
        keys = [row[0] for c in freed if (row := self._rows.get(c)) is not None]
        self._forget(freed)
        self._publish_usage()
        self._publish_owed()
        return keys

    def _make_room(
        self,
        nbytes: int,
        wait_for_space: float,
        own_pins: Mapping[object, int],
        abort: Callable[[], bool] | None = None,
    ) -> None:
        ring = self.ring
        if chunk_size(nbytes) > ring.capacity:
            raise CacheFullError(f"{nbytes} bytes can never fit a {ring.capacity}-byte ring")
        deadline = time.monotonic() + wait_for_space
        waiting = False
        budget = [self.relocate_budget if self.second_chance else 0]
        try:
            while True:
                if ring.fits(nbytes):
                    return
                self.drain()
                self._reclaim(nbytes, budget)
                if ring.fits(nbytes):
                    return
                head = self._head_entry()
                if head is not None and head.debt > 0 and self._probe_debtors(head):
                    continue
                if head is not None and 0 < head.pins <= own_pins.get(head, 0):
                    self._publish_usage()
                    raise CacheFullError(
                        f"no room for {nbytes} bytes: the oldest item is pinned by this request"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._publish_usage()
                    raise CacheFullError(
                        f"no room for {nbytes} bytes: the oldest item is "
                        + (
                            "pinned"
                            if head is not None and (head.pins or head.touched)
                            else "still owed to readers"
                        )
                    )
                if not waiting:
                    waiting = True
                    self._hw[H_WAITING] = 1
                    continue  # re-check once after raising the flag: no lost wake-up
                self._wait(min(remaining, WAIT_POLL))
                if abort is not None and abort():
                    raise CacheFullError(f"no room for {nbytes} bytes: the request was abandoned")
        finally:
            if waiting and not self._closed:
                self._hw[H_WAITING] = 0

    def _reclaim(self, nbytes: int, budget: list[int]) -> None:
        """Free from the head until ``nbytes`` fit (and a bounded slack), relocating marked free
        heads while ``budget[0]`` (bytes, spent here) allows; stops at a head that is not free.

        Before the first relocation, :meth:`_rotation_makes_room` looks ahead: if an item that
        cannot be freed comes before enough room, moving marked items past it would only leave
        that item at the head and the put without room, so this pass evicts in plain FIFO order
        instead (what the ring did without second chance).
        """
        ring = self.ring
        fifo = not self.second_chance

        def relocatable(cid: int | None) -> bool:
            return (
                not fifo
                and cid is not None
                and self._is_marked(cid)
                and self._relocation_cost(cid) <= budget[0]
                and self._is_free(cid)
                and not self.is_pending(self._rows[cid][0])
            )

        entries, marked, ledger = self._by_id, self._marked, self.ledger

        def evictable(cid: int) -> bool:  # _is_free and _is_marked, inline: once per chunk freed
            e = entries.get(cid)
            if e is not None and not ledger.is_free(e):
                return False
            if cid not in marked or not self._is_marked(cid):
                return True
            # a marked head is moved (not freed) while the put needs room, and kept in the slack
            return not (relocatable(cid) or ring.fits(nbytes))

        pred = evictable if self.second_chance else self._is_free
        looked_ahead = False
        while True:
            self._forget(
                ring.free(pred, nbytes, slack=self.evict_slack, max_extra=EVICT_SLACK_CHUNKS)
            )
            if ring.fits(nbytes):
                return
            head = ring.head_id
            if head is None or not relocatable(head):
                return
            if not looked_ahead:
                looked_ahead = True
                if not self._rotation_makes_room(nbytes, budget[0]):
                    fifo = True
                    continue
            budget[0] -= self._relocation_cost(head)
            self._relocate(head)

    def _is_marked(self, cid: int) -> bool:
        """Hit since written or relocated, and still the indexed chunk of its key."""
        if cid not in self._marked:
            return False
        row = self._rows.get(cid)
        return row is not None and self._index.get(row[0]) == cid

    def _relocation_cost(self, cid: int) -> int:
        """What moving chunk ``cid`` takes from a put's budget (see ``RELOCATE_MAX_ITEMS``)."""
        return max(chunk_size(self._rows[cid][2]), self.relocate_budget // RELOCATE_MAX_ITEMS)

    def _rotation_makes_room(self, nbytes: int, budget: int) -> bool:
        """Whether moving marked heads (within ``budget``) and evicting the others reaches room
        for ``nbytes`` before a chunk that cannot be freed. Visits the chunks the pass would.

        Room is counted as free bytes against twice the chunk (contiguity: a wrap may skip up to
        one chunk's worth at the end), so a "yes" is safe; past every chunk it is "yes" too (the
        moved items come round unmarked and are evicted).
        """
        need = 2 * chunk_size(nbytes)
        room = self.ring.capacity - self.ring.used_bytes
        for cid, size, writing in self.ring.iter_chunks():
            if room >= need:
                return True
            if writing or not self._is_free(cid):
                return False
            if self._is_marked(cid) and self._relocation_cost(cid) <= budget:
                budget -= self._relocation_cost(cid)
            else:
                room += size
        return True

    def _relocate(self, cid: int) -> None:
        """Move chunk ``cid`` (the free head) to the tail and point its key at the new chunk."""
        key, _address, length, _position, _base, _epoch = self._rows[cid]
        self.ledger.forget(cid)  # it owes nothing: it was free
        self._marked.pop(cid, None)
        moved = self.ring.relocate_head()
        if moved is None:  # ids exhausted: the chunk is gone, as if evicted
            self._forget([cid])
            return
        del self._rows[cid]
        address, new, position = moved
        epoch = int(self._hw[H_EPOCH])
        base = tag_base(self._secret, epoch, address, new, length, position)
        self._rows[new] = (key, address, length, position, base, epoch)
        self._index[key] = new
        if self.hints:
            self.hints.publish(key, Hint(epoch, address, new, length, position))
        self.relocations += 1
        self.bytes_relocated += length
        hw = self._hw
        hw[H_RELOCATIONS] = self.relocations
        hw[H_BYTES_RELOCATED] = self.bytes_relocated

    def _wait(self, timeout: float) -> None:
        """Sleep until a reader posts (or ``timeout``), letting go of the writer lock meanwhile.

        Callers of :meth:`reserve` hold :attr:`lock`; releasing it while asleep lets hits and
        other puts go on (the waiting loop re-checks everything after waking).
        """
        self.wakeups += 1
        sem = self._sem
        self._waiters += 1
        self._lock.release()
        try:
            sem.acquire(timeout)
            # absorb posts that piled up while we were not waiting
            with contextlib.suppress(posix_ipc.BusyError):
                while True:
                    sem.acquire(0)
        except posix_ipc.BusyError:
            pass
        finally:
            self._lock.acquire()
            self._waiters -= 1
            if self._closed and not self._waiters:  # close() left the handle to us
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    sem.close()
        self._check_writer()

    def _publish_usage(self) -> None:
        hw = self._hw
        hw[H_BYTES_USED] = self.ring.used_bytes
        hw[H_ITEMS] = len(self._index)
        hw[H_EVICTIONS] = self.evictions

    def clear(self) -> int:
        """Drop every item: a new epoch makes every older reference stale. Returns items dropped."""
        self._check_writer()
        n = len(self._index)
        freed = self.ring.clear()
        for cid in freed:
            self._by_id.pop(cid, None)
            self._rows.pop(cid, None)
        self._index.clear()
        self._marked.clear()
        for s in list(self.ledger.owed):
            self.ledger.owed[s] = 0
        self._publish_usage()
        self._publish_owed()
        return n

    def reader_info(self) -> list[ReaderSlotInfo]:
        """Every reader slot: attached, alive (kernel lock), pid, acknowledgements, debt."""
        if self.is_writer:
            self._check_writer()  # a forked child must not publish the parent's words
            self._publish_owed()
        else:
            self._check_open()
        return reader_slots_info(self.readers, probe=True)

    # --- reading (the read path) ------------------------------------------------------------
    def check_writer(self) -> None:
        """``WriterGoneError`` if the writer closed or died (probed at most every 0.25 s)."""
        self._reading.check_writer()

    def check_reader(self) -> ReaderSlot:
        """This reader's slot, after checking it may read now (open, writer alive, not revoked)."""
        return self._reading.check_reader()

    _check_reader = check_reader  # the former name, until the caches use the public one

    def validate(self, ref: object) -> ShmRef:
        """Check a reference against this segment without reading it (typed errors)."""
        return self._reading.validate(ref)

    def get(self, ref: ShmRef | dict[str, Any], *, copy: bool = True) -> Any:
        """Read a reference; a reader acknowledges it once the copy is verified.

        The writer's own read verifies the same way (a chunk reused during the copy is a
        ``StaleReferenceError``) and acknowledges nothing. With ``copy=False`` the arrays are
        read-only views into shared memory and nothing is acknowledged: call :meth:`ack` when
        done (a ``lease`` does this for you).
        """
        if self.is_writer:
            return self._reading.read(ref)
        return self._reading.get(ref, copy=copy)

    def ack(self, ref: ShmRef) -> None:
        """Acknowledge a reference read with ``copy=False`` after re-verifying it."""
        self._reading.ack(ref)

    def give_back(self, ref: ShmRef) -> None:
        """Acknowledge a reference that will not be read (never raises).

        For a request that failed or was cancelled: the debt is settled so the writer can free
        the chunk. Nothing is read, so nothing needs verifying. A reference found stale is never
        given back (it owes nothing; see ``_reading``).
        """
        self._reading.give_back(ref)

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent. The writer unlinks the segment and its semaphore; a reader frees its slot."""
        if self._closed:
            return
        self._closed = True
        self._reading.close()
        if self._sem is not None:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                if not self._seg.forked:
                    self._sem.unlink()
            if self._waiters:  # wake them; the last one closes the handle (never under them)
                for _ in range(self._waiters):
                    with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                        self._sem.release()
            else:
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    self._sem.close()
        self._index.clear()
        self._rows.clear()
        self._marked.clear()
        self._by_id.clear()
        self.readers.release()
        self.hints.release()
        self.ring.close()

    def __enter__(self) -> ShmObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
