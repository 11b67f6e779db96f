"""Layer 2: ``ShmRingBuffer``, a single-writer ring of chunks in a shared-memory segment.

The chunk header (id, length, state, check word; ``C_`` words) is laid out in ``_layout``.

All bookkeeping (FIFO order, head, tail) lives in the writer's memory; readers see chunk headers
only. The writer writes a chunk's header (state *writing*), then the payload, then flips the state
to *committed*; it frees a chunk by flipping the state to *freed* before any byte of it can be
reused. A reader validates a reference (bounds, alignment, check word, id, state, length), copies,
and re-checks id and state: on x86-64 (total store order) a copy that saw a single reused byte
sees the freed state or the new id afterwards, so torn reads are always detected.

Payload bytes cannot be trusted to detect their own reuse: the next occupant of the memory may
write anything, a forged chunk header included. So each chunk also has a *position*, a 64-bit
offset in the endless stream of allocations (position mod capacity = address), and the writer
publishes in the segment header the position of the oldest live chunk (``H_HEAD_POS``) *before*
it reuses any byte behind it. A reader re-checks after its copy that the head has not passed its
chunk's position — a word no payload can touch.

The writer's FIFO of chunks is a circular buffer of parallel columns of signed 64-bit words
(address, size, id, position, state; ``"q"`` views of one ``bytearray``) indexed by an
ever-growing chunk number, plus dicts address -> chunk number: no Python object per chunk,
nothing for the garbage collector to walk (a deque of 250,000 tuples costs ~6 ms per full
collection, even a deque of ints as much).

Allocation wraps at the end of the ring; the tail that is skipped stays accounted as used until the
head passes it. The usual allocation, right after the tail, is one comparison with the end of the
free run there (``_limit``, recomputed when the head moves or the tail wraps); a wrap first skips
the rest of the ring, then allocates at 0 the usual way. Ids come from a 64-bit counter in the
segment header and keep increasing across ``clear`` (which also bumps the epoch).

**Relocation** (second chance, :meth:`ShmRingBuffer.relocate_head`) moves the committed head
chunk to the tail: the head chunk is freed exactly as by :meth:`~ShmRingBuffer.free` (state
*freed*, reuse fence published past it), then a new chunk of the same length is allocated at the
tail (it always fits: the freed chunk's own bytes are free now), the payload moved into it and
committed. The new chunk has a new id, address and position, so every reference to the old one
is stale like any evicted chunk's. The new chunk never starts inside the old payload (it starts
at or before the old address, or after the old chunk), so the move is a forward ``memmove`` from
bytes nobody else writes; in a full ring it is a shift back by the gap between tail and head
(none at all when the ring is exactly full). Eviction stays FIFO in positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

import numpy as np

from ._core_api import core
from ._layout import (
    C_CHECK,
    C_ID,
    C_LENGTH,
    C_STATE,
    CHUNK_HEADER,
    CHUNK_MAGIC,
    COMMITTED,
    DEAD,
    FREED,
    H_EPOCH,
    H_HEAD_POS,
    H_NEXT_ID,
    LAYOUT_VERSION,
    WRITING,
    Layout,
    chunk_size,
)
from ._segment import Segment
from ._sharded_map import shards_for
from ._types import CacheHandle
from .errors import (
    CacheFullError,
    ClosedCacheError,
    InvalidReferenceError,
    RoleError,
    ShmCacheError,
    StaleReferenceError,
)

__all__ = ["CHUNK_HEADER", "MAX_RING_ID", "PRESIZE_CHUNK_BYTES", "ShmRingBuffer"]

#: the largest chunk id: the writer's FIFO columns are signed 64-bit (format ``"q"``), so ids
#: stop at 2**63 - 1 (a ring numbering 10**9 chunks a second takes 292 years to get there)
MAX_RING_ID: Final = (1 << 63) - 1
#: the writer's FIFO columns start with a slot per this many bytes of ring (see ``presize``)
PRESIZE_CHUNK_BYTES: Final = 1024


def _columns(n: int) -> tuple[memoryview, ...]:
    """The writer's five FIFO columns of ``n`` signed 64-bit words, zeroed: views of one
    ``bytearray`` (the compiled put reads a live view's buffer without exporting it)."""
    block = memoryview(bytearray(40 * n))
    return tuple(block[8 * n * i : 8 * n * (i + 1)].cast("q") for i in range(5))


class ShmRingBuffer(core.RingState):
    """Single-writer ring of chunks, addressed by (address, id).

    The writer allocates, commits, abandons and frees (FIFO); any process reads a committed chunk
    through :meth:`access` and confirms the copy with :meth:`verify`.
    """

    # the state the compiled put reads and writes at the slots' offsets (a look-up by name in
    # an instance dict costs ~150 instructions); ``__dict__`` still takes anything else. The
    # ints (``_tail``, ``_limit``, ``_end``, ``_head``, ``_mask``, ``_at_mask``, ``_lap``,
    # ``used_bytes``, ``capacity``) live in the base, the core's ``RingState``: C integers on
    # the compiled core, which its put reads and writes without making Python ints
    __slots__ = (
        "__dict__",
        "_addr",
        "_at",
        "_cpos",
        "_hw",
        "_id",
        "_seg",
        "_size",
        "_state",
        "_w",
        "_writer",
        "buf",
    )

    def __init__(self, segment: Segment, *, writer: bool) -> None:
        self._seg = segment
        self._hw = segment.words
        off = segment.layout.ring_off  # the checked geometry, not the header words again
        self.capacity = segment.layout.capacity
        self.buf = segment.buf[off : off + self.capacity]
        self._w = self.buf.cast("Q")
        self._writer = writer
        # writer bookkeeping: the FIFO of chunks numbered _head.._end-1 (chunk k in column slot
        # k & _mask), columns address, size, id, position, state (the writer's own view).
        # Sized at creation for a ring of PRESIZE_CHUNK_BYTES chunks, so a first lap of items
        # that size or bigger never grows them (doubling 5 columns of 131,072 slots stalled a
        # put for milliseconds); a ring of smaller items still doubles them when full.
        n = self.presize(self.capacity) if writer else 8
        self._mask = n - 1
        self._addr, self._size, self._id, self._cpos, self._state = _columns(n)
        self._head = 0  # number of the oldest chunk
        self._end = 0  # number the next chunk gets
        # address // 64 -> number of the chunk there: one entry per chunk, so split in dicts by
        # the 64-byte unit (as ``_sharded_map.ShardedMap`` splits by hash, which is the same for
        # these ints), so that consecutive chunks fall in different dicts (one then holds at most
        # capacity / 16 KiB entries, whatever the chunk sizes); no count is kept
        self._at: list[dict[int, int]] = [
            {} for _ in range(shards_for(self.capacity // (2 * CHUNK_HEADER)))
        ]
        self._at_mask = len(self._at) - 1
        self._tail = 0
        # position of address 0 in the tail's lap: the next byte allocated is at position
        # ``_lap + _tail`` (a segment starts at a lap boundary: position mod capacity = address)
        # (a reader never allocates: its 0 keeps a header word it cannot trust out of an int64)
        self._lap = int(self._hw[H_HEAD_POS]) if writer else 0
        #: bytes between head and tail, the skipped tail of a wrap included (writer only; an
        #: attribute kept up to date, not a property: the store publishes it on every put)
        self.used_bytes = 0
        self._limit = -1  # end of the free run at the tail (``_set_limit``)
        self._set_limit()

    @staticmethod
    def presize(capacity: int) -> int:
        """Slots the writer's FIFO columns start with for a ring of ``capacity`` bytes: a power
        of two, one per :data:`PRESIZE_CHUNK_BYTES` of ring (40 bytes of writer memory each)."""
        return max(8, 1 << (max(1, capacity // PRESIZE_CHUNK_BYTES) - 1).bit_length())

    # --- standalone construction ----------------------------------------------------------
    @classmethod
    def create(
        cls, capacity_bytes: int, *, name: str | None = None, first_id: int = 1
    ) -> ShmRingBuffer:
        """A ring in a new segment of its own (the store builds its ring on a shared segment).

        ``first_id`` is the first chunk id, 1 to :data:`MAX_RING_ID`: checked before anything is
        created, so that an id the ring cannot number never reaches an allocation.
        """
        if type(first_id) is not int or not 1 <= first_id <= MAX_RING_ID:
            raise ValueError(f"first_id must be an int from 1 to 2**63 - 1, not {first_id!r}")
        layout = Layout(capacity_bytes, 1, 64)
        seg = Segment.create(
            name,
            layout,
            max_object_bytes=layout.capacity - CHUNK_HEADER,
            delivery="broadcast",
            handout_ttl=30.0,
        )
        seg.words[H_NEXT_ID] = first_id
        return cls(seg, writer=True)

    @classmethod
    def attach(cls, handle: CacheHandle | str) -> ShmRingBuffer:
        """Map the ring of an existing segment as a reader."""
        if isinstance(handle, CacheHandle):
            return cls(Segment.attach(handle.name, nonce=handle.nonce), writer=False)
        return cls(Segment.attach(handle), writer=False)

    def handle(self) -> CacheHandle:
        """What another process needs to attach to this ring."""
        return CacheHandle(self._seg.name, self._seg.nonce, LAYOUT_VERSION)

    def close(self) -> None:
        """Release the views and close the segment (the owner unlinks it); idempotent."""
        if not self._seg.closed:
            self._w.release()
            self.buf.release()
            self._seg.close()

    # --- state ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch (bumped by :meth:`clear`)."""
        return int(self._hw[H_EPOCH])

    @property
    def next_id(self) -> int:
        """The id the next allocated chunk gets."""
        return int(self._hw[H_NEXT_ID])

    @property
    def n_chunks(self) -> int:
        """How many chunks are allocated (writer only)."""
        return self._end - self._head

    @property
    def head_id(self) -> int | None:
        """Id of the oldest allocated chunk, None if the ring is empty (writer only)."""
        return self._id[self._head & self._mask] if self._end != self._head else None

    def iter_chunks(self) -> Iterator[tuple[int, int, bool]]:
        """(id, chunk size, being written) of each allocated chunk, oldest first (writer only)."""
        m, ids, sizes, states = self._mask, self._id, self._size, self._state
        for k in range(self._head, self._end):
            yield ids[k & m], sizes[k & m], states[k & m] == WRITING

    def chunk_ids(self) -> list[int]:
        """Ids of the allocated chunks, oldest first."""
        m, ids = self._mask, self._id
        return [ids[k & m] for k in range(self._head, self._end)]

    def _grow(self) -> None:
        """Double the FIFO's columns (they are full), keeping every chunk's number.

        Each new column holds the old one twice: chunk ``k`` was in slot ``k & mask`` and is
        now in slot ``k & mask`` or ``(k & mask) + size``, which hold the same value. Two
        ``memcpy`` per column, no Python loop: growing to a million chunks takes milliseconds.
        """
        n = self._mask + 1
        old = (self._addr, self._size, self._id, self._cpos, self._state)
        new = _columns(2 * n)
        for src, dst in zip(old, new, strict=True):
            dst[:n] = src
            dst[n:] = src
        self._addr, self._size, self._id, self._cpos, self._state = new
        self._mask = 2 * n - 1

    def _pop_head(self) -> None:
        """Drop the head chunk from the FIFO (its state word is already written)."""
        u = self._addr[self._head & self._mask] >> 6
        del self._at[u & self._at_mask][u]
        self._head += 1

    def _check_writer(self) -> None:
        if not self._writer:
            raise RoleError("this is a reader: only the writer allocates, commits and frees")
        if self._seg.closed:
            raise ClosedCacheError("the ring is closed")
        if self._seg.forked:
            raise RoleError("a forked child of the writer cannot act as the writer")

    # --- writer side ---------------------------------------------------------------------
    def _place(self, size: int) -> int | None:
        """Address where a chunk of ``size`` bytes fits contiguously, or None."""
        cap = self.capacity
        if self._end == self._head:
            return 0 if size <= cap else None
        head, tail = self._addr[self._head & self._mask], self._tail
        if tail > head:  # data in [head, tail)
            if cap - tail >= size:
                return tail
            return 0 if head >= size else None
        return tail if head - tail >= size else None  # wrapped: data in [head, cap) + [0, tail)

    def fits(self, payload: int) -> bool:
        """Whether a payload of this size fits now without freeing anything."""
        size = CHUNK_HEADER + ((payload + 63) & -64)  # chunk_size, inline
        return self._tail + size <= self._limit or self._place(size) is not None

    def allocate(self, payload: int) -> tuple[int, int]:
        """Reserve a chunk for ``payload`` bytes; returns (address, id). State: *writing*."""
        got = self.try_allocate(payload)
        if got is None:
            size = chunk_size(payload)
            if size > self.capacity:
                raise CacheFullError(
                    f"a {payload}-byte chunk can never fit a {self.capacity}-byte ring"
                )
            raise CacheFullError(f"no contiguous room for {size} bytes (used {self.used_bytes})")
        return got

    def try_allocate(self, payload: int) -> tuple[int, int] | None:
        """:meth:`allocate`, or None (nothing changed) if the chunk does not fit now."""
        size = CHUNK_HEADER + ((payload + 63) & -64)  # chunk_size, inline (the hot path)
        tail = self._tail
        seg = self._seg
        if tail + size > self._limit or payload < 0 or seg.closed or seg.forked:
            # the rare cases, out of line: a wrap, no room, a bad size, not the writer
            return self._allocate_rare(payload, size)
        # the usual case: the chunk fits right after the tail (``_limit``, see ``_set_limit``)
        hw = self._hw
        cid = hw[H_NEXT_ID]
        if cid > MAX_RING_ID:  # before any store: an exhausted ring is left as it was
            raise ShmCacheError("chunk ids exhausted (the last id is 2**63 - 1)")
        hw[H_NEXT_ID] = cid + 1
        w, i = self._w, tail >> 3
        w[i + C_STATE] = WRITING
        w[i + C_ID] = cid
        w[i + C_LENGTH] = payload
        w[i + C_CHECK] = cid ^ payload ^ CHUNK_MAGIC
        k = self._end
        if k - self._head > self._mask:
            self._grow()
        j = k & self._mask
        self._addr[j] = tail
        self._size[j] = size
        self._id[j] = cid
        self._cpos[j] = self._lap + tail
        self._state[j] = WRITING
        u = tail >> 6
        self._at[u & self._at_mask][u] = k
        self._end = k + 1
        self._tail = tail + size
        self.used_bytes += size
        return tail, cid

    def _allocate_rare(self, payload: int, size: int) -> tuple[int, int] | None:
        """:meth:`try_allocate` when the chunk does not fit right after the tail.

        Either it does not fit at all (None), or the input or the role is wrong (the typed
        error), or it fits at address 0: then the rest of the ring after the tail is skipped —
        it stays accounted as used, and in the stream of positions, until the head passes it —
        and the chunk is allocated at the new tail, 0, by the usual path.
        """
        self._check_writer()
        if payload < 0:
            raise ValueError("payload size must be non-negative")
        addr = self._place(size)
        if addr is None:
            return None
        tail = self._tail
        if addr != tail:  # a wrap (or an empty ring whose tail is not at 0)
            if self._hw[H_NEXT_ID] > MAX_RING_ID:  # before the skip: nothing changes
                raise ShmCacheError("chunk ids exhausted (the last id is 2**63 - 1)")
            self._lap += self.capacity  # the skipped bytes count in the stream of positions
            self.used_bytes += self.capacity - tail  # and as used, until the head passes them
            self._tail = 0
        self._set_limit()
        if self._tail + size > self._limit:  # never: _place said it fits at the tail now
            raise RuntimeError(f"internal error: no room at {self._tail} after placing there")
        return self.try_allocate(payload)

    def _set_limit(self) -> None:
        """Where the free run that starts at the tail ends (the usual allocation's bound).

        The end of the ring while the data does not wrap (or the ring is empty: its tail is 0),
        else the head's address. Recomputed whenever the head or the tail's lap changes
        (``_publish_head``, a wrap); a reader's is -1: every allocation goes the rare way, which
        raises ``RoleError``.
        """
        if not self._writer:
            self._limit = -1
        elif self._end == self._head:  # empty: its tail is at 0 (else: a wrap to 0 first)
            self._limit = self.capacity if self._tail == 0 else -1
        else:
            head = self._addr[self._head & self._mask]
            self._limit = self.capacity if self._tail > head else head

    def _number(self, address: int) -> int | None:
        """The number of the allocated chunk at ``address``, None if no chunk starts there."""
        if address & 63:
            return None
        u = address >> 6
        return self._at[u & self._at_mask].get(u)

    def position(self, address: int) -> int:
        """The position of the allocated chunk at ``address`` (goes into its references)."""
        k = self._number(address)
        if k is None:
            raise KeyError(address)
        return self._cpos[k & self._mask]

    def _publish_head(self) -> None:
        """Publish the reuse fence: everything before the head's position may be overwritten."""
        if self._end != self._head:
            self._hw[H_HEAD_POS] = head = self._cpos[self._head & self._mask]
            self.used_bytes = self._lap + self._tail - head  # positions of the tail and the head
        else:  # empty: the next chunk goes to address 0, the next lap
            cap = self.capacity
            self._lap = -(-(self._lap + self._tail) // cap) * cap
            self._tail = 0
            self._hw[H_HEAD_POS] = self._lap
            self.used_bytes = 0
        self._set_limit()  # the head moved

    def payload(self, address: int) -> memoryview:
        """Writable view of an allocated chunk's payload (writer only)."""
        i = address >> 3
        return self.buf[
            address + CHUNK_HEADER : address + CHUNK_HEADER + int(self._w[i + C_LENGTH])
        ]

    def commit(self, address: int) -> int:
        """Make the chunk readable: its payload must be fully written. Returns its position."""
        if not self._writer or self._seg.closed or self._seg.forked:
            self._check_writer()
        # ``self._number(address)``, inline
        k = None if address & 63 else self._at[(u := address >> 6) & self._at_mask].get(u)
        if k is None or self._state[j := k & self._mask] != WRITING:
            raise ShmCacheError(f"chunk at {address} is not being written")
        self._w[(address >> 3) + C_STATE] = COMMITTED
        self._state[j] = COMMITTED
        return self._cpos[j]

    def abandon(self, address: int) -> None:
        """Mark an allocation whose copy was abandoned as dead; it is reclaimed in FIFO order."""
        self._check_writer()
        k = self._number(address)
        if k is not None:
            self._w[(address >> 3) + C_STATE] = DEAD
            self._state[k & self._mask] = DEAD

    def free(
        self,
        is_free: Callable[[int], bool],
        nbytes: int = 0,
        *,
        slack: int = 0,
        max_extra: int = 0,
    ) -> list[int]:
        """Free chunks oldest first while they are free, until ``nbytes`` fit contiguously.

        ``nbytes == 0`` frees every free chunk at the head. Dead chunks are always free; chunks
        being written never are. Once ``nbytes`` fit, up to ``max_extra`` more free chunks go
        while fewer than ``nbytes + slack`` bytes are free in all (batch eviction: the next puts
        find room without evicting). Returns the ids freed, oldest first.
        """
        self._check_writer()
        need = chunk_size(nbytes) if nbytes > 0 else 0
        freed: list[int] = []
        w, m, at, at_mask = self._w, self._mask, self._at, self._at_mask
        addrs, ids, states = self._addr, self._id, self._state
        cap, tail = self.capacity, self._tail
        extra = 0
        fits = False  # once it fits it keeps fitting: freeing the head only adds room
        while self._end != self._head:
            if need:
                if not fits:  # ``_limit`` is not updated in the loop: it may only be too low
                    fits = tail + need <= self._limit or self._place(need) is not None
                if fits:
                    if extra >= max_extra:
                        break
                    a = addrs[self._head & m]  # used_bytes, inline
                    if cap - (tail - a if tail > a else cap - a + tail) >= need + slack:
                        break
                    extra += 1
            j = self._head & m
            cid, st = ids[j], states[j]
            if st == WRITING or (st == COMMITTED and not is_free(cid)):
                break
            addr = addrs[j]
            w[(addr >> 3) + C_STATE] = FREED
            del at[(u := addr >> 6) & at_mask][u]
            self._head += 1
            freed.append(cid)
        if freed:
            self._publish_head()  # before the caller can reuse a byte of what was freed
        return freed

    def relocate_head(self) -> tuple[int, int, int] | None:
        """Move the committed head chunk to the tail (see the module docstring).

        Returns the new chunk's (address, id, position), committed; None if the head was freed
        but no chunk could be allocated (only when 64-bit ids run out): the item is then gone,
        as if evicted.
        """
        self._check_writer()
        if self._end == self._head:
            raise ShmCacheError("the ring is empty: no head chunk to relocate")
        j = self._head & self._mask
        addr = self._addr[j]
        if self._state[j] != COMMITTED:
            raise ShmCacheError(f"the head chunk at {addr} is not committed")
        length = int(self._w[(addr >> 3) + C_LENGTH])
        self._w[(addr >> 3) + C_STATE] = FREED
        self._pop_head()
        self._publish_head()  # the old chunk is stale before a byte of it is reused
        try:
            new, cid = self.allocate(length)
        except ShmCacheError:
            return None
        if new != addr:  # new < addr, or new past the old chunk: a forward move is safe
            src = np.frombuffer(self.buf, np.uint8, length, addr + CHUNK_HEADER)
            dst = np.frombuffer(self.buf, np.uint8, length, new + CHUNK_HEADER)
            dst[...] = src  # numpy copies overlapping 1-D data as memmove, without the GIL
            del src, dst
        self.commit(new)
        return new, cid, self.position(new)

    def clear(self) -> list[int]:
        """Free every chunk not being written, bump the epoch. Returns the ids freed.

        Chunks being written (a copy in flight) stay allocated; they are reclaimed in FIFO order
        once their writer commits or abandons them.
        """
        self._check_writer()
        self._hw[H_EPOCH] = int(self._hw[H_EPOCH]) + 1
        m, addrs, ids, states = self._mask, self._addr, self._id, self._state
        live = range(self._head, self._end)
        if any(states[k & m] == WRITING for k in live):
            freed = []
            for k in live:
                if states[k & m] != WRITING:
                    self._w[(addrs[k & m] >> 3) + C_STATE] = FREED
                    states[k & m] = DEAD
                    freed.append(ids[k & m])
            return freed
        freed = [ids[k & m] for k in live]
        for k in live:
            self._w[(addrs[k & m] >> 3) + C_STATE] = FREED
        self._head = self._end
        for d in self._at:
            d.clear()
        self._publish_head()
        return freed

    # --- reader side (any process) -----------------------------------------------------
    def access(
        self, address: int, cid: int, length: int | None = None, position: int | None = None
    ) -> memoryview:
        """Validated read-only view of a committed chunk's payload.

        ``InvalidReferenceError``: out of range, misaligned, not a chunk start, wrong length or
        an id never issued. ``StaleReferenceError``: the chunk was freed or reused.
        """
        if self._seg.closed:
            raise ClosedCacheError("the ring is closed")
        cap = self.capacity
        if (
            type(address) is not int
            or type(cid) is not int
            or address < 0
            or address & 63
            or address + CHUNK_HEADER > cap
        ):
            raise InvalidReferenceError(f"address {address!r} is not a chunk address in this ring")
        w, i = self._w, address >> 3
        hid, hlen, hstate, hcheck = w[i + C_ID], w[i + C_LENGTH], w[i + C_STATE], w[i + C_CHECK]
        if hid != cid or hcheck != hid ^ hlen ^ CHUNK_MAGIC:
            if 0 < cid < self._hw[H_NEXT_ID]:
                raise StaleReferenceError(f"chunk {cid} was evicted and its space reused")
            raise InvalidReferenceError(f"chunk id {cid} was never issued by this writer")
        if hstate != COMMITTED:
            # *writing* under the old id, length and check word: the writer is reusing the
            # chunk's place (it writes the state first, then the id) and was read between its
            # stores; the reuse fence already passed the old chunk, so it is stale, not forged
            reused = position is not None and self._hw[H_HEAD_POS] > position
            if hstate in (FREED, DEAD) or reused:
                raise StaleReferenceError(f"chunk {cid} was evicted or cleared")
            raise InvalidReferenceError(f"chunk {cid} is not committed")
        if (length is not None and hlen != length) or address + CHUNK_HEADER + hlen > cap:
            raise InvalidReferenceError(f"chunk {cid}: length {length} does not match")
        if position is not None:
            if position % cap != address:
                raise InvalidReferenceError(f"chunk {cid}: position does not match its address")
            if self._hw[H_HEAD_POS] > position:
                raise StaleReferenceError(f"chunk {cid} was evicted and its space reused")
        start = address + CHUNK_HEADER
        return self.buf[start : start + hlen].toreadonly()

    def verify(self, address: int, cid: int, position: int | None = None) -> None:
        """Re-check after a copy that the chunk was not freed or reused meanwhile.

        With ``position`` the check reads the reuse fence in the segment header, which payload
        bytes cannot forge; the chunk header words are checked too.
        """
        if self._seg.closed:
            raise ClosedCacheError("the ring was closed during the read")
        if position is not None and self._hw[H_HEAD_POS] > position:
            raise StaleReferenceError(f"chunk {cid} was reclaimed during the read")
        i = address >> 3
        if self._w[i + C_ID] != cid or self._w[i + C_STATE] != COMMITTED:
            raise StaleReferenceError(f"chunk {cid} was reclaimed during the read")
