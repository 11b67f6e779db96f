"""Tests of the put path's shortcuts in `MsgpackSerde`: cached layouts of flat items and `write`.

A flat item (a dict of str keys to plain ndarrays) whose shape was planned before reuses the
cached layout (prefix, header and padding bytes, array slots); ``write`` writes that layout with
one slice assignment and one copy per array. Each test compares against a fresh serde (which
walks the value) byte for byte: the shortcuts must change nothing but the cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioshmcache._serde.encode as serde_encode
from aioshmcache._serde import MsgpackSerde
from aioshmcache.errors import SerdeError

from .test_serde import Aligned, assert_same, encode

SMALL = serde_encode._SMALL_COPY
# array sizes in float64 elements for each way write copies: tobytes, memoryview, numpy
COPY_SIZES = [16, 1024, SMALL // 8 + 8]


def fresh_bytes(obj: object) -> bytes:
    """The encoding of ``obj`` by a serde that has never seen its shape (a full walk)."""
    return bytes(encode(obj, MsgpackSerde()).view)


def cached(serde: MsgpackSerde, obj: dict[str, Any]) -> bool:
    """Whether ``serde`` holds a layout for ``obj``'s shape (the next plan of it is a hit)."""
    plan: Any = serde.plan(obj)
    return any(plan._layout is layout for layout in serde._shapes.values())


def odd_item(rng: np.random.Generator) -> dict[str, Any]:
    """Arrays whose sizes leave padding after the header and between every two arrays."""
    return {
        "a": rng.integers(0, 255, 3, dtype=np.uint8),
        "b": rng.random((5, 3)).astype(np.float32),
        "c": np.zeros((2, 0), np.int64),
        "d": rng.random(7),
        "e": np.array(1.5, dtype=">f8"),
        "f": rng.random(701),  # more than _BYTES_COPY: the memoryview copy
        "g": np.arange(600).astype("M8[s]"),  # no buffer format: numpy's copy
        "h": np.arange(3).astype("m8[ms]"),
    }


def test_hit_shares_the_layout_and_writes_the_same_bytes() -> None:
    serde = MsgpackSerde()
    rng = np.random.default_rng(1)
    first = odd_item(rng)
    encode(first, serde)
    assert cached(serde, first)
    second = odd_item(rng)  # same keys, dtypes and shapes; other values
    p1: Any = serde.plan(first)
    p2: Any = serde.plan(second)
    assert p1._layout is p2._layout and p1.nbytes == p2.nbytes
    assert p2._sources == tuple(second.values())  # the new item's own arrays, by reference
    assert bytes(encode(second, serde).view) == fresh_bytes(second)
    assert_same(second, serde.read(encode(second, serde).view))


def test_every_byte_is_written_over_old_data() -> None:
    """A chunk holds an earlier item's bytes: header padding and gaps between arrays are zeroed."""
    serde = MsgpackSerde()
    item = odd_item(np.random.default_rng(2))
    expected = fresh_bytes(item)
    for _ in range(2):  # the walk, then the cached layout
        dirty = Aligned(len(expected), fill=0xFF)
        serde.write(serde.plan(item), dirty.view)
        assert bytes(dirty.view) == expected
        assert dirty.guard_intact()
        assert_same(item, serde.read(dirty.view))
    assert cached(serde, item)
    # the same holds for items that are not flat (no cached layout): nested, bytes values
    nested = {"x": [np.arange(3, dtype=np.int16), b"z" * 2000, {"y": np.ones(5, np.float16)}]}
    dirty = Aligned(len(fresh_bytes(nested)), fill=0xFF)
    serde.write(serde.plan(nested), dirty.view)
    assert bytes(dirty.view) == fresh_bytes(nested)
    assert_same(nested, serde.read(dirty.view))


