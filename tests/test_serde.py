"""Tests of `MsgpackSerde`: exact round trips, the byte layout, limits and hostile input."""

from __future__ import annotations

import collections
import enum
import inspect
import mmap
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aioshmcache._serde as serde_module
import aioshmcache._serde.decode as serde_decode
import aioshmcache._serde.encode as serde_encode
import aioshmcache._serde.format as serde_format
from aioshmcache._serde import EncodePlan, MsgpackSerde, Serde
from aioshmcache.errors import SerdeError, ShmCacheError
from aioshmcache.wire import unpack_features

from .test_core_read import Planter, planter_fixture  # noqa: F401 (the fixture)

SERDE = MsgpackSerde()
PREFIX = struct.Struct("<4sHHIQ")  # magic, version, flags, header_len, data_len
ALIGN = 64
GUARD = 0xA5
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ----------------------------------------------------------------------------------


def align64(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Aligned:
    """A 64-byte aligned writable region of exactly ``n`` bytes, followed by guard bytes."""

    def __init__(self, n: int, *, guard: int = 128, fill: int = 0) -> None:
        self._raw = np.full(n + guard + ALIGN, fill, dtype=np.uint8)
        start = (-self._raw.ctypes.data) % ALIGN
        self.region = self._raw[start : start + n + guard]
        self.region[n:] = GUARD
        self.n = n
        self.view = self.region[:n].data
        assert self.region.ctypes.data % ALIGN == 0

    def guard_intact(self) -> bool:
        return bool((self.region[self.n :] == GUARD).all())

    def address(self) -> int:
        return int(self.region.ctypes.data)


def encode(obj: object, serde: MsgpackSerde = SERDE, *, fill: int = 0) -> Aligned:
    plan = serde.plan(obj)
    buf = Aligned(plan.nbytes, fill=fill)
    serde.write(plan, buf.view)
    assert buf.guard_intact(), "write touched bytes past plan.nbytes"
    return buf


def encoded_bytes(obj: object) -> bytes:
    return bytes(encode(obj).view)


def assert_same(expected: object, got: object, path: str = "$") -> None:
    """Exact comparison: same types (tuple vs list, numpy scalar type), dtype, shape and bytes."""
    if isinstance(expected, np.ndarray):
        assert type(got) is np.ndarray, path
        assert got.dtype == expected.dtype and got.dtype.str == expected.dtype.str, path
        assert got.shape == expected.shape, path
        assert got.tobytes() == expected.tobytes(), path
    elif isinstance(expected, np.generic):
        assert type(got) is type(expected), (path, type(got), type(expected))
        e, g = np.asarray(expected), np.asarray(got)
        assert g.dtype == e.dtype, path
        if e.dtype.type in (np.longdouble, np.clongdouble):
            # x87 extended precision: 10 significant bytes padded to 16, and np.asarray of a
            # scalar makes a fresh buffer whose padding is whatever that memory held (a
            # comparison of its bytes failed now and then): compare the values
            assert np.array_equal(g, e), path
        else:
            assert g.tobytes() == e.tobytes(), path
    elif isinstance(expected, float):
        assert type(got) is float, path
        assert struct.pack("<d", got) == struct.pack("<d", expected), path  # NaN, -0.0 exact
    elif isinstance(expected, dict):
        assert type(got) is dict, path
        assert list(got) == list(expected), path
        for k, v in expected.items():
            assert_same(v, got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), (path, type(got))
        assert len(got) == len(expected), path
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_same(e, g, f"{path}[{i}]")
    else:
        assert type(got) is type(expected), (path, type(got), type(expected))
        assert got == expected, path


def iter_arrays(obj: object) -> Iterator[np.ndarray[Any, Any]]:
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_arrays(v)


def read_or_serde_error(data: bytes | memoryview, *, copy: bool = True) -> object:
    """Decode hostile bytes: a SerdeError is fine; any other exception fails the test."""
    try:
        return SERDE.read(memoryview(data), copy=copy)
    except SerdeError:
        return None


def ext_array(
    dtype: str | bytes,
    shape: tuple[int, ...],
    offset: int,
    nbytes: int,
    *,
    flags: int = 0,
    ndim: int | None = None,
) -> msgpack.ExtType:
    dts = dtype.encode() if isinstance(dtype, str) else dtype
    n = len(shape) if ndim is None else ndim
    body = struct.pack(f"<QQBBB{len(shape)}Q", offset, nbytes, flags, n, len(dts), *shape)
    return msgpack.ExtType(1, body + dts)


def craft(
    structure: object = None,
    data: bytes = b"",
    *,
    header: bytes | None = None,
    magic: bytes = b"ASHM",
    version: int = 1,
    flags: int = 0,
    data_len: int | None = None,
) -> bytes:
    """A payload built by hand, with a correct prefix unless told otherwise."""
    h = msgpack.packb(structure, use_bin_type=True) if header is None else header
    pad = align64(PREFIX.size + len(h)) - PREFIX.size - len(h)
    dlen = len(data) if data_len is None else data_len
    return PREFIX.pack(magic, version, flags, len(h), dlen) + h + bytes(pad) + data


# --- strategies -------------------------------------------------------------------------------

numeric_dtypes = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64))
    | hnp.complex_number_dtypes(endianness="?")
)
other_dtypes = (
    hnp.datetime64_dtypes(endianness="?")
    | hnp.timedelta64_dtypes(endianness="?")
    | hnp.unicode_string_dtypes(endianness="?", min_len=1, max_len=6)
    | hnp.byte_string_dtypes(min_len=1, max_len=6)
)
all_dtypes = numeric_dtypes | other_dtypes
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def arrays(draw: st.DrawFn, dtypes: st.SearchStrategy[Any] = all_dtypes) -> np.ndarray[Any, Any]:
    """Arrays of every supported dtype, including 0-d, zero-size and non-contiguous views."""
    arr: np.ndarray[Any, Any] = draw(hnp.arrays(draw(dtypes), draw(shapes)))
    how = draw(st.sampled_from(["as-is", "transpose", "step", "reverse", "fortran"]))
    if how == "transpose":
        arr = arr.T
    elif how == "step" and arr.ndim:
        arr = arr[..., ::2]
    elif how == "reverse" and arr.ndim:
        arr = arr[::-1]
    elif how == "fortran":
        arr = np.asfortranarray(arr)
    return arr


