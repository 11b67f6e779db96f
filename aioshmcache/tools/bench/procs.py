"""The other process of every cross-process workload: one spawned worker, driven by commands.

Spawning costs about half a second here (a fresh interpreter imports numpy), so one worker
serves a whole suite. It receives commands on a control ``Pipe`` and answers each one; the data
paths it serves are the ones being measured (references or arrays over the same pipe). Every
loop it runs ends on a sentinel (``None``) or when the pipe closes, so a benchmark that fails
midway never leaves it hanging; ``Worker.close`` joins with a timeout and terminates as a last
resort.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from aioshmcache import ShmObjectStore
from aioshmcache.store import StoreReader

__all__ = ["Worker", "run_spawned"]

JOIN_TIMEOUT = 10.0


def _until_none(recv: Callable[[], Any]) -> Iterator[Any]:
    while (msg := recv()) is not None:
        yield msg


def _read(store: StoreReader, ref: Any, mode: str) -> int:
    """Read ``ref``: a copy, or (``lease``) a zero-copy view acknowledged at once; the ns taken."""
    t0 = time.perf_counter_ns()
    if mode == "copy":
        store.get(ref)
    else:
        store.get(ref, copy=False)
        store.ack(ref)
    return time.perf_counter_ns() - t0


def _close_all(stores: list[StoreReader]) -> None:
    for s in stores:
        with contextlib.suppress(Exception):
            s.close()
    stores.clear()


def _dispatch(cmd: str, args: tuple[Any, ...], conn: Connection, stores: list[Any]) -> Any:
    """One command; its loops read from the pipe until ``None``."""
    if cmd == "attach":  # ("attach", handle, n): claim n reader slots
        stores.extend(ShmObjectStore.from_handle(args[0]) for _ in range(args[1]))
        return len(stores)
    if cmd == "detach":
        _close_all(stores)
    elif cmd == "read":  # ("read", mode, reply): lists of refs; read each, reply times if asked
        for batch in _until_none(conn.recv):
            times = [_read(stores[0], ref, args[0]) for ref in batch]
            if args[1]:
                conn.send(times)
    elif cmd == "pipe_echo":  # arrays over the pipe; echo them back, or reply their size
        for arr in _until_none(conn.recv):
            conn.send(arr if args[0] else arr.nbytes)
    elif cmd != "ping":
        raise ValueError(f"unknown command {cmd!r}")
    return None


def _serve(conn: Connection) -> None:
    """The worker's main loop (runs in the spawned process)."""
    stores: list[StoreReader] = []
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if not (isinstance(msg, tuple) and msg and isinstance(msg[0], str)):
                continue  # a stray item of an aborted data loop
            if msg[0] == "exit":
                conn.send(("ok",))
                return
            try:
                reply = ("ok", _dispatch(msg[0], msg[1:], conn, stores))
            except Exception as exc:  # report, keep serving
                reply = ("error", f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    finally:
        _close_all(stores)


class Worker:
    """The spawned worker process and the pipe that reaches it.

    Started by the first workload that needs it (:meth:`attempt`); a workload that fails with
    it leaves it in an unknown state, so it is ended at once and the next one starts afresh.
    """

    conn: Connection
    proc: BaseProcess | None = None

    def attempt(self, report: Any, what: str, fn: Callable[[Worker], object]) -> None:
        """``report.attempt`` of ``fn(worker)``, the process started first if it is not."""
        if not report.attempt(what, lambda: fn(self._started())) and self.proc is not None:
            self.proc.terminate()
            self.close()

    def _started(self) -> Worker:
        if self.proc is None:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_serve, args=(child,), name="aioshmcache-bench-worker")
            self.proc.daemon = True
            self.proc.start()
            child.close()
            self.call("ping", timeout=60.0)
        return self

    def reply(self, timeout: float = 120.0) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"bench worker did not answer within {timeout} s")
        r: tuple[Any, ...] = self.conn.recv()
        if isinstance(r, tuple) and r and r[0] == "error":
            raise RuntimeError(f"bench worker: {r[1]}")
        return r

    def call(self, *msg: Any, timeout: float = 120.0) -> tuple[Any, ...]:
        self.conn.send(msg)
        return self.reply(timeout)

    @contextlib.contextmanager
    def serving(self, *command: Any) -> Iterator[Connection]:
        """The worker runs the data loop ``command`` for the block; at its end ``None`` on the
        pipe ends the loop, and its answer is waited for."""
        self.conn.send(command)
        try:
            yield self.conn
        finally:
            self.conn.send(None)
            self.reply()

    @contextlib.contextmanager
    def attached(
        self, handle: Any, n: int = 1, *, reads: str = "", reply: bool = False
    ) -> Iterator[Connection]:
        """``n`` reader slots on ``handle`` for the block; with ``reads`` (``copy`` or ``lease``)
        the first reads the lists of references sent to it (and with ``reply`` replies the
        times of each list's reads)."""
        self.call("attach", handle, n)
        try:
            serve = self.serving("read", reads, reply) if reads else contextlib.nullcontext()
            with serve:
                yield self.conn
        finally:
            self.call("detach")

    def close(self) -> None:
        if (proc := self.proc) is None:
            return
        with contextlib.suppress(Exception):
            if proc.is_alive():
                self.conn.send(("exit",))
                if self.conn.poll(JOIN_TIMEOUT):
                    self.conn.recv()
        proc.join(JOIN_TIMEOUT)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_TIMEOUT)
        self.conn.close()
        self.proc = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_spawned(
    target: Callable[..., None], args: list[tuple[Any, ...]], *, timeout: float
) -> list[Any]:
    """``target(*a, barrier, out)`` in a spawned process per ``a``; the one result each puts.

    The simulated gateways and hosts of the group and fleet suites: they start their load
    together behind ``barrier`` (one party per process) and put one result on ``out``. Every
    process is joined, and killed if it is still alive a minute later.
    """
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(args)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args]
    for proc in procs:
        proc.start()
    try:
        return [out.get(timeout=timeout) for _ in procs]
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
