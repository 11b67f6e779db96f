"""One channel connection: an ``asyncio.Protocol`` that cuts the bytes it receives into frames.

Both ends of the channel use it. The bytes go through ``wire.FrameDecoder`` as they arrive
(``data_received``), so a call whose two frames come in one read is taken whole with no stream
read per frame and no wait at all; a task awaits only when no whole frame is there yet.
Writes go out as ``wire.frame_parts`` makes them (one buffer up to 256 KiB: the peer wakes once);
``drain`` waits only while the transport has paused writing (its buffer over the high-water mark).
The gateway's ``ClientConnection`` goes further for its one call at a time: the call is
written with no coroutine (``send``), and an answer received whole in one read is cut with one
core call and handed to the waiting call as its wait's result, with no frame queued.

Why not asyncio streams: a ``StreamReader`` costs a ``readexactly`` per prefix and per payload,
each a coroutine with its own bookkeeping; on a small call that was a sizeable part of the
round trip (bench/README.md, the channel section).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any, Final, cast

from ._core_api import core
from ._loop_turns import turned
from .errors import (
    EndOfFramesError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    WireError,
)
from .wire import Buffer, FrameDecoder, frame_parts

__all__ = ["MAX_UNREAD_FRAMES", "ClientConnection", "FrameConnection"]

#: Whole frames kept unread before a connection stops reading (two calls, or four answers):
#: a peer that sends faster than its frames are taken then waits in its socket, not in this
#: process's memory (as a stream reader pauses over its limit); reading resumes as they go.
MAX_UNREAD_FRAMES: Final = 4
cut_frame = core.chan_frame  # bytes that are exactly one whole frame: its payload (``_core_chan``)


class FrameConnection(asyncio.Protocol):
    """Frames in, frames out, over one transport. After an error every read raises it."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.transport: asyncio.Transport | None = None
        #: the loop the transport belongs to, known once connected (None before, or driven by
        #: hand outside a loop): asked once, not per call (``asyncio.get_running_loop`` makes a
        #: ``getpid`` system call on Python 3.11)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._decoder = FrameDecoder(max_bytes=max_frame_bytes)
        #: part of a frame waits in the decoder (its ``pending``, kept as a plain attribute: the
        #: usual call's paths ask it up to three times a round trip, and a property is a Python
        #: call each time); only ``data_received``'s ``feed`` changes it
        self._partial = False
        self._frames: collections.deque[bytes] = collections.deque()
        #: why reading ended: a FrameError, an OSError, or EndOfFramesError at a clean end
        self.error: BaseException | None = None
        #: what ``data_received`` or the end resolves: None, or (``ClientConnection``) the frame
        self._waiter: asyncio.Future[bytes | None] | None = None
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False  # over MAX_UNREAD_FRAMES (see ``_took``)
        #: the deadline of the ``next_frame`` wait in progress (loop clock), and the one timer
        #: that enforces it (``_on_timer``)
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        #: a whole call cut and decoded as it arrived (the worker's: ``_channel_server``),
        #: served before any frame received after it
        self.call: tuple[Any, list[Any]] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a Unix stream socket's
        try:  # the transport's, which calls this protocol from its loop
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand, outside a loop: each wait asks for its own
            self.loop = None

    def data_received(self, data: bytes) -> None:
        turned()  # the loop turned (``_loop_turns``: the async faces' checkpoints)
        if self.error is not None:
            return
        try:
            self._frames.extend(self._decoder.feed(data))
        except (FrameError, FrameTooLargeError) as exc:
            self._partial = self._decoder.pending > 0
            self._fail(exc)
            self.abort()  # out of step: nothing more is read from it
            return
        self._partial = self._decoder.pending > 0
        if len(self._frames) >= MAX_UNREAD_FRAMES and self.transport is not None:
            self._reading_paused = True  # whole frames wait: taking them reads on (``_took``)
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        try:
            self._decoder.close()
        except IncompleteFrameError as exc:  # the peer ended inside a frame
            self._partial = False  # the decoder dropped that part
            self._fail(exc)
        else:
            self._fail(EndOfFramesError("the stream ended (no more frames)"))
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc if exc is not None else EndOfFramesError("the connection was closed"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- for the channel ----------------------------------------------------------------------

    def has_frames(self, n: int) -> bool:
        """Whether ``n`` whole frames are waiting."""
        return len(self._frames) >= n

    def take(self) -> bytes:
        """The next whole frame (``has_frames`` said there is one)."""
        frame = self._frames.popleft()
        if self._reading_paused:
            self._took()
        return frame

    def started(self) -> bool:
        """Whether any byte of a frame is waiting (or reading has ended). The worker's usual
        case, a call cut as it arrived, is asked first."""
        return (
            self.call is not None or bool(self._frames) or self.error is not None or self._partial
        )

    async def wait_started(self) -> None:
        """Wait until a byte of a frame arrives; raise the error if reading ended first."""
        while not self.started():
            await self._waiter_future()
        if (
            self.error is not None  # the rare case first: one test on the usual path
            and self.call is None
            and not self._frames
            and not self._partial
        ):
            raise self.error

    async def next_frame(self, deadline: float | None = None) -> bytes:
        """The next whole frame, once it is in; the error if reading ends first.

        ``TimeoutError`` if ``deadline`` (on the loop's clock) passes first. The connection
        keeps one timer for its waits (``_on_timer``): a wait whose deadline is not earlier than
        the armed timer's reuses it, so a connection whose calls have the same timeout arms
        about one timer per timeout, not one per call (``call_at`` and ``cancel`` cost ~1.8 us
        a call on uvloop, more than a timeout scope's share).
        """
        while not self._frames:
            if self.error is not None:
                raise self.error
            if deadline is None:
                await self._waiter_future()
                continue
            self._deadline = deadline
            if self._timer is None or self._timer_at > deadline:
                self._arm(deadline)
            try:
                await self._waiter_future()
            finally:
                self._deadline = None
        frame = self._frames.popleft()
        if self._reading_paused:
            self._took()
        return frame

    def usable(self) -> bool:
        """Open, in step, nothing unread (no whole frame, nor part of one): fit for the next
        call. Part of a frame that nobody asked for (a broken peer's stray or duplicate answer
        cut short) would otherwise be completed by later bytes and read as the next call's
        answer."""
        t = self.transport
        return (
            self.error is None
            and t is not None
            and not t.is_closing()
            and not self._frames
            and not self._partial
        )

    def write(self, payloads: Sequence[Buffer]) -> bool:
        """Queue ``payloads`` as frames (``FrameTooLargeError`` over ``max_frame_bytes``);
        whether they must be drained (``drain`` would wait, or raise: the transport paused or
        closing), so that the usual write awaits no coroutine."""
        t = self.transport
        if t is None:
            raise ConnectionResetError("not connected")
        parts = frame_parts(payloads, max_bytes=self.max_frame_bytes)
        if len(parts) == 1:
            t.write(parts[0])
        else:
            t.writelines(parts)
        return self._paused or t.is_closing()

    def write_framed(self, data: bytes) -> bool:
        """Queue ``data``, frames already made (``_channel_format.framed_call``'s); whether it
        must be drained, as ``write``."""
        t = self.transport
        if t is None:
            raise ConnectionResetError("not connected")
        t.write(data)
        return self._paused or t.is_closing()

    async def drain(self, deadline: float | None = None) -> None:
        """Wait while the transport has paused writing; ``ConnectionResetError`` if it closed;
        ``TimeoutError`` if ``deadline`` (on the loop's clock) passes first."""
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the connection is closed")
        if not self._paused:
            return
        if self._drain is None or self._drain.done():
            self._drain = (self.loop or asyncio.get_running_loop()).create_future()
        await _until(self._drain, deadline)
        if t.is_closing():
            raise ConnectionResetError("the connection is closed")

    def queued(self) -> int:
        """Bytes written but still in the transport's buffer."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def abort(self) -> None:
        """Close at once, dropping whatever is still queued."""
        if self.transport is not None:
            self.transport.abort()

    def _took(self) -> None:
        """A frame was taken while reading is paused: read on once fewer frames wait."""
        t = self.transport
        if len(self._frames) < MAX_UNREAD_FRAMES and t is not None:
            self._reading_paused = False
            if not t.is_closing():
                t.resume_reading()

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = (self.loop or asyncio.get_running_loop()).call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        """The timer fired: the wait in progress times out if its deadline was the timer's (or
        earlier); a later one re-arms the timer for itself; with no wait, the timer lapses."""
        self._timer = None
        at = self._deadline
        if at is None:
            return
        if at <= self._timer_at:
            self._deadline = None
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_exception(TimeoutError())
        else:
            self._arm(at)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        self._deadline = None  # the wait is over (a ``next_frame`` that waits again sets it)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _waiter_future(self) -> asyncio.Future[bytes | None]:
        """The future the next ``data_received`` or the end resolves (awaited directly: no
        coroutine of its own)."""
        if self._waiter is None or self._waiter.done():
            self._waiter = (self.loop or asyncio.get_running_loop()).create_future()
        return self._waiter

    #: ``_waiter_future`` for the worker's serving task, which awaits the next bytes (or the
    #: end) itself, with no coroutine level of its own (``wait_started``'s); the method itself,
    #: not a method around it (one frame less per call)
    arrival = _waiter_future


class ClientConnection(FrameConnection):
    """The gateway's connection (``EngineClient``): one call at a time, written in one go.

    ``send`` writes a call without a coroutine and says whether it must be waited for: the
    usual call's send needs no drain (the transport took it whole, or below its high-water
    mark), so the call goes from an idle connection to the wait for its answer with no
    coroutine level in between (each cost ~1.5k instructions per round trip).
    """

    def send(self, frames: tuple[bytes, bytes] | bytes) -> bool:
        """Queue a call: its two frames, or (``bytes``) the frames ``framed_call`` made.

        Returns whether the caller must ``await drain`` before the call counts as sent: the
        transport paused writing, or it is closing (``drain`` then raises). ``WireError`` if a
        frame exceeds ``max_frame_bytes`` (nothing written).
        """
        t = self.transport
        if t is None:
            raise ConnectionResetError("not connected")
        if isinstance(frames, bytes):
            t.write(frames)
        else:
            head, body = frames
            if len(head) > self.max_frame_bytes or len(body) > self.max_frame_bytes:
                raise WireError(f"the call exceeds max_frame_bytes={self.max_frame_bytes}")
            self.write(frames)
        return self._paused or t.is_closing()

    def data_received(self, data: bytes) -> None:
        """An answer that arrives in one read while its call waits, nothing else received, is
        cut with one core call (``chan_frame``) and handed to the call as its wait's result
        (``answer``): no frame queued, no decoder. Any other bytes (a frame in pieces, two
        frames, no wait) are cut as they arrive (``FrameConnection``)."""
        waiter = self._waiter
        if (
            waiter is not None
            and not waiter.done()
            and not self._frames
            and not self._partial
            and self.error is None
            and (frame := cut_frame(data, self.max_frame_bytes)) is not None
        ):
            self._waiter = None
            self._deadline = None
            waiter.set_result(frame)
            turned()  # as ``FrameConnection.data_received`` counts
            return
        super().data_received(data)

    def answer(self, deadline: float) -> asyncio.Future[bytes | None]:
        """The wait for the call's answer, awaited by the call itself (no coroutine here), by
        ``deadline`` (the loop's clock: the connection's one timer, ``next_frame``'s rule).

        Its result is the answer when it came whole in one read (``data_received``); None
        when it came otherwise, or reading ended: ``next_frame`` then takes it (or raises).
        """
        if self._frames or self.error is not None:  # a frame came during the drain, or the end
            done: asyncio.Future[bytes | None] = (
                self.loop or asyncio.get_running_loop()
            ).create_future()
            done.set_result(None)
            return done
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            self._arm(deadline)
        return self._waiter_future()


async def _until(future: asyncio.Future[None], deadline: float | None) -> None:
    """Await ``future``; ``TimeoutError`` if ``deadline`` (on the loop's clock) passes first."""
    if deadline is None:
        await future
        return
    timer = asyncio.get_running_loop().call_at(deadline, _expire, future)
    try:
        await future
    finally:
        timer.cancel()


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
