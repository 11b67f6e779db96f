"""Every public parser on hostile input: typed errors only, memory bounded by the input's size.

Issue 19, item 4: one ~1 MiB wire message of empty maps or lists, within every length limit, once
cost ~0.5 GiB and seconds of CPU. The parsers covered: ``wire.unpack_features`` and the frame
decoder, ``CacheHandle.from_json`` / ``from_msgpack`` / ``from_dict``, ``coerce_handle``,
``ShmRef.from_dict`` and the serde's payload (structure header) decoder, which reads what shared
memory holds. Each must raise an error of ``aioshmcache.errors`` (or the documented builtin) for
anything it does not accept, and its peak memory (tracemalloc) must stay under a fixed budget
plus a few bytes per input byte. Memory, not time, is asserted (the machine is shared); the
time of the crafted worst cases is measured in ``bench/runs/decode-bounds.md``.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import CacheHandle, FeatureSpec, MsgpackSerde, SerdeError, ShmCacheError, ShmRef
from aioshmcache._types import coerce_handle
from aioshmcache.errors import (
    FrameError,
    FrameTooLargeError,
    IncompleteFrameError,
    InvalidReferenceError,
    WireError,
)
from aioshmcache.wire import FrameDecoder, encode_frame, pack_features, unpack_features

from .test_core_read import Planter, planter_fixture  # noqa: F401 (the fixture)

MiB = 1 << 20
#: what any parser may hold at once, whatever the input: the container budget's worth
#: (``max_containers`` nodes at ~0.5 KiB each) and the interpreter's own noise
BUDGET = 24 * MiB
#: and per input byte (plain values, copied once or twice)
PER_BYTE = 32

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _peak(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak traced memory of ``fn()`` and its result (or the exception it raised)."""
    tracemalloc.start()
    try:
        try:
            out: object = fn()
        except BaseException as exc:  # the caller checks what it was
            out = exc
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def _bounded(nbytes: int, peak: int) -> None:
    assert peak <= BUDGET + PER_BYTE * nbytes, f"{peak / MiB:.1f} MiB for {nbytes} bytes"


def _payload(header: bytes) -> bytes:
    """A serde payload (prefix, structure header, padding) with an empty data section."""
    body = struct.pack("<4sHHIQ", b"ASHM", 1, 0, len(header), 0) + header
    return body + bytes(-len(body) % 64)


def _array32(n: int, element: bytes) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + element * n


