"""Layer 5: ``StoreWriter``, the writer of one segment's object store, made of parts.

``ShmObjectStore`` (``_store_base``) is the package's public name: :meth:`ShmObjectStore.create`
makes a segment and returns its **writer**, a :class:`StoreWriter` (this module);
:meth:`ShmObjectStore.from_handle` attaches a **reader**, a ``StoreReader`` (``_store_reader``).
Importing this module defines both. Each role holds only its own state (``__slots__``) and has
only its own methods (a reader has no writer methods: see ``_store_base``).

The writer owns the write algorithm: the store's puts (:meth:`StoreWriter.put`, and the steps a
sender request drives: :meth:`StoreWriter.reserve`, :meth:`StoreWriter.write_reserved`,
:meth:`StoreWriter.commit` or :meth:`StoreWriter.abort`, and :meth:`StoreWriter.put_now` for
a small copy in one step), its hand-outs, releases, invalidations and clears. It keeps the
index ``key -> chunk id`` and a row per chunk (key, address, length, position, tag; see
"Compact writer state" below), and is composed of parts that each hold their own state behind
a small interface:

* the **hand-out ledger** (``_ledger.HandoutLedger``, pure bookkeeping): who owes which
  hand-out, pins, touches, and the rules by which debts lapse;
* the **acknowledgements** (``_acks.Acknowledgements``): the reader slots as the writer knows
  them, the readers' logs drained into the ledger, each hand-out recorded;
* the **pins** (``_pins.Pins``): touches, a request's pins and its guard;
* the **eviction** (``_evict.Eviction``): FIFO eviction, second chance (its marks), waiting for
  space (its semaphore), its counters.

The parts hold no lock: the writer's methods take its lock and call them.

**One lock rule.** Every writer method takes the writer's re-entrant :attr:`StoreWriter.lock`
itself — but those documented as "the lock held", for a sender request that decides all its
items in one locked step (``_request``). A caller may hold the lock around several calls to make
them one step (``with store.lock: store.put(...)``). Every writer method first checks that it
runs in the process that created the writer (:meth:`StoreWriter.check_owner`): a forked child
gets ``RoleError`` before it could touch the lock it may have inherited held.

A **hand-out** is one ``ShmRef`` returned by :meth:`StoreWriter.put` or
:meth:`StoreWriter.get_cached`, numbered by its ``seq``; every reader that owes it acknowledges
exactly that hand-out, ``(id, seq)``, once, after reading and verifying the bytes
(``StoreReader.get``).

The **reference tag** has one definition, ``_types.tag_base`` and ``_types.finish_tag``; the
writer computes it through the core (``core.tag_base``, ``core.finish_tag``: the compiled twin
when built, that definition otherwise).

**Compact writer state.** A full garbage collection walks every tracked object; a Python object
per cached item costs ~250 ns each (65-90 ms for 250,000 items here, more with the dicts that
point at them). So the writer keeps no object per item: the index maps key -> chunk id, and
each chunk's row is its key and a bytes object of packed ints (``_rows``, ``_keys``): the
collector never tracks them, nor the dicts holding only such values. (A tuple of ints would be
untracked only by a collection, and every insert of a fresh one tracks its dict again: a full
collection then walked every row, ~6 ms per 30,000 items here.) Only *active* entries (owed,
pinned or touched) have a ``Debts`` object in the ledger, and it is dropped again once settled.
The second-chance marks are a map of chunk id -> None (a set would be walked member by member),
and the ring keeps its FIFO in columns of 64-bit words (views of one ``bytearray``). The maps
with one entry per item (index, rows, keys, marks) are ``ShardedMap``s of 256 small dicts:
growing, or rebuilding after churn, never stalls a put for the tens of milliseconds a rebuild
of one big dict takes.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import posix_ipc

from ._acks import Acknowledgements
from ._core_api import core
from ._evict import EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, Eviction
from ._hints import Hint, HintTable
from ._layout import (
    CHUNK_HEADER,
    H_BYTES_USED,
    H_EPOCH,
    H_EVICTIONS,
    H_ITEMS,
    H_SECRET,
    chunk_size,
    semaphore_name,
)
from ._ledger import Debts, HandoutLedger
from ._pins import Pins
from ._read_path import check_ref_fields
from ._reader_table import ReaderTable, SlotState, reader_slots_info
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import EncodePlan, MsgpackPlan, MsgpackSerde, Serde
from ._sharded_map import ShardedMap, shards_for
from ._store_base import ShmObjectStore
from ._store_reader import StoreReader
from ._types import CacheConfig, ReaderSlotInfo, ShmRef, reference_tag
from .errors import ClosedCacheError, DuplicateKeyError, ObjectTooLargeError, ShmCacheError

__all__ = ["RawPlan", "Reservation", "ShmObjectStore", "StoreReader", "StoreWriter"]

log = logging.getLogger("aioshmcache")

#: Copies below this size are made holding the writer lock, where the call began (``put``, and
#: a request's small misses: on the loop, for the async facade); bigger ones run outside the
#: lock (a request's copy jobs: in a worker thread, for the async facade). The one threshold
#: for both. Measured by ``bench`` here: a thread hop costs 75-170 us, a warm 1 MiB copy
#: ~40 us, so copies under 1 MiB are cheaper inline and keep loop lag below ~0.1 ms.
INLINE_COPY_UNDER_LOCK: Final = 1 << 20
#: The sync face's one-item puts (``put`` without a wait, ``SenderCache.get_and_update_item``)
#: are one step at every size: the core's ``put_plain`` allocates (evicting), copies with the GIL
#: released and publishes in one call, so the writer lock is held for the copy and microseconds
#: more, and the caller's thread makes the copy anyway. Measured (callgrind, a full 64 MiB ring,
#: every put evicting): one step against reserve / copy / commit, 149k against 244k instructions
#: at 1 MiB, 446k against 547k at 4 MiB, 1.63M against 1.74M at 16 MiB. A request of several
#: items and the async face keep ``INLINE_COPY_UNDER_LOCK`` (their copy jobs run outside the
#: lock: on a worker thread, off the event loop).
SYNC_ONE_STEP_PUT_UNDER: Final = 1 << 62


def exact_key(key: object) -> str:
    """``key`` as the store keeps it: an exact ``str`` (``TypeError`` if it is not a ``str``).

    A ``str`` subclass is kept as its characters alone: the index, the ledger and the sender's
    book are hashed and compared by the compiled core, where a subclass's own ``__hash__`` or
    ``__eq__`` (Python code) must never run between a put's first change and its last.
    """
    if type(key) is str:
        return key
    if not isinstance(key, str):
        raise TypeError(f"keys are str, not {type(key).__name__}")
    return str.__str__(key)  # the base method: a new exact str, whatever the subclass defines


#: A cached item's row, by chunk id: ``(key, address, length, position, tag_base, tag_epoch)``.
#: Kept as its key (a str) and the five ints packed in a bytes object (``_ROW``): neither is a
#: container, so the collector never tracks them or the dicts that hold them (see "Compact
#: writer state" in the module docstring).
_Row = tuple[str, int, int, int, int, int]
_ROW: Final = struct.Struct("=5Q")  # a tag base is kept to 64 bits (its tag is the same)
_pack_row: Final = _ROW.pack
_unpack_row: Final = _ROW.unpack
_new_ref: Final = tuple.__new__  # ShmRef's fields in order, without its Python-level __new__
#: the core's put of a plain item (``_core_put.c``); it declines with None before any side effect
core.configure(ShmRef, MsgpackPlan, MsgpackSerde)
#: the core's hand-out (``_core_put.c``) stands for ``Acknowledgements.hand_out`` in its puts
core.configure_hand_out(Acknowledgements, HandoutLedger, Debts, SlotState, ReaderTable)
#: ...and makes the room itself in the usual case: ``Eviction.make_room``'s FIFO pass, compiled
core.configure_evict(Eviction, EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, H_EVICTIONS)
_put_plain = core.put_plain
#: the core's reference of a hand-out (``StoreWriter._ref``); None: the Python steps decide
_make_ref = core.make_ref
#: the core's publish of a written chunk (``StoreWriter._publish_put``); None: the Python steps
_publish_plain = core.publish_plain
#: the reference tag: ``_types``'s one definition, compiled when the core is built
_tag_base: Final = core.tag_base
_finish_tag: Final = core.finish_tag


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


class _PinnedKeys(list[str]):
    """The list :meth:`StoreWriter.pinned` yields. A key appended (pinned just before by
    :meth:`StoreWriter.pin`) notes the entry it names then, the one that pin holds, so that the
    block's exit unpins that entry, never a newer one put under the key meanwhile."""

    def __init__(self, entry_of: Callable[[str], Debts | None], keys: list[str]) -> None:
        super().__init__(keys)
        self._entry_of = entry_of  # the writer's: the entry cached under a key, if pinned
        #: key -> the entries pinned under it after the block began, in the order appended
        self.later: dict[str, list[Debts]] = {}

    def append(self, key: str) -> None:
        super().append(key)
        e = self._entry_of(key)
        if e is not None:
            self.later.setdefault(key, []).append(e)

    def extend(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.append(k)

    def __iadd__(self, keys: Iterable[str]) -> _PinnedKeys:  # type: ignore[override,misc]
        self.extend(keys)
        return self


class StoreWriter(ShmObjectStore):
    """The writer of one segment (:meth:`ShmObjectStore.create`); ``close`` unlinks it.

    Puts, hands out, pins, evicts and clears; drains the readers' acknowledgements. Every
    method takes :attr:`lock` itself (re-entrant), after :meth:`check_owner`, but those said to
    run with the lock held (for a sender request, which holds it around its decision).
    """

    __slots__ = (
        "_acks",
        "_config",
        "_evict",
        "_hand_out_seq",
        "_has_hints",
        "_hints",
        "_index",
        "_keys",
        "_ledger",
        "_lock",
        "_pending",
        "_pins",
        "_rows",
        "_secret",
        "_waiting_keys",
        "index",
        "words",
    )

    _role = "writer"

    def __init__(self, segment: Segment, config: CacheConfig, *, serde: Serde | None = None):
        """The writer's state over a segment just created (use :meth:`ShmObjectStore.create`)."""
        super().__init__(segment, ShmRingBuffer(segment, writer=True), serde=serde)
        self._config = config
        self._secret = int(self._hw[H_SECRET])  # the key of every reference's tag
        self._hints = HintTable(segment)  # empty unless the segment is a group shard
        self._has_hints = bool(self._hints)  # its size is fixed with the segment
        # one entry per cached item: sharded, so that no put rebuilds a big table (``_sharded_map``)
        # at most one item per smallest chunk: the per-item maps are sized for that many
        n = shards_for(self.ring.capacity // chunk_size(1))
        self._index: ShardedMap[str, int] = ShardedMap(n)  # key -> chunk id
        #: the index, for a sender request's look-up under the lock (read it, never write it)
        self.index = self._index
        #: the segment header's words (a sender request publishes its counters there)
        self.words = self._hw
        # chunk id -> its row (``_ROW``-packed bytes: never tracked by the collector, nor is a
        # dict of them) and its key, until the chunk is freed
        self._rows: ShardedMap[int, bytes] = ShardedMap(n)
        self._keys: ShardedMap[int, str] = ShardedMap(n)
        self._pending: dict[str, Reservation] = {}
        self._waiting_keys: set[str] = set()
        # serialises writer state changes between threads; re-entrant, so that one lock rule
        # holds: every writer method takes it itself, and a caller may hold it around several
        self._lock = threading.RLock()
        # the parts, each with its own state
        self._ledger = HandoutLedger(one_of_n=self.one_of_n, handout_ttl=self.handout_ttl)
        self._acks = Acknowledgements(self._readers, self._ledger, one_of_n=self.one_of_n)
        self._hand_out_seq = self._acks.hand_out  # the hand-out step (also the C core's)
        self._pins = Pins(self._ledger, self._index, self._rows)
        self._evict = Eviction(
            self,
            ring=self.ring,
            words=self._hw,
            ledger=self._ledger,
            acks=self._acks,
            pins=self._pins,
            hints=self._hints if self._has_hints else None,
            index=self._index,
            rows=self._rows,
            keys=self._keys,
            lock=self._lock,
            # the wake-up semaphore readers post while the writer waits for space
            sem=posix_ipc.Semaphore(
                semaphore_name(segment.name, segment.nonce), posix_ipc.O_CREX, 0o600, 0
            ),
            second_chance=config.second_chance,
            evict_after=config.evict_stuck_readers_after,
        )

    @property
    def lock(self) -> threading.RLock:
        """The writer lock (re-entrant). Every writer method takes it itself; hold it around
        several calls to make them one step for other threads (``with store.lock: ...``)."""
        return self._lock

    @property
    def shards(self) -> int:
        """How many dicts each per-item map of the writer is split into (``_sharded_map``)."""
        return len(self._index.shards)

    def check_owner(self) -> None:
        """``RoleError`` in a forked child of the process that created the writer;
        ``ClosedCacheError`` once closed. Every writer method checks it first, before it
        touches shared memory or takes :attr:`lock` (a forked child may inherit it held)."""
        if self._reading.closed or self._seg.forked:  # one test when fine
            self._check_open()  # raises: closed, or a forked child

    _check_writer = check_owner  # the name the store's own methods use

    # --- eviction's counters and settings (its part's) -------------------------------------
    @property
    def evictions(self) -> int:
        """Items evicted so far."""
        return self._evict.evictions

    @property
    def relocations(self) -> int:
        """Second chance: chunks moved to the tail instead of evicted."""
        return self._evict.relocations

    @property
    def bytes_relocated(self) -> int:
        """Second chance: the payload bytes of those chunks."""
        return self._evict.bytes_relocated

    @property
    def wakeups(self) -> int:
        """How many times a put waiting for space slept."""
        return self._evict.wakeups

    @property
    def second_chance(self) -> bool:
        """Whether a hit head item is moved to the tail instead of evicted."""
        return self._evict.second_chance

    @second_chance.setter
    def second_chance(self, on: bool) -> None:
        self._evict.second_chance = on

    @property
    def relocate_budget(self) -> int:
        """Bytes (chunk sizes) second chance may move per put."""
        return self._evict.relocate_budget

    @relocate_budget.setter
    def relocate_budget(self, n: int) -> None:
        self._evict.relocate_budget = n

    @property
    def evict_slack(self) -> int:
        """Bytes an eviction pass frees beyond a put's need (a batch)."""
        return self._evict.evict_slack

    @evict_slack.setter
    def evict_slack(self, n: int) -> None:
        if type(n) is not int or n < 0:
            raise ValueError(f"evict_slack must be an int >= 0 (bytes), got {n!r}")
        self._evict.evict_slack = n

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        """Called with each key evicted (the sender cache drops its own tables' entry)."""
        return self._evict.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[str], None] | None) -> None:
        self._evict.on_evict = hook

    # --- the host of eviction (``_evict.EvictionHost``) ------------------------------------
    def publish_usage(self) -> None:
        """Publish the bytes and items in use, and the evictions, in the segment header."""
        self._check_writer()  # closed: its header words are released (a ValueError)
        hw = self._hw
        hw[H_BYTES_USED] = self.ring.used_bytes
        hw[H_ITEMS] = len(self._index)
        hw[H_EVICTIONS] = self._evict.evictions

    def relocated(self, key: str, cid: int, address: int, length: int, position: int) -> None:
        """Index ``key`` under chunk ``cid``: its entry's copy, moved to the tail (lock held)."""
        epoch = int(self._hw[H_EPOCH])
        base = _tag_base(self._secret, epoch, address, cid, length, position)
        self._set_row(cid, (key, address, length, position, base, epoch))
        self._index[key] = cid
        if self._has_hints:
            self._hints.publish(key, Hint(epoch, address, cid, length, position))

    def length_of(self, cid: int) -> int:
        """The payload length of live chunk ``cid`` (0 if it has no row)."""
        row = self._row(cid)
        return 0 if row is None else row[2]

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
        with self._lock:
            order = {c: i for i, c in enumerate(self.ring.chunk_ids())}
            return sorted(self._index, key=lambda k: order.get(self._index[k], -1))

    def ref_of(self, key: str) -> ShmRef | None:
        """The reference of a cached key, without a hand-out (for inspection and tests)."""
        self._check_writer()
        with self._lock:
            cid = self._index.get(key)
            return None if cid is None else self._ref(cid)

    def key_of(self, cid: int) -> str | None:
        """The key a live chunk was put under (None once freed; it may be invalidated)."""
        with self._lock:
            return self._keys.get(cid)

    def _row(self, cid: int) -> _Row | None:
        """Chunk ``cid``'s row ``(key, address, length, position, tag_base, tag_epoch)``."""
        packed = self._rows.get(cid)
        if packed is None:
            return None
        return (self._keys[cid], *_unpack_row(packed))

    def _set_row(self, cid: int, row: _Row) -> None:
        key, *fields = row
        self._rows[cid] = _pack_row(*fields)
        self._keys[cid] = key

    def _ref(self, cid: int, seq: int = 0) -> ShmRef:
        ref = _make_ref(self, cid, seq)  # the core's, if it may (else None: the steps below)
        if ref is not None:
            return ref
        epoch = self._hw[H_EPOCH]  # a "Q" view: already an int
        rows = self._rows
        shard = rows.shards[hash(cid) & rows.mask]  # self._rows[cid], one call shorter
        address, length, position, base, tag_epoch = _unpack_row(shard[cid])
        if tag_epoch != epoch:  # the seq-independent part of the tag, once per epoch
            base = _tag_base(self._secret, epoch, address, cid, length, position)
            shard[cid] = _pack_row(address, length, position, base, epoch)
        return _new_ref(
            ShmRef,
            (self._nonce, epoch, address, cid, length, _finish_tag(base, seq), position, seq),
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
        self._check_writer()  # first: a forked child may inherit the lock held
        plan = self.plan(value)
        if wait_for_space is None:
            wait_for_space = self._config.wait_for_space
        with self._lock:
            if plan.nbytes < SYNC_ONE_STEP_PUT_UNDER and not wait_for_space:
                return self.put_now(key, plan)  # no wait: one step (the copy without the GIL)
            res = self.reserve(key, plan, wait_for_space=wait_for_space)
            if plan.nbytes < INLINE_COPY_UNDER_LOCK:
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
        """:meth:`put_now` for a caller that does not hold the lock: checks the owner first."""
        self._check_writer()  # closed, a reader, or a forked child: the typed error first
        with self._lock:
            return self.put_now(key, plan)

    def put_now(self, key: str, plan: EncodePlan) -> ShmRef:
        """Reserve, write and commit a small value in one step, without waiting for space
        (the lock held; the owner checked).

        For copies of microseconds (the sender's one-item path, :meth:`put` of a small value):
        no ``Reservation`` is made, since nothing can see the chunk before it is committed.
        ``DuplicateKeyError``, ``CacheFullError`` (nothing allocated: eviction made no room), or
        the copy's error (the chunk is abandoned, reclaimed in FIFO order). ``plan`` was made by
        :meth:`plan` (the size limit is checked there).

        The core's ``put_plain`` runs first: the usual put in one compiled step (the C core;
        the pure core declines every put), or None, before any side effect, for anything
        unusual; then the steps below, the reference, run.
        """
        ref = _put_plain(self, key, plan)
        if ref is not None:
            return ref
        if type(key) is not str:
            key = exact_key(key)  # (the core declines every other key)
        if (
            key in (i := self._index).shards[hash(key) & i.mask]  # ``key in self._index``
            or key in self._pending
            or key in self._waiting_keys
        ):
            raise DuplicateKeyError(f"key {key!r} is already cached")
        ring = self.ring
        nbytes = plan.nbytes
        got = ring.try_allocate(nbytes)
        if got is None:
            self._evict.make_room(nbytes, 0.0, {})  # no wait: the lock is never let go
            ref = _put_plain(self, key, plan)  # room made: the core's usual put, if it may
            if ref is not None:
                return ref
            got = ring.allocate(nbytes)
        address, cid = got
        start = address + CHUNK_HEADER  # ``ring.payload(address)``, inline: its length is nbytes
        try:
            self.serde.write(plan, ring.buf[start : start + nbytes])
        except BaseException:
            ring.abandon(address)
            self.publish_usage()  # the room made may have evicted: the header says so
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
        """Allocate a chunk for ``plan`` (evicting FIFO as needed; the lock is let go only while
        waiting for space); then :meth:`write_reserved` and :meth:`commit`, or :meth:`abort`.

        ``own_pins``: the caller's pins (entry -> count, as returned by :meth:`pin_entry`). When
        only those hold the head of the ring, nothing can make room while the caller waits, so
        ``CacheFullError`` comes at once instead of after ``wait_for_space``. ``abort``: asked
        after every wake-up while waiting; true ends the wait with ``CacheFullError`` (the caller
        gave up, e.g. a cancelled request).
        """
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            if type(key) is not str:
                key = exact_key(key)
            if key in self._index or key in self._pending or key in self._waiting_keys:
                raise DuplicateKeyError(f"key {key!r} is already cached")
            if plan.nbytes > self.max_object_bytes:
                raise ObjectTooLargeError(
                    f"object of {plan.nbytes} bytes exceeds "
                    f"max_object_bytes={self.max_object_bytes}",
                    nbytes=plan.nbytes,
                )
            got = self.ring.try_allocate(plan.nbytes)
            if got is None:  # the slow path: evict, maybe wait
                if wait_for_space is None:
                    wait_for_space = self._config.wait_for_space
                self._waiting_keys.add(key)  # the lock may be let go while waiting: claim the key
                try:
                    self._evict.make_room(plan.nbytes, wait_for_space, own_pins or {}, abort)
                finally:
                    self._waiting_keys.discard(key)
                self._check_writer()  # closed while we waited?
                got = self.ring.allocate(plan.nbytes)
            res = Reservation(key, got[0], got[1], plan)
            self._pending[key] = res
            return res

    def write_reserved(self, res: Reservation) -> None:
        """Copy the value into its chunk. Touches only that chunk: the lock is held only while
        the chunk's view is taken, not for the copy.

        ``ClosedCacheError`` if the store was closed since the reservation (another thread's
        ``close`` does not wait for a copy outside the lock). Once the view is taken, a close
        meanwhile leaves the mapping to it (a released ring has no view to take: its
        ``ValueError`` was what such a put raised) and the commit raises ``ClosedCacheError``.
        A ``RawPlan`` is copied byte for byte (the core's copy: the GIL is let go for big ones),
        then verified at its source (``StaleReferenceError`` if the source changed meanwhile).
        """
        self._check_writer()  # closed, or a forked child: before the lock it may hold
        with self._lock:
            self._check_writer()  # closed while this waited for the lock
            dst = self.ring.payload(res.address)
        plan = res.plan
        if not isinstance(plan, RawPlan):
            self.serde.write(plan, dst)
            return
        src = plan.source()
        try:  # the core's copy: no GIL, streaming stores for big ones
            core.copy_into(dst, 0, src)
        finally:
            src.release()
        plan.verify()

    def commit(self, res: Reservation) -> ShmRef:
        """Publish a written chunk, index it and take the first hand-out."""
        with self._lock:
            if res.done:
                raise ShmCacheError("reservation already finished")
            res.done = True
            del self._pending[res.key]
            if self._closed:
                raise ClosedCacheError("store closed during the put")
            return self._publish_put(res.key, res.address, res.id, res.plan.nbytes)

    def _publish_put(self, key: str, address: int, cid: int, length: int) -> ShmRef:
        """Commit a written chunk, index it under ``key`` and take its first hand-out.

        The core's ``publish_plain`` first (the same steps in one call), or None before any
        side effect: then the steps below, the reference.
        """
        ref = _publish_plain(self, key, address, cid, length)
        if ref is not None:
            return ref
        ring, hw = self.ring, self._hw
        position = ring.commit(address)
        epoch = hw[H_EPOCH]
        base = _tag_base(self._secret, epoch, address, cid, length, position)
        # ``self._rows[cid] = ...`` and ``self._index[key] = cid`` inline: both keys are new
        # (a new chunk id; a key checked not cached, not pending, under the lock)
        rows, keys, index = self._rows, self._keys, self._index
        rows.shards[hash(cid) & rows.mask][cid] = _pack_row(address, length, position, base, epoch)
        rows.n += 1
        keys.shards[hash(cid) & keys.mask][cid] = key
        keys.n += 1
        index.shards[hash(key) & index.mask][key] = cid
        index.n = n_items = index.n + 1
        guarded = self._pins.guarded
        if guarded is not None:  # a request's own put (see ``guard``)
            guarded[cid] = None
        if self._has_hints:
            self._hints.publish(key, Hint(epoch, address, cid, length, position))
        hw[H_BYTES_USED] = ring.used_bytes  # publish_usage, inline: every put (evictions are
        hw[H_ITEMS] = n_items  # published where they happen)
        # ``self._ref(cid, seq)`` from what is at hand: the row just written, read back for
        # nothing otherwise (the epoch moves only in ``clear``, under this lock)
        seq = self._hand_out_seq(cid)
        return _new_ref(
            ShmRef,
            (self._nonce, epoch, address, cid, length, _finish_tag(base, seq), position, seq),
        )

    def abort(self, res: Reservation) -> None:
        """Abandon a reservation whose copy failed or was cancelled (idempotent: a committed
        one is left alone)."""
        with self._lock:
            if res.done:
                return
            res.done = True
            self._pending.pop(res.key, None)
            if not self._closed:
                self.ring.abandon(res.address)
                # the room made for it may have evicted: publish what is left, as a commit does
                self.publish_usage()

    def is_pending(self, key: str) -> bool:
        """A put of ``key`` is in progress (allocated, or waiting for room)."""
        with self._lock:
            return key in self._pending or key in self._waiting_keys

    # --- writer: hand-outs, pins, release -------------------------------------------------
    def get_cached(self, key: str) -> ShmRef | None:
        """A new hand-out of a cached key, or None if it is not cached."""
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            index = self._index
            cid = index.shards[hash(key) & index.mask].get(key)  # self._index.get, one call shorter
            return None if cid is None else self.hand_out(cid)

    def hand_out(self, cid: int) -> ShmRef:
        """A new hand-out of the cached chunk ``cid`` (``index[key]``; the lock held): a hit,
        marked for its second chance. ``ClosedCacheError`` once closed (checked only when
        the hand-out fails: its callers checked, and a try costs nothing)."""
        ev = self._evict
        if ev.second_chance:  # ``ev.mark(cid)``, inline
            marks = ev.marked
            shard = marks.shards[hash(cid) & marks.mask]
            if cid not in shard:
                shard[cid] = None
                marks.n += 1
        try:
            return self._ref(cid, self._hand_out_seq(cid))
        except (ValueError, BufferError):  # a released view: closed (else not ours to hide)
            self._check_writer()
            raise

    def release(self, ref: ShmRef) -> bool:
        """Undo one hand-out that never reached the readers. False if unknown or none left."""
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            if not isinstance(ref, ShmRef) or not check_ref_fields(ref):
                return False
            if ref.tag != reference_tag(
                self._secret, ref.epoch, ref.address, ref.id, ref.length, ref.position, ref.seq
            ):
                return False
            row = self._row(ref.id)
            if row is None or ref.nonce != self._nonce:
                return False
            if row[1] != ref.address or not self._ledger.release(ref.id, ref.seq):
                return False  # unknown, already released, or already read by everyone
            self._acks.publish_owed()
            return True

    def touch(self, key: str) -> bool:
        """Protect a cached key from eviction until its next hand-out (``handout_ttl`` at most).

        Returns False if ``key`` is not cached.
        """
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            return self._pins.touch(key)

    def pin(self, key: str) -> bool:
        """Request-scoped pin (counted) of the entry cached under ``key``; pair with
        :meth:`unpin`. False if ``key`` is not cached."""
        self._check_writer()
        with self._lock:
            return self._pins.pin_entry(key) is not None

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of the entry cached under ``key`` now."""
        if self._seg.forked:  # not when closed: a request's cleanup may run after a close
            self._check_writer()
        with self._lock:
            self._pins.unpin_key(key)

    def pin_entry(self, key: str) -> Debts | None:
        """Request-scoped pin of the entry cached under ``key`` now (see :meth:`unpin_entry`).

        Returns the entry's debts (``id`` is its chunk id), which hold the pin.
        """
        self._check_writer()
        with self._lock:
            return self._pins.pin_entry(key)

    def _pinned_entry_of(self, key: str) -> Debts | None:
        """The entry cached under ``key`` now if it holds a pin (what :meth:`pin` pinned)."""
        with self._lock:
            return self._pins.pinned_entry_of(key)

    def unpin_entry(self, e: Debts) -> None:
        """Undo one :meth:`pin_entry` of ``e`` (whatever key names it by now)."""
        with self._lock:
            self._pins.unpin_entry(e)

    @contextlib.contextmanager
    def pinned(self, keys: list[str]) -> Iterator[list[str]]:
        """Pin the cached ones of ``keys`` for the block; yields the list of keys pinned.

        Keys appended to that list (pinned later in the block with :meth:`pin`) are unpinned on
        exit too. Pins belong to entries: an entry invalidated and re-put meanwhile keeps the
        pins of its own requests, and the new entry is not unpinned by mistake.
        """
        entries = [(k, e) for k in keys if (e := self.pin_entry(k)) is not None]
        done = _PinnedKeys(self._pinned_entry_of, [k for k, _e in entries])
        n0 = len(done)
        try:
            yield done
        finally:
            for _k, e in entries:
                self.unpin_entry(e)
            for k in done[n0:]:
                later = done.later.get(k)
                if later:  # the entry its pin pinned, noted when it was appended
                    self.unpin_entry(later.pop(0))
                else:
                    self.unpin(k)

    def guard(self, keys: Sequence[str]) -> dict[int, None]:
        """Protect the chunks of the cached ``keys``, and every chunk put (committed) from now
        on, from eviction and relocation until :meth:`unguard`. Hold :attr:`lock` from here to
        :meth:`unguard`: the guard covers one step.

        A request protects its own items so that its later puts never evict its earlier ones.
        While it decides in one step under the lock, nothing else can put, so "every chunk put
        from now on" is exactly its own puts: a set member each instead of a pin (a ledger
        entry). Returns the guarded set (for :meth:`pin_ids` if the request goes on unlocked).
        """
        with self._lock:
            return self._pins.guard(keys)

    def unguard(self) -> None:
        """End :meth:`guard` (idempotent)."""
        with self._lock:
            self._pins.unguard()

    def pin_ids(self, ids: Iterable[int]) -> list[Debts]:
        """Request-scoped pins of the live chunks ``ids`` (each undone by :meth:`unpin_entry`):
        what a request's :meth:`guard` becomes when the request goes on outside the lock."""
        with self._lock:
            return self._pins.pin_ids(ids)

    # --- writer: eviction and acknowledgements (their parts') -------------------------------
    def drain(self) -> int:
        """Apply every acknowledgement written since the last drain; returns how many."""
        self._check_writer()
        with self._lock:
            return self._acks.drain()

    def is_freeable(self, key: str) -> bool:
        """Whether ``key``'s chunk could be evicted now.

        Drains the acknowledgement logs first and probes the readers still owing it, so a dead
        reader's debts do not count.
        """
        self._check_writer()
        with self._lock:
            return self._evict.is_freeable(key)

    def evict(self, nbytes: int = 0) -> list[str]:
        """Free free chunks from the head (all of them, or until ``nbytes`` fit); their keys.

        Readers owing the head item are probed first: a dead one's debts are dropped. An explicit
        eviction: hit items are evicted too (second chance applies to puts that need room).
        """
        self._check_writer()
        with self._lock:
            return self._evict.evict(nbytes)

    def invalidate(self, key: str) -> bool:
        """Forget ``key``: it is no longer handed out; its chunk is freed once its debts settle.

        Request pins on the old entry stay until their requests end (they unpin that entry).
        """
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            cid = self._index.pop(key, None)
            if cid is None:
                return False
            if self._hints:
                self._hints.remove(key, cid)
            if (e := self._ledger.get(cid)) is not None:
                self._ledger.untouch(e)
            self.publish_usage()
            return True

    def clear(self) -> int:
        """Drop every item: a new epoch makes every older reference stale. Returns items dropped."""
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            n = len(self._index)
            freed = self.ring.clear()
            entries = self._ledger.entries
            for cid in freed:
                entries.pop(cid, None)
                self._rows.pop(cid, None)
                self._keys.pop(cid, None)
            self._index.clear()
            self._evict.marked.clear()
            owed = self._ledger.owed
            for s in list(owed):
                owed[s] = 0
            self.publish_usage()
            self._acks.publish_owed()
            return n

    def reader_info(self) -> list[ReaderSlotInfo]:
        """Every reader slot: attached, alive (kernel lock), pid, acknowledgements, debt."""
        self._check_writer()  # a forked child must not publish the parent's words
        with self._lock:
            self._acks.publish_owed()
            return reader_slots_info(self._readers, probe=True)

    def get(self, ref: ShmRef | dict[str, Any]) -> Any:
        """The writer's own read of a reference: a verified copy; nothing is owed or
        acknowledged (the writer is nobody's debtor). A chunk reused during the copy is a
        ``StaleReferenceError``, as for a reader."""
        return self._reading.read(ref)

    def stop_waits(self) -> None:
        """Wake every put waiting for space (readers slow to acknowledge) and fail it, and any
        later wait, with ``ClosedCacheError``; puts that need no wait go on. The first step of
        a close that lets the puts in progress finish (``AsyncSenderCache.aclose``)."""
        self._evict.stop_waits()

    def close(self) -> None:
        """Idempotent: unlink the segment and its semaphore (readers then see
        ``WriterGoneError``). A put running in another thread ends first (its big copy runs
        without the GIL, holding the writer lock and the ring's views): the close takes the
        writer lock; a put copying outside it (one that may wait for space, a request's copy
        job) raises ``ClosedCacheError`` instead. A forked child's copy closes at once (no
        thread of the child holds the lock; the parent's may have held it at the fork)."""
        if self.forked:
            super().close()
            return
        with self._lock:
            super().close()

    def _close_role(self) -> None:
        """Unlink the wake-up semaphore, wake the writers waiting on it, drop the maps."""
        self._evict.close(unlink=not self._seg.forked)
        self._index.clear()
        self._rows.clear()
        self._keys.clear()
        self._ledger.entries.clear()
        self._hints.release()
