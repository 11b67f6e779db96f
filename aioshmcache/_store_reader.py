"""Layer 5, the reader's role: ``StoreReader``, what ``ShmObjectStore.from_handle`` returns.

A reader holds a reader slot (claimed at attach, released at close; its kernel lock tells the
writer it is alive) and reads references: resolve, copy or view, verify the copy, then
acknowledge the hand-out in its slot's log (``_read_path.ReadPath`` does all of it). It holds no
writer state: no index, rows, ledger or writer lock, and no writer methods: asked for one of the
writer's names, it raises ``RoleError`` (``__getattr__``, which only runs once the usual
look-up has failed), saying which role has it.
"""

from __future__ import annotations

from typing import Any

from ._layout import H_GROUP
from ._read_path import CLOSE_WAIT, ReadPath
from ._reader_table import ReaderSlot
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import Serde
from ._store_base import ShmObjectStore
from ._types import ShmRef
from .errors import RoleError, WriterGoneError

__all__ = ["StoreReader"]


class StoreReader(ShmObjectStore):
    """A reader of one segment (:meth:`ShmObjectStore.from_handle`); ``close`` frees its slot.

    Reads and acknowledges references; no lock on the read path. Its reader slot is its read
    path's (``read_path.slot``): the one piece of state it adds to the base.
    """

    __slots__ = ()

    _role = "reader"

    def __init__(
        self, segment: Segment, *, serde: Serde | None = None, probe_interval: float = 0.25
    ) -> None:
        """Claim a reader slot of an attached segment (use :meth:`ShmObjectStore.from_handle`).

        ``WriterGoneError`` if the writer is gone already; ``ReaderLimitError`` if every slot
        is taken.
        """
        ring = ShmRingBuffer(segment, writer=False)
        super().__init__(segment, ring, serde=serde, probe_interval=probe_interval)
        if not segment.writer_alive():
            raise WriterGoneError(f"the writer of {segment.name!r} is gone")
        self._reading.slot = self._readers.claim()
        self._reading.enable_core()  # the compiled read of plain items, if the core is built

    def get(self, ref: ShmRef | dict[str, Any], *, copy: bool = True) -> Any:
        """Read a reference and acknowledge it once the copy is verified.

        With ``copy=False`` the arrays are read-only views into shared memory and nothing is
        acknowledged: call :meth:`ack` when done (a cache's ``lease`` does this for you).
        """
        return self._reading.get(ref, copy=copy)

    def ack(self, ref: ShmRef) -> None:
        """Acknowledge a reference read with ``copy=False`` after re-verifying it."""
        self._reading.ack(ref)

    def release(self, ref: ShmRef) -> None:
        """Acknowledge a reference that will not be read (never raises): the reader's side of
        the writer's ``release``.

        For a request that failed or was cancelled: the debt is settled so the writer can free
        the chunk. Nothing is read, but the reference is checked as a read checks it: a forged,
        foreign or stale one is never given back (it owes nothing, and a copy of a live one
        must not settle a hand-out not read yet; see ``_read_path``).
        """
        self._reading.give_back(ref)

    def check_writer(self) -> None:
        """``WriterGoneError`` if the writer closed or died (its kernel lock is probed at most
        every ``probe_interval`` s)."""
        self._reading.check_writer()

    @property
    def read_path(self) -> ReadPath:
        """This reader's read path (internal API, for the receiver requests of
        ``_receiver_request`` and the caches): the steps of a read (``hold`` ... ``leave``,
        ``lookup``, ``read_item``, ``get_checked``) that a request drives itself, and whether it
        is closing."""
        return self._reading

    @property
    def group_word(self) -> int:
        """The segment header's ``H_GROUP`` word, a cache group shard's proof of membership
        (``_layout.group_word`` of the group's name; 0 when not a shard, or once closed)."""
        return 0 if self._seg.closed else int(self._hw[H_GROUP])

    def _check_reader(self) -> ReaderSlot:
        """This reader's slot, after checking it may read now (open, writer alive, not
        revoked): for the caches' requests, which read through the slot themselves."""
        return self._reading.check_reader()

    def close_when_idle(self, *, wait: float = CLOSE_WAIT) -> bool:
        """Close now (reads that start later raise ``ClosedCacheError``) and free the slot and
        the mapping once no read is in flight in another thread.

        They are freed here if the reads in flight end within ``wait`` s, else by the last of
        them as it leaves; True if freed here. Never call it from inside a read of this store.
        """
        return self._reading.close_when_idle(self.close, wait=wait)

    def __getattr__(self, name: str) -> Any:
        """Only for names the reader lacks: one of the writer's is a ``RoleError`` (also
        an ``AttributeError``: ``hasattr(reader, "put")`` is False), any other the usual
        ``AttributeError``."""
        if name in self._role_names.get("writer", ()):
            raise RoleError(self._wrong_role(name, "writer"), name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _close_role(self) -> None:
        """Nothing of its own: the slot is the read path's, freed when that closes."""
