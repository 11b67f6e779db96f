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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, cast

from ._core_api import core
from ._group import Found, Siblings
from ._kept import KEPT, keep, restore
from ._layout import H_HITS, H_INLINE_FULL, H_INLINE_LARGE, H_MISSES, H_SIBLING_HITS
from ._sharded_map import ShardedMap
from ._store import (
    INLINE_COPY_UNDER_LOCK,
    SYNC_ONE_STEP_PUT_UNDER,
    Reservation,
    StoreWriter,
    exact_key,
)
from ._types import FeatureSpec, ShmRef, as_reference
from .errors import (
    CacheFullError,
    CacheMissError,
    ClosedCacheError,
    DuplicateKeyError,
    ObjectTooLargeError,
    SerdeError,
    ShmCacheError,
)

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "MmItem",
    "RequestCounters",
    "SenderBook",
    "SenderRequest",
    "as_reference",
    "check_hash",
    "run_one",
]

#: The default ``copy_inline_below``: the store's one threshold for a copy under the writer lock.
DEFAULT_INLINE_THRESHOLD: Final = INLINE_COPY_UNDER_LOCK

#: the core's one-item miss, hit or look-up (``_core_put.c``, see ``run_one``); None: declined,
#: no side effect
_put_item = core.put_item
#: the core's split of a request's features and its new specs (``_core_spec.c``, see
#: ``SenderRequest.for_features`` and ``features_from``, the references); None: declined
_split_features = core.split_features
_specs_from = core.specs_from
core.configure_specs(FeatureSpec, ShmRef)

log = logging.getLogger("aioshmcache")

MmItem = tuple[Any, Sequence[Any]]

#: the sender's are the store's (re-entrant) lock; a receiver's are plain locks
_Lock: TypeAlias = "threading.Lock | threading.RLock"
# Shared "nothing yet" defaults, replaced by a fresh container on first use. Immutable, so a
# mistaken append fails loudly (AttributeError) instead of leaking into every other request.
_NONE: Final[list[Any]] = cast("list[Any]", ())
_NO_SET: Final[set[str]] = cast("set[str]", frozenset())
_new_object = object.__new__
_set_field = object.__setattr__


def check_hash(mm_hash: object) -> str:
    """``mm_hash`` as an exact ``str`` (a subclass's characters: ``_store.exact_key``), else
    ``TypeError``."""
    if type(mm_hash) is str:
        return mm_hash
    if not isinstance(mm_hash, str):
        raise TypeError(f"mm_hash must be a str, not {type(mm_hash).__name__}")
    return exact_key(mm_hash)


def check_wait(wait: object) -> float:
    """A ``wait_for_space`` value as seconds, or ``ValueError``."""
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise ValueError("wait_for_space must be a number of seconds")
    if not (math.isfinite(wait) and wait >= 0):
        raise ValueError("wait_for_space must be a finite number of seconds >= 0")
    return float(wait)


