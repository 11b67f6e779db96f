"""The engine worker pool: spawning, supervising and talking to the worker processes.

The gateway listens on a Unix socket in a private directory (mode 0700). Each worker is a fresh
interpreter (``python -m aioshmcache demo worker``), started with ``asyncio``'s subprocess API;
it attaches to the cache, connects, and says hello with a per-pool secret (passed in its
environment, not on the command line). A worker is *ready* once its hello arrived.

Requests are multiplexed by id on each worker's connection. A worker's death is noticed twice,
whichever comes first: its connection ends, or its process exits. Either fails its pending
requests with :class:`WorkerDied` at once (no request waits for a timeout), bumps
:attr:`WorkerPool.generation` and, unless the pool is stopping, starts a replacement (with a
short backoff and a restart budget against crash loops).

Delivery modes (they must match ``CacheConfig(delivery=...)``):

* ``broadcast`` (tensor-parallel ranks): every request goes to every worker, and every worker
  reads every hand-out. The group is only available when *all* workers are ready; a hand-out
  made while the group changed (``generation`` moved: a death, a spawn) is released and the
  request fails with 503, so no live reader is ever left owing a hand-out it was never sent.
* ``one_of_n`` (a worker pool): each request goes to the least-loaded ready worker (ties in
  round-robin order). When that worker dies the gateway retries on another one with a fresh
  hand-out; the orphaned hand-out expires after ``handout_ttl``.

Shutdown is bounded: ``stop`` messages, then SIGTERM after ``stop_timeout``, then SIGKILL.

External workers (``worker_dir``, the demo's ``--gateway-workers N``): the pool spawns nothing.
The serving process started the engine workers once for every gateway process; the pool
listens on ``worker_dir/gw-<pid>.sock``, where the workers find it, and each worker connects
and says hello (with the token the serving process gave both). Their supervision is the serving
process's; the pool only tracks their connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ..framing import ProtocolError, pack, read_frame
from .imaging import ProcessorConfig
from .worker import TOKEN_ENV

__all__ = ["SOCKET_DIR_PREFIX", "WorkerDied", "WorkerInfo", "WorkerPool", "WorkerUnavailable"]

log = logging.getLogger("aioshmcache.tools.demo")

#: the gateway's socket directory is ``$TMPDIR/aioshmcache-demo-<segment>-<random>``
SOCKET_DIR_PREFIX = "aioshmcache-demo-"


class WorkerUnavailable(Exception):
    """No (or not every, for broadcast) worker is ready: nothing was sent."""


class WorkerDied(Exception):
    """A worker's connection ended while this request was in flight."""


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    pid: int = 0
    writer: asyncio.StreamWriter | None = None
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    ready: bool = False
    starts: int = 0
    served: int = 0
    last_exit: int | None = None
    monitor: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    pid: int
    ready: bool
    starts: int
    served: int
    inflight: int
    last_exit: int | None


