"""Attacks on the compiled read (``_core_read.c``) and its reference (``_core_read_py``).

Anyone who can write the segment can write any byte of it, at any time; anyone who can read it
can forge a reference's tag. Whatever they do, a read gives the item written for that
reference, ``None`` (the general path takes over) or a typed error of ``aioshmcache.errors``:
never an untyped exception, a crash, a read out of bounds or a leak. These tests plant hostile
headers and forged references with extreme values, rewrite a record *while* it is read, fail
reads in every step (checking that nothing leaks: Python objects counted by
``sys.getallocatedblocks``, mappings by the process's address space), and race reads against
each other, against a close, a fork and a failing ``mmap``. The CI also runs them on a core
built with ASan and UBSan (``tests/test_core*.py``). Nothing is timed: loops are bounded by a
count of reads, or by a deadline that only bounds the work done.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from aioshmcache import ShmRef, StaleReferenceError, _core_api
from aioshmcache import _layout as L
from aioshmcache._core_read_py import DTYPES, dtype_table
from aioshmcache._store import StoreWriter
from aioshmcache._store_reader import StoreReader
from aioshmcache._types import reference_tag
from aioshmcache.errors import ClosedCacheError, ShmCacheError

from .test_core_read import (
    CORES,
    Planter,
    _array_rec,
    _payload,
    acked,
    agree,
    needs_c,
    plant,
    read_all,
    same,
    stores,
)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = (1 << 64) - 1
#: values a forger tries first: the edges of every range a check computes with
EXTREMES = (0, 1, 7, 63, 64, 65, 1 << 20, 1 << 32, (1 << 62) - 1, 1 << 62, 1 << 63, U64 - 63, U64)
#: the pages of their own start here (``OWN_PAGES``): arrays this big take the mmap path
OWN_PAGES = 256 * 1024
#: a sanitizer build reserves terabytes of address space: limits on it (RLIMIT_AS) cannot hold
SANITIZED = "asan" in os.environ.get("LD_PRELOAD", "")


def core_id(core: Any) -> str:
    return str(core.__name__.rsplit(".", 1)[1])


def ctx_of(r: StoreReader, core: Any, *, np_empty: Callable[..., Any] = np.empty) -> Any:
    """A ``ReadCtx`` of ``core`` for reader ``r``, with ``np_empty`` as its allocator."""
    slot = r.read_path.slot
    assert slot is not None
    words = r._seg.words
    return core.ReadCtx(
        r._seg.buf,
        ShmRef,
        r.serde,
        slot,
        np_empty,
        dtype_table(),
        StaleReferenceError,
        r.nonce,
        int(words[L.H_SECRET]),
        int(words[L.H_RING_OFF]),
        r.ring.capacity,
        int(words[L.H_READER_OFF]) + slot.slot * int(words[L.H_SLOT_SIZE]),
    )


def payload_offset(w: StoreWriter, ref: ShmRef) -> int:
    """Where the payload of ``ref`` starts in the segment."""
    return int(w.words[L.H_RING_OFF]) + ref.address + L.CHUNK_HEADER


def vm_bytes() -> tuple[int, int]:
    """This process's (address space, resident set) in bytes: mappings the C core leaks show."""
    with open("/proc/self/statm") as f:
        size, resident = f.read().split()[:2]
    page = os.sysconf("SC_PAGE_SIZE")
    return int(size) * page, int(resident) * page


# --- a record rewritten while it is read ----------------------------------------------------------


@contextlib.contextmanager
def flipping(buf: memoryview, at: int, values: tuple[int, int]) -> Iterator[None]:
    """Flip the 8-byte word at ``buf[at:]`` between two values, as fast as memory allows,
    until the block exits: a hostile writer (numpy's copy releases the GIL, so the flips run
    while a read holds it)."""
    word = np.frombuffer(buf, np.uint64, 1, at)
    # 2**25 stores into one word per call (the two values broadcast): long stretches without
    # the GIL, so the flips overlap the reads
    target = as_strided(word, shape=(1 << 24, 2), strides=(0, 0), writeable=True)
    src = np.array(values, np.uint64)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            np.copyto(target, src)

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(60)
        word[0] = values[0]