@dataclass(slots=True)  # the compiled one-item miss reads and writes them at the slots' offsets
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
    sibling_hits: int = 0  # group shards: items served from a sibling (also counted as hits)
    wait_seconds: float = 0.0  # time spent waiting for space, summed over requests
    lock: _Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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

    def hit(self) -> None:
        """Count one item seen and found (``add(hits=1, total=1)`` without its keywords: once per
        one-item read)."""
        lock = self.lock
        lock.acquire()
        try:
            self.hits += 1
            self.total += 1
        finally:
            lock.release()

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

    # the compiled one-item miss reads these at the slots' offsets (a look-up by name in an
    # instance dict costs ~150 instructions), and with no instance dict ``keep_updates`` is
    # known to be the class's own without making a bound method
    __slots__ = (
        "_logged",
        "_words",
        "counters",
        "default_wait_for_space",
        "prompt_updates",
        "siblings",
        "store",
        "too_large",
    )

    def __init__(
        self,
        store: StoreWriter,
        *,
        default_wait_for_space: float = 0.0,
        siblings: Siblings | None = None,
    ) -> None:
        self.store = store
        self.siblings = siblings  # the other shards of the group, if this cache is a shard
        self.default_wait_for_space = default_wait_for_space
        # one entry per cached item: as many shards as the store's index; each kept as
        # ``_kept.keep`` makes it (a form the garbage collector skips), read by ``restore``
        self.prompt_updates: ShardedMap[str, Any] = ShardedMap(store.shards)
        self.too_large = TooLargeMemory()
        self.counters = RequestCounters(lock=store.lock)
        self._words = store.words
        self._logged: set[str] = set()

    def keep_updates(self, mm_hash: str, updates: Sequence[Any]) -> None:
        """Keep the prompt updates of an item just put (the one place they are stored)."""
        # the form the sender keeps (``_kept``); ``()`` as it is, without a call; made before
        # the count changes, as the compiled put makes it
        kept = updates if type(updates) is tuple and not updates else keep(updates)
        pu = self.prompt_updates  # ``pu[h] = kept``, one call shorter
        d = pu.shards[hash(mm_hash) & pu.mask]
        if mm_hash not in d:
            pu.n += 1
        d[mm_hash] = kept
        sib = self.siblings
        if sib is not None and sib.withheld:  # put again after its ``invalidate``
            sib.withheld.pop(mm_hash, None)

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

    def count_miss(self) -> None:
        """``count(hit=False)`` of an item put, in fewer steps."""
        c = self.counters
        c.total = total = c.total + 1
        self._words[H_MISSES] = total - c.hits

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
    "too_large": "item %s (%d bytes) exceeds max_object_bytes=%d: never cached, so every "
    "request for it is preprocessed and sent inline again",
    "full": "cache full (oldest items still owed to readers): serving %s inline",
}


