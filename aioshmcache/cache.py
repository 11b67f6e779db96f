"""Layer 6: the P0 sender cache (the writer) and the P1 receiver cache (a reader).

The sender answers repeated multimodal items (same ``mm_hash``) from its index with a new
hand-out of the cached chunk, puts new ones, and serves inline what cannot be cached (too large,
or no room even after eviction). Each request pins its own cached items for the length of the
call, so it never evicts what it is about to hand out (vLLM issue 26195). The receiver turns
references back into items: it validates every reference of a request first, reads each one,
verifies it and only then acknowledges it, and reports stale ones together as one
``CacheMissError`` (the drift signal: the sender answers with ``invalidate`` and a resend).

A request's algorithm lives in ``_request`` (``SenderRequest``, ``ReceiverRequest``) as explicit
steps; these classes run the steps inline, the asyncio twins in ``aio`` run the very same steps
and only choose where the copy jobs run.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, TypeVar, overload

from . import _request
from ._group import Siblings, open_shard
from ._group_receiver import GroupReceiverRequest, GroupShards
from ._layout import check_group
from ._receiver_request import ReceiverRequest, read_one, read_one_feature
from ._request import (
    DEFAULT_INLINE_THRESHOLD,
    MmItem,
    RequestCounters,
    SenderBook,
    SenderRequest,
    as_reference,
    check_hash,
    feature_item,
    features_from,
    run_one,
)
from ._serde import Serde
from ._store import SYNC_ONE_STEP_PUT_UNDER, ShmObjectStore, StoreWriter
from ._store_reader import StoreReader
from ._types import (
    CacheConfig,
    CacheHandle,
    CacheInfo,
    CacheSnapshot,
    FeatureSpec,
    ShmRef,
    coerce_handle,
)
from .errors import (
    ClosedCacheError,
    InvalidReferenceError,
    ReaderLimitError,
    StaleReferenceError,
    WriterGoneError,
)

__all__ = [
    "GroupReceiverCache",
    "MmItem",
    "Receiver",
    "ReceiverCache",
    "SenderCache",
    "as_reference",
]

log = logging.getLogger("aioshmcache")


class ReadRequest(Protocol):
    """The steps of a receiver's read (a ``ReceiverRequest``, or a group's)."""

    @property
    def has_jobs(self) -> bool: ...
    def begin(self) -> None: ...
    def run_jobs(self) -> None: ...
    def abandon(self) -> None: ...
    def finish(self) -> list[FeatureSpec]: ...
    def finish_item(self) -> Any: ...
    def settle_lease(self) -> None: ...


#: The sync receivers' ``copy_inline_below``: every reference is read in the step that validated
#: it. They run every step on the calling thread, so a read job (which looks its chunk up again
#: when it runs, as it must when the async face runs it later in a worker thread) would only add
#: a second look-up and its steps: ~350 bytecodes per big read.
_READ_IN_BEGIN: Final = 1 << 63


def _run_inline(request: ReadRequest) -> None:
    """The sync face of a request: every step on the calling thread; abandon on any error."""
    try:
        request.begin()
        if request.has_jobs:
            request.run_jobs()
    except BaseException:
        request.abandon()
        raise


def kept_form(mm_item: MmItem | None) -> MmItem | None:
    """``mm_item`` with a ``list`` of prompt updates as a ``tuple``: what the sender keeps.

    The sender keeps each cached item's prompt updates until the item leaves. A list is a
    container the garbage collector tracks for as long as it lives, and every full collection
    walks each one: 200,000 cached items keeping the caller's ``[]`` made one ``gc.collect()``
    take 40 ms, a stall of a put in the first lap. A tuple of atoms (str, int, ...) is untracked
    by CPython at the first collection that sees it, and an empty one is the shared ``()``, so
    entries keep no tracked object. (Updates that are themselves objects, such as vLLM's
    ``ResolvedPromptUpdate``, are packed by the sender's book into one flat tuple of atoms,
    untracked too: ``_kept``.) Anything else is unchanged.
    """
    if type(mm_item) is tuple and len(mm_item) == 2 and type(mm_item[1]) is list:
        return (mm_item[0], tuple(mm_item[1]))
    return mm_item


def as_given(given: MmItem | None, sent: MmItem | None, out: MmItem) -> MmItem:
    """A request's result for ``given`` (sent as ``sent = kept_form(given)``), as the caller
    passed it: an item served inline is ``given`` itself, a put or a hit of a given item carries
    the caller's own updates, and a look-up (``given`` is None) the kept ones as a new list, the
    type vLLM's callers pass (the features path gives tuples)."""
    if out is sent:  # served inline
        return given if given is not None else out
    if given is None:
        u = out[1]
        return (out[0], list(u)) if type(u) is tuple else out
    return out if sent is given else (out[0], given[1])


