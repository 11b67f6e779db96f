"""Differential tests of the compiled plan (``plan_item``, ``aioshmcache/_core_plan.c``) against
its reference, ``MsgpackSerde.plan``: random values and random serde limits give the same plan
(size, layout, prefix and header bytes, array slots and gaps, the very source arrays) and the
same payload bytes once written; whatever the reference refuses (a ``SerdeError``: a limit, an
int out of range, a str it cannot encode) the compiled plan declines, as it declines every value
it does not handle (subclasses, numpy scalars, large bytes, dtypes not validated yet), so the
reference decides. The one-item miss of a sender takes the compiled plan and writes the same
segment. Skipped where the C core is not built.
"""

from __future__ import annotations

import sys
import uuid
from collections import OrderedDict
from types import FrameType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aioshmcache import CacheConfig, MsgpackSerde, SenderCache
from aioshmcache._serde import MsgpackPlan
from aioshmcache._serde.encode import _ENC_DTYPES, _ZEROS
from aioshmcache.errors import SerdeError

from .conftest import RUN_PREFIX
from .test_core import c_core
from .test_serde import Aligned, arrays, values

C = c_core()
pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")
if C is not None:  # as ``_serde`` does for the core in use (with AIOSHM_PURE=1, the pure one)
    assert C.configure_plan(MsgpackSerde, MsgpackPlan, _ENC_DTYPES, _ZEROS)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# the usual values: what the compiled plan takes (and what a put usually carries)
usual_dtypes = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="<")
    | hnp.unsigned_integer_dtypes(endianness="<")
    | hnp.floating_dtypes(endianness="<", sizes=(16, 32, 64))
)
usual_arrays = hnp.arrays(
    usual_dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=70)
)
atoms = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.integers()  # out of msgpack's range too
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.text(min_size=30, max_size=300)  # str 8 / 16 headers
    | st.binary(max_size=1023)
    | usual_arrays
)
usual = st.recursive(
    atoms,
    lambda children: (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=20).map(tuple)
        | st.dictionaries(st.text(max_size=10), children, max_size=18)
    ),
    max_leaves=24,
)
limits = st.fixed_dictionaries(
    {
        "max_header_bytes": st.integers(1, 400),
        "max_arrays": st.integers(1, 6),
        "max_ndim": st.integers(1, 3),
        "max_depth": st.integers(1, 4),
        "max_containers": st.integers(1, 12),
    }
)


def _reference(serde: MsgpackSerde, value: object) -> MsgpackPlan | str:
    try:
        plan = serde.plan(value)
    except SerdeError as exc:
        return f"SerdeError: {exc}"
    assert isinstance(plan, MsgpackPlan)
    return plan


def _payload(serde: MsgpackSerde, plan: MsgpackPlan) -> bytes:
    buf = Aligned(plan.nbytes, fill=0x5A)  # every byte must be written
    serde.write(plan, buf.view)
    assert buf.guard_intact()
    return bytes(buf.view)


def _check(serde: MsgpackSerde, value: object) -> bool:
    """Compare the compiled plan with the reference's; whether the compiled one was taken."""
    assert C is not None
    first = C.plan_item(serde, value)  # before the reference validates (and remembers) dtypes
    ref = _reference(serde, value)
    got = C.plan_item(serde, value)
    if isinstance(ref, str):  # refused: the compiled plan declines, the reference raises
        assert first is None and got is None, ref
        return False
    for plan in (first, got):
        if plan is None:
            continue
        assert type(plan) is MsgpackPlan
        assert plan.nbytes == ref.nbytes
        assert plan._layout == ref._layout
        assert len(plan._sources) == len(ref._sources)
        assert all(a is b for a, b in zip(plan._sources, ref._sources, strict=True))
        assert _payload(serde, plan) == _payload(serde, ref)
    return got is not None


