"""Layer 5: the object store of one segment, one object per role.

``ShmObjectStore`` is the package's public name: :meth:`ShmObjectStore.create` makes a segment
and returns its **writer**, a :class:`StoreWriter`; :meth:`ShmObjectStore.from_handle` attaches
a **reader**, a ``StoreReader`` (``_store_reader``). Both are ``ShmObjectStore``s: the base holds
what the two roles share (the mapped segment, its ring and reader table, the read path's checks
in :meth:`~ShmObjectStore.validate` and :meth:`~ShmObjectStore.get`, the handle, the lifetime)
and nothing else. Each role holds only its own state (``__slots__``): the writer has no reader
slot, the reader no index, ledger, rows or writer lock. Neither offers the other's methods:
looked up on the wrong object, one raises ``RoleError``, which says which
role has it and is also an ``AttributeError`` (so ``hasattr(reader, "put")`` is False).
The type checker knows each role too: ``create`` is typed to return a ``StoreWriter``,
``from_handle`` a ``StoreReader``, and neither class declares the other's methods.

The writer is made of three parts:

* its index ``key -> chunk id`` and a row per chunk (key, address, length, position, tag) over
  the ring (see "Compact writer state" below), with puts in three short steps so that a
  request can copy outside its lock: ``_reserve`` (check, allocate), ``_write_reserved`` (the
  copy, no shared state), and ``_commit`` (publish, index, first hand-out) or ``_abort``
  (private: the caches' requests drive them; :meth:`StoreWriter.put` is the public put);
* the **hand-out ledger** (``_ledger.HandoutLedger``, pure bookkeeping): who owes which
  hand-out, pins, touches, and the rules by which debts lapse (one-of-N expiry per hand-out,
  lost hand-outs in broadcast, stuck readers);
* the parts mixed in from their own modules: ``_acks`` (draining the readers' logs),
  ``_evict`` (FIFO eviction, second chance, waiting for space) and ``_pins`` (touches, a
  request's pins and guard).

The read path (``_reading.ReadPath``: resolve, verify, copy or view, acknowledge) serves both
roles: a reader's has its reader slot and acknowledges; the writer's has none and only verifies
its own reads.

**One lock rule.** Every writer method takes the writer's re-entrant :attr:`StoreWriter.lock`
itself; a caller may hold it around several calls to make them one step (``with store.lock:
store.put(...)``). Every writer method first checks that it runs in the process that created
the writer (:meth:`StoreWriter.check_owner`): a forked child gets ``RoleError`` before it could
touch the lock it may have inherited held.

A **hand-out** is one ``ShmRef`` returned by :meth:`StoreWriter.put` or
:meth:`StoreWriter.get_cached`, numbered by its ``seq``; every reader that owes it acknowledges
exactly that hand-out, ``(id, seq)``, once, after reading and verifying the bytes
(``StoreReader.get``). The writer connects the ledger to shared memory in ``_acks``: it drains
the readers' acknowledgement logs into it, notices sessions that attach, close, die (their
kernel lock is free) or are revoked, and publishes each slot's debt (``WS_OWED``) for
``inspect``.

**Compact writer state.** A full garbage collection walks every tracked object; a Python object
per cached item costs ~250 ns each (65-90 ms for 250,000 items here, more with the dicts that
point at them). So the writer keeps no object per item: the index maps key -> chunk id, and
each chunk's row is its key and a bytes object of packed ints (``_rows``, ``_keys``): the
collector never tracks them, nor the dicts holding only such values. (A tuple of ints would be
untracked only by a collection, and every insert of a fresh one tracks its dict again: a full
collection then walked every row, ~6 ms per 30,000 items here.) Only *active* entries (owed,
pinned or touched) have a ``Debts`` object in the ledger, and it is dropped again once settled.
The second-chance marks are a map of chunk id -> None (a set would be walked member by member),
and the ring keeps its FIFO in ``array('q')`` columns. The maps with one entry per item (index,
rows, keys, marks) are ``ShardedMap``s of 256 small dicts: growing, or rebuilding after churn,
never stalls a put for the tens of milliseconds a rebuild of one big dict takes.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

import posix_ipc

from ._acks import Acknowledgements
from ._core_api import core
from ._evict import EVICT_SLACK_BYTES, RELOCATE_BUDGET, Eviction
from ._hints import Hint, HintTable
from ._layout import (
    CHUNK_HEADER,
    DELIVERY_CODES,
    H_BYTES_USED,
    H_DELIVERY,
    H_EPOCH,
    H_EVICTIONS,
    H_HANDOUT_TTL_MS,
    H_ITEMS,
    H_MAX_OBJECT,
    H_SECRET,
    LAYOUT_VERSION,
    Layout,
    chunk_size,
    semaphore_name,
)
from ._ledger import Debts, HandoutLedger
from ._pins import Pins
from ._readers import ReaderTable, SlotState, reader_slots_info
from ._reading import ReadPath, check_ref_fields
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import EncodePlan, MsgpackSerde, Serde
from ._serde_encode import _Plan
from ._shards import ShardedMap, shards_for
from ._types import (
    _M1,
    _M3,
    CacheConfig,
    CacheHandle,
    ReaderSlotInfo,
    ShmRef,
    finish_tag,
    reference_tag,
    tag_base,
)
from .errors import (
    ClosedCacheError,
    DuplicateKeyError,
    InvalidReferenceError,
    ObjectTooLargeError,
    RoleError,
    ShmCacheError,
)

__all__ = ["RawPlan", "Reservation", "ShmObjectStore", "StoreWriter"]

log = logging.getLogger("aioshmcache")

#: Copies below this size are made holding the writer lock, where the call began (``put``, and
#: a request's small misses: on the loop, for the async facade); bigger ones run outside the
#: lock (a request's copy jobs: in a worker thread, for the async facade). The one threshold
#: for both. Measured by ``bench`` here: a thread hop costs 75-170 us, a warm 1 MiB copy
#: ~40 us, so copies under 1 MiB are cheaper inline and keep loop lag below ~0.1 ms.
INLINE_COPY_UNDER_LOCK: Final = 1 << 20

#: A cached item's row, by chunk id: ``(key, address, length, position, tag_base, tag_epoch)``.
#: Kept as its key (a str) and the five ints packed in a bytes object (``_ROW``): neither is a
#: container, so the collector never tracks them or the dicts that hold them (see "Compact
#: writer state" in the module docstring).
_Row = tuple[str, int, int, int, int, int]
_ROW: Final = struct.Struct("=5Q")  # a tag base is kept to 64 bits (its tag is the same)
_U64: Final = (1 << 64) - 1
_pack_row: Final = _ROW.pack
_unpack_row: Final = _ROW.unpack
_new_ref: Final = tuple.__new__  # ShmRef's fields in order, without its Python-level __new__
_NOBODY: Final[list[int]] = []  # the owers of a one-of-N hand-out (never appended to)
#: the core's put of a plain item (``_core_put.c``); it declines with None before any side effect
core.configure(ShmRef, _Plan, MsgpackSerde)
_put_plain = core.put_plain
#: the core's reference of a hand-out (``StoreWriter._ref``); None: the Python steps decide
_make_ref = core.make_ref
#: the core's publish of a written chunk (``StoreWriter._publish_put``); None: the Python steps
_publish_plain = core.publish_plain


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


def _public_names(cls: type) -> frozenset[str]:
    return frozenset(n for n in dir(cls) if not n.startswith("_"))


class _OtherRolesName:
    """One of the other role's names on a role's class (``put`` on the reader's): looked up on
    an instance, it raises ``RoleError`` (an ``AttributeError`` too: ``hasattr`` is False).

    Set on the class at run time only, so the type checker still knows each role's own names.
    """

    __slots__ = ("name", "role")

    def __init__(self, name: str, role: str) -> None:
        self.name = name
        self.role = role

    def __get__(self, obj: ShmObjectStore | None, cls: type | None = None) -> Any:
        if obj is None:
            return self  # on the class: for ``dir``, ``inspect`` and the like
        raise RoleError(obj._wrong_role(self.name, self.role), name=self.name, obj=obj)


class ShmObjectStore(abc.ABC):
    """Single-writer / multi-reader object store in one shared-memory segment.

    :meth:`create` makes the segment and returns its writer (:class:`StoreWriter`);
    :meth:`from_handle` attaches a reader (``StoreReader``), which claims a reader slot. This
    base is what both roles share; each role's methods are on its own class (see the module
    docstring: the other role's names raise ``RoleError``).
    """

    __slots__ = (
        "_closed",
        "_hw",
        "_nonce",
        "_readers",
        "_reading",
        "_seg",
        "handout_ttl",
        "max_object_bytes",
        "one_of_n",
        "ring",
        "serde",
    )

    #: the role's name ("writer", "reader"), set by each role's class
    _role: ClassVar[str] = ""
    #: each role's own public names (registered by ``__init_subclass__``)
    _role_names: ClassVar[dict[str, frozenset[str]]] = {}
    _role_classes: ClassVar[dict[str, type[ShmObjectStore]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register a role (a class that sets ``_role``): its own public names become, on
        every other role's class, names that raise ``RoleError`` (``_OtherRolesName``),
        and theirs on it.

        Class attributes, not ``__getattr__``: a class with ``__getattr__`` loses the
        interpreter's fast attribute loads on every access (13-16 % more instructions per
        1 KiB request here), and these names are only ever looked up by mistake.
        """
        super().__init_subclass__(**kwargs)
        if "_role" not in cls.__dict__:
            return
        own = _public_names(cls) - _public_names(ShmObjectStore)
        for role, other in ShmObjectStore._role_classes.items():
            theirs = ShmObjectStore._role_names[role]
            for name in theirs - own:
                setattr(cls, name, _OtherRolesName(name, role))
            for name in own - theirs:
                setattr(other, name, _OtherRolesName(name, cls._role))
        ShmObjectStore._role_names[cls._role] = own
        ShmObjectStore._role_classes[cls._role] = cls

    def __init__(
        self,
        segment: Segment,
        ring: ShmRingBuffer,
        *,
        serde: Serde | None = None,
        probe_interval: float = 0.25,
    ) -> None:
        self._seg = segment
        self._hw = segment.words
        self.ring = ring
        self._readers = ReaderTable(segment)
        self.serde: Serde = serde if serde is not None else MsgpackSerde()
        self.max_object_bytes = int(self._hw[H_MAX_OBJECT])
        self.one_of_n = int(self._hw[H_DELIVERY]) == DELIVERY_CODES["one_of_n"]
        self.handout_ttl = int(self._hw[H_HANDOUT_TTL_MS]) / 1000.0
        self._nonce = segment.nonce
        self._closed = False
        self._reading = ReadPath(segment, ring, self.serde, probe_interval=probe_interval)

    # --- construction ------------------------------------------------------------------------
    @staticmethod
    def create(
        config: CacheConfig,
        *,
        serde: Serde | None = None,
        name: str | None = None,
        hint_slots: int = 0,
    ) -> StoreWriter:
        """Create the segment and return its writer (``close`` unlinks it).

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
            return StoreWriter(seg, config, serde=serde)
        except BaseException:
            seg.close()
            raise

    @staticmethod
    def from_handle(
        handle: CacheHandle | str | dict[str, Any],
        *,
        serde: Serde | None = None,
        probe_interval: float = 0.25,
    ) -> StoreReader:
        """Attach to a writer's segment and return a reader, which claims a reader slot.

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
            return StoreReader(seg, serde=serde, probe_interval=probe_interval)
        except BaseException:
            seg.close()
            raise

    # --- what both roles share -------------------------------------------------------------------
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
        """The current epoch (:meth:`StoreWriter.clear` starts a new one)."""
        return int(self._hw[H_EPOCH])

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (and has released the mapping)."""
        return self._closed

    def _check_open(self) -> None:
        self._reading.check_open()

    def validate(self, ref: object) -> ShmRef:
        """Check a reference against this segment without reading it (typed errors)."""
        return self._reading.validate(ref)

    @abc.abstractmethod
    def get(self, ref: ShmRef | dict[str, Any]) -> Any:
        """Read a reference: resolve, copy, and verify the copy (a chunk reused during the
        copy is a ``StaleReferenceError``, never torn data). A reader then acknowledges it."""

    def reader_info(self) -> list[ReaderSlotInfo]:
        """Every reader slot: attached, alive (kernel lock), pid, acknowledgements, debt."""
        self._check_open()
        return reader_slots_info(self._readers, probe=True)

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent. The writer unlinks the segment and its semaphore; a reader frees its slot."""
        if self._closed:
            return
        self._closed = True
        self._reading.close()
        self._close_role()
        self._readers.release()
        self.ring.close()

    @abc.abstractmethod
    def _close_role(self) -> None:
        """Release what only this role holds (``close`` calls it once, before the mapping)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wrong_role(self, name: str, role: str) -> str:
        how = "ShmObjectStore.create" if role == "writer" else "ShmObjectStore.from_handle"
        msg = f"this store is a {self._role}: {name!r} is the {role}'s ({how} makes a {role})"
        if self._seg.forked:
            msg += f"; and this object was opened by process {self._seg.pid}: attach again"
        return msg


class StoreWriter(ShmObjectStore, Acknowledgements, Eviction, Pins):
    """The writer of one segment (:meth:`ShmObjectStore.create`); ``close`` unlinks it.

    Puts, hands out, pins, evicts and clears; drains the readers' acknowledgements. Every
    method takes :attr:`lock` itself (re-entrant), after :meth:`check_owner`.
    """

    __slots__ = (
        "_by_id",
        "_config",
        "_guarded",
        "_has_hints",
        "_hints",
        "_index",
        "_keys",
        "_known_sessions",
        "_ledger",
        "_live_sessions",
        "_live_slots",
        "_lock",
        "_marked",
        "_pending",
        "_rows",
        "_secret",
        "_sem",
        "_slots",
        "_undrained",
        "_waiters",
        "_waiting_keys",
        "bytes_relocated",
        "evict_slack",
        "evictions",
        "on_evict",
        "relocate_budget",
        "relocations",
        "second_chance",
        "wakeups",
    )

    _role = "writer"

    def __init__(self, segment: Segment, config: CacheConfig, *, serde: Serde | None = None):
        """The writer's state over a segment just created (use :meth:`ShmObjectStore.create`)."""
        super().__init__(segment, ShmRingBuffer(segment, writer=True), serde=serde)
        self._config = config
        self._secret = int(self._hw[H_SECRET])  # the key of every reference's tag
        self._hints = HintTable(segment)  # empty unless the segment is a group shard
        self._has_hints = bool(self._hints)  # its size is fixed with the segment
        self._ledger = HandoutLedger(one_of_n=self.one_of_n, handout_ttl=self.handout_ttl)
        # one entry per cached item: sharded, so that no put rebuilds a big table (``_shards``)
        # at most one item per smallest chunk: the per-item maps are sized for that many
        n = shards_for(self.ring.capacity // chunk_size(1))
        self._index: ShardedMap[str, int] = ShardedMap(n)  # key -> chunk id
        # chunk id -> its row (``_ROW``-packed bytes: never tracked by the collector, nor is a
        # dict of them) and its key, until the chunk is freed
        self._rows: ShardedMap[int, bytes] = ShardedMap(n)
        self._keys: ShardedMap[int, str] = ShardedMap(n)
        # second chance: chunk ids hit since written or moved. A dict of int -> None, not a set:
        # the collector untracks such a dict, while it walks every member of a set (12 ms per
        # full collection with 250,000 marked items)
        self._marked: ShardedMap[int, None] = ShardedMap(n)
        self._by_id: dict[int, Debts] = self._ledger.entries  # the same dict: active entries only
        self._pending: dict[str, Reservation] = {}
        self._waiting_keys: set[str] = set()
        self._waiters = 0  # threads asleep in _wait (they own the semaphore handle then)
        self._slots = [SlotState() for _ in range(self._readers.n_slots)]
        self._known_sessions = [0] * self._readers.n_slots
        self._live_slots: list[tuple[int, int]] = []  # (slot, session) of live readers
        self._live_sessions: list[int] = []
        self._undrained = 0
        self.evictions = 0
        self.wakeups = 0
        self.relocations = 0  # second chance: chunks moved to the tail instead of evicted
        self.bytes_relocated = 0  # their payload bytes
        self.second_chance = config.second_chance
        self.relocate_budget = RELOCATE_BUDGET  # per put (tests lower it)
        self.evict_slack = min(EVICT_SLACK_BYTES, self.ring.capacity // 16)
        self.on_evict: Callable[[str], None] | None = None
        # serialises writer state changes between threads; re-entrant, so that one lock rule
        # holds: every writer method takes it itself, and a caller may hold it around several
        self._lock = threading.RLock()
        # a request's guard while it decides under the lock (see ``guard``): these chunk ids
        # are not evicted or moved; every chunk put meanwhile joins them. None: no guard
        self._guarded: dict[int, None] | None = None
        # the wake-up semaphore readers post while the writer waits for space (``_evict``)
        self._sem: Any = posix_ipc.Semaphore(
            semaphore_name(segment.name, segment.nonce), posix_ipc.O_CREX, 0o600, 0
        )

    @property
    def lock(self) -> threading.RLock:
        """The writer lock (re-entrant). Every writer method takes it itself; hold it around
        several calls to make them one step for other threads (``with store.lock: ...``)."""
        return self._lock

    @property
    def shards(self) -> int:
        """How many dicts each per-item map of the writer is split into (``_shards``)."""
        return len(self._index.shards)

    def check_owner(self) -> None:
        """``RoleError`` in a forked child of the process that created the writer;
        ``ClosedCacheError`` once closed. Every writer method checks it first, before it
        touches shared memory or takes :attr:`lock` (a forked child may inherit it held)."""
        if self._reading.closed or self._seg.forked:  # one test when fine
            self._check_open()  # raises: closed, or a forked child

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

    def _drop_row(self, cid: int) -> str | None:
        """Forget chunk ``cid``'s row; its key (None if it had none: a dead allocation)."""
        self._rows.pop(cid, None)
        return self._keys.pop(cid, None)

    def _ref(self, cid: int, seq: int = 0) -> ShmRef:
        ref = _make_ref(self, cid, seq)  # the core's, if it may (else None: the steps below)
        if ref is not None:
            return ref
        epoch = self._hw[H_EPOCH]  # a "Q" view: already an int
        rows = self._rows
        shard = rows.shards[hash(cid) & rows.mask]  # self._rows[cid], one call shorter
        address, length, position, base, tag_epoch = _unpack_row(shard[cid])
        if tag_epoch != epoch:  # the seq-independent part of the tag, once per epoch
            base = tag_base(self._secret, epoch, address, cid, length, position) & _U64
            shard[cid] = _pack_row(address, length, position, base, epoch)
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
        self._check_writer()  # first: a forked child may inherit the lock held
        plan = self.plan(value)
        if wait_for_space is None:
            wait_for_space = self._config.wait_for_space
        with self._lock:
            if plan.nbytes < INLINE_COPY_UNDER_LOCK and not wait_for_space:
                return self._put_now(key, plan)  # small, no wait: one step, the copy is µs
            res = self._reserve(key, plan, wait_for_space=wait_for_space)
            if plan.nbytes < INLINE_COPY_UNDER_LOCK:
                try:
                    self._write_reserved(res)
                except BaseException:
                    self._abort(res)
                    raise
                return self._commit(res)
        try:
            self._write_reserved(res)
        except BaseException:
            with self._lock:
                self._abort(res)
            raise
        with self._lock:
            return self._commit(res)

    def put_locked(self, key: str, plan: EncodePlan) -> ShmRef:
        """``_reserve`` + ``_write_reserved`` + ``_commit`` of a small value in one step, without
        waiting for space. The lock is held throughout (never let go: the copy runs under it).

        For copies of microseconds (the sender's one-item path, :meth:`put` of a small value):
        no ``Reservation`` is made, since nothing can see the chunk before it is committed.
        ``DuplicateKeyError``, ``CacheFullError`` (nothing allocated: eviction made no room), or
        the copy's error (the chunk is abandoned, reclaimed in FIFO order). ``plan`` was made by
        :meth:`plan` (the size limit is checked there).
        """
        self._check_writer()  # closed, a reader, or a forked child: the typed error first
        with self._lock:
            return self._put_now(key, plan)

    def _put_now(self, key: str, plan: EncodePlan) -> ShmRef:
        """:meth:`put_locked` for a caller that checked the owner and holds the lock (a
        sender request, deciding all its items in one locked step).

        The core's ``put_plain`` runs first: the usual put in one compiled step (the C core;
        the pure core declines every put), or None, before any side effect, for anything
        unusual; then the steps below, the reference, run.
        """
        ref = _put_plain(self, key, plan)
        if ref is not None:
            return ref
        if type(key) is not str and not isinstance(key, str):
            raise TypeError(f"keys are str, not {type(key).__name__}")
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
            self._make_room(nbytes, 0.0, {})  # no wait: the lock is never let go
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
            raise
        return self._publish_put(key, address, cid, nbytes)

    def _reserve(
        self,
        key: str,
        plan: EncodePlan | RawPlan,
        *,
        wait_for_space: float | None = None,
        own_pins: Mapping[object, int] | None = None,
        abort: Callable[[], bool] | None = None,
    ) -> Reservation:
        """Allocate a chunk for ``plan`` (evicting FIFO as needed; the lock is let go only while
        waiting for space).

        ``own_pins``: the caller's pins (entry -> count, as returned by :meth:`_pin_entry`). When
        only those hold the head of the ring, nothing can make room while the caller waits, so
        ``CacheFullError`` comes at once instead of after ``wait_for_space``. ``abort``: asked
        after every wake-up while waiting; true ends the wait with ``CacheFullError`` (the caller
        gave up, e.g. a cancelled request).
        """
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            if type(key) is not str and not isinstance(key, str):
                raise TypeError(f"keys are str, not {type(key).__name__}")
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
                    self._make_room(plan.nbytes, wait_for_space, own_pins or {}, abort)
                finally:
                    self._waiting_keys.discard(key)
                self._check_writer()  # closed while we waited?
                got = self.ring.allocate(plan.nbytes)
            res = Reservation(key, got[0], got[1], plan)
            self._pending[key] = res
            return res

    def _write_reserved(self, res: Reservation) -> None:
        """Copy the value into its chunk. Touches only that chunk: no lock needed.

        A ``RawPlan`` is copied byte for byte (the core's copy: the GIL is let go for big ones),
        then verified at its source (``StaleReferenceError`` if the source changed meanwhile).
        """
        plan = res.plan
        if not isinstance(plan, RawPlan):
            self.serde.write(plan, self.ring.payload(res.address))
            return
        src = plan.source()
        try:  # the core's copy: no GIL, streaming stores for big ones
            core.copy_into(self.ring.payload(res.address), 0, src)
        finally:
            src.release()
        plan.verify()

    def _commit(self, res: Reservation) -> ShmRef:
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
        base = tag_base(self._secret, epoch, address, cid, length, position) & _U64
        # ``self._rows[cid] = ...`` and ``self._index[key] = cid`` inline: both keys are new
        # (a new chunk id; a key checked not cached, not pending, under the lock)
        rows, keys, index = self._rows, self._keys, self._index
        rows.shards[hash(cid) & rows.mask][cid] = _pack_row(address, length, position, base, epoch)
        rows.n += 1
        keys.shards[hash(cid) & keys.mask][cid] = key
        keys.n += 1
        index.shards[hash(key) & index.mask][key] = cid
        index.n = n_items = index.n + 1
        if self._guarded is not None:  # a request's own put (see ``guard``)
            self._guarded[cid] = None
        if self._has_hints:
            self._hints.publish(key, Hint(epoch, address, cid, length, position))
        hw[H_BYTES_USED] = ring.used_bytes  # _publish_usage, inline: every put (evictions are
        hw[H_ITEMS] = n_items  # published where they happen, by _forget)
        # ``self._ref(cid, seq)`` from what is at hand: the row just written, read back for
        # nothing otherwise (the epoch moves only in ``clear``, under this lock)
        seq = self._hand_out_seq(cid)
        t = (base ^ (seq * _M3 >> 11)) & _U64  # ``finish_tag(base, seq)``, inlined
        t ^= t >> 29
        return _new_ref(
            ShmRef, (self._nonce, epoch, address, cid, length, (t * _M1) & _U64, position, seq)
        )

    def _abort(self, res: Reservation) -> None:
        """Abandon a reservation whose copy failed or was cancelled."""
        with self._lock:
            if res.done:
                return
            res.done = True
            self._pending.pop(res.key, None)
            if not self._closed:
                self.ring.abandon(res.address)

    def is_pending(self, key: str) -> bool:
        """A put of ``key`` is in progress (allocated, or waiting for room)."""
        with self._lock:
            return key in self._pending or key in self._waiting_keys

    # --- writer: hand-outs, pins, release -------------------------------------------------
    def get_cached(self, key: str) -> ShmRef | None:
        """A new hand-out of a cached key, or None if it is not cached."""
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            return self._hand_out_key(key)

    def _hand_out_key(self, key: str) -> ShmRef | None:
        """:meth:`get_cached` for a caller that checked the owner and holds the lock."""
        index = self._index
        cid = index.shards[hash(key) & index.mask].get(key)  # self._index.get, one call shorter
        return None if cid is None else self._hand_out_cid(cid)

    def _hand_out_cid(self, cid: int) -> ShmRef:
        """A new hand-out of the cached chunk ``cid`` (``_index[key]``; lock held, as above)."""
        if self.second_chance:  # a hit: second chance (``self._marked[cid] = None``, inline)
            marks = self._marked
            shard = marks.shards[hash(cid) & marks.mask]
            if cid not in shard:
                shard[cid] = None
                marks.n += 1
        return self._ref(cid, self._hand_out_seq(cid))

    def _hand_out_seq(self, cid: int) -> int:
        """Record a hand-out of chunk ``cid`` (owed by the live sessions); its sequence number."""
        if self.one_of_n:
            seq = self._ledger.hand_out_id(cid, _NOBODY)
        else:
            if self._readers.sessions() != self._known_sessions:
                self._sync_sessions()
            seq = self._ledger.hand_out_id(cid, self._live_sessions)
            if self._live_sessions:
                owed, words = self._ledger.owed, self._readers.owed_words
                for i, s in self._live_slots:  # the owing slots' debts, for inspect
                    words[i] = owed[s]
        self._undrained += 1
        if self._undrained * 2 >= self._readers.log_entries:
            self.drain()
        return seq

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
            self._publish_owed()
            return True

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
            self._publish_usage()
            return True

    def _publish_usage(self) -> None:
        hw = self._hw
        hw[H_BYTES_USED] = self.ring.used_bytes
        hw[H_ITEMS] = len(self._index)
        hw[H_EVICTIONS] = self.evictions

    def clear(self) -> int:
        """Drop every item: a new epoch makes every older reference stale. Returns items dropped."""
        self._check_writer()  # first: a forked child may inherit the lock held
        with self._lock:
            n = len(self._index)
            freed = self.ring.clear()
            for cid in freed:
                self._by_id.pop(cid, None)
                self._drop_row(cid)
            self._index.clear()
            self._marked.clear()
            for s in list(self._ledger.owed):
                self._ledger.owed[s] = 0
            self._publish_usage()
            self._publish_owed()
            return n

    def reader_info(self) -> list[ReaderSlotInfo]:
        """Every reader slot: attached, alive (kernel lock), pid, acknowledgements, debt."""
        self._check_writer()  # a forked child must not publish the parent's words
        with self._lock:
            self._publish_owed()
            return reader_slots_info(self._readers, probe=True)

    def get(self, ref: ShmRef | dict[str, Any]) -> Any:
        """The writer's own read of a reference: a verified copy; nothing is owed or
        acknowledged (the writer is nobody's debtor). A chunk reused during the copy is a
        ``StaleReferenceError``, as for a reader."""
        return self._reading.read(ref)

    def _close_role(self) -> None:
        """Unlink the wake-up semaphore, wake the writers waiting on it, drop the maps."""
        sem = self._sem
        with contextlib.suppress(posix_ipc.ExistentialError, OSError):
            if not self._seg.forked:
                sem.unlink()
        if self._waiters:  # wake them; the last one closes the handle (never under them)
            for _ in range(self._waiters):
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    sem.release()
        else:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                sem.close()
        self._index.clear()
        self._rows.clear()
        self._keys.clear()
        self._marked.clear()
        self._by_id.clear()
        self._hints.release()


# The reader's class builds on the base above; imported last so that ``from_handle`` (and its
# annotation, for ``typing.get_type_hints``) finds it here.
from ._store_reader import StoreReader  # noqa: E402