def kept_forms(mm_items: list[MmItem | None]) -> list[MmItem | None]:
    """``kept_form`` of each item: ``mm_items`` itself when none changes (the usual case)."""
    sent = mm_items
    for i, it in enumerate(mm_items):
        if type(it) is tuple and len(it) == 2 and type(it[1]) is list:
            if sent is mm_items:
                sent = list(mm_items)
            sent[i] = (it[0], tuple(it[1]))
    return sent


def all_as_given(
    given: list[MmItem | None], sent: list[MmItem | None], out: list[MmItem]
) -> list[MmItem]:
    """``as_given`` of each result, in ``out`` (the request's own new list; the lengths match:
    the request checked). Nothing to do when no item changed and none was a look-up."""
    if sent is given and None not in given:
        return out
    for i, o in enumerate(out):
        g = given[i]
        if g is None:  # a look-up (``as_given``'s case, inline): its updates as a new list
            u = o[1]
            if type(u) is tuple:
                out[i] = (o[0], list(u))
        else:
            out[i] = as_given(g, sent[i], o)
    return out


class _Lease:
    """The context manager of ``ReceiverCache.lease`` (a class: a generator's costs ~1 us more).

    As a ``with`` block: the request begins on entry (a failure abandons it, nothing is leased),
    the views are dropped and every hand-out settled on exit, whatever the block raised.
    """

    __slots__ = ("_cache", "_entered", "_features", "_out", "_req")

    def __init__(self, cache: Receiver, features: Sequence[FeatureSpec]) -> None:
        self._cache = cache
        self._features = features
        self._req: ReadRequest | None = None
        self._out: list[FeatureSpec] = []
        self._entered = False

    def __enter__(self) -> list[FeatureSpec]:
        if self._entered:
            raise RuntimeError("a lease is entered once")
        self._entered = True
        req = self._req = self._cache._request(self._features, copy=False)
        try:
            req.begin()
            out = req.finish()
        except BaseException:
            req.abandon()
            raise
        self._out = out
        return out

    def __exit__(self, *exc: object) -> None:
        self._out.clear()
        if self._req is not None:
            self._req.settle_lease()


_C = TypeVar("_C", bound="_Counted")


class _Counted(abc.ABC):
    """What every cache shares: counters, ``make_stats``, lifetime as ``with``."""

    _counters: RequestCounters
    _last_delta: CacheInfo

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and total; with ``delta`` the change since the previous delta call.

        Sender: items answered from the cache of items asked for. Receiver: references
        resolved into items of features seen.
        """
        with self._counters.lock:
            info = CacheInfo(self._counters.hits, self._counters.total)
        if not delta:
            return info
        out = info - self._last_delta
        self._last_delta = info
        return out

    @abc.abstractmethod
    def close(self) -> None:
        """Close the cache (idempotent)."""

    def __enter__(self: _C) -> _C:
        """Enter ``with``: the cache itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Leave ``with``: ``close()``."""
        self.close()


class _Cache(_Counted):
    """What the caches of one segment share: the store and its handle."""

    store: ShmObjectStore

    def handle(self) -> CacheHandle:
        """The segment's handle: what a reader needs to attach (picklable, JSON-friendly)."""
        return self.store.handle()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self.store.closed


