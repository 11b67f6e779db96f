"""The gateway <-> engine worker channel: requests of features over a Unix socket, answers back.

Gateway side::

    async with EngineClient.connect("/run/mm/engine.sock", cache=cache) as engine:
        result = await engine.call([feature], payload={"prompt": "..."}, timeout=30.0)

Worker side::

    async with AsyncReceiverCache.attach_group("mm") as rx:
        await serve_engine("/run/mm/engine.sock", handler, rx)  # handler(features, payload)

Why it exists: every multi-process user of the cache wrote this glue (a pool of sockets with
timeouts and reconnect, the worker's accept loop, the error mapping, giving hand-outs back when a
send fails, the resend after a drift signal), and each got some of it wrong.

**Frames.** Everything travels in ``aioshmcache.wire`` frames (8-byte length, payload). A call
is two frames, a response one::

    call      frame 1: serde value ["aioshmcache.channel", 2, "call", payload]
              frame 2: wire.pack_features(features), or, for references and Nones
                       without prompt updates, that message's value in plain msgpack
    response  frame:   serde value ["aioshmcache.channel", 1, "ok", result]
                    or ["aioshmcache.channel", 1, "error", kind, remote_type, message,
                        mm_hashes, unread]

Values are encoded with the store's own serde (``MsgpackSerde``: msgpack with size limits, numpy
arrays as raw aligned bytes; never pickle), so ``payload`` and ``result`` may be anything it
carries: numbers, str, bytes, lists, dicts and numpy arrays. ``kind`` is one of
``cache_miss``, ``writer_gone``, ``stale_reference``, ``invalid_reference``, ``reader_evicted``
(the cache's errors while reading the features, raised on the gateway as the same types),
``bad_request`` (the worker could not decode the call: ``WireError``), ``bad_response`` (the
handler's result cannot be encoded, or its answer would exceed the worker's ``max_frame_bytes``:
``WireError``) and ``handler`` (the handler raised, ``BaseException``s such as a
``CancelledError`` of its own included: ``EngineCallError`` with ``remote_type``). ``unread``
says the worker did not read the call's references: the client then gives them back to its
cache. An answer whose header announces more than the gateway's own ``max_frame_bytes`` is a
``WireError`` too (that connection is closed, it is out of step).

**One call per connection at a time.** A connection is lent to one call from its send to its
answer; the pool (``_channel_pool.PoolBook``: bounded, reuse first, reconnect with exponential
backoff and jitter, one probe at a time while the worker is down) bounds how many are open. A
call whose connection breaks or that is cancelled or times out after sending closes that
connection: the stream is out of step, and its late answer must never reach the next caller.

**Hand-outs.** A reference handed to a call is settled on every path:

* the call could not be encoded, or was never fully written (no connection within the deadline,
  the send failed, cancelled or timed out part-way): the client gives it back
  (``await cache.release(ref)``). The request's frames are written in one go; when a send is
  interrupted, the bytes still queued in the transport are dropped (``abort``), so the worker
  sees a cut frame and reads nothing; when nothing was still queued, the whole call reached the
  socket and counts as delivered;
* delivered: the worker reads it (and acknowledges it), or gives it back itself, or dies (a dead
  reader's debts are dropped). A call cancelled or timed out after delivery does not give back:
  the worker still reads it. A call delivered on a connection the worker closed unread in its
  own shutdown is the one lost hand-out the cache's lapse rule (``handout_ttl``) exists for;
* the worker answers ``unread``: the client gives it back;
* the worker went away before answering (died, or closed the connection) and the call is sent
  again (``retries``, once by default, on a fresh connection): the retry takes fresh hand-outs
  and gives the first ones back. The worker that went away acknowledged them already (giving
  back is then a no-op: the ledger settles a hand-out once) or never will (a dead reader's
  debts are dropped anyway).

**Drift recovery.** When the worker answers ``cache_miss`` (references gone stale: evicted,
cleared, a restarted writer), the client invalidates those hashes in its cache and, if the
caller passed ``items=`` (a mapping or a function from hash to item), resends the call once with
those items inline and fresh hand-outs for the request's other references (the worker
acknowledged the first ones). Without ``items``, or if the resend misses again, the
``CacheMissError`` reaches the caller, whose usual answer is to ask its client for the data.

Runs on asyncio (and uvloop): the channel uses asyncio streams, whose transport tells how much of
a send is still queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import inspect
import logging
import multiprocessing
import os
import resource
import signal
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Protocol

import anyio
import msgpack

from ._channel_pool import PoolBook
from ._serde import MsgpackSerde
from ._serde_decode import _check_complete, _NodeCounter
from ._types import FeatureSpec, ShmRef
from .errors import (
    CacheMissError,
    EndOfFramesError,
    EngineAddressInUseError,
    EngineCallError,
    EngineTimeoutError,
    EngineUnavailableError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    InvalidReferenceError,
    ReaderEvictedError,
    SerdeError,
    ShmCacheError,
    StaleReferenceError,
    WireError,
    WriterGoneError,
)
from .wire import (
    _KIND_NONE,
    _KIND_REF,
    _MAX_CONTAINERS,
    _MAX_FEATURES,
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_PREFIX_BYTES,
    _reference_row,
    pack_features,
    read_frame,
    unpack_features,
)
from .wire import _TAG as _WIRE_TAG
from .wire import _VERSION as _WIRE_VERSION
from .wire import _features as _wire_features

__all__ = [
    "ChannelStats",
    "EngineClient",
    "Handler",
    "serve_engine",
]

log = logging.getLogger("aioshmcache.channel")

_TAG: Final = "aioshmcache.channel"
_VERSION: Final = 1  # of answers, and of calls whose features frame is a wire message
_CALL_VERSION: Final = 2  # a call whose features frame may be plain msgpack (module docstring)
_CALL_VERSIONS: Final = (1, 2)
_SERDE = MsgpackSerde()
#: how long a new engine worker tries to take the path's lock (a prober may hold it briefly)
_LOCK_TRIES_S: Final = 1.0
_STOP_GRACE_S: Final = 10.0
_IDLE_TIMEOUT_S: Final = 10.0  # serve_engine: a connection's whole call must arrive within this
_FULL_WARN_S: Final = 10.0  # at most one "max_connections reached" warning this often
_SEND_TRIES: Final = 3
_JOIN_BELOW: Final = 256 << 10  # a message's pieces are joined into one write up to this size
_KEEP_POLL_S: Final = 0.5  # how often EngineClient(start=) checks the worker
_KEEP_QUICK_S: Final = 5.0  # a worker that crashes sooner than this after its start ...
_KEEP_MAX_S: Final = 30.0  # ... is restarted after a pause that doubles up to this
_KIND_ERRORS: Final[dict[str, type[ShmCacheError]]] = {
    "stale_reference": StaleReferenceError,
    "invalid_reference": InvalidReferenceError,
    "reader_evicted": ReaderEvictedError,
    "bad_request": WireError,
    "bad_response": WireError,
}
#: first bytes of a msgpack array (fixarray, array 16, array 32): a plain features frame
_MSGPACK_ARRAY_FIRST: Final = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
#: an error frame carries at most this much of the exception's message
_MAX_MESSAGE_CHARS: Final = 16384

_timeout = asyncio.timeout  # 10-17 us a call here, anyio.fail_after 35-95 us


Handler = Callable[[list[FeatureSpec], Any], Awaitable[Any]]
Items = Mapping[str, Any] | Callable[[str], Any]


class _SenderLike(Protocol):
    """What the client needs of the gateway's cache (``AsyncSenderCache``)."""

    async def release(self, ref: ShmRef) -> bool: ...

    async def invalidate(self, mm_hash: str) -> bool: ...

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec], *, wait_for_space: float | None = None
    ) -> list[FeatureSpec]: ...


