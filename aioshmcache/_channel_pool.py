"""The engine client's connection pool as pure bookkeeping: slots, idle connections, backoff.

No sockets, no awaits: the client (``aioshmcache.channel.EngineClient``) asks :meth:`PoolBook.plan`
what to do next and reports what happened (:meth:`opened`, :meth:`open_failed`,
:meth:`give_back`). Time comes from an injected ``clock`` and the backoff's jitter from an
injected ``rand``, so every rule is tested against a model (``tests/test_channel_pool.py``).

Rules:

* **Bounded.** Connections lent out plus connections being opened never exceed
  ``max_connections``. A caller that finds no idle connection and no free slot waits for a
  :meth:`give_back` (the client bounds that wait by the call's deadline).
* **Reuse first.** An idle connection is lent before a new one is opened (most recently
  returned first: it is the one least likely to have been closed by the peer meanwhile).
* **Backoff.** After ``n`` consecutive failed opens, no open is tried before
  ``backoff_initial * backoff_factor ** (n - 1)`` seconds (capped at ``backoff_max``, minus up
  to ``jitter`` of it at random, so that many gateway processes do not reconnect in lockstep)
  have passed since the last failure. While the engine is failing, one open at a time probes it
  (half-open); the first success ends the backoff. The cap bounds how long a restarted engine
  waits for its first call (a probe of a local socket is one cheap ``connect``): 0.5 s by
  default.
* **No lost wake-up.** Every report that can change what a waiting caller would be told
  (a connection opened, failed, abandoned or given back; the pool closed) calls ``on_change``,
  so that the client wakes its waiters to plan again. In particular the probe's successful
  *open* wakes the callers queued behind it: they open their own connections at once instead
  of waiting for the probe's whole call.
* **Fresh after a loss.** :meth:`drop_idle` hands every idle connection over to be closed (the
  engine they lead to went away; a retry must not pick one of them).
* **Closed.** After :meth:`close` nothing is lent; returned connections are handed back to be
  closed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = ["PoolBook", "Step"]

C = TypeVar("C")


@dataclass(frozen=True)
class Step(Generic[C]):
    """What the caller does next.

    ``reuse``: use ``conn`` (already counted as lent). ``open``: open a connection (a slot is
    reserved: report :meth:`PoolBook.opened` or :meth:`PoolBook.open_failed`). ``wait``: wait for
    a connection to come back, or until ``until`` (a clock time) if it is not None, then plan
    again. ``closed``: the pool is closed.
    """

    kind: Literal["reuse", "open", "wait", "closed"]
    conn: C | None = None
    until: float | None = None


class PoolBook(Generic[C]):
    """Who holds which connection, and when the next open may be tried."""

    def __init__(
        self,
        max_connections: int,
        *,
        backoff_initial: float = 0.05,
        backoff_max: float = 0.5,
        backoff_factor: float = 2.0,
        jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        if type(max_connections) is not int or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if not 0 < backoff_initial <= backoff_max:
            raise ValueError("need 0 < backoff_initial <= backoff_max")
        if backoff_factor < 1:
            raise ValueError("backoff_factor must be >= 1")
        if not 0 <= jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        self.max_connections = max_connections
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.backoff_factor = backoff_factor
        self.jitter = jitter
        self._clock = clock
        self._rand = rand
        self._on_change = on_change
        self.idle: list[C] = []
        self.lent = 0
        self.opening = 0
        #: consecutive failed opens (0 once an open succeeds)
        self.failures = 0
        #: no open before this clock time
        self.retry_at = 0.0
        self.last_error: BaseException | None = None
        self.closed = False
        #: opens that succeeded / failed, over the pool's life
        self.opens = 0
        self.open_failures = 0

    def backoff(self, failures: int) -> float:
        """The delay after ``failures`` consecutive failures, before jitter."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_max, self.backoff_initial * self.backoff_factor ** (failures - 1))

    def plan(self) -> Step[C]:
        """The next step of a caller that wants a connection."""
        if self.closed:
            return Step("closed")
        if self.idle:
            self.lent += 1
            return Step("reuse", self.idle.pop())
        if self.lent + self.opening >= self.max_connections:
            return Step("wait")
        if self.failures and self.opening:
            return Step("wait")  # half-open: one probe at a time while the engine fails
        if self._clock() < self.retry_at:
            return Step("wait", until=self.retry_at)
        self.opening += 1
        return Step("open")

    def take_idle(self) -> C | None:
        """An idle connection lent at once (``plan``'s ``reuse``, without a ``Step``), or None
        when ``plan`` would say anything else."""
        if self.closed or not self.idle:
            return None
        self.lent += 1
        return self.idle.pop()

    def opened(self, conn: C) -> None:
        """An open succeeded: ``conn`` is lent to the caller that opened it; backoff ends."""
        self._check_opening()
        self.opening -= 1
        self.opens += 1
        if self.closed:
            self.lent += 1  # lent; give_back hands it over to be closed
            return
        self.lent += 1
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = None
        self._on_change()  # the half-open gate and the backoff are gone: wake the waiters

    def open_failed(self, error: BaseException | None = None) -> None:
        """An open failed (or was abandoned): the slot is free again; the backoff grows."""
        self._check_opening()
        self.opening -= 1
        self.open_failures += 1
        self.failures += 1
        self.last_error = error
        delay = self.backoff(self.failures) * (1.0 - self.jitter * self._rand())
        self.retry_at = self._clock() + delay
        self._on_change()

    def open_abandoned(self) -> None:
        """An open was given up by its caller (cancelled): the slot is free, no backoff."""
        self._check_opening()
        self.opening -= 1
        self._on_change()

    def give_back(self, conn: C, *, reusable: bool) -> C | None:
        """A lent connection comes back; returns it if the caller must close it."""
        if self.lent <= 0:
            raise RuntimeError("give_back without a lent connection")
        self.lent -= 1
        self._on_change()
        if reusable and not self.closed:
            self.idle.append(conn)
            return None
        return conn

    def drop_idle(self) -> list[C]:
        """Forget the idle connections; returns them, to be closed."""
        idle, self.idle = self.idle, []
        return idle

    def close(self) -> list[C]:
        """Lend nothing any more; returns the idle connections, to be closed."""
        self.closed = True
        self._on_change()
        return self.drop_idle()

    def _check_opening(self) -> None:
        if self.opening <= 0:
            raise RuntimeError("no open in progress")
