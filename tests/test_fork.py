"""Fork: a child never keeps a dead parent's writer or reader looking alive.

A writer or reader process forks a child (the ``fork`` start method), then is SIGKILLed while the
child lives. The kernel lock of the parent must die with the parent: readers see
``WriterGoneError`` and ``sweep`` removes the orphan; a dead reader's debts are dropped at the
writer's next free attempt. The child cannot use its parent's cache object (``RoleError`` telling
it to attach again).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

from aioshmcache import (
    CacheConfig,
    FeatureSpec,
    ReceiverCache,
    RoleError,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    WriterGoneError,
)
from aioshmcache._sweep import sweep

from .helpers import SPAWN, gone, kill_and_reap, wait_until

FORK = mp.get_context("fork")


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
    if pid and not gone(pid):
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: gone(pid), timeout=30.0)


def _use_the_parent_s_store(store: ShmObjectStore, ref: dict[str, Any], conn: Any) -> None:
    """Forked child: every use of the parent's store is a RoleError; then live on.

    ``put``: the writer's, or for a reader a name of the other role, which says so too."""
    results: list[object] = []
    for call in (
        lambda: cast(Any, store).put("child", {"x": 2}),
        lambda: store.get(ref),
        store.reader_info,
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
            assert not gone(grandchild)  # the child lives on, holding the inherited mapping

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
            assert not gone(grandchild)
            assert wait_until(lambda: store.is_freeable("a"), timeout=30.0)
            assert store.evict() == ["a"]
            assert not any(s.alive for s in store.reader_info())
        finally:
            kill_and_reap(reader)
            _kill_grandchild(grandchild)


def test_fork_hook_closes_only_the_lock_descriptor(make_config: Any) -> None:
    """In the child, the parent's segment is marked forked and its lock descriptor is closed."""
    with ShmObjectStore.create(make_config()) as store:
        fd = store._seg.fd
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


def _writer_calls(tx: SenderCache, ref: ShmRef) -> dict[str, Callable[[], object]]:
    """Every writer method of the cache and of its store, as calls a forked child might make."""
    st = tx.store
    feat = FeatureSpec("h0", None)
    return {
        "is_cached": lambda: tx.is_cached("h0"),
        "request": lambda: tx._request([None], ["h0"]),
        "features_request": lambda: tx._features_request([feat]),
        "get_and_update_item hit": lambda: tx.get_and_update_item(None, "h0"),
        "get_and_update_item put": lambda: tx.get_and_update_item(({"x": 1}, ()), "new"),
        "get_and_update": lambda: tx.get_and_update([None], ["h0"]),
        "get_and_update_features": lambda: tx.get_and_update_features([feat]),
        "touch": lambda: tx.touch("h0"),
        "release": lambda: tx.release(ref),
        "invalidate": lambda: tx.invalidate("h0"),
        "clear": tx.clear,
        "remove_dangling_items": tx.remove_dangling_items,
        "cached_order": tx.cached_order,
        "is_freeable": lambda: tx.is_freeable("h0"),
        "snapshot": tx.snapshot,
        "store.drain": st.drain,
        "store.is_freeable": lambda: st.is_freeable("h0"),
        "store.keys": st.keys,
        "store.ref_of": lambda: st.ref_of("h0"),
        "store.reader_info": st.reader_info,
        "store.evict": st.evict,
        "store.pin": lambda: st.pin("h0"),
        "store.pin_entry": lambda: st.pin_entry("h0"),
        "store.unpin": lambda: st.unpin("h0"),
        "store.get_cached": lambda: st.get_cached("h0"),
        "store.touch": lambda: st.touch("h0"),
        "store.put": lambda: st.put("new", {"x": 1}),
        "store.release": lambda: st.release(ref),
        "store.invalidate": lambda: st.invalidate("h0"),
        "store.clear": st.clear,
    }


def _child_uses_the_parent_s_writer(tx: SenderCache, ref: ShmRef, conn: Any) -> None:
    """Forked child: report, per writer method, the error it raised (or that it raised none)."""
    out = {}
    for name, call in _writer_calls(tx, ref).items():
        try:
            call()
            out[name] = "no error"
        except RoleError as exc:
            out[name] = "RoleError" if "attach again" in str(exc) else f"RoleError: {exc}"
        except Exception as exc:  # report anything else to the test
            out[name] = f"{type(exc).__name__}: {exc}"
    conn.send(out)
    conn.close()


def _child_touches_with_the_parent_s_reader(rx: ReceiverCache, ref: ShmRef, conn: Any) -> None:
    """Forked child: the error ``touch`` of the parent's reader raised (or that it raised none)."""
    try:
        rx.touch("h", ref)
        conn.send("no error")
    except Exception as exc:  # report anything to the test
        conn.send(f"{type(exc).__name__}: {exc}")
    conn.close()


def _forked_report(target: Callable[..., None], *args: Any) -> tuple[Any, int | None]:
    """Run ``target(*args, conn)`` in a forked child: what it sends back, and its exit code
    (the child reaped on every path)."""
    a, b = FORK.Pipe()
    child = FORK.Process(target=target, args=(*args, b))
    child.start()
    try:
        assert a.poll(60), "the forked child did not report"
        got = a.recv()
        child.join(60)
        return got, child.exitcode
    finally:
        kill_and_reap(child)


def test_a_forked_child_s_touch_of_its_parent_s_reader_is_role_error(make_config: Any) -> None:
    """A reader's ``touch`` probes the writer; in a forked child the copy probes no lock, so the
    parent's live writer was reported dead (``WriterGoneError``): ``RoleError`` first, as a read."""
    cfg = make_config(64 * 1024, 8 * 1024, 1)
    with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
        ref = tx.get_and_update_item(({"a": np.zeros(8)}, ()), "h")[0]
        assert isinstance(ref, ShmRef)
        got, _ = _forked_report(_child_touches_with_the_parent_s_reader, rx, ref)
        assert got.startswith("RoleError") and "attach again" in got, got
        rx.touch("h", ref)  # the parent's reader and writer are fine


def test_a_forked_child_cannot_touch_its_parent_s_writer(
    make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19 item 2: every writer method raises ``RoleError`` in a forked child before it
    touches anything, so the parent's accounting is undisturbed.

    Before the fix the child's ``snapshot()`` drained the reader's log (writing the writer's
    words in shared memory) and ``is_freeable`` / ``cached_order`` ran: the parent then called the
    log inconsistent, dropped real acknowledgements, and served the following puts inline.
    """
    caplog.set_level(logging.WARNING, logger="aioshmcache")
    n = 31  # hand-outs: fewer than half the log, so the parent drains none of them
    cfg = make_config(64 * 1024, 8 * 1024, 1, ack_log_entries=64)
    with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
        blob = np.zeros(256, np.uint8)
        refs = [tx.get_and_update_item(({"a": blob + i}, ()), f"h{i}")[0] for i in range(n - 1)]
        spare = tx.get_and_update_item(None, "h0")[0]
        assert tx.release(spare)  # the parent can; the child must not
        for i, ref in enumerate(refs):
            rx.get_and_update_item(ref, f"h{i}")
        got, exitcode = _forked_report(_child_uses_the_parent_s_writer, tx, spare)
        assert exitcode == 0
        assert {k: v for k, v in got.items() if v != "RoleError"} == {}
        for _ in range(2):  # read everything twice more: had the child drained the log, these
            for i, ref in enumerate(refs):  # acknowledgements would overwrite unread ones
                rx.get_and_update_item(ref, f"h{i}")
        # the parent's accounting is undisturbed: every acknowledgement counts
        assert tx.snapshot().readers[0].lag == 0
        assert all(tx.is_freeable(f"h{i}") for i in range(n - 1))
        assert tx.cached_order() == [f"h{i}" for i in range(n - 1)]
        big = np.zeros(4000, np.uint8)  # 40 puts of 4 KB need the ring's room many times over
        for i in range(40):
            ref = tx.get_and_update_item(({"a": big + i}, ()), f"k{i}")[0]
            assert isinstance(ref, ShmRef), f"put {i} was served inline"
            assert int(rx.get_and_update_item(ref, f"k{i}")["a"][0]) == i
        assert tx.snapshot().readers[0].lag == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_forked_child_with_the_writer_lock_held_gets_role_error_not_a_hang(
    make_config: Any,
) -> None:
    """Forked while another thread holds the writer lock, the child inherits it held forever:
    every sender request entry point must raise ``RoleError`` before it would take that lock
    (the request's roll back takes it too, so the check comes before the request's ``try``),
    and the child's close of its copy does not wait for it."""
    import select
    import threading

    with SenderCache(make_config()) as tx:
        tx.get_and_update_item(({"x": 1}, ()), "h0")
        calls: dict[str, Callable[[], object]] = {
            "get_and_update_item": lambda: tx.get_and_update_item(None, "h0"),
            "get_and_update": lambda: tx.get_and_update([None], ["h0"]),
            "get_and_update_features": lambda: tx.get_and_update_features(
                [FeatureSpec("h0", None)]
            ),
        }
        held, done = threading.Event(), threading.Event()

        def hold() -> None:
            with tx.store.lock:
                held.set()
                done.wait(60)

        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(30)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                out = []
                for name, call in calls.items():
                    try:
                        call()
                        out.append(f"{name}: no error")
                    except RoleError:
                        out.append(f"{name}: RoleError")
                    except Exception as exc:
                        out.append(f"{name}: {type(exc).__name__}")
                tx.close()  # its copy, at once: the lock held in the parent is not waited for
                out.append("closed")
                os.write(w, "\n".join(out).encode())
                os._exit(0)
            os.close(w)
            try:
                ready, _, _ = select.select([r], [], [], 30)
                got = os.read(r, 4096).decode() if ready else ""
            finally:
                os.close(r)
                if not got:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        finally:
            done.set()
            t.join(30)
        want = [f"{name}: RoleError" for name in calls] + ["closed"]
        assert got.splitlines() == want, got or "hang"


def _leader_whose_make_forks(group: str, conn: Any) -> None:
    """A group leader whose ``make`` forks a helper that lives on; then it waits (to be killed)."""
    import asyncio

    from aioshmcache import AsyncSenderCache

    async def main() -> None:
        cfg = CacheConfig(4 << 20, 1 << 20, 1, group=group)
        async with AsyncSenderCache.from_config(cfg) as cache:

            async def make() -> dict[str, Any]:
                pid = os.fork()  # what a fork-started process pool does
                if pid == 0:
                    signal.pause()  # a helper that lives on (the test kills it)
                    os._exit(0)
                conn.send(pid)
                await asyncio.sleep(3600)
                return {"x": 1}

            await cache.get_or_put("h", make)

    asyncio.run(main())


@pytest.mark.slow
def test_a_forked_helper_does_not_keep_a_dead_leader_s_marker(shm_name: str) -> None:
    """The group single-flight marker is not inherited: the leader SIGKILLed while the helper
    its ``make`` forked lives, a sibling claims the hash at once (not after its whole wait)."""
    import anyio

    from aioshmcache._flight import GroupFlight, marker_directory

    group = f"{shm_name}g"
    a, b = SPAWN.Pipe()
    leader = SPAWN.Process(target=_leader_whose_make_forks, args=(group, b))
    leader.start()
    helper = 0
    try:
        assert a.poll(60)
        helper = a.recv()

        async def held_by_the_leader() -> bool:
            probe = GroupFlight(group, wait_s=3600.0)
            with anyio.move_on_after(0.05):  # the first try is made before any wait
                await probe.claim("h", lambda: False)
            return probe.waited == 1 and not probe.holds("h")

        assert anyio.run(held_by_the_leader)
        kill_and_reap(leader)
        assert not gone(helper)  # the helper lives on, with the leader's marker fd closed

        async def claim() -> bool:
            with anyio.fail_after(30):
                return await gf.claim("h", lambda: False)

        gf = GroupFlight(group, wait_s=3600.0)  # before the fix: waited all of it
        assert anyio.run(claim)
        assert gf.holds("h")  # claimed the marker itself, not given up on it
        gf.release("h")
    finally:
        kill_and_reap(leader)
        _kill_grandchild(helper)
        sweep(prefix=group)
    assert not os.path.exists(marker_directory(group))


class _HeldRead:
    """The default serde, whose reads wait for ``go`` once they have started (``entered``)."""

    def __init__(self) -> None:
        import threading

        from aioshmcache.store import MsgpackSerde

        self.inner = MsgpackSerde()
        self.entered, self.go = threading.Event(), threading.Event()

    def plan(self, obj: object) -> Any:
        return self.inner.plan(obj)

    def write(self, plan: Any, buf: memoryview) -> None:
        self.inner.write(plan, buf)

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        self.entered.set()
        self.go.wait(60)
        return self.inner.read(buf, copy=copy)


def test_a_forked_child_closes_a_reader_copy_at_once_while_a_parent_thread_reads(
    make_config: Any,
) -> None:
    """Forked while another thread of the parent is in the middle of a read, the child's close
    of its reader copy neither waits for that read (the child has no such thread: it would wait
    the whole close bound, 5 s, for nothing) nor leaves the copy to a last read that never
    comes; the parent's read ends as usual."""
    import select
    import threading

    with SenderCache(make_config()) as tx:
        serde = _HeldRead()
        rx = ReceiverCache.attach(tx.handle(), serde=serde)
        ref = tx.get_and_update_item(({"x": np.arange(8)}, ()), "h0")[0]
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(rx.get_and_update_item(ref, "h0")))
        t.start()
        try:
            assert serde.entered.wait(30)  # a read in flight in another thread
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                start = time.monotonic()
                rx.close()
                took = time.monotonic() - start
                os.write(w, f"{took:.3f} {rx.closed}".encode())
                os._exit(0)
            os.close(w)
            try:
                ready, _, _ = select.select([r], [], [], 30)
                out = os.read(r, 4096).decode() if ready else ""
            finally:
                os.close(r)
                if not out:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        finally:
            serde.go.set()
            t.join(30)
        took_s, closed = out.split()
        assert float(took_s) < 1.0 and closed == "True", out
        assert np.array_equal(got[0]["x"], np.arange(8))  # the parent's read is untouched
        rx.close()
