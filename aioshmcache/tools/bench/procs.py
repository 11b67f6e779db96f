"""The other process of every cross-process workload: one spawned worker, driven by commands.

Spawning costs about half a second here (a fresh interpreter imports numpy), so one worker
serves a whole suite. It receives commands on a control ``Pipe`` and answers each one; the data
paths it serves are the ones being measured (references over the same pipe, arrays over a
``Pipe`` or a ``Queue``). Every loop it runs ends on a sentinel (``None``) or when the pipe
closes, so a benchmark that fails midway never leaves it hanging; ``Worker.close`` joins with a
timeout and terminates as a last resort.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from aioshmcache import ShmObjectStore, ShmRef, StoreReader

__all__ = ["LazyWorker", "Worker"]

JOIN_TIMEOUT = 10.0


def _serve(conn: Connection, q_in: Any, q_out: Any) -> None:
    """The worker's main loop (runs in the spawned process)."""
    stores: list[StoreReader] = []

    def detach() -> None:
        for s in stores:
            with contextlib.suppress(Exception):
                s.close()
        stores.clear()

    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if not (isinstance(msg, tuple) and msg and isinstance(msg[0], str)):
                continue  # a stray item of an aborted data loop
            cmd, args = msg[0], msg[1:]
            if cmd == "exit":
                conn.send(("ok",))
                return
            try:
                reply = _dispatch(cmd, args, conn, q_in, q_out, stores, detach)
            except Exception as exc:  # report, keep serving
                reply = ("error", f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    finally:
        detach()


def _dispatch(
    cmd: str,
    args: tuple[Any, ...],
    conn: Connection,
    q_in: Any,
    q_out: Any,
    stores: list[StoreReader],
    detach: Any,
) -> tuple[Any, ...]:
    if cmd == "attach":  # ("attach", handle, n): claim n reader slots
        handle, n = args
        stores.extend(ShmObjectStore.from_handle(handle) for _ in range(n))
        return ("ok", len(stores))
    if cmd == "detach":
        detach()
        return ("ok",)
    if cmd == "serve_refs":  # refs arrive one by one; read each, reply a small int
        (mode,) = args
        store = stores[0]
        n = 0
        while True:
            ref = conn.recv()
            if ref is None:
                break
            conn.send(_read(store, ref, mode))
            n += 1
        return ("ok", n)
    if cmd == "timed_gets":  # batches of refs; time each get; reply the samples per batch
        (mode,) = args
        store = stores[0]
        clock = time.perf_counter_ns
        while True:
            batch = conn.recv()
            if batch is None:
                break
            out: list[int] = []
            for ref in batch:  # the get alone is timed (no size computed inside)
                t0 = clock()
                if mode == "copy":
                    store.get(ref)
                else:
                    store.get(ref, copy=False)
                    store.ack(ref)
                out.append(clock() - t0)
            conn.send(out)
        return ("ok",)
    if cmd == "ack_stream":  # churn: refs in small lists; read (copy) and acknowledge each
        (mode,) = args
        store = stores[0]
        n = 0
        while True:
            batch = conn.recv()
            if batch is None:
                break
            for ref in batch:
                _read(store, ref, mode)
                n += 1
        return ("ok", n)
    if cmd == "pipe_echo":  # arrays over the pipe; echo them back, or reply their size
        (echo,) = args
        n = 0
        while True:
            arr = conn.recv()
            if arr is None:
                break
            conn.send(arr if echo else arr.nbytes)
            n += 1
        return ("ok", n)
    if cmd == "queue_echo":
        (echo,) = args
        n = 0
        while True:
            try:
                arr = q_in.get(timeout=1.0)
            except queue.Empty:
                parent = mp.parent_process()
                if parent is not None and not parent.is_alive():
                    break
                continue
            if arr is None:
                break
            q_out.put(arr if echo else arr.nbytes)
            n += 1
        return ("ok", n)
    if cmd == "ping":
        return ("ok",)
    return ("error", f"unknown command {cmd!r}")


def _read(store: StoreReader, ref: Any, mode: str) -> int:
    """Read ``ref``: a copy, or (``lease``) a zero-copy view acknowledged at once; its bytes."""
    if mode == "copy":
        return _nbytes(store.get(ref))
    value = store.get(ref, copy=False)
    nb = _nbytes(value)
    del value
    store.ack(ref)
    return nb


def _nbytes(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return int(getattr(value, "nbytes", 0))


class Worker:
    """A spawned worker process and the pipe and queues that reach it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.q_in: Any = ctx.Queue()
        self.q_out: Any = ctx.Queue()
        self.proc = ctx.Process(
            target=_serve, args=(child, self.q_in, self.q_out), name="aioshmcache-bench-worker"
        )
        self.proc.daemon = True
        self.proc.start()
        child.close()
        self.call("ping", timeout=60.0)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def reply(self, timeout: float = 120.0) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"bench worker did not answer within {timeout} s")
        r: tuple[Any, ...] = self.conn.recv()
        if r and r[0] == "error":
            raise RuntimeError(f"bench worker: {r[1]}")
        return r

    def call(self, *msg: Any, timeout: float = 120.0) -> tuple[Any, ...]:
        self.send(*msg)
        return self.reply(timeout)

    def attach(self, handle: Any, n: int = 1) -> None:
        self.call("attach", handle, n)

    def detach(self) -> None:
        self.call("detach")

    def send_refs(self, refs: Sequence[ShmRef] | ShmRef | None) -> None:
        self.conn.send(refs)

    def kill(self) -> None:
        """End the worker at once (after a failed workload left it in an unknown state)."""
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(JOIN_TIMEOUT)
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.is_alive():
                self.conn.send(("exit",))
                if self.conn.poll(JOIN_TIMEOUT):
                    self.conn.recv()
        self.proc.join(JOIN_TIMEOUT)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(JOIN_TIMEOUT)
        with contextlib.suppress(Exception):
            self.conn.close()
        for q in (self.q_in, self.q_out):
            with contextlib.suppress(Exception):
                q.close()
                q.join_thread()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LazyWorker:
    """Starts a worker on first use; ``reset`` kills it so the next use starts a fresh one."""

    def __init__(self) -> None:
        self._worker: Worker | None = None

    def get(self) -> Worker:
        if self._worker is None:
            self._worker = Worker()
        return self._worker

    def reset(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> LazyWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