class SenderCache(_Cache):
    """P0: the writer. Creates and owns the segment; ``close`` unlinks it."""

    store: StoreWriter

    def __init__(self, config: CacheConfig, *, serde: Serde | None = None) -> None:
        """Create the segment ``config`` describes (``SegmentExistsError`` if its name is taken
        by a live writer); ``serde`` replaces the default ``MsgpackSerde``."""
        self.config = config
        self.shard: int | None = None
        siblings: Siblings | None = None
        if config.group is None:
            self.store = ShmObjectStore.create(config, serde=serde)
        else:
            self.store, self.shard = open_shard(config, serde=serde)
            siblings = Siblings(config.group, self.store.name)
        self._book = SenderBook(
            self.store, default_wait_for_space=config.wait_for_space, siblings=siblings
        )
        self._siblings = siblings
        self._prompt_updates = self._book.prompt_updates
        self._too_large = self._book.too_large
        self._counters = self._book.counters
        self.store.on_evict = self._book.forget
        self._last_delta = CacheInfo(0, 0)

    @property
    def inline_busy(self) -> int:
        """Items served inline because another request was putting the same hash."""
        return self._counters.inline_busy

    @overload  # a str is a Sequence[str] too: this first overload wins for it
    def is_cached(self, mm_hash: str, *, rescan: bool = False) -> bool: ...  # type: ignore[overload-overlap]

    @overload
    def is_cached(self, mm_hash: Sequence[str], *, rescan: bool = False) -> list[bool]: ...

    def is_cached(self, mm_hash: str | Sequence[str], *, rescan: bool = False) -> bool | list[bool]:
        """Pure look-up: no hand-out, no change to eviction order. One hash gives a bool, a list
        of hashes a list of bools (vLLM's ``is_cached`` shape).

        In a group shard, also true when a live sibling shard holds the item (its chunk checked,
        not copied) in a chunk this shard can hold: a request passing ``None`` for it then
        copies it into this shard (or, with no room here, serves it inline). One over this
        shard's ``max_object_bytes`` is not cached here (a look-up of it is a plain miss, so the
        caller sends the data).
        ``rescan``: look for sibling shards opened since the last scan first (otherwise one is
        seen up to ``RESCAN_INTERVAL`` later): the last look of a group single-flight claim,
        whose "not cached" means "compute it here".
        """
        if isinstance(mm_hash, str):
            return self._is_cached(mm_hash, rescan)
        if not isinstance(mm_hash, Sequence):
            raise TypeError(f"mm_hash must be a str or a list of str, not {type(mm_hash).__name__}")
        return [self._is_cached(h, rescan) for h in mm_hash]

    def _is_cached(self, mm_hash: str, rescan: bool) -> bool:
        self.store.check_owner()
        if self.store.is_cached(check_hash(mm_hash)):
            return True
        sib = self._siblings
        if sib is None:
            return False
        found = sib.find(mm_hash, rescan=rescan)
        # what a look-up would copy (``SenderRequest._in_sibling``): none over our limit
        return found is not None and found.ref.length <= self.store.max_object_bytes

    @property
    def group(self) -> str | None:
        """The cache group this writer is a shard of (None for a plain cache)."""
        return self.config.group

    @property
    def name(self) -> str:
        """The segment's name (``aioshm-...``)."""
        return self.store.name

    def _request(
        self,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
        _fresh: bool = False,
    ) -> SenderRequest:
        """A request as steps (``begin``, ``run_jobs``, ``finish`` or ``abandon``).

        For drivers such as the asyncio facade, which choose where ``run_jobs`` runs; the
        methods below run all the steps inline. ``_fresh``: the lists are the caller's own,
        made for this request (kept, not copied).
        """
        self.store.check_owner()
        return SenderRequest(
            self.store,
            self._book,
            mm_items,
            mm_hashes,
            wait_for_space=wait_for_space,
            copy_inline_below=copy_inline_below,
            _fresh=_fresh,
        )

    def _features_request(
        self,
        features: Sequence[FeatureSpec],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> SenderRequest:
        """``_request`` over ``FeatureSpec``s; end it with ``finish_features``."""
        self.store.check_owner()
        return SenderRequest.for_features(
            self.store,
            self._book,
            features,
            wait_for_space=wait_for_space,
            copy_inline_below=copy_inline_below,
        )

    def _put_one(self, sent: MmItem | None, mm_hash: str, inline_below: int) -> MmItem | None:
        """The core's one-item call (``run_one``'s first step: a miss, a hit or a look-up) for
        an item in the kept form: its result, or None, declined before any side effect (then a
        request runs)."""
        return _request._put_item(self.store, self._book, sent, mm_hash, inline_below)

    def get_and_update_item(
        self, mm_item: MmItem | None, mm_hash: str, *, wait_for_space: float | None = None
    ) -> MmItem:
        """One item: a hit or a put gives ``(ShmRef, prompt_updates)``; else the input, inline.

        ``mm_item`` is ``(item, prompt_updates)`` or ``None`` (the caller believes it is cached:
        ``CacheMissError`` if not). A given item comes back with the caller's own prompt
        updates; a look-up (``None``) gives the kept ones, equal to those the item was put with,
        as a new list (they are kept as a tuple, which the garbage collector need not track).
        """
        if (
            wait_for_space is None
            and type(mm_item) is tuple
            and len(mm_item) == 2
            and type(mm_item[1]) is tuple
        ):
            # run_one's first step, without its frame and the conversions (an item given with
            # its updates as a tuple is sent as it is, and its result needs no conversion):
            # the core's one-item miss (``_put_one``'s call, without that frame either);
            # declined, the request runs as in run_one
            done = _request._put_item(
                self.store, self._book, mm_item, mm_hash, SYNC_ONE_STEP_PUT_UNDER
            )
            if done is not None:
                return done
            return SenderRequest(self.store, self._book, [mm_item], [mm_hash], _fresh=True).run()[0]
        sent = kept_form(mm_item)
        out = run_one(self.store, self._book, sent, mm_hash, wait_for_space=wait_for_space)
        return as_given(mm_item, sent, out)

    def get_and_update(
        self,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
    ) -> list[MmItem]:
        """A whole request: pin every cached hash first, then update each item in order.

        ``wait_for_space`` (seconds, default the config's) bounds the whole call. If anything
        raises, everything the call took is given back (hand-outs, allocations, pins).
        """
        given = mm_items if type(mm_items) is list else list(mm_items)
        if len(given) == 1 and type(mm_hashes) in (list, tuple) and len(mm_hashes) == 1:
            # one item: the one-item call's path (the same algorithm: ``run_one``)
            return [self.get_and_update_item(given[0], mm_hashes[0], wait_for_space=wait_for_space)]
        sent = kept_forms(given)
        out = self._request(sent, mm_hashes, wait_for_space=wait_for_space).run()
        return all_as_given(given, sent, out)

    def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]:
        """The same over ``FeatureSpec``s; returns new specs whose data is a ``ShmRef`` or inline.

        A spec whose data is ``None`` (or already a reference) is looked up by its hash.
        """
        if wait_for_space is None and type(features) is list and len(features) == 1:
            # one spec: the core's one-item call first (``run_one``'s first step: a miss, a
            # hit, or a look-up when its data is None or a reference); declined before any
            # side effect, the request runs
            f = features[0]
            item = feature_item(f)  # checks the spec and its hash, as the request does
            done = self._put_one(item, f.mm_hash, SYNC_ONE_STEP_PUT_UNDER)
            if done is not None:
                return features_from(features, [done])
        return SenderRequest.for_features(
            self.store, self._book, features, wait_for_space=wait_for_space
        ).run_features()

    def touch(self, mm_hash: str) -> bool:
        """Protect a cached item from eviction until its next hand-out; False if not cached."""
        self.store.check_owner()
        with self.store.lock:
            return self.store.touch(check_hash(mm_hash))

    def release(self, ref: ShmRef) -> bool:
        """Undo a hand-out whose request failed before reaching the readers."""
        self.store.check_owner()
        with self.store.lock:
            return self.store.release(ref)

    def invalidate(self, mm_hash: str) -> bool:
        """Forget an item (after a receiver's ``CacheMissError``); the next request re-puts it.

        False if ``mm_hash`` was not cached. The guarantee: from now on no request is given the
        old copy (the next one for ``mm_hash`` is a miss and puts a new one). References handed
        out *before* stay valid: each is still owed by its readers, so it reads the item it was
        made for, and the old chunk is freed once every hand-out of it is acknowledged (or
        expires by the usual rules). A reference becomes stale only when its chunk is freed
        (nothing owed for it any more), on ``clear``, when a one-of-N hand-out outlives
        ``handout_ttl`` or when its reader was evicted. Revoking outstanding references here
        would only turn reads that are correct (same hash, same bytes) into misses and resends.
        """
        self.store.check_owner()
        with self.store.lock:
            self._prompt_updates.pop(mm_hash, None)
            self._too_large.discard(mm_hash)
            key = check_hash(mm_hash)
            if self._siblings is not None:  # a sibling's copy is the old item too
                self._siblings.withhold(key)
            return self.store.invalidate(key)

    def clear(self) -> None:
        """Drop everything; a new epoch makes every older reference stale."""
        self.store.check_owner()
        with self.store.lock:
            self.store.clear()
            self._prompt_updates.clear()
            self._too_large.clear()

    def remove_dangling_items(self) -> int:
        """Free every freeable chunk at the head and drop side-table rows of evicted items."""
        self.store.check_owner()
        with self.store.lock:
            self.store.evict(0)
            dangling = [k for k in self._prompt_updates if not self.store.is_cached(k)]
            for k in dangling:
                del self._prompt_updates[k]
            return len(dangling)

    def cached_order(self) -> list[str]:
        """Cached hashes oldest first (the FIFO eviction order)."""
        self.store.check_owner()
        with self.store.lock:
            return self.store.keys()

    def is_freeable(self, mm_hash: str) -> bool:
        """Whether the item's chunk could be evicted now (debts of dead readers dropped)."""
        self.store.check_owner()
        with self.store.lock:
            return self.store.is_freeable(mm_hash)

    def snapshot(self) -> CacheSnapshot:
        """What an operator watches: counters, usage and every reader slot."""
        self.store.check_owner()
        with self.store.lock:
            self.store.drain()
            st, c = self.store, self._counters
            return CacheSnapshot(
                name=st.name,
                hits=c.hits,
                misses=c.total - c.hits,
                inline_too_large=c.inline_too_large,
                inline_full=c.inline_full,
                inline_busy=c.inline_busy,
                wait_for_space_seconds=c.wait_seconds,
                sibling_hits=c.sibling_hits,
                group=self.config.group,
                shard=self.shard,
                evictions=st.evictions,
                relocations=st.relocations,
                bytes_relocated=st.bytes_relocated,
                bytes_used=st.ring.used_bytes,
                items=len(st),
                capacity_bytes=st.ring.capacity,
                epoch=st.epoch,
                readers=tuple(st.reader_info()),
            )

    def stop_waits(self) -> None:
        """Wake every request waiting for space and fail it, and any later wait, with
        ``ClosedCacheError`` (``StoreWriter.stop_waits``): the first step of a close that lets
        the requests in progress finish (``AsyncSenderCache.aclose``)."""
        self.store.stop_waits()

    def close(self) -> None:
        """Unlink the segment (idempotent). Readers then see ``WriterGoneError``. A call in
        another thread ends first (the close takes the writer lock); a forked child's copy
        closes at once (it unlinks nothing)."""
        with contextlib.nullcontext() if self.store.forked else self.store.lock:
            self.store.close()
            self._prompt_updates.clear()
        if self._siblings is not None:
            self._siblings.close()


