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

The writer-liveness probe lives here too: a reader checks the writer's kernel lock at most once
per ``probe_interval`` seconds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import posix_ipc

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
    WS_REVOKED,
    semaphore_name,
)
from ._readers import ReaderSlot
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import Serde
from ._types import ShmRef, finish_tag, tag_base
from .errors import (
    ClosedCacheError,
    InvalidReferenceError,
    RoleError,
    ShmCacheError,
    StaleReferenceError,
    WriterGoneError,
)

__all__ = ["ReadPath", "check_ref_fields"]


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
        self._last_writer_probe = 0.0
        self._sem: Any = None
        self.closed = False
        # the ring's size and views, for ``get``'s inline chunk checks (borrowed: the ring
        # releases them when it closes)
        self._capacity = ring.capacity
        self._chunk_words = ring._w
        self._chunk_bytes = ring.buf

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
        """``WriterGoneError`` if the writer closed or died (probed every ``probe_interval``)."""
        if self._hw[H_STATE] != STATE_LIVE:
            raise WriterGoneError(f"the writer of {self._seg.name!r} closed the cache")
        now = time.monotonic()
        if now - self._last_writer_probe > self.probe_interval:
            if not self._seg.writer_alive():
                raise WriterGoneError(f"the writer of {self._seg.name!r} died")
            self._last_writer_probe = now

    def check_reader(self) -> ReaderSlot:
        """The reader slot, after checking that this reader may read now (typed errors)."""
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
            self.check_writer()
        if slot._words[WS_REVOKED] == slot.session:
            slot.check_revoked()
        if slot._overflow:
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
        if self.closed or self._seg.forked:
            self.check_open()
        r = ref if isinstance(ref, ShmRef) else ShmRef.from_dict(ref)
        if not check_ref_fields(r):
            raise InvalidReferenceError("reference fields must be unsigned 64-bit ints")
        nonce, epoch, address, cid, length, tag, position, seq = r
        if nonce != self._nonce:
            raise InvalidReferenceError("reference belongs to another cache (nonce mismatch)")
        if tag != finish_tag(tag_base(self._secret, epoch, address, cid, length, position), seq):
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
            if slot._words[WS_REVOKED] == slot.session:
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

        The usual case is :meth:`lookup` then :meth:`finish_read`; anything unusual takes the
        general path, which makes the same checks again and raises the typed error.
        """
        view = self.lookup(ref)
        if view is None:
            return self._get(ref, copy)
        return self.finish_read(self.slot, ref, view, copy)  # type: ignore[arg-type]

    def lookup(self, ref: object) -> memoryview | None:
        """The usual case of :meth:`check_reader` and :meth:`resolve`, in one function.

        A view of the payload of ``ref`` if it is a ``ShmRef`` that passes every check, the
        writer is live (and its probe not due) and this reader's slot has room; ``None`` for
        anything else (nothing raised, nothing owed: the general path then raises the typed
        error, or gives back a stale reference). The checks are those of ``check_reader``,
        ``resolve`` and ``ShmRingBuffer.access``, in their order.
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
            or slot._words[WS_REVOKED] == slot.session
            or slot._overflow
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
            or tag != finish_tag(tag_base(self._secret, epoch, address, cid, length, position), seq)
            or epoch != hw[H_EPOCH]
        ):
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

    def _get(self, ref: object, copy: bool) -> Any:
        slot = self.check_reader()
        r, view = self.resolve(ref)  # stale: raised, not acknowledged (see the module docstring)
        return self.finish_read(slot, r, view, copy)

    def get_checked(self, r: ShmRef, *, copy: bool = True, slot: ReaderSlot | None = None) -> Any:
        """``get`` of a reference that passed :meth:`validate` here (a request's).

        The fields, nonce and tag cannot have changed; the epoch and the chunk are checked again.
        ``slot``: what :meth:`check_reader` returned just before (the same step), else it runs.
        """
        if slot is None:
            slot = self.check_reader()
        self._check_epoch(r.epoch)  # stale: raised, owes nothing (see the module docstring)
        view = self.ring.access(r.address, r.id, r.length, r.position)
        return self.finish_read(slot, r, view, copy)

    def ack(self, ref: ShmRef) -> None:
        """Acknowledge a reference read with ``copy=False`` after re-verifying it."""
        slot = self.check_reader()
        address, cid, position = ref.address, ref.id, ref.position
        # ShmRingBuffer.verify's checks, inline (as in finish_read); it raises if one fails
        hw = self._hw
        if self._seg.closed or hw[H_HEAD_POS] > position:
            self.ring.verify(address, cid, position)
        cw, i = self._chunk_words, address >> 3
        if cw[i + C_ID] != cid or cw[i + C_STATE] != COMMITTED:
            self.ring.verify(address, cid, position)
        slot.ack(cid, ref.seq)
        if hw[H_WAITING]:
            self._post_wake()

    def give_back(self, ref: ShmRef) -> None:
        """Acknowledge a reference that will not be read (never raises)."""
        slot = self.slot
        if slot is None or self.closed or slot.closed or self._seg.forked:
            return
        with contextlib.suppress(ShmCacheError, ValueError, AttributeError, TypeError):
            self._ack(slot, ref.id, ref.seq)

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
        """Free the reader slot and the semaphore handle; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.slot is not None:
            self.slot.close()
        if self._sem is not None:
            with contextlib.suppress(posix_ipc.ExistentialError, OSError):
                self._sem.close()
