"""The layer beneath the caches: the object store, its two roles, the ring and the serde plan.

``ShmObjectStore.create(config)`` makes a segment and returns its writer (a ``StoreWriter``:
put, hand out, pin, evict, clear); ``ShmObjectStore.from_handle(handle)`` attaches a reader (a
``StoreReader``: get, acknowledge, give back). Most programs use the caches instead
(``aioshmcache.SenderCache`` / ``ReceiverCache``); these names are for code that drives the store
itself or types what it returns. ``EncodePlan`` is what a custom ``Serde`` plans;
``ReaderSlotInfo`` one reader slot of a ``CacheSnapshot``.
"""

from ._ring import ShmRingBuffer
from ._serde import EncodePlan, MsgpackSerde, Serde
from ._store import ShmObjectStore, StoreWriter
from ._store_reader import StoreReader
from ._types import ReaderSlotInfo

__all__ = [
    "EncodePlan",
    "MsgpackSerde",
    "ReaderSlotInfo",
    "Serde",
    "ShmObjectStore",
    "ShmRingBuffer",
    "StoreReader",
    "StoreWriter",
]