class WorkerPool:
    """Start ``n`` workers attached to the cache ``handle`` and dispatch requests to them."""

    def __init__(
        self,
        n: int,
        handle: dict[str, Any],
        *,
        delivery: Literal["broadcast", "one_of_n"],
        processor: ProcessorConfig,
        loop: Literal["asyncio", "uvloop"] = "asyncio",
        restart: bool = True,
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        max_restarts_per_minute: int = 20,
        worker_dir: str | None = None,
        token: str | None = None,
    ) -> None:
        if n < 1:
            raise ValueError("need at least one worker")
        self.n = n
        self.handle = handle
        self.delivery = delivery
        self.processor = processor
        self.loop_kind = loop
        self.restart = restart
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.max_restarts_per_minute = max_restarts_per_minute
        self.generation = 0
        self.restarts = 0
        self.deaths = 0
        self._workers = [_Worker(i) for i in range(n)]
        self._token = token or secrets.token_hex(16)
        self._external = worker_dir  # external workers connect to a socket in this directory
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._stopping = False
        self._starting = True
        self._start_error: str | None = None
        self._restart_times: list[float] = []
        self._changed: asyncio.Event | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()

    # --- lifetime ------------------------------------------------------------------------
    @property
    def socket_path(self) -> str:
        if self._external is not None:
            return os.path.join(self._external, f"gw-{os.getpid()}.sock")
        if self._dir is None:
            raise RuntimeError("the pool is not started")
        return os.path.join(self._dir, "workers.sock")

    async def start(self) -> None:
        """Listen, spawn every worker and wait (bounded) until each one said hello."""
        self._changed = asyncio.Event()
        if self._external is None:
            # named after the segment, so that whoever cleans up after a killed gateway finds it
            name = self.handle.get("name", "")
            self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{name}-")
        self._server = await asyncio.start_unix_server(self._on_connect, path=self.socket_path)
        try:
            for w in self._workers:
                if self._external is None:
                    await self._spawn(w)
            deadline = time.monotonic() + self.start_timeout
            while not all(w.ready for w in self._workers):
                if self._start_error is not None:
                    raise RuntimeError(f"worker startup failed: {self._start_error}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [w.index for w in self._workers if not w.ready]
                    raise RuntimeError(
                        f"workers {missing} did not attach within {self.start_timeout} s"
                    )
                await self._wait_changed(remaining)
        except BaseException:
            await self.stop()
            raise
        finally:
            self._starting = False

    async def stop(self) -> None:
        """Stop every worker (stop message, SIGTERM, SIGKILL; bounded) and remove the socket."""
        self._stopping = True
        for w in self._workers:
            if w.writer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._write(w, pack({"t": "stop"})), 1.0)
        procs = [w.proc for w in self._workers if w.proc is not None]
        for sig, wait in ((None, self.stop_timeout), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.returncode is None]
            if not alive:
                break
            if sig is not None:
                for p in alive:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(sig)
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in alive], timeout=wait)
        for w in self._workers:
            if w.monitor is not None and w.monitor is not asyncio.current_task():
                w.monitor.cancel()
            self._mark_dead(w, "the pool is stopping")
            if w.writer is not None:
                w.writer.close()
                w.writer = None
        if self._external is not None and self._conn_tasks:
            # external workers close a connection on "stop": let them, rather than cancel
            await asyncio.wait(list(self._conn_tasks), timeout=2.0)
        for t in list(self._conn_tasks):
            t.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._external is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    # --- supervision -----------------------------------------------------------------------
    def _command(self, w: _Worker) -> list[str]:
        return [
            sys.executable,
            "-m",
            "aioshmcache",
            "demo",
            "worker",
            "--socket",
            self.socket_path,
            "--index",
            str(w.index),
            "--handle",
            json.dumps(self.handle),
            "--processor",
            json.dumps(self.processor.to_dict()),
            "--loop",
            self.loop_kind,
        ]

    async def _spawn(self, w: _Worker) -> None:
        self.generation += 1
        w.ready = False
        env = dict(os.environ)
        env[TOKEN_ENV] = self._token
        proc = await asyncio.create_subprocess_exec(
            *self._command(w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            env=env,
        )
        w.proc, w.pid = proc, proc.pid
        w.starts += 1
        w.monitor = asyncio.ensure_future(self._monitor(w, proc))

    async def _monitor(self, w: _Worker, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if w.proc is not proc:
            return
        w.last_exit = rc
        if self._stopping:
            return
        self.deaths += 1
        log.warning("worker %d (pid %d) exited with %s", w.index, proc.pid, rc)
        self._mark_dead(w, f"worker {w.index} (pid {proc.pid}) exited with code {rc}")
        if self._starting:  # a worker that cannot even start: fail the startup at once
            self._start_error = f"worker {w.index} (pid {proc.pid}) exited with code {rc}"
            self._notify()
            return
        if not self.restart:
            return
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < 60.0]
        if len(self._restart_times) >= self.max_restarts_per_minute:
            log.error("worker %d: restart budget exhausted; not restarting", w.index)
            return
        self._restart_times.append(now)
        await asyncio.sleep(0.1)
        if not self._stopping:
            self.restarts += 1
            await self._spawn(w)

    def _mark_dead(self, w: _Worker, why: str) -> None:
        if w.ready:
            self.generation += 1
        w.ready = False
        pending, w.pending = w.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(why))
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_changed(self, timeout: float) -> None:
        ev = self._changed
        if ev is None:
            return
        ev.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout)

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until every worker is ready (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while not self.all_ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await self._wait_changed(min(remaining, 0.1))
        return True

    # --- the channel -----------------------------------------------------------------------
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        w: _Worker | None = None
        try:
            hello = await asyncio.wait_for(read_frame(reader), 10.0)
            w = self._accept_hello(hello)
            if w is None:
                return
            w.writer = writer
            w.ready = True
            self.generation += 1
            self._notify()
            while True:
                msg = await read_frame(reader)
                if msg is None:
                    break
                if msg["t"] == "result":
                    fut = w.pending.pop(msg.get("id", -1), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except (asyncio.TimeoutError, ConnectionError, ProtocolError) as exc:
            log.info("worker channel: %s", exc)
        except Exception:
            log.exception("worker channel failed")
        finally:
            if w is not None and w.writer is writer:
                w.writer = None
                self._mark_dead(w, f"worker {w.index} (pid {w.pid}) closed its connection")
            writer.close()
            if task is not None:
                self._conn_tasks.discard(task)

    def _accept_hello(self, hello: dict[str, Any] | None) -> _Worker | None:
        if hello is None or hello.get("t") != "hello":
            log.warning("worker channel: no hello")
            return None
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            log.warning("worker channel: bad token")
            return None
        idx = hello.get("worker")
        if not isinstance(idx, int) or not 0 <= idx < self.n:
            return None
        w = self._workers[idx]
        if self._external is not None and isinstance(hello.get("pid"), int):
            w.pid = int(hello["pid"])  # not our child: whoever says hello with the token
        if hello.get("pid") != w.pid or w.writer is not None or self._stopping:
            log.warning("worker channel: unexpected hello from pid %s", hello.get("pid"))
            return None
        return w

    async def _write(self, w: _Worker, frame: bytes) -> None:
        writer = w.writer
        if writer is None or writer.is_closing():
            raise WorkerDied(f"worker {w.index} is not connected")
        async with w.write_lock:
            try:
                writer.write(frame)
                await writer.drain()
            except (ConnectionError, OSError, RuntimeError) as exc:  # uvloop: RuntimeError
                raise WorkerDied(f"worker {w.index}: {exc}") from None

    # --- dispatch ----------------------------------------------------------------------------
    def all_ready(self) -> bool:
        return all(w.ready for w in self._workers)

    def any_ready(self) -> bool:
        return any(w.ready for w in self._workers)

    def available(self) -> bool:
        return self.all_ready() if self.delivery == "broadcast" else self.any_ready()

    def check_available(self) -> None:
        if self.available():
            return
        down = [w.index for w in self._workers if not w.ready]
        if self.delivery == "broadcast":
            raise WorkerUnavailable(
                f"worker(s) {down} not ready (restarting); broadcast needs every worker"
            )
        raise WorkerUnavailable("no engine worker is ready (all restarting)")

    def _targets(self) -> list[_Worker]:
        self.check_available()
        if self.delivery == "broadcast":
            return list(self._workers)
        ready = [w for w in self._workers if w.ready]
        start = next(self._rr) % len(ready)
        ordered = ready[start:] + ready[:start]
        return [min(ordered, key=lambda w: len(w.pending))]

    async def dispatch(self, features: bytes, *, timeout: float) -> list[dict[str, Any]]:
        """Send one request (its features packed by ``encode_features``) and gather the replies.

        ``WorkerUnavailable`` means nothing was sent. Otherwise the frame is handed to every
        target's transport synchronously, before the first ``await``: a cancellation can never
        leave a broadcast half-sent (a live rank owing a hand-out it never received). Returns
        one reply per target; ``WorkerDied`` if a target's connection ended, and
        ``asyncio.TimeoutError`` if a reply is late — in both cases only after the other
        targets' replies were awaited (so their reads are settled).
        """
        targets = self._targets()
        rid = next(self._ids)
        frame = pack({"t": "infer", "id": rid, "features": features})
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[dict[str, Any]]] = []
        for w in targets:  # no await in this loop: all or nothing
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            futs.append(fut)
            writer = w.writer
            try:
                if writer is None or writer.is_closing():
                    raise WorkerDied(f"worker {w.index} is not connected")
                writer.write(frame)
            except (ConnectionError, OSError, RuntimeError) as exc:  # uvloop: RuntimeError
                fut.set_exception(WorkerDied(f"worker {w.index}: {exc}"))
                continue
            w.pending[rid] = fut

        async def one(w: _Worker, fut: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
            try:
                if not fut.done():
                    await self._drain(w)
                reply = await asyncio.wait_for(fut, timeout)
                w.served += 1
                return reply
            finally:
                w.pending.pop(rid, None)
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: no "exception was never retrieved" noise

        results = await asyncio.gather(
            *(one(w, f) for w, f in zip(targets, futs)), return_exceptions=True
        )
        replies: list[dict[str, Any]] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            replies.append(r)
        return replies

    async def _drain(self, w: _Worker) -> None:
        """Flow control after a write (the bytes are already in the transport's buffer)."""
        writer = w.writer
        if writer is None:
            return
        async with w.write_lock:
            try:
                await writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                pass  # the reply future fails when the connection's end is noticed

    # --- observation -------------------------------------------------------------------------
    def info(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(w.index, w.pid, w.ready, w.starts, w.served, len(w.pending), w.last_exit)
            for w in self._workers
        ]