scalars = hnp.arrays(all_dtypes, ()).map(lambda a: a[()])
leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.binary(min_size=1000, max_size=1100)  # around the inline / data-section threshold
    | arrays()
    | scalars
)
keys = st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
    ),
    max_leaves=10,
)
items = st.dictionaries(st.text(max_size=8), values, max_size=4)


# --- round trips ------------------------------------------------------------------------------


@FAST
@given(obj=values)
def test_round_trip_copy(obj: object) -> None:
    buf = encode(obj)
    got = SERDE.read(buf.view, copy=True)
    assert_same(obj, got)
    for arr in iter_arrays(got):
        assert arr.flags.writeable and arr.flags.c_contiguous
    buf.region[:] = 0xFF  # the copies own their memory
    assert_same(obj, got)


@FAST
@given(obj=values)
def test_round_trip_view(obj: object) -> None:
    buf = encode(obj)
    got = SERDE.read(buf.view, copy=False)
    assert_same(obj, got)
    base = buf.address()
    for arr in iter_arrays(got):
        assert not arr.flags.writeable
        if arr.size:
            address = arr.__array_interface__["data"][0]
            assert base <= address < base + buf.n  # a view into the buffer, not a copy
            assert (address - base) % ALIGN == 0
            with pytest.raises(ValueError):
                arr.flags.writeable = True
            with pytest.raises(ValueError):
                arr.reshape(-1)[0] = arr.reshape(-1)[0]


@FAST
@given(arr=arrays())
def test_single_array_exact(arr: np.ndarray[Any, Any]) -> None:
    for copy in (True, False):
        got = SERDE.read(encode({"x": arr}).view, copy=copy)
        assert isinstance(got, dict)
        assert_same(arr, got["x"])
        np.testing.assert_array_equal(got["x"], arr)  # value equality too (NaN-safe)


@pytest.mark.slow
@FAST
@given(obj=items)
def test_nbytes_exact_and_deterministic(obj: dict[str, object]) -> None:
    plan = SERDE.plan(obj)
    assert isinstance(plan, EncodePlan)
    a = Aligned(plan.nbytes, fill=0x00)
    b = Aligned(plan.nbytes + 256, fill=0xEE)  # larger, dirty buffer: same bytes, padding zeroed
    SERDE.write(plan, a.view)
    SERDE.write(plan, b.view)
    assert a.guard_intact()
    assert bytes(a.view) == bytes(b.view[: plan.nbytes])
    assert (b.region[plan.nbytes : plan.nbytes + 256] == 0xEE).all()
    # A plan can be written again, and a second plan of the same value is the same.
    assert bytes(encode(obj).view) == bytes(a.view)
    assert_same(obj, SERDE.read(a.view))


@pytest.mark.slow
@FAST
@given(
    first=st.dictionaries(st.text(max_size=6), arrays(), max_size=4),
    data=st.data(),
)
def test_flat_item_header_cached_by_shape(first: dict[str, Any], data: st.DataObject) -> None:
    """A flat item whose shape was planned before reuses the header: the very same bytes as a
    fresh walk, and the new item's own arrays (not the first one's)."""
    serde = MsgpackSerde()
    encode(first, serde)  # plans and remembers the shape
    # same keys, dtypes and shapes, other values (a non-contiguous layout is still the same shape)
    second = {
        k: data.draw(hnp.arrays(v.dtype, v.shape), label=f"values of {k!r}")
        for k, v in first.items()
    }
    assert bytes(encode(second, serde).view) == bytes(encode(second, MsgpackSerde()).view)
    assert_same(second, serde.read(encode(second, serde).view))
    # another shape under the same keys gets its own header
    if first:
        k = next(iter(first))
        other = dict(second)
        other[k] = np.zeros((*first[k].shape, 2), dtype=first[k].dtype)
        assert bytes(encode(other, serde).view) == bytes(encode(other, MsgpackSerde()).view)


def test_flat_item_cached_header_keeps_the_limits() -> None:
    """A header remembered under roomier limits is not used past tighter ones."""
    serde = MsgpackSerde(max_arrays=2)
    item = {"a": np.zeros((1, 3)), "b": np.ones(2, np.int8)}
    encode(item, serde)
    serde.max_arrays = 1
    with pytest.raises(SerdeError, match="max_arrays"):
        serde.plan(item)
    serde.max_arrays, serde.max_ndim = 2, 1
    with pytest.raises(SerdeError, match="max_ndim"):
        serde.plan(item)
    serde.max_ndim, serde.max_header_bytes = 32, 8
    with pytest.raises(SerdeError, match="max_header_bytes"):
        serde.plan(item)