class _ReceiverLike(Protocol):
    """What the worker needs of its cache (``AsyncReceiverCache``)."""

    async def get_and_update_features(
        self, features: Sequence[FeatureSpec]
    ) -> list[FeatureSpec]: ...

    def lease(
        self, features: Sequence[FeatureSpec]
    ) -> contextlib.AbstractAsyncContextManager[list[FeatureSpec]]: ...


# --- encoding ----------------------------------------------------------------------------------


def _encode(value: object) -> bytes:
    plan = _SERDE.plan(value)
    out = bytearray(plan.nbytes)
    _SERDE.write(plan, memoryview(out))
    return bytes(out)


def _decode(data: bytes, what: str, versions: tuple[int, ...] = (_VERSION,)) -> list[Any]:
    try:
        value = _SERDE.read(memoryview(data), copy=False)
    except WireError:
        raise
    except SerdeError as exc:
        raise WireError(f"not an aioshmcache.channel {what}: {exc}") from exc
    if type(value) is not list or len(value) < 3 or value[0] != _TAG:
        raise WireError(f"not an aioshmcache.channel {what}")
    if value[1] not in versions:
        raise WireError(f"unsupported channel version {value[1]!r} (this side reads {versions})")
    return value


def _pack_body(features: list[FeatureSpec]) -> bytes:
    """A call's features frame: plain msgpack for references and Nones, else a wire message.

    A request of references (and ``None``s) without prompt updates, the channel's usual call,
    is the wire message's own value packed with plain msgpack: the wire message goes through
    the store's serde, whose decoder keeps a compiled template per distinct header, and every
    hand-out's reference makes a new header (a template compiled per call: 15-40 us). Anything
    else (an inline item, prompt updates, a malformed feature: its error) is
    ``wire.pack_features``'s.
    """
    rows: list[list[Any]] = []
    if len(features) <= _MAX_FEATURES:
        for f in features:
            data = f.data
            if (
                type(f.mm_hash) is not str
                or f.prompt_updates != ()
                or not (f.identifier is None or type(f.identifier) is str)
            ):
                break
            if data is None:
                rows.append([f.mm_hash, _KIND_NONE, None, f.identifier, []])
            elif type(data) is ShmRef:
                rows.append([f.mm_hash, _KIND_REF, _reference_row(data), f.identifier, []])
            else:
                break
        else:
            packed: bytes = msgpack.packb([_WIRE_TAG, _WIRE_VERSION, rows])
            return packed
    return pack_features(features)


