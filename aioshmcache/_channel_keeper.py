"""Who serves an engine path, and keeping one engine worker alive for it (``EngineClient(start=)``).

One worker per path: a worker takes the path's lock file (``path + ".lock"``, an ``flock`` the
kernel releases if the worker dies) before it listens, and removes it when it stops cleanly; a
gateway probes the lock without keeping it to learn whether a worker lives. The keeper of a
client started with ``start=`` polls that lock and, whichever process finds none, starts a
worker in a spawned process (``run_worker``), which takes the lock before ``start`` runs, so a
starter that lost the race leaves at once and quietly; a worker that crashes soon after its
start is restarted after a pause that doubles (0.5 s up to 30 s), and a started worker leaves
when the process that started it is gone (even killed -9).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import multiprocessing
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from typing import Final

from .errors import EngineAddressInUseError

__all__ = [
    "WorkerKeeper",
    "lock_held",
    "lock_path",
    "release_path",
    "run_worker",
    "stop_process",
    "take_path",
]

log = logging.getLogger("aioshmcache.channel")

#: how long a new engine worker tries to take the path's lock (a prober may hold it briefly)
_LOCK_TRIES_S: Final = 1.0
_STOP_GRACE_S: Final = 10.0
_KEEP_POLL_S: Final = 0.5  # how often the keeper checks the worker
_KEEP_QUICK_S: Final = 5.0  # a worker that crashes sooner than this after its start ...
_KEEP_MAX_S: Final = 30.0  # ... is restarted after a pause that doubles up to this


def lock_path(path: str) -> str:
    return path + ".lock"


def lock_held(path: str) -> bool:
    """Whether a live engine worker holds ``path``'s lock (probed without keeping it)."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our shared lock, if we got it
    return False


#: path -> lock fd, for a path this process took before ``serve_engine`` ran (``run_worker``)
_HELD: dict[str, int] = {}


def take_path(path: str) -> int:
    """Take ``path``'s lock (kernel-released if we die) and clear a dead worker's socket file.

    The lock file is removed by the worker that holds it when it stops cleanly
    (:func:`release_path`), so a lock taken on a file that is no longer the one at the lock's
    path (a stopping worker removed it while we waited) is let go and taken again on the file
    that is there now.
    """
    held = _HELD.pop(path, None)
    if held is not None:
        return held  # taken by this process already (flock would refuse a second open of it)
    lock = lock_path(path)
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
        release_path(path, fd)
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


def release_path(path: str, fd: int) -> None:
    """Let go of ``path``'s lock taken by :func:`take_path`, removing the lock file.

    Removed while still locked, so that a worker waiting for the lock finds it gone and
    takes a new file's lock (:func:`take_path`); a gateway's probe (:func:`lock_held`)
    finds no file: no worker.
    """
    try:
        if _is_at(fd, lock_path(path)):
            os.unlink(lock_path(path))
    except OSError:
        pass
    finally:
        os.close(fd)


def stop_process(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()
    proc.join(_STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join(_STOP_GRACE_S)


def run_worker(start: Callable[[str], None], path: str, starter: int | None = None) -> None:
    """A spawned engine worker's entry: take the path, then ``start(path)``.

    The path's lock is taken before ``start`` runs (before it attaches a reader anywhere), so a
    process that lost the race to another starter leaves at once and quietly; ``serve_engine``
    in ``start`` then uses the lock this process already holds. ``starter``: the pid of the
    process that started this one (the keeper's), so that a starter gone before this process
    got here (it was reparented already) is seen gone.
    """
    try:
        _HELD[path] = take_path(path)
    except EngineAddressInUseError as exc:
        if exc.errno == errno.EADDRINUSE:
            return  # another worker serves the path: this starter lost the race
        raise  # it cannot serve the path (not a socket): a failed start, paused and logged
    try:  # (a starter gone already: the SIGINT may come before ``start`` runs)
        threading.Thread(
            target=_leave_with_the_starter,
            args=(os.getppid() if starter is None else starter,),
            name="aioshm-starter",
            daemon=True,
        ).start()
        start(path)
    except KeyboardInterrupt:
        return
    finally:
        held = _HELD.pop(path, None)
        if held is not None:  # ``start`` never reached ``serve_engine``
            release_path(path, held)


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


class WorkerKeeper:
    """Keeps one engine worker alive for ``path`` among every process that uses it.

    ``begin()`` starts polling (in the running loop); ``aclose()`` stops it and stops the worker
    this keeper started, if any.
    """

    def __init__(self, path: str, start: Callable[[str], None]) -> None:
        self.path = path
        self._start = start
        self._child: multiprocessing.process.BaseProcess | None = None
        #: a worker being started, and its start (in a thread, which ``aclose`` cannot stop)
        self._starting: tuple[multiprocessing.process.BaseProcess, asyncio.Future[None]] | None
        self._starting = None
        self._task: asyncio.Task[None] | None = None

    def begin(self) -> None:
        """Start keeping (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._keep())

    async def aclose(self) -> None:
        """Stop keeping; stop the worker this keeper started. Idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        child, self._child = self._child, None
        starting, self._starting = self._starting, None
        if starting is not None:  # closed while a worker was being started: it is ours too
            proc, started = starting
            try:
                await started
            except Exception:
                pass  # it did not start
            else:
                child = proc
        if child is not None:
            await asyncio.to_thread(stop_process, child)

    async def _keep(self) -> None:
        """Start an engine worker whenever none holds the path's lock (and ours is not alive).

        A worker that crashes (exits non-zero) soon after it started is restarted with a growing
        pause (0.5 s doubling to 30 s), so that a worker that cannot start does not spin.
        """
        start = self._start
        ctx = multiprocessing.get_context("spawn")
        pause, started = _KEEP_POLL_S, 0.0
        while True:
            mine = self._child
            if (mine is None or not mine.is_alive()) and not lock_held(self.path):
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
                child = ctx.Process(
                    target=run_worker, args=(start, self.path, os.getpid()), daemon=True
                )
                starting = asyncio.ensure_future(asyncio.to_thread(child.start))
                self._starting = (child, starting)
                await asyncio.shield(starting)  # cancelled here, ``aclose`` stops the child
                self._starting = None
                self._child, started = child, time.monotonic()
            await asyncio.sleep(_KEEP_POLL_S)
