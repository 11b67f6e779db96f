"""The read path: resolve a reference, verify it, copy or view it, acknowledge it.

Used by every reader (with its reader slot) and by the writer's own :meth:`ReadPath.read`
(without one). A read resolves the reference against this segment (nonce, tag, epoch, then the
ring's bounds and chunk header), copies or views the payload, and re-verifies the chunk after the
copy: a chunk freed or reused meanwhile is a ``StaleReferenceError``, never torn data, for the
writer's own reads too. A reader then acknowledges the hand-out in its slot's log, and posts the
writer's wake-up semaphore when the writer waits for space. A valid reference that will not be
read (its request failed or was cancelled) is *given back*: acknowledged without reading.

A reference found **stale** is not acknowledged: it owes nothing. The writer frees a chunk only
once no hand-out of it is owed (or a clear dropped every debt), so a stale reference's hand-out is
settled already. Acknowledging it anyway could only ever settle a debt if the reference were
forged: a copy of a genuine one re-tagged with an older epoch (what anyone who can map the
segment may make) would settle the genuine hand-out its (id, seq) names before the reader read
it, and the writer would free the chunk under that reader.

**The one owner of the read algorithm.** Every read goes through this class; the requests of
the caches (``_receiver_request.ReceiverRequest``) drive its steps and hold none of their own:
the usual read of a plain item in one call (:meth:`ReadPath.read_item`, the core's ``read_item``:
``_core_read.c``, reference ``_core_read_py``), else ``lookup`` (the usual checks, nothing
raised) or ``check_reader_held`` + ``resolve_held`` (every check, typed errors), then
``finish_read_held``
(decode, verify, acknowledge); ``get_checked`` for a request's deferred reads; ``ack`` and
``give_back`` to settle hand-outs; ``_inflight`` / ``in_use`` around them (see below).

The writer-liveness probe lives here too: a reader checks the writer's kernel lock at most once
per ``probe_interval`` seconds.

**Closing during a read.** A reader may be closed by one thread while others read through it
(a worker's shutdown, or a group reader's rescan detaching the shard of a writer that went
away). Closing releases the views of the mapping, the reader slot and the descriptor that
carries the kernel locks; a read still using them would meet a released buffer (an untyped
``ValueError``) or probe a closed descriptor (``EBADF``, or worse, another file that reused its
number). So every entry point that touches shared memory counts itself *in flight* for its
duration (``_inflight``: one list entry per read; ``append`` and ``pop`` are single operations
under the GIL, so the hot path takes no lock) and checks ``closed`` after counting itself.
:meth:`shut` sets ``closed`` first and then waits, for a bounded time, until nothing is in
flight; a read that counted itself before that saw ``closed`` false and finishes against live
memory, one that counts itself after sees ``closed`` and raises ``ClosedCacheError`` before
touching anything. When the wait runs out (or the caller chose not to wait),
:meth:`close_when_idle` hands the release to the last read in flight, which runs it as it
leaves: the mapping and the descriptor stay valid until no read can use them, and no close
blocks for longer than its bound. A payload view handed out before the close (a zero-copy
read) keeps its pages mapped by itself (the mapping cannot be unmapped while exported).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import posix_ipc

from . import _core_api
from ._core_read_py import dtype_table as _dtype_table
from ._layout import (
    C_CHECK,
    C_ID,
    C_LENGTH,
    C_STATE,
    CHUNK_HEADER,
    CHUNK_MAGIC,
    COMMITTED,
    H_EPOCH,
    H_HEAD_POS,
    H_SECRET,
    H_STATE,
    H_WAITING,
    STATE_LIVE,
    semaphore_name,
)
from ._reader_table import ReaderSlot
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import MsgpackSerde, Serde
from ._types import ShmRef, reference_tag
from .errors import (
    ClosedCacheError,
    InvalidReferenceError,
    RoleError,
    ShmCacheError,
    StaleReferenceError,
    WriterGoneError,
)

__all__ = ["CLOSE_WAIT", "ReadPath", "check_ref_fields"]

#: how long ``close`` waits for reads in flight in other threads (seconds); a read is a bounded
#: copy and check, so this is only ever reached by a thread the OS did not schedule
CLOSE_WAIT = 5.0


def check_ref_fields(r: ShmRef) -> bool:
    """Whether every field of ``r`` is an unsigned 64-bit int (a ``ShmRef`` built by hand)."""
    a, b, c, d, e, f, g, h = r
    # exact ints only (no bool, no numpy ints); the OR of ints in [0, 2**64) stays below 2**64,
    # a negative one makes it negative: one shift checks every range (twice as fast as min/max)
    return (
        type(a) is int
        and type(b) is int
        and type(c) is int
        and type(d) is int
        and type(e) is int
        and type(f) is int
        and type(g) is int
        and type(h) is int
        and not (a | b | c | d | e | f | g | h) >> 64
    )


class ReadPath:
    """Reading references of one segment; with a reader slot, acknowledging them too."""

    # ``closed`` is read by the compiled put's owner check at the slot's offset (a look-up by
    # name in an instance dict costs ~150 instructions); ``__dict__`` still takes anything else
    __slots__ = (
        "__dict__",
        "_capacity",
        "_chunk_bytes",
        "_chunk_words",
        "_closed_done",
        "_ctx",
        "_hw",
        "_idle",
        "_inflight",
        "_last_writer_probe",
        "_nonce",
        "_read_item",
        "_release",
        "_secret",
        "_seg",
        "_sem",
        "closed",
        "probe_interval",
        "ring",
        "serde",
        "slot",
    )

    def __init__(
        self,
        segment: Segment,
        ring: ShmRingBuffer,
        serde: Serde,
        *,
        slot: ReaderSlot | None = None,
        probe_interval: float = 0.25,
    ) -> None:
        self._seg = segment
        self._hw = segment.words
        self.ring = ring
        self.serde = serde
        self.slot = slot
        self.probe_interval = probe_interval
        self._secret = int(self._hw[H_SECRET])
        self._nonce = segment.nonce
        self._last_writer_probe = -math.inf  # the first read probes, however young the clock
        self._sem: Any = None
        self.closed = False
        # reads in flight (one entry each; see "Closing during a read" in the module docstring)
        self._inflight: list[None] = []
        self._idle = threading.Condition(threading.Lock())
        self._release: Callable[[], None] | None = None  # run by the last read out, if deferred
        self._closed_done = False
        # the ring's size and views, for ``get``'s inline chunk checks: its words through a
        # view of this path's own (released by ``close``), its bytes borrowed (the ring
        # releases them when it closes)
        self._capacity = ring.capacity
        off = segment.layout.ring_off  # checked at attach (the header word may change since)
        self._chunk_words = segment.buf[off : off + self._capacity].cast("Q")
        self._chunk_bytes = ring.buf
        # the compiled read of one plain item (``enable_core``), None: the Python path only
        self._ctx: Any = None
        self._read_item: Callable[[Any, object, bool], Any] | None = None

    def enable_core(self, core: Any = None) -> bool:
        """Read plain items through the core's ``read_item`` (this reader's slot must be set).

        ``core``: the core module to use (default: the compiled one if it is in use; the pure
        one only on request, as the differential tests do, since the general Python path is
        faster than its step-by-step reference). Only for the default serde. True if enabled.
        """
        slot = self.slot
        if core is None:
            if _core_api.implementation() != "c":
                return False
            core = _core_api.core
        if slot is None or type(self.serde) is not MsgpackSerde:
            return False
        layout = self._seg.layout  # the geometry checked at attach, not the header words
        self._ctx = core.ReadCtx(
            self._seg.buf,
            ShmRef,
            self.serde,
            slot,
            np.empty,
            _dtype_table(),
            StaleReferenceError,
            self._nonce,
            self._secret,
            layout.ring_off,
            self._capacity,
            layout.reader_off + slot.slot * layout.slot_size,
        )
        self._read_item = core.read_item
        return True

    @property
    def has_core(self) -> bool:
        """Whether plain items are read through the core's ``read_item`` (:meth:`enable_core`)."""
        return self._read_item is not None

    def read_item(self, ref: object, copy: bool = True) -> Any:
        """The usual reader's read of a plain item in one core call (``_core_read``): the item,
        verified and acknowledged (with ``copy`` false: read-only views, acknowledged by
        :meth:`ack` when the lease ends); ``None`` (nothing done, nothing owed) for anything the
        core does not take, which the caller then reads by the general path.
        ``StaleReferenceError`` if the chunk was reclaimed during the copy (as ``get``)."""
        read = self._read_item
        if read is None:
            return None
        inflight = self._inflight  # one read in flight: ``in_use``, inlined
        inflight.append(None)
        try:
            if (
                self.closed
                or self._seg.forked
                or time.monotonic() - self._last_writer_probe > self.probe_interval
            ):
                return None
            value = read(self._ctx, ref, copy)
            if value is not None and copy and self._hw[H_WAITING]:
                self._post_wake()
            return value
        finally:
            inflight.pop()
            if self.closed:
                self._left_closed()

    # --- reads in flight (see "Closing during a read" in the module docstring) --------------
    def hold(self) -> None:
        """Count a read in flight without a check (the caller's own checks see ``closed``):
        a step of several reads, ended by :meth:`leave` on every path."""
        self._inflight.append(None)

    def _enter(self) -> None:
        """Count a read in flight; ``ClosedCacheError`` (uncounted) if closed already."""
        self._inflight.append(None)
        if self.closed:
            self.leave()
            self.check_open()

    def leave(self) -> None:
        """Uncount a read; the last one out after a close wakes the closer or runs the release."""
        self._inflight.pop()
        if self.closed:
            self._left_closed()

    def _left_closed(self) -> None:
        with self._idle:
            if self._inflight:
                return
            self._idle.notify_all()
            release, self._release = self._release, None
        if release is not None:
            release()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the mapping for a read made of several calls (typed error if closed)."""
        self._enter()
        try:
            yield
        finally:
            self.leave()

    def shut(self, wait: float) -> bool:
        """Refuse new reads, then wait up to ``wait`` s for those in flight; True once none is.

        After it returns True nothing can touch this reader's memory or descriptors any more:
        the caller may release them. (Not from inside a read of this path: see
        ``close_when_idle``.) In a forked child of the opener it never waits: the reads in
        flight at the fork were other threads' of the parent.
        """
        self.closed = True
        if self._seg.forked:
            # a forked child's copy: the reads counted in flight were the parent's threads',
            # which the child does not have (nor a lock one of them held at the fork): none
            # will ever leave, and nothing of the child reads through this copy
            return True
        deadline = time.monotonic() + wait
        with self._idle:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close_when_idle(self, release: Callable[[], None], *, wait: float = CLOSE_WAIT) -> bool:
        """Close now and run ``release`` (which frees the memory this path reads) when safe.

        ``release`` runs here if no read is in flight within ``wait`` s, else in the thread of
        the last read to leave (once). True if it ran here. Each call runs its ``release``, so
        it must be idempotent (``ShmObjectStore.close`` is). Never call it from inside a read
        of this path: it would wait for itself for ``wait`` s.
        """
        if self.shut(wait):
            release()
            return True
        with self._idle:
            if self._inflight:
                self._release = release
                return False
        release()  # the last read left between the wait and the lock
        return True

    # --- checks -----------------------------------------------------------------------------
    def check_open(self) -> None:
        """``ClosedCacheError`` once closed; ``RoleError`` in a forked child of the opener."""
        if self.closed:
            raise ClosedCacheError(f"store {self._seg.name!r} is closed")
        if self._seg.forked:
            raise RoleError(
                f"this cache object was opened by process {self._seg.pid}; a forked child "
                "cannot use it: attach again in the child"
            )

    def check_writer(self) -> None:
        """``WriterGoneError`` if the writer closed or died (probed every ``probe_interval``);
        ``RoleError`` first in a forked child of the opener (its copy probes no lock: a live
        writer would look dead)."""
        self._enter()
        try:
            if self._seg.forked:
                self.check_open()
            self._check_writer()
        finally:
            self.leave()

    def _check_writer(self) -> None:
        if self._hw[H_STATE] != STATE_LIVE:
            raise WriterGoneError(f"the writer of {self._seg.name!r} closed the cache")
        now = time.monotonic()
        if now - self._last_writer_probe > self.probe_interval:
            if not self._seg.writer_alive():
                raise WriterGoneError(f"the writer of {self._seg.name!r} died")
            self._last_writer_probe = now

    def check_reader(self) -> ReaderSlot:
        """The reader slot, after checking that this reader may read now (typed errors)."""
        self._enter()
        try:
            return self.check_reader_held()
        finally:
            self.leave()

    def check_reader_held(self) -> ReaderSlot:
        if self.closed or self._seg.forked:
            self.check_open()
        slot = self.slot
        if slot is None:
            raise RoleError(
                "this store is the writer; attach a reader to read with acknowledgement"
            )
        # check_writer's probe is due every probe_interval only: test that here, call it then
        if (
            self._hw[H_STATE] != STATE_LIVE
            or time.monotonic() - self._last_writer_probe > self.probe_interval
        ):
            self._check_writer()
        slot.check_revoked()
        if slot.overflowing:
            slot.flush()
        return slot

    # --- resolving --------------------------------------------------------------------------
    def _check_epoch(self, epoch: int) -> None:
        current = self._hw[H_EPOCH]
        if epoch != current:
            if epoch < current:
                raise StaleReferenceError(
                    f"reference is from before clear (epoch {epoch} < {current})"
                )
            raise InvalidReferenceError(f"reference epoch {epoch} is in the future")

    def resolve(self, ref: object) -> tuple[ShmRef, memoryview]:
        """Check a reference against this segment; returns it and a view of its payload.

        In order: open, fields, nonce, tag, epoch (none touches the chunk), then the chunk's
        header and the reuse fence (``ShmRingBuffer.access``). Typed errors.
        """
        self._enter()
        try:
            return self.resolve_held(ref)
        finally:
            self.leave()

    def resolve_held(self, ref: object) -> tuple[ShmRef, memoryview]:
        if self.closed or self._seg.forked:
            self.check_open()
        r = ref if isinstance(ref, ShmRef) else ShmRef.from_dict(ref)
        if not check_ref_fields(r):
            raise InvalidReferenceError("reference fields must be unsigned 64-bit ints")
        nonce, epoch, address, cid, length, tag, position, seq = r
        if nonce != self._nonce:
            raise InvalidReferenceError("reference belongs to another cache (nonce mismatch)")
        if tag != reference_tag(self._secret, epoch, address, cid, length, position, seq):
            raise InvalidReferenceError("reference is forged or corrupted (tag mismatch)")
        if epoch != self._hw[H_EPOCH]:
            self._check_epoch(epoch)
        return r, self.ring.access(address, cid, length, position)

    def validate(self, ref: object) -> ShmRef:
        """Check a reference against this segment without reading it (typed errors)."""
        r, view = self.resolve(ref)
        view.release()
        return r

    def finish_read(self, slot: ReaderSlot | None, r: ShmRef, view: memoryview, copy: bool) -> Any:
        """Decode and verify a resolved reference's view (a chunk reused during the copy is
        stale, never torn data); with a reader slot, check revocation and acknowledge a copy.

        After a big copy the CPU caches are cold: only a few words are touched after it.
        """
        inflight = self._inflight  # _enter and _leave, inlined (once per read)
        inflight.append(None)
        try:
            if self.closed:
                if copy:
                    view.release()
                self.check_open()
            return self.finish_read_held(slot, r, view, copy)
        finally:
            inflight.pop()
            if self.closed:
                self._left_closed()

    def finish_read_held(
        self, slot: ReaderSlot | None, r: ShmRef, view: memoryview, copy: bool
    ) -> Any:
        address, cid, position = r[2], r[3], r[6]
        try:
            value = self.serde.read(view, copy=copy)
        except ShmCacheError:
            # torn: stale; intact but undecodable: re-raise
            self.ring.verify(address, cid, position)
            raise
        finally:
            if copy:
                view.release()  # zero-copy arrays keep exporting it
        # ShmRingBuffer.verify's checks, inline; it raises the typed error if one fails
        cw, hw, i = self._chunk_words, self._hw, address >> 3
        if (
            self._seg.closed
            or hw[H_HEAD_POS] > position
            or cw[i + C_ID] != cid
            or cw[i + C_STATE] != COMMITTED
        ):
            self.ring.verify(address, cid, position)
        if slot is not None:
            slot.check_revoked()
            if copy:
                slot.ack(cid, r[7])
                if hw[H_WAITING]:
                    self._post_wake()
        return value

    # --- reading ----------------------------------------------------------------------------
    def read(self, ref: ShmRef | dict[str, Any]) -> Any:
        """The writer's own read: a verified copy, nothing acknowledged."""
        r, view = self.resolve(ref)
        return self.finish_read(None, r, view, True)

    def get(self, ref: ShmRef | dict[str, Any], *, copy: bool = True) -> Any:
        """A reader's read: verify, copy (or view), acknowledge (a copy only).

        The usual case is :meth:`lookup` then :meth:`finish_read_held`; anything unusual takes the
        general path, which makes the same checks again and raises the typed error. One read in
        flight for the whole call.
        """
        if self._read_item is not None:
            value = self.read_item(ref, copy)
            if value is not None:
                return value
        inflight = self._inflight  # one read in flight: ``in_use``, inlined
        inflight.append(None)
        try:
            view = self.lookup(ref)  # None if closed: ``check_reader_held`` raises then
            if view is None:
                return self._get(ref, copy)
            return self.finish_read_held(self.slot, ref, view, copy)  # type: ignore[arg-type]
        finally:
            inflight.pop()
            if self.closed:
                self._left_closed()

    def _get(self, ref: object, copy: bool) -> Any:
        """``get``'s general path, in the caller's read in flight: every check, typed errors."""
        slot = self.check_reader_held()
        r, view = self.resolve_held(ref)  # stale: raised, not acknowledged (module docstring)
        return self.finish_read_held(slot, r, view, copy)

    def lookup(self, ref: object) -> memoryview | None:
        """The usual case of :meth:`check_reader` and :meth:`resolve`, in one function.

        A view of the payload of ``ref`` if it is a ``ShmRef`` that passes every check, the
        writer is live (and its probe not due) and this reader's slot has room; ``None`` for
        anything else (nothing raised, nothing owed: the general path then raises the typed
        error, or gives back a stale reference). The checks are those of ``check_reader``,
        ``resolve`` and ``ShmRingBuffer.access``. The caller counts itself in flight.
        """
        slot = self.slot
        hw = self._hw
        if (
            slot is None
            or type(ref) is not ShmRef
            or self.closed
            or self._seg.forked
            or self._seg.closed
            or hw[H_STATE] != STATE_LIVE
            or time.monotonic() - self._last_writer_probe > self.probe_interval
            or not slot.ready()
        ):
            return None
        nonce, epoch, address, cid, length, tag, position, seq = ref
        if (
            type(nonce) is not int
            or type(epoch) is not int
            or type(address) is not int
            or type(cid) is not int
            or type(length) is not int
            or type(tag) is not int
            or type(position) is not int
            or type(seq) is not int
            or (nonce | epoch | address | cid | length | tag | position | seq) >> 64
            or nonce != self._nonce
            or epoch != hw[H_EPOCH]
        ):
            return None
        if tag != reference_tag(self._secret, epoch, address, cid, length, position, seq):
            return None
        # ShmRingBuffer.access: a committed chunk of this id and length, at its position, not
        # behind the reuse fence
        cw = self._chunk_words
        i = address >> 3
        if (
            address & 63
            or address + (CHUNK_HEADER + length) > self._capacity
            or cw[i + C_ID] != cid
            or cw[i + C_LENGTH] != length
            or cw[i + C_CHECK] != cid ^ length ^ CHUNK_MAGIC
            or cw[i + C_STATE] != COMMITTED
            or position % self._capacity != address
            or hw[H_HEAD_POS] > position
        ):
            return None
        start = address + CHUNK_HEADER
        return self._chunk_bytes[start : start + length].toreadonly()

    def get_checked(self, r: ShmRef, *, copy: bool = True, slot: ReaderSlot | None = None) -> Any:
        """``get`` of a reference that passed :meth:`validate` here (a request's).

        The fields, nonce and tag cannot have changed; the epoch and the chunk are checked again.
        ``slot``: what :meth:`check_reader` returned just before (the same step), else it runs.
        """
        with self.in_use():
            if slot is None:
                slot = self.check_reader_held()
            self._check_epoch(r.epoch)  # stale: raised, owes nothing (see the module docstring)
            view = self.ring.access(r.address, r.id, r.length, r.position)
            return self.finish_read_held(slot, r, view, copy)

    def ack(self, ref: ShmRef) -> None:
        """Acknowledge a reference read with ``copy=False`` after re-verifying it.

        Verified as a read is (``resolve_held``): a forged or foreign reference is an
        ``InvalidReferenceError`` and a stale one a ``StaleReferenceError``, neither
        acknowledged, so no copy of a leased reference settles the lease's hand-out.
        """
        with self.in_use():
            self._ack_checked(ref)

    def _ack_checked(self, ref: ShmRef) -> None:
        slot = self.check_reader_held()
        r, view = self.resolve_held(ref)  # typed errors; the chunk re-checked (fence, id, state)
        view.release()
        slot.ack(r.id, r.seq)
        if self._hw[H_WAITING]:
            self._post_wake()

    def give_back(self, ref: ShmRef) -> None:
        """Acknowledge a genuine reference that will not be read (never raises).

        Checked first as a read checks it (``resolve_held``: nonce, tag, epoch, the chunk live):
        a forged, foreign or stale reference is not acknowledged (module docstring), so no
        copy of a live reference, whatever its other fields, settles a hand-out the reader has
        not read (or still leases).
        """
        slot = self.slot
        if slot is None or self.closed or slot.closed or self._seg.forked:
            return
        # closed meanwhile: in_use raises ClosedCacheError, suppressed; forged or stale: the
        # typed error of ``resolve_held``, suppressed (nothing acknowledged)
        with (
            contextlib.suppress(ShmCacheError, ValueError, AttributeError, TypeError),
            self.in_use(),
        ):
            r, view = self.resolve_held(ref)
            view.release()
            self._ack(slot, r.id, r.seq)

    def _ack(self, slot: ReaderSlot, cid: int, seq: int) -> None:
        slot.ack(cid, seq)
        if self._hw[H_WAITING]:
            self._post_wake()

    def _post_wake(self) -> None:
        try:
            if self._sem is None:
                self._sem = posix_ipc.Semaphore(semaphore_name(self._seg.name, self._nonce))
            self._sem.release()
        except (posix_ipc.ExistentialError, OSError):
            pass  # the writer is gone or has not created it: waking is best-effort by design

    def close(self) -> None:
        """Free the reader slot and the semaphore handle; idempotent.

        Waits (up to ``CLOSE_WAIT`` s) for reads in flight in other threads first: see "Closing
        during a read" in the module docstring. ``ShmObjectStore.close`` releases the mapping
        after this returns even if a read is still in flight then; the caches close through
        ``close_when_idle``, which never releases under one.
        """
        if self._closed_done:
            return
        self._closed_done = True
        self.shut(CLOSE_WAIT)
        if self.slot is not None:
            self.slot.close()
        if self._sem is not None:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                self._sem.close()
        self._chunk_words.release()
