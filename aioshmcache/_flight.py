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

**Across the processes of a cache group** (:class:`GroupFlight`): a leader whose hash no shard
holds first claims a marker the sibling processes can see, a file per hash under a directory of
the group, locked with ``flock``. A process that finds the marker held waits (bounded by
``GROUP_WAIT_S``, polling every few milliseconds) until the hash is cached somewhere in the group
— then it is read like any sibling hit, not computed again — or until the marker is free. The
marker is held until the flight ends in this process (its put committed, or it failed), so a
sibling that sees it free and the hash still missing knows the computation failed and computes
itself. A leader that dies holding a marker holds nothing: the kernel drops a dead process's
``flock``. Marker files are removed by the process that held them (unlinked before the lock is
dropped; a claimer checks that the file it locked is still the one at the path); one whose holder
died stays behind, empty, and is reused by the next claim of that hash; the group's directory
goes with its last marker (a claimer that finds it gone makes it again). If the directory cannot be
used, the group-wide part is skipped (each process computes its own misses): it never fails a
request.

**fork.** A ``flock`` belongs to the open file description, which a forked child shares: a
leader whose ``make`` forks a helper (a fork-started process pool) would keep the marker held
for as long as that helper lives, after the leader itself died, and every sibling would wait
the whole ``GROUP_WAIT_S``. The marker fds are opened ``O_CLOEXEC`` (a helper that execs drops
them) and closed in every forked child (``os.register_at_fork``): the child's copy goes, the
lock stays the parent's, and dies with it. The marker file is never mapped, so no mapping
keeps the description alive behind the closed fd.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import inspect
import logging
import os
import stat
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread

from .errors import CacheMissError

__all__ = [
    "FROM_SIBLING",
    "GROUP_WAIT_S",
    "GroupFlight",
    "SingleFlight",
    "SingleFlightStats",
    "call_make",
    "marker_directory",
]

log = logging.getLogger("aioshmcache")

