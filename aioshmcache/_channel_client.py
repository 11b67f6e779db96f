"""The gateway's end of the channel: ``EngineClient``, a pool of connections to one worker.

A call borrows a pooled ``ClientConnection`` from its send to its answer (the pool's rules are
``_channel_pool.PoolBook``'s, a pure state machine), writes the call's two frames in one go and
waits for the answer frame; the call's messages are ``_channel_format``'s. See
``aioshmcache.channel`` for the behaviour as a whole (hand-outs, retries, drift recovery).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Protocol, Self

import anyio
from anyio.abc import AsyncResource

from ._channel_conn import ClientConnection
from ._channel_format import call_frames, decode, framed_call, raise_error
from ._channel_keeper import WorkerKeeper
from ._channel_pool import PoolBook
from ._core_api import core
from ._types import FeatureSpec, ShmRef
from .errors import (
    CacheMissError,
    EndOfFramesError,
    EngineTimeoutError,
    EngineUnavailableError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    SerdeError,
    WireError,
)
from .wire import DEFAULT_MAX_FRAME_BYTES

__all__ = ["ChannelStats", "EngineClient", "Items", "SenderLike"]

_SEND_TRIES: Final = 3
ok_result = core.chan_ok_result  # ``(result,)`` of a plain ok answer, or None (``_core_chan``)

Items = Mapping[str, Any] | Callable[[str], Any]


class SenderLike(Protocol):
    """What the client needs of the gateway's cache (``AsyncSenderCache``)."""

    async def release(self, ref: ShmRef) -> bool: ...

    async def invalidate(self, mm_hash: str) -> bool: ...

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]: ...


@dataclass(frozen=True)
class ChannelStats:
    """What an ``EngineClient`` counted since it was opened."""

    #: ``call`` invocations
    calls: int = 0
    #: calls that raised
    failures: int = 0
    #: connections opened / opens that failed
    connects: int = 0
    connect_failures: int = 0
    #: drift recoveries: calls resent with their missing items inline
    resends: int = 0
    #: hand-outs given back to the cache because the worker never read them (or went away)
    released: int = 0
    #: calls sent again because their worker went away before answering
    retries: int = 0

    def to_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return asdict(self)


class _Lost(Exception):
    """A call's connection broke before the answer: retried by ``EngineClient.call``, or its
    ``error`` raised. ``delivered``: the call's references the worker may have read."""

    def __init__(self, error: EngineUnavailableError) -> None:
        super().__init__(str(error))
        self.error = error
        self.delivered: list[ShmRef] = []


def _check_retries(retries: int) -> int:
    if type(retries) is not int or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    return retries


