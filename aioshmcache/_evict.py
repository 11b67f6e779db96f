"""Layer 5, eviction: how the writer makes room — FIFO, second chance, batch eviction, waits.

``Eviction`` is the part of the writer (``StoreWriter``) that frees chunks. It owns the
second-chance marks, its counters and settings, and the wake-up semaphore with the writers
asleep on it; it works on the ring, the hand-out ledger, the acknowledgements and pins parts and
the writer's index and rows, which the writer lends it, and asks the writer (a small
``EvictionHost`` interface) for what only the writer knows: which keys are being put, and how to
publish its usage and re-point a key at a moved chunk. It holds no lock of its own: the writer
calls it holding the writer lock, which :meth:`Eviction.make_room` lets go of while it waits.

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
A put bigger than that byte slack frees room for :data:`EVICT_AHEAD_PUTS` more puts of its size
(within the same 1/16), so big puts also evict in batches: the pass's fixed cost is then paid
every few puts, and each chunk freed ahead costs far less than the copy it makes room for.
Both bounds are small on purpose: a burst of lazy frees is what makes a put stall.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import posix_ipc

from ._acks import Acknowledgements
from ._hints import HintTable
from ._layout import H_BYTES_RELOCATED, H_EVICTIONS, H_RELOCATIONS, H_WAITING, chunk_size
from ._ledger import Debts, HandoutLedger
from ._pins import Pins
from ._ring import ShmRingBuffer
from ._sharded_map import ShardedMap
from .errors import CacheFullError, ClosedCacheError

__all__ = [
    "EVICT_AHEAD_PUTS",
    "EVICT_SLACK_BYTES",
    "EVICT_SLACK_CHUNKS",
    "RELOCATE_BUDGET",
    "RELOCATE_MAX_ITEMS",
    "WAIT_POLL",
    "Eviction",
    "EvictionHost",
]

WAIT_POLL: Final = 0.1  # the longest a waiting writer sleeps between checks (lost-post bound)
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
#: A put bigger than that slack frees room for this many more puts of its own size instead
#: (still within 1/16 of the ring): a run of 1 MiB puts then runs one eviction pass every
#: third put, not at every one. A pass has a fixed cost (drain the logs, a failed allocation,
#: the look at the head, publishing the fence: ~300 bytecodes, ~5 us here) that a 1 MiB copy
#: (~40-120 us) should not pay each time; each chunk freed ahead costs ~1-2 us.
EVICT_AHEAD_PUTS: Final = 2


class EvictionHost(Protocol):
    """What eviction asks of the writer it belongs to."""

    def is_pending(self, key: str) -> bool:
        """A put of ``key`` is in progress (allocated, or waiting for room)."""

    def publish_usage(self) -> None:
        """Publish the bytes and items in use (and the evictions) in the segment header."""

    def relocated(self, key: str, cid: int, address: int, length: int, position: int) -> None:
        """Index ``key`` under chunk ``cid``, the copy of its entry moved to the tail."""

    def check_owner(self) -> None:
        """The writer's typed error if it closed (or this is a forked child)."""

    def length_of(self, cid: int) -> int:
        """The payload length of live chunk ``cid`` (0 if it has no row)."""


def release_all(lock: threading.RLock) -> int:
    """Let go of a re-entrant lock this thread holds, however many times; how many."""
    n = 0
    while True:
        try:
            lock.release()
        except RuntimeError:  # no longer ours: released as many times as it was taken
            return n
        n += 1