class Receiver(_Counted):
    """What every reader offers, one segment's (``ReceiverCache``) or a group's
    (``GroupReceiverCache``): type code with it to take either.

    The read methods (``get_and_update_features``, ``get_and_update_item``, ``lease``), ``touch``,
    ``release``, ``clear``, ``make_stats``, ``close``, ``closed`` and ``with``. What only one
    kind has is on its own class: a segment's ``handle()`` and ``store``, a group's
    ``shard_handles()`` and ``rescan()``.
    """

    @abc.abstractmethod
    def _request(
        self,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> ReadRequest:
        """A read as steps, over this reader's store or shards."""

    @abc.abstractmethod
    def touch(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate a reference without reading it; owes nothing."""

    def get_and_update_features(self, features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """Resolve every reference of a request into its item (a copy); returns new specs.

        Features whose data is ``None`` or inline pass through. ``WriterGoneError`` first (a
        dead writer), ``InvalidReferenceError`` at once (forged or foreign), and stale references
        are read around and raised together as one ``CacheMissError`` listing their hashes (its
        ``features`` attribute holds the partial result). Any failure gives back every reference
        of the request that was not read: a failed read owes nothing.
        """
        req = self._request(features, copy_inline_below=_READ_IN_BEGIN)
        _run_inline(req)
        return req.finish()

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        """A reference becomes its item (a copy); inline data is returned unchanged.

        A stale reference raises ``StaleReferenceError``.
        """
        req = self._item_request(mm_item, mm_hash, _READ_IN_BEGIN)  # ``begin`` checks the hash
        _run_inline(req)
        return req.finish_item()

    def _item_request(self, mm_item: Any, mm_hash: str, copy_inline_below: int) -> ReadRequest:
        """The request of ``get_and_update_item``: ``_request`` of one spec (of ``mm_hash``)."""
        return self._request([FeatureSpec(mm_hash, mm_item)], copy_inline_below=copy_inline_below)

    def lease(
        self, features: Sequence[FeatureSpec]
    ) -> contextlib.AbstractContextManager[list[FeatureSpec]]:
        """Zero-copy read: arrays are read-only views into shared memory for the block.

        The hand-outs stay owed (the writer cannot reuse the bytes) until the block exits; then
        each is re-verified and acknowledged. Do not keep the arrays past the block. A stale
        reference raises ``CacheMissError`` before the block (nothing is leased then).
        """
        return _Lease(self, features)

    def clear(self) -> None:
        """Drop local state (the receiver keeps no item copies): its counters restart."""
        with self._counters.lock:
            self._counters.hits = self._counters.total = 0
        self._last_delta = CacheInfo(0, 0)

    @abc.abstractmethod
    def release(self, ref: ShmRef) -> bool:
        """Give back a hand-out this reader will not read; False if unknown or already released,
        or if its writer is gone (nothing is owed to it)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether ``close`` was called."""


class ReceiverCache(_Cache, Receiver):
    """P1: a reader. Attaches to a sender's segment and claims a reader slot."""

    store: StoreReader

    def __init__(self, store: StoreReader) -> None:
        """Wrap an attached reader store; use ``ReceiverCache.attach(handle)`` instead."""
        self.store = store
        self._released: dict[tuple[int, int], None] = {}  # hand-outs given back (bounded)
        self._counters = RequestCounters()
        self._last_delta = CacheInfo(0, 0)
        #: ``_receiver_request.read_one_feature`` on this reader, ``(features, inline_below)``:
        #: the new spec, or None (the request must run; nothing done). Bound once: an engine
        #: worker's every call takes it, and a method around it was one Python frame more.
        self._read_one_feature: Callable[[Sequence[FeatureSpec], int], list[FeatureSpec] | None]
        self._read_one_feature = functools.partial(
            read_one_feature, store, store.read_path, self._counters
        )

    @classmethod
    def attach(cls, handle: object, *, serde: Serde | None = None) -> ReceiverCache:
        """Attach as a reader and claim a reader slot.

        ``handle`` is a ``CacheHandle``, its dict, its JSON string (``CacheHandle.to_json``) or
        a bare segment name; anything else is a ``TypeError`` that says what it got. A handle
        carries the segment's nonce, so attaching by handle also checks that it is the same
        segment instance (a name alone cannot). ``ReaderLimitError`` if every slot is taken.
        """
        return cls(ShmObjectStore.from_handle(coerce_handle(handle), serde=serde))

    @classmethod
    def attach_group(
        cls, group: str, *, serde: Serde | None = None, wait_for_shard: float | None = 0.0
    ) -> GroupReceiverCache:
        """Attach as a reader of every shard of cache group ``group`` (see ``GroupReceiverCache``).

        Claims a reader slot on each live shard now (``ReaderLimitError`` if one has none
        left); shards that appear later are attached when a reference names them.

        ``wait_for_shard``: seconds to wait for the group's first shard (``0``, the default:
        look once); ``SegmentNotFoundError`` if there is none by then, so a mistyped group name
        fails here rather than at the first request. ``None`` accepts a group with no shard
        yet, for an engine worker started before its gateways (shards are attached as their
        references arrive).
        """
        return GroupReceiverCache(group, serde=serde, wait_for_shard=wait_for_shard)

    def _request(
        self,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> ReadRequest:
        """A read as steps (``begin``, ``run_jobs``, ``finish`` or ``abandon``), for drivers.

        ``copy=False`` reads zero-copy views that stay owed until ``settle_lease``.
        """
        return ReceiverRequest(
            self.store,
            self._counters,
            features,
            copy=copy,
            copy_inline_below=copy_inline_below,
        )

    def get_and_update_features(self, features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """As ``Receiver.get_and_update_features``. (One spec of a plain item in one core call,
        ``_receiver_request.read_one_feature``; anything else by the request.)"""
        got = self._read_one_feature(features, _READ_IN_BEGIN)
        if got is not None:
            return got
        return super().get_and_update_features(features)

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        """A reference becomes its item (a copy); inline data is returned unchanged.

        A stale reference raises ``StaleReferenceError``. (A plain item in one core call,
        ``_receiver_request.read_one``; anything else by the request.)
        """
        value = read_one(self.store, self._counters, mm_item, mm_hash)
        if value is not None:
            return value
        return super().get_and_update_item(mm_item, mm_hash)

    def _item_request(self, mm_item: Any, mm_hash: str, copy_inline_below: int) -> ReadRequest:
        """``_request`` of one spec, without building the spec (``ReceiverRequest.for_item``)."""
        return ReceiverRequest.for_item(
            self.store, self._counters, mm_item, mm_hash, copy_inline_below
        )

    def touch(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate a reference without reading it; owes nothing. ``WriterGoneError`` first,
        as a read (the writer closed or died: its item can no longer be read)."""
        check_hash(mm_hash)
        ref = as_reference(mm_item)
        if ref is not None:
            self.store.check_writer()
            self.store.validate(ref)

    def release(self, ref: ShmRef) -> bool:
        """Give back a hand-out this reader will not read; False if unknown or already released,
        or if its writer closed or died (nothing is owed to a writer that is gone).

        The writer may then free the chunk (as if the reference had been read). Each hand-out is
        a distinct reference (its ``seq``), so a second release of it is recognised.
        """
        try:
            r = self.store.validate(ref)
            self.store.check_writer()  # gone: there is no hand-out left to give back
        except (InvalidReferenceError, StaleReferenceError, WriterGoneError):
            return False
        key = (r.id, r.seq)
        if key in self._released:
            return False
        self._released[key] = None
        if len(self._released) > 65536:
            self._released.pop(next(iter(self._released)))
        self.store.release(r)
        return True

    def close(self) -> None:
        """Free the reader slot (idempotent; safe while other threads read).

        Reads that start after it raise ``ClosedCacheError``. Reads already in flight in other
        threads finish first: the slot and the mapping are released once the last of them
        ends (waiting up to ``CLOSE_WAIT`` s here, else by that last read as it leaves).
        """
        self.store.close_when_idle()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (reads refused; the release may wait for reads)."""
        return self.store.read_path.closed or self.store.closed


class GroupReceiverCache(Receiver):
    """A reader of a whole cache group (``ReceiverCache.attach_group(name)``).

    The read methods of ``ReceiverCache`` (shared, not inherited: a group has no single store,
    segment or handle, so it offers none of those). Each reference is read from the shard that
    issued it (its nonce names the shard instance); a reference whose shard's writer is gone raises
    ``WriterGoneError`` (with ``mm_hashes`` and the partial ``features``) after the request's
    other references were read; one naming no shard of the group is ``InvalidReferenceError``;
    stale ones are one ``CacheMissError`` as for a single cache. ``shard_handles()`` lists the
    handles of the shards it reads.
    """

    def __init__(
        self, group: str, *, serde: Serde | None = None, wait_for_shard: float | None = 0.0
    ) -> None:
        """Attach to ``group``'s live shards; use ``ReceiverCache.attach_group`` instead."""
        if wait_for_shard is not None and (
            type(wait_for_shard) not in (int, float) or not 0 <= wait_for_shard < float("inf")
        ):
            raise ValueError(f"wait_for_shard must be None or seconds >= 0, got {wait_for_shard!r}")
        self.group = check_group(group)
        self._shards = GroupShards(group, serde=serde)
        self._group_released: dict[tuple[int, int, int], None] = {}
        self._counters = RequestCounters()
        self._last_delta = CacheInfo(0, 0)
        try:
            if wait_for_shard is None:
                self._shards.rescan()
            else:
                self._shards.wait_for_member(wait_for_shard)
        except BaseException:
            self._shards.close()
            raise

    def shard_handles(self) -> list[CacheHandle]:
        """The handles of the shards this reader is attached to now."""
        return [s.handle() for s in self._shards.stores()]

    def rescan(self) -> None:
        """Attach to new shards and detach from dead ones now (also done on demand)."""
        self._shards.rescan()

    def _request(
        self,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> ReadRequest:
        """A read over the group, as steps (see ``ReceiverCache._request``)."""
        return GroupReceiverRequest(
            self._shards, self._counters, features, copy=copy, copy_inline_below=copy_inline_below
        )

    def _route(self, ref: object) -> tuple[StoreReader, ShmRef] | None:
        r = as_reference(ref)
        if r is None:
            return None
        if self._shards.store(r.nonce) is None and not self._shards.is_gone(r.nonce):
            self._shards.rescan(strict=False)
        store = self._shards.route(r)
        return store, store.validate(r)

    def touch(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate a reference against its shard without reading it; owes nothing.
        ``WriterGoneError`` if the shard's writer closed or died, as a read (listing
        ``mm_hash``)."""
        h = check_hash(mm_hash)
        try:
            routed = self._route(mm_item)
            if routed is not None:
                routed[0].check_writer()
        except WriterGoneError as exc:
            if exc.mm_hashes:
                raise
            raise WriterGoneError(
                f"the shard writer of 1 item(s) is gone: {h}", mm_hashes=(h,)
            ) from exc

    def release(self, ref: ShmRef) -> bool:
        """Give back a hand-out this reader will not read; False if unknown or released, or if
        its shard's writer closed or died (nothing is owed to a writer that is gone).
        ``ClosedCacheError`` once this reader is closed, as a plain reader's."""
        if self.closed:
            raise ClosedCacheError("the group reader is closed")
        try:
            routed = self._route(ref)
            if routed is not None:
                routed[0].check_writer()  # gone: there is no hand-out left to give back
        except (InvalidReferenceError, StaleReferenceError, WriterGoneError, ReaderLimitError):
            return False  # (a shard it cannot attach: it never was handed that reference)
        except ClosedCacheError:
            if self.closed:
                raise
            return False  # its shard detached meanwhile (the writer seen gone by another thread)
        if routed is None:
            return False
        store, r = routed
        key = (r.nonce, r.id, r.seq)
        if key in self._group_released:
            return False
        self._group_released[key] = None
        if len(self._group_released) > 65536:
            self._group_released.pop(next(iter(self._group_released)))
        store.release(r)
        return True

    def close(self) -> None:
        """Free the reader slot of every shard (idempotent)."""
        self._shards.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._shards.closed
