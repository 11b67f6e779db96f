"""Differential tests: the compiled core and its pure-Python reference give the same answers
and the same errors (property tests over random inputs).

Skipped where the C core is not built (the reference is then the only core there is); CI runs
this file on the plain C build and on one built with ASan and UBSan.
"""

from __future__ import annotations

import contextlib
import gc
import platform
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import MsgpackSerde, SenderCache, _core_py, _serde, _types, implementation

from .test_core import c_core

C = c_core()
pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")

U64 = st.integers(0, (1 << 64) - 1)
WORDISH = st.one_of(
    U64,
    st.integers(-(1 << 70), -1),
    st.integers(1 << 64, 1 << 70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
)


def _outcome(fn: Any, *args: object) -> tuple[str, object]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("error", type(exc))


@settings(max_examples=300, deadline=None)
@given(st.tuples(U64, U64, U64, U64, U64, U64), U64)
def test_tags_agree_on_64_bit_words(fields: tuple[int, ...], seq: int) -> None:
    assert C is not None
    base = C.tag_base(*fields)
    assert base == _core_py.tag_base(*fields) == _types.tag_base(*fields) & ((1 << 64) - 1)
    assert C.finish_tag(base, seq) == _core_py.finish_tag(base, seq)
    secret, epoch, address, cid, length, position = fields
    assert C.finish_tag(base, seq) == _types.reference_tag(
        secret, epoch, address, cid, length, position, seq
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(WORDISH, min_size=6, max_size=6))
def test_tags_refuse_the_same_inputs(fields: list[object]) -> None:
    assert C is not None
    assert _outcome(C.tag_base, *fields) == _outcome(_core_py.tag_base, *fields)
    assert _outcome(C.finish_tag, *fields[:2]) == _outcome(_core_py.finish_tag, *fields[:2])


def test_wrong_argument_counts_are_type_errors_in_both() -> None:
    assert C is not None
    for core in (C, _core_py):
        with pytest.raises(TypeError):
            core.tag_base(1, 2, 3)
        with pytest.raises(TypeError):
            core.finish_tag(1)


SIZES = st.sampled_from([0, 1, 63, 64, 100, 4096, 65535, 65536, 70001, 262144, 300001, 1 << 20])


@settings(max_examples=60, deadline=None)
@given(SIZES, st.integers(0, 200), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_copy_into_writes_the_same_bytes(n: int, offset: int, room: int, seed: int) -> None:
    """Both cores write ``src`` at ``offset`` and nothing else (streaming, unaligned heads
    and tails included), or refuse the same way when it does not fit."""
    assert C is not None
    src = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    got = []
    for core in (C, _core_py):
        dst = np.full(n + room, 7, np.uint8)
        got.append((_outcome(core.copy_into, dst, offset, src), dst.tobytes()))
    assert got[0] == got[1]
    if offset <= room:  # it fits
        assert got[0][0] == ("ok", None)
        expected = np.full(n + room, 7, np.uint8)
        expected[offset : offset + n] = src
        assert got[0][1] == expected.tobytes()
    else:
        assert got[0][0] == ("error", ValueError)


@settings(max_examples=30, deadline=None)
@given(SIZES, st.integers(0, 2**32 - 1))
def test_bytes_of_copies_the_same_bytes(n: int, seed: int) -> None:
    """Both cores make the same ``bytes`` of a buffer (the C one copies a big one with the GIL
    released), and refuse a buffer that is not C-contiguous, or no buffer, the same way."""
    assert C is not None
    src = np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)
    raw = src.tobytes()
    given_srcs: list[object] = [src, memoryview(raw), raw, src[::2], 7]
    for given_src in given_srcs:
        got = [_outcome(core.bytes_of, given_src) for core in (C, _core_py)]
        assert got[0] == got[1], (type(given_src), got)
        if got[0][0] == "ok":
            assert type(got[0][1]) is bytes and got[0][1] == raw


class _Str(str):
    pass


_ATOMISH = st.one_of(
    st.integers(-(2**70), 2**70),
    st.text(max_size=3),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.binary(max_size=3),
    st.sampled_from([_Str("s"), np.int64(3), [1], (1,), {"a": 1}, 1.5j]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_ATOMISH, max_size=12), st.sampled_from([None, (), (1,), ([],), {}, {1: 2}, [1]]))
def test_atom_tuple_makes_the_same_tuple_untracked_only_when_it_holds_no_container(
    items: list[Any], extra: object
) -> None:
    """The kept updates' records tuple (``atom_tuple``): the reference's ``tuple(seq)``, left
    to no collector walk by the C core unless an item is a container (a list, a dict, even an
    empty one, a tracked tuple); anything but a list refused alike."""
    assert C is not None
    seq = [*items, extra] if extra is not None else items
    got, want = C.atom_tuple(seq), _core_py.atom_tuple(seq)
    assert type(got) is tuple and got == want
    assert [type(x) for x in got] == [type(x) for x in want]
    # a container: an object of a type the collector handles (a dict, even an empty one the
    # collector does not track yet, may come to hold a cycle), but for an untracked tuple
    holds_container = any(
        type(x).__flags__ & _HAVE_GC and (type(x) is not tuple or gc.is_tracked(x)) for x in seq
    )
    assert gc.is_tracked(got) is holds_container
    for bad in ((1, 2), "ab", None, _ListSub([1])):
        assert _outcome(C.atom_tuple, bad) == _outcome(_core_py.atom_tuple, bad)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, "a", None, 2**70, 1.5]), max_size=24), st.data())