@pytest.mark.parametrize("core", CORES, ids=core_id)
@pytest.mark.parametrize("mode", ["copy", "lease", "own pages"])
def test_a_shape_rewritten_during_the_read_never_gives_an_untyped_error(
    core: Any, mode: str
) -> None:
    """A dim of an ARRAY record flips between its true value and a huge one while reads run:
    each read checks the dims it builds the array with. (The C core once read them twice:
    checked the first time, built with the second — ``MemoryError`` for 4 PiB, a ``reshape``
    ``ValueError``, a ``TypeError`` of a buffer too small.)"""
    n = OWN_PAGES // 4 + 16 if mode == "own pages" else 1000
    item = {"a": np.arange(n, dtype=np.float32).reshape(n, 1)}
    with stores(8 << 20) as (w, readers):
        r = readers["python"]
        ref = w.put("k", item)
        pl = payload_offset(w, ref)
        head = bytes(w._seg.buf[pl : pl + 256])
        at = head.find(np.array([n, 1], np.uint64).tobytes())
        assert at > 0
        ctx = ctx_of(r, core)
        copy = mode != "lease"
        outcomes: dict[str, int] = {}
        with flipping(w._seg.buf, pl + at + 8, (1, 1 << 40)):
            deadline = time.monotonic() + 1.0  # bounds the work only: nothing timed
            reads = 0
            while reads < 200 or (reads < 100_000 and time.monotonic() < deadline):
                reads += 1
                try:
                    value = core.read_item(ctx, ref, copy)
                except ShmCacheError as exc:
                    key = type(exc).__name__
                except Exception as exc:  # the defect: anything untyped
                    key = f"untyped {type(exc).__name__}: {exc}"
                else:
                    if value is None:
                        key = "declined"
                    else:
                        assert value["a"].shape == (n, 1)
                        assert np.array_equal(value["a"], item["a"])
                        key = "read"
                        del value
                outcomes[key] = outcomes.get(key, 0) + 1
        assert not [k for k in outcomes if k.startswith("untyped")], outcomes


# --- forged references ----------------------------------------------------------------------------

_field = st.one_of(st.sampled_from(EXTREMES), st.integers(0, U64), st.integers(-130, 130))


@SETTINGS
@given(
    changes=st.dictionaries(st.sampled_from([1, 2, 3, 4, 6, 7]), _field, min_size=1, max_size=4),
    big=st.booleans(),
)
def test_references_forged_with_the_secret_and_extreme_fields_read_alike(
    changes: dict[int, int], big: bool
) -> None:
    """A forger who read the secret re-tags a genuine reference with fields at the edges of
    every range (2**64-1, 2**63, a wrap past the ring's end, small steps off the genuine
    value): every path gives the same answer, and data only for the chunk written."""
    nbytes = OWN_PAGES + 64 if big else 256
    item = {"a": np.arange(nbytes, dtype=np.uint8), "n": 5}
    with stores(4 << 20) as (w, readers):
        ref = w.put("k", item)
        f = list(ref)
        for i, v in changes.items():
            f[i] = (f[i] + v) & U64 if -130 <= v <= 130 else v  # a step, or a value outright
        f[5] = reference_tag(int(w.words[L.H_SECRET]), f[1], f[2], f[3], f[4], f[6], f[7])
        forged = ShmRef(*f)
        results = read_all(readers, forged)
        agree(results)
        for _took, *res in results.values():
            if res[0] == "ok":
                assert same(res[1], item)
                assert (forged.address, forged.id, forged.length) == (
                    ref.address,
                    ref.id,
                    ref.length,
                )


# --- hostile headers ------------------------------------------------------------------------------


