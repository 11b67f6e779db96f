"""Layer 6: the P0 sender cache (the writer) and the P1 receiver cache (a reader).

The sender answers repeated multimodal items (same ``mm_hash``) from its index with a new
hand-out of the cached chunk, puts new ones, and serves inline what cannot be cached (too large,
or no room even after eviction). Each request pins its own cached items for the length of the
call, so it never evicts what it is about to hand out (vLLM issue 26195). The receiver turns
references back into items: it validates every reference of a request first, reads each one,
verifies it and only then acknowledges it, and reports stale ones together as one
``CacheMissError`` (the drift signal: the sender answers with ``invalidate`` and a resend).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from ._segment import (
    W_HITS,
    W_INLINE_FULL,
    W_INLINE_LARGE,
    W_MISSES,
)
from ._serde import Serde
from ._store import Reservation, ShmObjectStore
from ._types import (
    REF_FIELDS,
    CacheConfig,
    CacheHandle,
    CacheInfo,
    CacheSnapshot,
    FeatureSpec,
    ShmRef,
)
from .errors import (
    CacheFullError,
    CacheMissError,
    InvalidReferenceError,
    ObjectTooLargeError,
    StaleReferenceError,
)

__all__ = ["ReceiverCache", "SenderCache"]

log = logging.getLogger("aioshmcache")

_REF_KEYS: Final = frozenset(REF_FIELDS)
_TOO_LARGE_MEMORY: Final = 4096  # hashes remembered as too large (no re-serialisation)

MmItem = tuple[Any, Sequence[Any]]


def _check_hash(mm_hash: object) -> str:
    if not isinstance(mm_hash, str):
        raise TypeError(f"mm_hash must be a str, not {type(mm_hash).__name__}")
    return mm_hash


def as_reference(data: object) -> ShmRef | None:
    """``data`` as a reference if it is one (a ``ShmRef``, or a mapping of reference fields).

    A mapping with a ``nonce`` whose keys are all reference field names is a reference, validated
    strictly (``InvalidReferenceError`` for missing fields or wrong types); any other mapping is
    an inline item.
    """
    if isinstance(data, ShmRef):
        return data
    if isinstance(data, Mapping) and "nonce" in data and all(k in _REF_KEYS for k in data):
        return ShmRef.from_dict(data)
    return None


class SenderCache:
    """P0: the writer. Creates and owns the segment; ``close`` unlinks it."""

    def __init__(self, config: CacheConfig, *, serde: Serde | None = None) -> None:
        self.config = config
        self.store = ShmObjectStore.create(config, serde=serde)
        self._prompt_updates: dict[str, Sequence[Any]] = {}
        self.store.on_evict = self._forget
        self._too_large: OrderedDict[str, int] = OrderedDict()
        self.hits = 0
        self.total = 0
        self.inline_too_large = 0
        self.inline_full = 0
        self._logged: set[str] = set()
        self._last_delta = CacheInfo(0, 0)

    def _forget(self, key: str) -> None:
        self._prompt_updates.pop(key, None)

    # --- look-ups --------------------------------------------------------------------------
    def is_cached_item(self, mm_hash: str) -> bool:
        """Pure look-up: no hand-out, no change to eviction order."""
        return self.store.is_cached(_check_hash(mm_hash))

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        return [self.is_cached_item(h) for h in mm_hashes]

    def handle(self) -> CacheHandle:
        return self.store.handle()

    @property
    def name(self) -> str:
        return self.store.name

    # --- the seed's get_and_update -------------------------------------------------------
    def get_and_update_item(
        self, mm_item: MmItem | None, mm_hash: str, *, wait_for_space: float | None = None
    ) -> MmItem:
        """One item: a hit or a put gives ``(ShmRef, prompt_updates)``; else the input, inline.

        ``mm_item`` is ``(item, prompt_updates)`` or ``None`` (the caller believes it is cached:
        ``CacheMissError`` if not).
        """
        _check_hash(mm_hash)
        with self.store.lock:
            if mm_item is None and not self.store.is_cached(mm_hash):
                raise CacheMissError([mm_hash])
            with self.store.pinned([mm_hash]):
                return self._update_locked(mm_item, mm_hash, wait_for_space)

    def _count(self, hit: bool) -> None:
        self.total += 1
        if hit:
            self.hits += 1
        w = self.store.ring.segment.words
        w[W_HITS] = self.hits
        w[W_MISSES] = self.total - self.hits

    def _lookup_locked(self, mm_item: MmItem | None, mm_hash: str) -> MmItem | None:
        """The hit path (or None on a miss). Hold the store lock."""
        ref = self.store.get_cached(mm_hash)
        if ref is None:
            if mm_item is None:
                raise CacheMissError([mm_hash])
            return None
        self._count(True)
        updates = self._prompt_updates.get(mm_hash, ()) if mm_item is None else mm_item[1]
        return ref, updates

    def _update_locked(
        self, mm_item: MmItem | None, mm_hash: str, wait_for_space: float | None
    ) -> MmItem:
        hit = self._lookup_locked(mm_item, mm_hash)
        if hit is not None:
            return hit
        assert_item = _split_item(mm_item)
        if self.store.is_pending(mm_hash):  # another thread is putting it right now
            self._count(False)
            return assert_item
        res = self._reserve_locked(assert_item, mm_hash, wait_for_space)
        if res is None:
            return assert_item
        try:
            self.store.write_reserved(res)
        except BaseException:
            self.store.abort(res)
            raise
        return self._commit_locked(res, assert_item[1])

    def _reserve_locked(
        self,
        mm_item: MmItem,
        mm_hash: str,
        wait_for_space: float | None,
        *,
        count: bool = True,
        defer_full: bool = False,
    ) -> Reservation | None:
        """Plan and allocate a miss; None means: serve inline (counted and logged once).

        ``count=False``: the miss was counted already (a retry). ``defer_full``: raise
        ``CacheFullError`` instead of serving inline (the caller will wait for room).
        """
        if count:
            self._count(False)
        known = self._too_large.get(mm_hash)
        if known is not None:
            self._too_large.move_to_end(mm_hash)
            self._inline("too_large", mm_hash, known)
            return None
        try:
            plan = self.store.plan(mm_item[0])
            return self.store.reserve(mm_hash, plan, wait_for_space=wait_for_space)
        except ObjectTooLargeError as exc:
            nbytes = exc.nbytes
            self._too_large[mm_hash] = nbytes
            if len(self._too_large) > _TOO_LARGE_MEMORY:
                self._too_large.popitem(last=False)
            self._inline("too_large", mm_hash, nbytes)
            return None
        except CacheFullError:
            if defer_full:
                raise
            self._inline("full", mm_hash, 0)
            return None

    def _commit_locked(self, res: Reservation, prompt_updates: Sequence[Any]) -> MmItem:
        ref = self.store.commit(res)
        self._prompt_updates[res.key] = prompt_updates
        return ref, prompt_updates

    def _inline(self, cause: str, mm_hash: str, nbytes: int) -> None:
        w = self.store.ring.segment.words
        if cause == "too_large":
            self.inline_too_large += 1
            w[W_INLINE_LARGE] = self.inline_too_large
            msg = "item %s (%d bytes) exceeds max_object_bytes=%d: serving inline, not cached"
            args: tuple[Any, ...] = (mm_hash, nbytes, self.store.max_object_bytes)
        else:
            self.inline_full += 1
            w[W_INLINE_FULL] = self.inline_full
            msg = "cache full (oldest items still owed to readers): serving %s inline"
            args = (mm_hash,)
        if cause not in self._logged:  # one line per cause, not one per request
            self._logged.add(cause)
            log.warning(msg + " (logged once per cause; see snapshot() for counts)", *args)

    def get_and_update(
        self,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
    ) -> list[MmItem]:
        """A whole request: pin every cached hash first, then update each item in order.

        If anything raises, the hand-outs already taken by this call are released.
        """
        if len(mm_items) != len(mm_hashes):
            raise ValueError("mm_items and mm_hashes differ in length")
        hashes = [_check_hash(h) for h in mm_hashes]
        with self.store.lock:
            missing = [
                h for it, h in zip(mm_items, hashes) if it is None and not self.store.is_cached(h)
            ]
            if missing:
                raise CacheMissError(missing)
            out: list[MmItem] = []
            with self.store.pinned(hashes) as pins:
                try:
                    for it, h in zip(mm_items, hashes):
                        cached = self.store.is_cached(h)
                        out.append(self._update_locked(it, h, wait_for_space))
                        if not cached and self.store.pin(h):  # new: protect it from the rest
                            pins.append(h)
                except BaseException:
                    for r in out:
                        if isinstance(r[0], ShmRef):
                            self.store.release(r[0])
                    raise
            return out

    def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]:
        """The same over ``FeatureSpec``s; returns new specs whose data is a ``ShmRef`` or inline.

        A spec whose data is ``None`` (or already a reference) is looked up by its hash.
        """
        items = [_feature_item(f) for f in features]
        results = self.get_and_update(
            items, [f.mm_hash for f in features], wait_for_space=wait_for_space
        )
        return [
            FeatureSpec(f.mm_hash, data, identifier=f.identifier, prompt_updates=tuple(updates))
            for f, (data, updates) in zip(features, results)
        ]

    # --- maintenance ---------------------------------------------------------------------
    def touch_sender_cache_item(self, mm_hash: str) -> bool:
        """Protect a cached item from eviction until its next hand-out."""
        with self.store.lock:
            return self.store.touch(_check_hash(mm_hash))

    touch = touch_sender_cache_item

    def release(self, ref: ShmRef) -> bool:
        """Undo a hand-out whose request failed before reaching the readers."""
        with self.store.lock:
            return self.store.release(ref)

    def invalidate(self, mm_hash: str) -> bool:
        """Forget an item (after a receiver's ``CacheMissError``); the next request re-puts it."""
        with self.store.lock:
            self._prompt_updates.pop(mm_hash, None)
            self._too_large.pop(mm_hash, None)
            return self.store.invalidate(_check_hash(mm_hash))

    def clear_cache(self) -> None:
        """Drop everything; a new epoch makes every older reference stale."""
        with self.store.lock:
            self.store.clear()
            self._prompt_updates.clear()
            self._too_large.clear()

    clear = clear_cache

    def remove_dangling_items(self) -> int:
        """Free every freeable chunk at the head and drop side-table rows of evicted items."""
        with self.store.lock:
            self.store.evict(0)
            dangling = [k for k in self._prompt_updates if not self.store.is_cached(k)]
            for k in dangling:
                del self._prompt_updates[k]
            return len(dangling)

    def cached_order(self) -> list[str]:
        """Cached hashes oldest first (the FIFO eviction order)."""
        return self.store.keys()

    def is_freeable(self, mm_hash: str) -> bool:
        with self.store.lock:
            return self.store.is_freeable(mm_hash)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and total; with ``delta`` the change since the previous delta call."""
        info = CacheInfo(self.hits, self.total)
        if not delta:
            return info
        out = info - self._last_delta
        self._last_delta = info
        return out

    def snapshot(self) -> CacheSnapshot:
        with self.store.lock:
            self.store.drain()
            st = self.store
            return CacheSnapshot(
                name=st.name,
                hits=self.hits,
                misses=self.total - self.hits,
                inline_too_large=self.inline_too_large,
                inline_full=self.inline_full,
                evictions=st.evictions,
                bytes_used=st.ring.used_bytes,
                items=len(st),
                capacity_bytes=st.ring.capacity,
                epoch=st.epoch,
                readers=tuple(st.reader_info()),
            )

    def close(self) -> None:
        """Unlink the segment (idempotent). Readers then see ``WriterGoneError``."""
        with self.store.lock:
            self.store.close()
            self._prompt_updates.clear()

    @property
    def closed(self) -> bool:
        return self.store.closed

    def __enter__(self) -> SenderCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_item(mm_item: MmItem | None) -> MmItem:
    if mm_item is None:  # guarded by the callers; never an assert (python -O)
        raise CacheMissError([])
    if not isinstance(mm_item, tuple) or len(mm_item) != 2:
        raise TypeError("mm_item must be (item, prompt_updates) or None")
    return mm_item


def _feature_item(f: FeatureSpec) -> MmItem | None:
    if not isinstance(f, FeatureSpec):
        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
    _check_hash(f.mm_hash)
    if f.data is None or isinstance(f.data, ShmRef):
        return None
    return (f.data, tuple(f.prompt_updates))


class ReceiverCache:
    """P1: a reader. Attaches to a sender's segment and claims a reader slot."""

    def __init__(self, store: ShmObjectStore) -> None:
        self.store = store
        self._released: dict[tuple[int, int], None] = {}  # hand-outs given back (bounded)
        self.hits = 0
        self.total = 0
        self._last_delta = CacheInfo(0, 0)

    @classmethod
    def attach(
        cls, handle: CacheHandle | str | dict[str, Any], *, serde: Serde | None = None
    ) -> ReceiverCache:
        """Attach by handle (or segment name); ``ReaderLimitError`` if every slot is taken."""
        return cls(ShmObjectStore.from_handle(handle, serde=serde))

    def handle(self) -> CacheHandle:
        return self.store.handle()

    def _plan(self, features: Sequence[FeatureSpec]) -> tuple[list[ShmRef | None], list[str]]:
        """Validate a whole request before reading any of it: refs, and hashes found stale.

        A bad entry (forged reference, wrong type) fails the request, but only after every valid
        reference in it was given back (acknowledged unread): a rejected request owes nothing.
        """
        self.store._check_reader()
        refs: list[ShmRef | None] = []
        stale: list[str] = []
        error: Exception | None = None
        for f in features:
            ref = None
            try:
                if not isinstance(f, FeatureSpec):
                    raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
                _check_hash(f.mm_hash)
                ref = as_reference(f.data)
                if ref is not None:
                    try:
                        self.store.validate(ref)
                    except StaleReferenceError:
                        stale.append(f.mm_hash)
                        self.store.give_back(ref)
                        ref = None
            except (InvalidReferenceError, TypeError) as exc:
                error = error or exc
                ref = None
            refs.append(ref)
        if error is not None:
            self._give_back(refs)
            raise error
        return refs, stale

    def _give_back(self, refs: Sequence[ShmRef | None]) -> None:
        """Acknowledge references that will not be read (the request failed or was cancelled)."""
        for ref in refs:
            if ref is not None:
                self.store.give_back(ref)

    def get_and_update_features(self, features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """Resolve every reference of a request into its item (a copy); returns new specs.

        Features whose data is ``None`` or inline pass through. ``WriterGoneError`` first (a
        dead writer), ``InvalidReferenceError`` at once (forged or foreign), and stale references
        are read around and raised together as one ``CacheMissError`` listing their hashes (its
        ``features`` attribute holds the partial result).
        """
        refs, stale = self._plan(features)
        out: list[FeatureSpec] = []
        i = 0
        try:
            for i, (f, ref) in enumerate(zip(features, refs)):  # noqa: B007 (i used on error)
                self.total += 1
                if ref is None:
                    if as_reference(f.data) is not None:  # stale at validation
                        out.append(f.with_data(None))
                    else:
                        out.append(f.with_data(f.data))
                    continue
                try:
                    data = self.store.get(ref)
                except StaleReferenceError:
                    stale.append(f.mm_hash)
                    out.append(f.with_data(None))
                    continue
                self.hits += 1
                out.append(f.with_data(data))
        except BaseException:
            self._give_back(refs[i:])  # what was not read is owed no more
            raise
        if stale:
            raise CacheMissError(stale, features=out)
        return out

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        """A reference becomes its item (a copy); inline data is returned unchanged.

        A stale reference raises ``StaleReferenceError``.
        """
        _check_hash(mm_hash)
        self.store._check_reader()
        ref = as_reference(mm_item)
        self.total += 1
        if ref is None:
            return mm_item
        data = self.store.get(ref)
        self.hits += 1
        return data

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate a reference without reading it; owes nothing (parity with vLLM)."""
        _check_hash(mm_hash)
        ref = as_reference(mm_item)
        if ref is not None:
            self.store.validate(ref)

    touch = touch_receiver_cache_item

    def release(self, ref: ShmRef) -> bool:
        """Give back a hand-out this reader will not read; False if unknown or already released.

        The writer may then free the chunk (as if the reference had been read). Each hand-out is
        a distinct reference (its ``seq``), so a second release of it is recognised.
        """
        try:
            r = self.store.validate(ref)
        except (InvalidReferenceError, StaleReferenceError):
            return False
        key = (r.id, r.seq)
        if key in self._released:
            return False
        self._released[key] = None
        if len(self._released) > 65536:
            self._released.pop(next(iter(self._released)))
        self.store.give_back(r)
        return True

    @contextlib.contextmanager
    def lease(self, features: Sequence[FeatureSpec]) -> Iterator[list[FeatureSpec]]:
        """Zero-copy read: arrays are read-only views into shared memory for the block.

        The hand-outs stay owed (the writer cannot reuse the bytes) until the block exits; then
        each is re-verified and acknowledged. Do not keep the arrays past the block.
        """
        refs, stale = self._plan(features)
        if stale:
            self._give_back(refs)
            raise CacheMissError(stale)
        out: list[FeatureSpec] = []
        held: list[ShmRef] = []
        try:
            for i, (f, ref) in enumerate(zip(features, refs)):
                if ref is None:
                    out.append(f.with_data(f.data))
                    continue
                try:
                    out.append(f.with_data(self.store.get(ref, copy=False)))
                except BaseException:
                    self._give_back(refs[i:])
                    raise
                held.append(ref)
            yield out
        finally:
            out.clear()
            errors: list[BaseException] = []
            for ref in held:
                try:
                    self.store.ack(ref)
                except Exception as exc:  # keep acknowledging the others
                    errors.append(exc)
            if errors:
                raise errors[0]

    def clear_cache(self) -> None:
        """Drop local state (the receiver keeps no item copies)."""
        self.hits = 0
        self.total = 0
        self._last_delta = CacheInfo(0, 0)

    clear = clear_cache

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """References resolved (hits) of features seen (total); ``delta`` as on the sender."""
        info = CacheInfo(self.hits, self.total)
        if not delta:
            return info
        out = info - self._last_delta
        self._last_delta = info
        return out

    def close(self) -> None:
        """Free the reader slot (idempotent)."""
        self.store.close()

    @property
    def closed(self) -> bool:
        return self.store.closed

    def __enter__(self) -> ReceiverCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
