"""aioshmcache: an async-first single-writer / multi-reader shared-memory object cache.

A writer (the API gateway) puts preprocessed tensors into a ring buffer in POSIX shared memory
and sends small ``ShmRef`` references to reader processes (engine workers), which read the
tensors back, zero-copy if they like. See ``SenderCache`` / ``ReceiverCache`` and their asyncio
twins ``AsyncSenderCache`` / ``AsyncReceiverCache``.

This namespace is the surface a newcomer needs; the rest lives in modules:
``aioshmcache.errors`` (every error, the channel's and the frames' included),
``aioshmcache.store`` (the layer beneath the caches: ``ShmObjectStore.create`` returns the
segment's writer, a ``StoreWriter``, and ``from_handle`` a reader, a ``StoreReader``),
``aioshmcache.cache`` (``GroupReceiverCache``, ``Receiver``), ``aioshmcache.vllm`` (the same
caches under vLLM's processor-cache method names), ``aioshmcache.wire`` (a request's features
as bytes, and length-prefixed frames), ``aioshmcache.channel`` (the gateway <-> engine worker
channel: ``EngineClient``, ``serve_engine``), ``aioshmcache.tier`` (a Redis tier behind the
cache), ``aioshmcache.metrics`` (Prometheus, the ``metrics`` extra) and ``aioshmcache.keys``
(keys no client can poison: ``content_key``, ``lookup_key``, ``tenant_key``, re-exported here).

``implementation()`` says which core runs the hot steps: ``"c"`` (the compiled extension) or
``"python"`` (the pure-Python reference: no compiler at install time, or ``AIOSHM_PURE=1``).
"""

from ._core_api import implementation
from ._ring import ShmRingBuffer
from ._serde import MsgpackSerde, Serde
from ._store import ShmObjectStore
from ._sweep import sweep
from ._types import CacheConfig, CacheHandle, CacheInfo, CacheSnapshot, FeatureSpec, ShmRef
from .aio import AsyncReceiverCache, AsyncSenderCache
from .cache import ReceiverCache, SenderCache
from .errors import (
    CacheFullError,
    CacheMissError,
    ClosedCacheError,
    DuplicateKeyError,
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
    WriterGoneError,
)
from .keys import content_key, lookup_key, tenant_key

__version__ = "0.1.0"

__all__ = [
    # the caches
    "AsyncReceiverCache",
    "AsyncSenderCache",
    "ReceiverCache",
    "SenderCache",
    # their values
    "CacheConfig",
    "CacheHandle",
    "CacheInfo",
    "CacheSnapshot",
    "FeatureSpec",
    "ShmRef",
    # keys, the layers beneath, upkeep
    "MsgpackSerde",
    "Serde",
    "ShmObjectStore",
    "ShmRingBuffer",
    "content_key",
    "implementation",
    "lookup_key",
    "sweep",
    "tenant_key",
    # errors (all of them, the channel's too, in aioshmcache.errors)
    "CacheFullError",
    "CacheMissError",
    "ClosedCacheError",
    "DuplicateKeyError",
    "InvalidReferenceError",
    "KeyMismatchError",
    "ObjectTooLargeError",
    "ReaderEvictedError",
    "ReaderLimitError",
    "RoleError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SerdeError",
    "ShmCacheError",
    "ShmSpaceError",
    "StaleReferenceError",
    "WriterGoneError",
]