def _str(data: bytes, form: int) -> bytes:
    """A msgpack str of ``data`` in a given form (0: the shortest, 1-3: str8/16/32)."""
    n = len(data)
    if form == 0 and n < 32:
        return bytes([0xA0 | n]) + data
    width = {0: 4, 1: 1, 2: 2, 3: 4}[form]
    return (
        bytes([{1: 0xD9, 2: 0xDA, 4: 0xDB}[width]])
        + (n & ((1 << 8 * width) - 1)).to_bytes(width, "big")
        + data
    )


@st.composite
def records(draw: st.DrawFn, cursor: int) -> tuple[bytes, int]:
    """An ARRAY record (as raw ext bytes) with fields drawn near and far from valid ones, and
    the data cursor after it."""
    dt = draw(st.sampled_from([*(d.encode() for d in DTYPES), b"<f4", b">f4", b"|O", b"<V8"]))
    dt = draw(st.one_of(st.just(dt), st.binary(max_size=8)))
    ndim = draw(st.sampled_from([0, 1, 2, 3, 32, 33, 255]))
    small = ndim <= 3
    dims = [
        draw(st.one_of(st.integers(1, 9), st.sampled_from(EXTREMES)) if small else st.just(1))
        for _ in range(ndim)
    ]
    itemsize = int(dt[2:] or b"1") if dt[2:].isdigit() else 1
    true = 1
    for d in dims:
        true *= d
    true *= itemsize
    off = draw(st.sampled_from([(cursor + 63) & ~63, cursor, U64 - 63, 1 << 63]))
    nbytes = draw(
        st.sampled_from([true & U64, (true + 1) & U64, U64, 1 << 62, 0, (true * 2) & U64])
    )
    flags = draw(st.sampled_from([0, 0, 0, 1, 255]))
    body = (
        off.to_bytes(8, "little")
        + nbytes.to_bytes(8, "little")
        + bytes([flags, ndim, len(dt)])
        + b"".join(d.to_bytes(8, "little") for d in dims)
        + dt
    )
    body = draw(st.sampled_from([body, body[:-1], body + b"\0"]))
    ext = draw(st.sampled_from(["ext8", "ext16", "ext32", "type2"]))
    if ext == "ext8" and len(body) < 256:
        rec = bytes([0xC7, len(body), 1]) + body
    elif ext == "ext32":
        rec = b"\xc9" + len(body).to_bytes(4, "big") + b"\x01" + body
    elif ext == "type2":
        rec = b"\xc8" + len(body).to_bytes(2, "big") + b"\x02" + body
    else:
        rec = b"\xc8" + len(body).to_bytes(2, "big") + b"\x01" + body
    end = off + nbytes if off + nbytes < (1 << 20) else cursor
    return rec, end


_scalars = st.sampled_from(
    [
        b"\xc0",
        b"\xc3",
        b"\x7f",
        b"\xe0",
        b"\xcf" + b"\xff" * 8,
        b"\xd3" + b"\x80" + b"\0" * 7,
        b"\xca\x7f\xc0\x00\x00",
        b"\xcb" + b"\xff" * 8,
        b"\xdb\xff\xff\xff\xff",  # a str32 claiming 4 GiB
        b"\xd9\x05ab",  # a str8 claiming more than it holds
        b"\xa2\xc3\x28",  # invalid UTF-8
        b"\xcc",  # a uint8 cut short
        b"\xd4\x01\x00",  # a fixext
        b"\x91\xc0",  # a list: not plain
    ]
)


