"""Error types shared by every layer, the sync caches and the asyncio facade.

Flat: every error is a direct subclass of :class:`ShmCacheError`, some also of the builtin a
caller would naturally catch (``ValueError`` for bad input, ``FileExistsError`` /
``FileNotFoundError`` for segment names, ``EOFError`` for a stream that ended, ``TimeoutError``
and ``ConnectionError`` for the engine channel). There are no intermediate families: catch the
base, a builtin, or the leaves you mean. No error derives from ``MemoryError``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CacheFullError",
    "CacheMissError",
    "ClosedCacheError",
    "DuplicateKeyError",
    "EndOfFramesError",
    "EngineAddressInUseError",
    "EngineCallError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FrameError",
    "FrameTooLargeError",
    "IncompleteFrameError",
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
    "WireError",
    "WriterGoneError",
]


class ShmCacheError(Exception):
    """Base class of every error raised by aioshmcache."""


class CacheFullError(ShmCacheError):
    """No room in the ring, even after evicting every freeable item (and waiting, if asked)."""


class ObjectTooLargeError(ShmCacheError, ValueError):
    """The serialized object is larger than ``max_object_bytes`` (checked before any copy)."""

    def __init__(self, message: str, *, nbytes: int = 0) -> None:
        super().__init__(message)
        #: the serialized size that was refused
        self.nbytes = nbytes


class DuplicateKeyError(ShmCacheError, ValueError):
    """``put`` of a key that is already cached."""


class InvalidReferenceError(ShmCacheError, ValueError):
    """A reference that was never valid here: forged, out of bounds, or from another segment."""


class KeyMismatchError(ShmCacheError, ValueError):
    """A key a client sent does not name the body it came with, or is not a content key.

    Raised by ``content_key(body, claimed=...)`` and ``lookup_key``; answer it with HTTP 400
    and cache nothing. ``claimed`` is the key that was refused.
    """

    def __init__(self, message: str, claimed: str = "") -> None:
        super().__init__(message)
        #: the client's key that was refused
        self.claimed = claimed


class StaleReferenceError(ShmCacheError):
    """A reference that was valid once, but its chunk was evicted, reused or cleared."""


class CacheMissError(ShmCacheError, KeyError):
    """Items the cache no longer holds; ``mm_hashes`` lists them (the drift-recovery signal).

    The writer answers it with ``invalidate`` and a resend of the data.
    """

    def __init__(
        self, mm_hashes: Iterable[str], message: str | None = None, *, features: object = None
    ) -> None:
        self.mm_hashes: tuple[str, ...] = tuple(mm_hashes)
        #: the receiver's partial result (valid references read, stale ones ``None``), if any
        self.features: object = features
        if message is None:
            message = f"not cached (resend with data): {', '.join(map(str, self.mm_hashes))}"
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0])


class WriterGoneError(ShmCacheError):
    """The writer process died or closed the segment.

    From a group reader, ``mm_hashes`` lists the items whose shard's writer is gone and
    ``features`` holds the partial result (the other shards' items were read).
    """

    def __init__(
        self, message: str = "", *, mm_hashes: Iterable[str] = (), features: object = None
    ) -> None:
        super().__init__(message)
        self.mm_hashes: tuple[str, ...] = tuple(mm_hashes)
        self.features: object = features


class ReaderEvictedError(ShmCacheError):
    """This reader was revoked by the writer (it was stuck past ``evict_stuck_readers_after``)."""


class ReaderLimitError(ShmCacheError):
    """Every reader slot of the segment is taken."""


class ClosedCacheError(ShmCacheError):
    """The cache (or store, or segment) was closed."""


class SegmentExistsError(ShmCacheError, FileExistsError):
    """A segment of that name already exists."""


class SegmentNotFoundError(ShmCacheError, FileNotFoundError):
    """No segment of that name (or it is not an aioshmcache segment)."""


class ShmSpaceError(ShmCacheError, OSError):
    """Not enough space in /dev/shm to reserve the segment at creation."""


class RoleError(ShmCacheError, AttributeError):
    """An object was used in a role it does not have: a method of the other role looked up on
    a store (``reader.put``, ``writer.ack``), or a cache used in a forked child of its opener.

    Also an ``AttributeError``, since a reader indeed has no writer method:
    ``hasattr(reader, "put")`` is False and ``getattr(reader, "put", None)`` is None.
    """


class SerdeError(ShmCacheError, ValueError):
    """A value cannot be encoded, or bytes are not in our format (decoding is refused)."""


class WireError(ShmCacheError, ValueError):
    """Bytes received as a features message (``aioshmcache.wire``) are not a valid one."""


class FrameError(ShmCacheError):
    """A length-prefixed stream is out of step (an earlier frame failed, or a read returned
    more than asked): close it. The frames' other errors are ``FrameTooLargeError`` and
    ``IncompleteFrameError``."""


class FrameTooLargeError(ShmCacheError, ValueError):
    """A frame's declared (or given) length exceeds ``max_bytes``; nothing of it was read."""

    def __init__(self, message: str, *, nbytes: int = 0, max_bytes: int = 0) -> None:
        super().__init__(message)
        #: the length that was refused, and the limit it exceeds
        self.nbytes = nbytes
        self.max_bytes = max_bytes


class IncompleteFrameError(ShmCacheError, EOFError):
    """The stream ended inside a frame (in its length prefix or its payload)."""

    def __init__(self, message: str, *, received: int = 0, expected: int = 0) -> None:
        super().__init__(message)
        #: bytes of the frame (prefix included) received before the end, and the bytes expected
        self.received = received
        self.expected = expected


class EndOfFramesError(ShmCacheError, EOFError):
    """The stream ended cleanly between two frames: the peer closed it (not a bad frame)."""


class EngineUnavailableError(ShmCacheError, ConnectionError):
    """No engine worker could be reached (``aioshmcache.channel``), or it went away before
    answering.

    The channel's own errors are this, ``EngineTimeoutError``, ``EngineCallError`` and
    ``EngineAddressInUseError``. Errors of the cache met by the engine worker while reading a
    request's features come back as the cache's own types (``CacheMissError``, ...).
    """


class EngineTimeoutError(ShmCacheError, TimeoutError):
    """A call's deadline passed before the engine worker answered."""


class EngineCallError(ShmCacheError):
    """The engine worker's handler raised; ``remote_type`` names the exception it raised."""

    def __init__(self, message: str, *, remote_type: str = "") -> None:
        super().__init__(message)
        #: the class name of the exception raised in the engine worker
        self.remote_type = remote_type


class EngineAddressInUseError(ShmCacheError, FileExistsError):
    """Another live engine worker already serves this socket path."""