def _unpack_body(body: bytes) -> list[FeatureSpec]:
    """A call's features frame (:func:`_pack_body`'s two forms), as hostile as any input.

    A wire message starts with the serde's magic (``ASHM``), the plain form with a msgpack
    array marker. The plain form is unpacked under the serde's own bounds for a structure
    header (complete before it is unpacked, at most ``max_containers`` lists, lengths bounded
    by its size, no maps, bins or extensions), then checked as the wire message is (``wire``
    rules); it may hold only references and ``None``s, without prompt updates.
    """
    if not body or body[0] not in _MSGPACK_ARRAY_FIRST:
        return unpack_features(body)
    n = len(body)
    try:
        _check_complete(body)  # before msgpack allocates what array headers announce
        counter = _NodeCounter(_MAX_CONTAINERS)
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=0,
            max_array_len=n,
            max_map_len=0,
            max_ext_len=0,
            list_hook=counter.container,
        )
        for row in value[2] if type(value) is list and len(value) == 3 else ():
            if type(row) is list and len(row) == 5:
                if row[4] != []:
                    raise WireError("prompt updates in a plain features message")
                row[4] = ()  # as the wire message reads them
        features = _wire_features(value, _MAX_FEATURES)
    except WireError:
        raise
    except Exception as exc:  # msgpack's (malformed, too deep, bad UTF-8), the bounds', the rest
        raise WireError(f"malformed features message: {exc}") from exc
    for f in features:
        if f.data is not None and type(f.data) is not ShmRef:
            raise WireError("an inline item in a plain features message")
    return features


def _error_frame(
    kind: str, exc: BaseException, *, mm_hashes: Sequence[str] = (), unread: bool = False
) -> bytes:
    message = str(exc)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " [...]"
    return _encode(
        [_TAG, _VERSION, "error", kind, type(exc).__name__, message, list(mm_hashes), unread]
    )


def _raise_error(value: list[Any]) -> None:
    """Raise what an error response says, as a typed exception."""
    try:
        _, _, _, kind, remote_type, message, mm_hashes, _unread = value
        hashes = [str(h) for h in mm_hashes]
    except (TypeError, ValueError):
        raise WireError("malformed channel error response") from None
    message = str(message)
    if kind == "cache_miss":
        raise CacheMissError(hashes, message)
    if kind == "writer_gone":
        raise WriterGoneError(message, mm_hashes=hashes)
    if kind in _KIND_ERRORS:
        raise _KIND_ERRORS[kind](message)
    raise EngineCallError(f"engine worker: {remote_type}: {message}", remote_type=str(remote_type))