def test_atom_runs_are_the_reference_s_runs(items: list[Any], data: st.DataObject) -> None:
    """A list of atoms as its runs of one object (``atom_runs``, the kept token ids): the same
    runs or None (not shorter) on both cores; a non-atom item (exactly str, int, float, bool,
    bytes and None are atoms: a subclass or a numpy scalar is not) or a non-list refused
    alike."""
    assert C is not None
    k = data.draw(st.integers(0, 5))
    seq = [x for x in items for _ in range(k)]  # each item's object repeated k times
    got, want = C.atom_runs(seq), _core_py.atom_runs(seq)
    assert got == want and (got is None or not gc.is_tracked(got))
    if got is not None and want is not None:
        assert all(a is b for a, b in zip(got[::2], want[::2], strict=True))
    for bad in ([1, [2]], (1, 1), [1, _Str("s")]):
        assert _outcome(C.atom_runs, bad) == _outcome(_core_py.atom_runs, bad)
    # anything that looks like one: a subclass, a numpy scalar, a container, not a list
    mixed = data.draw(st.lists(_ATOMISH, max_size=12) | st.sampled_from([(1, 2), "ab", None]))
    assert _outcome(C.atom_runs, mixed) == _outcome(_core_py.atom_runs, mixed)


@contextlib.contextmanager
def _finalizer_in_the_next_allocation(change: Callable[[], None]) -> Iterator[None]:
    """Garbage whose finalizer calls ``change``, freed by the collection the next allocation of
    an object the collector tracks starts (CPython 3.11 collects in the allocation itself; later
    versions at the next bytecode, which no compiled call reaches). The threshold given back."""

    class Finalized:
        def __init__(self) -> None:
            self.me = self  # a cycle: only a collection frees it

        def __del__(self) -> None:
            change()

    was = gc.get_threshold()
    gc.collect()
    Finalized()
    gc.set_threshold(1)
    try:
        yield
    finally:
        gc.set_threshold(*was)
        gc.collect()


@pytest.mark.parametrize("into", ["empty", "more runs", "a non-atom"])
@pytest.mark.parametrize("name", ["atom_runs", "atom_tuple"])
def test_atom_runs_of_a_list_a_finalizer_changes_meanwhile(name: str, into: str) -> None:
    """The runs' or the tuple's allocation may start a collection whose finalizer changes the
    list: ``atom_runs`` and ``atom_tuple`` give what their references give for the list as it
    is then (``atom_runs`` refuses it alike when it no longer holds atoms only), never reading
    past its items nor writing past their tuple (they read a cleared list's freed items, a
    segfault, and ``atom_runs`` wrote more runs than its tuple had room for)."""
    assert C is not None
    # 15 runs: a 30-tuple, and 45 items: tuples no free list holds
    seq = [x for x in range(500, 515) for _ in range(3)]
    after: dict[str, list[Any]] = {
        "empty": [],
        "more runs": [x for x in range(900, 940) for _ in range(3)],
        "a non-atom": [[1]] * 45,
    }

    def change() -> None:
        seq[:] = after[into]

    with _finalizer_in_the_next_allocation(change):
        got = _outcome(getattr(C, name), seq)
    assert seq == after[into]  # the finalizer ran
    assert got == _outcome(getattr(_core_py, name), seq)


