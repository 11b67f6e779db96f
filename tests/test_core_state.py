"""The writer's counters as C integers: the compiled core's ``RingState`` and ``MapState``
(``_core_state.c``), the bases of ``ShmRingBuffer`` and ``ShardedMap``, against their pure
references (``_core_py``, plain slots).

Both bases hold the same names and read back what was written; the C one refuses what a
64-bit signed integer cannot hold and leaves the field as it was. A write from Python is what
the compiled put reads, and the put's writes are what Python reads next: a store whose ring and
maps were changed from Python puts the same way on both cores.
"""

from __future__ import annotations

import gc
import uuid
from typing import Any

import numpy as np
import pytest

from aioshmcache import (
    CacheConfig,
    ReceiverCache,
    SenderCache,
    SerdeError,
    ShmObjectStore,
    _core_py,
    _store,
    implementation,
)
from aioshmcache import _layout as L
from aioshmcache._ring import ShmRingBuffer
from aioshmcache._sharded_map import ShardedMap

from .conftest import RUN_PREFIX
from .test_core import c_core
from .test_differential_store import _spied, on_both_cores

C = c_core()
RING_FIELDS = (
    "_tail",
    "_limit",
    "_end",
    "_head",
    "_mask",
    "_at_mask",
    "_lap",
    "used_bytes",
    "capacity",
)
MAP_FIELDS = ("mask", "n")
BASES: list[tuple[str, Any, tuple[str, ...]]] = [
    ("pure-ring", _core_py.RingState, RING_FIELDS),
    ("pure-map", _core_py.MapState, MAP_FIELDS),
]
if C is not None:
    BASES += [("c-ring", C.RingState, RING_FIELDS), ("c-map", C.MapState, MAP_FIELDS)]


@pytest.mark.parametrize(("base", "fields"), [b[1:] for b in BASES], ids=[b[0] for b in BASES])
def test_each_base_holds_its_ints_under_a_slotted_subclass(
    base: type, fields: tuple[str, ...]
) -> None:
    sub = type("Sub", (base,), {"__slots__": ("extra",)})
    a, b = sub(), sub()
    values = [0, -1, 1, 255, 256, 1 << 40, (1 << 63) - 1, -(1 << 63)]
    for name in fields:
        for v in values:
            setattr(a, name, v)
            assert getattr(a, name) == v and type(getattr(a, name)) is int
    for i, name in enumerate(fields):  # each field its own, each object its own
        setattr(a, name, i)
        setattr(b, name, -i)
    assert [getattr(a, n) for n in fields] == list(range(len(fields)))
    assert [getattr(b, n) for n in fields] == [-i for i in range(len(fields))]
    a.extra = "x"  # the subclass's own slot beside the base's fields
    assert a.extra == "x" and getattr(a, fields[-1]) == len(fields) - 1
    with pytest.raises(AttributeError):
        a.not_a_field = 1


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@pytest.mark.parametrize("base", ["RingState", "MapState"])
def test_the_c_base_refuses_what_an_int64_cannot_hold(base: str) -> None:
    obj = getattr(C, base)()
    name = "_tail" if base == "RingState" else "n"
    setattr(obj, name, 7)
    for bad, error in (
        (1 << 63, OverflowError),
        (-(1 << 63) - 1, OverflowError),
        (1.5, TypeError),
        ("7", TypeError),
        (None, TypeError),
    ):
        with pytest.raises(error):
            setattr(obj, name, bad)
        assert getattr(obj, name) == 7  # left as it was
    setattr(obj, name, np.int64(9))  # an integer type (``__index__``) is an int
    assert getattr(obj, name) == 9
    with pytest.raises(TypeError):
        delattr(obj, name)


def test_the_package_builds_on_the_core_in_use() -> None:
    """``ShmRingBuffer`` and ``ShardedMap`` derive from the bases of the core in use."""
    core = C if implementation() == "c" else _core_py
    assert core is not None
    assert issubclass(ShmRingBuffer, core.RingState)
    assert issubclass(ShardedMap, core.MapState)
    m: ShardedMap[str, int] = ShardedMap(4)
    m["a"] = 1
    m["b"] = 2
    del m["a"]
    assert (len(m), m.mask, m.n, m.to_dict()) == (1, 3, 1, {"b": 2})


def _put_after_python_writes() -> tuple[Any, ...]:
    """A store whose ring lap and row count were set from Python, then one put:
    the reference's position and every int the put changed, read back from Python."""
    cfg = CacheConfig(256 * 1024, 200 * 1024, 1, name=f"{RUN_PREFIX}state-{uuid.uuid4().hex[:10]}")
    with ShmObjectStore.create(cfg) as store:
        ring = store.ring
        first = store.put("a", {"x": np.arange(16, dtype=np.uint8)})
        ring._lap = 3 * ring.capacity  # as a later lap (positions only grow: no reader is fooled)
        store._rows.n += 40  # a count the put goes on from
        ref = store.put("b", {"x": np.arange(300, dtype=np.float32)})
        state = tuple(getattr(ring, n) for n in RING_FIELDS)
        counts = (len(store), store._rows.n)
        words = (int(store.words[L.H_ITEMS]), int(store.words[L.H_BYTES_USED]))
        got = store.get(ref)
        return (first.position, ref.position, ref.address, state, counts, words, got["x"].sum())


