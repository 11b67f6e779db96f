"""The read section of the core (``_core_read.c``, reference ``_core_read_py``): one behaviour.

Three readers of one writer read the same references: one through the compiled ``read_item``,
one through its pure-Python reference, one by the general Python path only. Whatever the
reference (genuine, forged, stale, of another segment, out of bounds, torn by a rewrite during
the copy) and whatever the payload (the serde's, or hostile bytes planted in a chunk), all three
give the same answer or the same typed error, and the two cores take (or hand back to Python)
the same cases. Random inputs by Hypothesis; no timing is asserted.
"""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import (
    CacheConfig,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    StaleReferenceError,
    _core_api,
    _core_py,
)
from aioshmcache import _layout as L
from aioshmcache._core_read_py import DTYPES, READ_LAYOUT, dtype_table
from aioshmcache._store import StoreWriter
from aioshmcache._store_reader import StoreReader
from aioshmcache._types import reference_tag
from aioshmcache.errors import ShmCacheError

needs_c = pytest.mark.skipif(
    _core_api.implementation() != "c", reason="the compiled core is not in use"
)
#: the cores under test: the compiled one when it is in use, and always the reference
CORES: list[Any] = [_core_py] + ([_core_api.core] if _core_api.implementation() == "c" else [])

CAP = 1 << 20
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def stores(cap: int = CAP) -> Iterator[tuple[StoreWriter, dict[str, StoreReader]]]:
    """A writer and one reader per path: each core's ``read_item``, and Python alone."""
    with contextlib.ExitStack() as stack:
        w = stack.enter_context(ShmObjectStore.create(CacheConfig(cap, cap // 2, 4)))
        readers: dict[str, StoreReader] = {}
        for core in [*CORES, None]:
            # the writer probed now, not again during the test (a due probe is the Python path's)
            r = stack.enter_context(ShmObjectStore.from_handle(w.handle(), probe_interval=3600))
            r.check_writer()
            r.read_path._ctx = r.read_path._read_item = None
            if core is not None:
                assert r.read_path.enable_core(core)
            readers["python" if core is None else core.__name__.rsplit(".", 1)[1]] = r
        yield w, readers


def outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except ShmCacheError as exc:
        return ("error", type(exc), str(exc))


def acked(r: StoreReader) -> int:
    """Acknowledgements reader ``r`` has written."""
    slot = r.read_path.slot
    assert slot is not None
    return slot.acknowledged


def same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.flags.c_contiguous
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if type(a).__module__ == "torch" and type(a).__name__ == "Tensor":
        # a payload with overwritten bytes can name the torch tensor kind (torch installed):
        # compared as bytes, dtype and shape, as arrays are (``==`` on tensors is elementwise)
        import torch

        return bool(
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.is_contiguous()
            and b.is_contiguous()
            and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()
        )
    return bool(a == b)


def read_all(readers: dict[str, StoreReader], ref: object) -> dict[str, tuple[Any, ...]]:
    """Each reader's outcome, and (for the cores) whether ``read_item`` took it."""
    out: dict[str, tuple[Any, ...]] = {}
    for name, r in readers.items():
        took, res = False, None
        if name != "python":
            res = outcome(lambda r=r: r.read_path.read_item(ref))  # type: ignore[misc]
            took = res[0] != "ok" or res[1] is not None
        if not took:  # not taken: the get reads it (its core hands it to the Python path)
            res = outcome(lambda r=r: r.get(ref))  # type: ignore[misc]
        assert res is not None
        out[name] = (took, *res)
    return out


def agree(results: dict[str, tuple[Any, ...]]) -> None:
    base = results["python"][1:]
    for name, (_took, *rest) in results.items():
        assert rest[0] == base[0], (name, rest, base)
        if rest[0] == "ok":
            assert same(rest[1], base[1]), name
        else:
            assert tuple(rest[1:]) == tuple(base[1:]), (name, rest, base)
    took = {results[n][0] for n in results if n != "python"}
    assert len(took) == 1, results  # both cores take the same references


# --- items and references -------------------------------------------------------------------

_dims = st.lists(st.integers(0, 5), min_size=0, max_size=3)
_dtype = st.sampled_from([*DTYPES, "<U3", ">i4", "M8[s]", "|S2"])


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dt = np.dtype(draw(_dtype))
    shape = tuple(draw(_dims))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    if dt.kind in "b":
        raw = bytes(x & 1 for x in raw)
    if dt.kind == "U":
        return np.array(["ab"] * n, dtype=dt).reshape(shape)
    if dt.kind == "M":
        return np.zeros(shape, dtype=dt)
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
plain_items = st.dictionaries(st.text(max_size=6), st.one_of(arrays(), scalars), max_size=5)
other_items = st.one_of(
    st.lists(arrays(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.lists(scalars, max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=3), st.binary(max_size=2000), min_size=1, max_size=2),
    st.tuples(scalars),
)
MUTATIONS = ("genuine", "field", "retagged", "other segment", "out of bounds", "stale", "foreign")


def mutate(w: StoreWriter, ref: ShmRef, how: str, data: st.DataObject) -> object:
    f = list(ref)
    if how == "genuine":
        return ref
    if how == "field":  # any field changed, the tag left: invalid
        i = data.draw(st.integers(0, 7))
        f[i] ^= data.draw(st.integers(1, (1 << 64) - 1))
        return ShmRef(*f)
    if how == "stale":
        w.clear()
        return ref
    if how == "foreign":
        return data.draw(st.sampled_from([ref.to_dict(), tuple(ref), None, 5]))
    # a forger who read the secret: a valid tag over changed fields
    if how == "retagged":
        i = data.draw(st.sampled_from([2, 3, 4, 6]))
        f[i] = data.draw(st.one_of(st.integers(0, 4096), st.integers(0, (1 << 64) - 1)))
    elif how == "other segment":
        f[0] ^= 2
    else:  # out of bounds
        f[2] = data.draw(st.sampled_from([CAP, CAP - 64, CAP + 64, (1 << 64) - 64]))
        f[6] = f[2]
    _nonce, epoch, address, cid, length, _tag, position, seq = f
    f[5] = reference_tag(int(w.words[L.H_SECRET]), epoch, address, cid, length, position, seq)
    return ShmRef(*f)


@SETTINGS
@given(
    item=st.one_of(plain_items, plain_items, other_items),
    how=st.sampled_from(MUTATIONS),
    data=st.data(),
)
def test_every_path_reads_every_reference_alike(item: Any, how: str, data: st.DataObject) -> None:
    with stores() as (w, readers):
        ref = w.put("k", item)
        forged = mutate(w, ref, how, data)
        results = read_all(readers, forged)
        agree(results)
        if how == "genuine" and results["python"][1] == "ok":
            assert same(results["python"][2], item)
        if forged != ref or how == "stale":
            assert not results["_core_py"][0]  # only a genuine reference is read in one call


@SETTINGS
@given(item=plain_items.filter(lambda d: any(isinstance(v, np.ndarray) for v in d.values())))
def test_plain_items_are_taken_by_the_core_and_acknowledged_once(item: dict[str, Any]) -> None:
    with stores() as (w, readers):
        for name, r in readers.items():
            if name == "python":
                continue
            ref = w.put(f"k{name}", item)
            before = acked(r)
            value = r.read_path.read_item(ref)
            usual = all(
                not isinstance(v, np.ndarray) or (v.size and v.dtype.str in DTYPES)
                for v in item.values()
            )
            assert (value is not None) == usual, (name, item)
            if value is not None:
                assert same(value, item)
                assert acked(r) == before + 1
            else:
                assert acked(r) == before


# --- hostile payloads, planted in a committed chunk --------------------------------------------


def plant(w: StoreWriter, payload: bytes) -> ShmRef:
    """Commit a chunk holding ``payload`` and make it a genuine reference (a hostile writer)."""
    ring = w.ring
    address, cid = ring.allocate(len(payload))
    ring.payload(address)[:] = payload
    position = ring.commit(address)
    epoch = int(w.words[L.H_EPOCH])
    tag = reference_tag(int(w.words[L.H_SECRET]), epoch, address, cid, len(payload), position, 0)
    return ShmRef(w.nonce, epoch, address, cid, len(payload), tag, position, 0)


class Planter:
    """A writer and a reader per read path, kept across examples (the fuzz tests of other
    modules read their hostile payloads through it too): ``agree(payload)`` plants the payload
    into a committed chunk, reads it on every path and checks they agree."""

    def __init__(self) -> None:
        self._cm: Any = None
        self._stores: tuple[StoreWriter, dict[str, StoreReader]] | None = None

    def _open(self) -> tuple[StoreWriter, dict[str, StoreReader]]:
        if self._stores is None:
            self._cm = stores(8 << 20)
            self._stores = self._cm.__enter__()
        return self._stores

    def agree(self, payload: bytes) -> dict[str, tuple[Any, ...]]:
        """Every path's outcome for ``payload`` (empty: nothing to plant, nothing read)."""
        if not payload:
            return {}
        w, readers = self._open()
        try:
            ref = plant(w, payload)
        except ShmCacheError:  # the ring is full of planted chunks: start over
            self.close()
            w, readers = self._open()
            ref = plant(w, payload)
        results = read_all(readers, ref)
        agree(results)
        return results

    def close(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
        self._cm = self._stores = None


@pytest.fixture(scope="module", name="planter")
def planter_fixture() -> Iterator[Planter]:
    """A :class:`Planter` for a module's tests (imported by the fuzz tests of other modules)."""
    p = Planter()
    yield p
    p.close()


def _payload(header: bytes, data: bytes = b"") -> bytes:
    body = struct.pack("<4sHHIQ", b"ASHM", 1, 0, len(header), len(data)) + header
    return body + bytes(-len(body) % 64) + data


def _array_rec(off: int, nbytes: int, flags: int, dims: list[int], dt: bytes) -> msgpack.ExtType:
    head = struct.pack("<QQBBB", off, nbytes, flags, len(dims), len(dt))
    return msgpack.ExtType(1, head + b"".join(struct.pack("<Q", d) for d in dims) + dt)


@st.composite
def hostile_payloads(draw: st.DrawFn) -> bytes:
    """Payloads near the plain format: a map of records with fields drawn around valid ones."""
    n = draw(st.integers(0, 3))
    header: dict[Any, Any] = {}
    cursor = 0
    for i in range(n):
        dt = draw(st.sampled_from([b"<f4", b"|u1", b"<i8", b">f4", b"<X9", b""]))
        dims = draw(st.lists(st.integers(0, 9), max_size=3))
        size = math.prod(dims) * max(1, int(dt[2:3] or b"1") if dt[2:3].isdigit() else 1)
        off = (cursor + 63) & ~63
        off += draw(st.sampled_from([0, 0, 0, 8, 64]))
        nbytes = size + draw(st.sampled_from([0, 0, 0, 1, -1]))
        flags = draw(st.sampled_from([0, 0, 0, 1, 4]))
        header[draw(st.sampled_from([f"k{i}", "k0", 7]))] = _array_rec(
            off, max(nbytes, 0), flags, dims, dt
        )
        cursor = off + max(nbytes, 0)
    data = bytes(draw(st.integers(0, cursor + 70)))
    packed = msgpack.packb(header, use_bin_type=True)
    packed = draw(st.sampled_from([packed, packed[:-1], packed + b"\xc0", b"\xdf" + packed[1:]]))
    return _payload(packed, data)


@SETTINGS
@given(
    payload=st.one_of(
        hostile_payloads(),
        st.binary(min_size=1, max_size=300),
        st.builds(_payload, st.binary(min_size=1, max_size=200)),
    )
)
def test_hostile_payloads_give_the_same_typed_errors(payload: bytes) -> None:
    with stores() as (w, readers):
        ref = plant(w, payload)
        agree(read_all(readers, ref))


# --- torn by a rewrite during the copy ------------------------------------------------------


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.__name__.rsplit(".", 1)[1])
@pytest.mark.parametrize("rewrite", ["freed", "reused", "fence"])
def test_a_chunk_reclaimed_during_the_copy_is_stale_and_not_acknowledged(
    core: Any, rewrite: str
) -> None:
    with stores() as (w, readers):
        r = readers["python"]
        ref = w.put("k", {"a": np.arange(1000, dtype=np.float32)})
        words = w.words

        def empty_then_rewrite(shape: Any, dtype: Any) -> Any:
            # runs after every check and before the copy: the writer reclaims the chunk now
            i = (int(words[L.H_RING_OFF]) + ref.address) // 8
            whole = w._seg.buf.cast("Q")
            if rewrite == "freed":
                whole[i + L.C_STATE] = L.FREED
            elif rewrite == "reused":
                whole[i + L.C_ID] = ref.id + 1
            else:
                words[L.H_HEAD_POS] = ref.position + 1
            whole.release()
            return np.empty(shape, dtype)

        assert r.read_path.enable_core(core)
        slot = r.read_path.slot
        assert slot is not None
        torn = core.ReadCtx(
            r._seg.buf,
            ShmRef,
            r.serde,
            slot,
            empty_then_rewrite,
            dtype_table(),
            StaleReferenceError,
            r.nonce,
            int(r._seg.words[L.H_SECRET]),
            int(r._seg.words[L.H_RING_OFF]),
            r.ring.capacity,
            int(r._seg.words[L.H_READER_OFF]) + slot.slot * int(r._seg.words[L.H_SLOT_SIZE]),
        )
        before = acked(r)
        with pytest.raises(StaleReferenceError, match=f"chunk {ref.id} was reclaimed"):
            core.read_item(torn, ref)
        assert acked(r) == before


def test_the_receiver_cache_reads_through_the_core_with_the_same_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with SenderCache(CacheConfig(CAP, CAP // 2, 2)) as tx, ReceiverCache.attach(tx.handle()) as rx:
        item = {"a": np.arange(300, dtype=np.int64), "n": 3}
        ref, _ = tx.get_and_update_item((item, ()), "h")
        assert same(rx.get_and_update_item(ref, "h"), item)  # the first read probes the writer
        ref, _ = tx.get_and_update_item(None, "h")
        reading = rx.store.read_path
        spied: list[object] = []
        if CORES[1:]:  # the compiled core in use: this read is one core call
            read = reading.read_item

            def spy(r: object, copy: bool = True) -> Any:
                spied.append(r)
                return read(r, copy)

            monkeypatch.setattr(reading, "read_item", spy)
        assert same(rx.get_and_update_item(ref, "h"), item)
        assert not CORES[1:] or spied == [ref]
        stats = rx.make_stats()
        assert (stats.hits, stats.total) == (2, 2)
        ref2, _ = tx.get_and_update_item(None, "h")
        tx.clear()
        with pytest.raises(StaleReferenceError, match="reference for 'h' is stale"):
            rx.get_and_update_item(ref2, "h")
        stats = rx.make_stats()
        assert (stats.hits, stats.total) == (2, 3)
        assert rx.get_and_update_item("inline", "h") == "inline"


def test_read_layout_matches_the_python_layout() -> None:
    for core in CORES:
        assert core.read_layout() == READ_LAYOUT
    assert (READ_LAYOUT["H_STATE"], READ_LAYOUT["STATE_LIVE"]) == (L.H_STATE, L.STATE_LIVE)
    assert READ_LAYOUT["WS_REVOKED"] == L.WS_REVOKED


@needs_c
def test_a_reader_uses_the_compiled_read_by_default() -> None:
    with (
        ShmObjectStore.create(CacheConfig(CAP, CAP // 2, 1)) as w,
        ShmObjectStore.from_handle(w.handle()) as r,
    ):
        assert r.read_path._read_item is _core_api.core.read_item
        ref = w.put("k", {"a": np.arange(10)})
        before = acked(r)
        assert same(r.get(ref), {"a": np.arange(10)})
        assert acked(r) == before + 1


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.__name__.rsplit(".", 1)[1])
def test_the_first_read_probes_the_writer_however_young_the_clock(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's first read probes the writer (the general path, which the core leaves to
    Python) even when the monotonic clock is younger than ``probe_interval`` (a machine booted
    minutes ago, a long interval); later reads within the interval are the core's."""
    import aioshmcache._read_path as read_path_module

    class Young:  # the monotonic clock of a machine up for ten seconds
        @staticmethod
        def monotonic() -> float:
            return 10.0

    monkeypatch.setattr(read_path_module, "time", Young)
    with (
        ShmObjectStore.create(CacheConfig(CAP, CAP // 2, 1)) as w,
        ShmObjectStore.from_handle(w.handle(), probe_interval=3600) as r,
    ):
        r.read_path._ctx = r.read_path._read_item = None
        assert r.read_path.enable_core(core)
        ref = w.put("k", {"a": np.arange(10)})
        assert r.read_path.read_item(ref) is None  # declined: the probe is due
        r.check_writer()
        assert same(r.read_path.read_item(ref), {"a": np.arange(10)})


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.__name__.rsplit(".", 1)[1])
def test_read_item_refuses_a_bad_context(core: Any) -> None:
    with pytest.raises(TypeError):
        core.read_item(object(), ShmRef(1, 1, 0, 1, 1))


@pytest.mark.parametrize("nbytes", [256 << 10, (1 << 20) + 12, 5 << 20])
def test_big_arrays_read_alike_on_pages_of_their_own(nbytes: int) -> None:
    """From 256 KiB an array gets pages of its own (populated at once; huge pages from 4 MiB):
    the same values, dtype, shape and writability as the Python path's copy."""
    rng = np.random.default_rng(nbytes)
    item = {
        "flat": rng.integers(0, 255, nbytes, dtype=np.uint8),
        "n": 1,
        "shaped": rng.standard_normal(nbytes // 32).astype(np.float32).reshape(-1, 4),
        "small": np.arange(5),
    }
    with stores(32 << 20) as (w, readers):
        ref = w.put("k", item)
        results = read_all(readers, ref)
        agree(results)
        assert {results[n][0] for n in results if n != "python"} == {True}
        for name, (_took, _ok, value) in results.items():
            assert same(value, item), name
            for arr in (value["flat"], value["shaped"]):
                assert arr.flags.writeable and arr.flags.c_contiguous
                arr[...] = 0  # its own memory: writing it changes nothing shared
            del value
        # the freed arrays' pages are reused: a second item of other bytes reads as itself
        other = {k: v[::-1].copy() if isinstance(v, np.ndarray) else v for k, v in item.items()}
        for name, r in readers.items():
            value = r.get(w.put(f"k2{name}", other))
            assert same(value, other), name
            if name == "_core":  # the compiled read's pages expose the array's bytes only
                assert memoryview(value["flat"].base).nbytes == value["flat"].nbytes


def _faults_of(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the page faults this thread took meanwhile."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    got = fn()
    return got, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@needs_c
def test_a_bigger_item_reuses_its_pages_when_smaller_ones_filled_the_spares() -> None:
    """A freed array's pages are kept for the next big read, the most recently freed first: a
    reader that read many smaller items before (their mappings filling the spares) reads a
    bigger item, drops it, and the next one of that size lands in its warm pages, with no
    page fault. (The spares kept the oldest: every such read mapped and faulted fresh pages.)"""
    small = {"x": np.ones((300 << 10) // 8)}
    big = {"x": np.ones((3 << 20) // 8)}  # under the huge-page size: a fault per 4 KiB page
    with stores(64 << 20) as (w, readers):
        r = readers["_core"]
        held = [r.get(w.put(f"s{i}", small)) for i in range(20)]  # more than the spares hold
        del held  # ... all freed: the spares are full of small mappings
        refs = [w.put(f"b{i}", big) for i in range(3)]
        first, fresh = _faults_of(lambda: r.get(refs[0]))
        assert fresh >= (3 << 20) >> 12  # fresh pages, each faulted in once
        del first  # its mapping kept, an old small one given back
        for ref in refs[1:]:
            value, faults = _faults_of(functools.partial(r.get, ref))
            # the warm pages again: (next to) no fault (a sanitizer's own memory faults a few)
            assert same(value, big) and faults < fresh // 4, (faults, fresh)
            del value


def _receivers(tx: SenderCache, stack: contextlib.ExitStack) -> dict[str, ReceiverCache]:
    """A receiver per read path (the probe of the writer done, not due again in the test)."""
    out = {}
    for name, core in (("core", CORES[-1]), ("python", None)):
        rx = stack.enter_context(ReceiverCache.attach(tx.handle()))
        reading = rx.store.read_path
        reading.probe_interval = 3600
        reading.check_writer()
        reading._ctx = reading._read_item = None
        if core is not None:
            assert reading.enable_core(core)
        out[name] = rx
    return out


@SETTINGS
@given(kinds=st.lists(st.sampled_from(["plain", "other", "inline", "stale", "forged"]), max_size=5))
def test_a_request_of_several_features_reads_alike_on_every_path(kinds: list[str]) -> None:
    """``get_and_update_features``: plain references are read in one core call each, the rest
    by the request; the same results, the same error (a ``CacheMissError`` listing the stale
    ones, or the forged one's ``InvalidReferenceError``), the same counters and acks."""
    with contextlib.ExitStack() as stack:
        tx = stack.enter_context(SenderCache(CacheConfig(CAP, CAP // 4, 2)))
        rxs = _receivers(tx, stack)
        values = {"plain": {"a": np.arange(50.0)}, "other": [np.arange(3)], "inline": "x"}
        stale = tx.get_and_update_item(({"a": np.arange(2)}, ()), "s")[0]
        features = []
        for i, kind in enumerate(kinds):
            if kind in ("plain", "other"):
                ref, _ = tx.get_and_update_item((values[kind], ()), f"h{i}")
                features.append(FeatureSpec(f"h{i}", ref))
            elif kind == "inline":
                features.append(FeatureSpec(f"h{i}", "x"))
            elif kind == "forged":
                features.append(FeatureSpec(f"h{i}", stale._replace(length=stale.length + 1)))
            else:
                features.append(FeatureSpec(f"h{i}", stale))
        if "stale" in kinds:
            tx.clear()  # every earlier hand-out is stale: put the others again
            features = [
                f
                if kinds[i] in ("inline", "stale", "forged")
                else FeatureSpec(
                    f.mm_hash, tx.get_and_update_item((values[kinds[i]], ()), f.mm_hash)[0]
                )
                for i, f in enumerate(features)
            ]
        out = {}
        for name, rx in rxs.items():
            res = outcome(lambda rx=rx: rx.get_and_update_features(features))  # type: ignore[misc]
            stats = rx.make_stats()
            out[name] = (res, stats.hits, stats.total, acked(rx.store))
        core, python = out["core"], out["python"]
        assert core[1:] == python[1:]
        assert core[0][0] == python[0][0]
        if core[0][0] == "ok":
            assert all(same(a.data, b.data) for a, b in zip(core[0][1], python[0][1]))
        else:
            assert core[0][1:] == python[0][1:]


@SETTINGS
@given(item=st.one_of(plain_items, other_items), how=st.sampled_from(MUTATIONS), data=st.data())
def test_a_lease_reads_alike_on_every_path(item: Any, how: str, data: st.DataObject) -> None:
    """``copy=False``: read-only views into shared memory, nothing acknowledged until ``ack``;
    the same values and errors on every path."""
    with stores() as (w, readers):
        ref = mutate(w, w.put("k", item), how, data)
        out = {}
        for name, r in readers.items():
            before = acked(r)
            res = outcome(lambda r=r: r.get(ref, copy=False))  # type: ignore[misc]
            assert acked(r) == before, name  # a lease owes its acknowledgement
            if res[0] == "ok":
                leaves = [v for v in res[1].values()] if isinstance(res[1], dict) else []
                for v in leaves:
                    if isinstance(v, np.ndarray) and v.size:
                        assert not v.flags.writeable, name
                given = ShmRef.from_dict(ref) if isinstance(ref, dict) else ShmRef(*ref)  # type: ignore[misc]
                r.ack(given)
                assert acked(r) == before + 1, name
            out[name] = res
        base = out["python"]
        for name, res in out.items():
            assert res[0] == base[0], name
            if res[0] == "ok":
                assert same(res[1], base[1]), name
            else:
                assert res[1:] == base[1:], name


def test_a_receiver_lease_takes_the_core_and_settles_on_exit() -> None:
    with contextlib.ExitStack() as stack:
        tx = stack.enter_context(SenderCache(CacheConfig(CAP, CAP // 4, 2)))
        rxs = _receivers(tx, stack)
        item = {"a": np.arange(100, dtype=np.int32).reshape(10, 10), "s": "x"}
        for name, rx in rxs.items():
            ref, _ = tx.get_and_update_item((item, ()), "h")
            if name == "core":  # the core takes a plain item's lease in one call
                views = rx.store.read_path.read_item(ref, False)
                assert views is not None and same(views, item)
                del views
                rx.store.ack(ref)
                ref, _ = tx.get_and_update_item((item, ()), "h")
            before = acked(rx.store)
            with rx.lease([FeatureSpec("h", ref)]) as [f]:
                assert same(f.data, item) and not f.data["a"].flags.writeable
                assert acked(rx.store) == before
            assert acked(rx.store) == before + 1


def _log_words(r: StoreReader) -> tuple[Any, int]:
    """Reader ``r``'s slot table and slot: its acknowledgement log's words."""
    slot = r.read_path.slot
    assert slot is not None
    return slot.table, slot.slot


@pytest.mark.parametrize("start", [(1 << 64) - 1, (1 << 64) - 2])
def test_a_log_head_a_hostile_writer_set_to_the_top_wraps_alike_on_every_path(
    start: int,
) -> None:
    """The acknowledgement log's head is a 64-bit counter that another process can write (a
    hostile writer sets it, and the writer's consumed mark, to the top). The compiled core
    stores ``head + 1`` modulo 2**64; the Python path raised an untyped ``ValueError`` (the
    word cannot hold 2**64). Every path now acknowledges alike: the read succeeds, the head
    wraps, the entry lands where the compiled core puts it."""
    with stores() as (w, readers):
        for name, r in readers.items():
            ref = w.put(f"k-{name}", {"a": np.arange(10)})
            table, i = _log_words(r)
            table.set_word(i, L.RS_HEAD, start)
            table.set_word(i, L.WS_CONSUMED, start)
            got = r.get(ref)
            assert np.array_equal(got["a"], np.arange(10)), name
            assert table.word(i, L.RS_HEAD) == (start + 1) % (1 << 64), name
            k = start % table.log_entries
            assert table.log_view(i)[2 * k : 2 * k + 2].tolist() == [ref.id, ref.seq], name
            # a lease's acknowledgement and a give-back take the Python path (no core call)
            table.set_word(i, L.RS_HEAD, start)
            table.set_word(i, L.WS_CONSUMED, start)
            r.ack(ref)
            r.release(ref)
            assert table.word(i, L.RS_HEAD) == (start + 2) % (1 << 64), name


def test_a_consumed_mark_past_the_log_head_is_a_full_log_on_every_path() -> None:
    """A garbled slot whose consumed mark is ahead of its log head: the log's fill, ``head -
    consumed``, wraps modulo 2**64 (as ``ReaderSlot.ack`` and the compiled core compute it): the
    log is full, so the acknowledgement waits and the head stays. A review found the pure
    core computing it on Python ints (negative: room) and writing the log."""
    with stores() as (w, readers):
        for name, r in readers.items():
            ref = w.put(f"k-{name}", {"a": np.arange(10)})
            table, i = _log_words(r)
            head = table.word(i, L.RS_HEAD)
            table.set_word(i, L.WS_CONSUMED, head + 5)
            got = r.get(ref)
            assert np.array_equal(got["a"], np.arange(10)), name
            assert table.word(i, L.RS_HEAD) == head, name  # nothing written to the log
            table.set_word(i, L.WS_CONSUMED, head)


@pytest.mark.parametrize("exc", [MemoryError("no memory"), RuntimeError("bug")], ids=repr)
@pytest.mark.parametrize("how", ["features", "item", "lease", "async"])
def test_a_core_read_that_fails_gives_its_reference_and_the_rest_back(
    exc: BaseException, how: str
) -> None:
    """The core's ``read_item`` raising anything but stale (no memory for the copy, a bug) is a
    failed read like any other: its reference and every one of its request not read yet are
    given back before the error reaches the caller (they stayed owed and pinned the ring)."""
    import anyio

    from aioshmcache import AsyncReceiverCache

    with (
        SenderCache(CacheConfig(1 << 20, 1 << 18, 1)) as tx,
        ReceiverCache.attach(tx.handle()) as rx,
    ):
        feats = tx.get_and_update_features(
            [FeatureSpec(f"k{i}", {"a": np.full(10, i, np.uint8)}) for i in range(3)]
        )
        assert not any(tx.is_freeable(f.mm_hash) for f in feats)  # owed to the reader
        rx.store.check_writer()  # probed now: the core's call takes the reads
        reading = rx.store.read_path
        calls: list[object] = []

        def fails(ctx: Any, ref: object, copy: bool) -> Any:
            calls.append(ref)
            raise exc

        reading._read_item = fails  # as the compiled call failing in its copy
        with pytest.raises(type(exc)):
            if how == "features":
                rx.get_and_update_features(feats)
            elif how == "item":
                rx.get_and_update_item(feats[0].data, "k0")
            elif how == "lease":
                with rx.lease(feats):
                    pass
            else:

                async def read() -> None:
                    await AsyncReceiverCache(rx).get_and_update_features(feats)

                anyio.run(read)
        assert calls == [feats[0].data]
        if how == "item":  # the other two were never part of the read: give them back
            assert rx.release(feats[1].data) and rx.release(feats[2].data)
        reading._read_item = None
        rx.get_and_update_features([])  # flushes what was acknowledged locally
        assert [r.lag for r in tx.snapshot().readers if r.attached] == [0]
        assert all(tx.is_freeable(f.mm_hash) for f in feats)
