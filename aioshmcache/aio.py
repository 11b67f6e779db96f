"""The asyncio facade, ``AsyncSenderCache`` and ``AsyncReceiverCache`` (on anyio).

Same method names as the sync classes (``aclose`` for ``close``), and the same algorithm: each
call builds the sync cache's own request object (``SenderCache._request`` /
``ReceiverCache._request``) and runs its steps. The only decisions made here are *where* the copy
jobs run — inline on the loop below ``inline_threshold_bytes`` (a thread hop costs 75-170 us
here, a 64 KiB copy 3 us), else in a worker thread through a ``CapacityLimiter``, where the
numpy array assignments of the copy release the GIL — and what cancellation does:
``request.abandon()``.

Cancellation safety does not rely on anyio's shielding (a raw ``Task.cancel()`` makes the
awaiting task raise at once while the thread runs on). ``abandon`` rolls the request back at once
if its jobs never started, or leaves it to the thread, which rolls back itself when its jobs
end; either way exactly once. Nothing half-written is ever visible: a chunk becomes readable
only when committed, and an abandoned one is reclaimed in FIFO order.

``AsyncSenderCache.get_or_put`` adds single-flight puts (one preprocessing per new hash among
concurrent callers); its bookkeeping lives in ``_flight`` and drives the same requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, Final, Generic, Protocol, TypeVar, overload

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import AsyncResource

from ._core_api import core
from ._flight import FROM_SIBLING, GroupFlight, SingleFlight, SingleFlightStats, call_make
from ._loop_turns import turns
from ._request import (
    DEFAULT_INLINE_THRESHOLD,
    SenderRequest,
    check_hash,
    feature_item,
    features_from,
)
from ._serde import Serde
from ._types import (
    CacheConfig,
    CacheHandle,
    CacheInfo,
    CacheSnapshot,
    FeatureSpec,
    ShmRef,
    TierSnapshot,
    coerce_handle,
)
from .cache import (
    MmItem,
    Receiver,
    ReceiverCache,
    SenderCache,
    all_as_given,
    as_given,
    kept_form,
    kept_forms,
)
from .errors import ClosedCacheError, RoleError

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_READ_INLINE_THRESHOLD",
    "AsyncReceiverCache",
    "AsyncSenderCache",
    "SingleFlightStats",
]

CLOSE_TIMEOUT: Final = 10.0
#: The reader face's default ``inline_threshold_bytes``: reads below 2 MiB copy on the loop.
#: Measured here (one process, uvloop, the compiled core's copy into pages it reuses): a read of
#: 1 MiB on the loop took 38 us, of 2 MiB 61 us, against 190-230 us through a worker thread (the
#: hop alone ~150-170 us). Kept out of the loop above: a read whose pages are fresh (a reader that
#: keeps its items) took 340 us for 1 MiB, 700 us for 2 MiB and 9 ms for 4 MiB.
DEFAULT_READ_INLINE_THRESHOLD: Final = 2 << 20
#: An awaitable call whose request has no jobs (every copy inline) yields to the loop before it
#: begins only on every ``CHECKPOINT_EVERY``-th such call of the face, or when
#: ``CHECKPOINT_AFTER`` seconds passed since it last yielded: a checkpoint per call was a loop
#: round per call (most of the async face's cost), while a stream of hits still lets other
#: tasks run at least every few calls (and every half millisecond of inline copies). At 8 the
#: checkpoints still cost 0.3-0.45 µs per 1 KiB call (issue 29: ≤ 1.5 µs over the sync call);
#: 32 calls of 1 KiB take ~0.1-0.4 ms, inside the time bound. Both count from the first inline
#: call after the loop last turned: calls that each await something that suspends never yield
#: on their own. The face learns of a turn from the package's own I/O callbacks when they ran
#: since its last call (an engine channel's answer: ``_loop_turns``), else from a callback it
#: queues on the loop (``_note_turn``).
CHECKPOINT_EVERY: Final = 32
CHECKPOINT_AFTER: Final = 0.0005
_monotonic = time.monotonic
_specs_from = core.specs_from  # ``_request.features_from``'s core step

C = TypeVar("C", SenderCache, Receiver)


class SecondTier(Protocol):
    """What ``AsyncSenderCache(tier=...)`` needs of a second tier (``aioshmcache.tier``): an
    anyio ``AsyncResource`` (``async with``, ``aclose``) that fetches or makes items."""

    async def __aenter__(self) -> object:
        """Start (no I/O that may fail: the tier may be down)."""
        ...

    async def aclose(self) -> None:
        """Stop (idempotent)."""
        ...

    async def fetch_or_make(self, mm_hash: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """The item: from the tier, or ``make()`` (whose item the tier stores behind)."""
        ...

    def stats(self) -> TierSnapshot:
        """The tier's counters."""
        ...


