"""Single-flight bookkeeping behind ``AsyncSenderCache.get_or_put``.

When several requests ask for the same new ``mm_hash`` at once, only the first (the *leader*)
runs the preprocessing; the others (the *waiters*) wait for it and then make their own request
with the item the leader made, so each gets its own hand-out (or the inline item, when the item
could not be cached). Waiters are released only once the leader's put has committed: released
earlier, their requests would find the put still pending and be served inline.

The rules, in one place:

- a hit (the hash is cached when the call starts) never runs ``make``;
- a failure (``make`` or the leader's put raised an ``Exception``) reaches every waiter as an
  exception of the same type (a copy, chained to the original with ``from``), the flight ends
  and nothing is cached: the next call runs ``make`` again;
- a leader that is cancelled (any ``BaseException`` that is not an ``Exception``) hands the
  flight over: one waiter takes over. If ``make`` had already returned, the item is kept and
  the new leader only puts it; otherwise the new leader runs ``make`` again. The cancelled
  leader's own request has been rolled back by the request machinery (nothing leaked); a
  waiter never hangs on a leader that is gone. Waiters that are cancelled simply leave.

Everything here runs on the event loop of the cache (no locks: between two awaits nothing else
changes the table). One ``AsyncSenderCache`` is used from one event loop.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread

from .errors import CacheMissError

__all__ = ["SingleFlight", "SingleFlightStats", "call_make"]

R = TypeVar("R")


@dataclass(frozen=True)
class SingleFlightStats:
    """What ``get_or_put`` counted since the cache was opened.

    ``saved`` is the number of preprocessings single flight avoided: calls that joined another
    caller's flight and were served by its ``make`` without running their own.
    """

    #: ``get_or_put`` calls
    calls: int = 0
    #: calls answered from the cache at once (``make`` not called)
    hits: int = 0
    #: ``make()`` calls started
    runs: int = 0
    #: calls served by another caller's ``make`` (preprocessings saved)
    saved: int = 0
    #: flights that ended in an error (``make`` or its put raised), raised to every waiter
    failures: int = 0
    #: flights a waiter took over because their leader was cancelled
    takeovers: int = 0

    def to_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON, a status page, a results table)."""
        return asdict(self)


class _Flight:
    """One hash being made and put: its leader, its waiters, and how it ended."""

    __slots__ = ("changed", "error", "finished", "leading", "made", "waiters")

    def __init__(self) -> None:
        self.changed = anyio.Event()  # set when the flight ends or its leader leaves
        self.made: tuple[Any] | None = None  # the item, boxed, once ``make`` returned
        self.error: Exception | None = None
        self.finished = False
        self.leading = False
        self.waiters = 0


async def call_make(make: Callable[[], Any], limiter: anyio.CapacityLimiter) -> Any:
    """Run ``make``: a coroutine function is awaited, anything else runs in a worker thread.

    A sync callable that returns an awaitable (a lambda around a coroutine function) has that
    awaitable awaited on the loop.
    """
    if inspect.iscoroutinefunction(make):
        return await make()
    result = await anyio.to_thread.run_sync(make, limiter=limiter)
    if inspect.isawaitable(result):
        return await result
    return result


def _same_kind(exc: Exception) -> Exception:
    """A copy of ``exc`` to raise in another task (so tracebacks do not pile up on one object).

    Falls back to ``exc`` itself when it cannot be copied faithfully.
    """
    try:
        clone = copy.copy(exc)
    except Exception:
        return exc
    return clone if type(clone) is type(exc) else exc


class SingleFlight(Generic[R]):
    """Per-key flights: at most one ``make`` running per key among concurrent callers."""

    def __init__(self) -> None:
        self._flights: dict[str, _Flight] = {}
        self._calls = self._hits = self._runs = self._saved = 0
        self._failures = self._takeovers = 0

    def stats(self) -> SingleFlightStats:
        """The counters, read together."""
        return SingleFlightStats(
            calls=self._calls,
            hits=self._hits,
            runs=self._runs,
            saved=self._saved,
            failures=self._failures,
            takeovers=self._takeovers,
        )

    def in_flight(self) -> int:
        """Keys with a flight open right now."""
        return len(self._flights)

    async def run(
        self,
        key: str,
        make: Callable[[], Awaitable[Any]],
        *,
        cached: Callable[[], bool],
        hit: Callable[[], Awaitable[R]],
        put: Callable[[Any], Awaitable[R]],
    ) -> R:
        """One caller of ``key``: a hit, the leader of a new flight, or a waiter of one.

        ``cached()`` is a pure look-up; ``hit()`` makes the request for a cached key (it may
        raise ``CacheMissError`` if the key was evicted meanwhile: then this call joins or
        starts a flight); ``put(item)`` makes the request with the item.
        """
        self._calls += 1
        try_hit = True
        joined = False
        while True:
            f = self._flights.get(key)
            if f is None:
                if try_hit and cached():
                    try:
                        out = await hit()
                    except CacheMissError:  # evicted between the look-up and the request
                        try_hit = False
                        continue
                    self._hits += 1
                    return out
                f = self._flights[key] = _Flight()
            if not f.leading:  # a new flight, or one whose leader left: lead it
                if joined:
                    self._takeovers += 1
                return await self._lead(key, f, make, put)
            joined = True
            changed = f.changed
            f.waiters += 1
            try:
                await changed.wait()
            except BaseException:  # this waiter leaves (cancelled)
                f.waiters -= 1
                if not f.leading and f.waiters == 0 and f.error is None and not f.finished:
                    self._drop(key, f)  # a flight nobody leads or waits for any more
                raise
            f.waiters -= 1  # woken: the flight (and what its leader made) stays for us
            if f.error is not None:
                raise _same_kind(f.error) from f.error
            if f.finished and f.made is not None:
                self._saved += 1
                return await put(f.made[0])
            # the leader left before finishing: loop, and one of the waiters takes over

    async def _lead(
        self,
        key: str,
        f: _Flight,
        make: Callable[[], Awaitable[Any]],
        put: Callable[[Any], Awaitable[R]],
    ) -> R:
        f.leading = True
        try:
            if f.made is None:
                self._runs += 1
                f.made = (await make(),)
            out = await put(f.made[0])
        except Exception as exc:  # a failure: every waiter gets it, nothing is cached
            self._failures += 1
            f.error = exc
            self._end(key, f)
            raise
        except BaseException:  # cancelled: hand the flight over to a waiter, if any
            f.leading = False
            old, f.changed = f.changed, anyio.Event()
            if f.waiters == 0:
                self._drop(key, f)
            old.set()
            raise
        f.finished = True
        self._end(key, f)
        return out

    def _end(self, key: str, f: _Flight) -> None:
        self._drop(key, f)
        f.changed.set()

    def _drop(self, key: str, f: _Flight) -> None:
        if self._flights.get(key) is f:
            del self._flights[key]