@st.composite
def hostile_headers(draw: st.DrawFn) -> bytes:
    """A payload whose header is one map, hand-encoded: counts, lengths and records drawn
    around and far from the values the format allows."""
    n = draw(st.integers(0, 4))
    cursor = 0
    entries = []
    for i in range(n):
        key = _str(
            draw(st.sampled_from([f"k{i}".encode(), b"k0", b"\xff\xfe", b""])),
            draw(st.integers(0, 3)),
        )
        if draw(st.booleans()):
            rec, cursor = draw(records(cursor))
            entries.append(key + rec)
        else:
            entries.append(key + draw(_scalars))
    count = draw(st.sampled_from([n, n, n + 1, max(n - 1, 0), 0xFFFF, 0xFFFFFFFF]))
    form = draw(st.sampled_from(["fix", "map16", "map32"]))
    if form == "fix" and count < 16:
        head = bytes([0x80 | count])
    elif form == "map32" or count > 0xFFFF:
        head = b"\xdf" + count.to_bytes(4, "big")
    else:
        head = b"\xde" + count.to_bytes(2, "big")
    header = head + b"".join(entries)
    header = draw(st.sampled_from([header, header[:-1], header + b"\xc0"])) or b"\x80"
    data_len = draw(st.sampled_from([cursor, cursor + 1, max(cursor - 1, 0), 0]))
    return _payload(header, bytes(draw(st.binary(min_size=0, max_size=8))) * 0 + bytes(data_len))


@pytest.fixture(scope="module", name="planter")
def planter_fixture() -> Iterator[Planter]:
    p = Planter()
    yield p
    p.close()


@SETTINGS
@given(payload=hostile_headers())
def test_hostile_headers_with_extreme_counts_and_sizes_read_alike(
    planter: Planter, payload: bytes
) -> None:
    """Offsets and sizes at 2**63 and 2**64-1 (sums that wrap), shapes whose product
    overflows, 255 dimensions, unknown and empty dtype strings, str32 and map32 lengths of
    4 GiB in a header of a few bytes: the same typed errors (or item) on every path."""
    planter.agree(payload)


@st.composite
def mutated_items(draw: st.DrawFn) -> bytes:
    """The payload of a genuine plain item with a few of its bytes overwritten."""
    from aioshmcache import MsgpackSerde

    n = draw(st.sampled_from([3, 100, OWN_PAGES + 8]))
    item = {"x": np.arange(n, dtype=np.uint8), "s": "text", "v": 1.5, "m": np.ones((2, 3))}
    serde = MsgpackSerde()
    plan = serde.plan(item)
    buf = bytearray(plan.nbytes)
    serde.write(plan, memoryview(buf))
    hlen = int.from_bytes(buf[8:12], "little")
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, min(len(buf), 20 + hlen + 8) - 1))
        value = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0xDB, 0xC8, 0x01, 0x20]))
        width = draw(st.sampled_from([1, 1, 8]))
        for k in range(width):
            if at + k < len(buf):
                buf[at + k] = value if width == 1 or k < 7 else 0x7F
    return bytes(buf)


@SETTINGS
@given(payload=mutated_items())
def test_genuine_payloads_with_bytes_overwritten_read_alike(
    planter: Planter, payload: bytes
) -> None:
    planter.agree(payload)


# --- nothing leaks on any way out ---------------------------------------------------------------


def _big_then(tail: bytes, n_tail: int, more: int = 0) -> bytes:
    """A payload: an array on pages of its own, then ``tail`` (``n_tail`` more map entries,
    raw msgpack, whose arrays take ``more`` bytes of data after the big one's)."""
    rec = _array_rec(0, OWN_PAGES, 0, [OWN_PAGES], b"|u1")
    header = bytes([0x80 | (1 + n_tail)]) + b"\xa3big" + msgpack.packb(rec) + tail
    return _payload(header, bytes(OWN_PAGES + more))


#: a leak case: the reference, its allocator (None: numpy's) and the outcome it must have
_LeakCase = tuple[ShmRef, "Callable[..., Any] | None", str]