#: how long a process waits for a sibling that is computing the same hash (seconds)
GROUP_WAIT_S = 30.0
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.01
#: what a ``make`` returns when a sibling process computed the item: the put is then a hit
FROM_SIBLING: Any = object()
#: how many times a leader claims again after a sibling's item vanished before its copy
_SIBLING_TRIES = 3

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
    #: flights served by a sibling process of the group that was computing the same hash
    group_saved: int = 0

    def to_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON, a status page, a results table)."""
        return asdict(self)


class _Flight:
    """One hash being made and put: its leader, its waiters, and how it ended."""

    __slots__ = ("changed", "error", "finished", "hitting", "leading", "made", "waiters")

    def __init__(self) -> None:
        self.changed = anyio.Event()  # set when the flight ends or its leader leaves
        self.made: tuple[Any] | None = None  # the item, boxed, once ``make`` returned
        self.error: Exception | None = None
        self.finished = False
        self.leading = False
        self.hitting = False  # the leader makes the request of a cached hash (no ``make``)
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
        # a constructor that derives its message from other arguments (CacheMissError's
        # mm_hashes) rebuilt it from the message itself: the original arguments, as given
        clone.args = exc.args
    except Exception:
        return exc
    return clone if type(clone) is type(exc) else exc


class SingleFlight(Generic[R]):
    """Per-key flights: at most one ``make`` running per key among concurrent callers."""

    def __init__(self, *, on_end: Callable[[str], None] | None = None) -> None:
        self._on_end = on_end  # told when a key's flight is over in this process
        self._flights: dict[str, _Flight] = {}
        self._calls = self._hits = self._runs = self._saved = 0
        self._failures = self._takeovers = self._group_saved = 0

    def stats(self) -> SingleFlightStats:
        """The counters, read together."""
        return SingleFlightStats(
            calls=self._calls,
            hits=self._hits,
            runs=self._runs,
            saved=self._saved,
            failures=self._failures,
            takeovers=self._takeovers,
            group_saved=self._group_saved,
        )

    def in_flight(self) -> int:
        """Keys with a flight open right now."""
        return len(self._flights)

    def waiters(self, key: str) -> int:
        """Callers waiting on the flight of ``key`` right now (0 when it has none)."""
        f = self._flights.get(key)
        return 0 if f is None else f.waiters

    def count_run(self) -> None:
        """The caller's ``make`` is being called now: counted where it is called (behind a
        tier it may not be; after a sibling's item vanished it is, as a fallback)."""
        self._runs += 1

    async def run(
        self,
        key: str,
        make: Callable[[], Awaitable[Any]],
        *,
        cached: Callable[[], bool],
        hit: Callable[[], Awaitable[R]],
        put: Callable[[Any], Awaitable[R]],
        make_anyway: Callable[[], Awaitable[Any]] | None = None,
    ) -> R:
        """One caller of ``key``: the leader of a hit or of a new flight, or a waiter of one.

        ``cached()`` is a pure look-up; ``hit()`` makes the request for a cached key (it may
        raise ``CacheMissError`` if the key was evicted meanwhile: then this call leads a
        flight that makes it); ``put(item)`` makes the request with the item. ``make`` may
        return :data:`FROM_SIBLING` (a sibling process cached it): its put is then a hit, and
        if that finds the item gone again, ``make`` runs again (``make_anyway`` after
        ``_SIBLING_TRIES`` such returns).

        A hit leads a flight too: a hit on an item a sibling shard holds copies it into this
        process's shard, and a second caller that looked at the same moment would find that
        copy pending (a miss) and make the item again. Its waiters ask once it is copied.
        """
        self._calls += 1
        try_hit = True
        joined = False
        while True:
            f = self._flights.get(key)
            if f is None:
                f = self._flights[key] = _Flight()
                if try_hit and cached():
                    f.leading = f.hitting = True
                    try:
                        out = await hit()
                    except CacheMissError:  # evicted between the look-up and the request
                        try_hit = False
                        f.leading = f.hitting = False
                        return await self._lead(key, f, make, put, make_anyway)
                    except BaseException:  # its waiters ask again themselves
                        self._drop(key, f)
                        f.changed.set()
                        raise
                    self._hits += 1
                    f.finished = True
                    self._end(key, f)
                    return out
            if not f.leading:  # a new flight, or one whose leader left: lead it
                if joined:
                    self._takeovers += 1
                return await self._lead(key, f, make, put, make_anyway)
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
            if f.hitting:  # a hit flight: ended (it is cached here now) or its leader left
                joined = False
                if f.finished:
                    try:
                        out = await hit()
                    except CacheMissError:  # gone again: make it (in a flight of its own)
                        try_hit = False
                        continue
                    self._hits += 1
                    return out
                continue
            if f.finished and f.made is not None:
                try:
                    out = await put(f.made[0])
                except CacheMissError:
                    if f.made[0] is not FROM_SIBLING:
                        raise
                    try_hit, joined = False, False  # the sibling's item went: make it
                    continue
                self._saved += 1
                return out
            # the leader left before finishing: loop, and one of the waiters takes over

    async def _lead(
        self,
        key: str,
        f: _Flight,
        make: Callable[[], Awaitable[Any]],
        put: Callable[[Any], Awaitable[R]],
        make_anyway: Callable[[], Awaitable[Any]] | None,
    ) -> R:
        f.leading = True
        try:
            tries = 0
            while True:
                if f.made is None:
                    fallback = tries >= _SIBLING_TRIES and make_anyway is not None
                    f.made = (await (make_anyway() if fallback else make()),)  # type: ignore[misc]
                try:
                    out = await put(f.made[0])
                    break
                except CacheMissError:
                    if f.made[0] is not FROM_SIBLING:
                        raise
                    # the sibling's item went between its look-up and our copy: the next
                    # ``make`` claims the hash again (and counts its run, if it makes it)
                    f.made, tries = None, tries + 1
            if f.made[0] is FROM_SIBLING:  # not run here after all
                self._group_saved += 1
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
            if self._on_end is not None:
                self._on_end(key)


