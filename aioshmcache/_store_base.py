"""Layer 5: ``ShmObjectStore``, what the two roles of a segment's store share.

:meth:`ShmObjectStore.create` makes a segment and returns its **writer**, a ``StoreWriter``
(``_store``); :meth:`ShmObjectStore.from_handle` attaches a **reader**, a ``StoreReader``
(``_store_reader``). Both are ``ShmObjectStore``s: this base holds what the two roles share (the
mapped segment, its ring and reader table, the read path's checks in
:meth:`~ShmObjectStore.validate` and :meth:`~ShmObjectStore.get`, the handle, the lifetime) and
nothing else. Each role holds only its own state (``__slots__``) and offers only its own
methods: a reader simply has no writer methods, and a writer no reader methods. A reader asked
for one of the writer's names raises ``RoleError``, which says which role has it and is also an
``AttributeError``, so ``hasattr(reader, "put")`` is False.

Each role's class registers itself here when it is defined (``__init_subclass__``), which is how
``create`` and ``from_handle`` find them without this module importing either (no import
cycle): ``_store`` defines the writer and imports ``_store_reader``, so importing ``_store``
makes both available. The type checker knows each role: ``create`` is typed to return a
``StoreWriter``, ``from_handle`` a ``StoreReader``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Self

from ._layout import (
    DELIVERY_CODES,
    H_DELIVERY,
    H_EPOCH,
    H_HANDOUT_TTL_MS,
    H_MAX_OBJECT,
    LAYOUT_VERSION,
    Layout,
)
from ._read_path import ReadPath
from ._reader_table import ReaderTable, reader_slots_info
from ._ring import ShmRingBuffer
from ._segment import Segment
from ._serde import MsgpackSerde, Serde
from ._types import CacheConfig, CacheHandle, ReaderSlotInfo, ShmRef
from .errors import ClosedCacheError, InvalidReferenceError

if TYPE_CHECKING:
    from ._store import StoreWriter
    from ._store_reader import StoreReader

__all__ = ["ShmObjectStore"]


def _public_names(cls: type) -> frozenset[str]:
    return frozenset(n for n in dir(cls) if not n.startswith("_"))


class ShmObjectStore(abc.ABC):
    """Single-writer / multi-reader object store in one shared-memory segment.

    :meth:`create` makes the segment and returns its writer (:class:`StoreWriter`);
    :meth:`from_handle` attaches a reader (``StoreReader``), which claims a reader slot. This
    base is what both roles share; each role's methods are on its own class (see the module
    docstring).
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
    _role_classes: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register a role (a class that sets ``_role``): its class, for :meth:`create` and
        :meth:`from_handle`, and its own public names, for a clear error when another role is
        asked for one of them (``StoreReader.__getattr__``)."""
        super().__init_subclass__(**kwargs)
        if "_role" not in cls.__dict__:
            return
        ShmObjectStore._role_names[cls._role] = _public_names(cls) - _public_names(ShmObjectStore)
        ShmObjectStore._role_classes[cls._role] = cls
        # and under its name here, where ``create``'s and ``from_handle``'s return annotations
        # are resolved at run time (``typing.get_type_hints``; the checker imports them above)
        globals()[cls.__name__] = cls

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
            writer: StoreWriter = ShmObjectStore._role_classes["writer"](seg, config, serde=serde)
            return writer
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
            reader: StoreReader = ShmObjectStore._role_classes["reader"](
                seg, serde=serde, probe_interval=probe_interval
            )
            return reader
        except BaseException:
            seg.close()
            raise

    # --- what both roles share -------------------------------------------------------------------
    def handle(self) -> CacheHandle:
        """What a reader needs to attach: name, nonce and layout version (the same once closed:
        the nonce kept at open, not read from the mapping the close released)."""
        return CacheHandle(self._seg.name, self._nonce, LAYOUT_VERSION)

    @property
    def name(self) -> str:
        """The segment's name in /dev/shm."""
        return self._seg.name

    @property
    def nonce(self) -> int:
        """The random number of this instance of the segment (kept at open: readable once
        closed too)."""
        return self._nonce

    @property
    def epoch(self) -> int:
        """The current epoch (:meth:`StoreWriter.clear` starts a new one; ``ClosedCacheError``
        once closed)."""
        self._check_mapped()
        return int(self._hw[H_EPOCH])

    def _check_mapped(self) -> None:
        """``ClosedCacheError`` once closed: the header words are released (reading them would
        raise the released memoryview's ``ValueError``)."""
        if self._closed:
            raise ClosedCacheError(f"store {self._seg.name!r} is closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (and has released the mapping)."""
        return self._closed

    @property
    def forked(self) -> bool:
        """Whether this is a forked child's copy of a store opened by its parent (its role's
        calls raise ``RoleError`` here; a close releases the copy and unlinks nothing)."""
        return self._seg.forked

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