class _InFlight:
    """Counts jobs handed to worker threads so that ``aclose`` can wait for them (bounded).

    A job is counted from ``add`` until it has run, or until ``cancel`` withdraws it before its
    thread started (a task cancelled while it waits for the limiter): then it never runs.
    """

    def __init__(self) -> None:
        self._n = 0
        self.idle = threading.Event()
        self.idle.set()
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Jobs counted right now (added, and neither run nor withdrawn yet)."""
        return self._n

    def add(self, fn: Callable[[], None]) -> _Job:
        with self._lock:
            self._n += 1
            self.idle.clear()
        return _Job(self, fn)

    def done(self) -> None:
        with self._lock:
            self._n -= 1
            if self._n == 0:
                self.idle.set()


class _Job:
    """One job for a worker thread: runs once, or is withdrawn before it starts."""

    def __init__(self, owner: _InFlight, fn: Callable[[], None]) -> None:
        self._owner = owner
        self._fn = fn
        self._state = "queued"  # -> running | withdrawn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self._state != "queued":
                return
            self._state = "running"
        try:
            self._fn()
        finally:
            self._owner.done()

    def withdraw(self) -> None:
        """The caller is gone: if the job has not started, it never will."""
        with self._lock:
            if self._state != "queued":
                return
            self._state = "withdrawn"
        self._owner.done()


class _AsyncFace(AsyncResource, Generic[C]):
    """What both twins share: lifetime (own or borrow), the thread limiter, the job driver.

    An anyio ``AsyncResource``: ``async with`` opens what the object owns (creates the segment,
    attaches the reader) and ``aclose`` (idempotent) closes it.
    """

    def _init_face(self, cache: C | None, *, max_threads: int, inline_threshold_bytes: int) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be >= 1")
        if inline_threshold_bytes < 0:
            raise ValueError("inline_threshold_bytes must be >= 0")
        self._max_threads = max_threads
        self.inline_threshold_bytes = inline_threshold_bytes
        self._limiter: anyio.CapacityLimiter | None = None  # lazily: no loop-bound work here
        self._cache: C | None = cache
        self._owned = cache is None
        self._closed = False
        self._inflight = _InFlight()
        self._inline_calls = 0  # inline calls since this face last yielded to the loop
        self._last_yield = _monotonic()
        self._turn_noted = False  # a ``_turned`` callback is queued on the loop
        self._loop_turned = False  # it ran: the loop turned since the last inline call
        self._turns_seen = turns()  # ``turns()`` at the last inline call (or at the start)
        #: the last inline call found an I/O turn (``_loop_turns``) and queued nothing: the next one
        #: cannot tell whether the loop turned since, so it does not apply the time bound
        self._unwatched = False

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` was called (or the wrapped cache was closed)."""
        return self._closed or (self._cache is not None and self._cache.closed)

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The limiter of the worker threads that run big copies."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._max_threads)
        return self._limiter

    def _open_cache(self) -> C:
        raise NotImplementedError

    def _wrapped(self) -> C:
        if self._closed:
            raise ClosedCacheError("the cache is closed")
        if self._cache is None:
            raise ClosedCacheError("not open yet: use 'async with'")
        return self._cache

    async def _open(self) -> None:
        if self._closed:
            raise ClosedCacheError("the cache is closed")
        if self._cache is None:
            self._cache = await anyio.to_thread.run_sync(self._open_cache)

    async def aclose(self) -> None:
        """Close: wait (bounded) for jobs in worker threads, then close what this object owns.

        An owned sender unlinks its segment (first, a job of its waiting for space is woken and
        fails with ``ClosedCacheError``: ``StoreWriter.stop_waits``; the others finish), an
        owned reader frees its slot; a borrowed cache is left open. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._owned and self._cache is not None:
                self._before_close(self._cache)
            if not self._inflight.idle.is_set():
                await anyio.to_thread.run_sync(self._inflight.idle.wait, CLOSE_TIMEOUT)
            if self._owned and self._cache is not None:
                self._cache.close()

    def _before_close(self, cache: C) -> None:
        """What an owned cache does before its jobs are waited for (a sender: ``stop_waits``)."""

    def _due(self) -> bool:
        """Whether this inline call should yield to the loop first (see ``CHECKPOINT_EVERY``)."""
        now = _monotonic()
        seen = turns()
        io_turn = seen != self._turns_seen
        if io_turn or self._loop_turned:
            self._turns_seen = seen
            self._restart(now)
        n = self._inline_calls + 1
        if n >= CHECKPOINT_EVERY or (
            not self._unwatched and now - self._last_yield >= CHECKPOINT_AFTER
        ):
            self._inline_calls = 0
            self._last_yield = now
            self._unwatched = False
            if not self._turn_noted:
                self._note_turn()  # the yield turns it
            return True
        self._inline_calls = n
        self._unwatched = io_turn
        if not io_turn and not self._turn_noted:
            self._note_turn()  # whatever the caller awaits next turns it
        return False

    def _note_turn(self) -> None:
        """Learn when the loop next turns (``_turned``): a call that awaited something that
        suspended let the other tasks run, so the calls after it start a new count instead of
        yielding again for the same turn. Not queued by a call that found the package's I/O
        callbacks had turned the loop (``_loop_turns``: a channel's answer came): its caller
        awaits such answers, which will say so again."""
        self._turn_noted = True
        asyncio.get_running_loop().call_soon(self._turned)

    def _turned(self) -> None:
        self._turn_noted = False
        self._loop_turned = True

    def _restart(self, now: float) -> None:
        """The loop turned since the last inline call: count from this call."""
        self._loop_turned = False
        self._inline_calls = 0
        self._last_yield = now

    def _drive(self, request: Any) -> Coroutine[Any, Any, None] | None:
        """Run a request's steps as far as they go on the loop; what is left to await, if any.

        The awaitable calls do ``if (pending := self._drive(req)) is not None: await pending``:
        a request without jobs (every copy inline) whose turn to yield is not due (``_due``)
        runs entirely here, with no loop round and no coroutine besides the call's own. On any
        exception or cancellation the request is abandoned (rolled back exactly once, by this
        task or by the thread still running its jobs).
        """
        if self._due():
            return self._yield_then_run(request)
        return self._run_jobs(request) if self._begin(request) else None

    async def _yield_then_run(self, request: Any) -> None:
        try:
            await anyio.lowlevel.checkpoint()  # before anything is read
        except BaseException:  # cancelled: the read never runs, its references are given back
            request.abandon()
            raise
        if self._begin(request):
            await self._run_jobs(request)

    @staticmethod
    def _begin(request: Any) -> bool:
        """``begin`` a request (abandoned if it raises); whether it has jobs to run."""
        try:
            request.begin()
        except BaseException:
            request.abandon()
            raise
        return bool(request.has_jobs)

    async def _run_jobs(self, request: Any) -> None:
        """The request's jobs in a worker thread (the thread hop is the loop's turn)."""
        self._inline_calls = 0
        job = self._inflight.add(request.run_jobs)
        try:
            await anyio.to_thread.run_sync(job, limiter=self.limiter)
        except BaseException:
            job.withdraw()
            request.abandon()
            raise
        finally:
            self._last_yield = _monotonic()


class AsyncSenderCache(_AsyncFace[SenderCache]):
    """The writer's asyncio face.

    ``async with AsyncSenderCache.from_config(cfg) as cache`` creates the segment and owns it;
    ``AsyncSenderCache(sender_cache)`` wraps an existing ``SenderCache`` and only borrows it.
    Use it from one event loop. ``get_or_put`` adds single-flight puts to the sync methods.
    """

    def __init__(
        self,
        sender: SenderCache,
        *,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
        tier: SecondTier | None = None,
    ) -> None:
        """Wrap ``sender``, borrowed: ``aclose`` leaves it open (``from_config`` creates one).

        ``max_threads`` bounds the worker threads of big copies (and, separately, those of
        ``get_or_put``'s sync ``make``); copies under ``inline_threshold_bytes`` run on the
        loop. ``tier`` (an ``aioshmcache.tier.RedisTier``) is a second tier ``get_or_put`` looks
        in before it calls ``make``; this object enters and closes it. Does no loop-bound work:
        it can be built outside a running loop.
        """
        if not isinstance(sender, SenderCache):
            raise TypeError(
                f"AsyncSenderCache wraps a SenderCache, not {type(sender).__name__} "
                "(AsyncSenderCache.from_config(config) creates one)"
            )
        self._setup(sender, sender.config, None, max_threads, inline_threshold_bytes, tier)

    def _before_close(self, cache: SenderCache) -> None:
        cache.stop_waits()  # a job waiting for space ends now, not at CLOSE_TIMEOUT

    async def stop_waits(self) -> None:
        """Wake every request waiting for space and fail it, and any later wait, with
        ``ClosedCacheError`` (``SenderCache.stop_waits``; ``aclose`` of an owned cache does it
        first)."""
        self.sender.stop_waits()

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        *,
        serde: Serde | None = None,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
        tier: SecondTier | None = None,
    ) -> AsyncSenderCache:
        """A cache that creates its segment on ``async with`` and owns it (``aclose`` unlinks).

        ``serde`` replaces the default ``MsgpackSerde``; the other keywords as for the
        constructor. A plain call (not awaited): nothing is created until ``async with``.
        """
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, not {type(config).__name__}")
        face = cls.__new__(cls)
        face._setup(None, config, serde, max_threads, inline_threshold_bytes, tier)
        return face

    def _setup(
        self,
        sender: SenderCache | None,
        config: CacheConfig,
        serde: Serde | None,
        max_threads: int,
        inline_threshold_bytes: int,
        tier: SecondTier | None,
    ) -> None:
        """What both constructors set: a wrapped ``sender``, or the ``config`` to create one."""
        self._init_face(
            sender, max_threads=max_threads, inline_threshold_bytes=inline_threshold_bytes
        )
        self._config = config
        self._serde = serde
        group = config.group
        self._group_flight = None if group is None else GroupFlight(group)  # across processes
        self._flight: SingleFlight[FeatureSpec] = SingleFlight(
            on_end=None if self._group_flight is None else self._group_flight.release
        )
        self._make_limiter: anyio.CapacityLimiter | None = None
        self._tier = tier

    def _open_cache(self) -> SenderCache:
        return SenderCache(self._config, serde=self._serde)

    def _send(self, req: SenderRequest) -> list[MmItem] | Coroutine[Any, Any, list[MmItem]]:
        """Run a sender request as far as it goes on the loop: its result, or what is left to
        await (a turn to yield, copy jobs in a thread).

        The calls do ``out = self._send(req)`` and await ``out`` unless it is the result: a
        request whose copies all run inline (``SenderRequest.start`` ends it in one locked step)
        and whose turn to yield is not due (``_due``) costs no loop round and no coroutine
        besides the call's own. On any exception or cancellation the request is abandoned.
        """
        if self._due():
            return self._yield_then_send(req)
        try:
            out = req.start()
        except BaseException:
            req.abandon()
            raise
        return out if out is not None else self._jobs_then_finish(req)

    def _one_step(self, sent: MmItem | None, mm_hash: str) -> MmItem | None:
        """The core's one-item call on the loop (a hit, a look-up, or a miss whose copy is under
        ``inline_threshold_bytes``), when no turn to yield is due: its result, or None (declined
        before any side effect, or a turn due: the request's path runs and takes the turn).
        Counted as one inline call.

        Every call of a steady channel's gateway runs it: ``_restart`` and ``_wrapped`` are
        inlined (their frames were ~0.4k instructions a call)."""
        now = _monotonic()
        seen = turns()
        io_turn = seen != self._turns_seen
        if io_turn or self._loop_turned:  # ``_restart(now)``
            self._loop_turned = False
            self._inline_calls = 0
            self._last_yield = now
        n = self._inline_calls + 1
        if n >= CHECKPOINT_EVERY or (
            not self._unwatched and now - self._last_yield >= CHECKPOINT_AFTER
        ):
            return None
        cache = self._cache
        if cache is None or self._closed:
            cache = self._wrapped()  # raises ``ClosedCacheError``, as it says
        done = cache._put_one(sent, mm_hash, self.inline_threshold_bytes)
        if done is not None:  # (declined: the request's ``_due`` still finds the I/O turn)
            self._inline_calls = n
            self._turns_seen = seen
            self._unwatched = io_turn
            if not io_turn and not self._turn_noted:
                self._note_turn()
        return done

    async def _yield_then_send(self, req: SenderRequest) -> list[MmItem]:
        await anyio.lowlevel.checkpoint()  # before anything is taken: nothing to undo
        try:
            out = req.start()
        except BaseException:
            req.abandon()
            raise
        return out if out is not None else await self._jobs_then_finish(req)

    async def _jobs_then_finish(self, req: SenderRequest) -> list[MmItem]:
        await self._run_jobs(req)
        return req.finish()

    @property
    def sender(self) -> SenderCache:
        """The sync cache this face drives."""
        return self._wrapped()

    @property
    def name(self) -> str:
        """The segment's name (``aioshm-...``), as ``SenderCache.name``."""
        return self.sender.name

    @property
    def group(self) -> str | None:
        """The cache group this writer is a shard of (None for a plain cache)."""
        return self.sender.group

    @property
    def config(self) -> CacheConfig:
        """The configuration the cache was created with, as ``SenderCache.config``."""
        return self.sender.config

    @property
    def shard(self) -> int | None:
        """This writer's shard index in its group (None for a plain cache)."""
        return self.sender.shard

    async def __aenter__(self) -> AsyncSenderCache:
        """Enter ``async with``: create the segment if this object owns one (fallocate and
        prefault run in a thread), then enter the tier; if that fails, close again."""
        await self._open()
        if self._tier is not None:
            try:
                await self._tier.__aenter__()
            except BaseException:
                await self.aclose()
                raise
        return self

    async def aclose(self) -> None:
        """Close the tier (its queued writes flushed, bounded), then as the base class."""
        if self._tier is not None:
            with anyio.CancelScope(shield=True):
                await self._tier.aclose()
        await super().aclose()

    @property
    def tier(self) -> SecondTier | None:
        """The second tier ``get_or_put`` consults, if any."""
        return self._tier

    def tier_stats(self) -> TierSnapshot | None:
        """The second tier's counters (``snapshot().tier``, readable once closed too); None
        without a tier."""
        return None if self._tier is None else self._tier.stats()

    @property
    def inline_busy(self) -> int:
        """Items served inline because another request was putting the same hash."""
        return self.sender.inline_busy

    def handle(self) -> CacheHandle:
        """What a reader needs to attach."""
        return self.sender.handle()

    @overload  # a str is a Sequence[str] too: this first overload wins for it
    def is_cached(self, mm_hash: str, *, rescan: bool = False) -> bool: ...  # type: ignore[overload-overlap]

    @overload
    def is_cached(self, mm_hash: Sequence[str], *, rescan: bool = False) -> list[bool]: ...

    def is_cached(self, mm_hash: str | Sequence[str], *, rescan: bool = False) -> bool | list[bool]:
        """Pure look-up: no hand-out, no change to eviction order; one hash or a list, as the
        sync cache's (``rescan`` too)."""
        return self.sender.is_cached(mm_hash, rescan=rescan)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and total; with ``delta`` the change since the previous delta call."""
        return self.sender.make_stats(delta=delta)

    def snapshot(self) -> CacheSnapshot:
        """What an operator watches: counters, usage, every reader slot and the tier's counters.

        ``tier`` is the second tier's ``TierSnapshot`` (None without a tier): the tier lives in
        this face, not in the wrapped ``SenderCache``, whose own snapshot has none.
        """
        snap = self.sender.snapshot()
        return snap if self._tier is None else replace(snap, tier=self._tier.stats())

    def cached_order(self) -> list[str]:
        """Cached hashes oldest first (the FIFO eviction order)."""
        return self.sender.cached_order()

    def is_freeable(self, mm_hash: str) -> bool:
        """Whether the item's chunk could be evicted now."""
        return self.sender.is_freeable(mm_hash)

    async def get_and_update_item(
        self, mm_item: MmItem | None, mm_hash: str, *, wait_for_space: float | None = None
    ) -> MmItem:
        """As ``SenderCache.get_and_update_item``; big copies and waits run in a thread."""
        sent = kept_form(mm_item)  # the prompt updates as the sender keeps them
        if wait_for_space is None and (done := self._one_step(sent, mm_hash)) is not None:
            return as_given(mm_item, sent, done)
        out = self._send_one(sent, mm_hash, wait_for_space)
        return as_given(mm_item, sent, (out if type(out) is list else await out)[0])  # type: ignore[misc]

    def _send_one(
        self, sent: MmItem | None, mm_hash: str, wait_for_space: float | None
    ) -> list[MmItem] | Coroutine[Any, Any, list[MmItem]]:
        """``_send`` of the request of one item (``sent``, in the kept form): what a one-item
        call runs when its first step (``_one_step``) declined."""
        req = self._wrapped()._request(  # ``self.sender``, one call shorter
            [sent],
            [mm_hash],
            wait_for_space=wait_for_space,
            copy_inline_below=self.inline_threshold_bytes,
            _fresh=True,
        )
        return self._send(req)

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]:
        """As ``SenderCache.get_and_update_features``; big copies and waits run in a thread."""
        if wait_for_space is None and type(features) is list and len(features) == 1:
            f = features[0]
            if type(f) is FeatureSpec and f.data is None and type(f.mm_hash) is str:
                item = None  # a look-up: ``feature_item``'s answer, without its frame
            else:
                item = feature_item(f)  # checks the spec and its hash, as the request does
            if (done := self._one_step(item, f.mm_hash)) is not None:  # a look-up too
                made = _specs_from(features, [done])  # ``features_from``'s core step
                return made if made is not None else features_from(features, [done])
        req = self._wrapped()._features_request(  # ``self.sender``, one call shorter
            features, wait_for_space=wait_for_space, copy_inline_below=self.inline_threshold_bytes
        )
        out = self._send(req)
        return features_from(req.features, out if type(out) is list else await out)  # type: ignore[misc]

    async def get_and_update(
        self,
        mm_items: Sequence[MmItem | None],
        mm_hashes: Sequence[str],
        *,
        wait_for_space: float | None = None,
    ) -> list[MmItem]:
        """As ``SenderCache.get_and_update``; big copies and waits run in a thread."""
        given = mm_items if type(mm_items) is list else list(mm_items)
        if len(given) == 1 and type(mm_hashes) in (list, tuple) and len(mm_hashes) == 1:
            # one item: ``get_and_update_item``'s steps (the same algorithm), without its
            # coroutine
            it, h = given[0], mm_hashes[0]
            kept = kept_form(it)
            if wait_for_space is None and (done := self._one_step(kept, h)) is not None:
                return [as_given(it, kept, done)]
            one = self._send_one(kept, h, wait_for_space)
            return [as_given(it, kept, (one if type(one) is list else await one)[0])]  # type: ignore[misc]
        sent = kept_forms(given)  # the prompt updates as the sender keeps them
        req = self._wrapped()._request(  # ``self.sender``, one call shorter
            sent,
            mm_hashes,
            wait_for_space=wait_for_space,
            copy_inline_below=self.inline_threshold_bytes,
        )
        out = self._send(req)
        return all_as_given(given, sent, out if type(out) is list else await out)  # type: ignore[misc]

    async def get_or_put(
        self,
        mm_hash: str,
        make: Callable[[], Any],
        *,
        identifier: str | None = None,
        prompt_updates: Sequence[Any] = (),
        wait_for_space: float | None = None,
    ) -> FeatureSpec:
        """The feature of ``mm_hash``, preprocessing it with ``make()`` only if nobody has.

        Single flight: a cached hash is handed out at once (``make`` is not called). Otherwise
        the first caller runs ``make()`` — awaited if it is a coroutine function, else in a
        worker thread (its own limiter of ``max_threads`` threads, apart from the copies') —
        and puts the item; concurrent callers of the same hash wait for that put and then get
        their own hand-out. Every caller gets its own ``FeatureSpec`` whose data is its own
        ``ShmRef``, or the item itself when it cannot be cached (too large, no room).

        If ``make`` (or the put) raises, every waiter gets an exception of the same type and
        nothing is cached; the next call tries again. If the first caller is cancelled, a
        waiter takes over (reusing the item if ``make`` had returned); the cancelled caller's
        hand-out is rolled back. ``prompt_updates`` are stored with the item when it is put; a
        caller served by a hit at once gets the stored ones. Counters: ``single_flight_stats``.

        In a cache group the flight spans the group's processes: a hash that a sibling process
        is computing right now is waited for (up to ``_flight.GROUP_WAIT_S``) and then read
        from its shard, not computed again (``group_saved``; see ``_flight.GroupFlight``).

        With a ``tier``, the first caller looks in the tier before it calls ``make`` (an item
        found there is put as if made here) and ``make``'s item is stored in the tier behind
        the request; see ``aioshmcache.tier`` and ``tier_stats()``.
        """
        mm_hash = check_hash(mm_hash)
        updates = tuple(prompt_updates)

        async def call_make_counted() -> Any:  # every call of ``make`` is a counted run
            self._flight.count_run()
            return await call_make(make, self.make_limiter)

        async def make_here() -> Any:
            if self._tier is not None:  # shared memory missed: the tier, then ``make``
                return await self._tier.fetch_or_make(mm_hash, call_make_counted)
            return await call_make_counted()

        async def put(data: Any) -> FeatureSpec:
            if data is FROM_SIBLING:  # a sibling put it: a hit (its copy into our shard)
                data = None  # (gone again: ``CacheMissError``, the flight makes it then)
            spec = FeatureSpec(mm_hash, data, identifier=identifier, prompt_updates=updates)
            [out] = await self.get_and_update_features([spec], wait_for_space=wait_for_space)
            return out

        async def run_make() -> Any:
            gf = self._group_flight  # a sibling process computing it: wait, then read its item
            if gf is not None and not await gf.claim(
                mm_hash,
                lambda: self.is_cached(mm_hash),
                lambda: self.is_cached(mm_hash, rescan=True),
            ):
                return FROM_SIBLING
            return await make_here()

        return await self._flight.run(
            mm_hash,
            run_make,
            cached=lambda: self.is_cached(mm_hash),
            hit=lambda: put(None),
            put=put,
            make_anyway=make_here,
        )

    @property
    def make_limiter(self) -> anyio.CapacityLimiter:
        """The limiter of the worker threads that run ``get_or_put``'s sync ``make``."""
        if self._make_limiter is None:
            self._make_limiter = anyio.CapacityLimiter(self._max_threads)
        return self._make_limiter

    def single_flight_stats(self) -> SingleFlightStats:
        """What ``get_or_put`` counted: calls, hits, runs of ``make``, saved, failures."""
        return self._flight.stats()

    async def touch(self, mm_hash: str) -> bool:
        """Protect a cached item from eviction until its next hand-out; False if not cached."""
        return self.sender.touch(mm_hash)

    async def release(self, ref: ShmRef) -> bool:
        """Undo a hand-out whose request failed before reaching the readers."""
        return self.sender.release(ref)

    async def invalidate(self, mm_hash: str) -> bool:
        """Forget an item; the next request re-puts it (``SenderCache.invalidate``: references
        handed out before stay readable until acknowledged)."""
        return self.sender.invalidate(mm_hash)

    async def clear(self) -> None:
        """Drop everything; a new epoch makes every older reference stale."""
        self.sender.clear()

    async def remove_dangling_items(self) -> int:
        """Free every freeable chunk at the head; drop side-table rows of evicted items."""
        return self.sender.remove_dangling_items()


