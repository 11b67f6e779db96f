"""Layer 5, eviction: how the writer makes room — FIFO, second chance, batch eviction, waits.

``Eviction`` is the part of the writer (``StoreWriter``) that frees chunks: the writer
inherits it, and it works on the writer's state (index, rows, marks, ledger, ring),
declared below for the type checker. Its entry points take the writer lock, as the store's do.

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
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import posix_ipc

from ._hints import Hint, HintTable
from ._layout import (
    H_BYTES_RELOCATED,
    H_EPOCH,
    H_EVICTIONS,
    H_RELOCATIONS,
    H_WAITING,
    RS_PID,
    WS_REVOKED,
    chunk_size,
)
from ._ledger import Debts, HandoutLedger
from ._readers import ReaderTable, SlotState
from ._ring import ShmRingBuffer
from ._shards import ShardedMap
from ._types import CacheConfig, tag_base
from .errors import CacheFullError

__all__ = [
    "EVICT_AHEAD_PUTS",
    "EVICT_SLACK_BYTES",
    "EVICT_SLACK_CHUNKS",
    "RELOCATE_BUDGET",
    "RELOCATE_MAX_ITEMS",
    "WAIT_POLL",
    "Eviction",
]

log = logging.getLogger("aioshmcache")

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


class Eviction:
    """The writer's eviction (see the module docstring); mixed into ``StoreWriter``."""

    if TYPE_CHECKING:  # the writer's state this part works on (set by ``StoreWriter``)
        ring: ShmRingBuffer
        _readers: ReaderTable
        _ledger: HandoutLedger
        _hints: HintTable
        _has_hints: bool
        _hw: Any
        _index: ShardedMap[str, int]
        _rows: ShardedMap[int, bytes]
        _keys: ShardedMap[int, str]
        _marked: ShardedMap[int, None]
        _by_id: dict[int, Debts]
        _guarded: dict[int, None] | None
        _slots: list[SlotState]
        _config: CacheConfig
        _sem: Any
        _lock: threading.RLock
        _waiters: int
        _closed: bool
        _secret: int
        one_of_n: bool
        second_chance: bool
        relocate_budget: int
        evict_slack: int
        evictions: int
        relocations: int
        bytes_relocated: int
        wakeups: int
        on_evict: Callable[[str], None] | None

        def drain(self) -> int: ...
        def is_pending(self, key: str) -> bool: ...
        def _check_writer(self) -> None: ...
        def _row(self, cid: int) -> tuple[str, int, int, int, int, int] | None: ...
        def _set_row(self, cid: int, row: tuple[str, int, int, int, int, int]) -> None: ...
        def _drop_row(self, cid: int) -> str | None: ...
        def _publish_usage(self) -> None: ...
        def _publish_owed(self) -> None: ...
        def _refresh_live(self) -> None: ...
    else:  # no state of its own: the writer's (hidden from the checker, which
        __slots__ = ()  # would then refuse every assignment to the writer's state here)

    def _probe_debtors(self, e: Debts) -> bool:
        """Probe the readers owing ``e``; drop dead ones, revoke stuck ones. True if any dropped."""
        since = self._ledger.debtors(e)
        if not since:
            return False
        changed = False
        evict_after = self._config.evict_stuck_readers_after
        stuck = set(self._ledger.stuck(e, evict_after)) if evict_after is not None else set()
        for slot, st in enumerate(self._slots):
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
            self._publish_owed()
        return changed

    def _is_free(self, cid: int) -> bool:
        g = self._guarded
        if g is not None and cid in g:
            return False  # guarded by the request deciding now
        e = self._by_id.get(cid)
        return e is None or self._ledger.is_free(e)

    def is_freeable(self, key: str) -> bool:
        """Whether ``key``'s chunk could be evicted now.

        Drains the acknowledgement logs first and probes the readers still owing it, so a dead
        reader's debts do not count.
        """
        self._check_writer()
        with self._lock:
            self.drain()
            cid = self._index.get(key)
            if cid is None:
                return False
            e = self._ledger.get(cid)
            if e is None:
                return True  # nothing owed, pinned or touched
            if e.debt > 0 and not self.one_of_n:
                self._probe_debtors(e)
            return self._ledger.is_free(e)

    def _forget(self, freed: list[int]) -> None:
        """Drop the rows, index entries, marks and debts of freed chunks; count evictions."""
        index, marked, entries = self._index, self._marked, self._by_id
        rows, keys = self._rows, self._keys
        hints = self._hints if self._has_hints else None
        on_evict = self.on_evict
        evicted = self.evictions
        for cid in freed:  # the ``ShardedMap`` calls inline: once per chunk freed
            if cid in entries:
                self._ledger.forget(cid)
            h = hash(cid)
            if cid in (dm := marked.shards[h & marked.mask]):  # ``del marked[cid]``
                del dm[cid]
                marked.n -= 1
            if cid in (dr := rows.shards[h & rows.mask]):  # ``self._drop_row(cid)``
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
        return None if cid is None else self._by_id.get(cid)

    def evict(self, nbytes: int = 0) -> list[str]:
        """Free free chunks from the head (all of them, or until ``nbytes`` fit).

        Readers owing the head item are probed first: a dead one's debts are dropped. An explicit
        eviction: hit items are evicted too (second chance applies to puts that need room).
        """
        self._check_writer()
        with self._lock:
            self.drain()
            head = self._head_entry()
            if head is not None and head.debt > 0:
                self._probe_debtors(head)
            freed = self.ring.free(self._is_free, nbytes)
            keys = [k for c in freed if (k := self._keys.get(c)) is not None]
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
                head_id, guarded = ring.head_id, self._guarded
                if (head is not None and 0 < head.pins <= own_pins.get(head, 0)) or (
                    guarded is not None and head_id in guarded
                ):
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
                and not self.is_pending(self._keys[cid])
            )

        entries, marked, ledger, guarded = self._by_id, self._marked, self._ledger, self._guarded

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
            self._forget(ring.free(pred, nbytes, slack=slack, max_extra=EVICT_SLACK_CHUNKS))
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
        key = self._keys.get(cid)
        return key is not None and self._index.get(key) == cid

    def _relocation_cost(self, cid: int) -> int:
        """What moving chunk ``cid`` takes from a put's budget (see ``RELOCATE_MAX_ITEMS``)."""
        row = self._row(cid)
        length = 0 if row is None else row[2]
        return max(chunk_size(length), self.relocate_budget // RELOCATE_MAX_ITEMS)

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
        row = self._row(cid)
        if row is None:  # unreachable: the head of a relocation is an indexed chunk
            return
        key, _address, length, _position, _base, _epoch = row
        self._ledger.forget(cid)  # it owes nothing: it was free
        self._marked.pop(cid, None)
        moved = self.ring.relocate_head()
        if moved is None:  # ids exhausted: the chunk is gone, as if evicted
            self._forget([cid])
            return
        self._drop_row(cid)
        address, new, position = moved
        epoch = int(self._hw[H_EPOCH])
        base = tag_base(self._secret, epoch, address, new, length, position) & ((1 << 64) - 1)
        self._set_row(new, (key, address, length, position, base, epoch))
        self._index[key] = new
        if self._hints:
            self._hints.publish(key, Hint(epoch, address, new, length, position))
        self.relocations += 1
        self.bytes_relocated += length
        hw = self._hw
        hw[H_RELOCATIONS] = self.relocations
        hw[H_BYTES_RELOCATED] = self.bytes_relocated

    def _wait(self, timeout: float) -> None:
        """Sleep until a reader posts (or ``timeout``), letting go of the writer lock meanwhile.

        :meth:`reserve` holds the (re-entrant) lock, maybe more than once (a caller's ``with
        store.lock``): it is let go entirely while asleep, as ``threading.Condition`` lets go of
        its lock, so that hits and other puts go on (the waiting loop re-checks everything after
        waking), and taken back as many times before returning.
        """
        self.wakeups += 1
        sem = self._sem
        self._waiters += 1
        saved = self._lock._release_save()  # type: ignore[attr-defined]
        try:
            sem.acquire(timeout)
            # absorb posts that piled up while we were not waiting
            with contextlib.suppress(posix_ipc.BusyError):
                while True:
                    sem.acquire(0)
        except posix_ipc.BusyError:
            pass
        finally:
            self._lock._acquire_restore(saved)  # type: ignore[attr-defined]
            self._waiters -= 1
            if self._closed and not self._waiters:  # close() left the handle to us
                with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                    sem.close()
        self._check_writer()
