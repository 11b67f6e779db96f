"""The gateway's usual call (``EngineClient.call``) and the paths it falls back to.

The usual call (an idle pooled connection, a send that needs no drain, an answer that arrives
in one read) takes a short path; each test checks that path is taken, and that what it leaves
to the general path (a pool wait, a drain, an answer in pieces, a deadline) behaves as before.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioshmcache import AsyncReceiverCache, AsyncSenderCache, FeatureSpec, ShmRef, wire
from aioshmcache import _channel_format as F
from aioshmcache._channel_conn import ClientConnection
from aioshmcache.aio import CHECKPOINT_EVERY
from aioshmcache.channel import EngineClient
from aioshmcache.errors import (
    EndOfFramesError,
    EngineCallError,
    EngineTimeoutError,
    IncompleteFrameError,
    WireError,
)
from aioshmcache.wire import read_frame

from ._channel_procs import crc
from .test_channel import _connected, _features, _item
from .test_differential_store import _spied


async def test_the_usual_call_reads_only_the_loop_s_clock(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's deadline is on the loop's clock from the start (``loop.time()``, which every
    wait takes as it is): the usual call reads no other clock, and a call past its deadline is
    still ``EngineTimeoutError``."""
    from aioshmcache import _channel_client

    reads: list[float] = []

    def monotonic() -> float:
        reads.append(now := time.monotonic())
        return now

    monkeypatch.setattr(_channel_client, "time", types.SimpleNamespace(monotonic=monotonic))
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        for i in range(3):  # a new connection, then the idle one
            [f] = await _features(cache, range(i, i + 1))
            out = await engine.call([f], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(_item(i)["x"])]
        assert reads == []
        with pytest.raises(EngineTimeoutError, match="answer"):
            await engine.call([], {"op": "sleep", "s": 1.0}, timeout=0.2)
        assert reads == []
        assert (await engine.call([], {"op": "echo", "n": 1}, timeout=30))["payload"]["n"] == 1
        assert cache.snapshot().readers[0].lag == 0


