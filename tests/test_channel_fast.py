"""The channel's one-message call (version 4) and its fallback to the two-frame form.

A call of references and ``None``s without prompt updates, whose payload plain msgpack carries,
travels as one plain message (``_channel_format.call_frames``); any other call as before
(version 3). The worker reads both (``decode_call``) and refuses hostile bytes with
``WireError``, never anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioshmcache import AsyncReceiverCache, AsyncSenderCache, FeatureSpec, ShmRef
from aioshmcache._channel_format import (
    CALL_VERSION,
    MAX_FEATURES,
    ONE_MESSAGE_VERSION,
    TAG,
    call_envelope,
    call_frames,
    decode,
    decode_call,
    pack_call_features,
)
from aioshmcache._channel_server import CallLimit
from aioshmcache.aio import read_after_wait
from aioshmcache.channel import EngineClient, serve_engine
from aioshmcache.errors import InvalidReferenceError, WireError
from aioshmcache.wire import encode_frame, read_frame

from ._channel_procs import crc, handler
from .test_differential_store import _spied

REF = ShmRef(1 << 63, 2, 4096, 77, 1024, (1 << 64) - 1, 3, 12345)
_U64X8 = struct.Struct("<8Q")


def _v4(rows: Any, payload: Any = None, *, tag: str = TAG, kind: str = "call") -> bytes:
    packed: bytes = msgpack.packb([tag, ONE_MESSAGE_VERSION, kind, payload, rows])
    return packed


@pytest.mark.parametrize(
    "features",
    [
        [],
        [FeatureSpec("a", REF), FeatureSpec("b", None, identifier="id-b")],
        [FeatureSpec("é" * 70, REF, identifier=None, prompt_updates=())],
        [FeatureSpec(f"h{i}", REF._replace(seq=i)) for i in range(50)],
    ],
)
@pytest.mark.parametrize("payload", [None, {"prompt": "a cat", "ids": [1, 2], "raw": b"\x00"}])
def test_a_call_of_references_is_one_message(features: list[FeatureSpec], payload: Any) -> None:
    head, body = call_frames(payload, features)
    assert body == b"" and msgpack.unpackb(head)[1] == ONE_MESSAGE_VERSION
    version, got_payload, got = decode_call(head, body)
    assert version == ONE_MESSAGE_VERSION and got_payload == payload and got == features
    assert all(type(f.data) is ShmRef or f.data is None for f in got)
    # the two-frame form of the same call reads back the same
    old = decode_call(call_envelope(payload), pack_call_features(features))
    assert old == (CALL_VERSION, payload, features)


@pytest.mark.parametrize(
    ("payload", "features"),
    [
        (None, [FeatureSpec("i", {"x": np.arange(3)})]),  # an inline item
        (None, [FeatureSpec("a", REF, prompt_updates=[{"offset": 3}])]),
        ((1, 2), [FeatureSpec("a", REF)]),  # a tuple payload: the serde's envelope
        ({"x": np.arange(4, dtype=np.float32)}, []),
        (None, [FeatureSpec("a", REF.to_dict())]),  # a reference's dict
    ],
)
def test_any_other_call_keeps_the_two_frame_form(payload: Any, features: list[FeatureSpec]) -> None:
    head, body = call_frames(payload, features)
    assert body != b""
    version, got_payload, got = decode_call(head, body)
    assert version == CALL_VERSION
    assert [f.mm_hash for f in got] == [f.mm_hash for f in features]
    if isinstance(payload, tuple):
        assert got_payload == payload and type(got_payload) is tuple


@pytest.mark.parametrize(
    "ref",
    [
        REF._replace(seq=True),  # a bool is not an int here
        REF._replace(seq=np.uint64(3)),  # type: ignore[arg-type]  # nor a numpy int
        REF._replace(seq=1 << 64),  # out of range
        REF._replace(seq=-1),
    ],
)
def test_a_malformed_reference_is_refused_as_before(ref: ShmRef) -> None:
    """The one-message form takes only what the general form takes; the rest raises there."""
    with pytest.raises(InvalidReferenceError):
        call_frames(None, [FeatureSpec("a", ref)])


def test_a_version_three_worker_refuses_a_one_message_call() -> None:
    """What a worker of the previous version runs on the call's first frame: ``WireError``, so
    it answers ``bad_request`` at once (the second frame is there, empty)."""
    head, _ = call_frames(None, [FeatureSpec("a", REF)])
    with pytest.raises(WireError, match="version"):
        decode(head, "call", (1, 2, 3))


@pytest.mark.parametrize(
    ("head", "body"),
    [
        (_v4([]), b"\x00"),  # the second frame must be empty
        (_v4([["a", None, b"\x00" * 63]]), b""),  # a short reference
        (_v4([["a", None, b"\x00" * 65]]), b""),
        (_v4([["a", None, [0] * 8]]), b""),  # a reference as a list: not this form's
        (_v4([["a", None, "x" * 64]]), b""),  # a str, not bytes
        (_v4([["a", None]]), b""),
        (_v4([["a", None, None, None]]), b""),
        (_v4([[1, None, None]]), b""),  # mm_hash not a str
        (_v4([["a", 5, None]]), b""),  # identifier not a str
        (_v4("rows"), b""),
        (_v4([None]), b""),
        (_v4([["a", None, None]] * (MAX_FEATURES + 1)), b""),
        (_v4([], kind="answer"), b""),
        (_v4([], tag="not.channel"), b""),
        (_v4([]) + b"\x00", b""),  # trailing bytes
        (_v4([["a", None, b"\x00" * 64]])[:-5], b""),  # cut
        (msgpack.packb([TAG, ONE_MESSAGE_VERSION, "call", None]), b""),  # four items
        (msgpack.packb([TAG, True, "call", None, []]), b""),
        (msgpack.packb([TAG, ONE_MESSAGE_VERSION, "call", {1: "int key"}, []]), b""),
        (b"\x95" + b"\x91" * 100_000 + b"\xc0", b""),  # deep
        (b"\x95\xb3aioshmcache.channel\x04\xa4call\xc0" + b"\x90" * 40_000, b""),  # containers
    ],
)
def test_a_hostile_one_message_call_is_a_wire_error(head: bytes, body: bytes) -> None:
    with pytest.raises(WireError):
        decode_call(head, body)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300).map(lambda b: b"\x95\xb3aioshmcache.channel\x04\xa4call" + b),
        st.recursive(
            st.none()
            | st.integers(-(2**63), 2**64 - 1)
            | st.text(max_size=8)
            | st.binary(min_size=60, max_size=68)
            | st.binary(max_size=8),
            lambda inner: st.lists(inner, max_size=6),
            max_leaves=30,
        ).map(_v4),
    )
)
def test_a_one_message_call_is_features_or_a_wire_error(head: bytes) -> None:
    """Any bytes starting as a version-4 call: references and Nones, or ``WireError``."""
    try:
        _version, _payload, features = decode_call(head, b"")
    except WireError:
        return
    for f in features:
        assert type(f.mm_hash) is str and (f.identifier is None or type(f.identifier) is str)
        assert f.data is None or (type(f.data) is ShmRef and all(type(v) is int for v in f.data))


@contextlib.asynccontextmanager
async def _worker(make_config: Callable[..., Any], sock: Path) -> AsyncIterator[AsyncSenderCache]:
    """A writer's cache, and an engine worker serving ``handler`` on ``sock`` with its reader."""
    async with (
        AsyncSenderCache.from_config(make_config(4 << 20)) as cache,
        AsyncReceiverCache.attach(cache.handle()) as rx,
    ):
        ready = asyncio.Event()
        task = asyncio.create_task(serve_engine(sock, handler, rx, ready=ready.set))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            yield cache
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_a_one_message_call_is_served_with_a_plain_answer(
    make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """Written by hand on a socket, as a gateway of this version does: read, acknowledged,
    answered in plain msgpack; a reference's eight ints cross as they were."""

    sock = tmp_path / "e.sock"
    async with _worker(make_config, sock) as cache:
        item = {"x": np.arange(256, dtype=np.float32)}
        [f] = await cache.get_and_update_features([FeatureSpec("h", item)])
        reader, writer = await asyncio.open_unix_connection(str(sock))
        try:
            row = ["h", None, _U64X8.pack(*f.data)]
            writer.write(encode_frame(_v4([row], {"op": "echo", "n": 1})) + encode_frame(b""))
            await writer.drain()
            answer = await asyncio.wait_for(read_frame(reader), 30)
            assert answer[:4] != b"ASHM"  # plain msgpack (the echo's result allows it)
            value = decode(answer, "response")
            assert value[2] == "ok" and value[3]["payload"] == {"op": "echo", "n": 1}
        finally:
            writer.close()
        assert cache.snapshot().readers[0].lag == 0  # read and acknowledged
        async with EngineClient.connect(sock, cache=cache) as engine:  # and by the client
            [g] = await cache.get_and_update_features([FeatureSpec("h", None)])
            out = await engine.call([g], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(item["x"])]
        assert cache.snapshot().readers[0].lag == 0


async def test_a_connection_s_one_timer_enforces_every_wait_s_own_deadline() -> None:
    """A connection keeps one timer for its waits: a wait with a later deadline than the armed
    timer's times out at its own deadline, never at the earlier one; a wait with an earlier
    deadline times out at it, not at the armed one; a frame in time is returned."""
    import socket

    from aioshmcache._channel_conn import FrameConnection

    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    b.setblocking(False)
    transport, conn = await loop.connect_accepted_socket(lambda: FrameConnection(1 << 20), a)
    try:
        await loop.sock_sendall(b, encode_frame(b"one"))
        assert await conn.next_frame(loop.time() + 0.2) == b"one"  # arms a timer at +0.2
        later = loop.time() + 0.5
        with pytest.raises(TimeoutError):
            await conn.next_frame(later)
        # not at the armed timer's earlier deadline (a timer may fire a millisecond early)
        assert loop.time() >= later - 0.05
        await loop.sock_sendall(b, encode_frame(b"two"))
        assert await conn.next_frame(loop.time() + 60) == b"two"  # arms a timer at +60
        start = loop.time()
        with pytest.raises(TimeoutError):
            await conn.next_frame(start + 0.05)
        assert loop.time() - start < 30  # its own deadline, not the armed one's
        await loop.sock_sendall(b, encode_frame(b"three"))
        assert await conn.next_frame(loop.time() + 60) == b"three"  # usable after a timeout
    finally:
        transport.abort()
        b.close()


async def test_the_call_limit_hands_slots_over_in_order_and_survives_cancellation() -> None:
    """``CallLimit`` (``serve_engine``'s ``max_concurrency``): a free slot is taken at once, a
    given-back slot goes to the first waiter, a waiter cancelled in the queue leaves it, and
    one cancelled after it was handed a slot passes it on (no slot is lost)."""
    limit = CallLimit(1)
    assert limit.take() and not limit.take()
    order: list[str] = []

    async def queued(name: str) -> None:
        await limit.wait()
        order.append(name)

    a = asyncio.create_task(queued("a"))
    b = asyncio.create_task(queued("b"))
    c = asyncio.create_task(queued("c"))
    await asyncio.sleep(0)
    b.cancel()  # cancelled while queued: leaves the queue
    await asyncio.sleep(0)
    limit.give()  # to "a"
    await a
    assert order == ["a"] and b.cancelled()
    limit.give()  # handed to "c", which is cancelled before it runs: passed on, not lost
    c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    assert order == ["a"] and limit.free == 1 and not limit.waiters
    assert limit.take() and not limit.take()


async def test_at_most_max_concurrency_handlers_run_at_once(tmp_path: Path) -> None:
    """Calls beyond ``max_concurrency`` wait for a slot; every one is answered."""
    running = peak = 0
    full = asyncio.Event()  # two handlers run: each waits for it, so the peak reaches two

    async def slow(features: list[FeatureSpec], payload: Any) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            full.set()
        await full.wait()
        await asyncio.sleep(0)
        running -= 1
        return int(payload)

    class NoReads:
        async def get_and_update_features(self, features: Any) -> list[FeatureSpec]:
            return list(features)

        def lease(self, features: Any) -> Any:
            raise AssertionError("not leasing")

    sock = tmp_path / "e.sock"
    ready = asyncio.Event()
    task = asyncio.create_task(
        serve_engine(sock, slow, NoReads(), max_concurrency=2, ready=ready.set)
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with EngineClient.connect(sock, max_connections=6) as engine:
            got = await asyncio.gather(*(engine.call([], i, timeout=60) for i in range(6)))
        assert got == list(range(6)) and peak == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _echo_call(cache: AsyncSenderCache, n: int) -> bytes:
    """A one-message call (and its empty end frame) of one reference to "h", payload n."""
    [g] = await cache.get_and_update_features([FeatureSpec("h", None)])
    row = ["h", None, _U64X8.pack(*g.data)]
    return encode_frame(_v4([row], {"op": "echo", "n": n})) + encode_frame(b"")


async def _send_raw(sock: Path, pieces: list[bytes], *, answers: int) -> None:
    """Write ``pieces`` to the worker on a connection of its own (a pause between pieces);
    the ``answers`` echo answers come back in order."""
    reader, writer = await asyncio.open_unix_connection(str(sock))
    try:
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(0.05)
            writer.write(piece)
            await writer.drain()
        for n in range(answers):
            value = decode(await asyncio.wait_for(read_frame(reader), 30), "response")
            assert value[2] == "ok" and value[3]["payload"] == {"op": "echo", "n": n}
    finally:
        writer.close()


async def test_a_call_received_whole_is_cut_and_decoded_in_one_core_call(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the C core the worker takes a version-4 call that arrives in one read with one core
    call (``chan_take_call``: no frame queued, no separate decode), and answers it as it answers
    the frames; its plain answer is encoded and framed, and read by the gateway, in one core call
    each; a call cut into pieces, or two calls in one read, take the frame path and are
    answered alike, in order."""
    import aioshmcache
    from aioshmcache import _channel_client, _channel_server

    taken = _spied(monkeypatch, _channel_server, "take_call", _channel_server.take_call)
    # the answer encoded and framed, then read, in one core call each
    framed = _spied(monkeypatch, _channel_server, "ok_frame", _channel_server.ok_frame)
    read = _spied(monkeypatch, _channel_client, "ok_result", _channel_client.ok_result)
    sock = tmp_path / "e.sock"
    async with _worker(make_config, sock) as cache:
        item = {"x": np.arange(300, dtype=np.float32)}
        [f] = await cache.get_and_update_features([FeatureSpec("h", item)])
        async with EngineClient.connect(sock, cache=cache) as engine:
            out = await engine.call([f], {"op": "crc"}, timeout=30)
            assert out["crcs"] == [crc(item["x"])]
            compiled = aioshmcache.implementation() == "c"
            assert taken and taken[-1] is compiled
            # an answer with an array takes the general path; a plain one the core's
            assert framed == read == [False]
            [f] = await cache.get_and_update_features([FeatureSpec("h", None)])
            out = await engine.call([f], {"op": "echo"}, timeout=30)
            assert out["payload"] == {"op": "echo"}
            assert framed == read == [False, compiled]
        calls = [await _echo_call(cache, n) for n in range(2)]
        # a call in pieces, then the next one with its end
        await _send_raw(sock, [calls[0][:7], calls[0][7:] + calls[1]], answers=2)
        assert cache.snapshot().readers[0].lag == 0  # every call read and acknowledged


async def test_a_call_taken_whole_counts_a_loop_turn(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's connection counts a loop turn (``_loop_turns.turned``) for a call the core
    takes whole as it arrives, as for any other read: the async faces' checkpoints learn of the
    turn from it (a first version left the count out of this path)."""
    import aioshmcache
    from aioshmcache import _channel_server

    if aioshmcache.implementation() != "c":
        pytest.skip("the pure core takes no call whole")
    counted: list[None] = []
    from aioshmcache._loop_turns import turned as real

    def turned() -> None:
        counted.append(None)
        real()

    taken = _spied(monkeypatch, _channel_server, "take_call", _channel_server.take_call)
    monkeypatch.setattr(_channel_server, "turned", turned)
    sock = tmp_path / "e.sock"
    async with _worker(make_config, sock) as cache:
        [f] = await cache.get_and_update_features([FeatureSpec("h", {"x": np.ones(8)})])
        async with EngineClient.connect(sock, cache=cache) as engine:
            for _ in range(5):
                [f] = await cache.get_and_update_features([FeatureSpec("h", None)])
                assert (await engine.call([f], {"op": "echo"}, timeout=30))["payload"]
    assert len(counted) == taken.count(True) >= 5


async def test_a_call_the_worker_waited_for_is_read_without_the_face_s_turn_accounting(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection whose task waited for its call (the loop turned meanwhile) reads the call's
    one reference with ``aio.read_after_wait``: no checkpoint accounting (``_due``) on the reader
    face (with the C core; the pure core declines and the face reads). A call already waiting
    when the task comes back for it (two calls in one read) was not
    waited for: it is read through the face, which may yield first. Both are answered alike."""
    import aioshmcache
    from aioshmcache import _channel_server

    direct = _spied(monkeypatch, _channel_server, "read_after_wait", read_after_wait)
    dues: list[bool] = []
    due = AsyncReceiverCache._due

    def counted_due(self: AsyncReceiverCache) -> bool:
        dues.append(True)
        return due(self)

    monkeypatch.setattr(AsyncReceiverCache, "_due", counted_due)
    sock = tmp_path / "e.sock"
    async with _worker(make_config, sock) as cache:
        item = {"x": np.arange(300, dtype=np.float32)}
        [f] = await cache.get_and_update_features([FeatureSpec("h", item)])
        async with EngineClient.connect(sock, cache=cache) as engine:
            for n in range(4):
                if n == 1:  # the first read probes the writer (the request path): not counted
                    direct.clear()
                    dues.clear()
                out = await engine.call([f], {"op": "crc"}, timeout=30)
                assert out["crcs"] == [crc(item["x"])]
                [f] = await cache.get_and_update_features([FeatureSpec("h", None)])
            await cache.release(f.data)
        compiled = aioshmcache.implementation() == "c"  # the pure core reads through the face
        assert direct == [compiled] * 3 and (dues == []) is compiled
        calls = [await _echo_call(cache, n) for n in range(2)]
        # in one write: the second call waits while the first is served
        await _send_raw(sock, [calls[0] + calls[1]], answers=2)
        # the first call was waited for (read directly); the second was there already
        assert direct == [compiled] * 4
        assert len(dues) == 1 if compiled else len(dues) >= 4  # pure: every read by the face
        assert cache.snapshot().readers[0].lag == 0  # every call read and acknowledged


async def test_the_worker_s_usual_answer_awaits_no_drain(
    make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer the transport takes without pausing (the usual one) is written with no
    coroutine: ``write_framed`` (and ``write``) say whether it must be drained, and the worker
    awaits ``drain`` only then (its transport paused or closing)."""
    from aioshmcache._channel_conn import FrameConnection

    drained: list[None] = []
    drain = FrameConnection.drain

    async def counted(self: Any, deadline: float | None = None) -> None:
        drained.append(None)
        await drain(self, deadline)

    monkeypatch.setattr(FrameConnection, "drain", counted)  # either end's (the gateway: none)
    sock = tmp_path / "e.sock"
    async with _worker(make_config, sock) as cache:
        item = {"x": np.arange(300, dtype=np.float32)}
        async with EngineClient.connect(sock, cache=cache) as engine:
            for _ in range(3):
                [f] = await cache.get_and_update_features([FeatureSpec("h", item)])
                assert (await engine.call([f], {"op": "crc"}, timeout=30))["crcs"] == [
                    crc(item["x"])
                ]
    assert drained == []

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.written: list[bytes] = []
            self.closing = False

        def write(self, data: Any) -> None:
            self.written.append(bytes(data))

        def is_closing(self) -> bool:
            return self.closing

    conn = FrameConnection(1 << 10)
    t = Transport()
    conn.connection_made(t)
    assert conn.write_framed(b"a") is False
    conn.pause_writing()
    assert conn.write_framed(b"b") is True  # paused: drain waits for the transport
    conn.resume_writing()
    t.closing = True
    assert conn.write_framed(b"c") is True  # closing: drain raises
    assert conn.write([b"d"]) is True
    t.closing = False
    assert conn.write([b"e"]) is False
    assert t.written == [b"a", b"b", b"c", encode_frame(b"d"), encode_frame(b"e")]
