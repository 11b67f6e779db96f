"""Fork: a child never keeps a dead parent's writer or reader looking alive.

A writer or reader process forks a child (the ``fork`` start method), then is SIGKILLed while the
child lives. The kernel lock of the parent must die with the parent: readers see
``WriterGoneError`` and ``sweep`` removes the orphan; a dead reader's debts are dropped at the
writer's next free attempt. The child cannot use its parent's cache object (``RoleError`` telling
it to attach again).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from aioshmcache import (
    CacheConfig,
    RoleError,
    ShmObjectStore,
    ShmRef,
    WriterGoneError,
)
from aioshmcache._sweep import sweep

from .helpers import SPAWN, kill_and_reap, wait_until

FORK = mp.get_context("fork")


def _gone(pid: int) -> bool:
    """The process is gone or a zombie (a zombie holds no descriptor and no lock)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _messages(conn: Any) -> dict[str, Any]:
    """The parent's and the forked child's messages, by sender: they share one pipe, and the
    child may well report before its parent does (it starts first)."""
    out: dict[str, Any] = {}
    while len(out) < 2:
        assert conn.poll(60)
        who, what = conn.recv()
        out[who] = what
    return out


def _kill_grandchild(pid: int) -> None:
    """Kill a process started by a child of ours (re-parented when that child died)."""
    if pid and not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: _gone(pid), timeout=30.0)


def _use_the_parent_s_store(store: ShmObjectStore, ref: dict[str, Any], conn: Any) -> None:
    """Forked child: every use of the parent's store is a RoleError; then live on."""
    results: list[object] = []
    for call in (
        lambda: store.put("child", {"x": 2}),
        lambda: store.get(ref),
        lambda: store.check_reader(),
    ):
        try:
            call()
            results.append("no error")
        except RoleError as exc:
            results.append("attach again" in str(exc))
        except Exception as exc:  # report anything else to the test
            results.append(type(exc).__name__)
    conn.send(("child", results))
    time.sleep(3600)


def _writer_that_forks(name: str, conn: Any) -> None:
    store = ShmObjectStore.create(CacheConfig(1 << 20, 1 << 18, 2, name=name))
    ref = store.put("a", {"x": 1})
    child = FORK.Process(target=_use_the_parent_s_store, args=(store, ref.to_dict(), conn))
    child.start()
    conn.send(("parent", (store.handle().to_dict(), ref.to_dict(), child.pid)))
    time.sleep(3600)


def _reader_that_forks(handle: dict[str, Any], conn: Any) -> None:
    store = ShmObjectStore.from_handle(handle)
    child = FORK.Process(target=_use_the_parent_s_store, args=(store, {}, conn))
    child.start()
    conn.send(("parent", child.pid))
    time.sleep(3600)


@pytest.mark.slow
def test_writer_killed_while_its_forked_child_lives(shm_name: str) -> None:
    a, b = SPAWN.Pipe()
    writer = SPAWN.Process(target=_writer_that_forks, args=(shm_name, b))
    writer.start()
    grandchild = 0
    try:
        got = _messages(a)
        handle, ref, grandchild = got["parent"]
        assert got["child"] == [True, True, True]  # the child got RoleError, told to attach again
        with ShmObjectStore.from_handle(handle, probe_interval=0.05) as reader:
            assert reader.get(ShmRef.from_dict(ref)) == {"x": 1}
            kill_and_reap(writer)
            assert not _gone(grandchild)  # the child lives on, holding the inherited mapping

            def writer_seen_gone() -> bool:
                try:
                    reader.get(ShmRef.from_dict(ref))
                except WriterGoneError:
                    return True
                return False

            assert wait_until(writer_seen_gone, timeout=30.0)
        removed = sweep(name=shm_name)
        assert f"aioshm-{shm_name}" in removed
        assert not [n for n in os.listdir("/dev/shm") if shm_name in n]
    finally:
        kill_and_reap(writer)
        _kill_grandchild(grandchild)
        sweep(name=shm_name)


@pytest.mark.slow
def test_reader_killed_while_its_forked_child_lives(make_config: Any) -> None:
    with ShmObjectStore.create(make_config(n_readers=1)) as store:
        a, b = SPAWN.Pipe()
        reader = SPAWN.Process(target=_reader_that_forks, args=(store.handle().to_dict(), b))
        reader.start()
        grandchild = 0
        try:
            got = _messages(a)
            grandchild = got["parent"]
            assert got["child"] == [True, True, True]  # the child cannot use its parent's slot
            store.put("a", {"x": 1})  # owed by the reader
            assert not store.is_freeable("a")
            kill_and_reap(reader)
            assert not _gone(grandchild)
            assert wait_until(lambda: store.is_freeable("a"), timeout=30.0)
            assert store.evict() == ["a"]
            assert not any(s.alive for s in store.reader_info())
        finally:
            kill_and_reap(reader)
            _kill_grandchild(grandchild)


def test_fork_hook_closes_only_the_lock_descriptor(make_config: Any) -> None:
    """In the child, the parent's segment is marked forked and its lock descriptor is closed."""
    with ShmObjectStore.create(make_config()) as store:
        fd = store._seg._fd
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            ok = False
            try:
                ok = store._seg.forked and store._seg._fd == -1
                try:
                    os.fstat(fd)
                    ok = False  # still open in the child
                except OSError:
                    pass
                try:
                    _ = store._seg.fd
                    ok = False
                except RoleError:
                    pass
            finally:
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
        os.close(w)
        try:
            assert os.read(r, 1) == b"1"
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        assert store._seg.fd == fd and not store._seg.forked