class _ListSub(list[Any]):
    pass


_HAVE_GC = 1 << 14  # Py_TPFLAGS_HAVE_GC


def test_copy_into_refuses_the_same_buffers() -> None:
    assert C is not None
    rw = bytearray(64)
    cases: list[tuple[object, object, object]] = [
        (b"read-only dst.", 0, b"x"),
        (rw, 0, np.arange(16, dtype=np.uint8)[::2]),  # not contiguous
        (rw, 0, np.zeros(2, "M8[s]")),  # numpy exports no buffer for datetimes
        (rw, 0, 3),
        (7, 0, b"x"),
        (rw, "0", b"x"),
        (rw, -1, b"x"),
        (rw, 1 << 80, b"x"),
        (rw, 60, b"12345"),
    ]
    for dst, off, src in cases:
        assert _outcome(C.copy_into, dst, off, src) == _outcome(_core_py.copy_into, dst, off, src)
        assert _outcome(C.copy_into, dst, off, src)[0] == "error", (dst, off, src)


@pytest.mark.parametrize("n", [1000, 70_000, 150_000])
@pytest.mark.parametrize("shift", [100, -100, 1000, -4096, 64])
def test_a_copy_within_one_buffer_moves_the_bytes_as_the_reference(n: int, shift: int) -> None:
    """Source and destination overlapping (a source viewing the destination's own buffer): the
    bytes the reference's copy gives (numpy's copy moves them). A review found the compiled
    copy copying forwards, streamed from 64 KiB: wrong bytes."""
    assert C is not None
    start = max(0, -shift)
    base = ((np.arange(n + abs(shift)) * 2654435761) % 251).astype(np.uint8).tobytes()
    got = []
    for core in (C, _core_py):
        buf = bytearray(base)
        core.copy_into(buf, start + shift, memoryview(buf)[start : start + n])
        got.append(bytes(buf))
    want = bytearray(base)
    want[start + shift : start + shift + n] = base[start : start + n]
    assert got[0] == got[1] == bytes(want)


def test_the_copy_threshold_is_settable_and_reported() -> None:
    assert C is not None
    kind, default = C.copy_info()
    assert kind in ("avx512", "avx2", "sse2", "memcpy") and default > 0
    try:
        C.set_stream_min(0)  # every big copy streams: the bytes must still be right
        src = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
        dst = np.zeros((1 << 20) + 64, np.uint8)
        C.copy_into(dst, 3, src)
        assert np.array_equal(dst[3 : 3 + (1 << 20)], src)
        with pytest.raises(ValueError):
            C.set_stream_min(-1)
    finally:
        C.set_stream_min(default)
    assert C.copy_info() == (kind, default)