def _leak_cases(w: StoreWriter) -> dict[str, _LeakCase]:
    small = msgpack.packb(_array_rec(OWN_PAGES, 64, 0, [16], b"<f4"))
    words = w.words

    def stale_after_planning(ref: list[ShmRef]) -> Callable[..., Any]:
        def empty(shape: Any, dtype: Any) -> Any:  # the chunk "reused" under the read
            i = (int(words[L.H_RING_OFF]) + ref[0].address) // 8
            whole = w._seg.buf.cast("Q")
            whole[i + L.C_ID] = ref[0].id + 1
            whole.release()
            return np.empty(shape, dtype)

        return empty

    def failing(shape: Any, dtype: Any) -> Any:
        raise RuntimeError("no array today")

    cases: dict[str, _LeakCase] = {}
    # declined after the pages were taken (a duplicate key)
    cases["duplicate"] = (plant(w, _big_then(b"\xa3big\xc0", 1)), None, "NoneType")
    # an error raised by the allocator after the pages were taken
    cases["allocator fails"] = (
        plant(w, _big_then(b"\xa1s" + small, 1, 64)),
        failing,
        "RuntimeError",
    )
    # stale after the copy (the chunk reused meanwhile), pages held
    holder: list[ShmRef] = []
    ref = plant(w, _big_then(b"\xa1s" + small, 1, 64))
    holder.append(ref)
    cases["stale after the copy"] = (ref, stale_after_planning(holder), "StaleReferenceError")
    # a declined read whose header is bad at its end
    cases["bad end"] = (plant(w, _big_then(b"\xa1s\xc1", 1)), None, "NoneType")
    return cases


@needs_c
def test_failing_reads_leak_neither_objects_nor_pages() -> None:
    """Reads that take pages of their own and then fail (declined, an allocator error, stale
    after the copy) or succeed and are dropped, thousands of times: the count of Python
    memory blocks and the address space stay flat (each leaked mapping would be 256 KiB,
    each leaked key, shape or dtype reference a block per read)."""
    core = _core_api.core
    f4 = np.dtype("<f4")
    with stores(8 << 20) as (w, readers):
        r = readers["python"]
        cases = _leak_cases(w)
        good = w.put("good", {"big": np.ones(OWN_PAGES, np.uint8), "s": np.ones(16, "<f4")})
        ctxs = {name: ctx_of(r, core, np_empty=c[1] or np.empty) for name, c in cases.items()}
        plain = ctx_of(r, core)

        def once() -> None:
            for name, (ref, _, expected) in cases.items():
                try:
                    got = type(core.read_item(ctxs[name], ref)).__name__
                except (StaleReferenceError, RuntimeError) as exc:
                    got = type(exc).__name__
                assert got == expected, name
                if name == "stale after the copy":  # the chunk back as it was
                    i = (int(w.words[L.H_RING_OFF]) + ref.address) // 8
                    whole = w._seg.buf.cast("Q")
                    whole[i + L.C_ID] = ref.id
                    whole.release()
            value = core.read_item(plain, good, False)  # a lease: nothing acknowledged
            assert value is not None and value["big"].nbytes == OWN_PAGES
            del value

        for _ in range(50):
            once()
        refs_before = sys.getrefcount(f4)
        blocks_before = sys.getallocatedblocks()
        vm_before, _ = vm_bytes()
        for _ in range(2000):
            once()
        blocks = sys.getallocatedblocks() - blocks_before
        vm = vm_bytes()[0] - vm_before
        assert sys.getrefcount(f4) == refs_before
        assert blocks < 500, blocks  # a leak per read would be >= 2000
        assert vm < 16 << 20, vm  # a leaked mapping per read would be >= 500 MiB


# --- the pages of big arrays: lifetime and bounds -------------------------------------------------


