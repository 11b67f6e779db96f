"""Layer 7: the asyncio facade, ``AsyncSenderCache`` and ``AsyncReceiverCache`` (on anyio).

Same method names as the sync classes (``aclose`` for ``close``). Short steps run inline on the
loop: look-ups, hand-outs, small copies (a thread hop costs 75-170 us here, a 64 KiB copy 3 us).
Copies of ``inline_threshold_bytes`` or more run in a worker thread through a
``CapacityLimiter`` with ``np.copyto`` (which releases the GIL), so the loop keeps serving.

Writer state changes (plan and allocate; commit and hand out) are short synchronous sections
under the store's lock, never spanning an ``await``; the copy into an allocated chunk runs outside
the lock, so copies into distinct chunks overlap. Cancellation safety does not rely on anyio's
shielding (a raw ``Task.cancel()`` makes the awaiting task raise at once while the thread runs
on): each offloaded function carries a token guarded by the store lock. The thread finishes every
state change it starts (copy -> commit; read -> verify -> acknowledge); if its caller is gone it
releases the hand-out itself, and if it never started the cancelled caller aborts the
allocations (or acknowledges the unread references) on its way out. Nothing half-written is ever
visible: a chunk becomes readable only when committed, and an abandoned one is reclaimed in FIFO
order.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._store import Reservation
from ._types import CacheConfig, CacheHandle, CacheInfo, CacheSnapshot, FeatureSpec, ShmRef
from .cache import MmItem, ReceiverCache, SenderCache, _check_hash, _feature_item, as_reference
from .errors import CacheFullError, CacheMissError, ClosedCacheError, StaleReferenceError

__all__ = ["DEFAULT_INLINE_THRESHOLD", "AsyncReceiverCache", "AsyncSenderCache"]

#: Copies below this size run on the loop. Measured by bench/bench_async.py on this machine: a
#: thread hop costs 75-170 us, a warm 1 MiB copy ~40 us, so copies under 1 MiB are cheaper inline
#: and keep loop lag below ~0.1 ms; larger ones go to a thread.
DEFAULT_INLINE_THRESHOLD: Final = 1 << 20
CLOSE_TIMEOUT: Final = 10.0

T = TypeVar("T")


class _Token:
    """Hand-off state between an awaiting caller and its worker thread.

    ``started`` and ``abandoned`` are decided under ``lock``: either the thread starts (and then
    finishes or undoes everything itself) or the caller abandons it first (and then undoes it).
    """

    __slots__ = ("abandoned", "lock", "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.abandoned = False


class _InFlight:
    """Counts work in flight so that ``aclose`` can wait for it (bounded)."""

    def __init__(self) -> None:
        self.n = 0
        self.idle = threading.Event()
        self.idle.set()
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.n += 1
            self.idle.clear()

    def exit(self) -> None:
        with self._lock:
            self.n -= 1
            if self.n == 0:
                self.idle.set()


class _AsyncBase:
    _limiter: anyio.CapacityLimiter | None
    _closed: bool

    def __init__(self, *, max_threads: int, inline_threshold_bytes: int) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be >= 1")
        if inline_threshold_bytes < 0:
            raise ValueError("inline_threshold_bytes must be >= 0")
        self._max_threads = max_threads
        self.inline_threshold_bytes = inline_threshold_bytes
        self._limiter = None  # created lazily: constructors do no loop-bound work
        self._closed = False
        self._inflight = _InFlight()

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._max_threads)
        return self._limiter

    def _check(self) -> None:
        if self._closed:
            raise ClosedCacheError("the cache is closed")

    async def _in_thread(
        self, fn: Callable[[_Token], T], on_never_started: Callable[[], None]
    ) -> T | None:
        """Run ``fn(token)`` in a worker thread, safe against any cancellation.

        If the caller is cancelled before the thread starts, ``fn`` never runs and
        ``on_never_started`` undoes its work; once started, ``fn`` sees ``token.abandoned`` and
        must finish or undo what it does itself.
        """
        token = _Token()

        def run() -> T | None:
            with token.lock:
                if token.abandoned:
                    return None
                token.started = True
            try:
                return fn(token)
            finally:
                self._inflight.exit()

        self._inflight.enter()
        try:
            return await anyio.to_thread.run_sync(run, limiter=self.limiter)
        except BaseException:
            with token.lock:
                token.abandoned = True
                never = not token.started
            if never:
                self._inflight.exit()
                on_never_started()
            raise

    async def _wait_idle(self) -> None:
        """Wait (bounded) until no worker thread of ours is still running."""
        if not self._inflight.idle.is_set():
            await anyio.to_thread.run_sync(self._inflight.idle.wait, CLOSE_TIMEOUT)


class AsyncSenderCache(_AsyncBase):
    """The writer's asyncio face.

    ``async with AsyncSenderCache.from_config(cfg) as cache`` creates the segment and owns it;
    ``AsyncSenderCache(sender_cache)`` wraps an existing ``SenderCache`` and only borrows it.
    """

    def __init__(
        self,
        sender: SenderCache | None = None,
        *,
        config: CacheConfig | None = None,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(max_threads=max_threads, inline_threshold_bytes=inline_threshold_bytes)
        if (sender is None) == (config is None):
            raise ValueError("give either a SenderCache to wrap or a config to create one")
        self._sender = sender
        self._config = config
        self._owned = sender is None
        self.inline_busy = 0

    @classmethod
    def from_config(cls, config: CacheConfig, **kwargs: Any) -> AsyncSenderCache:
        """A cache that creates (on ``__aenter__``) and owns its segment."""
        return cls(config=config, **kwargs)

    @property
    def sender(self) -> SenderCache:
        if self._sender is None:
            raise ClosedCacheError("not open yet: use 'async with' (or 'await cache.open()')")
        return self._sender

    async def open(self) -> AsyncSenderCache:
        """Create the segment if this object owns one (fallocate + prefault run in a thread)."""
        self._check()
        if self._sender is None:
            cfg = self._config
            if cfg is None:  # unreachable by construction; never an assert
                raise ClosedCacheError("no configuration")
            self._sender = await anyio.to_thread.run_sync(SenderCache, cfg)
        return self

    async def __aenter__(self) -> AsyncSenderCache:
        return await self.open()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Idempotent: waits (bounded) for copies in flight, then closes an owned segment."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._wait_idle()
            if self._owned and self._sender is not None:
                self._sender.close()

    # --- synchronous queries -------------------------------------------------------------
    def handle(self) -> CacheHandle:
        return self.sender.handle()

    def is_cached_item(self, mm_hash: str) -> bool:
        return self.sender.is_cached_item(mm_hash)

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        return self.sender.is_cached(mm_hashes)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        return self.sender.make_stats(delta=delta)

    def snapshot(self) -> CacheSnapshot:
        return self.sender.snapshot()

    def cached_order(self) -> list[str]:
        return self.sender.cached_order()

    def is_freeable(self, mm_hash: str) -> bool:
        return self.sender.is_freeable(mm_hash)

    # --- the awaitable operations --------------------------------------------------------
    async def get_and_update_item(
        self, mm_item: MmItem | None, mm_hash: str, *, wait_for_space: float | None = None
    ) -> MmItem:
        return (await self.get_and_update([mm_item], [mm_hash], wait_for_space=wait_for_space))[0]

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]:
        items = [_feature_item(f) for f in features]
        results = await self.get_and_update(
            items, [f.mm_hash for f in features], wait_for_space=wait_for_space
        )
        return [
            FeatureSpec(f.mm_hash, data, identifier=f.identifier, prompt_updates=tuple(updates))
            for f, (data, updates) in zip(features, results)
        ]

    async def get_and_update(
        self,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
    ) -> list[MmItem]:
        """A whole request, as ``SenderCache.get_and_update``; big copies run in a thread.

        Always yields to the loop once (before any state change), so that a stream of hits,
        which need no thread, cannot starve other tasks.
        """
        await anyio.lowlevel.checkpoint()
        self._check()
        sender = self.sender
        store = sender.store
        if len(mm_items) != len(mm_hashes):
            raise ValueError("mm_items and mm_hashes differ in length")
        hashes = [_check_hash(h) for h in mm_hashes]
        wait = sender.config.wait_for_space if wait_for_space is None else wait_for_space
        if not (isinstance(wait, (int, float)) and math.isfinite(wait) and wait >= 0):
            raise ValueError("wait_for_space must be a finite number of seconds >= 0")
        out: list[MmItem | None] = [None] * len(hashes)
        big: list[tuple[int, Reservation, Sequence[Any]]] = []
        deferred: list[int] = []  # misses that must wait for space (in a thread)
        pinned: list[Any] = []  # the store's entries this request pinned
        reserved: list[Reservation] = []  # every allocation of step 1
        offloaded = False  # from then on the worker thread (or never_started) owns ``big``
        try:
            # step 1, inline and atomic: pin, hand out the hits, allocate the misses
            with store.lock:
                missing = [
                    h for it, h in zip(mm_items, hashes) if it is None and not store.is_cached(h)
                ]
                if missing:
                    raise CacheMissError(missing)
                pinned = [e for h in hashes if (e := store.pin_entry(h)) is not None]
                small: list[tuple[int, Reservation, Sequence[Any]]] = []
                for i, (it, h) in enumerate(zip(mm_items, hashes)):
                    hit = sender._lookup_locked(it, h)
                    if hit is not None:
                        out[i] = hit
                        continue
                    item = _split_item_async(it)
                    if store.is_pending(h):  # another task is copying this very item
                        self.inline_busy += 1
                        out[i] = item
                        continue
                    try:
                        res = sender._reserve_locked(item, h, 0.0, defer_full=wait > 0)
                    except CacheFullError:  # wait for room, in a thread (never on the loop)
                        deferred.append(i)
                        continue
                    if res is None:
                        out[i] = item
                        continue
                    reserved.append(res)
                    if res.plan.nbytes >= self.inline_threshold_bytes:
                        big.append((i, res, item[1]))
                    else:
                        small.append((i, res, item[1]))
                # small copies inline, still under the lock (microseconds)
                for i, res, updates in small:
                    store.write_reserved(res)  # on error: aborted below with the others
                    out[i] = sender._commit_locked(res, updates)
                    if (e := store.pin_entry(res.key)) is not None:  # protect it from the rest
                        pinned.append(e)
            # step 2: big copies and waiting puts in one worker thread
            if big or deferred:

                def never_started() -> None:
                    with store.lock:
                        for _i, res, _u in big:
                            store.abort(res)

                offloaded = True
                await self._in_thread(
                    lambda tok: self._thread_puts(
                        tok, big, deferred, mm_items, hashes, wait, out, pinned
                    ),
                    never_started,
                )
            done = [r for r in out if r is not None]
            if len(done) != len(out):
                raise RuntimeError("internal error: an item of the request was not resolved")
            return done
        except BaseException:
            with store.lock:  # the caller is gone: give back the hand-outs it took
                for r in out:
                    if r is not None and isinstance(r[0], ShmRef):
                        store.release(r[0])
                if not offloaded:  # nothing else will finish these allocations
                    for res in reserved:
                        store.abort(res)  # idempotent: a committed one is left alone
            raise
        finally:
            with store.lock:
                for e in pinned:
                    store.unpin_entry(e)

    def _thread_puts(
        self,
        token: _Token,
        big: list[tuple[int, Reservation, Sequence[Any]]],
        deferred: list[int],
        mm_items: Sequence[MmItem | None],
        hashes: list[str],
        wait: float,
        out: list[MmItem | None],
        pinned: list[Any],
    ) -> None:
        """Runs in a worker thread: copy -> commit each reservation; wait for room if asked.

        Each commit happens under the store lock together with the check of
        ``token.abandoned``: a caller that is gone gets nothing pinned and nothing handed out.
        """
        store = self.sender.store
        try:
            self._thread_copies(token, big, out, pinned)
        finally:
            with store.lock:  # a copy that failed leaves the rest: abort them (idempotent)
                for _i, res, _u in big:
                    store.abort(res)
        self._thread_waits(token, deferred, mm_items, hashes, wait, out, pinned)

    def _thread_copies(
        self,
        token: _Token,
        big: list[tuple[int, Reservation, Sequence[Any]]],
        out: list[MmItem | None],
        pinned: list[Any],
    ) -> None:
        sender, store = self.sender, self.sender.store
        for i, res, updates in big:
            if token.abandoned:
                with store.lock:
                    store.abort(res)
                continue
            store.write_reserved(res)
            with store.lock:
                ref, upd = sender._commit_locked(res, updates)
                if token.abandoned:
                    store.release(ref)
                else:
                    out[i] = (ref, upd)
                    if (e := store.pin_entry(res.key)) is not None:
                        pinned.append(e)

    def _thread_waits(
        self,
        token: _Token,
        deferred: list[int],
        mm_items: Sequence[MmItem | None],
        hashes: list[str],
        wait: float,
        out: list[MmItem | None],
        pinned: list[Any],
    ) -> None:
        sender, store = self.sender, self.sender.store
        for i in deferred:
            if token.abandoned:
                return
            item = _split_item_async(mm_items[i])
            with store.lock:
                h = hashes[i]
                if store.is_cached(h):  # another request cached it since step 1: now a hit
                    hit = sender._lookup_locked(item, h)
                    if hit is not None and token.abandoned:
                        store.release(hit[0])
                    elif hit is not None:
                        out[i] = hit
                        if (e := store.pin_entry(h)) is not None:
                            pinned.append(e)
                    continue
                if store.is_pending(h):  # another request is copying it right now
                    self.inline_busy += 1
                    out[i] = item
                    continue
                # the store releases its lock while it sleeps on the readers' semaphore
                waited = sender._reserve_locked(item, h, wait, count=False)
                if waited is None:
                    out[i] = item
                    continue
                res = waited
            try:
                store.write_reserved(res)
            except BaseException:
                with store.lock:
                    store.abort(res)
                raise
            with store.lock:
                ref, upd = sender._commit_locked(res, item[1])
                if token.abandoned:
                    store.release(ref)
                else:
                    out[i] = (ref, upd)
                    if (e := store.pin_entry(res.key)) is not None:
                        pinned.append(e)

    async def touch_sender_cache_item(self, mm_hash: str) -> bool:
        self._check()
        return self.sender.touch_sender_cache_item(mm_hash)

    touch = touch_sender_cache_item

    async def release(self, ref: ShmRef) -> bool:
        self._check()
        return self.sender.release(ref)

    async def invalidate(self, mm_hash: str) -> bool:
        self._check()
        return self.sender.invalidate(mm_hash)

    async def clear_cache(self) -> None:
        self._check()
        self.sender.clear_cache()

    clear = clear_cache

    async def remove_dangling_items(self) -> int:
        self._check()
        return self.sender.remove_dangling_items()


def _split_item_async(mm_item: MmItem | None) -> MmItem:
    if mm_item is None or not isinstance(mm_item, tuple) or len(mm_item) != 2:
        raise TypeError("mm_item must be (item, prompt_updates)")
    return mm_item


class AsyncReceiverCache(_AsyncBase):
    """A reader's asyncio face. ``AsyncReceiverCache.attach(handle)`` attaches on ``__aenter__``;
    ``AsyncReceiverCache(receiver_cache)`` wraps (and borrows) an attached ``ReceiverCache``."""

    def __init__(
        self,
        receiver: ReceiverCache | None = None,
        *,
        handle: CacheHandle | str | dict[str, Any] | None = None,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(max_threads=max_threads, inline_threshold_bytes=inline_threshold_bytes)
        if (receiver is None) == (handle is None):
            raise ValueError("give either a ReceiverCache to wrap or a handle to attach")
        self._receiver = receiver
        self._handle = handle
        self._owned = receiver is None

    @classmethod
    def attach(
        cls, handle: CacheHandle | str | dict[str, Any], **kwargs: Any
    ) -> AsyncReceiverCache:
        """A reader that attaches (on ``__aenter__``) and frees its slot on ``aclose``."""
        return cls(handle=handle, **kwargs)

    @property
    def receiver(self) -> ReceiverCache:
        if self._receiver is None:
            raise ClosedCacheError("not attached yet: use 'async with' (or 'await cache.open()')")
        return self._receiver

    async def open(self) -> AsyncReceiverCache:
        self._check()
        if self._receiver is None:
            h = self._handle
            if h is None:
                raise ClosedCacheError("no handle")
            self._receiver = await anyio.to_thread.run_sync(ReceiverCache.attach, h)
        return self

    async def __aenter__(self) -> AsyncReceiverCache:
        return await self.open()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._wait_idle()
            if self._owned and self._receiver is not None:
                self._receiver.close()

    def handle(self) -> CacheHandle:
        return self.receiver.handle()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        return self.receiver.make_stats(delta=delta)

    async def get_and_update_features(self, features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """As ``ReceiverCache.get_and_update_features``; big copies run in a worker thread.

        Yields to the loop once before reading, like the sender.
        """
        await anyio.lowlevel.checkpoint()
        self._check()
        rc = self.receiver
        store = rc.store
        refs, stale = rc._plan(features)
        results: list[Any] = [None] * len(features)
        big: list[int] = []
        i = 0
        try:
            for i, (f, ref) in enumerate(zip(features, refs)):
                rc.total += 1
                if ref is None:
                    results[i] = None if as_reference(f.data) is not None else f.data
                elif ref.length >= self.inline_threshold_bytes:
                    big.append(i)
                else:
                    try:
                        results[i] = store.get(ref)
                        rc.hits += 1
                    except StaleReferenceError:
                        stale.append(f.mm_hash)
        except BaseException:  # what will not be read is owed no more
            rc._give_back(refs[i:] + [refs[j] for j in big])
            raise
        if big:

            def read_all(token: _Token) -> None:
                for i in big:
                    ref = refs[i]
                    if ref is None:
                        continue
                    if token.abandoned:  # caller gone: settle the debt without reading
                        with contextlib.suppress(Exception):
                            store.ack(ref)
                        continue
                    try:
                        results[i] = store.get(ref)
                        rc.hits += 1
                    except StaleReferenceError:
                        stale.append(features[i].mm_hash)

            def never_started() -> None:
                for i in big:
                    ref = refs[i]
                    if ref is not None:
                        with contextlib.suppress(Exception):
                            store.ack(ref)

            await self._in_thread(read_all, never_started)
        out = [f.with_data(d) for f, d in zip(features, results)]
        if stale:
            raise CacheMissError(stale, features=out)
        return out

    async def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        _check_hash(mm_hash)
        ref = as_reference(mm_item)
        if ref is None:
            self._check()
            return self.receiver.get_and_update_item(mm_item, mm_hash)
        try:
            out = await self.get_and_update_features([FeatureSpec(mm_hash, ref)])
        except CacheMissError:
            raise StaleReferenceError(f"reference for {mm_hash!r} is stale") from None
        return out[0].data

    async def release(self, ref: ShmRef) -> bool:
        """As ``ReceiverCache.release``: give back a hand-out this reader will not read."""
        self._check()
        return self.receiver.release(ref)

    async def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        self._check()
        self.receiver.touch_receiver_cache_item(mm_hash, mm_item)

    touch = touch_receiver_cache_item

    async def clear_cache(self) -> None:
        self._check()
        self.receiver.clear_cache()

    clear = clear_cache

    @contextlib.asynccontextmanager
    async def lease(self, features: Sequence[FeatureSpec]) -> AsyncIterator[list[FeatureSpec]]:
        """Zero-copy: arrays are views into shared memory until the block exits (then acked)."""
        self._check()
        with self.receiver.lease(features) as items:
            yield items
