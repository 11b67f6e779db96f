"""The children's side of the one protocol, and what writer and reader share.

``python -m aioshmcache.tools.stress ROLE SOCKET TOKEN SPEC`` connects to the parent, says
``hello`` (a writer, once its cache is open: with its handle) and serves until ``exit`` or the
parent is gone (it dies with the parent, even on SIGKILL: ``PR_SET_PDEATHSIG``). A message
(:mod:`..framing`) names the receiver's ``on_<t>`` method; one with ``re`` is a question,
answered by ``{"t": "re", "re": ..., **result}``. A request carries its features as
``pack_features`` bytes in ``f``, each one's digest and size in ``c``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import random
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, NamedTuple, TypeVar

import anyio

from aioshmcache import ShmRef
from aioshmcache.wire import unpack_features

from ..framing import Link, ProtocolError
from .options import StressOptions

T = TypeVar("T")
HB_INTERVAL: Final = 0.5  # a child silent for --hang-timeout hangs
MAX_FRAME: Final = 1 << 24
#: the self-test (``--sabotage``): every this-many-th reference lies about its digest and every
#: this-many-th request holding one is dropped; the run goes on until each was seen MIN_SEEN
#: times, for at most GRACE seconds past ``--duration``
SABOTAGE_EVERY, SABOTAGE_MIN_SEEN, SABOTAGE_GRACE = 10, 3, 300.0
#: one feature of a request: mm_hash, its reference (None: served inline), digest, size
Feature = tuple[str, ShmRef | None, int, int]


def sock_path(name: str) -> str:
    """``@name`` is the abstract socket ``\\0name`` (argv cannot carry a NUL byte)."""
    return "\0" + name[1:] if name.startswith("@") else name


def request_features(msg: dict[str, Any]) -> list[Feature]:
    """The features of a ``req`` message, references decoded by ``unpack_features``."""
    specs, checks = unpack_features(msg["f"]), msg["c"]
    if not isinstance(checks, list) or len(checks) != len(specs):
        raise ProtocolError("a request needs one [digest, size] per feature")
    return [
        (f.mm_hash, f.data if isinstance(f.data, ShmRef) else None, int(d), int(n))
        for f, (d, n) in zip(specs, checks)
    ]


class Outcome(NamedTuple):
    kind: str  # ok | error | cancelled | timeout
    value: Any = None
    exc: BaseException | None = None


async def guarded(
    make: Callable[[], Awaitable[Any]], *, mode: str, deadline: float, rng: random.Random
) -> Outcome:
    """One library call under a deadline, cancelled mid-way by the ``cancel`` fault.

    ``mode`` ``"task"``: a raw ``Task.cancel()`` once started (a call that finishes without
    suspending counts as "completed first"); ``"scope"``: a tiny ``anyio.move_on_after`` (it
    lands at anyio checkpoints only: ``to_thread.run_sync`` holds it back); ``"none"``.
    """
    if mode == "task":
        started = asyncio.Event()

        async def run() -> Any:
            started.set()
            return await make()

        task = asyncio.ensure_future(run())
        await started.wait()  # cancel mid-operation, not before the call began
        if not task.done():
            await asyncio.sleep(rng.uniform(0.0, 0.004))
        task.cancel()
        if not (await asyncio.wait({task}, timeout=deadline))[0]:
            return Outcome("timeout")
        if task.cancelled():
            return Outcome("cancelled")
        exc = task.exception()
        return Outcome("error", exc=exc) if exc is not None else Outcome("ok", task.result())
    try:
        with anyio.move_on_after(rng.uniform(0.0, 0.006) if mode == "scope" else deadline):
            return Outcome("ok", await make())
    except Exception as exc:
        return Outcome("error", exc=exc)
    return Outcome("cancelled" if mode == "scope" else "timeout")


class Proc:
    """What both children do: messages, violations, heartbeats."""

    who = "?"

    def __init__(self, opts: StressOptions, link: Link, token: str, seed: int) -> None:
        self.opts, self.link, self.token, self.rng = opts, link, token, random.Random(seed)

    def send(self, t: str, **kw: Any) -> None:
        self.link.send({"t": t, **kw})

    def violation(self, text: str) -> None:
        self.send("violation", who=self.who, text=text)

    def cancel_mode(self) -> str:
        if "cancel" not in self.opts.faults or self.rng.random() >= self.opts.cancel_prob:
            return "none"
        return self.rng.choice(("task", "scope"))

    def hb(self) -> dict[str, Any]:
        return {}

    async def heartbeat(self) -> None:
        while True:
            self.send("hb", **self.hb())
            await asyncio.sleep(HB_INTERVAL)

    async def serve(self) -> None:
        """Handle the parent's messages until ``exit`` or the end of the link."""
        while (got := await self.link.recv()) is not None and got[0]["t"] != "exit":
            out = await getattr(self, "on_" + got[0]["t"])(got[0])
            if "re" in got[0]:
                self.send("re", re=got[0]["re"], **(out or {}))


def run_loop(loop: str, coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``coro()`` on a fresh event loop: ``"asyncio"`` or ``"uvloop"``."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro())
    return asyncio.run(coro())


def child_main(argv: list[str]) -> int:
    """The child's whole life; its exit status (3: it crashed)."""
    with contextlib.suppress(Exception):  # die with the parent: no orphan process
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    role, sock, token, spec = argv[0], argv[1], argv[2], json.loads(argv[3])
    opts = StressOptions.from_child_dict(spec.pop("opts"))
    if opts.switch_interval > 0:
        sys.setswitchinterval(opts.switch_interval)

    async def amain() -> None:
        from .reader import ReaderProc
        from .writer import WriterProc

        link = Link(*await asyncio.open_unix_connection(sock_path(sock)), max_frame=MAX_FRAME)
        proc = (WriterProc if role == "writer" else ReaderProc)(opts, link, token, **spec)
        try:
            await proc.run()
        except Exception as exc:
            proc.violation(f"{role} crashed: {exc!r}\n{traceback.format_exc()}")
            raise
        finally:
            with contextlib.suppress(Exception):
                await link.writer.drain()
            await link.close()

    try:
        run_loop(opts.loop, amain)
    except BaseException:
        traceback.print_exc()
        return 3
    return 0