@needs_c
def test_big_arrays_outlive_their_reader_and_views_outlive_their_array() -> None:
    """An array on pages of its own keeps them while it, or any view of it, lives — also
    after the cache is closed; freed pages are reused by the next read only once nothing
    refers to them any more."""
    n = 1 << 20
    with stores(16 << 20) as (w, readers):
        r = readers["_core"]
        refs = [w.put(f"k{i}", {"a": np.full(n, i, np.uint8)}) for i in range(4)]
        first = r.get(refs[0])["a"]
        view = first[10:20]
        kept = r.get(refs[1])["a"]
        del first  # the view holds the pages
        for ref in refs[2:]:  # new reads: they must not land on the view's pages
            value = r.get(ref)["a"]
            assert value[0] == value[-1]
            del value
        assert (view == 0).all() and (kept == 1).all()
    # the cache is gone (segment unmapped): the copies are the reader's own
    assert (view == 0).all() and (kept == 1).all()
    kept[:] = 7
    assert (kept == 7).all()


@needs_c
def test_freed_pages_kept_for_reuse_are_bounded() -> None:
    """Forty 1 MiB arrays read and kept, then all freed at once: at most 64 MiB of their
    pages stay mapped for reuse (the rest are unmapped), and the next reads use them."""
    n = 1 << 20
    with stores(64 << 20) as (w, readers):
        r = readers["_core"]
        refs = [w.put(f"k{i}", {"a": np.full(n, i % 251, np.uint8)}) for i in range(40)]
        vm_before, _ = vm_bytes()
        arrays = [r.get(ref)["a"] for ref in refs]
        assert all(a[0] == i % 251 for i, a in enumerate(arrays))
        del arrays
        kept = vm_bytes()[0] - vm_before
        assert kept <= (64 << 20) + (8 << 20), kept
        again = [r.get(ref)["a"] for ref in refs[:8]]
        assert all(a[-1] == i % 251 for i, a in enumerate(again))
        del again
        assert vm_bytes()[0] - vm_before <= (64 << 20) + (8 << 20)


# --- concurrency ----------------------------------------------------------------------------------


@needs_c
def test_two_threads_reading_big_items_at_once_read_them_whole() -> None:
    """Two threads read big items (copies without the GIL, pages taken and given back)
    through one reader: each read is whole and acknowledged once."""
    n = OWN_PAGES * 2
    with stores(16 << 20) as (w, readers):
        r = readers["_core"]
        refs = [w.put(f"k{i}", {"a": np.full(n, i, np.uint8), "i": i}) for i in range(6)]
        before = acked(r)
        bad: list[str] = []
        reads = 150

        def run(start: int) -> None:
            for j in range(reads):
                ref = refs[(start + j) % len(refs)]
                value = r.get(ref)
                a = value["a"]
                if not (a[0] == a[-1] == value["i"] == (start + j) % len(refs)):
                    bad.append(f"{start}:{j}")

        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not bad, bad[:5]
        assert acked(r) == before + 2 * reads


@needs_c
def test_a_close_during_big_copies_gives_the_item_or_a_typed_error() -> None:
    """Threads copy big items without the GIL while the reader is closed: each read ends with
    the item or ``ClosedCacheError`` (the read holds the mapping while it copies)."""
    n = 4 << 20
    with stores(32 << 20) as (w, readers):
        r = readers["_core"]
        ref = w.put("k", {"a": np.full(n, 9, np.uint8)})
        started = threading.Barrier(3)
        errors: list[BaseException] = []
        good = [0, 0]

        def run(k: int) -> None:
            started.wait(30)
            for _ in range(200):
                try:
                    value = r.get(ref)
                except ClosedCacheError:
                    return
                except BaseException as exc:
                    errors.append(exc)
                    return
                if value["a"][0] != 9 or value["a"][-1] != 9:
                    errors.append(AssertionError("torn"))
                good[k] += 1

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        started.wait(30)
        while sum(good) < 4 and all(t.is_alive() for t in threads):
            time.sleep(0.001)
        r.close()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors


@needs_c
def test_the_core_call_holds_the_mapping_even_without_the_read_path_s_guard() -> None:
    """Belt and braces: ``read_item`` called directly (no ``in_use``) while the segment is
    closed under it copies from a mapping its buffer export keeps alive: an item or ``None``,
    never a fault."""
    n = 8 << 20
    with stores(32 << 20) as (w, readers):
        r = readers["_core"]
        ref = w.put("k", {"a": np.full(n, 3, np.uint8)})
        ctx = r.read_path._ctx
        out: list[Any] = []

        def run() -> None:
            for _ in range(20):
                try:
                    out.append(_core_api.core.read_item(ctx, ref, False))
                except BaseException as exc:
                    out.append(exc)

        t = threading.Thread(target=run)
        t.start()
        while not out:
            time.sleep(0.0005)
        r._seg.close()
        t.join(120)
        assert not t.is_alive()
        for v in out:
            assert v is None or (isinstance(v, dict) and v["a"][-1] == 3), v


# --- fork and a failing mmap ----------------------------------------------------------------------


@needs_c
def test_a_forked_child_reads_big_items_on_its_own_pages() -> None:
    """A child forked after the parent freed big arrays (their pages kept for reuse) may get
    those pages in its own reads (its copy of them): the parent's arrays are not touched, and
    the parent's reader refuses to read in the child (``RoleError``)."""
    n = 1 << 20
    with stores(16 << 20) as (w, readers):
        r = readers["_core"]
        refs = [w.put(f"k{i}", {"a": np.full(n, i + 1, np.uint8)}) for i in range(3)]
        keep = r.get(refs[0])["a"]
        dropped = r.get(refs[1])["a"]
        del dropped  # its pages kept for reuse, inherited by the child
        handle = w.handle()
        pid = os.fork()
        if pid == 0:  # the child: report by the exit status only
            code = 1
            try:
                from aioshmcache import RoleError, ShmObjectStore

                try:
                    r.get(refs[2])
                    code = 2
                except RoleError:
                    with ShmObjectStore.from_handle(handle) as child:
                        value = child.get(refs[2])["a"]
                        value[:] = 0xEE  # written in the child's own pages
                        code = 0 if value[0] == 0xEE else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        status = None
        while status is None and time.monotonic() < deadline:
            done, st_ = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st_
            else:
                time.sleep(0.01)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish")
        assert os.waitstatus_to_exitcode(status) == 0
        assert (keep == 1).all()
        again = r.get(refs[2])["a"]
        assert (again == 3).all()


_NO_MAP = r"""
import json, resource, sys
import numpy as np
from aioshmcache import CacheConfig, ShmObjectStore, _core_api
cap = 32 << 20
out = {}
with ShmObjectStore.create(CacheConfig(cap, cap // 2, 1)) as w, \
        ShmObjectStore.from_handle(w.handle()) as r:
    reading = r.read_path
    refs = {n: w.put(str(n), {"a": np.full(n, 5, np.uint8)}) for n in (1 << 20, 6 << 20)}
    before = reading.slot.acknowledged
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 10), hard))
    try:
        got = {n: _core_api.core.read_item(reading._ctx, ref) for n, ref in refs.items()}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    out["declined"] = [n for n, v in got.items() if v is None]
    out["acked"] = reading.slot.acknowledged - before
    after = {n: _core_api.core.read_item(reading._ctx, ref) for n, ref in refs.items()}
    out["read"] = [n for n, v in after.items() if v is not None and (v["a"] == 5).all()]
print(json.dumps(out))
"""


@needs_c
@pytest.mark.skipif(SANITIZED, reason="the sanitizers reserve more address space than a limit")
def test_when_no_pages_can_be_mapped_the_read_is_declined_with_nothing_done() -> None:
    """``mmap`` failing (the address space limit reached) declines the read to the Python
    path before anything is acknowledged; with memory back, the same references read."""
    proc = subprocess.run(
        [sys.executable, "-c", _NO_MAP], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"declined": [1 << 20, 6 << 20], "acked": 0, "read": [1 << 20, 6 << 20]}