def test_array_offsets_aligned() -> None:
    odd = {
        "a": np.arange(3, dtype=np.uint8),
        "b": np.arange(5, dtype=np.float64),
        "c": [np.ones((3, 7), np.float16), b"z" * 5000, np.zeros(0, np.int32)],
        "d": np.array(True),
        "e": np.arange(33, dtype=">i2")[::3],
    }
    buf = encode(odd)
    got = SERDE.read(buf.view, copy=False)
    assert_same(odd, got)
    arrays_ = [a for a in iter_arrays(got) if a.size]
    assert len(arrays_) == 5
    for arr in arrays_:
        assert (arr.__array_interface__["data"][0] - buf.address()) % ALIGN == 0
    # The prefix states the layout: data section at align64(20 + header), exact total.
    magic, version, flags, hlen, data_len = PREFIX.unpack_from(buf.view)
    assert (magic, version, flags) == (b"ASHM", 1, 0)
    assert align64(PREFIX.size + hlen) + data_len == buf.n


def test_specific_types() -> None:
    class Point(NamedTuple):
        x: int
        y: int

    class Color(enum.IntEnum):
        RED = 1

    class Key(str):
        pass

    class Sub(np.ndarray):
        pass

    obj: dict[Any, Any] = {
        "tuple": (1, 2, (3,), ()),
        "list": [1, [2], []],
        "empty": {},
        "bytearray": bytearray(b"ab"),
        "memoryview": memoryview(b"cd"),
        "big_bytearray": bytearray(range(256)) * 20,
        "big_memoryview": memoryview(bytes(3000)),
        "strided_memoryview": memoryview(bytes(range(200)))[::3],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "named": Point(1, 2),
        "enum": Color.RED,
        Key("key"): 1.5,
        b"\x00bytes-key": None,
        np.str_("np-key"): 1,
        "f32": np.float32(1.5),
        "f16": np.float16(-0.0),
        "c64": np.complex64(1 + 2j),
        "i8": np.int8(-3),
        "u64": np.uint64(2**64 - 1),
        "bool_": np.bool_(True),
        "str_": np.str_("héllo"),
        "bytes_": np.bytes_(b"x\x00y"),
        "dt": np.datetime64("2024-01-02T03:04", "m"),
        "td": np.timedelta64(5, ("s", 25)),
        "nat": np.datetime64("NaT"),
        "longdouble": np.arange(3, dtype=np.longdouble),
        "clongdouble": np.clongdouble(1 + 1j),
        "zero_d": np.array(2.5, dtype=">f8"),
        "zero_size": np.zeros((3, 0, 2), dtype=np.complex128),
        "broadcast": np.broadcast_to(np.arange(4.0), (3, 4)),
        "u_array": np.array(["a", "héllo", ""]),
        "s_array": np.array([b"a", b"\x00b"]),
        "subclass": np.arange(4).view(Sub),
        "ints": [0, -(2**63), 2**64 - 1, True, False],
    }
    got = SERDE.read(encode(obj).view)
    assert isinstance(got, dict)
    assert got["tuple"] == (1, 2, (3,), ()) and type(got["tuple"][2]) is tuple
    assert got["list"] == [1, [2], []] and type(got["list"][1]) is list
    assert got["empty"] == {}
    for k in ("bytearray", "memoryview", "big_bytearray", "big_memoryview", "strided_memoryview"):
        assert type(got[k]) is bytes and got[k] == bytes(obj[k])
    assert type(got["ordered"]) is dict and list(got["ordered"].items()) == [("b", 1), ("a", 2)]
    assert type(got["named"]) is tuple and got["named"] == (1, 2)
    assert type(got["enum"]) is int and got["enum"] == 1
    assert type(next(k for k in got if k == "key")) is str
    assert got[b"\x00bytes-key"] is None
    for k in ("f32", "f16", "c64", "i8", "u64", "bool_", "str_", "bytes_", "dt", "td", "nat"):
        assert_same(obj[k], got[k], k)
    assert_same(obj["longdouble"], got["longdouble"])
    assert_same(obj["clongdouble"], got["clongdouble"])
    assert_same(obj["zero_d"], got["zero_d"])
    assert_same(obj["zero_size"], got["zero_size"])
    assert_same(np.ascontiguousarray(obj["broadcast"]), got["broadcast"])
    assert_same(obj["u_array"], got["u_array"])
    assert_same(obj["s_array"], got["s_array"])
    assert type(got["subclass"]) is np.ndarray
    np.testing.assert_array_equal(got["subclass"], np.arange(4))
    assert got["np-key"] == 1 and type(next(k for k in got if k == "np-key")) is str
    assert got["ints"] == [0, -(2**63), 2**64 - 1, True, False]
    assert [type(v) for v in got["ints"]] == [int, int, int, bool, bool]


def test_top_level_values() -> None:
    for obj in (None, 1, "s", b"b", [np.arange(3)], (np.float64(2.0),), np.arange(5)):
        for copy in (True, False):
            assert_same(obj, SERDE.read(encode(obj).view, copy=copy))


def test_non_contiguous_written_contiguous() -> None:
    base = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    for view in (base.T, base[:, ::2, 1::3], base[::-1, :, ::-2], np.asfortranarray(base)):
        got = SERDE.read(encode({"v": view}).view, copy=False)
        assert isinstance(got, dict)
        out = got["v"]
        assert out.flags.c_contiguous and out.shape == view.shape
        np.testing.assert_array_equal(out, view)


def test_plan_copies_no_array_bytes() -> None:
    # 4 TiB logical array of one element: plan must size it without materializing anything.
    huge = np.broadcast_to(np.float32(1.0), (1 << 20, 1 << 20))
    plan = SERDE.plan({"huge": huge})
    assert plan.nbytes > huge.nbytes