@SETTINGS
@given(value=usual)
def test_usual_values_plan_alike(value: object) -> None:
    _check(MsgpackSerde(), value)


@SETTINGS
@given(value=values)
def test_every_value_plans_alike_or_is_declined(value: object) -> None:
    """The serde's own strategy (every dtype and order, numpy scalars, bytes keys, large bytes,
    non-contiguous views): the same plan, or a decline."""
    _check(MsgpackSerde(), value)


@SETTINGS
@given(value=usual, lim=limits)
def test_limits_give_the_same_plan_or_a_decline(value: object, lim: dict[str, int]) -> None:
    _check(MsgpackSerde(**lim), value)


@SETTINGS
@given(arr=arrays())
def test_arrays_of_any_order_plan_alike(arr: np.ndarray[Any, Any]) -> None:
    _check(MsgpackSerde(), {"a": arr, "n": 3})


def test_the_usual_shapes_are_taken() -> None:
    """Not a vacuous comparison: what the benchmark and the apps pass is planned in C."""
    rng = np.random.default_rng(0)
    taken = [
        {"data": np.arange(256, dtype=np.float32)},
        {"pixel_values": rng.integers(0, 255, (3, 8, 8), dtype=np.uint8), "n": 3, "s": "x"},
        {"a": [np.ones(3), (1, 2.5, None, True)], "b": {"c": b"raw"}},
        [np.zeros((2, 2)), np.zeros(0, np.int8), np.ones(100, np.int16)],
        np.arange(5),
        (),
        -(2**63),
        2**64 - 1,
        # every msgpack size class on both sides of its boundary
        [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63],
        [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)],
        ["x" * n for n in (0, 31, 32, 255, 256, 65535, 65536)],
        [b"y" * n for n in (0, 255, 256, 1023)],
        [list(range(n)) for n in (15, 16)],
        [tuple(range(n)) for n in (14, 15, 16)],
        [{str(i): i for i in range(n)} for n in (15, 16)],
        {"big": list(range(70000))},
    ]
    for value in taken:
        assert _check(MsgpackSerde(), value), value


@pytest.mark.parametrize(
    "value",
    [
        {"s": np.float32(1.5)},  # a numpy scalar
        OrderedDict(a=1),  # a subclass
        {"l": np.ma.masked_array([1, 2])},  # an ndarray subclass
        {b"k": 1},  # bytes keys
        {"b": b"x" * 1024},  # large bytes: the data section
        {"b": bytearray(b"x")},
        {"o": np.array([object()], dtype=object)},  # refused by the reference
        {"u": "\udc80"},  # a lone surrogate: refused
        {"i": 2**64},  # out of msgpack's range: refused
        {"i": -(2**63) - 1},
        {"c": 1j},
        {"t": np.arange(3).astype("M8[s]").view("<M8[ns]")},  # validated once planned
    ],
    ids=repr,
)
def test_the_rest_is_declined_or_planned_alike(value: object) -> None:
    taken = _check(MsgpackSerde(), value)
    if not isinstance(value, dict) or not isinstance(next(iter(value.values())), np.ndarray):
        assert not taken