class AsyncReceiverCache(_AsyncFace[Receiver]):
    """A reader's asyncio face. ``AsyncReceiverCache.attach(handle)`` attaches on ``async with``
    and frees its slot on ``aclose``; ``AsyncReceiverCache(receiver)`` wraps (and borrows) an
    attached reader: a ``ReceiverCache`` or a ``GroupReceiverCache``."""

    def __init__(
        self,
        receiver: Receiver,
        *,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_READ_INLINE_THRESHOLD,
    ) -> None:
        """Wrap ``receiver``, borrowed: ``aclose`` leaves it open (``attach`` attaches one).

        ``max_threads`` bounds the worker threads of big reads; reads under
        ``inline_threshold_bytes`` (default 2 MiB, ``DEFAULT_READ_INLINE_THRESHOLD``) run on
        the loop.
        """
        if not isinstance(receiver, Receiver):
            raise TypeError(
                f"AsyncReceiverCache wraps a ReceiverCache, not {type(receiver).__name__} "
                "(AsyncReceiverCache.attach(handle) attaches one)"
            )
        self._setup(receiver, None, None, None, 0.0, max_threads, inline_threshold_bytes)

    @classmethod
    def attach(
        cls,
        handle: object,
        *,
        serde: Serde | None = None,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_READ_INLINE_THRESHOLD,
    ) -> AsyncReceiverCache:
        """A reader that attaches on ``async with`` and frees its slot on ``aclose``.

        ``handle`` as for ``ReceiverCache.attach`` (a handle, its dict or JSON, or a name);
        ``serde`` replaces the default ``MsgpackSerde``; the other keywords as for the
        constructor. A plain call (not awaited); a malformed handle is refused here, at once.
        """
        face = cls.__new__(cls)
        face._setup(
            None, coerce_handle(handle), None, serde, 0.0, max_threads, inline_threshold_bytes
        )
        return face

    @classmethod
    def attach_group(
        cls,
        group: str,
        *,
        serde: Serde | None = None,
        wait_for_shard: float | None = 0.0,
        max_threads: int = 4,
        inline_threshold_bytes: int = DEFAULT_READ_INLINE_THRESHOLD,
    ) -> AsyncReceiverCache:
        """A reader of every shard of cache group ``group`` (``ReceiverCache.attach_group``),
        attached on ``async with`` (in a worker thread: a ``wait_for_shard`` wait does not
        block the loop); ``aclose`` frees its slot on every shard."""
        face = cls.__new__(cls)
        face._setup(None, None, group, serde, wait_for_shard, max_threads, inline_threshold_bytes)
        return face

    def _setup(
        self,
        receiver: Receiver | None,
        handle: CacheHandle | str | None,
        group: str | None,
        serde: Serde | None,
        wait_for_shard: float | None,
        max_threads: int,
        inline_threshold_bytes: int,
    ) -> None:
        """What the constructors set: a wrapped ``receiver``, or what to attach to."""
        self._init_face(
            receiver, max_threads=max_threads, inline_threshold_bytes=inline_threshold_bytes
        )
        self._handle = handle
        self._group = group
        self._wait_for_shard = wait_for_shard
        self._serde = serde

    def _open_cache(self) -> Receiver:
        if self._group is not None:
            return ReceiverCache.attach_group(
                self._group, serde=self._serde, wait_for_shard=self._wait_for_shard
            )
        return ReceiverCache.attach(self._handle, serde=self._serde)

    @property
    def receiver(self) -> Receiver:
        """The sync cache this face drives (a ``GroupReceiverCache`` after ``attach_group``)."""
        return self._wrapped()

    async def __aenter__(self) -> AsyncReceiverCache:
        """Enter ``async with``: attach and claim a reader slot (in a thread) if this object
        owns its reader."""
        await self._open()
        return self

    def handle(self) -> CacheHandle:
        """The handle of the segment this reader is attached to.

        A reader of a cache group has one handle per shard: ``RoleError`` (its ``receiver``'s
        ``shard_handles()`` lists them).
        """
        receiver = self.receiver
        if not isinstance(receiver, ReceiverCache):
            group = getattr(receiver, "group", None)
            raise RoleError(f"a reader of cache group {group!r} has one handle per shard")
        return receiver.handle()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """References resolved (hits) of features seen (total)."""
        return self.receiver.make_stats(delta=delta)

    async def get_and_update_features(self, features: Sequence[FeatureSpec]) -> list[FeatureSpec]:
        """As ``ReceiverCache.get_and_update_features``; big copies run in a worker thread.

        One spec of a plain item below the threshold, when no yield is due, is read in one core
        call (``ReceiverCache._read_one_feature``, as the sync face reads it); anything else by
        the request.
        """
        receiver = self._wrapped()  # ``self.receiver``, one call shorter
        below = self.inline_threshold_bytes
        if len(features) == 1 and type(receiver) is ReceiverCache:
            due = self._due()  # asked once: ``_drive``'s steps follow, without asking again
            if not due:
                got = receiver._read_one_feature(features, below)
                if got is not None:
                    return got
            req = receiver._request(features, copy_inline_below=below)
            if due:
                await self._yield_then_run(req)
            elif self._begin(req):
                await self._run_jobs(req)
            return req.finish()
        req = receiver._request(features, copy_inline_below=below)
        if (pending := self._drive(req)) is not None:
            await pending
        return req.finish()

    async def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        """As ``ReceiverCache.get_and_update_item``; a big copy runs in a worker thread."""
        req = self.receiver._item_request(mm_item, mm_hash, self.inline_threshold_bytes)
        if (pending := self._drive(req)) is not None:
            await pending
        return req.finish_item()

    async def release(self, ref: ShmRef) -> bool:
        """Give back a hand-out this reader will not read; False if unknown or released, or if
        its writer is gone (nothing is owed to it)."""
        return self.receiver.release(ref)

    async def touch(self, mm_hash: str, mm_item: Any = None) -> None:
        """Validate a reference without reading it; owes nothing. ``WriterGoneError`` first,
        as a read (the writer closed or died: its item can no longer be read)."""
        self.receiver.touch(mm_hash, mm_item)

    async def clear(self) -> None:
        """Drop local state (the receiver keeps no item copies): its counters restart."""
        self.receiver.clear()

    @contextlib.asynccontextmanager
    async def lease(self, features: Sequence[FeatureSpec]) -> AsyncIterator[list[FeatureSpec]]:
        """Zero-copy: arrays are views into shared memory until the block exits (then acked)."""
        with self.receiver.lease(features) as items:
            yield items


def read_after_wait(face: object, features: Sequence[FeatureSpec]) -> list[FeatureSpec] | None:
    """``await face.get_and_update_features(features)``'s usual case, for a caller whose task
    has just come back from a wait that suspended (an engine worker's connection, woken by the
    call's arrival): the loop has turned since, so no checkpoint can be due and the face's turn
    accounting (``_due``) is skipped. A single spec of a plain reader
    below the face's ``inline_threshold_bytes``, read on the loop in one core call (as the face
    reads it); ``None``, with nothing done, for anything else, which the caller then awaits
    through the face.

    The face would find the turn too (the call's arrival is counted in ``_loop_turns``), but
    through its coroutine and its turn accounting (``_due``); this caller knows the answer
    already and calls the face's read itself."""
    if type(face) is not AsyncReceiverCache or len(features) != 1:
        return None
    receiver = face.receiver  # (closed: ``ClosedCacheError``, as the face's own call)
    if type(receiver) is not ReceiverCache:
        return None
    return receiver._read_one_feature(features, face.inline_threshold_bytes)