def test_large_array_and_bytes() -> None:
    obj = {"a": np.random.default_rng(0).random((512, 1024)), "b": bytes(range(256)) * 4096}
    for copy in (True, False):
        assert_same(obj, SERDE.read(encode(obj).view, copy=copy))


def test_read_accepts_bytes_and_readonly_views() -> None:
    data = encoded_bytes({"a": np.arange(10)})
    for source in (data, bytearray(data), memoryview(data), memoryview(bytearray(data))):
        got = SERDE.read(source, copy=False)  # type: ignore[arg-type]
        assert isinstance(got, dict)
        np.testing.assert_array_equal(got["a"], np.arange(10))
        assert not got["a"].flags.writeable


def test_protocol_and_repr() -> None:
    assert isinstance(SERDE, Serde)
    plan = SERDE.plan({"a": np.zeros(3)})
    assert isinstance(plan, EncodePlan)
    assert "nbytes" in repr(plan)
    assert "MsgpackSerde(" in repr(SERDE)
    assert serde_module.__all__ == ["EncodePlan", "MsgpackPlan", "MsgpackSerde", "Serde"]
    assert issubclass(SerdeError, ShmCacheError) and issubclass(SerdeError, ValueError)


def test_threads_share_one_serde() -> None:
    objs = [{"i": i, "a": np.full(i + 1, i, np.int32), "t": (str(i),) * i} for i in range(8)]
    expected = [encoded_bytes(o) for o in objs]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                for o, e in zip(objs, expected, strict=True):
                    assert bytes(encode(o).view) == e
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_no_pickle_no_torch_import() -> None:
    for module in (serde_module, serde_format, serde_encode, serde_decode):  # the whole package
        source = inspect.getsource(module)
        assert "import pickle" not in source and "pickle." not in source
    code = (
        "import sys, numpy as np\n"
        "from aioshmcache._serde import MsgpackSerde\n"
        "s = MsgpackSerde()\n"
        "p = s.plan({'a': np.zeros(3)})\n"
        "b = memoryview(bytearray(p.nbytes))\n"
        "s.write(p, b)\n"
        "s.read(b)\n"
        "assert 'torch' not in sys.modules, 'serde imported torch'\n"
    )
    root = Path(serde_module.__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env, cwd=root)


# --- encode refusals --------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, "a"], dtype=object),
        np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]),
        np.zeros(2, dtype="V4"),
        np.void(b"abcd"),
        np.ma.masked_array([1, 2], mask=[False, True]),
        {1: "int key"},
        {(1, 2): "tuple key"},
        {None: 1},
        2**64,
        -(2**63) - 1,
        1 + 2j,
        {1, 2},
        frozenset(),
        Opaque(),
        Opaque,
        print,
        "\udc80",
        msgpack.Timestamp(0),
        range(3),
        [1, [2, [3, {"x": 2**70}]]],
    ],
    ids=repr,
)
def test_encode_refuses(bad: object) -> None:
    with pytest.raises(SerdeError):
        SERDE.plan({"k": bad})
    with pytest.raises(SerdeError):
        SERDE.plan(bad)


def test_a_numpy_text_scalar_ending_in_nul_is_refused_not_cut() -> None:
    """numpy's fixed-width text drops trailing NULs: ``np.str_("a\\0")`` (2 characters) was
    written as ``<U2`` and read back as ``np.str_("a")``, another value. Refused instead; a
    NUL elsewhere, and the empty scalar, round-trip exactly."""
    for bad in (np.str_("a\x00"), np.str_("\x00"), np.bytes_(b"ab\x00\x00"), np.bytes_(b"\x00")):
        with pytest.raises(SerdeError, match="NUL"):
            SERDE.plan(bad)
        with pytest.raises(SerdeError, match="NUL"):
            SERDE.plan({"k": [bad]})
    for good in (np.str_("a\x00b"), np.bytes_(b"\x00b"), np.str_(""), np.bytes_(b"")):
        got = SERDE.read(encode({"k": good}).view)
        assert isinstance(got, dict)
        assert type(got["k"]) is type(good) and got["k"] == good and len(got["k"]) == len(good)


def test_encode_refuses_key_collision() -> None:
    class Key(str):  # distinct from "a" as a dict key, "a" once converted to str
        def __eq__(self, other: object) -> bool:
            return self is other

        def __hash__(self) -> int:
            return id(self)

    with pytest.raises(SerdeError, match="collide"):
        SERDE.plan({"a": np.zeros(1), Key("a"): np.zeros(2)})


