"""aioshmcache.channel: the gateway <-> engine worker channel.

In-process tests (the worker's ``serve_engine`` as a task of the test's loop, its receiver
attached in the same process) cover the protocol, errors, hand-outs and drift; the ``e2e`` ones
run the worker as a real spawned process: pool, deadline, kill -9 and restart, shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioshmcache import AsyncReceiverCache, AsyncSenderCache, CacheMissError, FeatureSpec, ShmRef
from aioshmcache.channel import EngineClient, serve_engine
from aioshmcache.errors import (
    EngineAddressInUseError,
    EngineCallError,
    EngineTimeoutError,
    EngineUnavailableError,
    WireError,
)

from . import _channel_procs
from ._channel_procs import crc, handler
from .helpers import SPAWN, kill_and_reap, wait_until


def _item(i: int, n: int = 1024) -> dict[str, Any]:
    return {"x": (np.arange(n, dtype=np.int64) * (i + 1)).astype(np.float32)}


@contextlib.asynccontextmanager
async def _serving(
    path: Path, rx: AsyncReceiverCache, **kw: Any
) -> AsyncIterator[asyncio.Task[None]]:
    """An in-process worker serving ``path`` with ``rx``, listening; stopped at the exit."""
    ready = asyncio.Event()
    task = asyncio.create_task(serve_engine(path, handler, rx, ready=ready.set, **kw))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def _engine(
    make_config: Callable[..., Any], path: Path, **kw: Any
) -> AsyncIterator[tuple[AsyncSenderCache, AsyncReceiverCache, asyncio.Task[None]]]:
    """A sender, an in-process worker serving ``path`` with a receiver of it."""
    async with (
        AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
        _serving(path, rx, **kw) as task,
    ):
        yield cache, rx, task


@contextlib.asynccontextmanager
async def _connected(
    make_config: Callable[..., Any], sock: Path, serve: dict[str, Any] | None = None, **client: Any
) -> AsyncIterator[tuple[AsyncSenderCache, AsyncReceiverCache, EngineClient]]:
    """``_engine`` serving ``sock`` (``serve``: its keywords) and a client connected to it."""
    async with (
        _engine(make_config, sock, **(serve or {})) as (cache, rx, _task),
        EngineClient.connect(sock, cache=cache, **client) as engine,
    ):
        yield cache, rx, engine


async def _features(cache: AsyncSenderCache, ids: range) -> list[FeatureSpec]:
    return await cache.get_and_update_features([FeatureSpec(f"h{i}", _item(i)) for i in ids])


@pytest.mark.parametrize("lease", [False, True])
async def test_call_round_trip_refs_and_inline(
    make_config: Callable[..., Any], tmp_path: Path, lease: bool
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, {"lease": lease}) as (cache, _rx, engine):
        feats = await _features(cache, range(3))
        assert all(isinstance(f.data, ShmRef) for f in feats)
        inline = FeatureSpec("inline", _item(9))
        out = await engine.call([*feats, inline], {"tag": "t1"})
        assert out["hashes"] == ["h0", "h1", "h2", "inline"]
        assert out["crcs"] == [crc(_item(i)["x"]) for i in (0, 1, 2, 9)]
        assert out["tag"] == "t1"
        np.testing.assert_array_equal(out["first"], _item(0)["x"][:4])  # arrays come back
        assert out["first"].dtype == np.float32
        assert cache.snapshot().readers[0].lag == 0  # every hand-out read and acknowledged
        assert not sock.with_name("e.sock").exists() or sock.is_socket()
    assert not sock.exists()  # the worker removed its socket file
    assert not sock.with_name("e.sock.lock").exists()  # and its lock file


async def test_handler_error_is_typed_and_the_connection_stays_usable(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        with pytest.raises(EngineCallError, match="divided by zero") as info:
            await engine.call([f], {"op": "fail"})
        assert info.value.remote_type == "ZeroDivisionError"
        assert cache.snapshot().readers[0].lag == 0  # the features were read before the handler
        out = await engine.call([], {"op": "echo", "n": 1})
        assert out["payload"] == {"op": "echo", "n": 1}
        assert engine.stats().connects == 1


@pytest.mark.parametrize(
    ("op", "remote_type"), [("cancelled", "CancelledError"), ("base", "HandlerBaseError")]
)
async def test_a_handler_raising_a_base_exception_is_an_engine_call_error(
    make_config: Callable[..., Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    op: str,
    remote_type: str,
) -> None:
    """A handler's own ``CancelledError`` or another ``BaseException`` is answered (not a dead
    engine: ``EngineUnavailableError``), logged by the worker, and the connection is reused."""
    caplog.set_level("ERROR", logger="aioshmcache.channel")
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        with pytest.raises(EngineCallError) as info:
            await engine.call([f], {"op": op}, timeout=30)
        assert info.value.remote_type == remote_type
        assert any(
            r.exc_info and type(r.exc_info[1]).__name__ == remote_type for r in caplog.records
        )
        assert cache.snapshot().readers[0].lag == 0
        out = await engine.call([], {"op": "echo", "n": 1}, timeout=30)
        assert out["payload"]["n"] == 1
        assert engine.stats().connects == 1  # the same connection served both


@pytest.mark.parametrize("side", ["engine", "gateway", "unencodable", "int_keys"])
async def test_an_answer_that_cannot_travel_is_a_wire_error(
    make_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture, side: str
) -> None:
    """A result over the engine's ``max_frame_bytes`` (it answers an error instead and logs it),
    over the gateway's (the header says so), or not encodable (an object, map keys that are not
    str or bytes: plain msgpack packed those, the gateway refused them as a malformed message
    and the worker logged nothing): ``WireError``, not a dead engine; the next call is
    served."""
    caplog.set_level("ERROR", logger="aioshmcache.channel")
    sock = tmp_path / "e.sock"
    limit = 1 << 16
    serve = {"max_frame_bytes": limit} if side == "engine" else {}
    client = {"max_frame_bytes": limit} if side == "gateway" else {}
    payload = {"op": side} if side in ("unencodable", "int_keys") else {"op": "big", "n": 2 * limit}
    async with _connected(make_config, sock, serve, **client) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        with pytest.raises(WireError, match=r"too large|exceeds|cannot be encoded"):
            await engine.call([f], payload, timeout=30)
        if side != "gateway":  # the engine knows, says why and keeps the connection
            assert any(
                "max_frame_bytes" in r.getMessage() or "encoded" in r.getMessage()
                for r in caplog.records
            )
        assert cache.snapshot().readers[0].lag == 0  # the worker read the features
        out = await engine.call([], {"op": "echo", "n": 4}, timeout=30)
        assert out["payload"]["n"] == 4
        assert engine.stats().connects == (2 if side == "gateway" else 1)


async def test_unencodable_call_gives_its_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        with pytest.raises(WireError):
            await engine.call([f], {"op": object()})
        assert engine.stats().released == 1
        assert not await cache.release(f.data)  # already given back by the client
        assert cache.snapshot().readers[0].lag == 0


@pytest.mark.parametrize("key", [1, None, 2.5])
@pytest.mark.parametrize("inline", [False, True])
async def test_a_payload_with_map_keys_neither_form_carries_is_refused_at_the_gateway(
    make_config: Callable[..., Any], tmp_path: Path, key: Any, inline: bool
) -> None:
    """Map keys that are not str or bytes: plain msgpack packed them, and the worker refused the
    call (``bad_request``). Neither form of an envelope carries them (the serde's refuses them
    too), so the call cannot be encoded: refused at the gateway, its hand-outs given back
    (``inline``: a version-3 call, an item sent inline)."""
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        features = [f, FeatureSpec("inline", _item(9))] if inline else [f]
        with pytest.raises(WireError, match="the call cannot be encoded"):
            await engine.call(features, {"op": "echo", "m": [{"a": {key: 1}}]})
        assert engine.stats().released == 1
        assert cache.snapshot().readers[0].lag == 0


@pytest.mark.parametrize("bad", [None, "h", {"mm_hash": "h", "data": None}])
async def test_a_call_with_an_item_that_is_not_a_spec_gives_its_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path, bad: Any
) -> None:
    """A call whose features hold something that is not a ``FeatureSpec`` cannot be encoded:
    ``WireError`` (the general form's ``TypeError``), and its hand-outs are given back (the
    version-4 form read ``.data`` of it: an ``AttributeError``, raised again while gathering
    the references to give back, so the hand-out stayed owed)."""
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        with pytest.raises(WireError, match="must be a FeatureSpec"):
            await engine.call([f, bad], {"op": "echo"})
        assert engine.stats().released == 1
        assert cache.snapshot().readers[0].lag == 0


async def test_a_call_without_a_worker_fails_typed_and_gives_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    async with (
        AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()),  # a reader that would owe the hand-out
        EngineClient.connect(tmp_path / "none.sock", cache=cache, backoff_max=0.05) as engine,
    ):
        [f] = await _features(cache, range(1))
        assert cache.snapshot().readers[0].lag == 1
        with pytest.raises(EngineUnavailableError, match="no engine worker"):
            await engine.call([f], timeout=0.5)
        assert engine.stats().connect_failures >= 2  # it kept trying, with backoff
        assert engine.stats().released == 1
        assert cache.snapshot().readers[0].lag == 0
        assert not await cache.release(f.data)


async def test_deadline_then_the_late_answer_never_reaches_the_next_call(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (_cache, _rx, engine):
        with pytest.raises(EngineTimeoutError, match="answer"):
            await engine.call([], {"op": "sleep", "s": 1.0}, timeout=0.2)
        out = await engine.call([], {"op": "echo", "n": 2}, timeout=10)
        assert out["payload"]["n"] == 2  # its own answer, not the slept call's
        assert engine.stats().connects == 2  # the timed-out call's connection was dropped


async def test_the_deadline_bounds_the_wait_for_a_pooled_connection(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """With the one connection lent to a slow call, another call's deadline passes while it
    waits for the pool: ``EngineTimeoutError`` naming that wait, its hand-out given back."""
    sock = tmp_path / "e.sock"
    serve = {"shutdown_timeout": 0.5}
    async with _connected(make_config, sock, serve, max_connections=1) as (cache, _rx, engine):
        slow = asyncio.create_task(engine.call([], {"op": "sleep", "s": 600.0}, timeout=600))
        try:
            await asyncio.to_thread(wait_until, lambda: engine.open_connections == 1)
            [f] = await _features(cache, range(1))
            with pytest.raises(EngineTimeoutError, match="connect"):
                await engine.call([f], timeout=0.2)
            assert engine.stats().released == 1
            assert not slow.done()
        finally:
            slow.cancel()
            await asyncio.gather(slow, return_exceptions=True)
        assert cache.snapshot().readers[0].lag == 0


async def test_cancelled_while_waiting_for_the_pool_gives_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        blocker = asyncio.create_task(engine.call([], {"op": "sleep", "s": 0.5}))
        assert await asyncio.to_thread(wait_until, lambda: engine.open_connections == 1)
        [f] = await _features(cache, range(1))
        waiting = asyncio.create_task(engine.call([f]))
        for _ in range(10):  # loop turns: the call reaches the pool's wait (no I/O before it)
            await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert engine.stats().released == 1
        assert not await cache.release(f.data)
        await blocker
        assert cache.snapshot().readers[0].lag == 0


async def test_cancelled_after_delivery_is_still_read_by_the_worker(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, rx, engine):
        [f] = await _features(cache, range(1))
        call = asyncio.create_task(engine.call([f], {"op": "crc"}))
        assert await asyncio.to_thread(wait_until, lambda: rx.make_stats().total == 1)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        assert engine.stats().released == 0  # delivered: not given back twice
        assert cache.snapshot().readers[0].lag == 0  # the worker read and acknowledged it


async def test_many_concurrent_calls_share_a_bounded_pool(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=3) as (cache, _rx, engine):
        feats = await _features(cache, range(24))
        seen = []

        async def one(f: FeatureSpec) -> None:
            out = await engine.call([f], {"op": "crc"})
            seen.append(out["crcs"][0] == crc(_item(int(f.mm_hash[1:]))["x"]))
            assert engine.open_connections <= 3

        await asyncio.gather(*(one(f) for f in feats))
        assert seen == [True] * 24
        assert engine.stats().connects <= 3


@pytest.mark.parametrize("with_items", [True, False])
async def test_drift_recovery_resends_the_missing_items_inline_once(
    make_config: Callable[..., Any], tmp_path: Path, with_items: bool
) -> None:
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        [stale] = await _features(cache, range(1))
        await cache.clear()  # a new epoch: the reference goes stale (the worker misses it)
        [fresh] = await _features(cache, range(1, 2))
        made: list[str] = []

        def items(h: str) -> dict[str, Any]:
            made.append(h)
            return _item(int(h[1:]))

        if not with_items:
            with pytest.raises(CacheMissError) as info:
                await engine.call([stale, fresh])
            assert info.value.mm_hashes == ("h0",)
            assert not cache.is_cached("h0")  # invalidated for the next request
            return
        out = await engine.call([stale, fresh], items=items)
        assert made == ["h0"]  # only the missing item was asked for
        assert out["crcs"] == [crc(_item(0)["x"]), crc(_item(1)["x"])]
        assert engine.stats().resends == 1
        assert cache.snapshot().readers[0].lag == 0


@pytest.mark.parametrize("how", ["missing", "raises", "cancelled"])
async def test_a_drift_resend_that_cannot_be_built_gives_its_fresh_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path, how: str
) -> None:
    """``[B live, A stale]``: the resend takes a fresh hand-out of B, then building A fails (the
    mapping lacks it, ``items()`` raises, the caller is cancelled inside an async ``items()``).
    The fresh hand-out of B was never sent: it is given back, nothing stays owed."""
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        [stale] = await _features(cache, range(1))
        await cache.clear()  # the worker will miss h0
        [live] = await _features(cache, range(1, 2))
        entered = asyncio.Event()

        async def never(h: str) -> Any:
            entered.set()
            await asyncio.Event().wait()

        def boom(h: str) -> Any:
            raise RuntimeError(f"cannot make {h}")

        items: Any = {"missing": {}, "raises": boom, "cancelled": never}[how]
        call = asyncio.create_task(engine.call([live, stale], items=items))
        if how == "cancelled":
            await asyncio.wait_for(entered.wait(), 30)
            assert cache.snapshot().readers[0].lag == 1  # the fresh hand-out of h1 is out
            call.cancel()
        expected = {"missing": CacheMissError, "raises": RuntimeError}
        with pytest.raises(expected.get(how, asyncio.CancelledError)):
            await call
        assert engine.stats().released == 1  # the fresh hand-out of h1, never sent
        assert cache.snapshot().readers[0].lag == 0  # nothing owed: the ring is not pinned


async def test_callers_queued_behind_the_reconnect_probe_wait_only_for_its_connect(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """After an engine restart the first call probes it; calls queued behind the probe (with
    free slots) go on once the probe *connected*, not after its 8 s call."""
    sock = tmp_path / "e.sock"
    async with (
        AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
        EngineClient.connect(sock, cache=cache, max_connections=4) as engine,
    ):
        with pytest.raises(EngineUnavailableError):
            await engine.call([], {"op": "echo"}, timeout=0.3)  # no engine: backing off
        async with _serving(sock, rx, shutdown_timeout=0.5):  # the restarted engine
            book = engine.pool
            assert await asyncio.to_thread(wait_until, lambda: time.monotonic() >= book.retry_at)
            slow = asyncio.create_task(engine.call([], {"op": "sleep", "s": 8.0}, timeout=60))
            await asyncio.sleep(0)  # it plans: open (the probe), and awaits its connect
            assert book.failures >= 1 and book.opening == 1
            quick = [engine.call([], {"op": "echo", "n": i}, timeout=3.0) for i in range(3)]
            outs = await asyncio.gather(*quick)
            assert [o["payload"]["n"] for o in outs] == [0, 1, 2]
            assert not slow.done()  # the quick ones did not wait for the probe's call
            slow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slow


@pytest.mark.parametrize("retries", [None, 0])
async def test_a_call_whose_worker_went_away_is_sent_again_once(
    make_config: Callable[..., Any], tmp_path: Path, retries: int | None
) -> None:
    """The worker stops (its connection cut) while the call runs in the handler: by default the
    call is sent again on a fresh connection, with a fresh hand-out, to the next worker, and
    nothing stays owed. ``retries=0`` opts out."""
    sock = tmp_path / "e.sock"
    async with (
        AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
        EngineClient.connect(sock, cache=cache) as engine,
    ):
        [f] = await _features(cache, range(1))
        mark = tmp_path / "reached"
        payload = {"op": "sleep", "s": 0.2, "mark": str(mark)}
        opt: dict[str, Any] = {} if retries is None else {"retries": retries}
        async with _serving(sock, rx, shutdown_timeout=0) as first:
            call = asyncio.create_task(engine.call([f], payload, timeout=60, **opt))
            assert await asyncio.to_thread(wait_until, mark.exists, 30)  # in the handler
            first.cancel()  # the worker goes away without answering
        if retries == 0:
            with pytest.raises(EngineUnavailableError, match="went away"):
                await call
        else:
            async with _serving(sock, rx):
                out = await call
            assert out["crcs"] == [crc(_item(0)["x"])]
            assert engine.stats().retries == 1
        assert cache.snapshot().readers[0].lag == 0  # nothing owed: each hand-out settled


async def test_a_second_worker_on_a_live_path_is_refused(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with _engine(make_config, sock) as (_cache, rx, _t):
        with pytest.raises(EngineAddressInUseError, match="another engine worker"):
            await serve_engine(sock, handler, rx)
        assert sock.is_socket()  # the live worker's socket is untouched


def test_a_worker_waiting_for_the_path_takes_it_when_the_holder_stops(tmp_path: Path) -> None:
    """The lock file goes with a clean stop; a worker that waited for it then holds the file at
    the path (not the removed one), so a third is still refused."""
    import threading

    from aioshmcache._channel_keeper import lock_held, release_path, take_path

    path = str(tmp_path / "e.sock")
    first = take_path(path)
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.append(take_path(path)))
    waiter.start()
    release_path(path, first)
    waiter.join(30)
    assert len(taken) == 1 and lock_held(path)
    with pytest.raises(EngineAddressInUseError):
        take_path(path)
    release_path(path, taken[0])
    assert not lock_held(path) and not os.path.exists(f"{path}.lock")


@pytest.mark.parametrize("fails", ["ready", "signal"])
async def test_a_worker_failing_after_it_listened_stops_serving(
    make_config: Callable[..., Any], tmp_path: Path, fails: str
) -> None:
    """``ready()`` raising, or a shutdown signal that cannot be caught, fails ``serve_engine``
    after it listened: it closes its socket and removes the file (it kept both, accepting and
    serving connections after it raised, with the path's lock already let go)."""
    import socket

    from aioshmcache._channel_keeper import lock_held

    def refuse() -> None:
        raise RuntimeError("not ready today")

    sock = tmp_path / "e.sock"
    kw: dict[str, Any] = (
        {"ready": refuse} if fails == "ready" else {"shutdown_signals": (signal.SIGKILL,)}
    )
    async with (
        AsyncSenderCache.from_config(make_config(1 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        with pytest.raises(RuntimeError):
            await serve_engine(sock, handler, rx, **kw)
        assert not sock.exists() and not lock_held(str(sock))
        with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
            s.connect(str(sock))


async def test_a_worker_cancelled_while_waiting_for_the_path_does_not_take_it_later(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """``serve_engine`` cancelled while it waits for the path's lock (a worker still stopping
    holds it): the lock its thread takes afterwards is let go (it was kept for the process's
    life, so no worker could serve the path and every gateway saw one alive)."""
    import fcntl

    from aioshmcache._channel_keeper import lock_held, lock_path

    sock = tmp_path / "e.sock"
    holder = os.open(lock_path(str(sock)), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    async with (
        AsyncSenderCache.from_config(make_config(1 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        task = asyncio.create_task(serve_engine(sock, handler, rx))
        await asyncio.sleep(0.2)  # waiting for the lock in its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.close(holder)  # the holder stops: the waiting thread takes the lock
        await asyncio.sleep(0.5)
        assert not lock_held(str(sock))
        async with _serving(sock, rx):  # another worker serves the path
            assert lock_held(str(sock))


# --- real worker processes ---------------------------------------------------------------------


def _start_worker(sock: Path, handle: Any) -> Any:
    proc = SPAWN.Process(target=_channel_procs.engine_main, args=(str(sock), handle))
    proc.start()
    return proc


@pytest.mark.e2e
@pytest.mark.slow
async def test_reconnect_after_the_worker_is_killed_and_restarted(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with AsyncSenderCache.from_config(make_config(4 << 20)) as cache:
        handle = cache.handle()
        first = _start_worker(sock, handle)
        try:
            async with EngineClient.connect(
                sock, cache=cache, max_connections=2, backoff_max=0.2
            ) as engine:
                [f] = await _features(cache, range(1))
                out = await engine.call([f], timeout=60)
                assert out["pid"] == first.pid
                kill_and_reap(first, signal.SIGKILL)
                [g] = await _features(cache, range(1, 2))
                with pytest.raises(EngineUnavailableError):
                    await engine.call([g], timeout=0.5)
                assert sock.exists()  # the dead worker's socket file is still there
                second = _start_worker(sock, handle)
                try:
                    [h] = await _features(cache, range(2, 3))
                    out = await engine.call([h], timeout=60)  # reconnects once it is up
                    assert out["pid"] == second.pid
                    assert out["crcs"] == [crc(_item(2)["x"])]
                    assert engine.stats().connect_failures >= 1
                finally:
                    os.kill(second.pid, signal.SIGTERM)
                    second.join(30)
                    assert second.exitcode == 0
                    assert not sock.exists()  # graceful shutdown removed it
        finally:
            kill_and_reap(first)


@pytest.mark.e2e
@pytest.mark.slow
async def test_calls_through_an_engine_killed_9_and_restarted_all_succeed(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A steady stream of calls (four callers) with the client's defaults; the worker is
    killed -9 while one call is inside its handler, then restarted: no call fails, every
    answer is right, the call in the handler was sent again, nothing stays owed."""
    sock = tmp_path / "e.sock"
    async with AsyncSenderCache.from_config(make_config(4 << 20)) as cache:
        handle = cache.handle()
        procs = [_start_worker(sock, handle)]
        answered: dict[int, int] = {}  # pid -> calls it answered
        errors: list[str] = []
        stop = asyncio.Event()

        async def caller(k: int, engine: EngineClient) -> None:
            for n in itertools.count():
                if stop.is_set():
                    return
                i = (k + 4 * n) % 8
                try:
                    feats = await _features(cache, range(i, i + 1))
                    out = await engine.call(feats, {"op": "crc"})
                except Exception as exc:  # the test asserts there is none; the caller stops
                    errors.append(repr(exc))
                    return
                assert out["crcs"] == [crc(_item(i)["x"])]
                pid: int = out["pid"]
                answered[pid] = answered.get(pid, 0) + 1

        try:
            async with EngineClient.connect(sock, cache=cache) as engine:
                await engine.call([], {"op": "echo"}, timeout=120)  # the worker is up
                callers = [asyncio.create_task(caller(k, engine)) for k in range(4)]
                try:
                    first = procs[0].pid
                    assert await asyncio.to_thread(
                        wait_until, lambda: answered.get(first, 0) > 20, 60
                    )
                    mark = tmp_path / "reached"
                    [f] = await _features(cache, range(8, 9))
                    held = asyncio.create_task(
                        engine.call([f], {"op": "sleep", "s": 0.2, "mark": str(mark)})
                    )
                    assert await asyncio.to_thread(wait_until, mark.exists, 60)
                    kill_and_reap(procs[0], signal.SIGKILL)  # inside the handler, mid-stream
                    procs.append(_start_worker(sock, handle))
                    second = procs[1].pid
                    assert (await held)["crcs"] == [crc(_item(8)["x"])]  # sent again
                    assert await asyncio.to_thread(
                        wait_until, lambda: answered.get(second, 0) > 20 or bool(errors), 120
                    )
                    assert errors == []
                    stop.set()  # each caller ends after its current call
                    await asyncio.wait_for(asyncio.gather(*callers), 120)
                finally:
                    for task in callers:
                        task.cancel()
                    await asyncio.gather(*callers, return_exceptions=True)
                assert engine.stats().retries >= 1
                [reader] = [r for r in cache.snapshot().readers if r.alive]
                assert reader.pid == second and reader.lag == 0  # nothing owed
        finally:
            for proc in procs:
                kill_and_reap(proc)


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_call_in_progress_finishes_through_a_graceful_shutdown(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    async with AsyncSenderCache.from_config(make_config(4 << 20)) as cache:
        proc = _start_worker(sock, cache.handle())
        try:
            async with EngineClient.connect(sock, cache=cache) as engine:
                await engine.call([], {"op": "echo"}, timeout=60)  # up
                mark = tmp_path / "reached"
                slow = asyncio.create_task(
                    engine.call([], {"op": "sleep", "s": 1.0, "mark": str(mark)})
                )
                assert await asyncio.to_thread(wait_until, mark.exists, 60)  # in the handler
                os.kill(proc.pid, signal.SIGTERM)
                await slow  # answered, not cut off
                await asyncio.to_thread(proc.join, 30)
                assert proc.exitcode == 0
                with pytest.raises(EngineUnavailableError):
                    await engine.call([], {"op": "echo"}, timeout=0.5)
        finally:
            kill_and_reap(proc)


@pytest.mark.e2e
@pytest.mark.slow
async def test_start_keeps_one_worker_alive_among_clients(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """``start=``: two clients (two gateways) share one worker; one killed -9 is replaced."""
    from aioshmcache._channel_keeper import lock_held

    sock = tmp_path / "e.sock"
    async with AsyncSenderCache.from_config(make_config(4 << 20)) as cache:
        start = functools.partial(_channel_procs.engine_main, handle=cache.handle())
        async with (
            EngineClient.connect(sock, cache=cache, start=start, backoff_max=0.2) as one,
            EngineClient.connect(sock, cache=cache, start=start, backoff_max=0.2) as two,
        ):
            first = await one.call([], {"op": "echo"}, timeout=60)
            assert (await two.call([], {"op": "echo"}, timeout=60))["pid"] == first["pid"]
            os.kill(first["pid"], signal.SIGKILL)
            again = first
            for _ in range(600):  # a call on a connection of the dead worker fails typed
                with contextlib.suppress(EngineUnavailableError):
                    again = await one.call([], {"op": "echo"}, timeout=60)
                if again["pid"] != first["pid"]:
                    break
                await asyncio.sleep(0.1)
            assert again["pid"] != first["pid"]  # a new worker was started for the path
            assert (await two.call([], {"op": "echo"}, timeout=60))["pid"] == again["pid"]
        assert await asyncio.to_thread(wait_until, lambda: not lock_held(str(sock)), 30)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_started_worker_leaves_when_its_gateway_is_killed(tmp_path: Path) -> None:
    """``start=``'s engine worker does not outlive the gateway that started it: killed -9,
    the gateway cannot stop it, so the worker sees its parent gone and leaves (the demo found
    such orphans, each holding a reader slot and the path's lock)."""
    import uuid

    from aioshmcache import sweep
    from aioshmcache._channel_keeper import lock_held

    from .conftest import RUN_PREFIX

    sock, name = str(tmp_path / "e.sock"), f"{RUN_PREFIX}orph{uuid.uuid4().hex[:6]}"
    parent, child = SPAWN.Pipe()
    gateway = SPAWN.Process(
        target=_channel_procs.gateway_starting_a_worker, args=(sock, name, child)
    )
    gateway.start()
    try:
        assert parent.poll(120) and parent.recv() == "ready"
        assert lock_held(sock)  # the started worker serves the path
    finally:
        kill_and_reap(gateway)
    assert wait_until(lambda: not lock_held(sock), 60)  # the orphan left
    sweep(name=name)  # the killed gateway's segment


@pytest.mark.e2e
@pytest.mark.slow
def test_a_worker_whose_gateway_is_killed_while_it_starts_leaves_too(tmp_path: Path) -> None:
    """The gateway killed -9 right after it spawned its worker, before the worker ran its own
    code: the worker, already reparented, took its new parent for its starter and served the
    path (holding its lock) for ever; it now knows its starter's pid and leaves."""
    from aioshmcache._channel_keeper import lock_held

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    sock = str(tmp_path / "e.sock")
    parent, child = SPAWN.Pipe()
    gateway = SPAWN.Process(
        target=_channel_procs.gateway_killed_while_starting_a_worker, args=(sock, child)
    )
    gateway.start()
    worker = 0
    try:
        assert parent.poll(120)
        worker = parent.recv()
    finally:
        kill_and_reap(gateway)
    try:
        assert wait_until(lambda: gone(worker), 30)  # the orphan left
        assert not lock_held(sock)
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_worker_that_cannot_start_is_restarted_with_growing_pauses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="aioshmcache.channel")
    async with EngineClient.connect(tmp_path / "e.sock", start=_channel_procs.crash) as engine:
        with pytest.raises(EngineUnavailableError):
            await engine.call([], timeout=1.0)

        def pauses() -> list[float]:
            return [float(r.args[2]) for r in caplog.records if "restarting in" in r.msg]  # type: ignore[index,arg-type]

        assert await asyncio.to_thread(wait_until, lambda: len(pauses()) >= 2, 60)
        assert pauses()[:2] == [1.0, 2.0]  # doubling, not a crash loop every half second


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_started_worker_that_cannot_serve_its_path_is_restarted_with_growing_pauses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``start=`` for a path that is a regular file: the worker fails (it left quietly, as a
    starter that lost the race does, exit code 0, so it was started again every half second
    without a word); the file is left alone."""
    from aioshmcache._channel_keeper import run_worker

    caplog.set_level("WARNING", logger="aioshmcache.channel")
    sock = tmp_path / "e.sock"
    sock.write_bytes(b"not a socket")
    with pytest.raises(EngineAddressInUseError, match="not a socket"):
        run_worker(_channel_procs.crash, str(sock))
    async with EngineClient.connect(sock, start=_channel_procs.crash) as engine:
        with pytest.raises(EngineUnavailableError):
            await engine.call([], timeout=1.0)

        def pauses() -> list[float]:
            return [float(r.args[2]) for r in caplog.records if "restarting in" in r.msg]  # type: ignore[index,arg-type]

        assert await asyncio.to_thread(wait_until, lambda: len(pauses()) >= 2, 30)
        assert pauses()[:2] == [1.0, 2.0]
    assert sock.read_bytes() == b"not a socket"


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_client_closed_while_starting_its_worker_stops_it(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """``aclose`` while the keeper's worker process is being started (in a thread, which a
    cancellation does not stop): that worker is stopped too (it was left serving the path,
    holding its lock and a reader slot, until the gateway's process ended)."""
    import multiprocessing

    from aioshmcache._channel_keeper import lock_held

    sock = tmp_path / "e.sock"
    before = set(multiprocessing.active_children())
    try:
        async with AsyncSenderCache.from_config(make_config(4 << 20)) as cache:
            start = functools.partial(_channel_procs.engine_main, handle=cache.handle())
            async with EngineClient.connect(sock, cache=cache, start=start):
                await asyncio.sleep(0)  # the keeper is starting a worker
            await asyncio.sleep(1.0)
            assert set(multiprocessing.active_children()) - before == set()
            assert not lock_held(str(sock))
    finally:
        for proc in set(multiprocessing.active_children()) - before:
            kill_and_reap(proc)


async def test_hostile_calls_get_typed_answers_and_the_worker_keeps_serving(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """Garbage call frames are answered ``bad_request``; a huge declared frame ends only its
    own connection; a well-formed call on a new connection is served afterwards."""
    from aioshmcache._channel_format import decode, raise_error
    from aioshmcache.wire import read_frame, write_frame

    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, {"max_frame_bytes": 1 << 20}) as (_cache, _rx, engine):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        for head, body in [
            (b"\x00garbage", b"more garbage"),
            (np.arange(8, dtype=np.uint8).tobytes(), b""),
            (b"", b""),
            *((_serde_envelope(bad), b"") for bad in _arrays_in_place("call")),
        ]:
            await write_frame(writer, head)
            await write_frame(writer, body)
            value = decode(await asyncio.wait_for(read_frame(reader), 10), "response")
            assert value[2] == "error" and value[3] == "bad_request" and value[7] is True
            with pytest.raises(WireError):
                raise_error(value)
        writer.write((1 << 40).to_bytes(8, "little"))  # a frame far over max_frame_bytes
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # that connection ends
        writer.close()
        out = await engine.call([], {"op": "echo", "n": 3})
        assert out["payload"]["n"] == 3


async def test_a_connection_without_a_whole_call_is_closed_after_idle_timeout(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """Silent, or stuck inside a frame (a cut prefix, a cut payload): closed after
    ``idle_timeout``. A pooled connection that sent a whole call may idle longer."""
    sock = tmp_path / "e.sock"
    serve = {"idle_timeout": 0.3}
    async with _connected(make_config, sock, serve, max_connections=1) as (_cache, _rx, engine):
        await engine.call([], {"op": "echo"}, timeout=30)  # a proven, pooled connection
        stuck = [b"", b"\x05\x00", (100).to_bytes(8, "little") + b"partial"]
        peers = []
        for sent in stuck:
            reader, writer = await asyncio.open_unix_connection(str(sock))
            writer.write(sent)
            await writer.drain()
            peers.append((reader, writer))
        for reader, writer in peers:
            assert await asyncio.wait_for(reader.read(), 30) == b""  # the worker closed it
            writer.close()
        out = await engine.call([], {"op": "echo", "n": 5}, timeout=30)
        assert out["payload"]["n"] == 5
        assert engine.stats().connects == 1  # the pooled connection outlived idle_timeout


async def test_silent_connections_beyond_max_connections_do_not_keep_calls_out(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """200 connections that send nothing against ``max_connections=8`` (and an idle timeout far
    away): the oldest silent ones make room, a pooled connection that sent a call is kept, and
    a new gateway's call is served."""
    sock = tmp_path / "e.sock"
    serve = {"max_connections": 8, "idle_timeout": 600.0}
    async with _connected(make_config, sock, serve) as (cache, _rx, engine):
        await engine.call([], {"op": "echo"}, timeout=30)
        silent = [await asyncio.open_unix_connection(str(sock)) for _ in range(200)]
        try:
            [f] = await _features(cache, range(1))
            out = await engine.call([f], {"op": "crc"}, timeout=30)  # the pooled connection
            assert out["crcs"] == [crc(_item(0)["x"])]
            assert engine.stats().connects == 1
            async with EngineClient.connect(sock, cache=cache) as other:  # a new connection
                out = await other.call([], {"op": "echo", "n": 6}, timeout=30)
                assert out["payload"]["n"] == 6

            def most_closed() -> bool:
                return sum(r.at_eof() for r, _w in silent) >= 200 - 8

            assert await asyncio.to_thread(wait_until, most_closed, 60)
        finally:
            for _r, w in silent:
                w.close()
        assert cache.snapshot().readers[0].lag == 0


def test_the_plain_features_frame_reads_as_the_wire_message_does() -> None:
    """References and Nones travel as plain msgpack; anything else as the wire message; both
    read back the same features."""
    from aioshmcache._channel_format import pack_call_features, unpack_call_features
    from aioshmcache.wire import pack_features, unpack_features

    ref = ShmRef(1 << 63, 2, 4096, 77, 1024, (1 << 64) - 1, 3, 12345)
    plain = [
        [],
        [FeatureSpec("a", ref), FeatureSpec("b", None, identifier="id-b")],
        [FeatureSpec("é" * 70, ref, identifier=None, prompt_updates=())],
    ]
    for features in plain:
        body = pack_call_features(features)
        assert body[:4] != b"ASHM"
        assert unpack_call_features(body) == unpack_features(pack_features(features)) == features
    wire = [
        [FeatureSpec("a", ref), FeatureSpec("i", _item(1))],  # an inline item
        [FeatureSpec("a", ref, prompt_updates=[{"offset": 3}])],
    ]
    for features in wire:
        body = pack_call_features(features)
        assert body[:4] == b"ASHM"
        out = unpack_call_features(body)
        assert [f.mm_hash for f in out] == [f.mm_hash for f in features]
    hostile = [
        msgpack.packb(["aioshmcache.wire", 1, [["x", 2, {"no": "items"}, None, []]]]),  # inline
        msgpack.packb(["aioshmcache.wire", 1, [["x", 2, [1, 2], None, []]]]),
        msgpack.packb(["aioshmcache.wire", 9, []]),
        msgpack.packb(["not.wire", 1, []]),
        msgpack.packb(["aioshmcache.wire", 1, [["x", 1, [1, 2, 3], None, []]]]),
        msgpack.packb(["aioshmcache.wire", 1, [["x", 1, [-1] * 8, None, []]]]),
        msgpack.packb(["aioshmcache.wire", 1, [["x", 1, [0] * 8, None, []]]])[:-3],  # cut
        msgpack.packb(["aioshmcache.wire", 1, []]) + b"\x00",  # trailing bytes
        b"\x93\xa1\xff\x01\x90",  # not UTF-8
        b"\x91" * 100_000 + b"\xc0",  # deep
        b"\xdd\xff\xff\xff\xff",  # a huge declared array
        msgpack.packb(["aioshmcache.wire", 1, [["x", 0, None, None, [b"bin"]]]]),
        msgpack.packb(["aioshmcache.wire", 1, [["x", 0, None, None, ["update"]]]]),
        msgpack.packb(["aioshmcache.wire", 1, [["x", 0, None, None, 5]]]),
        msgpack.packb(["aioshmcache.wire", 1, "rows"]),
        msgpack.packb([1, 2]),
        b"\x93\xb0aioshmcache.wire\x01" + b"\xdd\x00\x00\xff\xff" * 1000,  # open arrays
        b"\x93\xb0aioshmcache.wire\x01\xdd\x00\x10\x00\x00" + b"\x90" * 0x100000,  # 1M lists
    ]
    for body in hostile:
        with pytest.raises(WireError):
            unpack_call_features(body)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300).map(lambda b: b"\x93" + b),
        st.recursive(
            st.none()
            | st.integers(-(2**63), 2**64 - 1)
            | st.text(max_size=8)
            | st.binary(max_size=8),
            lambda inner: st.lists(inner, max_size=6),
            max_leaves=30,
        ).map(lambda v: msgpack.packb(["aioshmcache.wire", 1, v])),
    )
)
def test_a_plain_features_frame_is_features_or_a_wire_error(body: bytes) -> None:
    """Any bytes starting as a msgpack array: features of references and Nones, or
    ``WireError``; nothing else escapes."""
    from aioshmcache._channel_format import unpack_call_features

    try:
        features = unpack_call_features(body)
    except WireError:
        return
    assert all(f.data is None or type(f.data) is ShmRef for f in features)


async def test_calls_of_both_channel_versions_are_served(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """Gateways of the previous versions (1: features as a wire message; 2: the envelope always
    the serde's) are still served, in the serde's form; an unknown version is a
    ``bad_request``."""
    from aioshmcache._channel_format import decode, encode
    from aioshmcache.wire import pack_features, read_frame, write_frame

    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, _engine):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        try:
            for version, kind in [(1, "ok"), (2, "ok"), (9, "error")]:
                if kind == "ok":  # the unknown version's call is not read: no new hand-out
                    [f] = await _features(cache, range(1))
                envelope = ["aioshmcache.channel", version, "call", None]
                await write_frame(writer, encode(envelope, plain=False))  # as they sent it
                await write_frame(writer, pack_features([f]))
                answer = await asyncio.wait_for(read_frame(reader), 30)
                assert answer[:4] == b"ASHM"  # the serde's form: what they read
                value = decode(answer, "response")
                assert value[2] == kind
                if kind == "ok":
                    assert value[3]["crcs"] == [crc(_item(0)["x"])]
                else:
                    assert value[3] == "bad_request"
        finally:
            writer.close()
        assert cache.snapshot().readers[0].lag == 0


def _serde_envelope(value: list[Any]) -> bytes:
    """``value`` as an envelope in the serde's form (which carries numpy arrays)."""
    from aioshmcache._channel_format import encode

    return encode(value, plain=False)


def _arrays_in_place(what: str) -> list[list[Any]]:
    """Envelopes whose tag, version or kind is a numpy array (of two elements: its truth is
    ambiguous, a ``ValueError`` of numpy's own; of one: it passed for the value it holds)."""
    from aioshmcache._channel_format import TAG

    tail = [None] if what == "call" else [7]
    return [
        [np.array([TAG, TAG]), 1, what, *tail],
        [TAG, np.array([1, 1]), what, *tail],
        [TAG, 1, np.array([what, what]), *tail],
        [np.array([TAG]), np.array([1]), np.array([what]), *tail],
    ]


def _error_answer(kind: Any) -> bytes:
    from aioshmcache._channel_format import ANSWER_VERSION, TAG

    return bytes(msgpack.packb([TAG, ANSWER_VERSION, "error", kind, "C", "m", [], False]))


@pytest.mark.parametrize(
    "answer",
    [
        b"\x93not ours",
        *(_error_answer(kind) for kind in ({"x": 1}, [1], 7, None)),
        *(_serde_envelope(bad) for bad in _arrays_in_place("ok")),
    ],
    ids=[
        "junk",
        "kind-dict",
        "kind-list",
        "kind-int",
        "kind-nil",
        "tag-array",
        "version-array",
        "ok-array",
        "all-arrays",
    ],
)
async def test_a_garbage_answer_is_a_typed_error(tmp_path: Path, answer: bytes) -> None:
    """A peer that answers junk (not a worker), or an error answer whose kind is not a str
    (unhashable: a review found it raising an untyped ``TypeError`` at the kind's look-up),
    makes the call raise ``WireError``."""
    from aioshmcache.wire import read_frame, write_frame

    async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)
        await read_frame(reader)
        await write_frame(writer, answer)
        writer.close()

    sock = tmp_path / "junk.sock"
    server = await asyncio.start_unix_server(junk, str(sock))
    async with server, EngineClient.connect(sock) as engine:
        with pytest.raises(WireError):
            await engine.call([], {"op": "echo"}, timeout=10)


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("surrogate", r"no file named b\\udcff\.txt"),
        ("str-raises", "could not be made"),
        ("long", r"xxx \[\.\.\.\]"),
    ],
)
async def test_a_handler_error_whose_message_is_hard_to_send_is_answered_once(
    make_config: Callable[..., Any], tmp_path: Path, kind: str, match: str
) -> None:
    """A review's handler errors that the worker could not answer: a message with a lone
    surrogate or a ``__str__`` that raises made the error answer raise, and one longer than
    the worker's ``max_frame_bytes`` could not be written; the worker dropped the connection,
    the gateway took it for a worker gone and ran the handler again. Each is answered, once."""
    sock = tmp_path / "e.sock"
    serve = {"max_frame_bytes": 4096}
    _channel_procs.RAISED.clear()
    async with _connected(make_config, sock, serve, max_connections=1) as (_c, _rx, engine):
        with pytest.raises(EngineCallError, match=match):
            await engine.call([], {"op": "raise", "kind": kind, "n": 10_000})
        runs = list(_channel_procs.RAISED)
        assert runs == [kind]  # run once: no retry of a call answered
        assert (await engine.call([], {"op": "echo"}))["payload"] == {"op": "echo"}
        assert engine.stats().connects == 1  # the connection stayed in use


async def test_aclose_closes_a_connection_lent_to_a_call_in_flight(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """``aclose`` closes every connection, those lent to calls in flight too: such a call
    raises ``EngineUnavailableError`` saying the client was closed (not that the worker went
    away) and is not sent again (a review's call ran on to its answer after the client was
    closed, its connection still open)."""
    sock, mark = tmp_path / "e.sock", tmp_path / "reached"
    async with _engine(make_config, sock) as (cache, _rx, _task):
        engine = EngineClient.connect(sock, cache=cache)
        async with engine:
            call = asyncio.create_task(engine.call([], {"op": "sleep", "s": 2, "mark": str(mark)}))
            assert await asyncio.to_thread(wait_until, mark.exists, 30)  # in the handler
            await engine.aclose()
            with pytest.raises(EngineUnavailableError, match="client was closed"):
                await asyncio.wait_for(call, 30)
            assert engine.open_connections == 0 and engine.stats().retries == 0


async def test_a_gateway_that_stops_reading_an_answer_is_closed_after_idle_timeout(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A peer that sends a call whose answer does not fit the socket, then never reads: the
    worker's wait for the answer to drain is bounded by ``idle_timeout`` (it held the
    connection's task, and delayed a shutdown, for as long as the peer lived)."""
    import socket

    from aioshmcache._channel_format import call_frames
    from aioshmcache.wire import frame_parts

    sock = tmp_path / "e.sock"
    async with _engine(make_config, sock, idle_timeout=0.5):
        head, body = call_frames({"op": "big", "n": 8 << 20}, [])
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(str(sock))
        try:
            raw.sendall(b"".join(frame_parts([head, body], max_bytes=1 << 30)))

            def closed_by_the_worker() -> bool:
                try:
                    raw.send(b"\0")  # (our bytes, never read: the worker closes anyway)
                except OSError:
                    return True
                return False

            assert await asyncio.to_thread(wait_until, closed_by_the_worker, 60, 0.05)
        finally:
            raw.close()


@pytest.mark.parametrize("where", ["client", "call"])
async def test_a_timeout_that_is_not_a_number_above_zero_is_refused(
    tmp_path: Path, where: str
) -> None:
    """NaN passed ``timeout <= 0`` and made a deadline never reached (a review's call hung)."""
    if where == "client":
        with pytest.raises(ValueError, match="timeout"):
            EngineClient.connect(tmp_path / "e.sock", timeout=float("nan"))
        return
    async with EngineClient.connect(tmp_path / "e.sock") as engine:
        with pytest.raises(ValueError, match="timeout"):
            await engine.call([], {}, timeout=float("nan"))


# --- the envelope's two forms, the connection's framing, the client's lifetime ----------------


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (None, True),
        ({"prompt": "é" * 100, "n": [1, 2.5, True, None, b"raw"]}, True),
        ({"nested": {"a": [[], {}]}}, True),
        ((1, 2), False),  # a tuple stays a tuple: the serde's
        ({"x": np.arange(4, dtype=np.float32)}, False),
        ([np.float64(1.5)], False),  # a numpy scalar (a float subclass)
        ([1 << 70], False),  # beyond msgpack's ints: the serde's error
    ],
)
def test_an_envelope_is_plain_msgpack_only_for_plain_values(value: Any, plain: bool) -> None:
    """Plain msgpack for exactly the plain types, the serde's payload otherwise; both read back
    as what was sent (a tuple as a tuple, arrays as arrays)."""
    from aioshmcache._channel_format import TAG, decode, encode
    from aioshmcache.errors import SerdeError

    envelope = [TAG, 1, "ok", value]
    try:
        data = encode(envelope)
    except SerdeError:
        assert not plain  # neither form carries it
        return
    assert (data[:4] != b"ASHM") is plain
    for form in (data, encode(envelope, plain=False)):  # the chosen form, and the serde's
        back = decode(form, "response")[3]
        if isinstance(value, dict) and "x" in value:
            assert np.array_equal(back["x"], value["x"]) and back["x"].dtype == value["x"].dtype
        else:
            assert back == value and type(back) is type(value)


def test_a_hostile_plain_envelope_is_a_wire_error() -> None:
    from aioshmcache._channel_format import decode

    for data in [
        msgpack.packb(["aioshmcache.channel", 1, "ok", {1: "int key"}]),
        msgpack.packb(["aioshmcache.channel", 1, "ok", msgpack.ExtType(1, b"x")]),
        msgpack.packb(["aioshmcache.channel", 1, "ok", None]) + b"\x00",  # trailing bytes
        msgpack.packb(["aioshmcache.channel", 1, "ok", "x" * 50])[:-10],  # cut
        b"\x94" + b"\x91" * 100_000 + b"\xc0",  # deep
        b"\xdd\xff\xff\xff\xff",  # a huge declared array
        b"\x94\xb3aioshmcache.channel\x01\xa2ok" + b"\x90" * 40_000,  # too many containers
        msgpack.packb(["not.channel", 1, "ok", None]),
        msgpack.packb(["aioshmcache.channel", 7, "ok", None]),
    ]:
        with pytest.raises(WireError):
            decode(data, "response")


async def test_payloads_and_results_of_both_forms_cross_the_channel(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A plain payload and one with a tuple and an array come back as sent (the echo handler
    returns the payload)."""
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (_cache, _rx, engine):
        plain = {"op": "echo", "prompt": "a cat", "ids": [1, 2, 3], "raw": b"\x00\x01"}
        assert (await engine.call([], plain, timeout=30))["payload"] == plain
        rich: dict[str, Any] = {"op": "echo", "pair": (1, "b"), "x": np.arange(5, dtype=np.int16)}
        back = (await engine.call([], rich, timeout=30))["payload"]
        assert back["pair"] == (1, "b") and type(back["pair"]) is tuple
        assert np.array_equal(back["x"], rich["x"]) and back["x"].dtype == np.int16


async def test_calls_cut_into_bytes_or_sent_back_to_back_are_served_in_order(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """The worker cuts frames as bytes arrive: a call written one byte at a time is served, and
    three calls written in one go get three answers, in order."""
    from aioshmcache._channel_format import call_envelope, decode, pack_call_features
    from aioshmcache.wire import encode_frame, read_frame

    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, _engine):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        try:
            [f] = await _features(cache, range(1))
            call = encode_frame(call_envelope({"op": "crc"})) + encode_frame(
                pack_call_features([f])
            )
            for i in range(len(call)):
                writer.write(call[i : i + 1])
                await writer.drain()
                if i % 16 == 0:
                    await asyncio.sleep(0.001)
            value = decode(await asyncio.wait_for(read_frame(reader), 30), "response")
            assert value[2] == "ok" and value[3]["crcs"] == [crc(_item(0)["x"])]
            calls = b"".join(
                encode_frame(call_envelope({"op": "echo", "n": n}))
                + encode_frame(pack_call_features([]))
                for n in range(3)
            )
            writer.write(calls)
            await writer.drain()
            for n in range(3):
                value = decode(await asyncio.wait_for(read_frame(reader), 30), "response")
                assert value[3]["payload"]["n"] == n
        finally:
            writer.close()
        assert cache.snapshot().readers[0].lag == 0


async def test_the_client_is_an_async_resource(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """``connect`` is a plain call whose result is used with ``async with``; ``aclose`` closes
    every connection, is idempotent, and a closed client refuses calls (typed)."""
    from anyio.abc import AsyncResource

    sock = tmp_path / "e.sock"
    async with _engine(make_config, sock) as (_cache, _rx, _task):
        engine = EngineClient.connect(sock)
        assert isinstance(engine, AsyncResource) and engine.open_connections == 0
        async with engine as same:
            assert same is engine
            await engine.call([], {"op": "echo"}, timeout=30)
            assert engine.open_connections == 1
        assert engine.open_connections == 0
        await engine.aclose()  # again: nothing to do
        with pytest.raises(EngineUnavailableError, match="closed"):
            await engine.call([], {"op": "echo"}, timeout=5)


async def test_a_call_then_a_half_close_is_answered(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A client that writes a whole call then ends its side of the stream (``shutdown(SHUT_WR)``,
    as ``nc -N`` or a one-shot client in another language does) still gets the answer: the
    worker answers the calls it received whole before the end, then closes."""
    from aioshmcache._channel_format import call_envelope, decode, pack_call_features
    from aioshmcache.wire import encode_frame, read_frame

    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (_cache, _rx, _engine):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        try:
            writer.write(
                encode_frame(call_envelope({"op": "echo", "n": 7}))
                + encode_frame(pack_call_features([]))
            )
            writer.write_eof()
            await writer.drain()
            value = decode(await asyncio.wait_for(read_frame(reader), 30), "response")
            assert value[2] == "ok" and value[3]["payload"]["n"] == 7
            assert await asyncio.wait_for(reader.read(), 30) == b""  # then the worker closes
        finally:
            writer.close()


async def test_a_connection_stops_reading_while_whole_frames_wait_unread() -> None:
    """A peer that sends frames faster than they are taken (calls sent back to back to a busy
    worker, answers to a gateway) waits in its socket, not in this process's memory: the
    connection stops reading once ``MAX_UNREAD_FRAMES`` whole frames wait, and reads on as they
    are taken, to the last one."""
    import socket

    from aioshmcache._channel_conn import MAX_UNREAD_FRAMES, FrameConnection
    from aioshmcache.wire import encode_frame

    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    b.setblocking(False)
    n = 50_000  # 5.4 MB: far more than the socket pair buffers
    _transport, conn = await loop.connect_accepted_socket(lambda: FrameConnection(1 << 20), a)
    send = asyncio.create_task(
        loop.sock_sendall(b, b"".join(encode_frame(b"%99d" % i) for i in range(n)))
    )
    try:
        for _ in range(3000):  # the peer fills the connection (30 s at most)
            if conn.has_frames(MAX_UNREAD_FRAMES):
                break
            await asyncio.sleep(0.01)
        assert conn.has_frames(MAX_UNREAD_FRAMES)
        await asyncio.sleep(0.2)  # reads the loop would make meanwhile, were it still reading
        one_read = (256 << 10) // 107 + 1  # frames one transport read may hold
        assert not conn.has_frames(MAX_UNREAD_FRAMES + one_read)
        for i in range(n):  # taken: reading goes on, every frame arrives in order
            assert await asyncio.wait_for(conn.next_frame(), 30) == b"%99d" % i
        await asyncio.wait_for(send, 30)
    finally:
        send.cancel()
        conn.abort()
        b.close()