def test_key_order_is_part_of_the_shape() -> None:
    serde = MsgpackSerde()
    a, b = np.arange(4, dtype=np.int32), np.ones((2, 2), np.float64)
    ab, ba = {"a": a, "b": b}, {"b": b, "a": a}
    for item in (ab, ba, ab, ba):
        got = serde.read(encode(item, serde).view)
        assert isinstance(got, dict) and list(got) == list(item)
        assert bytes(encode(item, serde).view) == fresh_bytes(item)
    assert serde.plan(ab)._layout is not serde.plan(ba)._layout  # type: ignore[attr-defined]
    # same keys and dtypes, shapes swapped between keys; same key, other dtype
    swapped = {"a": np.ones((2, 2), np.int32), "b": np.arange(4, dtype=np.float64)}
    other_dtype = {"a": a.astype(np.uint32), "b": b}
    for item in (swapped, other_dtype):
        assert bytes(encode(item, serde).view) == fresh_bytes(item)


@pytest.mark.parametrize("n", COPY_SIZES)
def test_non_contiguous_array_of_a_cached_shape(n: int) -> None:
    serde = MsgpackSerde()
    base = np.arange(2 * n, dtype=np.float64).reshape(2, n)
    encode({"v": np.ascontiguousarray(base[:, ::2])}, serde)  # caches shape (2, n // 2)
    for view in (base[:, ::2], base[:, 1::2], np.asfortranarray(base[:, ::2]), base[::-1, ::-2]):
        item = {"v": view}
        assert cached(serde, item)
        assert bytes(encode(item, serde).view) == fresh_bytes(item)
        got: Any = serde.read(encode(item, serde).view)
        assert got["v"].flags.c_contiguous
        np.testing.assert_array_equal(got["v"], view)


def test_subclasses_do_not_use_a_cached_layout() -> None:
    """Only exact str keys and exact ndarrays match a cached shape: anything else is walked."""

    class Key(str):  # equal to every str and hashes like "a": it must not find "a"'s layout
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("a")

    class Sub(np.ndarray):
        pass

    serde = MsgpackSerde()
    encode({"a": np.zeros(3)}, serde)
    encode({"a": np.array(2.5)}, serde)
    for item in (
        {Key("other"): np.zeros(3)},
        {"a": np.zeros(3).view(Sub)},
        {"a": np.float64(2.5)},  # dtype and shape of the cached 0-d array, but a scalar
    ):
        assert bytes(encode(item, serde).view) == fresh_bytes(item)
    got: Any = serde.read(encode({Key("other"): np.zeros(3)}, serde).view)
    assert list(got) == ["other"] and type(next(iter(got))) is str
    got = serde.read(encode({"a": np.float64(2.5)}, serde).view)
    assert type(got["a"]) is np.float64


def test_limits_apply_to_cached_layouts() -> None:
    """A change of limit forgets every cached layout; lifting it again lets the item through."""
    serde = MsgpackSerde()
    item = {"a": np.zeros((1, 2, 3)), "b": np.zeros(2, np.int8)}
    expected = bytes(encode(item, serde).view)
    assert cached(serde, item)
    for name, tight in (("max_ndim", 2), ("max_arrays", 1), ("max_header_bytes", 16)):
        roomy = getattr(serde, name)
        setattr(serde, name, tight)
        assert not serde._shapes
        with pytest.raises(SerdeError, match=name):
            serde.plan(item)
        setattr(serde, name, roomy)
        assert bytes(encode(item, serde).view) == expected
        assert cached(serde, item)
    serde.max_depth = 1  # a flat item is one level deep: still fine
    assert bytes(encode(item, serde).view) == expected


