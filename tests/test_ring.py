"""Layer 2: the ring against a plain-Python model, wraparound, ids, and reference validation."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from aioshmcache import (
    CacheFullError,
    ClosedCacheError,
    InvalidReferenceError,
    ReceiverCache,
    RoleError,
    SenderCache,
    ShmCacheError,
    ShmRef,
    ShmRingBuffer,
    StaleReferenceError,
)
from aioshmcache._layout import CHUNK_HEADER, H_SECRET, chunk_size
from aioshmcache._ring import PRESIZE_CHUNK_BYTES
from aioshmcache._types import reference_tag

from .test_store import READ_PATHS, _close_fuzz_store, _fuzz_store  # noqa: F401 (its fixture)

CAP = 4096


class RingModel(RuleBasedStateMachine):
    """The ring vs a model: a FIFO of (address, size, id, payload bytes, acked)."""

    chunks = Bundle("chunks")

    def __init__(self) -> None:
        super().__init__()
        self.ring = ShmRingBuffer.create(CAP, first_id=(1 << 32) - 3)  # ids cross 2**32
        self.fifo: list[list[Any]] = []  # [addr, size, id, data, acked, position]
        self.last_id = 0
        self.next_pos = 0  # the position of the next byte allocated (the stream of positions)
        self.freed: list[tuple[int, int]] = []
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        self.ring.close()

    def _model_place(self, size: int) -> int | None:
        if not self.fifo:
            return 0 if size <= CAP else None
        head = int(self.fifo[0][0])
        tail = int(self.fifo[-1][0]) + int(self.fifo[-1][1])
        if tail > head:
            if CAP - tail >= size:
                return tail
            return 0 if head >= size else None
        return tail if head - tail >= size else None

    def _model_position(self, addr: int, size: int) -> int:
        """The position a chunk allocated at ``addr`` gets: an empty ring starts a new lap, a
        wrap counts the skipped tail."""
        if not self.fifo:
            self.next_pos = -(-self.next_pos // CAP) * CAP
            tail = 0
        else:
            tail = int(self.fifo[-1][0]) + int(self.fifo[-1][1])
        pos = self.next_pos + (CAP - tail if addr != tail else 0)
        self.next_pos = pos + size
        return pos

    @rule(target=chunks, payload=st.integers(0, 1500))
    def allocate(self, payload: int) -> object:
        expect = self._model_place(chunk_size(payload))
        if expect is None:
            with pytest.raises(CacheFullError):
                self.ring.allocate(payload)
            return None
        addr, cid = self.ring.allocate(payload)
        assert addr == expect
        assert addr % 64 == 0 and addr + chunk_size(payload) <= CAP
        assert cid > self.last_id  # strictly increasing, never reused
        self.last_id = cid
        data = self.rng.integers(0, 255, payload, dtype=np.uint8).tobytes()
        self.ring.payload(addr)[:] = data
        assert self.ring.commit(addr) == self._model_position(addr, chunk_size(payload))
        rec: list[object] = [addr, chunk_size(payload), cid, data, False]
        self.fifo.append(rec)
        return rec

    @rule(rec=chunks)
    def access(self, rec: list[object] | None) -> None:
        if rec is None:
            return
        addr, _size, cid, data, _acked = rec
        assert isinstance(addr, int) and isinstance(cid, int)
        if rec in self.fifo:
            view = self.ring.access(addr, cid, len(data))  # type: ignore[arg-type]
            assert bytes(view) == data
            self.ring.verify(addr, cid)
        else:
            with pytest.raises((StaleReferenceError, InvalidReferenceError)):
                self.ring.access(addr, cid)

    @rule(rec=chunks)
    def acknowledge(self, rec: list[object] | None) -> None:
        if rec is not None:
            rec[4] = True

    @precondition(lambda self: len(self.fifo) > 0)
    @rule(target=chunks)
    def relocate(self) -> object:
        """Second chance: the head chunk moves to the tail, a new chunk with the same bytes."""
        old = self.fifo.pop(0)
        _addr, size, _cid, data, _acked = old
        expect = self._model_place(int(size))  # the old chunk's room is free first
        assert expect is not None, "a relocated chunk always fits"
        assert isinstance(data, bytes)
        moved = self.ring.relocate_head()
        assert moved is not None
        addr, cid, pos = moved
        assert addr == expect and cid > self.last_id
        assert pos == self._model_position(addr, int(size))
        self.last_id = cid
        assert bytes(self.ring.access(addr, cid, len(data))) == data
        rec: list[object] = [addr, size, cid, data, False]
        self.fifo.append(rec)
        return rec

    def _model_free_bytes(self) -> int:
        if not self.fifo:
            return CAP
        head = int(self.fifo[0][0])
        tail = int(self.fifo[-1][0]) + int(self.fifo[-1][1])
        return CAP - (tail - head if tail > head else CAP - head + tail)

    @rule(n=st.integers(0, 3000), slack=st.integers(0, 2000), max_extra=st.integers(0, 3))
    def free(self, n: int, slack: int, max_extra: int) -> None:
        """Free acknowledged chunks until ``n`` bytes fit, then a bounded batch beyond."""
        acked = {r[2] for r in self.fifo if r[4]}
        freed = self.ring.free(lambda cid: cid in acked, n, slack=slack, max_extra=max_extra)
        expect = []
        need = chunk_size(n) if n else 0
        extra = 0
        while self.fifo:
            if need and self._model_place(need) is not None:
                if extra >= max_extra or self._model_free_bytes() >= need + slack:
                    break
                extra += 1
            if not self.fifo[0][4]:
                break
            expect.append(self.fifo.pop(0)[2])
        assert freed == expect
        assert self.ring.capacity - self.ring.used_bytes == self._model_free_bytes()

    @precondition(lambda self: len(self.fifo) > 0)
    @rule()
    def clear(self) -> None:
        epoch = self.ring.epoch
        freed = self.ring.clear()
        assert freed == [r[2] for r in self.fifo]
        self.fifo.clear()
        assert self.ring.epoch == epoch + 1

    @invariant()
    def geometry(self) -> None:
        assert self.ring.chunk_ids() == [r[2] for r in self.fifo]
        spans = sorted((int(r[0]), int(r[0]) + int(r[1])) for r in self.fifo)
        for (_a0, a1), (b0, _b1) in itertools.pairwise(spans):
            assert a1 <= b0, "live chunks overlap"
        assert all(a >= 0 and b <= CAP for a, b in spans)
        used = sum(int(r[1]) for r in self.fifo)
        assert self.ring.used_bytes >= used
        assert self.ring.used_bytes == CAP - self._model_free_bytes()  # the skipped tail too


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_wraparound_accounts_the_skipped_tail() -> None:
    ring = ShmRingBuffer.create(1024)
    try:
        a, _ = ring.allocate(300)  # 384 bytes
        b, _ = ring.allocate(300)  # 384 -> 768
        assert (a, b) == (0, 384)
        ring.commit(a)
        ring.commit(b)
        assert ring.free(lambda c: c == 1, 400) == [1]  # the second is not free: stops there
        c, _ = ring.allocate(300)  # 256 left at the end: wraps to 0
        assert c == 0
        assert ring.used_bytes == 1024  # [384, 768) live, [768, 1024) skipped, [0, 384) live
    finally:
        ring.close()


def test_a_wrap_with_no_id_left_changes_nothing() -> None:
    """The last id goes, then an allocation that would wrap raises before it skips the tail."""
    last = (1 << 63) - 1
    ring = ShmRingBuffer.create(1024, first_id=last - 1)
    try:
        a, ca = ring.allocate(300)  # [0, 384)
        b, cb = ring.allocate(500)  # [384, 960): 64 bytes left at the end
        ring.commit(a)
        ring.commit(b)
        assert ring.free(lambda c: c == ca, 300) == [ca]  # room at 0 now: a wrap would fit
        before = (ring.next_id, ring.n_chunks, ring.used_bytes, ring.fits(300))
        assert before[3] and before[2] == 576
        with pytest.raises(ShmCacheError, match="exhausted"):
            ring.try_allocate(300)
        assert (ring.next_id, ring.n_chunks, ring.used_bytes, ring.fits(300)) == before
        assert ring.position(b) == 384 and cb == last
    finally:
        ring.close()


def test_wrong_sizes_and_a_closed_ring_raise_typed_errors() -> None:
    ring = ShmRingBuffer.create(1024)
    with pytest.raises(ValueError, match="non-negative"):
        ring.try_allocate(-100)  # would look like a 0-byte chunk to the room check
    with pytest.raises(ValueError, match="non-negative"):
        ring.try_allocate(-1)
    assert ring.n_chunks == 0 and ring.next_id == 1
    assert ring.try_allocate(1024) is None  # never fits (its header too): nothing changed
    ring.close()
    with pytest.raises(ClosedCacheError):
        ring.try_allocate(100)


def test_reference_validation_is_typed() -> None:
    ring = ShmRingBuffer.create(4096)
    try:
        addr, cid = ring.allocate(100)
        with pytest.raises(InvalidReferenceError):  # not committed yet
            ring.access(addr, cid)
        ring.commit(addr)
        assert len(ring.access(addr, cid, 100)) == 100
        for bad in [(-64, cid), (4096, cid), (7, cid), (addr, cid + 10), (64, cid)]:
            with pytest.raises((InvalidReferenceError, StaleReferenceError)):
                ring.access(*bad)
        with pytest.raises(InvalidReferenceError):
            ring.access(addr, cid, 99)  # wrong length
        with pytest.raises(InvalidReferenceError):
            ring.access(addr, cid + 10)  # never issued
        ring.free(lambda _c: True)
        with pytest.raises(StaleReferenceError):
            ring.access(addr, cid)
        a2, c2 = ring.allocate(100)
        ring.commit(a2)
        assert a2 == addr and c2 > cid
        with pytest.raises(StaleReferenceError):
            ring.access(addr, cid)  # same address, reused by a newer chunk
    finally:
        ring.close()


def test_reader_role_and_abandoned_chunks() -> None:
    ring = ShmRingBuffer.create(4096)
    try:
        reader = ShmRingBuffer.attach(ring.handle())
        with pytest.raises(RoleError):
            reader.allocate(10)
        with pytest.raises(RoleError):
            reader.clear()
        addr, cid = ring.allocate(64)
        ring.abandon(addr)  # a copy that was cancelled: reclaimed in FIFO order
        with pytest.raises(StaleReferenceError):
            reader.access(addr, cid)
        assert ring.free(lambda _c: False) == [cid]
        reader.close()
    finally:
        ring.close()


def test_chunk_being_written_blocks_fifo_free() -> None:
    ring = ShmRingBuffer.create(4096)
    try:
        a, c = ring.allocate(64)
        assert ring.free(lambda _c: True) == []
        ring.commit(a)
        assert ring.free(lambda _c: True) == [c]
    finally:
        ring.close()


@settings(max_examples=300, deadline=None)
@given(
    address=st.integers(-(1 << 70), 1 << 70),
    cid=st.integers(-(1 << 70), 1 << 70),
    length=st.one_of(st.none(), st.integers(-(1 << 70), 1 << 70)),
)
@pytest.mark.parametrize("path", ["ring", *READ_PATHS])
def test_forged_addresses_only_raise_typed_errors(
    path: str, address: int, cid: int, length: int | None
) -> None:
    """The ring's own check, and a reader's on each read path (the compiled ``read_item``,
    its reference, the Python path) given a reference a forger tagged right."""
    if path != "ring":
        w, r, real = _fuzz_store(path)
        n = real.length if length is None else length
        tag = reference_tag(int(w.words[H_SECRET]), real.epoch, address, cid, n, address)
        try:
            value = r.get(ShmRef(real.nonce, real.epoch, address, cid, n, tag, address))
        except (InvalidReferenceError, StaleReferenceError):
            return
        assert (address, cid, n) == (real.address, real.id, real.length)
        assert np.array_equal(value["a"], np.arange(100))
        return
    ring = _shared_ring()
    try:
        view = ring.access(address, cid, length)
    except (InvalidReferenceError, StaleReferenceError):
        return
    # only the one real chunk may be accessed
    assert (address, cid) == _REAL and len(view) == 200


_RING: list[ShmRingBuffer] = []
_REAL: tuple[int, int] = (0, 0)


def _shared_ring() -> ShmRingBuffer:
    global _REAL
    if not _RING:
        r = ShmRingBuffer.create(1 << 16)
        a, c = r.allocate(200)
        r.commit(a)
        _REAL = (a, c)
        _RING.append(r)
    return _RING[0]


@pytest.fixture(autouse=True, scope="module")
def _close_shared_ring() -> object:
    yield None
    for r in _RING:
        r.close()
    _RING.clear()


def test_chunk_header_is_small() -> None:
    assert CHUNK_HEADER == 64


def test_reused_bytes_that_forge_the_old_chunk_header_are_still_stale(make_config: Any) -> None:
    """The next occupant's payload writes a perfect copy of the freed chunk's header."""
    from aioshmcache._layout import CHUNK_MAGIC, COMMITTED

    with (
        SenderCache(make_config(1 << 16, 1 << 15, 1)) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
    ):
        filler, _ = tx.get_and_update_item(({"f": np.zeros(900, np.uint8)}, ()), "filler")
        ref, _ = tx.get_and_update_item(({"a": np.arange(10)}, ()), "a")
        assert ref.address > 0
        rx.get_and_update_item(ref, "a")
        rx.get_and_update_item(filler, "filler")
        tx.invalidate("a")
        tx.invalidate("filler")
        tx.remove_dangling_items()  # both freed: the ring is empty, the next put starts at 0
        assert tx.store.ring.n_chunks == 0
        pattern = np.zeros(8, np.uint64)
        pattern[:4] = [ref.id, ref.length, COMMITTED, ref.id ^ ref.length ^ CHUNK_MAGIC]
        forged = np.tile(pattern, 400)  # a forged header at every 64-byte boundary
        tx.get_and_update_item(({"x": forged}, ()), "b")
        words = tx.store.ring.buf.cast("Q")
        i = ref.address // 8
        assert list(words[i : i + 4]) == list(pattern[:4])  # the old header is back, verbatim
        words.release()
        with pytest.raises(StaleReferenceError):
            rx.get_and_update_item(ref, "a")


def test_fifo_columns_grow_and_wrap_in_order() -> None:
    """Thousands of chunks: the writer's FIFO columns grow (keeping the order) across wraps."""
    ring = ShmRingBuffer.create(1 << 20)
    try:
        live: list[tuple[int, int, int]] = []  # (address, id, position), oldest first
        for n in range(40_000):
            if not ring.fits(100 + n % 700):
                freed = ring.free(lambda _c: True, 100 + n % 700)
                assert freed == [c for _a, c, _p in live[: len(freed)]]
                del live[: len(freed)]
            addr, cid = ring.allocate(100 + n % 700)
            ring.commit(addr)
            pos = ring.position(addr)
            assert pos % ring.capacity == addr
            live.append((addr, cid, pos))
            assert ring.head_id == live[0][1]
        assert ring.chunk_ids() == [c for _a, c, _p in live]
        assert [c for c, _s, _w in ring.iter_chunks()] == ring.chunk_ids()
        assert all(ring.position(a) == p for a, _c, p in live)
        assert ring.n_chunks == len(live) > 1000
    finally:
        ring.close()


