"""The tier's circuit breaker: stop asking Redis for a while after repeated failures.

Pure state machine: no I/O, time from an injected ``clock``, so every rule is tested against a
model (``tests/test_tier_logic.py``). The tier asks :meth:`CircuitBreaker.allow` before each
Redis operation and reports its outcome with :meth:`~CircuitBreaker.success` or
:meth:`~CircuitBreaker.failure`.

**What a failure is.** Redis failed: a connection error, or no answer at all within the
client's socket timeout. Not a failure: an answer that came after the request's own deadline
(the request went on without it; on a busy host the event loop itself is late, and a 50 ms
deadline expires with Redis answering in 1 ms). The tier lets such an operation finish in the
background and reports its outcome when it comes: an answer is a success, however late.

Rules:

* **closed** (the normal state): every operation is allowed. ``failures`` consecutive failures
  open the breaker; any success resets the count.
* **open**: nothing is allowed until ``retry_after_s`` has passed since it opened. Failures
  reported meanwhile (operations that started before it opened) change nothing.
* **half-open** (the wait is over): exactly one operation, the *probe*, is allowed; the others
  are refused while it runs. Its success closes the breaker and resets the wait; its failure
  opens it again with the wait doubled (at most ``max_retry_after_s``: 0.8 s by default, so
  the tier is tried again within a second of Redis coming back). A failure reported with a
  ``started_at`` before the probe was let through is an older operation's, not the probe's:
  it changes nothing. A probe that never reports (its task was cancelled) frees the probe
  slot after ``retry_after_s``.
* A success reported in any state closes the breaker (Redis answered: it is back).
* :attr:`~CircuitBreaker.state` is computed from the clock when read: an idle breaker reads
  ``half_open`` once its wait is over, without any call to :meth:`~CircuitBreaker.allow`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "CircuitBreaker"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Counts consecutive failures and decides whether the next operation may try Redis."""

    def __init__(
        self,
        *,
        failures: int = 3,
        retry_after_s: float = 0.2,
        max_retry_after_s: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if type(failures) is not int or failures < 1:
            raise ValueError(f"failures must be an int >= 1, got {failures!r}")
        if not retry_after_s > 0 or not max_retry_after_s >= retry_after_s:
            raise ValueError("need 0 < retry_after_s <= max_retry_after_s")
        self._threshold = failures
        self._base = float(retry_after_s)
        self._max = float(max_retry_after_s)
        self._clock = clock
        self._failures = 0  # consecutive, while closed
        self._wait = self._base  # the current open period
        self._opened_at: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the running probe was let through
        #: how many times the breaker opened (a counter for the stats)
        self.opened = 0

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"`` (now).

        Read once (a metrics scrape reads it from another thread while the loop closes it).
        """
        opened_at, wait = self._opened_at, self._wait
        if opened_at is None:
            return CLOSED
        return OPEN if self._clock() < opened_at + wait else HALF_OPEN

    def now(self) -> float:
        """The breaker's clock (what an operation passes back as ``started_at``)."""
        return self._clock()

    @property
    def retry_after_s(self) -> float:
        """The length of the current (or next) open period."""
        return self._wait

    def allow(self) -> bool:
        """Whether an operation may try Redis now (in half-open: takes the probe slot)."""
        if self._opened_at is None:
            return True
        now = self._clock()
        if now < self._opened_at + self._wait:
            return False
        if self._probe_at is not None and now < self._probe_at + self._wait:
            return False  # a probe is running (and not yet presumed lost)
        self._probe_at = now
        return True

    def success(self) -> None:
        """An operation succeeded: close, reset the count and the wait."""
        self._failures = 0
        self._wait = self._base
        self._opened_at = None
        self._probe_at = None

    def failure(self, started_at: float | None = None) -> None:
        """An operation failed (Redis errored, or never answered); ``started_at``: when it
        was let through (:meth:`now`), None for "just now"."""
        if self._opened_at is None:
            self._failures += 1
            if self._failures >= self._threshold:
                self._open(self._clock())
            return
        if self._probe_at is not None and (started_at is None or started_at >= self._probe_at):
            # the probe failed: open again, for longer
            self._wait = min(self._wait * 2, self._max)
            self._open(self._clock())
        # else: an operation that started before the breaker opened; nothing changes

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._probe_at = None
        self._failures = 0
        self.opened += 1