def test_encode_limits() -> None:
    deep: list[object] = []
    node = deep
    for _ in range(100):
        child: list[object] = []
        node.append(child)
        node = child
    with pytest.raises(SerdeError, match="max_depth"):
        SERDE.plan(deep)
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(SerdeError):
        SERDE.plan(cyclic)
    with pytest.raises(SerdeError, match="max_arrays"):
        MsgpackSerde(max_arrays=2).plan([np.zeros(1)] * 3)
    with pytest.raises(SerdeError, match="max_arrays"):
        MsgpackSerde(max_arrays=1).plan([b"x" * 5000, b"y" * 5000])
    with pytest.raises(SerdeError, match="max_ndim"):
        MsgpackSerde(max_ndim=2).plan(np.zeros((1, 1, 1)))
    with pytest.raises(SerdeError, match="max_header_bytes"):
        MsgpackSerde(max_header_bytes=100).plan("x" * 200)
    with pytest.raises(SerdeError, match="max_depth"):
        MsgpackSerde(max_depth=2).plan({"a": [{"b": 1}]})
    assert MsgpackSerde(max_depth=3).plan({"a": [{"b": 1}]}).nbytes > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_header_bytes": 0},
        {"max_header_bytes": 1 << 32},
        {"max_arrays": -1},
        {"max_ndim": 65},
        {"max_depth": 0},
        {"max_depth": 10_000},
        {"max_ndim": 2.5},
        {"max_arrays": True},
    ],
)
def test_constructor_validates(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MsgpackSerde(**kwargs)


def test_write_refuses() -> None:
    plan = SERDE.plan({"a": np.zeros(10)})
    with pytest.raises(SerdeError):
        SERDE.write(plan, memoryview(bytearray(plan.nbytes - 1)))
    with pytest.raises(SerdeError):
        SERDE.write(plan, memoryview(bytes(plan.nbytes)))

    class Foreign:
        nbytes = 10

    with pytest.raises(SerdeError):
        SERDE.write(Foreign(), memoryview(bytearray(10)))


# --- hostile input ----------------------------------------------------------------------------

VALID_SAMPLES = [
    {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [1, "x", (2.5, None)]},
    {"img": np.zeros((4, 4, 3), np.uint8), "s": np.float16(1.5), "blob": b"q" * 1500},
    (np.array([], dtype=">i4"), {b"k": np.array(True)}, np.array(["ab", "c"])),
]
VALID_ENCODINGS = [encoded_bytes(o) for o in VALID_SAMPLES]


def test_crafted_helper_matches_format() -> None:
    data = np.arange(4, dtype="<f4").tobytes()
    got = SERDE.read(memoryview(craft({"a": ext_array("<f4", (4,), 0, 16)}, data)))
    assert isinstance(got, dict)
    assert_same(np.arange(4, dtype="<f4"), got["a"])


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600))
def test_random_bytes(data: bytes) -> None:
    with pytest.raises(SerdeError):
        SERDE.read(memoryview(data))


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=400), hlen=st.integers(0, 500), dlen=st.integers(0, 2**64 - 1))
def test_random_bytes_behind_a_valid_prefix(body: bytes, hlen: int, dlen: int) -> None:
    for data in (PREFIX.pack(b"ASHM", 1, 0, hlen, dlen) + body, craft(header=body)):
        read_or_serde_error(data)
        read_or_serde_error(data, copy=False)


hostile_ext = st.builds(msgpack.ExtType, st.integers(0, 6), st.binary(max_size=64)) | st.builds(
    ext_array,
    st.sampled_from(["<f4", "|u1", ">i8", "|b1", "<U2", "|O", "<c8", "<M8[s]", "V4", "f4"]),
    st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 8), max_size=4).map(tuple),
    st.integers(0, 2**64 - 1) | st.sampled_from([0, 64, 128, 1, 63]),
    st.integers(0, 2**64 - 1) | st.integers(0, 256),
    flags=st.integers(0, 255) | st.just(0),
)
hostile_structure = st.recursive(
    st.none()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | hostile_ext,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(structure=hostile_structure, data=st.binary(max_size=300))
def test_random_structures_with_ext_records(structure: object, data: bytes) -> None:
    payload = craft(structure, data)
    got = read_or_serde_error(payload)
    view = read_or_serde_error(payload, copy=False)
    if got is not None:
        assert type(view) is type(got)


@settings(max_examples=200, deadline=None)
@given(structure=hostile_structure, data=st.binary(max_size=300))
def test_random_structures_read_alike_on_every_read_path(
    planter: Planter, structure: object, data: bytes
) -> None:
    """The hostile payloads above, in a committed chunk: every read path of a reader (the
    compiled ``read_item``, its reference, the Python path) gives the same value or error."""
    planter.agree(craft(structure, data))


@settings(max_examples=200, deadline=None)
@given(which=st.sampled_from(range(len(VALID_ENCODINGS))), cut=st.integers(0, 10**6))
def test_truncated(which: int, cut: int) -> None:
    data = VALID_ENCODINGS[which]
    cut %= len(data)
    with pytest.raises(SerdeError):
        SERDE.read(memoryview(data[:cut]))
    with pytest.raises(SerdeError):  # trailing bytes are refused too
        SERDE.read(memoryview(data + b"\x00"))


def test_every_truncation() -> None:
    data = VALID_ENCODINGS[0]
    for cut in range(len(data)):
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(data[:cut]))


@settings(max_examples=400, deadline=None)
@given(
    which=st.sampled_from(range(len(VALID_ENCODINGS))),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=3),
)
def test_bit_flips(which: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID_ENCODINGS[which])
    for pos, bit in flips:
        # Mostly the prefix and header, where flips matter; sometimes the data section.
        pos %= len(data) if pos % 4 == 0 else min(len(data), 256)
        data[pos] ^= 1 << bit
    for copy in (True, False):
        read_or_serde_error(bytes(data), copy=copy)


def test_pickle_and_foreign_msgpack() -> None:
    for blob in (
        pickle.dumps({"a": 1}),
        pickle.dumps({"a": np.arange(3)}),
        pickle.dumps(VALID_SAMPLES[0]),
        msgpack.packb({"a": 1}),
        msgpack.packb([b"ASHM", 1, 2]),
        b"",
        b"ASHM",
    ):
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(blob))
    good = craft({"a": 1})
    assert SERDE.read(memoryview(good)) == {"a": 1}
    with pytest.raises(SerdeError, match="magic"):
        SERDE.read(memoryview(craft({"a": 1}, magic=b"ASHN")))
    with pytest.raises(SerdeError, match="version"):
        SERDE.read(memoryview(craft({"a": 1}, version=2)))
    with pytest.raises(SerdeError, match="version"):
        SERDE.read(memoryview(craft({"a": 1}, flags=1)))