def test_a_first_lap_of_1_kib_items_never_grows_the_fifo_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer's FIFO columns are sized at creation for a ring of 1 KiB items: filling the
    ring with them never doubles the columns (a doubling at 131,072 chunks stalled a put for
    milliseconds on the first lap of a 256 MiB cache); smaller items still grow them."""
    grown: list[int] = []
    grow = ShmRingBuffer._grow

    def counted(self: ShmRingBuffer) -> None:
        grown.append(self.n_chunks)
        grow(self)

    monkeypatch.setattr(ShmRingBuffer, "_grow", counted)
    ring = ShmRingBuffer.create(4 << 20)
    try:
        assert ShmRingBuffer.presize(ring.capacity) == ring.capacity // PRESIZE_CHUNK_BYTES
        while ring.fits(1024):
            ring.commit(ring.allocate(1024)[0])
        assert ring.n_chunks > 3000 and grown == []
        ring.free(lambda _c: True, ring.capacity)
        while ring.fits(1):  # 128-byte chunks: more than the columns were sized for
            ring.commit(ring.allocate(1)[0])
        assert grown and ring.n_chunks > ShmRingBuffer.presize(ring.capacity)
        assert len(ring.chunk_ids()) == ring.n_chunks
    finally:
        ring.close()


def test_commit_and_abandon_refuse_an_address_between_chunks() -> None:
    """The writer finds a chunk by its address divided by 64 (chunks are 64-byte aligned): an
    address that is not a chunk's, even one inside a chunk's first 64 bytes, is refused."""
    ring = ShmRingBuffer.create(4096)
    try:
        addr, _cid = ring.allocate(100)
        for wrong in (addr + 1, addr + 63, addr + 64):
            with pytest.raises(ShmCacheError, match="not being written"):
                ring.commit(wrong)
            ring.abandon(wrong)  # nothing there: nothing marked dead
        ring.commit(addr)  # the chunk itself is still being written, then committed
        assert ring.n_chunks == 1
    finally:
        ring.close()


@pytest.mark.parametrize("first_id", [0, 1 << 63, (1 << 64) - 2, 1 << 64])
def test_a_first_id_past_the_id_range_is_refused_at_creation(first_id: int) -> None:
    """Issue 19 item 7: an id the ring cannot number is a ``ValueError`` at creation, never an
    ``OverflowError`` at the first allocation (which left the ring half-updated)."""
    with pytest.raises(ValueError, match="first_id"):
        ShmRingBuffer.create(CAP, first_id=first_id)


def test_the_last_id_is_usable_and_exhaustion_changes_nothing() -> None:
    last = (1 << 63) - 1  # the largest id the writer's signed 64-bit columns hold
    ring = ShmRingBuffer.create(CAP, first_id=last)
    try:
        addr, cid = ring.allocate(100)
        assert cid == last
        ring.commit(addr)
        before = (ring.next_id, ring.n_chunks, ring.used_bytes, ring.chunk_ids())
        with pytest.raises(ShmCacheError, match="exhausted"):
            ring.allocate(100)
        with pytest.raises(ShmCacheError, match="exhausted"):
            ring.try_allocate(100)
        assert (ring.next_id, ring.n_chunks, ring.used_bytes, ring.chunk_ids()) == before
        assert len(ring.access(addr, cid, 100)) == 100  # the ring still works for what it holds
        assert ring.free(lambda _c: True) == [cid]
    finally:
        ring.close()
