"""The wire: features round-trip exactly; hostile messages and frames fail typed, never hang."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest
from anyio.abc import ByteReceiveStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import (
    FeatureSpec,
    InvalidReferenceError,
    MsgpackSerde,
    SerdeError,
    ShmCacheError,
    ShmRef,
)
from aioshmcache.errors import (
    EndOfFramesError,
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    WireError,
)
from aioshmcache.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_PREFIX_BYTES,
    FrameDecoder,
    encode_frame,
    pack_features,
    read_frame,
    receive_frame,
    send_frame,
    unpack_features,
    write_frame,
)
from tests.test_serde import arrays, assert_same, items, values

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = (1 << 64) - 1
REF = ShmRef(nonce=U64, epoch=3, address=4096, id=(1 << 40) + 7, length=123, tag=99, seq=2)
BIG = 5 << 20  # a frame well past asyncio's 64 KiB stream limit
DEADLINE = 30.0


def assert_features(expected: list[FeatureSpec], got: list[FeatureSpec]) -> None:
    assert type(got) is list and len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert type(g) is FeatureSpec
        assert g.mm_hash == e.mm_hash and g.identifier == e.identifier
        assert_same(e.prompt_updates, g.prompt_updates)
        if isinstance(e.data, ShmRef):
            assert type(g.data) is ShmRef and g.data == e.data
        else:
            assert_same(e.data, g.data)


def round_trip(features: list[FeatureSpec], **kw: Any) -> list[FeatureSpec]:
    out = unpack_features(pack_features(features), **kw)
    assert_features(features, out)
    return out


def message(value: object) -> bytes:
    """Any structure as a well-formed serde payload (to forge messages the packer never makes)."""
    serde = MsgpackSerde(max_depth=256)
    plan = serde.plan(value)
    buf = bytearray(plan.nbytes)
    serde.write(plan, memoryview(buf))
    return bytes(buf)


def unpack_or_serde_error(data: bytes | bytearray | memoryview) -> list[FeatureSpec] | None:
    """Decode hostile bytes: a SerdeError or WireError is fine; any other exception fails."""
    try:
        return unpack_features(data)
    except (SerdeError, WireError):
        return None


# --- round trips ------------------------------------------------------------------------------

SPECIAL_ARRAYS = {
    "bool": np.array([True, False, True]),
    "float16": np.linspace(-2, 2, 7, dtype=np.float16),
    "big-endian f8": np.arange(6, dtype=">f8").reshape(2, 3),
    "big-endian i4": np.arange(-3, 3, dtype=">i4"),
    "zero-size": np.zeros((0, 3), dtype=np.float32),
    "zero-size 3-d": np.ones((2, 0, 4), dtype=np.int64),
    "0-d": np.array(3.5),
    "non-contiguous": np.arange(48, dtype=np.int16).reshape(6, 8)[::2, 1::3],
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "bfloat16 as uint16": np.array([0x3F80, 0xC000, 0x7FC0], dtype=np.uint16),
    "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
    "str": np.array(["a", "ünï", ""]),
    "bytes": np.array([b"x", b"yz"]),
    "datetime": np.array(["2024-01-01", "NaT"], dtype="datetime64[D]"),
    "nan": np.array([np.nan, -0.0, np.inf]),
    "uint64 max": np.array([U64, 0], dtype=np.uint64),
}


@pytest.mark.parametrize("name", list(SPECIAL_ARRAYS))
def test_every_kind_of_array_round_trips(name: str) -> None:
    arr = SPECIAL_ARRAYS[name]
    out = round_trip([FeatureSpec("h", {"a": arr, "nested": [arr, {"again": arr}]})])
    got = out[0].data["a"]
    assert got.flags.c_contiguous and not got.flags.writeable


def test_references_none_and_items_in_one_request() -> None:
    features = [
        FeatureSpec("none", None),
        FeatureSpec("ref", REF, identifier="img-0", prompt_updates=("a", 1, [2.5, None])),
        FeatureSpec(
            "item",
            {
                "pixel_values": np.random.default_rng(0).random((3, 8, 8), dtype=np.float32),
                "image_grid_thw": [np.int64(1), np.int64(2), np.int64(2)],
                "meta": {"size": (640, 480), "name": "cat.png", "raw": b"\x00" * 2000, "k": 1.5},
                "flags": [True, False, None],
            },
            identifier=None,
            prompt_updates=[{"offset": 3, "length": np.int32(4)}],
        ),
        FeatureSpec("empty", {}),
    ]
    out = round_trip(features)
    assert out[1].data == REF and isinstance(out[1].data, ShmRef)
    assert type(out[2].data["image_grid_thw"][0]) is np.int64
    assert type(out[2].prompt_updates) is list and type(out[1].prompt_updates) is tuple


def test_reference_dicts_travel_as_references() -> None:
    out = unpack_features(pack_features([FeatureSpec("h", REF.to_dict())]))
    assert type(out[0].data) is ShmRef and out[0].data == REF


def test_empty_request() -> None:
    assert unpack_features(pack_features([])) == []


@pytest.mark.torch
def test_torch_bfloat16_round_trips() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([[1.0, -2.5], [0.125, 3.0]], dtype=torch.bfloat16)
    out = unpack_features(pack_features([FeatureSpec("h", {"t": t})]), copy=True)
    got = out[0].data["t"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, t)


ref_strategy = st.builds(ShmRef, *[st.integers(0, U64) for _ in ShmRef._fields])
text_or_none = st.none() | st.text(max_size=10)
features_strategy = st.lists(
    st.builds(
        FeatureSpec,
        st.text(max_size=16),
        st.none() | ref_strategy | items,
        identifier=text_or_none,
        prompt_updates=st.lists(values, max_size=3) | st.lists(values, max_size=3).map(tuple),
    ),
    max_size=5,
)


@FAST
@given(features=features_strategy)
def test_round_trip_hypothesis(features: list[FeatureSpec]) -> None:
    round_trip(features)
    assert_features(features, unpack_features(pack_features(features), copy=True))


@FAST
@given(arr=arrays(), shape_kind=st.sampled_from(["plain", "in list", "in tuple"]))
def test_single_arrays_of_every_dtype_and_shape(arr: np.ndarray[Any, Any], shape_kind: str) -> None:
    value: object = arr if shape_kind == "plain" else [arr] if shape_kind == "in list" else (arr,)
    round_trip([FeatureSpec("h", {"v": value})])


# --- zero copy --------------------------------------------------------------------------------


def test_views_alias_the_buffer_and_are_read_only() -> None:
    arr = np.arange(1000, dtype=np.float64)
    data = pack_features([FeatureSpec("h", {"a": arr})])
    got = unpack_features(data)[0].data["a"]
    assert np.shares_memory(got, np.frombuffer(data, np.uint8))
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0] = 1.0
    with pytest.raises(ValueError):
        got.flags.writeable = True


def test_views_of_a_bytearray_pin_it_and_stay_read_only() -> None:
    data = bytearray(pack_features([FeatureSpec("h", {"a": np.arange(100)})]))
    got = unpack_features(data)[0].data["a"]
    assert np.shares_memory(got, np.frombuffer(data, np.uint8)) and not got.flags.writeable
    with pytest.raises(BufferError):
        data.append(0)  # exported while the view lives
    del got
    data.append(0)


def test_copy_gives_writable_arrays_of_their_own() -> None:
    data = pack_features([FeatureSpec("h", {"a": np.arange(100)})])
    got = unpack_features(data, copy=True)[0].data["a"]
    assert got.flags.writeable and got.flags.owndata
    assert not np.shares_memory(got, np.frombuffer(data, np.uint8))
    got[0] = 7


# --- what the packer refuses ------------------------------------------------------------------


@pytest.mark.parametrize(
    "features",
    [
        "abc",
        b"abc",
        FeatureSpec("h", None),
        42,
        [object()],
        [FeatureSpec(1, None)],  # type: ignore[arg-type]
        [FeatureSpec("h", None, identifier=3)],  # type: ignore[arg-type]
        [FeatureSpec("h", None, prompt_updates="abc")],
        [FeatureSpec("h", None, prompt_updates=range(3))],
    ],
)
def test_pack_refuses_wrong_types(features: Any) -> None:
    with pytest.raises(TypeError):
        pack_features(features)


@pytest.mark.parametrize(
    "data",
    [
        {"a": object()},
        {"a": 1 + 2j},
        {"a": {1, 2}},
        {"a": np.array([object()])},
        {1: 2},
        {"a": 1 << 64},
    ],
)
def test_pack_refuses_what_the_serde_refuses(data: Any) -> None:
    with pytest.raises(SerdeError):
        pack_features([FeatureSpec("h", data)])


def test_pack_refuses_pickle_only_prompt_updates() -> None:
    with pytest.raises(SerdeError):
        pack_features([FeatureSpec("h", None, prompt_updates=[lambda: 0])])


@pytest.mark.parametrize("bad", [REF._replace(id=-1), REF._replace(tag=1 << 64)])
def test_pack_refuses_malformed_references(bad: ShmRef) -> None:
    with pytest.raises(InvalidReferenceError):
        pack_features([FeatureSpec("h", bad)])
    with pytest.raises(InvalidReferenceError):
        pack_features([FeatureSpec("h", {**REF.to_dict(), "id": "7"})])


def test_pack_refuses_what_the_reader_would_refuse() -> None:
    with pytest.raises(WireError):
        pack_features([FeatureSpec(str(i), None) for i in range(11)], max_features=10)
    with pytest.raises(SerdeError):  # the structure header holds str values
        pack_features([FeatureSpec("h", {"s": "x" * (2 << 20)})])
    with pytest.raises(SerdeError):
        pack_features([FeatureSpec("h", {"a": list(range(5))})], max_arrays=1, max_depth=1)
    deep: Any = 1
    for _ in range(63):
        deep = [deep]
    pack_features([FeatureSpec("h", {"d": deep})])  # the item's depth, as in the store: 64
    with pytest.raises(SerdeError):
        pack_features([FeatureSpec("h", {"d": [deep]})])
    with pytest.raises(ValueError):
        pack_features([], max_depth=0)


# --- hostile messages -------------------------------------------------------------------------

GOOD = pack_features(
    [
        FeatureSpec("a", REF, identifier="i", prompt_updates=[1]),
        FeatureSpec("b", {"x": np.arange(300, dtype=np.float32), "y": "s"}),
        FeatureSpec("c", None),
    ]
)


def test_every_truncation_and_extension_is_refused() -> None:
    for n in range(len(GOOD)):
        with pytest.raises(SerdeError):
            unpack_features(GOOD[:n])
    for extra in (b"\x00", b"\x00" * 64, GOOD):
        with pytest.raises(SerdeError):
            unpack_features(GOOD + extra)


@FAST
@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused(data: bytes) -> None:
    unpack_or_serde_error(data)
    unpack_or_serde_error(b"ASHM\x01\x00\x00\x00" + data)


@FAST
@given(flips=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), max_size=4))
def test_corrupted_messages_fail_typed(flips: list[tuple[int, int]]) -> None:
    data = bytearray(GOOD)
    for pos, mask in flips:
        data[pos] ^= mask
    out = unpack_or_serde_error(data)
    if out is not None:
        assert len(out) <= 3 and all(type(f) is FeatureSpec for f in out)


NOT_MESSAGES: list[object] = [
    None,
    {"a": 1},
    ["aioshmcache.wire", 1],
    ["aioshmcache.wire", 1, [], None],
    ["other", 1, []],
    [np.arange(3), 1, []],
    ["aioshmcache.wire", 2, []],
    ["aioshmcache.wire", True, []],
    ["aioshmcache.wire", "1", []],
    ["aioshmcache.wire", 1, {}],
    ["aioshmcache.wire", 1, ("h", 0, None, None, [])],
    ["aioshmcache.wire", 1, [("h", 0, None, None, [])]],
    ["aioshmcache.wire", 1, [["h", 0, None, None]]],
    ["aioshmcache.wire", 1, [["h", 0, None, None, [], 0]]],
    ["aioshmcache.wire", 1, [[b"h", 0, None, None, []]]],
    ["aioshmcache.wire", 1, [[7, 0, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", 0, None, 5, []]]],
    ["aioshmcache.wire", 1, [["h", 0, None, None, "x"]]],
    ["aioshmcache.wire", 1, [["h", 0, None, None, {}]]],
    ["aioshmcache.wire", 1, [["h", 3, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", -1, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", False, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", 0.0, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", 0, {"a": 1}, None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, None, None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, list(range(7)), None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, list(range(9)), None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, [-1, *range(7)], None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, [1.0, *range(7)], None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, [True, *range(7)], None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, tuple(range(8)), None, []]]],
    ["aioshmcache.wire", 1, [["h", 1, {"nonce": 1}, None, []]]],
    ["aioshmcache.wire", 1, [["h", 2, None, None, []]]],
]


@pytest.mark.parametrize("value", NOT_MESSAGES, ids=range(len(NOT_MESSAGES)))
def test_well_formed_payloads_that_are_not_messages(value: object) -> None:
    with pytest.raises(WireError):
        unpack_features(message(value))


def test_max_features_and_deep_nesting_are_refused() -> None:
    rows = [["h", 0, None, None, []]] * 11
    with pytest.raises(WireError):
        unpack_features(message(["aioshmcache.wire", 1, rows]), max_features=10)
    assert len(unpack_features(message(["aioshmcache.wire", 1, rows]))) == 11
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(SerdeError):
        unpack_features(message(["aioshmcache.wire", 1, [["h", 2, {"d": deep}, None, []]]]))


def test_huge_declared_lengths_are_refused_at_once() -> None:
    prefix = struct.Struct("<4sHHIQ")
    # a header of 4 GiB, a data section of 2**64 - 1 bytes
    with pytest.raises(SerdeError):
        unpack_features(prefix.pack(b"ASHM", 1, 0, (1 << 32) - 1, 0) + b"\x90")
    with pytest.raises(SerdeError):
        unpack_features(prefix.pack(b"ASHM", 1, 0, 1, U64) + b"\x90")
    # msgpack containers declaring 2**32 - 1 elements in a tiny header
    for header in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        data = prefix.pack(b"ASHM", 1, 0, len(header), 0) + header
        data += bytes(-len(data) % 64)
        with pytest.raises(SerdeError):
            unpack_features(data)


def test_no_pickle_is_ever_decoded() -> None:
    import pickle

    with pytest.raises(SerdeError):
        unpack_features(pickle.dumps([FeatureSpec("h", None)]))
    header = msgpack.packb(["aioshmcache.wire", 1, [["h", 2, msgpack.ExtType(99, b"x"), None, []]]])
    data = struct.pack("<4sHHIQ", b"ASHM", 1, 0, len(header), 0) + header
    with pytest.raises(SerdeError):
        unpack_features(data + bytes(-len(data) % 64))


@pytest.mark.parametrize("bad", ["text", 12, None, [1, 2]])
def test_unpack_refuses_non_buffers(bad: Any) -> None:
    with pytest.raises(TypeError):
        unpack_features(bad)


# --- frames: buffers --------------------------------------------------------------------------


def frames_of(
    data: bytes, cuts: list[int], *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> list[bytes]:
    dec = FrameDecoder(max_bytes=max_bytes)
    out: list[bytes] = []
    prev = 0
    for cut in [*sorted(cuts), len(data)]:
        out += dec.feed(data[prev:cut])
        prev = cut
    dec.close()
    return out


def test_encode_and_decode_frames_split_anywhere() -> None:
    payloads = [b"", b"a", bytes(range(256)) * 3, b"", GOOD]
    stream = b"".join(encode_frame(p) for p in payloads)
    for cut in range(len(stream) + 1):
        assert frames_of(stream, [cut]) == payloads
    rng = random.Random(1)
    for _ in range(50):
        cuts = rng.sample(range(len(stream)), 10)
        assert frames_of(stream, cuts) == payloads
    assert frames_of(stream, list(range(len(stream)))) == payloads  # one byte at a time


def test_encode_frame_accepts_buffers() -> None:
    arr = np.arange(10, dtype=np.int32)
    assert encode_frame(arr.data) == encode_frame(arr.tobytes())
    assert encode_frame(arr.data[::2]) == encode_frame(arr[::2].tobytes())
    assert encode_frame(bytearray(b"xy"))[:FRAME_PREFIX_BYTES] == struct.pack("<Q", 2)
    with pytest.raises(TypeError):
        encode_frame("text")  # type: ignore[arg-type]
    with pytest.raises(FrameTooLargeError) as info:
        encode_frame(b"x" * 11, max_bytes=10)
    assert info.value.nbytes == 11 and info.value.max_bytes == 10
    for bad in (-1, 1.5, 1 << 64):
        with pytest.raises(ValueError):
            encode_frame(b"", max_bytes=bad)  # type: ignore[arg-type]


def test_frame_decoder_refuses_too_large_then_stays_out_of_step() -> None:
    dec = FrameDecoder(max_bytes=100)
    assert dec.feed(encode_frame(b"x" * 100)) == [b"x" * 100]
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(struct.pack("<Q", 101))  # refused from the prefix alone
    assert info.value.nbytes == 101
    with pytest.raises(FrameError):
        dec.feed(b"")
    with pytest.raises(FrameTooLargeError):
        FrameDecoder().feed(struct.pack("<Q", U64))


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 20])
def test_frame_decoder_close_mid_frame(cut: int) -> None:
    dec = FrameDecoder()
    frame = encode_frame(b"y" * 20)
    assert dec.feed(frame[:cut]) == []
    assert dec.pending == cut
    with pytest.raises(IncompleteFrameError) as info:
        dec.close()
    assert info.value.received == cut and isinstance(info.value, EOFError)
    assert info.value.expected == (8 if cut < 8 else 28)


@FAST
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=5))
def test_frame_decoder_on_random_bytes(data: bytes, cuts: list[int]) -> None:
    try:
        frames_of(data, [c for c in cuts if c <= len(data)], max_bytes=1 << 16)
    except (FrameError, FrameTooLargeError, IncompleteFrameError):
        pass


# --- frames: asyncio streams ------------------------------------------------------------------


@asynccontextmanager
async def socketpair() -> AsyncIterator[
    tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.StreamReader, asyncio.StreamWriter]
]:
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    try:
        yield ra, wa, rb, wb
    finally:
        for w in (wa, wb):
            w.close()
        for w in (wa, wb):
            try:
                await w.wait_closed()
            except OSError:
                pass


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a unix socket path is limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="aioshm-wire-", dir="/tmp"))
    try:
        yield path
    finally:
        for p in path.iterdir():
            p.unlink()
        path.rmdir()


async def test_asyncio_frames_over_a_socketpair() -> None:
    big = os.urandom(BIG)
    payloads = [b"", b"small", big, GOOD]
    async with socketpair() as (_ra, wa, rb, _wb):
        async with asyncio.timeout(DEADLINE):

            async def send() -> None:
                for p in payloads:
                    await write_frame(wa, p)
                wa.write_eof()

            task = asyncio.create_task(send())
            got = [await read_frame(rb) for _ in payloads]
            await task
            assert got == payloads
            with pytest.raises(EndOfFramesError):
                await read_frame(rb)


async def test_asyncio_features_over_a_unix_server(short_dir: Path) -> None:
    """The overload path: an inline item of megabytes crosses in one frame, zero-copy after."""
    item = {"pixel_values": np.random.default_rng(1).random((3, 480, 640), dtype=np.float32)}
    request = [FeatureSpec("cached", REF), FeatureSpec("inline", item, identifier="x")]
    received: list[list[FeatureSpec]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                received.append(unpack_features(await read_frame(reader)))
                await write_frame(writer, b"ok")
        except EndOfFramesError:
            pass
        finally:
            writer.close()

    path = str(short_dir / "s")
    server = await asyncio.start_unix_server(serve, path)
    async with server:
        async with asyncio.timeout(DEADLINE):
            reader, writer = await asyncio.open_unix_connection(path)
            for _ in range(2):
                await write_frame(writer, pack_features(request))
                assert await read_frame(reader) == b"ok"
            writer.close()
            await writer.wait_closed()
    assert len(received) == 2
    for got in received:
        assert_features(request, got)


async def test_asyncio_eof_inside_a_frame() -> None:
    for raw, received, expected in [
        (b"\x05\x00\x00", 3, 8),
        (struct.pack("<Q", 10) + b"abc", 11, 18),
    ]:
        async with socketpair() as (_ra, wa, rb, _wb):
            wa.write(raw)
            wa.write_eof()
            async with asyncio.timeout(DEADLINE):
                with pytest.raises(IncompleteFrameError) as info:
                    await read_frame(rb)
            assert (info.value.received, info.value.expected) == (received, expected)


async def test_asyncio_too_large_is_refused_before_reading_the_payload() -> None:
    async with socketpair() as (ra, wa, rb, wb):
        async with asyncio.timeout(DEADLINE):
            wa.write(struct.pack("<Q", U64) + b"rest")  # a hostile length: no hang, no allocation
            await wa.drain()
            with pytest.raises(FrameTooLargeError):
                await read_frame(rb)
            assert await rb.readexactly(4) == b"rest"
            with pytest.raises(FrameTooLargeError):
                await write_frame(wa, b"x" * 11, max_bytes=10)
            await write_frame(wa, b"after")  # nothing of the refused frame was written
            assert await read_frame(rb, max_bytes=5) == b"after"
            wb.write(encode_frame(b"x" * 6))
            await wb.drain()
            with pytest.raises(FrameTooLargeError):
                await read_frame(ra, max_bytes=5)


async def test_asyncio_stream_limit_does_not_apply() -> None:
    a, b = socket.socketpair()
    reader, w_in = await asyncio.open_connection(sock=a, limit=1024)
    _r_out, writer = await asyncio.open_connection(sock=b)
    try:
        async with asyncio.timeout(DEADLINE):
            payload = os.urandom(200_000)
            task = asyncio.create_task(write_frame(writer, payload))
            assert await read_frame(reader) == payload
            await task
    finally:
        for w in (w_in, writer):
            w.close()
            await w.wait_closed()


# --- frames: anyio streams --------------------------------------------------------------------


class ChunkyByteStream(ByteReceiveStream):
    """A memory byte stream that answers each receive with a random number of bytes."""

    def __init__(self, source: MemoryObjectReceiveStream[bytes], seed: int) -> None:
        self._buffered = BufferedByteReceiveStream(source)
        self._rng = random.Random(seed)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._buffered.receive(self._rng.randint(1, max_bytes))

    async def aclose(self) -> None:
        await self._buffered.aclose()


async def test_anyio_memory_streams() -> None:
    payloads = [b"", b"a", os.urandom(BIG), GOOD, b"z" * 70_000]
    for seed in range(3):
        send, recv = anyio.create_memory_object_stream[bytes](100)
        async with send, recv:
            with anyio.fail_after(DEADLINE):
                for p in payloads:
                    await send_frame(send, p)
                await send.aclose()
                stream = ChunkyByteStream(recv, seed)
                assert [await receive_frame(stream) for _ in payloads] == payloads
                with pytest.raises(EndOfFramesError):
                    await receive_frame(stream)


async def test_anyio_eof_and_limits() -> None:
    send, recv = anyio.create_memory_object_stream[bytes](10)
    async with send, recv:
        stream = BufferedByteReceiveStream(recv)
        await send.send(struct.pack("<Q", 1 << 40))
        with pytest.raises(FrameTooLargeError):
            await receive_frame(stream)
        with pytest.raises(FrameTooLargeError):
            await send_frame(send, b"x" * 11, max_bytes=10)
        await send.send(struct.pack("<Q", 10) + b"abc")
        await send.aclose()
        with anyio.fail_after(DEADLINE), pytest.raises(IncompleteFrameError) as info:
            await receive_frame(stream)
        assert (info.value.received, info.value.expected) == (11, 18)
    with pytest.raises(TypeError):
        await receive_frame(recv)  # type: ignore[arg-type]


async def test_anyio_unix_socket(short_dir: Path) -> None:
    path = short_dir / "a"
    payloads = [os.urandom(BIG), pack_features([FeatureSpec("h", {"a": np.arange(50_000)})])]
    with anyio.fail_after(DEADLINE):
        async with await anyio.create_unix_listener(path) as listener:
            got: list[bytes] = []

            async def accept_one() -> None:
                conn = await listener.accept()
                async with conn:
                    got.extend([await receive_frame(conn) for _ in payloads])
                    with pytest.raises(EndOfFramesError):
                        await receive_frame(conn)

            async with anyio.create_task_group() as tg:
                tg.start_soon(accept_one)
                async with await anyio.connect_unix(path) as client:
                    for p in payloads:
                        await send_frame(client, p)
                    await client.send_eof()
    assert got == payloads
    assert_features(unpack_features(payloads[1]), unpack_features(got[1]))


def test_frame_errors_are_cache_errors() -> None:
    for cls in (FrameError, FrameTooLargeError, IncompleteFrameError, EndOfFramesError, WireError):
        assert ShmCacheError in cls.__bases__  # flat: no family in between
    assert issubclass(WireError, ValueError) and issubclass(FrameTooLargeError, ValueError)
    assert issubclass(IncompleteFrameError, EOFError) and issubclass(EndOfFramesError, EOFError)


def test_frame_parts_join_small_frames_and_leave_large_payloads_uncopied() -> None:
    """Up to 256 KiB in all: one buffer (the peer wakes once); beyond: prefixes and the payloads
    themselves; over ``max_bytes``: ``FrameTooLargeError`` before anything."""
    from aioshmcache.wire import frame_parts

    small = frame_parts([b"ab", b"", b"cde"])
    assert len(small) == 1
    assert FrameDecoder().feed(small[0]) == [b"ab", b"", b"cde"]
    big = bytes(300 << 10)
    parts = frame_parts([b"x", big])
    assert len(parts) == 4 and memoryview(parts[3]).obj is big
    assert FrameDecoder().feed(b"".join(parts)) == [b"x", big]
    with pytest.raises(FrameTooLargeError):
        frame_parts([b"ok", b"too long"], max_bytes=4)


def test_the_plain_form_and_the_bounded_unpack() -> None:
    """``pack_plain_features`` takes references and Nones only; ``unpack_features_any`` reads
    both forms; ``unpack_bounded`` refuses maps and bins unless asked, and what is over its
    bounds."""
    from aioshmcache.errors import WireError
    from aioshmcache.wire import (
        is_plain,
        pack_plain_features,
        unpack_bounded,
        unpack_features_any,
    )

    ref = ShmRef(1, 2, 4096, 7, 1024, 5, 3, 9)
    refs = [FeatureSpec("a", ref), FeatureSpec("b", None, identifier="i")]
    plain = pack_plain_features(refs)
    assert plain is not None and is_plain(plain) and not is_plain(pack_features(refs))
    assert unpack_features_any(plain) == unpack_features_any(pack_features(refs)) == refs
    assert pack_plain_features([FeatureSpec("c", {"x": np.zeros(2)})]) is None
    assert pack_plain_features([FeatureSpec("c", ref, prompt_updates=[1])]) is None
    assert unpack_bounded(msgpack.packb([1, [2]])) == [1, [2]]
    assert unpack_bounded(msgpack.packb({"k": b"v"}), maps=True) == {"k": b"v"}
    for data, maps in [
        (msgpack.packb({"k": 1}), False),
        (msgpack.packb([b"bin"]), False),
        (msgpack.packb({1: 1}), True),
        (msgpack.packb([[]] * 10), False),
    ]:
        with pytest.raises(WireError):
            unpack_bounded(data, maps=maps, max_containers=5)


def test_a_feature_plain_msgpack_cannot_encode_is_left_to_the_serde_form() -> None:
    """A hash or identifier with a lone surrogate does not fit the plain form: it is None there
    (it raised ``UnicodeEncodeError``, which the channel's call let through untyped instead of
    the ``SerdeError`` of :func:`pack_features`, whose errors say why)."""
    from aioshmcache.wire import pack_plain_features

    ref = ShmRef(1, 2, 4096, 7, 1024, 5, 3, 9)
    for features in (
        [FeatureSpec("\ud800", ref)],
        [FeatureSpec("a", None), FeatureSpec("b", ref, identifier="x\udfff")],
    ):
        assert pack_plain_features(features) is None
        with pytest.raises(SerdeError, match="surrogates"):
            pack_features(features)