class _Steps:
    """The life cycle both request kinds share: jobs that may run anywhere, exactly-once undo.

    ``lock`` guards ``_running``/``_abandoned``/``_settled`` (the sender uses the store's writer
    lock, so the decision is atomic with the writer state it protects).
    """

    __slots__ = ("_abandoned", "_lock", "_running", "_settled")

    def __init__(self, lock: _Lock) -> None:
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
    every item it puts is pinned once committed, so a request never evicts its own items (the
    last copy job of ``run`` commits and finishes in one locked step: no pin is needed there).
    """

    # No __slots__: what only some requests need has a class-level default (one store fewer
    # per field for every request; a hit needs none of them) and is set on first use.
    _copies: list[tuple[int, Reservation]] = _NONE  # copy jobs
    _waits: list[int] = _NONE  # misses waiting for room
    _reserved: list[Reservation] = _NONE  # every allocation, for the roll back
    _pins: list[Any] = _NONE  # the store's entries this request pinned
    _putting: set[str] = _NO_SET  # hashes this request reserved
    _followers: dict[str, list[int]] | None = None  # hash -> later items of that hash
    _sibling: dict[str, Found] | None = None  # hash -> a sibling shard holding it
    _withholds = 0  # the siblings' ``withholds`` when they were looked at (``_in_sibling``)
    _guests: list[int] = _NONE  # look-ups of a sibling's item to serve inline (no room here)
    _features: list[FeatureSpec] | None = None
    _deadline = 0.0
    _wait: float | None = None  # wait_for_space if the caller gave one, else the book's default
    _running = _abandoned = _settled = False
    _finish_in_jobs = False  # ``run``: the last copy job also finishes (see ``_run_jobs``)

    def __init__(
        self,
        store: StoreWriter,
        book: SenderBook,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
        _checked: bool = False,
        _fresh: bool = False,
    ) -> None:
        # ``_checked``: new lists of valid items and hashes (``for_features``): kept as they are;
        # ``_fresh``: new lists (the caller's own, e.g. ``[mm_item]``): checked, not copied
        if _checked or _fresh:
            self._hashes, self._items = hashes, items = mm_hashes, mm_items
        else:
            self._hashes = hashes = list(mm_hashes)
            self._items = items = list(mm_items)
            if len(items) != len(hashes):
                raise ValueError("mm_items and mm_hashes differ in length")
        if not _checked:
            for h in hashes:
                if type(h) is not str:
                    self._hashes = [check_hash(x) for x in hashes]
                    break
            for it in items:  # before any side effect: nothing to undo for a bad shape
                if it is not None and (not isinstance(it, tuple) or len(it) != 2):
                    raise TypeError("mm_item must be (item, prompt_updates) or None")
        if wait_for_space is not None:  # else the config's, validated with the config
            self._wait = check_wait(wait_for_space)
        self._book = book
        self._store = store
        self._lock = store.lock
        self._inline_below = copy_inline_below
        self._out: list[Any] = [None] * len(items)
        self._handed: list[ShmRef] = []  # every hand-out this request took, for the roll back

    @property
    def has_jobs(self) -> bool:
        """Whether ``run_jobs`` has anything to do (a big copy, a wait for space, or a sibling's
        item to read out and serve inline)."""
        return bool(self._copies or self._waits or self._guests)

    def begin(self) -> None:
        """Validate, guard, hand out hits, put the small misses, reserve the big ones. Raises
        ``CacheMissError`` (taking nothing) for a ``None`` item whose hash is not cached.

        The whole step runs under the store's writer lock, so a request of several items guards
        its own items (``StoreWriter.guard``: its cached hashes, and every chunk allocated
        during the step) instead of pinning each; if the request goes on outside the lock (copy
        jobs, waits), the guard becomes pins of those items before the lock is let go. A
        one-item request guards nothing: its own decision is the only step before ``finish``
        that could evict, and it never evicts its own hit. (An item it puts is still pinned from
        commit to ``finish`` when the copy runs as a job — but for the last job of ``run``,
        whose commit and ``finish`` are one locked step.)
        """
        self._store.check_owner()  # before the lock (a forked child may inherit it held)
        self._begin(False)

    def start(self) -> list[MmItem] | None:
        """``begin``, and when that leaves nothing to run, ``finish`` in the same locked step.

        Returns the result, or None when there are jobs (then ``run_jobs`` and ``finish``, or
        ``abandon``). What every face calls: most requests end here, in one step.
        """
        self._store.check_owner()  # before the lock (a forked child may inherit it held)
        return self._begin(True)

    def run(self) -> list[MmItem]:
        """Every step on the calling thread (the sync face); abandoned on any error."""
        # before the lock and before ``try``: a forked child may inherit the lock held, and
        # ``abandon`` takes it (nothing is taken yet, so there is nothing to undo)
        self._store.check_owner()
        try:
            out = self._begin(True)
            if out is not None:
                return out
            self._finish_in_jobs = True
            self.run_jobs()
        except BaseException:
            self.abandon()
            raise
        if self._settled and not self._abandoned:  # the last copy job finished it
            return self._out
        return self.finish()

    def _begin(self, settle: bool) -> list[MmItem] | None:
        """``begin`` (and ``finish`` when ``settle`` and nothing is left), the owner checked."""
        hashes = self._hashes
        wait = self._wait
        book = self._book
        if wait is None:
            wait = book.default_wait_for_space
        may_defer = wait > 0
        with self._lock:  # the store's writer lock
            if may_defer:
                self._deadline = time.monotonic() + wait
            # look-ups: every one must be cached (here or a sibling) before anything is taken;
            # one item with no siblings needs no pass of its own: its decision is the look-up,
            # raising the same ``CacheMissError`` with nothing taken
            if None in self._items and (len(hashes) != 1 or book.siblings is not None):
                self._check_lookups()
            if len(hashes) == 1:
                self._decide_locked(0, 0.0, may_defer, True)
            else:
                store = self._store
                guarded = store.guard(hashes)
                try:
                    self._decide_all_locked(may_defer)
                    if self._copies or self._waits or self._guests:  # going on unlocked:
                        self._pins = store.pin_ids(guarded)  # the guard becomes pins
                finally:
                    store.unguard()
            if not settle or self._copies or self._waits or self._guests:
                return None
            out: list[MmItem] = self._out  # ``finish``, in the same step (nothing pinned)
            if None in out:
                raise RuntimeError("internal error: an item of the request was not decided")
            self._settled = True
            return out

    def _decide_all_locked(self, may_defer: bool) -> None:
        """Decide every item of a request of several, in order, in ``begin``'s locked step.

        Each item, given or a look-up (None), is offered to the core's one-item call first
        (``put_item``: the steps of ``_decide_locked``'s hit or small miss in one compiled call
        — the look-up, then the hand-out and the hit counted (a look-up's kept prompt updates
        restored), or the plan, the put under this request's guard, the miss counted, the
        prompt updates kept — or its answer for an item measured too large: served inline).
        What it declines, before any side effect (a look-up not cached, a hash remembered too
        large, a copy job, room that needs the eviction policy; every call on the pure core),
        ``_decide_locked`` decides, as it does every item of a hash this request is reserving
        and a group shard's.
        A hand-out the core made is recorded for the roll back, as ``_decide_locked`` does.
        """
        store, book, hashes = self._store, self._book, self._hashes
        items, results, handed = self._items, self._out, self._handed
        below = self._inline_below
        plain = book.siblings is None
        for i in range(len(hashes)):
            it = items[i]
            if plain and hashes[i] not in self._putting:
                done = _put_item(store, book, it, hashes[i], below)
                if done is not None:
                    if done is not it:  # a put or a hit (``it`` itself: served inline)
                        handed.append(done[0])
                    results[i] = done
                    continue
            self._decide_locked(i, 0.0, may_defer, True)

    def _check_lookups(self) -> None:
        """``CacheMissError`` (nothing taken) unless every ``None`` item's hash is cached here
        or in a sibling shard, or given by an earlier item of the request.

        Items are decided in order, as vLLM's sender does: a look-up after an item of the same
        hash is that item's hit once it is put (a miss then only if it was served inline), also
        when that item first waits for room (the look-up waits after it).
        """
        index = self._store.index  # ``store.is_cached(h)``, inline: a look-up per item
        shards, mask = index.shards, index.mask
        given: set[str] = set()
        missing = []
        for it, h in zip(self._items, self._hashes):
            if it is not None:
                given.add(h)
            elif h not in shards[hash(h) & mask] and h not in given and not self._in_sibling(h):
                missing.append(h)
        if missing:
            raise CacheMissError(missing)

    def _decide_locked(
        self, i: int, wait: float, may_defer: bool, begin: bool = False
    ) -> Reservation | None:
        """Decide item ``i``: a hit, inline, deferred, or put.

        In ``begin``, a put copies at once when small (``put_locked``: one step, no
        reservation) and is a copy job otherwise; after a wait, the reservation is returned for
        the caller to copy (outside the lock) and commit.
        """
        store, book, h = self._store, self._book, self._hashes[i]
        it = self._items[i]
        # ``store.get_cached(h)`` (checked in ``begin``, under its lock), the look-up inline:
        # a miss costs no call
        index = store.index
        cid = index.shards[hash(h) & index.mask].get(h)
        if cid is not None:
            ref = store.hand_out(cid)
            self._handed.append(ref)
            if it is None:  # ``book.prompt_updates.get(h, ())``, one call shorter
                pu = book.prompt_updates
                u = pu.shards[hash(h) & pu.mask].get(h, ())
                if type(u) is not tuple or (u and u[0] is KEPT):  # kept by ``_kept.keep``
                    u = restore(u)
                self._out[i] = (ref, u)
            else:
                self._out[i] = (ref, it[1])
            c = book.counters  # ``book.count_hit()``, inline: the usual case
            c.total += 1
            c.hits = hits = c.hits + 1
            book._words[H_HITS] = hits
            return None
        if h in self._putting:  # this request puts it: a hit once that copy is committed
            self._follow(h, i)
            return None
        if it is None:
            if self._sibling is not None and h in self._sibling:
                res = self._reserve_sibling(i, wait=wait, may_defer=may_defer)
                if begin and res is not None:
                    self._job(i, res)
                    return None
                return res
            if begin and any(self._hashes[j] == h for j in self._waits):
                self._wait_for_room(i)  # an earlier item of its hash waits for room: after it
                return None
            # dropped meanwhile (invalidate), or an earlier item of its hash was served inline
            raise CacheMissError([h])
        if book.too_large.sizes:  # mostly empty
            known = book.too_large.get(h)
            if known is not None:
                self._out[i] = it
                book.count(hit=False, inline="too_large", mm_hash=h, nbytes=known)
                return None
        try:
            plan = store.plan(it[0])
            if begin and plan.nbytes < self._inline_below:
                # a small copy: allocate, copy and publish in one step (microseconds, under
                # the lock; nothing can see the chunk before it is committed)
                try:
                    ref = store.put_now(h, plan)  # checked, under the lock
                except (CacheFullError, DuplicateKeyError):
                    raise
                except BaseException:
                    book.count_miss()  # a failed copy counts as a miss
                    raise
                c = book.counters  # ``book.count_miss()``, inline: the usual miss
                c.total = total = c.total + 1
                book._words[H_MISSES] = total - c.hits
                self._handed.append(ref)
                updates = it[1]
                book.keep_updates(h, updates)
                self._out[i] = (ref, updates)
                return None
            res = store.reserve(
                h,
                plan,
                wait_for_space=wait,
                own_pins=Counter(self._pins) if self._pins else None,
                abort=self._gone,
            )
        except DuplicateKeyError:  # not cached: another request is putting it right now
            self._out[i] = it
            book.count(hit=False, inline="busy")
            return None
        except ObjectTooLargeError as exc:
            book.found_too_large(h, exc.nbytes)
            self._out[i] = it
            return None
        except CacheFullError:
            if may_defer and time.monotonic() < self._deadline:
                self._wait_for_room(i)  # counted once it is decided
                return None
            self._out[i] = it
            book.count(hit=False, inline="full", mm_hash=h)
            return None
        self._reserving(res)
        book.count_miss()
        if begin:
            self._job(i, res)
            return None
        return res

    def _job(self, i: int, res: Reservation) -> None:
        """A reservation made in ``begin``: copied now if small (a sibling's chunk), else a
        copy job."""
        if res.plan.nbytes < self._inline_below:
            self._write(res)  # microseconds: under the lock
            self._commit_locked(i, res, pin=False)  # guarded meanwhile (see ``begin``)
            return
        if self._copies is _NONE:
            self._copies = []
        self._copies.append((i, res))

    def _reserving(self, res: Reservation) -> None:
        """Remember an allocation of this request (for the roll back and its followers)."""
        if self._reserved is _NONE:
            self._reserved, self._putting = [], set()
        self._reserved.append(res)
        self._putting.add(res.key)

    def _follow(self, h: str, i: int) -> None:
        """Item ``i`` repeats ``h``, which this request is putting: decided after its commit."""
        if self._followers is None:
            self._followers = {}
        self._followers.setdefault(h, []).append(i)

    def _wait_for_room(self, i: int) -> None:
        if self._waits is _NONE:
            self._waits = []
        self._waits.append(i)

    def _in_sibling(self, h: str) -> bool:
        """Whether a sibling shard holds ``h`` now, in a chunk this shard can hold, and no
        other request of this writer is putting ``h`` (remembered for the decision). One over
        ``max_object_bytes`` here is not, nor one another request is copying in (or putting)
        right now: the look-up is then the plain miss ``_check_lookups`` raises before anything
        is taken or counted (a plain cache's look-up of a hash being put), not a
        ``CacheMissError`` of the decision after the request's earlier items were."""
        sib = self._book.siblings
        if sib is None:
            return False
        found = sib.find(h)
        if found is None or found.ref.length > self._store.max_object_bytes:
            return False
        if self._store.is_pending(h):  # checked in ``begin``'s locked step, as the decision's
            return False
        if self._sibling is None:
            self._sibling = {}
            self._withholds = sib.withholds  # (``begin``'s locked step: as for every look-up)
        self._sibling[h] = found
        return True

    def _reserve_sibling(self, i: int, *, wait: float, may_defer: bool) -> Reservation | None:
        """Reserve room for a copy of a sibling shard's chunk of item ``i`` (see ``_group``).

        No room (and no ``wait_for_space`` left) serves the sibling's item inline, as a plain
        cache serves an item it has no room for: decoded out of the sibling into objects of our
        own (``_read_guest``) and counted as a hit served from a sibling, inline for want of
        room. The sibling's item over our limit is a ``CacheMissError`` (not found up front, in
        ``_in_sibling``).
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
                h,
                found.sibling.raw_plan(found.ref),
                wait_for_space=wait,
                own_pins=Counter(self._pins) if self._pins else None,
                abort=self._gone,
            )
        except CacheFullError:
            if may_defer and time.monotonic() < self._deadline:
                self._wait_for_room(i)
            elif found.ref.length < self._inline_below:
                self._serve_guest_locked(i, self._read_guest(i))  # microseconds: now
            else:
                if self._guests is _NONE:
                    self._guests = []
                self._guests.append(i)  # a copy job of its own, outside the lock
            return None
        except ObjectTooLargeError:
            raise CacheMissError([h]) from None
        self._reserving(res)  # a hit once committed (a copy that fails counts nothing)
        return res

    def _read_guest(self, i: int) -> Any:
        """Look-up ``i``'s item, decoded out of the sibling shard holding it into objects of its
        own; a chunk that changed meanwhile is a miss."""
        h = self._hashes[i]
        found = self._sibling[h] if self._sibling is not None else None
        if found is None:
            raise RuntimeError(f"internal error: {h!r} not found in a sibling")
        try:
            return found.sibling.decode(found.ref, self._store.serde)
        except SerdeError:  # the chunk did not change: the shards' serdes differ
            raise
        except ShmCacheError:  # gone or changed (as ``_write``'s copy into this shard)
            raise CacheMissError([h]) from None

    def _serve_guest_locked(self, i: int, value: Any) -> None:
        """Serve look-up ``i`` inline with its sibling's item (``_read_guest``), counted; as a
        copy's commit (``_commit_locked``): nothing for a caller gone meanwhile, and
        ``ClosedCacheError`` once this writer is closed (its header words released)."""
        if self._abandoned:  # the caller is gone: serve and count nothing (the roll back)
            return
        if self._store.closed:
            raise ClosedCacheError("store closed during the sibling's read")
        h = self._hashes[i]
        if self._withheld_since(h):  # invalidated by this writer meanwhile: the old item
            raise CacheMissError([h])
        self._out[i] = (value, self._copied_updates(i))
        self._book.count(hit=True, sibling=True, inline="full", mm_hash=h)

    def _write(self, res: Reservation) -> None:
        """The copy into a reserved chunk; a sibling's chunk that changed meanwhile is a miss
        (our own store closed meanwhile is not: ``ClosedCacheError``, as for any copy)."""
        try:
            self._store.write_reserved(res)
        except ClosedCacheError:
            raise
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
        if item is None and self._withheld_since(res.key):
            # a sibling's chunk copied while this writer invalidated the hash: the old item,
            # never published (the roll back aborts it); a miss, as for a chunk that changed
            raise CacheMissError([res.key])
        updates: Sequence[Any] = self._copied_updates(i) if item is None else item[1]
        ref = self._store.commit(res)
        if item is None:  # a sibling's chunk, copied: counted as the hit it now is
            self._book.count(hit=True, sibling=True)
        self._handed.append(ref)
        self._putting.discard(res.key)
        self._book.keep_updates(res.key, updates)
        self._out[i] = (ref, updates)
        if pin and (e := self._store.pin_entry(res.key)) is not None:  # protect it from the rest
            if self._pins is _NONE:
                self._pins = []
            self._pins.append(e)
        if self._followers is not None:
            for j in self._followers.pop(res.key, ()):  # the same hash again in this request
                self._decide_locked(j, 0.0, False)

    def _withheld_since(self, key: str) -> bool:
        """Whether ``key``, a copy of a sibling's chunk (reserved, or to serve inline), was
        invalidated by this writer since the sibling was looked at (``Siblings.withheld_since``):
        that chunk is the old item, also when this writer put ``key`` anew meanwhile."""
        sib = self._book.siblings
        return (
            sib is not None
            and self._sibling is not None
            and key in self._sibling
            and sib.withheld_since(key, self._withholds)
        )

    def _copied_updates(self, i: int) -> tuple[Any, ...]:
        """The prompt updates kept for look-up ``i``, copied from a sibling shard: the sibling
        keeps its own in its process, so the look-up's spec gives them (``get_or_put`` passes
        its caller's); none for a request over items (vLLM's ``None`` carries none)."""
        if self._features is None:
            return ()
        u = self._features[i].prompt_updates
        return u if type(u) is tuple else tuple(u)

    def _run_jobs(self) -> None:
        store = self._store
        # ``run`` (the sync face) ends the request in the step of its last commit when no wait
        # follows: that item then needs no pin, since nothing can run between its commit and
        # the end of the request (as ``start`` ends a request without jobs in ``begin``'s step)
        last = -1
        if self._finish_in_jobs and not self._waits and not self._guests:
            last = len(self._copies) - 1
        for n, (i, res) in enumerate(self._copies):
            if self._abandoned:
                return  # the roll back aborts what is left
            self._write(res)  # outside the lock: copies into distinct chunks overlap
            with store.lock:
                if n != last:
                    self._commit_locked(i, res)
                    continue
                self._commit_locked(i, res, pin=False)
                if not self._abandoned:
                    self._finish_locked()
        for i in self._waits:
            if self._abandoned:
                return
            with store.lock:  # the store lets go of the lock while it sleeps
                t0 = time.monotonic()
                waited = self._decide_locked(i, max(0.0, self._deadline - t0), False)
                self._book.counters.wait_seconds += time.monotonic() - t0
            if waited is None or self._abandoned:
                continue
            self._write(waited)
            with store.lock:
                self._commit_locked(i, waited)
        for i in self._guests:  # after the waits, which may add some
            if self._abandoned:
                return
            value = self._read_guest(i)  # outside the lock, as a copy job
            with store.lock:
                self._serve_guest_locked(i, value)

    @classmethod
    def for_features(
        cls,
        store: StoreWriter,
        book: SenderBook,
        features: Sequence[FeatureSpec],
        *,
        wait_for_space: float | None = None,
        copy_inline_below: int = DEFAULT_INLINE_THRESHOLD,
    ) -> SenderRequest:
        """A request over ``FeatureSpec``s: data ``None`` (or a reference) means look it up.

        The core's ``split_features`` first (the steps below in one call), or, declined
        (anything unusual; every call on the pure core), the steps below.
        """
        split = _split_features(features)
        if split is not None:
            features, items, hashes = split
        else:
            features = list(features)
            items = []
            hashes = []
            for f in features:  # one pass, no comprehension frames
                items.append(feature_item(f))  # checks every spec and its hash
                hashes.append(check_hash(f.mm_hash))
        req = cls(
            store,
            book,
            items,
            hashes,
            wait_for_space=wait_for_space,
            copy_inline_below=copy_inline_below,
            _checked=True,
        )
        req._features = features
        return req

    @property
    def features(self) -> list[FeatureSpec]:
        """The specs of a request over features (``TypeError`` for another request)."""
        if self._features is None:
            raise TypeError("not a request over features")
        return self._features

    def run_features(self) -> list[FeatureSpec]:
        """``run`` as new specs whose data is a ``ShmRef`` or the inline item."""
        if self._features is None:
            raise TypeError("not a request over features (use run)")
        return features_from(self._features, self.run())

    def finish_features(self) -> list[FeatureSpec]:
        """``finish`` as new specs whose data is a ``ShmRef`` or the inline item."""
        if self._features is None:
            raise TypeError("not a request over features (use finish)")
        return features_from(self._features, self.finish())

    def finish(self) -> list[MmItem]:
        """Unpin and return one ``(ShmRef or item, prompt_updates)`` per item, in order."""
        with self._lock:
            return self._finish_locked()

    def _finish_locked(self) -> list[MmItem]:
        if self._settled:
            raise RuntimeError("request already finished or rolled back")
        out: list[MmItem] = self._out
        if None in out:
            self._roll_back_locked()
            raise RuntimeError("internal error: an item of the request was not decided")
        self._settled = True
        if self._pins:
            self._unpin_locked()
        return out

    def _unpin_locked(self) -> None:
        for e in self._pins:
            self._store.unpin_entry(e)
        self._pins = _NONE

    def _undo_locked(self) -> None:
        store = self._store
        for ref in self._handed:  # only what this request handed out, never a caller's data
            with contextlib.suppress(ClosedCacheError):  # closed: nothing is owed any more
                store.release(ref)
        for res in self._reserved:
            store.abort(res)  # idempotent: a committed reservation is left alone
        self._unpin_locked()


def run_one(
    store: StoreWriter,
    book: SenderBook,
    mm_item: MmItem | None,
    mm_hash: str,
    *,
    wait_for_space: float | None = None,
) -> MmItem:
    """``get_and_update`` of one item (the sync face's ``get_and_update_item``).

    The core's ``put_item`` first: a plain miss, a hit or a look-up of a cached hash in one
    compiled call, the same steps as the request's (the pure core declines every call); else,
    declined before any side effect, the request (``SenderRequest``, the reference) runs.
    """
    if wait_for_space is None:
        out = _put_item(store, book, mm_item, mm_hash, SYNC_ONE_STEP_PUT_UNDER)
        if out is not None:
            return cast("MmItem", out)
    return SenderRequest(
        store, book, [mm_item], [mm_hash], wait_for_space=wait_for_space, _fresh=True
    ).run()[0]  # ``run`` checks the owner first (before the lock a forked child may hold)


def feature_item(f: FeatureSpec) -> MmItem | None:
    """A ``FeatureSpec`` as the sender's ``(item, prompt_updates)``, or ``None`` (look it up)."""
    if not isinstance(f, FeatureSpec):
        raise TypeError(f"expected FeatureSpec, got {type(f).__name__}")
    if type(f.mm_hash) is not str:
        check_hash(f.mm_hash)
    data = f.data
    if data is None or isinstance(data, ShmRef):
        return None
    u = f.prompt_updates
    return (data, u if type(u) is tuple else tuple(u))


def features_from(features: Sequence[FeatureSpec], results: Sequence[MmItem]) -> list[FeatureSpec]:
    """New specs carrying each result (a ``ShmRef`` or the inline item).

    The core's ``specs_from`` first (the same specs in one call), or, declined, the steps below.
    """
    made: list[FeatureSpec] | None = _specs_from(features, results)
    if made is not None:
        return made
    out = []
    for f, (data, updates) in zip(features, results):
        # FeatureSpec(f.mm_hash, data, identifier=..., prompt_updates=tuple(updates)) without
        # the frozen dataclass's __init__, as ``FeatureSpec.with_data`` does (nothing to check)
        new = _new_object(FeatureSpec)
        _set_field(new, "mm_hash", f.mm_hash)
        _set_field(new, "data", data)
        _set_field(new, "identifier", f.identifier)
        _set_field(new, "prompt_updates", updates if type(updates) is tuple else tuple(updates))
        out.append(new)
    return out


class TooLargeMemory:
    """Hashes remembered as too large to cache (bounded), so they are not serialised again."""

    __slots__ = ("_capacity", "sizes")  # ``sizes``: read by the compiled one-item miss

    def __init__(self, capacity: int = 4096) -> None:
        #: hash -> bytes, oldest first (read it; :meth:`add` and :meth:`get` keep it)
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity

    def get(self, mm_hash: str) -> int | None:
        n = self.sizes.get(mm_hash)
        if n is not None:
            self.sizes.move_to_end(mm_hash)
        return n

    def add(self, mm_hash: str, nbytes: int) -> None:
        self.sizes[mm_hash] = nbytes
        if len(self.sizes) > self._capacity:
            self.sizes.popitem(last=False)

    def discard(self, mm_hash: str) -> None:
        self.sizes.pop(mm_hash, None)

    def clear(self) -> None:
        self.sizes.clear()
