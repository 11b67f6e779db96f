"""Cache groups: one logical cache for a gateway that runs as several processes.

Why this shape:

* **One writer per segment, still.** Every guarantee of a cache rests on a single writer per
  segment (no lock on the read path, acknowledgement logs with one writer per word, FIFO
  eviction decided in one place). So a group is a set of ordinary segments, the *shards*, one per
  writer process: shard ``k`` of group ``G`` is the segment ``aioshm-G.shard<k>`` (names built and
  parsed in ``_layout``).
* **No coordinator.** A writer opening the group tries ``k = 0, 1, ...`` (up to ``MAX_SHARDS``):
  a free name is created (``O_EXCL`` decides races), a name whose writer is provably dead is
  reclaimed (the kernel lock is free: ``Segment.create``'s ``reclaim_dead`` path), a name with a
  live writer is skipped. The shard is created when the cache *opens*, never when the
  ``CacheConfig`` is built, so gunicorn-style forked workers and uvicorn's spawned ones each get
  their own shard. Readers and siblings find shards by listing ``/dev/shm`` for the group's
  names; a new shard is noticed at the next scan (at most ``RESCAN_INTERVAL`` later for a writer;
  at once for a reader that meets a reference naming an unknown shard).
* **Capacity.** Each shard has the ``capacity_bytes`` of the config: a group of N gateway
  processes holds up to N x ``capacity_bytes``. Size the config per gateway process. An item is
  normally held by the shard of the process that put it; a process that needs an item another
  shard holds copies it into its own shard (below), so hot items end up in several shards.
* **One cache, not N.** Each shard publishes its keys in a key-hint table inside its own segment
  (``_hints``: written by its writer only, read lock-free by anyone). A writer that misses in its
  own shard looks the key up in its siblings' tables; a hint is only a hint, so the sibling's
  chunk is then checked (``ShmRingBuffer.access``: id, state, length, reuse fence), its payload
  copied byte for byte into a chunk reserved in this shard, and the sibling's chunk verified
  again after the copy (``verify``). A torn, stale or overwritten hint, or a chunk freed during
  the copy, only means "not found": the reservation is aborted and the caller preprocesses. Such
  a *guest* read owes nothing and pins nothing in the sibling (it never takes a reader slot
  there), so a sibling's eviction is never held up by its siblings. The item is copied as bytes,
  not decoded: the shards of a group must use the same serde (they do unless you pass a custom
  one to some writers only). When this shard has no room for the copy (its ring full of items
  its readers still owe), the payload is decoded into objects of the writer's own and verified
  the same way (``Sibling.decode``), then served inline, as a plain cache serves an item it has
  no room for.
* **Readers of a group** (``ReceiverCache.attach_group``) claim a reader slot on every live
  shard and route each reference by its nonce to the shard that issued it (``_group_receiver``).

**Membership is proven, not guessed from the name.** A plain cache named ``G.shard0`` is not
shard 0 of group ``G``: only a segment whose header word ``H_GROUP`` is ``group_word(G)``
(written by ``open_shard``; see ``_layout``) is a member. Readers check it before they claim a
reader slot (``shard_identity``, a read of the file's header) and again once attached (the name
may have been reused in between); sibling writers check it when they map a sibling.

A sibling writer that dies is noticed through its kernel lock (probed at most every
``PROBE_INTERVAL``) and forgotten; its segment is reclaimed by the next writer that takes its
index, or removed by ``sweep``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from ._hints import HintTable
from ._layout import (
    H_EPOCH,
    H_GROUP,
    H_MAGIC,
    H_NONCE,
    H_SECRET,
    H_STATE,
    H_VERSION,
    LAYOUT_VERSION,
    MAGIC,
    MAX_SHARDS,
    SHM_DIR,
    STATE_LIVE,
    group_word,
    hint_slots_for,
    shard_name,
)
from ._ring import ShmRingBuffer
from ._segment import Segment, list_shards
from ._serde import Serde
from ._store import RawPlan, ShmObjectStore, StoreWriter
from ._types import CacheConfig, ShmRef, reference_tag
from .errors import SegmentExistsError, ShmCacheError, StaleReferenceError

__all__ = [
    "RESCAN_INTERVAL",
    "Found",
    "Sibling",
    "Siblings",
    "is_member",
    "open_shard",
    "shard_identity",
]

log = logging.getLogger("aioshmcache")

#: how often a writer lists /dev/shm for new shards of its group (seconds)
RESCAN_INTERVAL: Final = 1.0
#: how often a sibling's writer lock is probed (seconds)
PROBE_INTERVAL: Final = 0.25
#: keys a writer invalidated and copies from no sibling until it puts them again (the newest)
WITHHELD_MAX: Final = 65536


def shard_identity(name: str) -> tuple[int, int] | None:
    """``(nonce, H_GROUP word)`` of segment ``name`` read from its file, or None.

    None unless it is an initialised segment of this layout (magic and version), readable by
    this user. Reads the header only: nothing is mapped, no slot is claimed.
    """
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = os.pread(fd, 8 * (H_GROUP + 1), 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) != 8 * (H_GROUP + 1):
        return None
    hw = memoryview(head).cast("Q")
    if hw[H_MAGIC] != MAGIC or hw[H_VERSION] != LAYOUT_VERSION:
        return None
    return int(hw[H_NONCE]), int(hw[H_GROUP])


def is_member(segment: Segment, group: str) -> bool:
    """Whether the mapped ``segment`` proves it is a shard of ``group`` (its ``H_GROUP`` word)."""
    return not segment.closed and int(segment.words[H_GROUP]) == group_word(group)


def open_shard(config: CacheConfig, *, serde: Serde | None = None) -> tuple[StoreWriter, int]:
    """Create this process's shard of ``config.group``; returns the store and its index.

    Tries ``k = 0, 1, ...``: free -> create, dead writer -> reclaim, live writer -> next.
    ``SegmentExistsError`` when all ``MAX_SHARDS`` have live writers.
    """
    group = config.group
    if group is None:
        raise ValueError("not a group configuration")
    hints = hint_slots_for(config.capacity_bytes)
    for k in range(MAX_SHARDS):
        name = shard_name(group, k)
        try:
            store = ShmObjectStore.create(config, serde=serde, name=name, hint_slots=hints)
        except SegmentExistsError:
            continue  # a live writer (or one creating it right now): the next index
        # the proof of membership, before anything is handed out or published (see _layout)
        store.words[H_GROUP] = group_word(group)
        log.info("opened shard %d of cache group %r (%s)", k, group, name)
        return store, k
    raise SegmentExistsError(f"cache group {group!r} has {MAX_SHARDS} live writers already")


@dataclass(frozen=True)
class Found:
    """A key a sibling holds, as a reference into the sibling (unverified beyond ``access``)."""

    sibling: Sibling
    ref: ShmRef


class Sibling:
    """Another shard of the group, mapped for guest reads only (no reader slot, no debts)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.name = segment.name
        self.nonce = segment.nonce
        self._hw = segment.words
        self._secret = int(self._hw[H_SECRET])
        self.ring = ShmRingBuffer(segment, writer=False)
        self.hints = HintTable(segment)
        self._probed = 0.0
        self._alive = True
        # a copy from this sibling runs outside the Siblings lock (payload, the copy, verify):
        # a rescan may close the sibling meanwhile. payload and verify take this lock and see
        # ``closed`` (the copy itself reads a view that keeps its pages mapped); see ``_read_path``
        self._lock = threading.Lock()
        self.closed = False

    def alive(self) -> bool:
        """The writer has not closed the shard, and holds its kernel lock (probed sparingly)."""
        if not self._alive or self._hw[H_STATE] != STATE_LIVE:
            self._alive = False
            return False
        now = time.monotonic()
        if now - self._probed > PROBE_INTERVAL:
            self._alive = self.segment.writer_alive()
            self._probed = now
        return self._alive

    def find(self, key: str) -> ShmRef | None:
        """A reference to ``key``'s chunk here if its hint checks out now, else None."""
        h = self.hints.lookup(key)
        if h is None or h.epoch != self._hw[H_EPOCH]:
            return None
        tag = reference_tag(self._secret, h.epoch, h.address, h.id, h.length, h.position)
        ref = ShmRef(self.nonce, h.epoch, h.address, h.id, h.length, tag, h.position, 0)
        try:
            self.ring.access(h.address, h.id, h.length, h.position).release()
        except (ShmCacheError, ValueError):
            return None  # freed, reused, or a hint torn beyond what the seqlock catches
        return ref

    def payload(self, ref: ShmRef) -> memoryview:
        """A view of the chunk's payload, checked now (``StaleReferenceError`` if gone)."""
        with self._lock:
            self._check_open()
            return self.ring.access(ref.address, ref.id, ref.length, ref.position)

    def verify(self, ref: ShmRef) -> None:
        """``StaleReferenceError`` if the chunk was freed or reused since ``payload`` (or this
        sibling was detached meanwhile: its chunk can no longer be vouched for)."""
        with self._lock:
            self._check_open()
            self.ring.verify(ref.address, ref.id, ref.position)
            if self._hw[H_EPOCH] != ref.epoch:
                raise StaleReferenceError("the sibling shard was cleared during the copy")

    def _check_open(self) -> None:
        if self.closed:
            raise StaleReferenceError(f"sibling shard {self.name!r} was detached during the copy")

    def raw_plan(self, ref: ShmRef) -> RawPlan:
        """The plan that copies this chunk into a chunk of our own shard."""
        return RawPlan(ref.length, lambda: self.payload(ref), lambda: self.verify(ref))

    def decode(self, ref: ShmRef, serde: Serde) -> object:
        """The chunk's payload decoded into objects of our own (``serde.read`` with ``copy``:
        for a look-up served inline when our shard has no room), verified after the decode:
        ``StaleReferenceError`` if the chunk changed meanwhile, also when its torn bytes did
        not decode (the serde's error, a ``SerdeError`` or a custom serde's own, only for a
        chunk that did not change).
        """
        src = self.payload(ref)
        try:
            value = serde.read(src, copy=True)
        except Exception:
            self.verify(ref)
            raise
        finally:
            src.release()
        self.verify(ref)
        return value

    def close(self) -> None:
        """Unmap (idempotent); a copy in progress then fails its ``verify`` (stale)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.hints.release()
            self.ring.close()


class Siblings:
    """The other live shards of a writer's group, found by listing /dev/shm (thread-safe)."""

    def __init__(self, group: str, own: str, *, rescan_interval: float = RESCAN_INTERVAL) -> None:
        self.group = group
        self._own = own
        self._interval = rescan_interval
        self._by_name: dict[str, Sibling] = {}
        self._scanned = -1e9
        self._lock = threading.Lock()
        self.lookups = 0
        self.closed = False
        #: keys this writer invalidated: a sibling's copy of one is the old item (see
        #: ``withhold``), the newest ``WITHHELD_MAX``
        self.withheld: OrderedDict[str, None] = OrderedDict()
        #: ``withhold`` calls so far, and the count at each key's last one (the newest
        #: ``WITHHELD_MAX``; kept when the key is put again): see ``withheld_since``
        self.withholds = 0
        self._last_withheld: OrderedDict[str, int] = OrderedDict()

    def withhold(self, key: str) -> None:
        """Copy ``key`` from no sibling until this shard puts it again (``invalidate``: from
        then on no request of this writer is given the old copy, a sibling's included)."""
        w = self.withheld
        w[key] = None
        w.move_to_end(key)
        if len(w) > WITHHELD_MAX:
            w.popitem(last=False)
        self.withholds += 1
        last = self._last_withheld
        last[key] = self.withholds
        last.move_to_end(key)
        if len(last) > WITHHELD_MAX:
            last.popitem(last=False)

    def withheld_since(self, key: str, withholds: int) -> bool:
        """Whether ``key`` was withheld (invalidated) since ``withholds`` was this writer's
        count of them: a sibling's chunk found before is then the old item, also when this
        shard put ``key`` again meanwhile (which ends its withholding: ``withheld`` no longer
        says it). More than ``WITHHELD_MAX`` withholds since count as one of ``key``."""
        n = self.withholds - withholds
        if n == 0:
            return False
        return n >= WITHHELD_MAX or self._last_withheld.get(key, 0) > withholds

    def _rescan_locked(self) -> None:
        self._scanned = time.monotonic()
        present = {n for _k, n in list_shards(self.group)} - {self._own}
        for name in list(self._by_name):
            sib = self._by_name[name]
            if name not in present or not sib.alive():
                del self._by_name[name]
                sib.close()
        for name in sorted(present - set(self._by_name)):
            try:
                seg = Segment.attach(name, populate=False)
            except (ShmCacheError, OSError):
                continue  # being created, reclaimed, or not ours
            if not is_member(seg, self.group):
                seg.close()  # a plain cache named like a shard (or one being opened)
                continue
            sib = Sibling(seg)
            if not sib.alive():
                sib.close()
                continue
            self._by_name[name] = sib

    def find(self, key: str, *, rescan: bool = False) -> Found | None:
        """A live sibling holding ``key`` (its chunk checked now), or None; ``rescan``: look for
        new shards first, however recent the last scan (a single-flight claim's last look)."""
        with self._lock:
            if self.closed or (self.withheld and key in self.withheld):
                return None
            if rescan or time.monotonic() - self._scanned > self._interval:
                self._rescan_locked()
            self.lookups += 1
            for sib in list(self._by_name.values()):
                if not sib.alive():
                    continue
                ref = sib.find(key)
                if ref is not None:
                    return Found(sib, ref)
        return None

    def names(self) -> list[str]:
        """The siblings known now (after a rescan)."""
        with self._lock:
            self._rescan_locked()
            return sorted(self._by_name)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for sib in self._by_name.values():
                sib.close()
            self._by_name.clear()