def test_python_writes_reach_the_compiled_put_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first run's puts through the compiled put (with AIOSHM_PURE=1: on the pure bases)
    seen = _spied(monkeypatch, _store, "_put_plain", (C or _core_py).put_plain)
    with_c, pure = on_both_cores(monkeypatch, _put_after_python_writes)
    assert with_c == pure
    first, position, address, state, counts, words, _ = with_c
    assert first == 0  # the first lap's first chunk
    ring = dict(zip(RING_FIELDS, state))
    assert position == 3 * ring["capacity"] + address  # the lap written from Python
    assert ring["_tail"] > address and ring["_end"] == 2 and ring["used_bytes"] == ring["_tail"]
    assert counts == (2, 42) and words == (2, ring["used_bytes"])  # the rows: 40 + 2 puts
    if C is not None:
        assert seen[:2] == [True, True]  # both puts were the compiled one's


def test_a_put_owed_by_a_reader_leaves_no_entry_for_the_collector_to_walk() -> None:
    """The compiled hand-out's ledger entry (``Debts``, its hand-outs and owers) is not
    tracked by the garbage collector (it cannot be part of a cycle); the ledger's Python code
    works on it as on any entry: a second hand-out, the reader's acknowledgements, retired."""
    cfg = CacheConfig(256 * 1024, 64 * 1024, 1, name=f"{RUN_PREFIX}gc-{uuid.uuid4().hex[:10]}")
    item = {"x": np.arange(64, dtype=np.float32)}
    with SenderCache(cfg) as tx, ReceiverCache.attach(tx.handle()) as rx:
        tx.get_and_update_item((item, ()), "first")  # the first sees the new session (Python)
        ref, _ = tx.get_and_update_item((item, ()), "a")
        ledger = tx.store._ledger
        e = ledger.entries[ref.id]
        owers, _when = e.out[ref.seq]
        assert owers is not None and len(owers) == 1 and e.debt == 1
        if implementation() == "c":
            assert not any(gc.is_tracked(o) for o in (e, e.out, e.out[ref.seq], owers))
        again, _ = tx.get_and_update_item(None, "a")  # a hit: the ledger's own hand-out
        assert again.id == ref.id and again.seq > ref.seq and e.debt == 2
        gc.collect()  # a full collection with the entry untracked: nothing lost
        assert ledger.entries[ref.id] is e and set(e.out) == {ref.seq, again.seq}
        for r in (ref, again):
            assert rx.get_and_update_item(r, "a")["x"].sum() == item["x"].sum()
        tx.store._acks.drain()
        assert ref.id not in ledger.entries and e.debt == 0  # settled and retired


def _spy_put_plain(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Puts through the compiled ``put_plain`` (the pure one without the C core): whether each
    was taken (not declined)."""
    return _spied(monkeypatch, _store, "_put_plain", (C or _core_py).put_plain)


def _store_config(tag: str, capacity: int = 256 * 1024) -> CacheConfig:
    return CacheConfig(capacity, 200 * 1024, 1, name=f"{RUN_PREFIX}{tag}-{uuid.uuid4().hex[:10]}")


def _put_resized(size: int) -> tuple[object, ...]:
    """Two plans whose source array is resized before ``put_now``, then a plain put: the
    errors, the chunks and items after each, the plain item read back."""
    out: list[object] = []
    with ShmObjectStore.create(_store_config("resized")) as store:
        for new_size in (size - 8, size + 8):
            arr = np.ones(size)
            plan = store.plan({"a": arr, "b": np.arange(3)})
            arr.resize(new_size, refcheck=False)
            with pytest.raises(SerdeError) as err:
                store.put_now(f"k{new_size}", plan)
            out += [str(err.value), len(store), store.ring.n_chunks]
        ref = store.put("ok", {"a": np.ones(size)})
        out += [len(store), float(store.get(ref)["a"].sum())]
    return tuple(out)


@pytest.mark.parametrize("size", [16, 1000, 7000])  # float64s: below the 64 KiB of a borrowed read
def test_a_source_resized_after_its_plan_is_declined_and_refused_alike(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """The compiled put reads a small source array's fields instead of exporting its buffer: an
    array resized between ``plan`` and ``put_now`` (which the docs forbid) is still seen, the
    put declined before any change, and the reference refuses it (``SerdeError``) as it does
    on the pure core."""
    seen = _spy_put_plain(monkeypatch)
    with_c, pure = on_both_cores(monkeypatch, lambda: _put_resized(size))
    assert with_c == pure and with_c[-2:] == (1, float(size))
    if C is not None:
        assert seen == [False, False, True]


def test_the_compiled_put_follows_the_columns_as_they_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny items fill more chunks than the FIFO columns were sized for: the columns grow
    (new views, by the reference's allocation; the compiled put then reads the live ones) and
    every item reads back."""
    seen = _spy_put_plain(monkeypatch)
    with ShmObjectStore.create(_store_config("grow", 1 << 20)) as store:
        slots = store.ring.presize(store.ring.capacity)
        refs = [store.put(f"k{i}", {"i": np.full(2, i)}) for i in range(3 * slots)]
        assert store.ring.n_chunks == 3 * slots > slots
        assert [int(store.get(r)["i"][0]) for r in refs] == list(range(3 * slots))
    if C is not None:  # each growth declined (the reference grows the columns), the rest taken
        assert len(seen) == 3 * slots and seen.count(False) == 2