N = MiB - 64  # elements of a ~1 MiB header of one-byte values
WORST = {
    "empty maps": _array32(N, b"\x80"),
    "empty lists": _array32(N, b"\x90"),
    "nested one-element lists": _array32(N // 2, b"\x91\x90"),
    "map of empty maps": b"\xdf"
    + struct.pack(">I", 140_000)
    + b"".join(msgpack.packb(f"{i:06d}") + b"\x80" for i in range(140_000)),
    "numpy scalars": _array32(N // 11, msgpack.packb(msgpack.ExtType(2, b"\x03<i4\x01\0\0\0"))),
    "tuple markers": _array32(N // 4, b"\x91\xd4\x03\x00"),
    "zeros": _array32(N, b"\x00"),
    "nils": _array32(N, b"\xc0"),
    "floats": msgpack.packb([1.5] * (N // 9)),
    # 1,000 array headers announcing 65,536 slots each, left open: msgpack allocates ~78 KiB
    # for each before reading an element (~80 MiB), unless the header is checked complete first
    "nested array headers": (b"\xdd" + struct.pack(">I", 1 << 16)) * 1000 + bytes(N - 5000),
}


def _wire_message(inner: bytes) -> bytes:
    """A features message whose one inline item is the msgpack value ``inner``."""
    row = b"\x95" + msgpack.packb("h") + b"\x02" + inner + b"\xc0\x90"
    return _payload(b"\x93" + msgpack.packb("aioshmcache.wire") + b"\x01\x91" + row)


@pytest.mark.parametrize("name", list(WORST))
def test_a_1mib_worst_case_header_costs_tens_of_mib_at_most(name: str) -> None:
    """The crafted worst cases, as a serde payload and as a wire message's inline item."""
    serde = MsgpackSerde(max_header_bytes=4 * MiB)
    for data in (_payload(WORST[name]), _wire_message(WORST[name])):
        assert len(data) > 900_000
        peak, out = _peak(lambda d=data: serde.read(memoryview(d)))  # type: ignore[misc]
        assert not isinstance(out, BaseException) or isinstance(out, SerdeError), repr(out)
        _bounded(len(data), peak)
        assert peak < 64 * MiB
        peak, out = _peak(lambda d=data: unpack_features(d, max_header_bytes=4 * MiB))  # type: ignore[misc]
        assert not isinstance(out, BaseException) or isinstance(out, SerdeError | WireError), out
        _bounded(len(data), peak)


def test_a_few_kib_of_open_array_headers_cost_no_more_than_their_bound() -> None:
    """An incomplete header is refused before msgpack allocates what its arrays announce."""
    for levels in (1000, 1100):  # each announces as many slots as the header has bytes
        header = (b"\xdd" + struct.pack(">I", 5 * levels)) * levels
        for data in (_payload(header), _wire_message(header)):
            peak, out = _peak(lambda d=data: unpack_features(d))  # type: ignore[misc]
            assert isinstance(out, SerdeError), repr(out)
            _bounded(len(data), peak)
            assert peak < 8 * MiB


def test_headers_checked_for_completeness_decode_as_before() -> None:
    """Headers with many ``array 16`` type bytes (checked complete first) decode as before;
    bytes after the object and a truncated one are still refused."""
    serde = MsgpackSerde(max_depth=8)
    deep: Any = [b"\xdc" * 100, *range(19)]  # type bytes of array 16 inside a bin: checked
    for _ in range(7):  # eight levels of 20-element lists: the limit exactly
        deep = [deep, *range(19)]
    wide = {"rows": [[i, f"{i}", b"\xdc\xdd" * 3, 1.5, None] * 4 for i in range(300)]}
    for value in (deep, wide, [[0xDC] * 40] * 50):
        plan = serde.plan(value)
        buf = bytearray(plan.nbytes)
        serde.write(plan, memoryview(buf))
        assert serde.read(memoryview(buf)) == value
    with pytest.raises(SerdeError, match="max_depth"):
        serde.read(memoryview(_payload(msgpack.packb([deep, *range(19)]))))
    packed = msgpack.packb(wide)
    for header in (packed + b"\xc0", packed[:-1]):
        with pytest.raises(SerdeError, match="malformed structure header"):
            serde.read(memoryview(_payload(header)))


def test_empty_maps_and_lists_are_refused_past_max_containers() -> None:
    for element in (b"\x80", b"\x90"):
        with pytest.raises(SerdeError, match="max_containers"):
            unpack_features(_wire_message(_array32(N, element)))
        serde = MsgpackSerde(max_containers=100)
        with pytest.raises(SerdeError, match="max_containers"):
            serde.read(memoryview(_payload(_array32(100, element))))
        assert (
            serde.read(memoryview(_payload(_array32(99, element))))
            == [{} if element == b"\x80" else []] * 99
        )


def test_plan_refuses_what_read_would_refuse_and_accepts_the_limit() -> None:
    """The writer counts as the reader does: no message it makes is refused on arrival."""
    serde = MsgpackSerde(max_containers=8)
    # the outer list, {}, [], a tuple (a list and its marker), a numpy scalar, {"a": [1]}: 8
    at_limit: list[Any] = [{}, [], (1, 2), np.int32(3), {"a": [1]}]
    plan = serde.plan(at_limit)
    buf = bytearray(plan.nbytes)
    serde.write(plan, memoryview(buf))
    back = serde.read(memoryview(buf))
    assert back == [{}, [], (1, 2), np.int32(3), {"a": [1]}]
    for over in ([*at_limit, []], [*at_limit, (1,)], [*at_limit, np.float32(1)]):
        with pytest.raises(SerdeError, match="max_containers"):
            serde.plan(over)
    with pytest.raises(SerdeError, match="max_containers"):
        pack_features([FeatureSpec("h", {"x": [[]] * 40_000})])


def test_plain_lists_and_maps_come_back_fresh_on_every_read() -> None:
    """Compiled into one copy (not a node per element), each read still gets its own."""
    serde = MsgpackSerde()
    value = {"ints": list(range(100)), "map": {"a": 1, "b": "x"}, "t": (1, "y")}
    plan = serde.plan(value)
    buf = bytearray(plan.nbytes)
    serde.write(plan, memoryview(buf))
    first = serde.read(memoryview(buf))
    assert first == value
    first["ints"].append(-1)
    first["map"]["c"] = 2
    assert serde.read(memoryview(buf)) == value


def test_limits_are_validated_and_a_change_forgets_templates() -> None:
    with pytest.raises(ValueError, match="max_containers"):
        MsgpackSerde(max_containers=0)
    serde = MsgpackSerde()
    data = _payload(_array32(50, b"\x80"))
    assert serde.read(memoryview(data)) == [{}] * 50
    serde.max_containers = 10
    with pytest.raises(SerdeError, match="max_containers"):
        serde.read(memoryview(data))


# --- fuzz: every parser, typed errors and bounded memory -----------------------------------------

GOOD_MESSAGE = pack_features(
    [
        FeatureSpec("a", ShmRef(1, 2, 64, 4, 5, 6, 7, 8)),
        FeatureSpec("b", {"x": np.arange(40, dtype=np.float32), "y": [{"z": (1, 2.5)}]}),
        FeatureSpec("c", None, identifier="i", prompt_updates=[{"k": 1}]),
    ]
)
HANDLE = CacheHandle("aioshm-x", 12345, 3)

_plain = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8)
)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # a def, not a lambda: Hypothesis checks that ``extend`` uses its argument by reading its
    # source, which it could not always find for a lambda spread over several lines
    return st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=6)
    )


values = st.recursive(_plain, _nested, max_leaves=30)


def _mutated(base: bytes) -> st.SearchStrategy[bytes]:
    flips = st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(1, 255)), max_size=6)

    def apply(fl: list[tuple[int, int]], cut: int) -> bytes:
        b = bytearray(base)
        for pos, mask in fl:
            b[pos] ^= mask
        return bytes(b[: len(b) - cut])

    return st.builds(apply, flips, st.integers(0, 8))


