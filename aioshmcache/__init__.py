"""aioshmcache: an async-first single-writer / multi-reader shared-memory object cache.

A writer (the API gateway) puts preprocessed tensors into a ring buffer in POSIX shared memory
and sends small ``ShmRef`` references to reader processes (engine workers), which read the
tensors back, zero-copy if they like. See ``SenderCache`` / ``ReceiverCache`` and their asyncio
twins ``AsyncSenderCache`` / ``AsyncReceiverCache``. Beneath them, ``ShmObjectStore.create``
returns the segment's writer (a ``StoreWriter``) and ``ShmObjectStore.from_handle`` a reader (a
``StoreReader``): one object per role.

Modules: ``aioshmcache.wire`` moves a request's features between processes (``pack_features`` /
``unpack_features`` and length-prefixed frames); ``aioshmcache.channel`` is the gateway <->
engine worker channel built on it (``EngineClient``, ``serve_engine``); ``aioshmcache.metrics``
(the ``metrics`` extra, not imported here) exports caches and cache groups to Prometheus;
``aioshmcache.keys`` derives keys no client can poison (``content_key``, ``lookup_key``,
``tenant_key``, re-exported here).

``implementation()`` says which core runs the hot steps: ``"c"`` (the compiled extension) or
``"python"`` (the pure-Python reference: no compiler at install time, or ``AIOSHM_PURE=1``).
"""

from . import wire
from ._core_api import implementation
from ._ring import ShmRingBuffer
from ._serde import EncodePlan, MsgpackSerde, Serde
from ._store import ShmObjectStore, StoreWriter
from ._store_reader import StoreReader
from ._sweep import sweep
from ._types import (
    CacheConfig,
    CacheHandle,
    CacheInfo,
    CacheSnapshot,
    FeatureSpec,
    ReaderSlotInfo,
    ShmRef,
    TierSnapshot,
)
from .aio import AsyncReceiverCache, AsyncSenderCache
from .cache import GroupReceiverCache, ReceiverCache, SenderCache
from .errors import (
    CacheFullError,
    CacheMissError,
    ClosedCacheError,
    DuplicateKeyError,
    EndOfFramesError,
    EngineAddressInUseError,
    EngineCallError,
    EngineError,
    EngineTimeoutError,
    EngineUnavailableError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    InvalidReferenceError,
    KeyMismatchError,
    ObjectTooLargeError,
    ReaderEvictedError,
    ReaderLimitError,
    RoleError,
    SegmentExistsError,
    SegmentNotFoundError,
    SerdeError,
    ShmCacheError,
    ShmSpaceError,
    StaleReferenceError,
    WireError,
    WriterGoneError,
    WrongRoleError,
)
from .keys import content_key, lookup_key, tenant_key

__version__ = "0.1.0"

__all__ = [
    "AsyncReceiverCache",
    "AsyncSenderCache",
    "CacheConfig",
    "CacheFullError",
    "CacheHandle",
    "CacheInfo",
    "CacheMissError",
    "CacheSnapshot",
    "ClosedCacheError",
    "DuplicateKeyError",
    "EncodePlan",
    "EndOfFramesError",
    "EngineAddressInUseError",
    "EngineCallError",
    "EngineError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FeatureSpec",
    "FrameError",
    "FrameTooLargeError",
    "GroupReceiverCache",
    "IncompleteFrameError",
    "InvalidReferenceError",
    "KeyMismatchError",
    "MsgpackSerde",
    "ObjectTooLargeError",
    "ReaderEvictedError",
    "ReaderLimitError",
    "ReaderSlotInfo",
    "ReceiverCache",
    "RoleError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SenderCache",
    "Serde",
    "SerdeError",
    "ShmCacheError",
    "ShmObjectStore",
    "ShmRef",
    "ShmRingBuffer",
    "ShmSpaceError",
    "StaleReferenceError",
    "StoreReader",
    "StoreWriter",
    "TierSnapshot",
    "WireError",
    "WriterGoneError",
    "WrongRoleError",
    "content_key",
    "implementation",
    "lookup_key",
    "sweep",
    "tenant_key",
    "wire",
]
