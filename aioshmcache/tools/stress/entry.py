"""A child process of the harness: ``python -m aioshmcache.tools.stress ROLE SOCKET TOKEN SPEC``.

Started by the parent only. It connects to the parent's socket, says hello and runs as the writer
or a reader until told to exit or the parent is gone; it dies with the parent even if the parent
is SIGKILLed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from ..framing import Link
from .options import StressOptions
from .protocol import MAX_FRAME, sock_path
from .reader import ReaderProc
from .writer import WriterProc

__all__ = ["child_main", "run_loop"]

PR_SET_PDEATHSIG: Final = 1
T = TypeVar("T")


def set_pdeathsig() -> None:
    """Children die with the parent (no orphan process even if the harness is killed)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_loop(loop: str, coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``coro()`` on a fresh event loop: ``"asyncio"`` or ``"uvloop"``."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro())
    return asyncio.run(coro())


def child_main(argv: list[str]) -> int:
    """The child's whole life; its exit status (3: it crashed)."""
    set_pdeathsig()
    role, sock, token, blob = argv[0], argv[1], argv[2], argv[3]
    spec = json.loads(blob)
    opts = StressOptions.from_child_dict(spec["opts"])
    if opts.switch_interval > 0:
        sys.setswitchinterval(opts.switch_interval)

    async def amain() -> None:
        reader, writer = await asyncio.open_unix_connection(sock_path(sock))
        link = Link(reader, writer, max_frame=MAX_FRAME)
        link.send({"t": "hello", "token": token, "pid": os.getpid()})
        try:
            if role == "writer":
                w = WriterProc(
                    opts, int(spec["gen"]), str(spec["name"]), str(spec["delivery"]), link
                )
                try:
                    await w.run()
                except Exception as exc:
                    link.send(
                        {
                            "t": "violation",
                            "who": f"writer g{spec['gen']}",
                            "text": f"writer crashed: {exc!r}\n{traceback.format_exc()}",
                        }
                    )
                    raise
            else:
                r = ReaderProc(opts, token, int(spec["seed"]), link)
                await r.run()
        finally:
            with contextlib.suppress(Exception):
                await writer.drain()
            await link.close()

    try:
        run_loop(opts.loop, amain)
    except BaseException:
        traceback.print_exc()
        return 3
    return 0