def _only(data_len: int, fn: Callable[[], object], *typed: type[BaseException]) -> object:
    peak, out = _peak(fn)
    if isinstance(out, BaseException) and not isinstance(out, typed):
        raise AssertionError(f"untyped {out!r}") from out
    _bounded(data_len, peak)
    return out


PAYLOADS = st.one_of(
    st.binary(max_size=2048),
    _mutated(GOOD_MESSAGE),
    st.builds(_payload, st.binary(max_size=2048)),
    st.builds(lambda v: _payload(msgpack.packb(v)), values),
)


@FUZZ
@given(data=PAYLOADS)
def test_fuzz_wire_and_serde_payloads(data: bytes) -> None:
    out = _only(len(data), lambda: unpack_features(data), SerdeError, WireError)
    if not isinstance(out, BaseException):
        assert isinstance(out, list) and all(type(f) is FeatureSpec for f in out)
    _only(len(data), lambda: MsgpackSerde().read(memoryview(data)), SerdeError)


@FUZZ
@given(data=PAYLOADS)
def test_fuzz_payloads_in_shared_memory_on_every_read_path(planter: Planter, data: bytes) -> None:
    """The same payloads planted in a committed chunk and read by a reader on each read path
    (the compiled ``read_item``, its reference, the Python path): the same typed errors or
    values on all, memory bounded as above."""
    planter._open()  # the stores are opened outside the measured call
    _only(len(data), lambda: planter.agree(data), ShmCacheError)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=4096), _mutated(encode_frame(GOOD_MESSAGE))),
    cuts=st.lists(st.integers(0, 4096), max_size=4),
)
def test_fuzz_frame_decoder(data: bytes, cuts: list[int]) -> None:
    def feed() -> None:
        dec = FrameDecoder(max_bytes=1 << 16)
        pos = 0
        for c in [*sorted(cuts), len(data)]:
            for frame in dec.feed(data[pos:c]):
                assert isinstance(frame, bytes)
            pos = max(pos, c)
        dec.close()

    _only(len(data), feed, FrameError, FrameTooLargeError, IncompleteFrameError)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=512),
        st.builds(json.dumps, values),
        st.builds(lambda v: json.dumps({**HANDLE.to_dict(), "name": v}), values),
        st.builds(lambda n, c: c * n, st.integers(1, 4096), st.sampled_from(["[", "{", '{"a":['])),
        st.builds(lambda t, i: t[:i], st.just(HANDLE.to_json()), st.integers(0, 60)),
    )
)
def test_fuzz_handle_json(text: str) -> None:
    out = _only(len(text), lambda: CacheHandle.from_json(text), InvalidReferenceError)
    if not isinstance(out, BaseException):
        assert isinstance(out, CacheHandle)
    raw = text.encode()
    _only(len(raw), lambda: CacheHandle.from_json(raw), InvalidReferenceError)
    if text.strip().startswith("{"):
        _only(len(text), lambda: coerce_handle(text), InvalidReferenceError)
    else:  # a bare segment name, or the documented ValueError for a str that is neither
        _only(len(text), lambda: coerce_handle(text), ValueError)


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=512),
        _mutated(HANDLE.to_msgpack()),
        st.builds(lambda v: msgpack.packb(v), values),
        st.builds(lambda n: b"\x91" * n, st.integers(1, 4096)),
    )
)
def test_fuzz_handle_msgpack(data: bytes) -> None:
    _only(len(data), lambda: CacheHandle.from_msgpack(data), InvalidReferenceError)


@FUZZ
@given(
    obj=st.one_of(
        values,
        st.dictionaries(st.sampled_from(["name", "nonce", "layout_version", "x"]), values),
        st.dictionaries(
            st.sampled_from(
                ["nonce", "epoch", "address", "id", "length", "tag", "position", "seq"]
            ),
            st.one_of(st.integers(-5, 2**65), _plain),
        ),
    )
)
def test_fuzz_handle_and_reference_dicts(obj: Any) -> None:
    _only(0, lambda: CacheHandle.from_dict(obj), InvalidReferenceError)
    _only(0, lambda: ShmRef.from_dict(obj), InvalidReferenceError)
    if isinstance(obj, dict):
        _only(0, lambda: coerce_handle(obj), InvalidReferenceError)