def test_limit_changed_during_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk that read the old limits (another thread changed one meanwhile) leaves no layout
    or template behind for the new limits."""
    serde = MsgpackSerde()
    item = {"a": np.zeros((2, 2, 2))}
    walk = MsgpackSerde._plan

    def walk_then_tighten(self: MsgpackSerde, obj: object) -> Any:
        plan = walk(self, obj)
        self.max_ndim = 2
        return plan

    monkeypatch.setattr(MsgpackSerde, "_plan", walk_then_tighten)
    buf = encode(item, serde)  # planned under max_ndim=32
    monkeypatch.undo()
    with pytest.raises(SerdeError, match="max_ndim"):
        serde.plan(item)

    serde.max_ndim = 32
    compile_ = MsgpackSerde._compile

    def compile_then_tighten(self: MsgpackSerde, *args: Any) -> Any:
        tmpl = compile_(self, *args)
        self.max_ndim = 2
        return tmpl

    monkeypatch.setattr(MsgpackSerde, "_compile", compile_then_tighten)
    assert_same(item, serde.read(buf.view))  # read under max_ndim=32
    monkeypatch.undo()
    with pytest.raises(SerdeError, match="max_ndim"):
        serde.read(buf.view)


def test_wide_items_are_not_cached_and_the_cache_is_bounded() -> None:
    serde = MsgpackSerde()
    wide = {f"k{i}": np.zeros(1) for i in range(serde_encode._FLAT_MAX + 1)}
    assert bytes(encode(wide, serde).view) == fresh_bytes(wide)
    assert not serde._shapes
    for n in range(serde_encode._FLAT_SHAPES_MAX + 10):
        encode({"a": np.zeros(n, np.uint8)}, serde)
    assert 0 < len(serde._shapes) <= serde_encode._FLAT_SHAPES_MAX


@pytest.mark.parametrize("cached_first", [False, True])
def test_write_checks_the_buffer(cached_first: bool) -> None:
    serde = MsgpackSerde()
    item = {"a": np.arange(10, dtype=np.int32), "b": np.ones(SMALL // 8 + 1)}
    if cached_first:
        encode(item, serde)
    plan = serde.plan(item)
    n = plan.nbytes
    expected = fresh_bytes(item)
    # shorter than the plan: refused before any byte is written
    short = bytearray(b"\xee" * (n - 1))
    with pytest.raises(SerdeError, match="smaller"):
        serde.write(plan, memoryview(short))
    assert short == b"\xee" * (n - 1)
    # read-only or not contiguous: refused, nothing written
    with pytest.raises(SerdeError, match="writable"):
        serde.write(plan, memoryview(bytes(n)))
    strided = bytearray(b"\xee" * (2 * n))
    with pytest.raises(SerdeError):
        serde.write(plan, memoryview(strided)[::2])
    assert strided == b"\xee" * (2 * n)
    with pytest.raises(SerdeError):
        serde.write(plan, 12345)  # type: ignore[arg-type]
    # longer: the first nbytes are the payload, the rest is untouched
    longer = Aligned(n + 100, fill=0xEE)
    serde.write(plan, longer.view)
    assert bytes(longer.view[:n]) == expected
    assert bytes(longer.view[n:]) == b"\xee" * 100
    # any C-contiguous buffer is taken as bytes: another format, two dimensions, a bytearray
    raw = bytearray(b"\xee" * 2 * n)
    serde.write(plan, memoryview(raw).cast("B", (2, n)))
    assert bytes(raw[:n]) == expected and raw[n:] == b"\xee" * n
    raw = bytearray(b"\xee" * ((n + 7) // 8 * 8))
    serde.write(plan, memoryview(raw).cast("Q"))
    assert bytes(raw[:n]) == expected
    raw = bytearray(n)
    serde.write(plan, raw)  # type: ignore[arg-type]
    assert bytes(raw) == expected


@pytest.mark.parametrize("size", COPY_SIZES)
def test_source_resized_after_plan(size: int) -> None:
    """A source array resized between ``plan`` and ``write`` (which the docs forbid) is refused:
    its bytes would not match the header."""
    serde = MsgpackSerde()
    for _ in range(2):  # the walk, then the cached layout
        for new_size in (size - 8, size + 8):  # a shrunk one would leave old bytes in its slot
            arr = np.zeros(size)
            plan = serde.plan({"a": arr, "b": np.ones(3)})
            arr.resize(new_size, refcheck=False)
            with pytest.raises(SerdeError, match=r"changed size|different structures"):
                serde.write(plan, Aligned(plan.nbytes + 4096).view)


def test_repr_of_a_cached_plan() -> None:
    serde = MsgpackSerde()
    item = {"a": np.zeros(3), "b": np.zeros(4)}
    first = repr(serde.plan(item))
    assert first == repr(serde.plan(item))
    assert "arrays=2" in first and f"nbytes={serde.plan(item).nbytes}" in first