class EngineClient(AsyncResource):
    """The gateway's end of the channel: a small pool of Unix-socket connections to one worker.

    Use ``async with EngineClient.connect(path, cache=cache) as engine`` and ``await
    engine.call(features, payload)``; leaving the block is ``await engine.aclose()``. Give it
    the gateway's ``AsyncSenderCache`` as ``cache``: the client gives hand-outs back to it and
    invalidates drifted hashes in it (without one, neither happens). With ``start=`` (a
    top-level function taking the socket path, run in a spawned process), the client also
    keeps one engine worker alive for the path among every process that uses it: whichever
    process finds none starts one, and a kernel lock on the path decides between racing
    starters (``_channel_keeper``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cache: SenderLike | None = None,
        max_connections: int = 4,
        timeout: float = 30.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 0.5,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        start: Callable[[str], None] | None = None,
        retries: int = 1,
    ) -> None:
        """See :meth:`connect` (the documented way to make one); nothing is opened here."""
        if not timeout > 0:  # (NaN too)
            raise ValueError("timeout must be > 0")
        self.path = os.fspath(path)
        self.cache = cache
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self.retries = _check_retries(retries)
        self._changed: asyncio.Event | None = None
        self._book: PoolBook[ClientConnection] = PoolBook(
            max_connections,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            on_change=self._notify,
        )
        self._keeper = WorkerKeeper(self.path, start) if start is not None else None
        #: every connection this client opened and has not seen closed (``aclose`` closes
        #: those lent to calls in flight too)
        self._conns: weakref.WeakSet[ClientConnection] = weakref.WeakSet()
        self._calls = self._failures = self._resends = self._released = self._retries = 0

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        cache: SenderLike | None = None,
        max_connections: int = 4,
        timeout: float = 30.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 0.5,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        start: Callable[[str], None] | None = None,
        retries: int = 1,
    ) -> EngineClient:
        """A client of the engine worker at ``path``, for an ``async with`` block.

        A plain call (not awaited) whose result is used with ``async with``, as the caches'
        ``from_config`` and ``attach`` are. ``max_connections`` bounds the pool (calls beyond
        it wait for a connection, within their deadline); ``timeout`` is the default per-call
        deadline in seconds (connecting, sending and waiting for the answer, all together);
        reconnects back off from ``backoff_initial`` to ``backoff_max`` seconds; ``retries`` is
        the default of :meth:`call`'s (a call whose worker went away is sent again). No
        connection is opened up front: a worker that starts after the gateway is found by the
        first call. Leaving the block (``aclose``) closes every connection (and stops the
        worker this process started, if any).
        """
        return cls(
            path,
            cache=cache,
            max_connections=max_connections,
            timeout=timeout,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            max_frame_bytes=max_frame_bytes,
            start=start,
            retries=retries,
        )

    async def __aenter__(self) -> Self:
        """Start keeping a worker alive (``start=``); connections open on the first call."""
        if self._keeper is not None:
            self._keeper.begin()
        return self

    async def aclose(self) -> None:
        """Close every connection, idle or lent to a call in flight (that call then raises
        ``EngineUnavailableError``, without a retry); stop the engine worker this client
        started. Idempotent."""
        for conn in self._book.close():
            conn.abort()
        for conn in list(self._conns):
            conn.abort()
        if self._keeper is not None:
            await self._keeper.aclose()

    def stats(self) -> ChannelStats:
        """The counters, read together."""
        return ChannelStats(
            calls=self._calls,
            failures=self._failures,
            connects=self._book.opens,
            connect_failures=self._book.open_failures,
            resends=self._resends,
            released=self._released,
            retries=self._retries,
        )

    @property
    def pool(self) -> PoolBook[ClientConnection]:
        """The pool's state (``_channel_pool.PoolBook``: counts, backoff), to read, not change."""
        return self._book

    @property
    def open_connections(self) -> int:
        """Connections open now (idle or lent), plus those being opened."""
        return len(self._book.idle) + self._book.lent + self._book.opening

    async def call(
        self,
        features: Sequence[FeatureSpec],
        payload: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the issue's API: a per-call deadline)
        items: Items | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send a request's features (and ``payload``) to the worker; return its handler's result.

        ``timeout`` (default: the client's) bounds the whole call, drift resend and retries
        included: ``EngineTimeoutError`` when it passes, ``EngineUnavailableError`` if no
        connection could be made within it or the worker went away before answering (and no
        retry is left). ``retries`` (default: the client's, 1) is how many times a call whose
        worker went away before answering (died, or closed the connection) is sent again on a
        fresh connection, with fresh hand-outs; ``retries=0`` for a call that is not safe to
        run twice (the first worker may have run the handler before it died). The worker's
        errors come back typed (see the module docstring). ``items`` (a mapping or a function,
        sync or async, from ``mm_hash`` to the item) enables drift recovery, and lets a retry
        send inline an item evicted meanwhile.
        """
        self._calls += 1
        current = list(features)
        limit = self.timeout if timeout is None else timeout
        if not limit > 0:  # (NaN too: a deadline never reached)
            raise ValueError("timeout must be > 0")
        retries_left = self.retries if retries is None else _check_retries(retries)
        # on the loop's clock from the start: every wait below takes it as it is. The loop is
        # the idle connection's that the usual call takes, as it is a ``getpid`` system call to
        # ask asyncio for it on Python 3.11 (``FrameConnection.loop``)
        idle = self._book.idle
        loop = (idle[-1].loop if idle else None) or asyncio.get_running_loop()
        deadline = loop.time() + limit
        resent = False
        try:
            while True:
                try:
                    return await self._attempt(current, payload, deadline)
                except CacheMissError as miss:
                    if self.cache is None:
                        raise
                    for h in miss.mm_hashes:
                        await self.cache.invalidate(h)
                    if items is None or resent:
                        raise
                    resent = True
                    current = await self._resend_features(current, set(miss.mm_hashes), items)
                    self._resends += 1
                except _Lost as lost:
                    if retries_left <= 0 or loop.time() >= deadline or self._book.closed:
                        raise lost.error from lost.error.__cause__
                    retries_left -= 1
                    try:
                        current = await self._resend_features(current, set(), items)
                    finally:  # whatever the dead worker did not acknowledge, nobody reads now
                        await self._give_back(lost.delivered)
                    self._retries += 1
        except BaseException:
            self._failures += 1
            raise

    async def _resend_features(
        self, features: list[FeatureSpec], missing: set[str], items: Items | None
    ) -> list[FeatureSpec]:
        """The request again: missing items inline, fresh hand-outs for its other references.

        A reference whose item was evicted meanwhile goes inline too, made by ``items``
        (``CacheMissError`` without it).

        If the request cannot be built (an item missing from ``items``, ``items`` raising, the
        caller cancelled while an async ``items`` runs), the fresh hand-outs taken so far are
        given back before the error propagates: nothing was sent, so nobody will read them.
        """
        out: list[FeatureSpec] = []
        fresh: list[ShmRef] = []
        try:
            for f in features:
                if (
                    f.mm_hash not in missing
                    and isinstance(f.data, ShmRef)
                    and self.cache is not None
                ):
                    try:
                        [renewed] = await self.cache.get_and_update_features([f.with_data(None)])
                    except CacheMissError:
                        pass  # evicted meanwhile: inline as well
                    else:
                        if isinstance(renewed.data, ShmRef):
                            fresh.append(renewed.data)
                        out.append(renewed)
                        continue
                if f.mm_hash in missing or (isinstance(f.data, ShmRef) and self.cache is not None):
                    if items is None:
                        raise CacheMissError([f.mm_hash], f"no item to resend for {f.mm_hash}")
                    item = await _item_of(items, f.mm_hash)
                    out.append(f.with_data(item))
                else:
                    out.append(f)
        except BaseException:
            await self._give_back(fresh)
            raise
        return out

    async def _attempt(self, features: list[FeatureSpec], payload: Any, at: float) -> Any:
        """One send of the call on a pooled connection and its answer, by ``at``.

        Each wait below carries the deadline itself (on the loop's clock, as ``call`` took it:
        no clock is read here): the usual call (an idle connection, a send that needs no drain)
        waits once, for its answer, with one timer on that wait and no timeout scope around the
        call, and no coroutine of its own but this one (``_acquire`` is the other cases').

        ``delivered``: whether the call's frames reached the socket whole (the worker will read
        its references). The references are gathered (``refs_of``) only when the call fails:
        to give them back, or to hand them to the retry as maybe read.
        """
        delivered = False
        try:
            frames: tuple[bytes, bytes] | bytes | None
            frames = framed_call(payload, features, self.max_frame_bytes)
            if frames is None:
                try:
                    frames = call_frames(payload, features)
                except (SerdeError, WireError, TypeError) as exc:
                    raise WireError(f"the call cannot be encoded: {exc}") from exc
            phase = "connect"
            broken = 0  # connections that broke before the call reached the worker
            try:
                while True:
                    conn = self._book.take_idle()  # the usual case, no ``Step`` made
                    if conn is None or not conn.usable():
                        conn = await self._acquire(at, conn)
                    phase = "send"
                    reusable = False
                    try:
                        if conn.send(frames):  # paused writing, or closing: not in the socket
                            try:
                                await conn.drain(at)
                            except BaseException:
                                if conn.queued() == 0 and conn.usable():
                                    delivered = True  # every byte is in the socket
                                else:
                                    conn.abort()  # drop what is queued: the worker sees a cut
                                raise
                        delivered = True
                        phase = "answer"
                        answer = await conn.answer(at)  # the usual answer: whole, in one read
                        if answer is None:  # in pieces, or more than one frame: cut and queued
                            answer = await conn.next_frame(at)
                        reusable = True
                        break
                    except FrameTooLargeError as exc:  # the stream is out of step: not reused
                        raise WireError(f"the engine's answer is too large: {exc}") from exc
                    except TimeoutError:
                        raise
                    except (OSError, FrameError, IncompleteFrameError, EndOfFramesError) as exc:
                        broken += 1
                        for idle in self._book.drop_idle():
                            idle.abort()  # they lead to the same worker: likely broken too
                        if not delivered and broken < _SEND_TRIES:
                            phase = "connect"
                            continue  # the call never reached the worker: another connection
                        raise _Lost(self._unavailable(delivered, exc)) from exc
                    finally:  # ``_give_conn``, without its frame
                        to_close = self._book.give_back(conn, reusable=reusable and conn.usable())
                        if to_close is not None:
                            to_close.abort()
            except TimeoutError:
                if phase == "connect" and self._book.last_error is not None:
                    raise EngineUnavailableError(
                        f"no engine worker at {self.path}: {self._book.last_error}"
                    ) from None
                raise EngineTimeoutError(
                    f"the engine call did not finish in time (waiting for: {phase})"
                ) from None
            ok = ok_result(answer)  # the usual answer, compiled
            if ok is not None:
                return ok[0]
            value = decode(answer, "response")
            if value[2] == "ok" and len(value) == 4:
                return value[3]
            if value[2] == "error" and len(value) == 8:
                if value[7] is True:
                    delivered = False  # the worker read nothing: give back below
                raise_error(value)
            raise WireError("malformed channel response")
        except _Lost as lost:
            if delivered:
                lost.delivered = refs_of(features)  # maybe read by the worker that went away
            else:
                await self._give_back(refs_of(features))
            raise
        except BaseException:
            if not delivered:
                await self._give_back(refs_of(features))
            raise

    def _unavailable(self, delivered: bool, exc: BaseException) -> EngineUnavailableError:
        """The error of a call whose connection broke (``exc``): before or after delivery, or
        cut by this client's own ``aclose``."""
        if self._book.closed:
            what = f"the engine client was closed during the call to {self.path}"
        elif not delivered:
            what = f"could not send the call to {self.path}: {exc}"
        else:
            what = f"the engine worker at {self.path} went away during the call: {exc}"
        error = EngineUnavailableError(what)
        error.__cause__ = exc
        return error

    async def _give_back(self, refs: list[ShmRef]) -> None:
        if self.cache is None or not refs:
            return
        with anyio.CancelScope(shield=True):
            for ref in refs:
                if await self.cache.release(ref):
                    self._released += 1

    async def _acquire(self, at: float, unusable: ClientConnection | None) -> ClientConnection:
        """A connection for one call when no usable idle one was at hand (``unusable``: the
        idle one taken, closed or out of step, given back here): another idle one, a new one,
        or one given back, by ``at``."""
        if unusable is not None:
            self._give_conn(unusable, False)
        loop = asyncio.get_running_loop()
        while True:
            step = self._book.plan()
            if step.kind == "closed":
                raise EngineUnavailableError("the engine client is closed")
            if step.kind == "reuse" and step.conn is not None:
                if step.conn.usable():
                    return step.conn
                self._give_conn(step.conn, False)
                continue
            if step.kind == "open":
                try:
                    async with asyncio.timeout_at(at):
                        _, conn = await loop.create_unix_connection(self._protocol, self.path)
                except TimeoutError:  # the deadline (also an OSError: before the clause below)
                    self._book.open_abandoned()
                    raise
                except OSError as exc:
                    self._book.open_failed(exc)
                    continue
                except BaseException:
                    self._book.open_abandoned()
                    raise
                self._book.opened(conn)
                if self._book.closed:
                    self._give_conn(conn, False)
                    continue
                return conn
            await self._wait_changed(step.until, at)

    def _protocol(self) -> ClientConnection:
        conn = ClientConnection(self.max_frame_bytes)
        self._conns.add(conn)
        return conn

    def _give_conn(self, conn: ClientConnection, reusable: bool) -> None:
        to_close = self._book.give_back(conn, reusable=reusable and conn.usable())
        if to_close is not None:
            to_close.abort()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_changed(self, until: float | None, at: float) -> None:
        """Wait for the pool to change, or ``until`` (the pool's clock); ``TimeoutError`` once
        ``at`` (the loop's clock) has passed."""
        if self._changed is None:
            self._changed = asyncio.Event()
        ev = self._changed
        loop = asyncio.get_running_loop()
        limit = at - loop.time()
        if until is not None:
            limit = min(limit, until - time.monotonic())
        with anyio.move_on_after(max(0.0, limit)):
            await ev.wait()
        if loop.time() >= at:
            raise TimeoutError


def refs_of(features: list[FeatureSpec]) -> list[ShmRef]:
    """The call's references (its hand-outs); an item that is not a ``FeatureSpec`` (a call
    refused as unencodable) has none, and does not keep the others from being given back."""
    return [f.data for f in features if isinstance(f, FeatureSpec) and isinstance(f.data, ShmRef)]


async def _item_of(items: Items, mm_hash: str) -> Any:
    if isinstance(items, Mapping):
        if mm_hash not in items:
            raise CacheMissError([mm_hash], f"no item to resend for {mm_hash}")
        return items[mm_hash]
    value = items(mm_hash)
    if inspect.isawaitable(value):
        value = await value
    return value