# --- gateway side ------------------------------------------------------------------------------


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


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not (
            self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None
        )

    def close(self) -> None:
        self.writer.transport.abort()


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


class _Sent:
    """How far a call got: whether its frames reached the socket whole."""

    __slots__ = ("delivered",)

    def __init__(self) -> None:
        self.delivered = False


class EngineClient:
    """The gateway's end of the channel: a small pool of Unix-socket connections to one worker.

    Use ``async with EngineClient.connect(path, cache=cache) as engine`` and ``await
    engine.call(features, payload)``. Give it the gateway's ``AsyncSenderCache`` as ``cache``:
    the client gives hand-outs back to it and invalidates drifted hashes in it (without one,
    neither happens). With ``start=`` (a top-level function taking the socket path, run in a
    spawned process), the client also keeps one engine worker alive for the path among every
    process that uses it: whichever process finds none starts one, and a kernel lock on the
    path decides between racing starters.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        cache: _SenderLike | None = None,
        max_connections: int = 4,
        timeout: float = 30.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 0.5,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        start: Callable[[str], None] | None = None,
        retries: int = 1,
    ) -> None:
        """See :meth:`connect`; nothing is opened until ``__aenter__``."""
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.path = os.fspath(path)
        self.cache = cache
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self.retries = _check_retries(retries)
        self._changed: asyncio.Event | None = None
        self._book: PoolBook[_Conn] = PoolBook(
            max_connections,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            on_change=self._notify,
        )
        self._start = start
        self._keeper: asyncio.Task[None] | None = None
        self._child: multiprocessing.process.BaseProcess | None = None
        self._calls = self._failures = self._resends = self._released = self._retries = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        cache: _SenderLike | None = None,
        max_connections: int = 4,
        timeout: float = 30.0,  # noqa: ASYNC109 (the deadline spans pool, send and answer)
        backoff_initial: float = 0.05,
        backoff_max: float = 0.5,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        start: Callable[[str], None] | None = None,
        retries: int = 1,
    ) -> AsyncIterator[EngineClient]:
        """A client of the engine worker at ``path``, for an ``async with`` block.

        ``max_connections`` bounds the pool (calls beyond it wait for a connection, within
        their deadline); ``timeout`` is the default per-call deadline in seconds (connecting,
        sending and waiting for the answer, all together); reconnects back off from
        ``backoff_initial`` to ``backoff_max`` seconds; ``retries`` is the default of
        :meth:`call`'s (a call whose worker went away is sent again). No connection is opened
        up front: a worker that starts after the gateway is found by the first call. Leaving
        the block closes every connection (and stops the worker this process started, if any).
        """
        client = cls(
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
        if start is not None:
            client._keeper = asyncio.create_task(client._keep_worker(start))
        try:
            yield client
        finally:
            await client.aclose()

    async def aclose(self) -> None:
        """Close every connection; stop the engine worker this client started. Idempotent."""
        for conn in self._book.close():
            conn.close()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        child, self._child = self._child, None
        if child is not None:
            await asyncio.to_thread(_stop_process, child)

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
        if limit <= 0:
            raise ValueError("timeout must be > 0")
        retries_left = self.retries if retries is None else _check_retries(retries)
        deadline = time.monotonic() + limit
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
                    if retries_left <= 0 or time.monotonic() >= deadline:
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

    async def _attempt(self, features: list[FeatureSpec], payload: Any, deadline: float) -> Any:
        refs = [f.data for f in features if isinstance(f.data, ShmRef)]
        sent = _Sent()
        try:
            try:
                frames = (_encode([_TAG, _CALL_VERSION, "call", payload]), _pack_body(features))
            except (SerdeError, TypeError) as exc:
                raise WireError(f"the call cannot be encoded: {exc}") from exc
            answer = await self._exchange(frames, deadline, sent)
            value = _decode(answer, "response")
            if value[2] == "ok" and len(value) == 4:
                return value[3]
            if value[2] == "error" and len(value) == 8:
                if value[7] is True:
                    sent.delivered = False  # the worker read nothing: give back below
                _raise_error(value)
            raise WireError("malformed channel response")
        except _Lost as lost:
            if sent.delivered:
                lost.delivered = refs  # maybe read by the worker that went away
            else:
                await self._give_back(refs)
            raise
        except BaseException:
            if not sent.delivered:
                await self._give_back(refs)
            raise

    async def _give_back(self, refs: list[ShmRef]) -> None:
        if self.cache is None or not refs:
            return
        with anyio.CancelScope(shield=True):
            for ref in refs:
                if await self.cache.release(ref):
                    self._released += 1

    async def _exchange(self, frames: tuple[bytes, bytes], deadline: float, sent: _Sent) -> bytes:
        """Write the call's frames on a pooled connection and read the answer, by ``deadline``."""
        phase = "connect"
        broken = 0  # connections that broke before the call reached the worker
        try:
            async with _timeout(max(0.0, deadline - time.monotonic())):
                while True:
                    conn = await self._acquire()
                    phase = "send"
                    reusable = False
                    try:
                        await self._send(conn, frames, sent)
                        phase = "answer"
                        answer = await read_frame(conn.reader, max_bytes=self.max_frame_bytes)
                        reusable = True
                        return answer
                    except FrameTooLargeError as exc:  # the stream is out of step: not reused
                        raise WireError(f"the engine's answer is too large: {exc}") from exc
                    except (OSError, FrameError, IncompleteFrameError, EndOfFramesError) as exc:
                        broken += 1
                        for idle in self._book.drop_idle():
                            idle.close()  # they lead to the same worker: likely broken too
                        if not sent.delivered and broken < _SEND_TRIES:
                            phase = "connect"
                            continue  # the call never reached the worker: another connection
                        if not sent.delivered:
                            what = f"could not send the call to {self.path}: {exc}"
                        else:
                            what = (
                                f"the engine worker at {self.path} went away during the call: {exc}"
                            )
                        error = EngineUnavailableError(what)
                        error.__cause__ = exc
                        raise _Lost(error) from exc
                    finally:
                        self._give_conn(conn, reusable)
        except TimeoutError:
            if phase == "connect" and self._book.last_error is not None:
                raise EngineUnavailableError(
                    f"no engine worker at {self.path}: {self._book.last_error}"
                ) from None
            raise EngineTimeoutError(
                f"the engine call did not finish in time (waiting for: {phase})"
            ) from None

    async def _send(self, conn: _Conn, frames: tuple[bytes, bytes], sent: _Sent) -> None:
        w = conn.writer
        prefix = len(frames[0]).to_bytes(8, "little"), len(frames[1]).to_bytes(8, "little")
        if len(frames[0]) > self.max_frame_bytes or len(frames[1]) > self.max_frame_bytes:
            raise WireError(f"the call exceeds max_frame_bytes={self.max_frame_bytes}")
        _write_joined(w, (prefix[0], frames[0], prefix[1], frames[1]))
        try:
            await w.drain()
        except BaseException:
            if w.transport.get_write_buffer_size() == 0 and not w.transport.is_closing():
                sent.delivered = True  # every byte is in the socket: the worker will read it
            else:
                w.transport.abort()  # drop what is queued: the worker sees a cut frame
            raise
        sent.delivered = True

    async def _acquire(self) -> _Conn:
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
                    reader, writer = await asyncio.open_unix_connection(self.path)
                except OSError as exc:
                    self._book.open_failed(exc)
                    continue
                except BaseException:
                    self._book.open_abandoned()
                    raise
                conn = _Conn(reader, writer)
                self._book.opened(conn)
                if self._book.closed:
                    self._give_conn(conn, False)
                    continue
                return conn
            await self._wait_changed(step.until)

    def _give_conn(self, conn: _Conn, reusable: bool) -> None:
        to_close = self._book.give_back(conn, reusable=reusable and conn.usable())
        if to_close is not None:
            to_close.close()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_changed(self, until: float | None) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        ev = self._changed
        if until is None:
            await ev.wait()
            return
        with anyio.move_on_after(max(0.0, until - time.monotonic())):
            await ev.wait()

    async def _keep_worker(self, start: Callable[[str], None]) -> None:
        """Start an engine worker whenever none holds the path's lock (and ours is not alive).

        A worker that crashes (exits non-zero) soon after it started is restarted with a growing
        pause (0.5 s doubling to 30 s), so that a worker that cannot start does not spin.
        """
        ctx = multiprocessing.get_context("spawn")
        pause, started = _KEEP_POLL_S, 0.0
        while True:
            mine = self._child
            if (mine is None or not mine.is_alive()) and not _lock_held(self.path):
                if mine is not None:
                    await asyncio.to_thread(mine.join, 1.0)
                    crashed = mine.exitcode not in (0, None)
                    quick = time.monotonic() - started < _KEEP_QUICK_S
                    pause = min(pause * 2, _KEEP_MAX_S) if crashed and quick else _KEEP_POLL_S
                    if pause > _KEEP_POLL_S:
                        log.warning(
                            "the engine worker for %s exited with %s; restarting in %.1f s",
                            self.path,
                            mine.exitcode,
                            pause,
                        )
                        self._child = None
                        await asyncio.sleep(pause)
                        continue
                child = ctx.Process(target=_run_worker, args=(start, self.path), daemon=True)
                await asyncio.to_thread(child.start)
                self._child, started = child, time.monotonic()
            await asyncio.sleep(_KEEP_POLL_S)


