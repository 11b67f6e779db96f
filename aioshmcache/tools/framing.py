"""Msgpack messages on asyncio streams, one per :mod:`aioshmcache.wire` frame.

The stress harness's channel between its parent and children. A message is a msgpack map whose
string ``"t"`` names its type; ``msgpack.unpackb`` bounds every length by the frame's size. The
framing is ``aioshmcache.wire``'s own (``read_frame``, ``encode_frame``): this module adds only
the messages on top, and no framing of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import anyio
import msgpack

from aioshmcache import wire
from aioshmcache.errors import EndOfFramesError, IncompleteFrameError

__all__ = ["Link", "ProtocolError"]


class ProtocolError(Exception):
    """A malformed message."""


class Link:
    """One end of a framed connection: a peer that dies (even mid-frame) reads as the end."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, max_frame: int
    ) -> None:
        self.reader, self.writer, self.max_frame = reader, writer, max_frame

    def send(self, msg: dict[str, Any]) -> None:
        self.send_body(msgpack.packb(msg))

    def send_body(self, body: bytes) -> None:
        """Send a message already packed (forwarded as received, or packed once for many)."""
        if not self.writer.is_closing():
            self.writer.write(wire.encode_frame(body, max_bytes=self.max_frame))

    async def recv(self) -> tuple[dict[str, Any], bytes] | None:
        """The next message and its packed body; None at the end."""
        try:
            body = await wire.read_frame(self.reader, max_bytes=self.max_frame)
        except (EndOfFramesError, IncompleteFrameError, ConnectionError):
            return None
        msg = msgpack.unpackb(body)
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise ProtocolError("a message must be a map with a string 't'")
        return msg, body

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            with anyio.move_on_after(2):
                await self.writer.wait_closed()
