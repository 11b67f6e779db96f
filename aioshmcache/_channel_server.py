"""The engine worker's end of the channel: ``serve_engine`` and its connections.

Each accepted connection gets a ``FrameConnection`` (frames cut as the bytes arrive) and one
task that serves its calls one after the other: a pooled gateway connection carries one call at
a time, so no task is made per call. The call's messages are ``_channel_format``'s; the path's
lock is ``_channel_keeper``'s. See ``aioshmcache.channel`` for the behaviour as a whole.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import resource
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import anyio

from ._channel_conn import FrameConnection
from ._channel_format import (
    ANSWER_VERSION,
    ONE_MESSAGE_VERSION,
    PLAIN_ANSWER_FROM,
    TAG,
    decode_call,
    encode,
    error_frame,
)
from ._channel_keeper import release_path, take_path
from ._core_api import core
from ._loop_turns import turned
from ._types import FeatureSpec
from .aio import read_after_wait
from .errors import (
    CacheMissError,
    FrameError,
    FrameTooLargeError,
    InvalidReferenceError,
    ReaderEvictedError,
    SerdeError,
    StaleReferenceError,
    WireError,
    WriterGoneError,
)
from .wire import DEFAULT_MAX_FRAME_BYTES

__all__ = ["CallLimit", "Handler", "ReceiverLike", "serve_engine"]

log = logging.getLogger("aioshmcache.channel")

_STOP_GRACE_S: Final = 10.0
_IDLE_TIMEOUT_S: Final = 10.0  # a connection's whole call must arrive within this
_FULL_WARN_S: Final = 10.0  # at most one "max_connections reached" warning this often
_timeout = asyncio.timeout  # 10-17 us a call here, anyio.fail_after 35-95 us
take_call = core.chan_take_call  # a version-4 call's two frames cut and decoded (``_core_chan``)
ok_frame = core.chan_ok_frame  # a plain ok answer encoded and framed (``_core_chan``)

Handler = Callable[[list[FeatureSpec], Any], Awaitable[Any]]


class ReceiverLike(Protocol):
    """What the worker needs of its cache (``AsyncReceiverCache``)."""

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec]
    ) -> list[FeatureSpec]: ...

    def lease(
        self, features: Sequence[FeatureSpec]
    ) -> contextlib.AbstractAsyncContextManager[list[FeatureSpec]]: ...


class _ServerConnection(FrameConnection):
    """A connection the worker accepted: its serving task starts with it."""

    def __init__(self, worker: _Worker) -> None:
        super().__init__(worker.max_frame_bytes)
        self._worker = worker

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        task = asyncio.get_running_loop().create_task(self._worker.connection(self))
        self._worker.tasks.add(task)
        task.add_done_callback(self._worker.tasks.discard)

    def data_received(self, data: bytes) -> None:
        """Bytes that are exactly one version-4 call's two frames, with nothing else waiting,
        are cut and decoded in one core call (``chan_take_call``) and kept as ``call``; any
        other bytes are cut into frames as they arrive (``FrameConnection``)."""
        if (
            self.call is None
            and not self._frames
            and self.error is None
            and not self._partial
            and (call := take_call(data, self.max_frame_bytes)) is not None
        ):
            self.call = call
            self._wake()
            turned()  # as ``FrameConnection.data_received`` counts
            return
        super().data_received(data)

    def eof_received(self) -> bool:
        """The peer ended its side: the calls it sent whole before are still answered (as a
        stream server does), so the write side stays open; the serving task closes the
        connection once it reads the end."""
        super().eof_received()
        return True


class CallLimit:
    """At most ``n`` calls at once, first come first served (``asyncio.Semaphore``'s rule).

    ``take`` is the usual case, a free slot taken with no coroutine (a semaphore's
    ``async with`` made four coroutine and method calls per call); ``wait`` queues for a slot
    that ``give`` hands over directly. A waiter cancelled after it was handed a slot passes it
    on; one cancelled before leaves the queue.
    """

    __slots__ = ("free", "waiters")

    def __init__(self, n: int) -> None:
        self.free = n
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take(self) -> bool:
        """Take a free slot if one is free and nobody queues for it."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Queue for a slot (after ``take`` said no); it is this caller's once this returns."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed a slot, then cancelled: the next waiter has it
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def give(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the free ones."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class _Worker:
    """One ``serve_engine`` run: its connections, the calls in progress, the shutdown."""

    def __init__(
        self,
        handler: Handler,
        receiver: ReceiverLike,
        *,
        max_concurrency: int,
        lease: bool,
        max_frame_bytes: int,
        idle_timeout: float,
        max_connections: int,
    ) -> None:
        self.handler = handler
        self.receiver = receiver
        self.limit = CallLimit(max_concurrency)
        self.lease = lease
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.idle: set[asyncio.Task[None]] = set()  # connections waiting for their next call
        self.busy: set[asyncio.Task[None]] = set()
        self.conns: set[FrameConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # every connection's (a strong reference)
        #: connections that never sent a byte of a call, oldest first: the first to go when full
        self.fresh: dict[asyncio.Task[None], FrameConnection] = {}
        self.stopping = False
        self.calls = 0
        self.turned_away = 0  # connections closed to stay within max_connections
        self._warned_at = -_FULL_WARN_S

    def protocol(self) -> FrameConnection:
        """A new connection's protocol (``loop.create_unix_server``'s factory)."""
        return _ServerConnection(self)

    async def connection(self, conn: _ServerConnection) -> None:
        """Serve one connection's calls, one after the other, until it ends or the worker stops."""
        task = asyncio.current_task()
        if task is None or self.stopping or not self._admit():
            conn.abort()
            return
        self.conns.add(conn)
        proven = False  # has it sent a whole call? (a gateway's pooled connection may then idle)
        try:
            while not self.stopping:
                waited = False  # did this task wait for the call (the loop turned meanwhile)?
                if not conn.started():
                    waited = True
                    self.idle.add(task)
                    if not proven:
                        self.fresh[task] = conn
                    try:
                        if proven:  # a pooled connection may wait for its next call without limit
                            await conn.arrival()  # (nothing came since ``started`` said so above)
                            while not conn.started():  # (an error ends the read below)
                                await conn.arrival()
                        else:
                            async with _timeout(self.idle_timeout):
                                await conn.wait_started()
                    finally:
                        self.idle.discard(task)
                        self.fresh.pop(task, None)
                self.busy.add(task)
                try:
                    call: tuple[int, Any, list[FeatureSpec]] | bytes
                    if conn.call is not None:  # cut and decoded as it arrived
                        payload, features = conn.call
                        conn.call = None
                        call = (ONE_MESSAGE_VERSION, payload, features)
                        self.calls += 1
                    else:
                        if conn.has_frames(2):  # the whole call is in: no deadline needed
                            head, body = conn.take(), conn.take()
                        else:
                            async with _timeout(self.idle_timeout):  # the rest of the call
                                head = await conn.next_frame()
                                body = await conn.next_frame()
                        call = self.decode(head, body)
                    proven = True
                    answer: bytes | tuple[bytes]
                    if type(call) is bytes:
                        answer = call
                    else:
                        answer = await self.serve_call(*call, waited=waited)
                    if isinstance(answer, tuple):  # its frame already made (``_answer``)
                        must_drain = conn.write_framed(answer[0])
                    else:
                        must_drain = conn.write((answer,))
                    if must_drain:  # paused or closing: the usual answer awaits nothing more
                        async with _timeout(self.idle_timeout):  # a gateway that stops reading
                            await conn.drain()
                finally:
                    self.busy.discard(task)
        except TimeoutError:  # no whole call, or its answer not read, within idle_timeout
            log.debug(
                "closing an engine connection: a call or its answer stuck for %.1f s",
                self.idle_timeout,
            )
        except (EOFError, FrameError, FrameTooLargeError, OSError):
            pass  # the gateway hung up (or sent garbage framing): this connection ends
        except asyncio.CancelledError:
            pass  # shutdown: ending quietly
        finally:
            self.conns.discard(conn)
            conn.abort()

    def _admit(self) -> bool:
        """Make room for a new connection: at ``max_connections``, the oldest connection that
        never sent a byte is closed for it; with none such, the new one is refused."""
        if len(self.conns) < self.max_connections:
            return True
        self.turned_away += 1
        now = time.monotonic()
        if now - self._warned_at >= _FULL_WARN_S:
            self._warned_at = now
            log.warning(
                "the engine worker is at max_connections=%d: closing connections that sent "
                "nothing (%d so far)",
                self.max_connections,
                self.turned_away,
            )
        for task, conn in self.fresh.items():
            del self.fresh[task]
            conn.abort()  # its read ends: the task leaves, the slot frees
            return True
        return False

    def decode(self, head: bytes, body: bytes) -> tuple[int, Any, list[FeatureSpec]] | bytes:
        """A call's frames as (version, payload, features), or the ``bad_request`` answer."""
        self.calls += 1
        try:
            return decode_call(head, body)
        except (SerdeError, WireError) as exc:
            return self._error_frame("bad_request", exc, unread=True)

    async def serve_call(
        self, version: int, payload: Any, features: list[FeatureSpec], *, waited: bool = False
    ) -> bytes | tuple[bytes]:
        """One call's answer: read the features, run the handler, encode its result (as
        ``_answer`` makes it). ``waited``: the serving task waited for this call, so the
        usual read needs no checkpoint (``aio.read_after_wait``)."""
        plain = version >= PLAIN_ANSWER_FROM
        if not self.limit.take():
            await self.limit.wait()
        try:
            try:
                if self.lease:
                    async with self.receiver.lease(features) as items:
                        return await self._handle(items, payload, plain)
                got = read_after_wait(self.receiver, features) if waited else None
                items = (
                    got
                    if got is not None
                    else await self.receiver.get_and_update_features(features)
                )
            except CacheMissError as exc:
                return self._error_frame("cache_miss", exc, mm_hashes=exc.mm_hashes, plain=plain)
            except WriterGoneError as exc:
                return self._error_frame("writer_gone", exc, mm_hashes=exc.mm_hashes, plain=plain)
            except StaleReferenceError as exc:
                return self._error_frame("stale_reference", exc, plain=plain)
            except InvalidReferenceError as exc:
                return self._error_frame("invalid_reference", exc, plain=plain)
            except ReaderEvictedError as exc:
                return self._error_frame("reader_evicted", exc, plain=plain)
            except _HandlerFailed as failed:
                return failed.frame
            except Exception as exc:  # the cache failed otherwise: still a typed answer
                log.exception("reading a call's features failed")
                return self._error_frame("handler", exc, plain=plain)
            try:  # ``_handle``'s steps, without its coroutine level
                result = await self.handler(items, payload)
            except BaseException as exc:
                return self._failed(exc, plain).frame
            try:
                return self._answer(result, plain)
            except _HandlerFailed as failed:
                return failed.frame
        finally:
            self.limit.give()

    async def _handle(
        self, items: list[FeatureSpec], payload: Any, plain: bool
    ) -> bytes | tuple[bytes]:
        """Run the handler and encode its result (inside a lease, before the views go).

        Whatever the handler raises becomes a ``handler`` error frame, ``BaseException``s
        included (a ``CancelledError`` of its own, a library's ``BaseException``), and is
        logged: only the process's own end (``KeyboardInterrupt``, ``SystemExit``) and a
        cancellation of this worker (its shutdown) pass through. A result that cannot be
        encoded, or whose answer would exceed ``max_frame_bytes``, becomes a ``bad_response``
        error frame (``WireError`` at the gateway), logged too.
        """
        try:
            result = await self.handler(items, payload)
        except BaseException as exc:
            raise self._failed(exc, plain) from exc
        return self._answer(result, plain)

    def _error_frame(
        self,
        kind: str,
        exc: BaseException,
        *,
        mm_hashes: Sequence[str] = (),
        unread: bool = False,
        plain: bool = False,
    ) -> bytes:
        """``error_frame`` that fits this worker's ``max_frame_bytes``."""
        return error_frame(
            kind, exc, mm_hashes=mm_hashes, unread=unread, plain=plain, limit=self.max_frame_bytes
        )

    def _failed(self, exc: BaseException, plain: bool) -> _HandlerFailed:
        """The handler raised ``exc``: its ``handler`` error frame, logged; the process's own
        end and a cancellation of this worker are raised again instead."""
        if isinstance(exc, KeyboardInterrupt | SystemExit) or _cancelled_from_outside(exc):
            raise exc
        log.error("the engine handler raised %s", type(exc).__name__, exc_info=exc)
        return _HandlerFailed(self._error_frame("handler", exc, plain=plain))

    def _answer(self, result: Any, plain: bool) -> bytes | tuple[bytes]:
        """The handler's result as its answer (``_handle``'s return); ``_HandlerFailed`` with
        a ``bad_response`` frame if it cannot be encoded or is too large."""
        if plain:  # the usual answer: encoded and framed in one core call, ``(frame,)``
            framed = ok_frame(result, self.max_frame_bytes)
            if framed is not None:
                return (framed,)
        try:
            answer = encode([TAG, ANSWER_VERSION, "ok", result], plain=plain)
        except (SerdeError, WireError, TypeError) as exc:
            log.error("the engine handler's result cannot be encoded: %s", exc)
            raise _HandlerFailed(
                self._error_frame(
                    "bad_response", WireError(f"the result cannot be encoded: {exc}"), plain=plain
                )
            ) from exc
        if len(answer) > self.max_frame_bytes:
            message = (
                f"the answer of {len(answer)} bytes exceeds the engine's "
                f"max_frame_bytes={self.max_frame_bytes}"
            )
            log.error("%s; answering an error instead", message)
            raise _HandlerFailed(self._error_frame("bad_response", WireError(message), plain=plain))
        return answer

    async def shutdown(self, grace: float) -> None:
        """Stop: idle connections close now; calls in progress get ``grace`` seconds."""
        self.stopping = True
        for task in list(self.idle):
            task.cancel()
        if self.busy:
            await asyncio.wait(set(self.busy), timeout=grace)
        rest = self.idle | self.busy
        for task in rest:
            task.cancel()
        if rest:
            await asyncio.wait(rest, timeout=grace)
        for conn in list(self.conns):
            conn.abort()


def _cancelled_from_outside(exc: BaseException) -> bool:
    """Whether ``exc`` is this task being cancelled (not a ``CancelledError`` a handler raised)."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _let_go(path: str, taking: asyncio.Future[int]) -> None:
    """``take_path`` finished for a ``serve_engine`` cancelled meanwhile: let the lock go."""
    if not taking.cancelled() and taking.exception() is None:
        release_path(path, taking.result())


def _default_max_connections() -> int:
    """Half the process's open-file limit (at most 4096): room left for everything else."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(1, min(4096, soft // 2))


class _HandlerFailed(Exception):
    def __init__(self, frame: bytes) -> None:
        super().__init__("handler failed")
        self.frame = frame


async def serve_engine(
    path: str | os.PathLike[str],
    handler: Handler,
    receiver: ReceiverLike,
    *,
    max_concurrency: int = 64,
    lease: bool = False,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    idle_timeout: float = _IDLE_TIMEOUT_S,
    max_connections: int | None = None,
    shutdown_timeout: float = _STOP_GRACE_S,
    shutdown_signals: Sequence[int] = (),
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve engine calls on the Unix socket ``path`` until cancelled (or a shutdown signal).

    For each call the worker reads its features with ``receiver`` (an open
    ``AsyncReceiverCache``, plain or of a group) — as copies, or zero-copy with ``lease=True``
    (the arrays are views into shared memory until the handler returns and its result is
    encoded) — then awaits ``handler(features, payload)`` and sends back its result (anything
    ``MsgpackSerde`` carries, numpy arrays included). At most ``max_concurrency`` calls run at
    once. Every failure is answered with a typed error frame (module docstring).

    Connections: a call's frames must arrive whole within ``idle_timeout`` seconds of its first
    byte, a new connection must start its first call within ``idle_timeout`` (default 10 s),
    and an answer the socket could not take at once must be read within ``idle_timeout``;
    otherwise the connection is closed. A connection that has sent a whole call may wait for
    its next one without limit (a gateway's pooled connection). At most ``max_connections``
    (default: half the process's open-file limit, at most 4096) are open: beyond it, the oldest
    connection that never sent a byte is closed to make room, or, with none such, the new one
    is closed at once. So silent connections can neither exhaust the worker's file descriptors
    nor keep a gateway's real calls out.

    One worker per path: the path's lock file (``path + ".lock"``, a kernel lock released if the
    worker dies) is taken first; a live worker holding it is ``EngineAddressInUseError``; a
    socket file left by a dead worker is replaced. ``ready()`` is called once listening.

    Shutdown (cancellation, or one of ``shutdown_signals`` such as ``signal.SIGTERM``): stop
    accepting, close idle connections, give calls in progress ``shutdown_timeout`` seconds,
    remove the socket file and the lock file. The receiver stays open (its owner closes it).
    """
    if type(max_concurrency) is not int or max_concurrency < 1:
        raise ValueError("max_concurrency must be an int >= 1")
    if not idle_timeout > 0:
        raise ValueError("idle_timeout must be > 0")
    if max_connections is None:
        max_connections = _default_max_connections()
    elif type(max_connections) is not int or max_connections < 1:
        raise ValueError("max_connections must be an int >= 1")
    path = os.fspath(path)
    loop = asyncio.get_running_loop()
    taking = asyncio.ensure_future(asyncio.to_thread(take_path, path))
    try:
        lock_fd = await asyncio.shield(taking)
    except asyncio.CancelledError:  # the thread takes the lock anyway: let it go once it has
        taking.add_done_callback(functools.partial(_let_go, path))
        raise
    worker = _Worker(
        handler,
        receiver,
        max_concurrency=max_concurrency,
        lease=lease,
        max_frame_bytes=max_frame_bytes,
        idle_timeout=idle_timeout,
        max_connections=max_connections,
    )
    stop = asyncio.Event()
    installed: list[int] = []
    try:
        old_umask = os.umask(0o177)
        try:
            server = await loop.create_unix_server(worker.protocol, path)
        finally:
            os.umask(old_umask)
        inode = None
        try:  # from here on, whatever fails (a signal refused, ``ready`` raising) closes it
            inode = os.stat(path).st_ino
            for sig in shutdown_signals:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            log.info("engine worker serving %s", path)
            if ready is not None:
                ready()
            await stop.wait()
        finally:
            server.close()
            with anyio.CancelScope(shield=True):
                await worker.shutdown(shutdown_timeout)
                with contextlib.suppress(OSError):
                    if inode is not None and os.stat(path).st_ino == inode:
                        os.unlink(path)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        release_path(path, lock_fd)