def test_header_level_refusals() -> None:
    one = msgpack.packb(1)
    cases = {
        "empty header": craft(header=b""),
        "trailing bytes in header": craft(header=one + one),
        "truncated header": craft(header=msgpack.packb([1, 2, 3])[:-1]),
        "int map key": craft({1: 2}),
        "ext map key": craft(header=b"\x81" + msgpack.packb(msgpack.ExtType(3, b"")) + one),
        "timestamp": craft(msgpack.Timestamp(1)),
        "unknown ext": craft(msgpack.ExtType(9, b"")),
        "misplaced tuple marker": craft([1, msgpack.ExtType(3, b"")]),
        "lone tuple marker": craft(msgpack.ExtType(3, b"")),
        "tuple marker with data": craft([msgpack.ExtType(3, b"x"), 1]),
        "invalid utf-8": craft(header=b"\xa2\xff\xfe"),
        "header over limit": craft("x" * 100),
        "declared data missing": craft({"a": 1}, data_len=64),
        "unreferenced data": craft({"a": 1}, b"\x00" * 64),
        "bytes descriptor short": craft(msgpack.ExtType(4, b"\x00" * 15)),
        "scalar empty": craft(msgpack.ExtType(2, b"")),
        "scalar short": craft(msgpack.ExtType(2, b"\x03<f4\x00")),
        "scalar long": craft(msgpack.ExtType(2, b"\x03<f4\x00\x00\x00\x00\x00")),
        "scalar object": craft(msgpack.ExtType(2, b"\x02|O" + bytes(8))),
        "scalar bad dlen": craft(msgpack.ExtType(2, b"\xff<f4")),
    }
    small = MsgpackSerde(max_header_bytes=64)
    for name, payload in cases.items():
        serde = small if name == "header over limit" else SERDE
        with pytest.raises(SerdeError):
            serde.read(memoryview(payload))
            pytest.fail(name)
    assert SERDE.read(memoryview(craft(msgpack.ExtType(2, b"\x03<f4" + bytes(4))))) == 0.0


def test_a_timestamp_record_is_refused_anywhere_in_the_header(planter: Planter) -> None:
    """msgpack unpacks a timestamp record (ext code -1) into a ``msgpack.Timestamp`` without
    calling the ext hook: refused at the top level, it was read as a value inside a list, a
    tuple or a map, which the format has no such value for (and the wire handed it out)."""
    ts = msgpack.Timestamp(1, 2)
    tup = msgpack.ExtType(3, b"")
    for structure in (
        [ts],
        [1, "a", ts],
        {"a": ts},
        {"a": 1, "b": ts},
        [tup, ts],
        [tup, [ts]],
        {"a": [ts, 1]},
        {"x": ext_array("<i8", (1,), 0, 8), "t": ts},
    ):
        data = bytes(8) if isinstance(structure, dict) and "x" in structure else b""
        payload = craft(structure, data)
        for copy in (True, False):
            with pytest.raises(SerdeError, match="Timestamp"):
                SERDE.read(memoryview(payload), copy=copy)
        results = planter.agree(payload)  # every read path of a store refuses it alike
        assert results["python"][1:3] == ("error", SerdeError), results
    message = ["aioshmcache.wire", 1, [["h", 2, {"x": ts}, None, []]]]
    with pytest.raises(SerdeError, match="Timestamp"):
        unpack_features(craft(message))


def test_text_with_a_code_point_past_unicode_is_refused(planter: Planter) -> None:
    """A ``U`` array or numpy str scalar is UCS-4 code units: one above U+10FFFF made numpy hand
    out a str CPython cannot hold (``ord`` raised ``SystemError``, ``encode`` wrote invalid
    UTF-8) instead of a ``SerdeError``; valid text still reads, on every read path."""
    bad = (0x110000).to_bytes(4, "little")
    for value, code in (
        ({"t": np.array(["ab", "cd"])}, "a"),  # the flat item
        ({"t": np.array(["ab", "cd"], dtype=">U2"), "n": 1}, "a"),
        ({"t": np.array("ab")}, "a"),  # 0-d
        ({"t": [np.array([["xy"]])]}, "y"),
        ({"t": np.str_("ab")}, "a"),  # a scalar record of the header
    ):
        good = encoded_bytes(value)
        for copy in (True, False):
            for _ in range(2):  # compiled, then its template
                assert_same(value, SERDE.read(memoryview(good), copy=copy))
        be = any(isinstance(a, np.ndarray) and a.dtype.byteorder == ">" for a in value.values())
        unit = code.encode("utf-32-be" if be else "utf-32-le")
        at = good.index(unit)
        payload = good[:at] + (bad[::-1] if be else bad) + good[at + 4 :]
        for copy in (True, False):
            for _ in range(2):
                with pytest.raises(SerdeError, match="code point"):
                    SERDE.read(memoryview(payload), copy=copy)
        results = planter.agree(payload)
        assert results["python"][1:3] == ("error", SerdeError), results


def test_deep_nesting() -> None:
    for depth in (65, 100, 600, 5000):
        header = b"\x91" * depth + b"\xc0"  # [[[...[None]...]]]
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(craft(header=header)))
        header = b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ...}}
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(craft(header=header)))
    assert SERDE.read(memoryview(craft(header=b"\x91" * 64 + b"\xc0"))) is not None