async def test_a_connection_asks_for_its_loop_once_not_per_call(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection learns its loop when it is made: the waits of its calls (the answer's
    future, the deadline's timer; the worker's wait for the next call) do not ask
    ``asyncio.get_running_loop`` again, a system call (``getpid``) each on Python 3.11; nor
    does a call that takes an idle connection (its deadline is on that connection's loop)."""
    from aioshmcache import _channel_client, _channel_conn

    asked: dict[str, int] = {"conn": 0, "client": 0}

    def counting(module: str) -> types.SimpleNamespace:
        def get_running_loop() -> asyncio.AbstractEventLoop:
            asked[module] += 1
            return asyncio.get_running_loop()

        return types.SimpleNamespace(**{**vars(asyncio), "get_running_loop": get_running_loop})

    monkeypatch.setattr(_channel_conn, "asyncio", counting("conn"))
    monkeypatch.setattr(_channel_client, "asyncio", counting("client"))
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        for i in range(4):
            [f] = await _features(cache, range(i, i + 1))
            out = await engine.call([f], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(_item(i)["x"])]
            if i == 0:  # no idle connection yet: the call and its connect asked
                assert asked["client"] == 2
        assert engine.stats().connects == 1
        assert asked["conn"] == 2  # connection_made's, at either end (the worker is in-process)
        assert asked["client"] == 2
        with pytest.raises(EngineTimeoutError):  # a deadline on the idle connection's loop
            await engine.call([], {"op": "sleep", "s": 1.0}, timeout=0.2)
        assert asked["client"] == 2


async def test_a_gateway_s_hand_outs_between_answers_queue_no_turn_witness(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway's look-up hit then call, again and again: each answer's ``data_received``
    tells the gateway's face that the loop turned (``_loop_turns``), so its hand-outs queue
    no callback of their own on the loop to learn it (an extra loop iteration per call) and
    never yield."""
    from .test_aio import _callbacks_of, _yields_of

    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        await _features(cache, range(1))
        [f] = await cache.get_and_update_features([FeatureSpec("h0", None)])
        await engine.call([f], {"op": "crc"}, timeout=30)
        queued = _callbacks_of(monkeypatch, cache)
        yields = _yields_of(monkeypatch)
        for _ in range(2 * CHECKPOINT_EVERY):
            [f] = await cache.get_and_update_features([FeatureSpec("h0", None)])
            out = await engine.call([f], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(_item(0)["x"])]
        assert queued == [] and yields == []


def _counted(m: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Count the calls of ``cls.name`` (a coroutine method), which still runs."""
    seen: list[int] = []
    real = getattr(cls, name)

    async def counted(self: Any, *args: Any) -> Any:
        seen.append(1)
        return await real(self, *args)

    m.setattr(cls, name, counted)
    return seen


async def test_the_usual_call_takes_an_idle_connection_and_sends_without_a_coroutine(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle usable connection is taken and the call written on it with no coroutine of
    their own (``_acquire``, the connection's ``drain``: the other cases); an idle connection
    found closed is given back and another one opened (``_acquire``), and the call is
    answered alike."""
    acquired = _counted(monkeypatch, EngineClient, "_acquire")
    drained = _counted(monkeypatch, ClientConnection, "drain")
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        for i in range(3):
            [f] = await _features(cache, range(i, i + 1))
            assert (await engine.call([f], {"op": "crc"}, timeout=30))["crcs"] == [
                crc(_item(i)["x"])
            ]
        assert acquired == [1] and drained == []  # the first call opened the connection
        [idle] = engine.pool.idle
        idle.abort()  # closed while idle: not usable
        assert (await engine.call([], {"op": "echo", "n": 5}, timeout=30))["payload"]["n"] == 5
        assert acquired == [1, 1] and drained == [] and engine.stats().connects == 2
        assert engine.pool.lent == 0 and len(engine.pool.idle) == 1
        assert cache.snapshot().readers[0].lag == 0


async def test_a_send_the_transport_paused_is_drained_before_the_answer(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call too big for the socket's buffer pauses the transport's writing: ``send`` says
    so and the call waits for the drain (the connection's ``drain``), then for its answer, as
    before."""
    drained = _counted(monkeypatch, ClientConnection, "drain")
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (cache, _rx, engine):
        [f] = await _features(cache, range(1))
        big = FeatureSpec("big", _item(2, 1 << 20))  # 4 MiB inline
        out = await engine.call([f, big], {"op": "crc"}, timeout=60)
        assert out["crcs"] == [crc(_item(0)["x"]), crc(_item(2, 1 << 20)["x"])]
        assert drained == [1]
        out = await engine.call([], {"op": "echo", "n": 1}, timeout=60)  # the same connection
        assert out["payload"]["n"] == 1 and drained == [1] and engine.stats().connects == 1
        assert cache.snapshot().readers[0].lag == 0


async def test_a_send_never_drained_times_out_and_gives_its_hand_outs_back(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A peer that accepts and never reads: the big call's send waits for the drain until the
    deadline, ``EngineTimeoutError`` naming the send; the bytes still queued are dropped (the
    connection closed) and its hand-out given back (nobody will read it)."""
    sock = tmp_path / "e.sock"
    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_unix_server(silent, str(sock))
    try:
        async with (
            AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
            AsyncReceiverCache.attach(cache.handle()) as _rx,
            EngineClient.connect(sock, cache=cache, max_connections=1) as engine,
        ):
            [f] = await _features(cache, range(1))
            big = FeatureSpec("big", _item(2, 2 << 20))  # 8 MiB inline
            with pytest.raises(EngineTimeoutError, match="send"):
                await engine.call([f, big], {"op": "crc"}, timeout=1.0)  # the connect well within
            assert engine.stats().released == 1
            assert engine.open_connections == 0  # dropped, not pooled
            assert not await cache.release(f.data)  # given back already
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


def _ok(n: int) -> bytes:
    """The frame of a plain ok answer ``{"n": n}``, as the worker makes it."""
    return wire.encode_frame(F.encode([F.TAG, F.ANSWER_VERSION, "ok", {"n": n}], plain=True))


async def test_an_answer_in_one_read_is_handed_to_its_call_and_any_other_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer that arrives whole in one read while its call waits is cut with one core call
    (``chan_frame``; the pure core declines) and handed to the call; an answer in pieces, or
    with another frame after it in the same read, is cut by the decoder and read as before
    (the connection is reused after the first; after the second, whose extra frame is unread,
    it is dropped)."""
    import aioshmcache
    from aioshmcache import _channel_conn

    taken = _spied(monkeypatch, _channel_conn, "cut_frame", _channel_conn.cut_frame)
    modes = ["whole", "pieces", "whole", "two", "whole"]
    answered = 0
    handlers: list[asyncio.Task[Any]] = []

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        current = asyncio.current_task()
        assert current is not None
        handlers.append(current)
        try:
            while True:
                await read_frame(reader)
                await read_frame(reader)
                frame, mode = _ok(answered), modes[answered]
                answered += 1
                if mode == "pieces":
                    writer.write(frame[:5])  # not even the length's prefix
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(frame[5:])
                elif mode == "two":
                    writer.write(frame + _ok(-1))  # a frame nobody asked for after it
                else:
                    writer.write(frame)
                await writer.drain()
        except (EndOfFramesError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    sock = tmp_path / "a.sock"
    server = await asyncio.start_unix_server(answering, str(sock))
    try:
        async with EngineClient.connect(sock, max_connections=1) as engine:
            got = [(await engine.call([], {"i": i}, timeout=30))["n"] for i in range(3)]
            assert got == [0, 1, 2] and engine.stats().connects == 1
            c = aioshmcache.implementation() == "c"
            assert taken == [c, False, c]  # in pieces: the first piece declined, then cut
            assert (await engine.call([], None, timeout=30))["n"] == 3
            assert taken == [c, False, c, False] and engine.open_connections == 0  # dropped
            assert (await engine.call([], None, timeout=30))["n"] == 4
            assert taken == [c, False, c, False, c] and engine.stats().connects == 2
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_part_of_a_stray_frame_after_an_answer_never_becomes_the_next_answer(
    tmp_path: Path,
) -> None:
    """A broken worker sends its answer, then part of a frame nobody asked for (a duplicate
    answer cut short). The connection holds that part unread: it is not given back to the pool
    (``usable`` counted only whole frames, so the next call took it and the stray frame's rest,
    sent later, completed it into the next call's answer: another call's result)."""
    stray = _ok(-1)
    handlers: list[asyncio.Task[Any]] = []
    opened = 0

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        current = asyncio.current_task()
        assert current is not None
        handlers.append(current)
        opened += 1
        first, answered = opened == 1, 0
        try:
            while True:
                await read_frame(reader)
                await read_frame(reader)
                if first and answered == 0:
                    writer.write(_ok(0) + stray[:10])  # the answer, then part of a stray frame
                elif first:  # the same connection's next call: the stray frame's rest first
                    writer.write(stray[10:])
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(_ok(answered))
                else:
                    writer.write(_ok(1))
                answered += 1
                await writer.drain()
        except (EndOfFramesError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    sock = tmp_path / "s.sock"
    server = await asyncio.start_unix_server(answering, str(sock))
    try:
        async with EngineClient.connect(sock, max_connections=1) as engine:
            assert (await engine.call([], {"i": 0}, timeout=30))["n"] == 0
            assert (await engine.call([], {"i": 1}, timeout=30))["n"] == 1  # not the stray -1
            assert engine.stats().connects == 2  # the connection holding the part was dropped
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_an_answer_after_the_deadline_is_not_handed_to_anyone(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A call whose deadline passes while it waits for its answer: ``EngineTimeoutError``; its
    connection is dropped, so the late answer reaches no later call; a call answered at once
    leaves the connection's timer to lapse, and the next call's longer wait is not cut short
    by it."""
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock, max_connections=1) as (_cache, _rx, engine):
        # a deadline no busy machine reaches for an echo, yet one the next call outlasts
        assert (await engine.call([], {"op": "echo", "n": 1}, timeout=1.5))["payload"]["n"] == 1
        out = await engine.call([], {"op": "sleep", "s": 1.8}, timeout=30)  # past the 1.5
        assert out["hashes"] == [] and engine.stats().connects == 1
        with pytest.raises(EngineTimeoutError, match="answer"):
            await engine.call([], {"op": "sleep", "s": 1.0}, timeout=0.2)
        assert (await engine.call([], {"op": "echo", "n": 2}, timeout=30))["payload"]["n"] == 2
        assert engine.stats().connects == 2


async def test_a_call_gathers_its_references_only_when_they_are_given_back(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's references (``refs_of``) are gathered only on a failure that gives them back
    or passes them to a retry: not for an answered call, nor for a delivered call whose
    handler failed (the worker read them); an unencodable call gives its hand-out back."""
    from aioshmcache import _channel_client

    gathered: list[list[ShmRef]] = []
    refs = _channel_client.refs_of

    def spy(features: list[FeatureSpec]) -> list[ShmRef]:
        gathered.append(out := refs(features))
        return out

    monkeypatch.setattr(_channel_client, "refs_of", spy)
    sock = tmp_path / "e.sock"
    async with _connected(make_config, sock) as (cache, _rx, engine):
        feats = await _features(cache, range(2))
        out = await engine.call([*feats, FeatureSpec("i", _item(5))], {"op": "crc"}, timeout=30)
        assert out["crcs"] == [crc(_item(i)["x"]) for i in (0, 1, 5)] and gathered == []
        [f] = await _features(cache, range(2, 3))
        with pytest.raises(EngineCallError):
            await engine.call([f], {"op": "fail"}, timeout=30)
        assert gathered == [] and engine.stats().released == 0
        [f] = await _features(cache, range(3, 4))
        with pytest.raises(WireError):
            await engine.call([f, FeatureSpec("i", None)], {"op": object()}, timeout=30)
        assert gathered == [[f.data]] and engine.stats().released == 1
        assert not await cache.release(f.data)  # already given back by the client
        assert cache.snapshot().readers[0].lag == 0


async def test_a_piece_that_looks_like_a_whole_frame_ends_the_frame_in_progress() -> None:
    """A connection knows part of a frame is waiting (kept as it feeds its decoder): bytes that
    follow it, even bytes that form a whole frame by themselves, are that frame's rest, never an
    answer of their own (``ClientConnection.data_received``'s one-read path), and a connection
    holding part of a frame has started a frame (``started``: the worker's idle wait ends)."""
    conn = ClientConnection(1 << 20)
    inner = wire.encode_frame(b"abc")  # a whole frame by itself
    head = b"head-"
    whole = wire.encode_frame(head + inner)
    loop = asyncio.get_running_loop()
    waiter = conn.answer(loop.time() + 30)
    conn.data_received(whole[: wire.FRAME_PREFIX_BYTES + len(head)])
    assert conn.started() and not conn.has_frames(1)
    assert await waiter is None  # woken: no frame yet
    waiter = conn.answer(loop.time() + 30)
    conn.data_received(inner)
    assert await waiter is None  # not ``b"abc"``: the frame came in pieces, queued
    assert await conn.next_frame(loop.time() + 30) == head + inner
    assert not conn.started()
    conn.connection_lost(None)


async def test_a_stream_that_ends_inside_a_frame_is_its_error_not_a_frame_started() -> None:
    """The peer ends its side inside a frame: the decoder drops that part and the connection
    knows nothing is pending any more, so a wait for a frame raises ``IncompleteFrameError``
    (it would wait on, or read nothing, if the part still counted as a frame started)."""
    conn = ClientConnection(1 << 20)
    whole = wire.encode_frame(b"abcdef")
    conn.data_received(whole[:-2])
    assert conn.started()
    conn.eof_received()
    with pytest.raises(IncompleteFrameError):
        await conn.wait_started()
    conn.connection_lost(None)
