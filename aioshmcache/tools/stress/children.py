"""The parent's view of its child processes: state, link, killing them, checking none is left."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from typing import Any, BinaryIO

import anyio

from ..framing import Link

__all__ = ["Child", "child_pids", "open_log"]


def open_log(path: str) -> BinaryIO:
    """A child's stdout and stderr go here."""
    return open(path, "wb")


@dataclasses.dataclass(eq=False)
class Child:
    """A child process as the parent sees it: its link, its state under faults, its replies."""

    role: str
    token: str
    proc: asyncio.subprocess.Process
    log_path: str
    pos: int = -1
    gen: int = 0
    name: str = ""
    link: Link | None = None
    connected: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    eof: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    handle_msg: dict[str, Any] | None = None
    got_handle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_hb: float = 0.0
    stopped: bool = False
    busy: bool = False  # a fault is acting on it
    killed_by_us: bool = False
    attached_gen: int = 0
    rc_seen: bool = False
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    replies: dict[str, asyncio.Future[dict[str, Any]]] = dataclasses.field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict[str, Any]) -> None:
        if self.link is not None:
            self.link.send(msg)

    async def kill(self, *, wait_link: bool, within: float = 10.0) -> bool:
        """SIGKILL; True once it is reaped (and its link closed) within ``within`` seconds."""
        self.killed_by_us = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        with anyio.move_on_after(within):
            await self.proc.wait()
            if wait_link:
                await self.eof.wait()
            return True
        return False

    def send_raw(self, frame: bytes) -> None:
        if self.link is not None:
            self.link.send_raw(frame)

    def log_tail(self, n: int = 1200) -> str:
        """The end of its log (what it printed before it crashed)."""
        try:
            with open(self.log_path, "rb") as f:
                data = f.read()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace").strip()


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this one, from /proc/*/stat."""
    me, pids = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] != b"Z":
            pids.append(int(d))
    return pids