async def _item_of(items: Items, mm_hash: str) -> Any:
    if isinstance(items, Mapping):
        if mm_hash not in items:
            raise CacheMissError([mm_hash], f"no item to resend for {mm_hash}")
        return items[mm_hash]
    value = items(mm_hash)
    if inspect.isawaitable(value):
        value = await value
    return value


def _stop_process(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()
    proc.join(_STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join(_STOP_GRACE_S)


def _run_worker(start: Callable[[str], None], path: str) -> None:
    """A spawned engine worker's entry: take the path, then ``start(path)``.

    The path's lock is taken before ``start`` runs (before it attaches a reader anywhere), so a
    process that lost the race to another starter leaves at once and quietly; ``serve_engine``
    in ``start`` then uses the lock this process already holds.
    """
    try:
        _HELD[path] = _take_path(path)
    except EngineAddressInUseError:
        return
    threading.Thread(
        target=_leave_with_the_starter, args=(os.getppid(),), name="aioshm-starter", daemon=True
    ).start()
    try:
        start(path)
    except KeyboardInterrupt:
        return
    finally:
        held = _HELD.pop(path, None)
        if held is not None:  # ``start`` never reached ``serve_engine``
            _release_path(path, held)


def _leave_with_the_starter(ppid: int) -> None:
    """End this engine worker once the process that started it is gone (killed, even -9).

    Nothing else would: the worker serves a socket, not its parent. A SIGINT first (the
    worker's ``asyncio.run`` cancels its task: the receiver and the socket close cleanly),
    then a hard exit if it has not gone within ``_STOP_GRACE_S``. Other clients of the path
    start a new worker when they need one (``EngineClient(start=)``).
    """
    while os.getppid() == ppid:
        time.sleep(_KEEP_POLL_S)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(_STOP_GRACE_S)
    os._exit(1)


# --- worker side -------------------------------------------------------------------------------


def _lock_path(path: str) -> str:
    return path + ".lock"


def _lock_held(path: str) -> bool:
    """Whether a live engine worker holds ``path``'s lock (probed without keeping it)."""
    try:
        fd = os.open(_lock_path(path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our shared lock, if we got it
    return False


#: path -> lock fd, for a path this process took before ``serve_engine`` ran (``_run_worker``)
_HELD: dict[str, int] = {}


def _take_path(path: str) -> int:
    """Take ``path``'s lock (kernel-released if we die) and clear a dead worker's socket file.

    The lock file is removed by the worker that holds it when it stops cleanly
    (:func:`_release_path`), so a lock taken on a file that is no longer the one at the lock's
    path (a stopping worker removed it while we waited) is let go and taken again on the file
    that is there now.
    """
    held = _HELD.pop(path, None)
    if held is not None:
        return held  # taken by this process already (flock would refuse a second open of it)
    lock = _lock_path(path)
    deadline = time.monotonic() + _LOCK_TRIES_S
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise EngineAddressInUseError(
                    errno.EADDRINUSE, f"another engine worker serves {path}"
                ) from None
            time.sleep(0.02)
            continue
        if _is_at(fd, lock):
            break
        os.close(fd)  # removed by the worker that just stopped: take the current file's lock
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return fd
    if not stat.S_ISSOCK(st.st_mode):
        _release_path(path, fd)
        raise EngineAddressInUseError(errno.EEXIST, f"{path} exists and is not a socket")
    os.unlink(path)  # a dead worker's: we hold the lock, so no live worker serves it
    return fd


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` now."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _release_path(path: str, fd: int) -> None:
    """Let go of ``path``'s lock taken by :func:`_take_path`, removing the lock file.

    Removed while still locked, so that a worker waiting for the lock finds it gone and
    takes a new file's lock (:func:`_take_path`); a gateway's probe (:func:`_lock_held`)
    finds no file: no worker.
    """
    try:
        if _is_at(fd, _lock_path(path)):
            os.unlink(_lock_path(path))
    except OSError:
        pass
    finally:
        os.close(fd)


class _Worker:
    """One ``serve_engine`` run: its connections, the calls in progress, the shutdown."""

    def __init__(
        self,
        handler: Handler,
        receiver: _ReceiverLike,
        *,
        max_concurrency: int,
        lease: bool,
        max_frame_bytes: int,
        idle_timeout: float,
        max_connections: int,
    ) -> None:
        self.handler = handler
        self.receiver = receiver
        self.limit = asyncio.Semaphore(max_concurrency)
        self.lease = lease
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.idle: set[asyncio.Task[None]] = set()  # connections waiting for their next call
        self.busy: set[asyncio.Task[None]] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        #: connections that never sent a byte of a call, oldest first: the first to go when full
        self.fresh: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.stopping = False
        self.calls = 0
        self.turned_away = 0  # connections closed to stay within max_connections
        self._warned_at = -_FULL_WARN_S

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or self.stopping or not self._admit():
            writer.transport.abort()
            return
        self.writers.add(writer)
        proven = False  # has it sent a whole call? (a gateway's pooled connection may then idle)
        try:
            while not self.stopping:
                self.idle.add(task)
                if not proven:
                    self.fresh[task] = writer
                try:
                    if proven:  # a pooled connection may wait for its next call without limit
                        first = await reader.readexactly(1)
                    else:
                        async with _timeout(self.idle_timeout):
                            first = await reader.readexactly(1)
                finally:
                    self.idle.discard(task)
                    self.fresh.pop(task, None)
                self.busy.add(task)
                try:
                    async with _timeout(self.idle_timeout):  # the rest of the call, both frames
                        head = await _rest_of_frame(reader, first, self.max_frame_bytes)
                        body = await read_frame(reader, max_bytes=self.max_frame_bytes)
                    proven = True
                    answer = await self.serve_call(head, body)
                    _write_joined(writer, (len(answer).to_bytes(8, "little"), answer))
                    await writer.drain()
                finally:
                    self.busy.discard(task)
        except TimeoutError:  # no whole call within idle_timeout: a stuck or silent peer
            log.debug("closing an engine connection: no whole call in %.1f s", self.idle_timeout)
        except (EOFError, FrameError, FrameTooLargeError, OSError):
            pass  # the gateway hung up (or sent garbage framing): this connection ends
        except asyncio.CancelledError:
            pass  # shutdown: ending quietly (asyncio logs a connection task that ends cancelled)
        finally:
            self.writers.discard(writer)
            writer.transport.abort()

    def _admit(self) -> bool:
        """Make room for a new connection: at ``max_connections``, the oldest connection that
        never sent a byte is closed for it; with none such, the new one is refused."""
        if len(self.writers) < self.max_connections:
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
        for task, writer in self.fresh.items():
            del self.fresh[task]
            writer.transport.abort()  # its read ends: the task leaves, the slot frees
            return True
        return False

    async def serve_call(self, head: bytes, body: bytes) -> bytes:
        self.calls += 1
        try:
            value = _decode(head, "call", _CALL_VERSIONS)
            if value[2] != "call" or len(value) != 4:
                raise WireError("not a channel call")
            features = _unpack_body(body)
        except (SerdeError, WireError) as exc:
            return _error_frame("bad_request", exc, unread=True)
        async with self.limit:
            try:
                if self.lease:
                    async with self.receiver.lease(features) as items:
                        return await self._handle(items, value[3])
                items = await self.receiver.get_and_update_features(features)
            except CacheMissError as exc:
                return _error_frame("cache_miss", exc, mm_hashes=exc.mm_hashes)
            except WriterGoneError as exc:
                return _error_frame("writer_gone", exc, mm_hashes=exc.mm_hashes)
            except StaleReferenceError as exc:
                return _error_frame("stale_reference", exc)
            except InvalidReferenceError as exc:
                return _error_frame("invalid_reference", exc)
            except ReaderEvictedError as exc:
                return _error_frame("reader_evicted", exc)
            except _HandlerFailed as failed:
                return failed.frame
            except Exception as exc:  # the cache failed otherwise: still a typed answer
                log.exception("reading a call's features failed")
                return _error_frame("handler", exc)
            try:
                return await self._handle(items, value[3])
            except _HandlerFailed as failed:
                return failed.frame

    async def _handle(self, items: list[FeatureSpec], payload: Any) -> bytes:
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
            if isinstance(exc, KeyboardInterrupt | SystemExit) or _cancelled_from_outside(exc):
                raise
            log.error("the engine handler raised %s", type(exc).__name__, exc_info=exc)
            raise _HandlerFailed(_error_frame("handler", exc)) from exc
        try:
            answer = _encode([_TAG, _VERSION, "ok", result])
        except (SerdeError, TypeError) as exc:
            log.error("the engine handler's result cannot be encoded: %s", exc)
            raise _HandlerFailed(
                _error_frame("bad_response", WireError(f"the result cannot be encoded: {exc}"))
            ) from exc
        if len(answer) > self.max_frame_bytes:
            message = (
                f"the answer of {len(answer)} bytes exceeds the engine's "
                f"max_frame_bytes={self.max_frame_bytes}"
            )
            log.error("%s; answering an error instead", message)
            raise _HandlerFailed(_error_frame("bad_response", WireError(message)))
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
        for w in list(self.writers):
            w.transport.abort()


def _write_joined(writer: asyncio.StreamWriter, parts: tuple[bytes, ...]) -> None:
    """Queue ``parts`` as one write when small: the peer wakes once for the whole message, not
    once per piece (asyncio's ``writelines`` writes each piece on its own); large parts are
    queued as they are, not copied."""
    if sum(map(len, parts)) <= _JOIN_BELOW:
        writer.write(b"".join(parts))
    else:
        writer.writelines(parts)


def _cancelled_from_outside(exc: BaseException) -> bool:
    """Whether ``exc`` is this task being cancelled (not a ``CancelledError`` a handler raised)."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


async def _rest_of_frame(reader: asyncio.StreamReader, first: bytes, max_bytes: int) -> bytes:
    """A frame whose first byte was read already (``wire.read_frame``'s rules otherwise)."""
    prefix = first + await reader.readexactly(FRAME_PREFIX_BYTES - len(first))
    n = int.from_bytes(prefix, "little")
    if n > max_bytes:
        raise FrameTooLargeError(
            f"incoming frame of {n} bytes exceeds max_bytes={max_bytes}",
            nbytes=n,
            max_bytes=max_bytes,
        )
    return await reader.readexactly(n) if n else b""


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
    receiver: _ReceiverLike,
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
    byte, and a new connection must start its first call within ``idle_timeout`` (default 10 s);
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
    lock_fd = await asyncio.to_thread(_take_path, path)
    worker = _Worker(
        handler,
        receiver,
        max_concurrency=max_concurrency,
        lease=lease,
        max_frame_bytes=max_frame_bytes,
        idle_timeout=idle_timeout,
        max_connections=max_connections,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[int] = []
    try:
        old_umask = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(worker.connection, path)
        finally:
            os.umask(old_umask)
        inode = os.stat(path).st_ino
        for sig in shutdown_signals:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        log.info("engine worker serving %s", path)
        if ready is not None:
            ready()
        try:
            await stop.wait()
        finally:
            server.close()
            with anyio.CancelScope(shield=True):
                await worker.shutdown(shutdown_timeout)
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == inode:
                        os.unlink(path)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        _release_path(path, lock_fd)
