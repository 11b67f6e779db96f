"""The public surface: one screen of top-level names, flat errors, the rest in modules."""

from __future__ import annotations

import builtins

import aioshmcache
from aioshmcache import cache, errors, store, tier

#: each error's builtin mix-ins (what a caller may catch instead of the error itself)
BUILTINS = {
    "CacheFullError": set(),
    "CacheMissError": {KeyError},
    "ClosedCacheError": set(),
    "DuplicateKeyError": {ValueError},
    "EndOfFramesError": {EOFError},
    "EngineAddressInUseError": {FileExistsError},
    "EngineCallError": set(),
    "EngineTimeoutError": {TimeoutError},
    "EngineUnavailableError": {ConnectionError},
    "FrameError": set(),
    "FrameTooLargeError": {ValueError},
    "IncompleteFrameError": {EOFError},
    "InvalidReferenceError": {ValueError},
    "KeyMismatchError": {ValueError},
    "ObjectTooLargeError": {ValueError},
    "ReaderEvictedError": set(),
    "ReaderLimitError": set(),
    "RoleError": {AttributeError},
    "SegmentExistsError": {FileExistsError},
    "SegmentNotFoundError": {FileNotFoundError},
    "SerdeError": {ValueError},
    "ShmSpaceError": {OSError},
    "StaleReferenceError": set(),
    "WireError": {ValueError},
    "WriterGoneError": set(),
}

#: the top level: the caches, their values, keys, the store layer DESIGN names, every error a
#: cache call raises (the channel's and the frames' are in ``aioshmcache.errors`` only)
TOP_LEVEL = {
    "AsyncReceiverCache",
    "AsyncSenderCache",
    "ReceiverCache",
    "SenderCache",
    "CacheConfig",
    "CacheHandle",
    "CacheInfo",
    "CacheSnapshot",
    "FeatureSpec",
    "ShmRef",
    "MsgpackSerde",
    "Serde",
    "ShmObjectStore",
    "ShmRingBuffer",
    "content_key",
    "implementation",
    "lookup_key",
    "sweep",
    "tenant_key",
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
}


def test_every_error_is_a_direct_subclass_of_the_base_plus_builtins() -> None:
    """Flat: no family between an error and ``ShmCacheError``; the other bases are builtins."""
    assert set(errors.__all__) == set(BUILTINS) | {"ShmCacheError"}
    assert errors.ShmCacheError.__bases__ == (Exception,)
    for name, mixins in BUILTINS.items():
        cls = getattr(errors, name)
        assert cls.__bases__[0] is errors.ShmCacheError, name
        others = set(cls.__bases__[1:])
        assert others == mixins, name
        assert all(getattr(builtins, b.__name__) is b for b in others), name
        assert not issubclass(cls, MemoryError), name


def test_one_role_error() -> None:
    """``RoleError`` is the only role error; it is an ``AttributeError`` (``hasattr`` False)."""
    assert not hasattr(errors, "WrongRoleError") and not hasattr(aioshmcache, "WrongRoleError")
    assert issubclass(aioshmcache.RoleError, AttributeError)

    class Reader:
        @property
        def put(self) -> None:
            raise aioshmcache.RoleError("'put' is the writer's")

    assert not hasattr(Reader(), "put")


def test_the_top_level_is_one_screen_and_the_rest_lives_in_modules() -> None:
    assert set(aioshmcache.__all__) == TOP_LEVEL
    assert len(aioshmcache.__all__) == len(set(aioshmcache.__all__))
    for name in aioshmcache.__all__:
        assert getattr(aioshmcache, name) is not None
    for name in TOP_LEVEL & set(errors.__all__):
        assert getattr(aioshmcache, name) is getattr(errors, name)
    moved = {
        store: ("EncodePlan", "ReaderSlotInfo", "StoreReader", "StoreWriter"),
        tier: ("TierSnapshot",),
        cache: ("GroupReceiverCache",),
        errors: ("EngineCallError", "FrameTooLargeError", "WireError", "EndOfFramesError"),
    }
    for module, names in moved.items():
        for name in names:
            assert name in module.__all__ and not hasattr(aioshmcache, name), name
    for name in store.__all__:  # the store module holds the store layer, the same objects
        assert not hasattr(aioshmcache, name) or getattr(aioshmcache, name) is getattr(store, name)