def test_limits_are_declined_before_the_reference_raises() -> None:
    deep: object = 1
    for _ in range(5):
        deep = [deep]
    for serde, value in [
        (MsgpackSerde(max_depth=4), deep),
        (MsgpackSerde(max_arrays=1), [np.ones(2), np.ones(2)]),
        (MsgpackSerde(max_ndim=1), np.ones((2, 2))),
        (MsgpackSerde(max_containers=2), [[], []]),
        (MsgpackSerde(max_header_bytes=20), "x" * 30),
    ]:
        with pytest.raises(SerdeError):
            serde.plan(value)
        assert C is not None and C.plan_item(serde, value) is None
        assert not _check(serde, value)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_arrays_whose_sizes_add_past_any_store_are_the_reference_s_to_refuse(n: int) -> None:
    """Zero-stride views of 2**61 nominal bytes each: their sum wrapped in the compiled plan
    (a negative size, then 320 bytes that passed the store's limit). The core now declines a
    sum past any store's size; the reference sums exactly, and a sum the format's length field
    cannot hold is a ``SerdeError`` (it was a raw ``struct.error``)."""
    from numpy.lib.stride_tricks import as_strided

    huge = as_strided(np.zeros(1), shape=(2**58,), strides=(0,))
    value = {f"x{i}": huge for i in range(n)}
    serde = MsgpackSerde()
    serde.plan({"w": np.zeros(1)})  # a plan made: the core's limits are known
    assert C is not None and C.plan_item(serde, value) is None
    if n * 2**61 > (1 << 64) - 1:
        with pytest.raises(SerdeError, match="exceed the format"):
            serde.plan(value)
    else:
        assert serde.plan(value).nbytes > n * 2**61
    name = f"{RUN_PREFIX}huge-{uuid.uuid4().hex[:8]}"
    with SenderCache(CacheConfig(1 << 20, 1 << 19, 1, name=name)) as cache:
        for _ in range(2):  # nothing is put: inline, as any item too large; or the serde's error
            if n * 2**61 > (1 << 64) - 1:
                with pytest.raises(SerdeError):
                    cache.get_and_update_item((value, ()), "h")
            else:
                assert cache.get_and_update_item((value, ()), "h")[0] is value
        assert not cache.is_cached("h")


@pytest.mark.parametrize(
    "name", ["max_header_bytes", "max_arrays", "max_ndim", "max_depth", "max_containers"]
)
def test_a_limit_is_checked_when_set_later_and_the_core_declines_one_past_its_range(
    name: str,
) -> None:
    """A limit set after the constructor is checked as the constructor checks it; one forced
    past its range anyway (``object.__setattr__``) is declined by the compiled plan, which
    computes with the limits in 64 bits (a header limit near 2**63 overflowed its sums), and
    the reference plans as before."""
    serde = MsgpackSerde()
    for bad in (0, -1, 2**63 - 1, 1.5, True):
        with pytest.raises(ValueError, match=name):
            setattr(serde, name, bad)
    value = {f"key{i}": i for i in range(100)}  # a header past the walk's first buffer
    object.__setattr__(serde, name, 2**63 - 1)
    assert C is not None and C.plan_item(serde, value) is None
    assert serde.plan(value).nbytes > 0


def test_a_replaced_plan_method_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A monkeypatched ``MsgpackSerde.plan`` is what decides: the compiled plan declines."""
    assert C is not None
    serde = MsgpackSerde()
    value = {"a": np.ones(4)}
    serde.plan(value)
    assert C.plan_item(serde, value) is not None
    monkeypatch.setattr(MsgpackSerde, "plan", lambda self, obj: MsgpackSerde._plan(self, obj))
    assert C.plan_item(serde, value) is None


def _plans_in_python(fn: Any) -> int:
    """How many times ``MsgpackSerde.plan`` ran (as a Python frame) during ``fn()``."""
    code = MsgpackSerde.plan.__code__
    calls = 0

    def prof(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is code:
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_the_sender_miss_plans_in_c_and_writes_what_the_reference_writes() -> None:
    """The one-item miss takes the compiled plan (the Python plan never runs) and the segment
    equals a segment whose puts were planned by the reference."""
    data = np.arange(256, dtype=np.float32)
    item = {"data": data, "meta": [1, "two", (3.0, None)]}
    rings = []
    for compiled in (True, False):
        name = f"{RUN_PREFIX}plan-{uuid.uuid4().hex[:10]}"
        with SenderCache(CacheConfig(256 * 1024, 64 * 1024, 1, name=name)) as cache:
            if not compiled:
                cache.store.serde = _OwnPlan()  # another serde type: the reference plans it
            cache.get_and_update_item((item, ()), "warm")  # dtypes validated
            ran = _plans_in_python(lambda c=cache: c.get_and_update_item((item, ()), "h1"))
            if compiled and type(cache.store.serde) is MsgpackSerde:
                from aioshmcache import implementation

                assert ran == (0 if implementation() == "c" else 1)
            got = cache.store.get(cache.get_and_update_item(None, "h1")[0])
            assert isinstance(got, dict) and np.array_equal(got["data"], data)
            assert got["meta"] == [1, "two", (3.0, None)]
            rings.append(bytes(cache.store.ring.buf[: cache.store.ring.used_bytes + 4096]))
    # the payload bytes of both puts are the same (their chunk headers hold ids and checks
    # that are equal too: the same sequence of puts)
    assert rings[0] == rings[1]


class _OwnPlan(MsgpackSerde):
    """A serde of another type (the compiled paths decline it): the reference's plan."""

    __slots__ = ()