class Eviction:
    """The writer's eviction (see the module docstring)."""

    __slots__ = (
        "_acks",
        "_closed",
        "_entries",
        "_evict_after",
        "_hints",
        "_host",
        "_hw",
        "_index",
        "_keys",
        "_ledger",
        "_lock",
        "_pins",
        "_rows",
        "_sem",
        "_stopping",
        "_waiters",
        "bytes_relocated",
        "evict_slack",
        "evictions",
        "marked",
        "on_evict",
        "relocate_budget",
        "relocations",
        "ring",
        "second_chance",
        "wakeups",
    )

    def __init__(
        self,
        host: EvictionHost,
        *,
        ring: ShmRingBuffer,
        words: Any,
        ledger: HandoutLedger,
        acks: Acknowledgements,
        pins: Pins,
        hints: HintTable | None,
        index: ShardedMap[str, int],
        rows: ShardedMap[int, bytes],
        keys: ShardedMap[int, str],
        lock: threading.RLock,
        sem: Any,
        second_chance: bool,
        evict_after: float | None,
    ) -> None:
        self._host = host
        self.ring = ring
        self._hw = words  # the segment header's words
        self._ledger = ledger
        self._entries = ledger.entries  # active entries only, by chunk id
        self._acks = acks
        self._pins = pins
        self._hints = hints  # None unless the segment is a group shard
        self._index, self._rows, self._keys = index, rows, keys
        self._lock = lock
        self._sem = sem  # the wake-up semaphore readers post while the writer waits for space
        self._waiters = 0  # threads asleep in _wait (they own the semaphore handle then)
        self._closed = False
        self._stopping = False  # ``stop_waits``: no put waits for space any more
        self._evict_after = evict_after
        # second chance: chunk ids hit since written or moved. A dict of int -> None, not a set:
        # the collector untracks such a dict, while it walks every member of a set (12 ms per
        # full collection with 250,000 marked items)
        self.marked: ShardedMap[int, None] = ShardedMap(len(index.shards))
        self.second_chance = second_chance
        self.evictions = 0
        self.wakeups = 0
        self.relocations = 0  # second chance: chunks moved to the tail instead of evicted
        self.bytes_relocated = 0  # their payload bytes
        self.relocate_budget = RELOCATE_BUDGET  # per put (tests lower it)
        self.evict_slack = min(EVICT_SLACK_BYTES, ring.capacity // 16)
        self.on_evict: Callable[[str], None] | None = None

    def mark(self, cid: int) -> None:
        """A hit on chunk ``cid``: it gets a second chance (``self.marked[cid] = None``)."""
        marks = self.marked
        shard = marks.shards[hash(cid) & marks.mask]
        if cid not in shard:
            shard[cid] = None
            marks.n += 1

    def _is_free(self, cid: int) -> bool:
        g = self._pins.guarded
        if g is not None and cid in g:
            return False  # guarded by the request deciding now
        e = self._entries.get(cid)
        return e is None or self._ledger.is_free(e)

    def is_freeable(self, key: str) -> bool:
        """Whether ``key``'s chunk could be evicted now (the logs drained first; the readers
        still owing it probed, so a dead reader's debts do not count)."""
        self._acks.drain()
        cid = self._index.get(key)
        if cid is None:
            return False
        e = self._ledger.get(cid)
        if e is None:
            return True  # nothing owed, pinned or touched
        if e.debt > 0 and not self._acks.one_of_n:
            self._acks.probe_debtors(e, self._evict_after)
        return self._ledger.is_free(e)

    def forget(self, freed: list[int]) -> None:
        """Drop the rows, index entries, marks and debts of freed chunks; count evictions."""
        index, marked, entries = self._index, self.marked, self._entries
        rows, keys = self._rows, self._keys
        hints = self._hints
        on_evict = self.on_evict
        evicted = self.evictions
        for cid in freed:  # the ``ShardedMap`` calls inline: once per chunk freed
            if cid in entries:
                self._ledger.forget(cid)
            h = hash(cid)
            if cid in (dm := marked.shards[h & marked.mask]):  # ``del marked[cid]``
                del dm[cid]
                marked.n -= 1
            if cid in (dr := rows.shards[h & rows.mask]):  # ``del rows[cid]``
                del dr[cid]
                rows.n -= 1
            key = keys.shards[h & keys.mask].pop(cid, None)
            if key is None:
                continue  # a dead allocation: never indexed
            keys.n -= 1
            if (di := index.shards[hash(key) & index.mask]).get(key) == cid:  # ``del index[key]``
                del di[key]
                index.n -= 1
                if hints is not None:
                    hints.remove(key, cid)
                self.evictions += 1
                if on_evict is not None:
                    on_evict(key)
        if self.evictions != evicted:
            self._hw[H_EVICTIONS] = self.evictions

    def _head_entry(self) -> Debts | None:
        cid = self.ring.head_id
        return None if cid is None else self._entries.get(cid)

    def evict(self, nbytes: int = 0) -> list[str]:
        """Free free chunks from the head (all of them, or until ``nbytes`` fit); their keys.

        Readers owing the head item are probed first: a dead one's debts are dropped. An explicit
        eviction: hit items are evicted too (second chance applies to puts that need room).
        """
        self._acks.drain()
        head = self._head_entry()
        if head is not None and head.debt > 0:
            self._acks.probe_debtors(head, self._evict_after)
        freed = self.ring.free(self._is_free, nbytes)
        keys = [k for c in freed if (k := self._keys.get(c)) is not None]
        self.forget(freed)
        self._host.publish_usage()
        self._acks.publish_owed()
        return keys

    def make_room(
        self,
        nbytes: int,
        wait_for_space: float,
        own_pins: Mapping[object, int],
        abort: Callable[[], bool] | None = None,
    ) -> None:
        """Free (and relocate) from the head until ``nbytes`` fit, waiting up to
        ``wait_for_space`` s for readers; ``CacheFullError`` if no room comes (see
        ``StoreWriter.reserve`` for ``own_pins`` and ``abort``)."""
        ring = self.ring
        if chunk_size(nbytes) > ring.capacity:
            raise CacheFullError(f"{nbytes} bytes can never fit a {ring.capacity}-byte ring")
        deadline = time.monotonic() + wait_for_space
        waiting = False
        budget = [self.relocate_budget if self.second_chance else 0]
        acks, pins = self._acks, self._pins
        try:
            while True:
                if ring.fits(nbytes):
                    return
                acks.drain()
                self._reclaim(nbytes, budget)
                if ring.fits(nbytes):
                    return
                head = self._head_entry()
                if (
                    head is not None
                    and head.debt > 0
                    and acks.probe_debtors(head, self._evict_after)
                ):
                    continue
                head_id, guarded = ring.head_id, pins.guarded
                if (head is not None and 0 < head.pins <= own_pins.get(head, 0)) or (
                    guarded is not None and head_id in guarded
                ):
                    raise CacheFullError(
                        f"no room for {nbytes} bytes: the oldest item is pinned by this request"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
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
                if not self._stopping:
                    self._wait(min(remaining, WAIT_POLL))
                if self._stopping:  # (checked and waited under the lock: no lost wake-up)
                    raise ClosedCacheError(f"no room for {nbytes} bytes: the cache is closing")
                if abort is not None and abort():
                    raise CacheFullError(f"no room for {nbytes} bytes: the request was abandoned")
        except CacheFullError:  # what the pass evicted is gone: the header says so, every way
            self._host.publish_usage()
            raise
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
        is_pending = self._host.is_pending

        def relocatable(cid: int | None) -> bool:
            return (
                not fifo
                and cid is not None
                and self._is_marked(cid)
                and self._relocation_cost(cid) <= budget[0]
                and self._is_free(cid)
                and not is_pending(self._keys[cid])
            )

        entries, marked, ledger = self._entries, self.marked, self._ledger
        guarded = self._pins.guarded

        def evictable(cid: int) -> bool:  # _is_free and _is_marked, inline: once per chunk freed
            if guarded is not None and cid in guarded:
                return False
            e = entries.get(cid)
            if e is not None and not ledger.is_free(e):
                return False
            if cid not in marked or not self._is_marked(cid):
                return True
            # a marked head is moved (not freed) while the put needs room, and kept in the slack
            return not (relocatable(cid) or ring.fits(nbytes))

        pred = evictable if self.second_chance else self._is_free
        slack = self.evict_slack
        if 0 < slack < nbytes:  # a big put: room for a few more like it (EVICT_AHEAD_PUTS)
            slack = max(slack, min(EVICT_AHEAD_PUTS * chunk_size(nbytes), ring.capacity // 16))
        looked_ahead = False
        while True:
            self.forget(ring.free(pred, nbytes, slack=slack, max_extra=EVICT_SLACK_CHUNKS))
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
        if cid not in self.marked:
            return False
        key = self._keys.get(cid)
        return key is not None and self._index.get(key) == cid

    def _relocation_cost(self, cid: int) -> int:
        """What moving chunk ``cid`` takes from a put's budget (see ``RELOCATE_MAX_ITEMS``)."""
        return max(
            chunk_size(self._host.length_of(cid)), self.relocate_budget // RELOCATE_MAX_ITEMS
        )

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
        key = self._keys.get(cid)
        if key is None:  # unreachable: the head of a relocation is an indexed chunk
            return
        length = self._host.length_of(cid)
        self._ledger.forget(cid)  # it owes nothing: it was free
        self.marked.pop(cid, None)
        moved = self.ring.relocate_head()
        if moved is None:  # ids exhausted: the chunk is gone, as if evicted
            self.forget([cid])
            return
        self._rows.pop(cid, None)
        self._keys.pop(cid, None)
        address, new, position = moved
        self._host.relocated(key, new, address, length, position)
        self.relocations += 1
        self.bytes_relocated += length
        hw = self._hw
        hw[H_RELOCATIONS] = self.relocations
        hw[H_BYTES_RELOCATED] = self.bytes_relocated

    def _wait(self, timeout: float) -> None:
        """Sleep until a reader posts (or ``timeout``), letting go of the writer lock meanwhile.

        The caller holds the (re-entrant) lock, maybe more than once (a caller's ``with
        store.lock``): it is let go entirely while asleep, as ``threading.Condition`` lets go of
        its lock, so that hits and other puts go on (the waiting loop re-checks everything after
        waking), and taken back as many times before returning.
        """
        self.wakeups += 1
        sem = self._sem
        self._waiters += 1
        held = release_all(self._lock)
        try:
            sem.acquire(timeout)
            # absorb posts that piled up while we were not waiting
            with contextlib.suppress(posix_ipc.BusyError):
                while True:
                    sem.acquire(0)
        except posix_ipc.BusyError:
            pass
        finally:
            for _ in range(held):
                self._lock.acquire()
            self._waiters -= 1
            if self._closed and not self._waiters:  # close() left the handle to us
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    sem.close()
        self._host.check_owner()

    def stop_waits(self) -> None:
        """Wake every put waiting for space, and fail it and any later wait with
        ``ClosedCacheError`` (the first step of a close that lets the other puts finish)."""
        with self._lock:
            self._stopping = True
            for _ in range(self._waiters):
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    self._sem.release()

    def close(self, *, unlink: bool) -> None:
        """The writer closes: unlink the semaphore (``unlink``), wake the writers waiting on
        it (the last of them closes the handle, never closed under them), drop the marks."""
        self._closed = True
        sem = self._sem
        if unlink:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                sem.unlink()
        if self._waiters:
            for _ in range(self._waiters):
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    sem.release()
        else:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                sem.close()
        self.marked.clear()