def test_every_streaming_kind_writes_the_same_bytes() -> None:
    """Each kind the CPU has (the one the core picked and the others ``set_stream_kind`` can
    choose: AVX-512, AVX2, SSE2, memcpy) writes ``src`` at unaligned places and nothing else;
    a kind the CPU lacks or a non-str is refused as the pure core refuses it."""
    assert C is not None
    kind, default = C.copy_info()
    kinds = C.stream_kinds()
    assert kind in kinds and kinds[-1] == "memcpy" and _core_py.stream_kinds() == ("memcpy",)
    rng = np.random.default_rng(2)
    try:
        C.set_stream_min(0)
        for k in kinds:
            C.set_stream_kind(k)
            assert C.copy_info() == (k, 0)
            for n, off in ((1 << 20, 3), (65536 + 17, 64), (100, 5), (1, 0)):
                src = rng.integers(0, 255, n, dtype=np.uint8)
                dst = np.full(n + 200, 7, np.uint8)
                C.copy_into(dst, off, src)
                expected = np.full(n + 200, 7, np.uint8)
                expected[off : off + n] = src
                assert np.array_equal(dst, expected), (k, n, off)
        for bad, err in (("neon", ValueError), ("", ValueError), (3, TypeError)):
            for core in (C, _core_py):
                with pytest.raises(err):
                    core.set_stream_kind(bad)
        assert C.copy_info()[0] == "memcpy"  # a refused kind changes nothing
    finally:
        C.set_stream_kind(kind)
        C.set_stream_min(default)
    assert C.copy_info() == (kind, default)
    assert "avx512" not in kinds or kind == "avx2"  # measured: AVX2's are the faster here


@pytest.mark.skipif(platform.machine() != "x86_64", reason="streaming stores are x86-64's")
@pytest.mark.skipif(implementation() != "c", reason="the caches run on the pure core here")
@pytest.mark.parametrize("via", ["item", "several"])
def test_a_big_put_streams_into_the_ring_and_a_small_one_does_not(
    make_config: Callable[..., Any], via: str
) -> None:
    """On x86-64 the core picks a streaming kind at import, and a put's array of ``stream_min``
    bytes or more is written with it (counted by ``streamed_copies``), through the one-item
    call and a request of several alike; a smaller one, or any array once the threshold is
    raised above it, is a plain copy. The bytes read back are the put's."""
    assert C is not None
    kind, stream_min = C.copy_info()
    assert kind in ("avx512", "avx2", "sse2")  # never memcpy where the CPU streams
    big = {"x": np.arange(stream_min, dtype=np.uint8)}
    small = {"x": np.arange(stream_min - 1, dtype=np.uint8)}
    cache = SenderCache(make_config(8 << 20, 1 << 20, 1))

    def put(item: dict[str, Any], key: str) -> int:
        before = int(C.streamed_copies())
        if via == "item":
            cache.get_and_update_item((item, ()), key)
        else:
            cache.get_and_update([(item, ()), (small, ())], [key, key + "-small"])
        ref = cache.store.ref_of(key)
        assert ref is not None
        assert np.array_equal(cache.store.get(ref)["x"], item["x"])
        return int(C.streamed_copies()) - before

    try:
        assert put(big, "big") == 1
        assert put(small, "small") == 0
        C.set_stream_min(stream_min + 1)
        assert put(big, "big-again") == 0
    finally:
        C.set_stream_min(stream_min)
        cache.close()
    assert C.copy_info() == (kind, stream_min)


ARRAYS = st.sampled_from(
    [
        lambda r: r.integers(0, 255, 300_000, dtype=np.uint8),
        lambda r: r.standard_normal((600, 129)).astype(np.float32),
        lambda r: r.standard_normal((700, 300))[:, ::2],  # not contiguous
        lambda r: np.arange(40_000).astype("M8[s]"),  # no buffer export
        lambda r: r.integers(0, 9, 10, dtype=np.int64),
    ]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(ARRAYS, min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_a_payload_is_the_same_bytes_with_either_core(
    monkeypatch_copy: Any, makers: list[Any], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    item = {f"k{i}": make(rng) for i, make in enumerate(makers)}
    serde = MsgpackSerde()
    plan = serde.plan(item)
    out = []
    for copy in (C.copy_into, _core_py.copy_into):  # type: ignore[union-attr]
        monkeypatch_copy(copy)
        buf = bytearray(b"\xee" * plan.nbytes)  # a chunk that held other bytes
        serde.write(plan, memoryview(buf))
        out.append(bytes(buf))
    assert out[0] == out[1]
    back = serde.read(memoryview(out[0]))
    assert isinstance(back, dict) and list(back) == list(item)
    for k, v in item.items():
        assert np.array_equal(back[k], v)


@pytest.fixture
def monkeypatch_copy(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(copy: Any) -> None:
        monkeypatch.setattr(_serde, "_copy_into", copy)

    return use