# --- the sync face's one-item call ------------------------------------------------------------


def _answers(cache: SenderCache, form: type) -> list[object]:
    """Misses, hits, an item served inline, look-ups and errors, with updates given as ``form``."""
    small = {"data": np.arange(256, dtype=np.float32)}
    big = {"data": np.zeros(100_000, np.uint8)}  # over max_object_bytes: served inline
    out: list[object] = []
    calls: list[tuple[Any, Any]] = [
        ((small, form([1, "u"])), "a"),  # a miss
        ((small, form([2])), "a"),  # a hit: the caller's own updates come back
        ((big, form([3])), "b"),  # too large: the item itself, inline
        ((big, form([3])), "b"),  # remembered too large
        (None, "a"),  # a look-up: the kept updates, as a list
        (None, "missing"),  # CacheMissError
        ((small, form([])), 7),  # not a str hash: an error
        (({"x": object()}, form([])), "c"),  # the serde refuses it
    ]
    for item, h in calls:
        try:
            got = cache.get_and_update_item(item, h)
        except Exception as exc:
            out.append(type(exc).__name__)
            continue
        ref, updates = got
        same = got is item
        # a given item's updates come back as given; a look-up's as a new list
        kind = type(updates) is form if item is not None else type(updates) is list
        out.append((type(ref).__name__, same, list(updates), kind))
        if item is not None and not same:
            assert updates is item[1]  # the caller's own object
    info = cache.make_stats()
    out.append((info.hits, info.total, len(cache.store)))
    return out


@pytest.mark.parametrize("pure", [False, True], ids=["c-core", "pure-core"])
def test_tuple_and_list_updates_answer_alike(monkeypatch: pytest.MonkeyPatch, pure: bool) -> None:
    """The sync call's shortcut for updates given as a tuple (the core's one-item call at once)
    answers as the general path (a list is converted first), on either core."""
    from aioshmcache import _core_py, _request

    if pure:
        monkeypatch.setattr(_request, "_put_item", _core_py.put_item)
    answers: list[list[Any]] = []
    for form in (tuple, list):
        name = f"{RUN_PREFIX}face-{uuid.uuid4().hex[:10]}"
        with SenderCache(CacheConfig(256 * 1024, 64 * 1024, 1, name=name)) as cache:
            answers.append(_answers(cache, form))
    assert answers[0] == answers[1]
    assert answers[0][0][0] == "ShmRef" and answers[0][2][1] is True


def test_the_entry_points_refuse_bad_arguments() -> None:
    assert C is not None
    with pytest.raises(TypeError):
        C.configure_plan(MsgpackSerde, MsgpackPlan, [], _ZEROS)
    with pytest.raises(TypeError):
        C.plan_item(MsgpackSerde())
    assert C.plan_item(object(), {"a": 1}) is None  # not a MsgpackSerde: declined
    assert C.configure_plan(MsgpackSerde, MsgpackPlan, _ENC_DTYPES, _ZEROS)  # as it was