def test_huge_declared_sizes() -> None:
    big = 2**64 - 1
    cases = [
        ext_array("<f4", (2**40, 2**40), 0, 16),
        ext_array("<f4", (2**62,), 0, 2**64 - 8),
        ext_array("<f4", (0, 2**63), 0, 0),
        ext_array("<f4", (0, 2**40, 2**40), 0, 0),
        ext_array("<f4", (big,), 0, big),
        ext_array("<f4", (4,), 0, big),
        ext_array("|u1", (2**60,), 0, 2**60),
        ext_array("<f4", (1,) * 33, 0, 4),  # ndim > max_ndim
        ext_array("<f4", (1,) * 64, 0, 4),
        ext_array("<f4", (4,), 0, 16, ndim=200),  # ndim byte disagrees with the body
        ext_array("<f4", (4,), 0, 16, ndim=0),
        msgpack.ExtType(1, b"\x00" * 18),
        msgpack.ExtType(4, struct.pack("<QQ", 0, big)),
    ]
    for rec in cases:
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(craft({"a": rec}, bytes(64))))
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(craft([rec], bytes(64), data_len=2**63)))


def test_offsets_checked() -> None:
    data = bytes(256)
    a16 = np.zeros(4, "<f4").tobytes()

    def payload(*recs: msgpack.ExtType, data: bytes = data) -> memoryview:
        return memoryview(craft(list(recs), data))

    ok = SERDE.read(payload(ext_array("<f4", (4,), 0, 16), ext_array("<f4", (4,), 64, 16),
                            data=bytes(64) + a16))  # fmt: skip
    assert isinstance(ok, list) and len(ok) == 2
    bad = [
        # overlapping: both at offset 0
        (ext_array("<f4", (4,), 0, 16), ext_array("<f4", (4,), 0, 16)),
        # unaligned
        (ext_array("<f4", (4,), 4, 16),),
        (ext_array("<f4", (4,), 1, 16),),
        # a gap (non-canonical), out of range, before the data section (negative impossible)
        (ext_array("<f4", (4,), 128, 16),),
        (ext_array("<f4", (4,), 256, 16),),
        (ext_array("<f4", (4,), 2**64 - 64, 16),),
        # order reversed
        (ext_array("<f4", (4,), 64, 16), ext_array("<f4", (4,), 0, 16)),
        # nbytes disagrees with shape
        (ext_array("<f4", (4,), 0, 15),),
        (ext_array("<f4", (4,), 0, 17),),
        # bytes descriptor overlapping an array
        (ext_array("|u1", (64,), 0, 64), msgpack.ExtType(4, struct.pack("<QQ", 32, 32))),
        # unknown flags, torch-only flag combinations
        (ext_array("<f4", (4,), 0, 16, flags=4),),
        (ext_array("<u2", (4,), 0, 8, flags=2),),
        (ext_array("<f4", (4,), 0, 16, flags=3),),
        (ext_array(">f4", (4,), 0, 16, flags=1),),
        (ext_array("<U1", (4,), 0, 16, flags=1),),
    ]
    for recs in bad:
        with pytest.raises(SerdeError):
            SERDE.read(payload(*recs, data=bytes(64) + a16))
        with pytest.raises(SerdeError):
            SERDE.read(payload(*recs), copy=False)


BAD_DTYPES = [
    "O", "|O", "|O8", "<O8", "O8", "object", "f4,i4", "(2,)f4", "<f4,(2,)i4", "V8", "|V8", "|V0",
    "a5", "|a5", "<U0", "|S0", "U", "S", "M8[xyz]", "<M8[]", "<i8[ns]", "=f4", "f4", "float32",
    "<f3", "<f4\x00", "<b1", "|f4", "<S5", " <f4", "<f4 ", "<c4", "<i3", "<u16", "<f99",
    "<M4", "<m8[0s]", "<M8[01s]", "|b2", "<?", "?", "<e", "d", "<U99999999999", "<U-1",
    "<T", "<T16", "<O\n", "<f\u00e94", "\xff", "", "<M8[s]\x00", "[('a','<f4')]",
]  # fmt: skip


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_bad_dtype_strings(dtype: str) -> None:
    raw = dtype.encode("utf-8")
    for nbytes in (0, 4, 8, 16, 32, 64):
        rec = ext_array(raw, (1,), 0, nbytes)
        with pytest.raises(SerdeError):
            SERDE.read(memoryview(craft([rec], bytes(nbytes))))
    scalar = msgpack.ExtType(2, bytes([len(raw)]) + raw + bytes(8))
    with pytest.raises(SerdeError):
        SERDE.read(memoryview(craft(scalar)))


@settings(max_examples=200, deadline=None)
@given(dtype=st.binary(max_size=12) | st.text(max_size=10).map(str.encode))
def test_fuzzed_dtype_strings(dtype: bytes) -> None:
    for nbytes in (0, 4, 16):
        payload = craft([ext_array(dtype, (1,), 0, nbytes)], bytes(nbytes))
        got = read_or_serde_error(payload)
        if got is not None:  # only a canonical, allowed dtype may decode
            assert isinstance(got, list)
            dt = got[0].dtype
            assert dt.str.encode() == dtype and dt.kind in "biufcSUmM" and not dt.hasobject


def test_decode_limits() -> None:
    many = encoded_bytes([np.zeros(1)] * 5)
    with pytest.raises(SerdeError, match="max_arrays"):
        MsgpackSerde(max_arrays=4).read(memoryview(many))
    dims = encoded_bytes(np.zeros((1, 1, 1)))
    with pytest.raises(SerdeError, match="max_ndim"):
        MsgpackSerde(max_ndim=2).read(memoryview(dims))
    nested = encoded_bytes([[[1]]])
    with pytest.raises(SerdeError, match="max_depth"):
        MsgpackSerde(max_depth=2).read(memoryview(nested))
    long_header = encoded_bytes({"s": "x" * 1000})
    with pytest.raises(SerdeError, match="max_header_bytes"):
        MsgpackSerde(max_header_bytes=512).read(memoryview(long_header))


