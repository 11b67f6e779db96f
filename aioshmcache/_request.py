"""Layer 6: one request's algorithm, written once, as explicit steps both faces run.

A request of the sender (``SenderRequest``) or of a receiver (``ReceiverRequest``) goes through
the same four steps whichever face drives it:

1. ``begin()`` — short and synchronous: validate, pin, hand out hits, reserve misses, do the
   small copies (under ``copy_inline_below`` bytes) at once;
2. ``run_jobs()`` — the work that may run anywhere: the big copies, waiting for space. The sync
   caches call it inline; the async facade calls it in a worker thread when there is any;
3. ``finish()`` — commit what is left, unpin, return the result;
4. or ``abandon()`` — roll back: abort every allocation, give back every hand-out taken, unpin.

``abandon`` is safe from any thread at any time, which is what makes the async facade
cancellation-safe without knowing anything of the store: if the jobs are running (a cancelled
task's thread runs on), the thread itself rolls back when it ends; if they never started, the
caller rolls back at once and the thread, if it starts later, does nothing. Either way the roll
back happens exactly once, and so is every pin undone exactly once (pins belong to entries, not
keys: after a wait that let go of the lock, a key may name a new entry).

Counters (hits, totals, inline serves) are kept here, identically for both faces, and are only
changed under a lock, so a step that runs in a thread counts like one that runs on the loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from ._group import Found, Siblings
from ._layout import H_HITS, H_INLINE_FULL, H_INLINE_LARGE, H_MISSES, H_SIBLING_HITS
from ._readers import ReaderSlot
from ._store import INLINE_COPY_UNDER_LOCK, Reservation, ShmObjectStore
from ._types import REF_FIELDS, FeatureSpec, ShmRef
from .errors import (
    CacheFullError,
    CacheMissError,
    ClosedCacheError,
    InvalidReferenceError,
    ObjectTooLargeError,
    ShmCacheError,
    StaleReferenceError,
)

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "MmItem",
    "ReceiverRequest",
    "RequestCounters",
    "SenderBook",
    "SenderRequest",
    "as_reference",
    "check_hash",
    "single_item",
]

#: Copies below this size run where the request began (on the loop, for the async facade).
#: Measured by ``bench`` on this machine: a thread hop costs 75-170 us, a warm 1 MiB copy
#: ~40 us, so copies under 1 MiB are cheaper inline and keep loop lag below ~0.1 ms.
DEFAULT_INLINE_THRESHOLD: Final = 1 << 20

_REF_KEYS: Final = frozenset(REF_FIELDS)

log = logging.getLogger("aioshmcache")

MmItem = tuple[Any, Sequence[Any]]


def check_hash(mm_hash: object) -> str:
    """``mm_hash`` if it is a ``str``, else ``TypeError``."""
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


def check_wait(wait: object) -> float:
    """A ``wait_for_space`` value as seconds, or ``ValueError``."""
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise ValueError("wait_for_space must be a number of seconds")
    if not (math.isfinite(wait) and wait >= 0):
        raise ValueError("wait_for_space must be a finite number of seconds >= 0")
    return float(wait)


@dataclass
class RequestCounters:
    """What the requests of one cache counted, changed only under ``lock``.

    ``inline_too_large`` / ``inline_full`` / ``inline_busy``: items served inline because they
    exceed ``max_object_bytes``, because there was no room, or because another request was
    putting the same hash at that moment.
    """

    hits: int = 0
    total: int = 0
    inline_too_large: int = 0
    inline_full: int = 0
    inline_busy: int = 0
    sibling_hits: int = 0  # group shards: items copied from a sibling (also counted as hits)
    wait_seconds: float = 0.0  # time spent waiting for space, summed over requests
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """Every counter, read together."""
        with self.lock:
            return (
                self.hits,
                self.total,
                self.inline_too_large,
                self.inline_full,
                self.inline_busy,
            )

    def add(self, *, hits: int = 0, total: int = 0) -> None:
        """Count hits and items seen (takes the lock: safe from any thread)."""
        lock = self.lock
        lock.acquire()  # not ``with``: 0.27 -> 0.10 us, once per request
        try:
            self.hits += hits
            self.total += total
        finally:
            lock.release()


class SenderBook:
    """The sender's side tables and counters, kept by its requests (under the store lock).

    Prompt updates stay in the writer process only; hashes found too large are remembered so
    they are not serialised again; counters are published to the segment for ``inspect``.
    """

    def __init__(
        self,
        store: ShmObjectStore,
        *,
        default_wait_for_space: float = 0.0,
        siblings: Siblings | None = None,
    ) -> None:
        self.store = store
        self.siblings = siblings  # the other shards of the group, if this cache is a shard
        self.default_wait_for_space = default_wait_for_space
        self.prompt_updates: dict[str, Sequence[Any]] = {}
        self.too_large = TooLargeMemory()
        self.counters = RequestCounters(lock=store.lock)
        self._words = store.ring.segment.words
        self._logged: set[str] = set()

    def forget(self, mm_hash: str) -> None:
        """An item left the cache: drop its prompt updates."""
        self.prompt_updates.pop(mm_hash, None)

    def count(
        self,
        *,
        hit: bool,
        inline: str | None = None,
        mm_hash: str = "",
        nbytes: int = 0,
        sibling: bool = False,
    ) -> None:
        """Count one decided item and publish the counters (hold the store lock).

        Only the words that change are written: a hit moves ``H_HITS``, a miss ``H_MISSES``.
        """
        c = self.counters
        c.total += 1
        w = self._words
        if hit:
            c.hits += 1
            w[H_HITS] = c.hits
        else:
            w[H_MISSES] = c.total - c.hits
        if sibling:
            c.sibling_hits += 1
            w[H_SIBLING_HITS] = c.sibling_hits
        if inline is None:
            return
        if inline == "too_large":
            c.inline_too_large += 1
            w[H_INLINE_LARGE] = c.inline_too_large
            self._log_once(inline, mm_hash, nbytes, self.store.max_object_bytes)
        elif inline == "full":
            c.inline_full += 1
            w[H_INLINE_FULL] = c.inline_full
            self._log_once(inline, mm_hash)
        elif inline == "busy":
            c.inline_busy += 1

    def one_item(self, mm_item: object, mm_hash: object) -> MmItem | None:
        """A one-item request in its usual case, decided without a request object.

        The same decision as a one-item ``SenderRequest`` with the default ``wait_for_space``
        and copy threshold, when it is one of: a hit, a put of a new hash that fits now (after
        eviction, without waiting) and is small enough to copy holding the writer lock
        (``INLINE_COPY_UNDER_LOCK``, the one threshold ``ShmObjectStore.put`` uses too), or an
        item found too large (served inline, remembered). Anything else returns ``None`` before
        any side effect that matters (at most a failed allocation's eviction, which the request
        repeats), and the caller runs the request: an item or hash of another type, a hash being
        put or known too large, a group shard, an item that needs a wait, a big copy. Counted
        and published exactly as the request counts (``test_parity`` compares the two).
        """
        if (
            type(mm_item) is not tuple
            or len(mm_item) != 2
            or type(mm_hash) is not str
            or self.siblings is not None
        ):
            return None
        store = self.store
        with store.lock:
            ref = store.get_cached(mm_hash)
            if ref is not None:
                self.count(hit=True)
                return (ref, mm_item[1])
            if store.is_pending(mm_hash) or mm_hash in self.too_large._sizes:
                return None
            try:
                plan = store.plan(mm_item[0])
            except ObjectTooLargeError as exc:
                self.found_too_large(mm_hash, exc.nbytes)
                return mm_item  # inline, as the request serves it
            if plan.nbytes > INLINE_COPY_UNDER_LOCK:
                return None  # a bigger copy runs outside the lock: the request does that
            try:
                ref = store.put_locked(mm_hash, plan)
            except CacheFullError:
                return None  # nothing taken: the request decides (inline, or wait for room)
            except BaseException:
                self.count(hit=False)  # a failed copy counts as the request counts it
                raise
            self.count(hit=False)
            updates = mm_item[1]
            self.prompt_updates[mm_hash] = updates
            return (ref, updates)

    def found_too_large(self, mm_hash: str, nbytes: int) -> None:
        """An item measured over ``max_object_bytes``: remember it, count it served inline."""
        self.too_large.add(mm_hash, nbytes)
        self.count(hit=False, inline="too_large", mm_hash=mm_hash, nbytes=nbytes)

    def _log_once(self, cause: str, *args: object) -> None:
        if cause in self._logged:  # one line per cause, not one per request
            return
        self._logged.add(cause)
        log.warning(
            _LOG_LINES[cause] + " (logged once per cause; see snapshot() for counts)", *args
        )


_LOG_LINES: Final = {
    "too_large": "item %s (%d bytes) exceeds max_object_bytes=%d: serving inline, not cached",
    "full": "cache full (oldest items still owed to readers): serving %s inline",
}


class _Steps:
    """The life cycle both request kinds share: jobs that may run anywhere, exactly-once undo.

    ``lock`` guards ``_running``/``_abandoned``/``_settled`` (the sender uses the store's writer
    lock, so the decision is atomic with the writer state it protects).
    """

    __slots__ = ("_abandoned", "_lock", "_running", "_settled")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._running = False
        self._abandoned = False
        self._settled = False

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def run_jobs(self) -> None:
        """Run the copy jobs (and waits), wherever the face chose; a no-op once abandoned."""
        with self._lock:
            if self._abandoned or self._settled:
                return
            self._running = True
        try:
            self._run_jobs()
        finally:
            with self._lock:
                self._running = False
                if self._abandoned:  # the caller left while we ran: undo it all ourselves
                    self._roll_back_locked()

    def abandon(self) -> None:
        """Roll the request back (now, or when its running jobs end). Idempotent."""
        with self._lock:
            self._abandoned = True
            if not self._running:
                self._roll_back_locked()

    def _roll_back_locked(self) -> None:
        if self._settled:
            return
        self._settled = True
        self._undo_locked()

    def _run_jobs(self) -> None:
        raise NotImplementedError

    def _undo_locked(self) -> None:
        raise NotImplementedError


class SenderRequest(_Steps):
    """One ``get_and_update`` of the sender, as steps (see the module docstring).

    Items are decided in order: a hit is handed out; a miss is reserved (copied at once when
    small, else as a copy job); an item too large, or with no room, is served inline; with
    ``wait_for_space`` a miss that finds no room becomes a wait job, bounded by one deadline for
    the whole call. Every cached item of the request is pinned from ``begin`` to the end, and
    every item it puts is pinned once committed, so a request never evicts its own items.
    """

    __slots__ = (
        "_book",
        "_copies",
        "_deadline",
        "_features",
        "_followers",
        "_handed",
        "_hashes",
        "_inline_below",
        "_items",
        "_out",
        "_pins",
        "_putting",
        "_reserved",
        "_sibling",
        "_store",
        "_wait",
        "_waits",
    )

    def __init__(
        self,
        store: ShmObjectStore,
        book: SenderBook,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        if len(mm_items) != len(mm_hashes):
            raise ValueError("mm_items and mm_hashes differ in length")
        self._hashes = hashes = list(mm_hashes)
        for i, h in enumerate(hashes):
            if type(h) is not str:
                hashes[i] = check_hash(h)
        self._items = items = list(mm_items)
        for it in items:  # before any side effect: nothing to undo for a bad shape
            if it is not None and (not isinstance(it, tuple) or len(it) != 2):
                raise TypeError("mm_item must be (item, prompt_updates) or None")
        # the config's default was validated with the config
        self._wait = (
            book.default_wait_for_space if wait_for_space is None else check_wait(wait_for_space)
        )
        self._book = book
        self._store = store
        self._lock = store.lock
        self._running = self._abandoned = self._settled = False
        self._inline_below = copy_inline_below
        self._deadline = 0.0
        self._out: list[MmItem | None] = [None] * len(items)
        self._pins: list[Any] = []  # the store's entries this request pinned
        # What only misses and groups need is made on first use (a hit needs none of it):
        # None until the first one (most requests have none: no list made for nothing)
        self._copies: list[tuple[int, Reservation]] | None = None  # copy jobs
        self._waits: list[int] | None = None  # misses waiting for room
        self._reserved: list[Reservation] | None = None  # every allocation, for the roll back
        self._handed: list[ShmRef] = []  # every hand-out this request took, for the roll back
        self._features: list[FeatureSpec] | None = None
        self._putting: set[str] = _NO_SET  # hashes this request reserved
        self._followers: dict[str, list[int]] | None = None  # hash -> later items of that hash
        self._sibling: dict[str, Found] | None = None  # hash -> a sibling shard holding it

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has anything to do (a big copy or a wait for space)."""
        return bool(self._copies or self._waits)

    def begin(self) -> None:
        """Validate, pin, hand out hits, reserve misses and copy the small ones. Raises
        ``CacheMissError`` (taking nothing) for a ``None`` item whose hash is not cached.

        A one-item request pins nothing up front: its own decision is the only step before
        ``finish`` that could evict, and it never evicts its own hit. (An item it puts is still
        pinned from commit to ``finish`` when the copy runs as a job.)
        """
        store = self._store
        hashes = self._hashes
        single = len(hashes) == 1
        may_defer = self._wait > 0
        with self._lock:  # the store's writer lock
            if may_defer:
                self._deadline = time.monotonic() + self._wait
            if None in self._items:  # look-ups: every one must be cached (here or a sibling)
                missing = [
                    h
                    for it, h in zip(self._items, hashes)
                    if it is None and not store.is_cached(h) and not self._in_sibling(h)
                ]
                if missing:
                    raise CacheMissError(missing)
            if not single:
                self._pins = [e for h in hashes if (e := store.pin_entry(h)) is not None]
            for i in range(len(hashes)):
                res = self._decide_locked(i, wait=0.0, may_defer=may_defer)
                if res is None:
                    continue
                if res.plan.nbytes < self._inline_below:
                    self._write(res)  # microseconds: under the lock
                    self._commit_locked(i, res, pin=not single)
                else:
                    if self._copies is None:
                        self._copies = []
                    self._copies.append((i, res))

    def _decide_locked(self, i: int, *, wait: float, may_defer: bool) -> Reservation | None:
        """Decide item ``i``: a hit, inline, deferred, or a reservation to copy into."""
        store, book, h = self._store, self._book, self._hashes[i]
        it = self._items[i]
        ref = store.get_cached(h)
        if ref is not None:
            self._handed.append(ref)
            updates = book.prompt_updates.get(h, ()) if it is None else it[1]
            self._out[i] = (ref, updates)
            book.count(hit=True)
            return None
        if it is None and self._sibling is not None and h in self._sibling:
            return self._reserve_sibling(i, wait=wait, may_defer=may_defer)
        if it is None:  # only when the item was dropped meanwhile (invalidate)
            raise CacheMissError([h])
        item = it  # its shape was checked when the request was made
        if h in self._putting:  # this request puts it: a hit once that copy is committed
            self._follow(h, i)
            return None
        if store.is_pending(h):  # another request is putting this very item right now
            self._out[i] = item
            book.count(hit=False, inline="busy")
            return None
        known = book.too_large.get(h) if book.too_large._sizes else None  # mostly empty
        if known is not None:
            self._out[i] = item
            book.count(hit=False, inline="too_large", mm_hash=h, nbytes=known)
            return None
        try:
            plan = store.plan(item[0])
            res = store.reserve(
                h,
                plan,
                wait_for_space=wait,
                own_pins=Counter(self._pins) if self._pins else None,
                abort=self._gone,
            )
        except ObjectTooLargeError as exc:
            book.found_too_large(h, exc.nbytes)
            self._out[i] = item
            return None
        except CacheFullError:
            if may_defer and time.monotonic() < self._deadline:
                self._wait_for_room(i)  # counted once it is decided
                return None
            self._out[i] = item
            book.count(hit=False, inline="full", mm_hash=h)
            return None
        self._reserving(res)
        book.count(hit=False)
        return res

    def _reserving(self, res: Reservation) -> None:
        """Remember an allocation of this request (for the roll back and its followers)."""
        if self._reserved is None:
            self._reserved, self._putting = [], set()
        self._reserved.append(res)
        self._putting.add(res.key)

    def _follow(self, h: str, i: int) -> None:
        """Item ``i`` repeats ``h``, which this request is putting: decided after its commit."""
        if self._followers is None:
            self._followers = {}
        self._followers.setdefault(h, []).append(i)

    def _wait_for_room(self, i: int) -> None:
        if self._waits is None:
            self._waits = []
        self._waits.append(i)

    def _in_sibling(self, h: str) -> bool:
        """Whether a sibling shard holds ``h`` now (remembered for the decision)."""
        sib = self._book.siblings
        if sib is None:
            return False
        found = sib.find(h)
        if found is None:
            return False
        if self._sibling is None:
            self._sibling = {}
        self._sibling[h] = found
        return True

    def _reserve_sibling(self, i: int, *, wait: float, may_defer: bool) -> Reservation | None:
        """Reserve room for a copy of a sibling shard's chunk of item ``i`` (see ``_group``).

        No room (or the sibling's item exceeds our limit) is a ``CacheMissError``: the caller
        has no data to serve inline, so it preprocesses and sends it, as for any miss.
        """
        h = self._hashes[i]
        if h in self._putting:
            self._follow(h, i)
            return None
        if self._store.is_pending(h):  # another request is copying it in: as for a plain miss
            raise CacheMissError([h])
        if self._sibling is None:
            raise RuntimeError(f"internal error: {h!r} not found in a sibling")
        found = self._sibling[h]
        try:
            res = self._store.reserve(
                h, found.sibling.raw_plan(found.ref), wait_for_space=wait, abort=self._gone
            )
        except CacheFullError:
            if may_defer and time.monotonic() < self._deadline:
                self._wait_for_room(i)
                return None
            raise CacheMissError([h]) from None
        except ObjectTooLargeError:
            raise CacheMissError([h]) from None
        self._reserving(res)
        self._book.count(hit=True, sibling=True)
        return res

    def _write(self, res: Reservation) -> None:
        """The copy into a reserved chunk; a sibling's chunk that changed meanwhile is a miss."""
        try:
            self._store.write_reserved(res)
        except ShmCacheError:
            if self._sibling is None or res.key not in self._sibling:
                raise
            raise CacheMissError([res.key]) from None

    def _gone(self) -> bool:
        """Whether the caller abandoned the request (a wait for space stops then)."""
        return self._abandoned

    def _commit_locked(self, i: int, res: Reservation, *, pin: bool = True) -> None:
        if self._abandoned:  # the caller is gone: never publish for nobody
            self._store.abort(res)
            return
        item = self._items[i]
        updates: Sequence[Any] = () if item is None else item[1]
        ref = self._store.commit(res)
        self._handed.append(ref)
        self._putting.discard(res.key)
        self._book.prompt_updates[res.key] = updates
        self._out[i] = (ref, updates)
        if pin and (e := self._store.pin_entry(res.key)) is not None:  # protect it from the rest
            self._pins.append(e)
        if self._followers is not None:
            for j in self._followers.pop(res.key, ()):  # the same hash again in this request
                self._decide_locked(j, wait=0.0, may_defer=False)

    def _run_jobs(self) -> None:
        store = self._store
        for i, res in self._copies or ():
            if self._abandoned:
                return  # the roll back aborts what is left
            self._write(res)  # outside the lock: copies into distinct chunks overlap
            with store.lock:
                self._commit_locked(i, res)
        for i in self._waits or ():
            if self._abandoned:
                return
            with store.lock:  # the store lets go of the lock while it sleeps
                t0 = time.monotonic()
                waited = self._decide_locked(i, wait=max(0.0, self._deadline - t0), may_defer=False)
                self._book.counters.wait_seconds += time.monotonic() - t0
            if waited is None or self._abandoned:
                continue
            self._write(waited)
            with store.lock:
                self._commit_locked(i, waited)

    @classmethod
    def for_features(
        cls,
        store: ShmObjectStore,
        book: SenderBook,
        features: Sequence[FeatureSpec],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> SenderRequest:
        """A request over ``FeatureSpec``s: data ``None`` (or a reference) means look it up."""
        features = list(features)
        req = cls(
            store,
            book,
            [feature_item(f) for f in features],
            [f.mm_hash for f in features],
            wait_for_space=wait_for_space,
            copy_inline_below=copy_inline_below,
        )
        req._features = features
        return req

    def finish_features(self) -> list[FeatureSpec]:
        """``finish`` as new specs whose data is a ``ShmRef`` or the inline item."""
        if self._features is None:
            raise TypeError("not a request over features (use finish)")
        return features_from(self._features, self.finish())

    def finish(self) -> list[MmItem]:
        """Unpin and return one ``(ShmRef or item, prompt_updates)`` per item, in order."""
        with self._lock:
            if self._settled:
                raise RuntimeError("request already finished or rolled back")
            out = self._out
            if None in out:
                self._roll_back_locked()
                raise RuntimeError("internal error: an item of the request was not decided")
            self._settled = True
            if self._pins:
                self._unpin_locked()
            return cast("list[MmItem]", out)

    def _unpin_locked(self) -> None:
        for e in self._pins:
            self._store.unpin_entry(e)
        self._pins = []

    def _undo_locked(self) -> None:
        store = self._store
        for ref in self._handed:  # only what this request handed out, never a caller's data
            with contextlib.suppress(ClosedCacheError):  # closed: nothing is owed any more
                store.release(ref)
        for res in self._reserved or ():
            store.abort(res)  # idempotent: a committed reservation is left alone
        self._unpin_locked()


_NO_SET: Final[set[str]] = cast("set[str]", frozenset())  # likewise (immutable: safe)


def feature_item(f: FeatureSpec) -> MmItem | None:
    """A ``FeatureSpec`` as the sender's ``(item, prompt_updates)``, or ``None`` (look it up)."""
    if not isinstance(f, FeatureSpec):
        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
    check_hash(f.mm_hash)
    if f.data is None or isinstance(f.data, ShmRef):
        return None
    return (f.data, tuple(f.prompt_updates))


def features_from(features: Sequence[FeatureSpec], results: Sequence[MmItem]) -> list[FeatureSpec]:
    """New specs carrying each result (a ``ShmRef`` or the inline item)."""
    return [
        FeatureSpec(f.mm_hash, data, identifier=f.identifier, prompt_updates=tuple(updates))
        for f, (data, updates) in zip(features, results)
    ]


class ReceiverRequest(_Steps):
    """One read of a request's features by a receiver, as steps (see the module docstring).

    ``begin`` validates every reference first (a forged or foreign one fails the request, which
    then owes nothing), sets the stale ones aside (a stale reference owes nothing: it is not
    acknowledged), and reads the small ones at once; the big reads are the jobs. A reference is
    owed until it is read and verified (then acknowledged) or given back; any failure gives back
    every reference not read yet. Stale references are read around and reported together by
    ``finish`` (``CacheMissError``, or ``StaleReferenceError`` for a single item). With
    ``copy=False`` (a lease) arrays are views and the hand-outs stay owed until
    ``settle_lease``.
    """

    __slots__ = (
        "_copy",
        "_counters",
        "_features",
        "_held",
        "_inline_below",
        "_jobs",
        "_owed",
        "_refs",
        "_results",
        "_stale",
        "_store",
    )

    def __init__(
        self,
        store: ShmObjectStore,
        counters: RequestCounters,
        features: Sequence[FeatureSpec],
        *,
        copy: bool = True,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(threading.Lock())
        self._counters = counters
        self._store = store
        self._features = list(features)
        self._copy = copy
        self._inline_below = copy_inline_below
        self._refs: list[ShmRef | None] = []
        self._results: list[Any] = [None] * len(self._features)
        self._owed: set[int] = set()  # references handed to this request, not settled yet
        self._held: list[ShmRef] = []  # leased: read as views, acknowledged by settle_lease
        self._stale: list[str] = []
        self._jobs: list[int] = []

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has reads to do (references of ``copy_inline_below`` or more)."""
        return bool(self._jobs)

    def begin(self) -> None:
        """Validate the whole request, then read what is small. Typed errors, nothing owed.

        The view a validation made of a reference read in this step is the one read: the copy
        is verified after it (a chunk freed meanwhile is stale), so a second look-up of the
        chunk would add nothing. Jobs look their chunk up again when they run.
        """
        reading = self._store._reading
        slot = reading.check_reader()
        copy, inline_below = self._copy, self._inline_below
        views: dict[int, memoryview] = {}
        error: Exception | None = None
        try:
            for i, f in enumerate(self._features):
                ref = None
                try:
                    if not isinstance(f, FeatureSpec):
                        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
                    check_hash(f.mm_hash)
                    ref = as_reference(f.data)
                    if ref is not None:
                        try:
                            # forged or foreign: never given back (not ours)
                            ref, view = reading.resolve(ref)
                        except StaleReferenceError:  # owes nothing: not acknowledged
                            self._stale.append(f.mm_hash)
                            ref = None
                        else:
                            self._owed.add(i)
                            if not copy or ref.length < inline_below:
                                views[i] = view
                            else:
                                view.release()
                    else:
                        self._results[i] = f.data
                except (InvalidReferenceError, TypeError) as exc:
                    error = error or exc
                    ref = None
                self._refs.append(ref)
            if error is not None:
                raise error  # the face abandons the request: every valid reference is given back
        except BaseException:
            for view in views.values():
                view.release()
            raise
        hits = 0
        try:
            for i, ref in enumerate(self._refs):
                if ref is None:
                    continue
                if i in views:  # checked above, in this same step
                    hits += self._read(i, ref, slot, views.pop(i))
                else:
                    self._jobs.append(i)
        finally:
            for unread in views.values():  # a read raised: the others are released, not leaked
                unread.release()
            # one lock round for the whole step (totals counted even if a read failed)
            self._counters.add(hits=hits, total=len(self._features))

    def _read(
        self, i: int, ref: ShmRef, slot: ReaderSlot | None = None, view: memoryview | None = None
    ) -> int:
        """Read one validated reference; 1 if it was read (a hit), 0 if it was stale.

        With ``view`` (what validating it returned, in the same step as ``slot``) the chunk is
        not looked up again.
        """
        reading = self._store._reading
        try:
            if view is None or slot is None:
                data = reading.get_checked(ref, copy=self._copy, slot=slot)
            else:
                data = reading.finish_read(slot, ref, view, self._copy)
        except StaleReferenceError:
            # stale before or after the copy: the chunk was freed (or cleared), and a freed
            # chunk is owed by nobody, so there is nothing to acknowledge
            with self._lock:
                self._owed.discard(i)
            self._stale.append(self._features[i].mm_hash)
            return 0
        # any other error propagates: the face abandons, and every owed reference is given back
        with self._lock:
            self._owed.discard(i)
            if not self._copy:
                self._held.append(ref)
        self._results[i] = data
        return 1

    def _give_back(self, i: int, ref: ShmRef) -> None:
        self._store.give_back(ref)
        with self._lock:
            self._owed.discard(i)

    def _run_jobs(self) -> None:
        hits = 0
        try:
            for i in self._jobs:
                if self._abandoned:
                    return  # the roll back gives back what is left
                ref = self._refs[i]
                if ref is not None:
                    hits += self._read(i, ref)
        finally:
            if hits:
                self._counters.add(hits=hits)

    def finish(self) -> list[FeatureSpec]:
        """New specs with the items read; ``CacheMissError`` lists the stale ones, if any."""
        out = [f.with_data(d) for f, d in zip(self._features, self._results)]
        with self._lock:
            if self._settled:
                raise RuntimeError("request already finished or rolled back")
            if self._stale:  # not settled: a lease's views are given back by ``abandon``
                raise CacheMissError(self._stale, features=out if self._copy else None)
            self._settled = True
        return out

    def finish_item(self) -> Any:
        """The single item of a one-feature request; ``StaleReferenceError`` if it was stale."""
        with self._lock:
            if self._settled or len(self._features) != 1:
                return single_item(self.finish, self._features)  # its errors, unchanged
            if self._stale:
                # what ``single_item`` makes of ``finish``'s CacheMissError
                h = self._features[0].mm_hash
                raise StaleReferenceError(f"reference for {h!r} is stale") from None
            self._settled = True
        return self._results[0]  # no new spec: only its data is returned

    def settle_lease(self) -> None:
        """End a lease: re-verify and acknowledge every leased reference.

        Every one is settled even if some fail; the first failure (``StaleReferenceError``: the
        bytes may have been reused under the views) is raised after.
        """
        with self._lock:
            held, self._held = self._held, []
        errors: list[BaseException] = []
        for ref in held:
            try:
                self._store.ack(ref)
            except Exception as exc:  # keep settling the others
                self._store.give_back(ref)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _undo_locked(self) -> None:
        owed, self._owed = self._owed, set()
        held, self._held = self._held, []
        for i in sorted(owed):
            ref = self._refs[i] if i < len(self._refs) else None
            if ref is not None:
                self._store.give_back(ref)
        for ref in held:
            self._store.give_back(ref)


def single_item(finish: Callable[[], list[FeatureSpec]], features: Sequence[FeatureSpec]) -> Any:
    """``finish()`` of a one-feature read as that feature's item; stale is ``StaleReferenceError``.

    (Both the single-segment and the group receiver requests end ``get_and_update_item`` so.)
    """
    try:
        [f] = finish()
    except CacheMissError:
        h = features[0].mm_hash
        raise StaleReferenceError(f"reference for {h!r} is stale") from None
    return f.data


class TooLargeMemory:
    """Hashes remembered as too large to cache (bounded), so they are not serialised again."""

    def __init__(self, capacity: int = 4096) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity

    def get(self, mm_hash: str) -> int | None:
        n = self._sizes.get(mm_hash)
        if n is not None:
            self._sizes.move_to_end(mm_hash)
        return n

    def add(self, mm_hash: str, nbytes: int) -> None:
        self._sizes[mm_hash] = nbytes
        if len(self._sizes) > self._capacity:
            self._sizes.popitem(last=False)

    def discard(self, mm_hash: str) -> None:
        self._sizes.pop(mm_hash, None)

    def clear(self) -> None:
        self._sizes.clear()