def marker_directory(group: str) -> str:
    """Where the single-flight markers of cache group ``group`` live (computed, not made)."""
    base = os.path.join(tempfile.gettempdir(), f"aioshm-{os.getuid()}-flights")
    return os.path.join(base, group.replace("/", "_"))


_open_flights: weakref.WeakSet[GroupFlight] = weakref.WeakSet()


def _drop_markers_in_child() -> None:
    for gf in list(_open_flights):
        gf.forget_after_fork()


os.register_at_fork(after_in_child=_drop_markers_in_child)


class GroupFlight:
    """The cross-process marker of a cache group: "a process of the group is computing h".

    :meth:`claim` is called by a process's leader before it computes; :meth:`release` when the
    flight is over in that process (``SingleFlight(on_end=...)``). See the module docstring.
    """

    def __init__(self, group: str, *, wait_s: float = GROUP_WAIT_S) -> None:
        self.group = group
        self.wait_s = wait_s
        self._dir: str | None = None
        self._held: dict[str, int] = {}
        #: claims that found a sibling computing, and of those, the ones it then served
        self.waited = 0
        self.served = 0
        _open_flights.add(self)

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited marker fds (the parent's locks stay its own)."""
        held, self._held = self._held, {}
        for fd in held.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _directory(self) -> str | None:
        if self._dir is None:
            path = marker_directory(self.group)
            base = os.path.dirname(path)
            try:
                for d in (base, path):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(d, 0o700)
                    st = os.lstat(d)
                    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                        raise PermissionError(f"{d} is not a directory of this user")
            except OSError as exc:
                log.warning("group-wide single flight is off for %r: %s", self.group, exc)
                self._dir = ""
            else:
                self._dir = path
        return self._dir or None

    def _path(self, key: str) -> str | None:
        d = self._directory()
        if d is None:
            return None
        # any str is a hash (lone surrogates too, as keys.py encodes them)
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16)
        return os.path.join(d, digest.hexdigest())

    def _try_lock(self, path: str) -> int | None:
        """The locked marker file at ``path`` (the one linked there now), or None if held."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the group's directory went with its last marker: again
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path), 0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder unlinked it after we opened it: try the new one
            os.close(fd)
            return self._try_lock(path)
        return fd

    async def claim(
        self, key: str, cached: Callable[[], bool], cached_now: Callable[[], bool] | None = None
    ) -> bool:
        """Whether this process should compute ``key``: False once a sibling has cached it.

        True with the marker held (release it with :meth:`release`), or True without it when
        the markers cannot be used or a sibling took longer than ``wait_s``. ``cached_now``:
        the look made once the marker is held (default ``cached``), whose "no" means "compute
        it": one that does not miss a sibling shard opened a moment ago.
        """
        last_look = cached if cached_now is None else cached_now
        path = self._path(key)
        if path is None or key in self._held:
            return True
        deadline = time.monotonic() + self.wait_s
        pause = _POLL_MIN_S
        waited = False
        while True:
            try:
                fd = self._try_lock(path)
            except OSError as exc:
                log.warning("group-wide single flight: %s", exc)
                return True
            if fd is not None:
                if last_look():  # put (and released) between our look-up and the lock
                    self._unlock(path, fd)
                    self.served += waited
                    return False
                self._held[key] = fd
                return True
            if not waited:
                waited = True
                self.waited += 1
            if cached():
                self.served += 1
                return False
            if time.monotonic() >= deadline:
                return True
            await anyio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def holds(self, key: str) -> bool:
        """Whether this process holds the marker of ``key`` (its flight of it is on)."""
        return key in self._held

    def release(self, key: str) -> None:
        """The flight of ``key`` is over in this process: drop its marker, if held."""
        fd = self._held.pop(key, None)
        if fd is None:
            return
        path = self._path(key)
        if path is not None:
            self._unlock(path, fd)

    @staticmethod
    def _unlock(path: str, fd: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before the lock goes: a claimer then sees a fresh file
        os.close(fd)
        with contextlib.suppress(OSError):  # the last marker takes the group's directory along
            os.rmdir(os.path.dirname(path))