def test_decoded_view_keeps_buffer_contract() -> None:
    buf = encode({"a": np.arange(8, dtype=np.int64)})
    got = SERDE.read(buf.view, copy=False)
    assert isinstance(got, dict)
    buf.region[buf.n - 8 : buf.n] = 0  # the view sees later writes: it is zero-copy
    assert got["a"][-1] == 0


def test_write_refuses_odd_buffers() -> None:
    plan = SERDE.plan({"a": np.arange(10)})
    big = bytearray(plan.nbytes * 2)
    with pytest.raises(SerdeError):
        SERDE.write(plan, memoryview(big)[::2])  # not contiguous
    with pytest.raises(SerdeError):
        SERDE.write(plan, 12345)  # type: ignore[arg-type]
    SERDE.write(plan, memoryview(big).cast("I"))  # any contiguous format is taken as bytes
    assert_same({"a": np.arange(10)}, SERDE.read(memoryview(big)[: plan.nbytes]))
    assert not any(big[plan.nbytes :])


def test_copy_read_leaves_no_buffer_export() -> None:
    """After ``read(copy=True)`` — success or failure — the caller can release its view."""
    for obj in VALID_SAMPLES:
        view = encode(obj).view
        SERDE.read(view, copy=True)
        view.release()  # BufferError if anything still exported it
    a16 = np.arange(4, dtype="<f4").tobytes()
    bad = craft([ext_array("<f4", (4,), 0, 16), ext_array("|O", (4,), 64, 32)], a16 + bytes(80))
    view = memoryview(bytearray(bad))
    with pytest.raises(SerdeError):
        SERDE.read(view, copy=True)
    view.release()
    # Zero-copy views hold their own export of the underlying memory: releasing the caller's
    # view is harmless, and the mapping cannot be closed under them.
    plan = SERDE.plan({"a": np.arange(3)})
    mm = mmap.mmap(-1, plan.nbytes)
    view = memoryview(mm)
    SERDE.write(plan, view)
    got = SERDE.read(view, copy=False)
    view.release()
    assert isinstance(got, dict)
    with pytest.raises(BufferError):
        mm.close()
    np.testing.assert_array_equal(got["a"], np.arange(3))
    del got
    mm.close()


# --- decoded structure headers (templates) --------------------------------------------------


def test_template_reads_build_fresh_values() -> None:
    """A read of a shape seen before shares no mutable object with the earlier read."""
    serde = MsgpackSerde()
    obj = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "meta": {"k": [1, 2]}, "t": (1, "x")}
    buf = encode(obj, serde)
    first: Any = serde.read(buf.view)
    assert len(serde._templates) == 1
    first["a"][0, 0] = 99
    first["meta"]["k"].append(3)
    first["extra"] = 1
    second: Any = serde.read(buf.view)
    assert_same(obj, second)
    assert second is not first and second["meta"] is not first["meta"]
    views: Any = serde.read(buf.view, copy=False)
    assert_same(obj, views)
    assert not views["a"].flags.writeable


def test_template_same_header_other_payload_size_refused() -> None:
    """A payload whose prefix and header match a template but whose size does not is refused."""
    serde = MsgpackSerde()
    obj = {"data": np.ones(100, dtype=np.uint8)}
    raw = encoded_bytes(obj)
    serde.read(memoryview(raw))  # the template is kept
    for bad in (raw + bytes(64), raw[:-1]):
        with pytest.raises(SerdeError, match="payload is"):
            serde.read(memoryview(bad))
    assert_same(obj, serde.read(memoryview(raw)))


def test_template_forgotten_when_a_limit_changes() -> None:
    """Templates were validated against the limits: lowering one applies to the next read."""
    serde = MsgpackSerde()
    buf = encode({"a": np.zeros((2, 2, 2), dtype=np.uint8)}, serde)
    serde.read(buf.view)
    serde.max_ndim = 2
    with pytest.raises(SerdeError, match="max_ndim"):
        serde.read(buf.view)
    serde.max_ndim = 3
    serde.read(buf.view)
    serde.max_header_bytes = 8
    with pytest.raises(SerdeError, match="max_header_bytes"):
        serde.read(buf.view)


def test_template_cache_is_bounded() -> None:
    serde = MsgpackSerde()
    for n in range(serde_decode._TEMPLATES_MAX + 10):
        serde.read(encode({f"k{n}": n}, serde).view)
    assert 0 < len(serde._templates) <= serde_decode._TEMPLATES_MAX


@pytest.mark.parametrize("length", [100, 5000], ids=["kept-template", "header-over-4KiB"])
def test_a_header_is_read_once_from_shared_memory(
    monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """A writer that changes the header between the completeness check and the unpacking
    cannot slip bytes past the check: both read one private copy (headers over 4 KiB too)."""
    serde = MsgpackSerde()
    shared = bytearray(encoded_bytes({"s": "a" * length}))
    original = serde_decode.check_complete
    changed: list[bool] = []

    def then_a_writer_changes_it(header: bytes | memoryview) -> None:
        original(header)
        at = shared.index(b"a" * length)
        shared[at : at + length] = b"b" * length  # after the check, before the unpacking
        changed.append(True)

    monkeypatch.setattr(serde_decode, "check_complete", then_a_writer_changes_it)
    assert serde.read(memoryview(shared)) == {"s": "a" * length}
    assert changed == [True]
