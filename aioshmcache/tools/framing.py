"""Msgpack messages on asyncio streams, one per :mod:`aioshmcache.wire` frame: the tools' channel.

The framing is the library's own (:func:`aioshmcache.wire.read_frame` / ``encode_frame``: an
8-byte little-endian length, then the payload, refused before anything is read when it declares
more than the maximum size). Each payload is a msgpack map with a string ``"t"`` (the message
type), decoded with explicit size limits. Features inside a message travel as the bytes of
:func:`aioshmcache.wire.pack_features`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Final

import anyio
import msgpack

from aioshmcache import wire
from aioshmcache.errors import EndOfFramesError, FrameError, IncompleteFrameError

__all__ = [
    "MAX_FRAME",
    "Link",
    "ProtocolError",
    "TruncatedFrameError",
    "pack",
    "read_frame",
    "read_frame_raw",
    "write_frame",
]

MAX_FRAME: Final = wire.DEFAULT_MAX_FRAME_BYTES


class ProtocolError(Exception):
    """A malformed frame or message."""


class TruncatedFrameError(ProtocolError):
    """The stream ended inside a frame (the peer died while writing)."""


def pack(message: Mapping[str, Any], *, max_frame: int = MAX_FRAME) -> bytes:
    """One frame holding ``message``."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    try:
        return wire.encode_frame(body, max_bytes=max_frame)
    except FrameError:
        raise ProtocolError(
            f"message of {len(body)} bytes exceeds the frame limit {max_frame}"
        ) from None


async def write_frame(
    writer: asyncio.StreamWriter, message: Mapping[str, Any], lock: asyncio.Lock | None = None
) -> None:
    """Send one message (under ``lock`` when several tasks share the writer)."""
    frame = pack(message)
    if lock is None:
        writer.write(frame)
        await writer.drain()
        return
    async with lock:
        writer.write(frame)
        await writer.drain()


def _decode(body: bytes, max_frame: int) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=1 << 20,
            max_bin_len=max_frame,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("a message must be a map with a string 't'")
    return msg


async def read_frame_raw(
    reader: asyncio.StreamReader, *, max_frame: int = MAX_FRAME
) -> tuple[dict[str, Any], bytes] | None:
    """The next message and its frame as received (to forward it unchanged); None at the end."""
    try:
        body = await wire.read_frame(reader, max_bytes=max_frame)
    except EndOfFramesError:
        return None
    except IncompleteFrameError as exc:
        raise TruncatedFrameError(str(exc)) from None
    except FrameError as exc:  # a declared length over the limit
        raise ProtocolError(str(exc)) from None
    return _decode(body, max_frame), wire.encode_frame(body, max_bytes=max_frame)


async def read_frame(
    reader: asyncio.StreamReader, *, max_frame: int = MAX_FRAME
) -> dict[str, Any] | None:
    """Read one message; ``None`` at a clean end of stream."""
    got = await read_frame_raw(reader, max_frame=max_frame)
    return None if got is None else got[0]


class Link:
    """One end of a framed connection whose peer may die at any time (then it reads as EOF)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame

    def send(self, msg: Mapping[str, Any]) -> None:
        self.send_raw(pack(msg, max_frame=self.max_frame))

    def send_raw(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame)

    async def recv_raw(self) -> tuple[dict[str, Any], bytes] | None:
        """The next message and its frame; None at the end or when the peer died mid-frame."""
        try:
            return await read_frame_raw(self.reader, max_frame=self.max_frame)
        except (TruncatedFrameError, ConnectionError):
            return None

    async def recv(self) -> dict[str, Any] | None:
        got = await self.recv_raw()
        return None if got is None else got[0]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            with anyio.move_on_after(2):
                await self.writer.wait_closed()
