"""Differential tests of the write path: a store whose puts go through the C core's
``put_plain`` and one on the pure-Python reference run the same random operation sequences and
give the same answers, the same errors and the same segment, bit for bit (ring bytes and header
words; only the instance's nonce, pid, time and secret differ, and the secret is made equal).

The segment written through the C core is read back by the Python read path, and since the two
segments are equal bytes, the reverse holds too. Skipped where the C core is not built.
"""

from __future__ import annotations

import itertools
import sys
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import (
    CacheConfig,
    CacheFullError,
    DuplicateKeyError,
    MsgpackSerde,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    _acks,
    _core_py,
    _request,
    _serde,
    _store,
    aio,
    implementation,
)
from aioshmcache import _layout as L
from aioshmcache._acks import Acknowledgements
from aioshmcache._evict import EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, Eviction
from aioshmcache._ledger import Debts, HandoutLedger
from aioshmcache._reader_table import ReaderTable, SlotState
from aioshmcache._request import SenderBook
from aioshmcache._serde import MsgpackPlan
from aioshmcache.store import StoreWriter

from .conftest import RUN_PREFIX
from .test_core import c_core

C = c_core()
pytestmark = pytest.mark.skipif(C is None, reason="the C core is not built here")
if C is not None:  # as ``_store`` does for the core in use (with AIOSHM_PURE=1, the pure one)
    C.configure(ShmRef, MsgpackPlan, MsgpackSerde)
    C.configure_hand_out(Acknowledgements, HandoutLedger, Debts, SlotState, ReaderTable)
    C.configure_evict(Eviction, EVICT_AHEAD_PUTS, EVICT_SLACK_CHUNKS, L.H_EVICTIONS)

#: header words that differ between two instances whatever they do (see the module docstring)
_INSTANCE_WORDS = {L.H_NONCE, L.H_WRITER_PID, L.H_OWNER_UID, L.H_CREATED, L.H_SECRET}
_SECRET = 0x0123456789ABCDEF

ITEMS: list[Callable[[np.random.Generator], object]] = [
    lambda r: {"pixel_values": r.integers(0, 255, 1024, dtype=np.uint8)},
    lambda r: {"a": r.standard_normal((7, 9)).astype(np.float32), "b": np.arange(3)},
    lambda r: {"big": r.integers(0, 255, 70_000, dtype=np.uint8)},
    lambda r: {"nc": r.standard_normal((40, 30))[:, ::3]},  # not contiguous: declined
    lambda r: {"t": np.arange(50).astype("M8[s]")},  # no buffer export: declined
    lambda r: {"empty": np.zeros(0, np.float64), "x": np.ones(5)},
    lambda r: {"nested": {"x": 1}, "s": "text"},  # not flat
    lambda r: [1, 2.5, "x", None],
    lambda r: {"huge": np.zeros(300_000, np.uint8)},  # over max_object_bytes
]

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
OPS = st.one_of(
    st.tuples(st.just("put"), KEYS, st.integers(0, len(ITEMS) - 1)),
    st.tuples(st.just("get_cached"), KEYS, st.just(0)),
    st.tuples(st.just("invalidate"), KEYS, st.just(0)),
    st.tuples(st.just("release_last"), KEYS, st.just(0)),
    st.tuples(st.just("clear"), KEYS, st.just(0)),
)

T = TypeVar("T")


def pure_core(m: pytest.MonkeyPatch) -> None:
    """Every entry point of the write path into the core: the pure one's (``AIOSHM_PURE=1``)."""
    m.setattr(_store, "_put_plain", _core_py.put_plain)
    m.setattr(_store, "_make_ref", _core_py.make_ref)
    m.setattr(_store, "_publish_plain", _core_py.publish_plain)
    m.setattr(_request, "_put_item", _core_py.put_item)
    m.setattr(_request, "_split_features", _core_py.split_features)
    m.setattr(_request, "_specs_from", _core_py.specs_from)
    m.setattr(aio, "_specs_from", _core_py.specs_from)  # the async face's one-item hand-out
    m.setattr(_serde, "_copy_into", _core_py.copy_into)
    m.setattr(_acks, "_drain_logs", _core_py.drain_logs)


def on_both_cores(m: pytest.MonkeyPatch, run: Callable[[], T]) -> tuple[T, T]:
    """``run()`` on the compiled core, then again on the pure one: the two answers."""
    with_c = run()
    with m.context() as pure_m:
        pure_core(pure_m)
        return with_c, run()


def _spied(m: pytest.MonkeyPatch, module: object, name: str, fn: Any) -> list[bool]:
    """Route ``module.name`` through ``fn``; whether each call was taken (not declined)."""
    seen: list[bool] = []

    def spy(*args: Any) -> Any:
        out = fn(*args)
        seen.append(out is not None)
        return out

    m.setattr(module, name, spy)
    return seen


def _sender_for(tag: str, n_readers: int = 1, **config: Any) -> SenderCache:
    """A small sender cache whose tags equal the other run's (the secret made equal)."""
    name = f"{RUN_PREFIX}{tag}-{uuid.uuid4().hex[:10]}"
    cache = SenderCache(CacheConfig(256 * 1024, 200 * 1024, n_readers, name=name, **config))
    cache.store._secret = _SECRET
    cache.store.words[L.H_SECRET] = _SECRET
    return cache


def _store_for(name: str) -> StoreWriter:
    cfg = CacheConfig(256 * 1024, 200 * 1024, 1, name=name)
    store = ShmObjectStore.create(cfg)
    store._secret = _SECRET  # the same tags in both
    store.words[L.H_SECRET] = _SECRET
    return store


def _ref_fields(ref: ShmRef) -> tuple[int, ...]:
    return tuple(ref)[1:]  # all but the nonce


def _run(ops: list[tuple[str, str, int]], seed: int) -> tuple[list[object], bytes, list[int]]:
    rng = np.random.default_rng(seed)
    store = _store_for(f"{RUN_PREFIX}diff-{uuid.uuid4().hex[:10]}")
    answers: list[object] = []
    last: ShmRef | None = None
    try:
        for op, key, n in ops:
            try:
                if op == "put":
                    value = ITEMS[n](rng)
                    last = store.put(key, value)
                    got = store.get(last)  # the Python read path reads what was written
                    answers.append(("put", _ref_fields(last), _same(got, value)))
                elif op == "get_cached":
                    ref = store.get_cached(key)
                    last = ref if ref is not None else last
                    answers.append(("hit", None if ref is None else _ref_fields(ref)))
                elif op == "invalidate":
                    answers.append(("invalidate", store.invalidate(key)))
                elif op == "release_last":
                    answers.append(("release", last is not None and store.release(last)))
                else:
                    answers.append(("clear", store.clear()))
            except Exception as exc:
                answers.append(("error", type(exc).__name__))
            answers.append(("state", store.keys(), store.ring.used_bytes, len(store)))
        ring = bytes(store.ring.buf)
        words = [w if i not in _INSTANCE_WORDS else 0 for i, w in enumerate(store.words[:64])]
        return answers, ring, words
    finally:
        store.close()


def _same(got: object, value: object) -> bool:
    if isinstance(value, dict):
        return (
            isinstance(got, dict)
            and list(got) == list(value)
            and all(_same(got[k], v) for k, v in value.items())
        )
    if isinstance(value, np.ndarray):
        return (
            isinstance(got, np.ndarray) and got.dtype == value.dtype and np.array_equal(got, value)
        )
    return bool(got == value)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(OPS, min_size=1, max_size=40), st.integers(0, 2**32 - 1))
def test_both_cores_answer_alike_and_write_the_same_segment(
    monkeypatch: pytest.MonkeyPatch, ops: list[tuple[str, str, int]], seed: int
) -> None:
    with_c, pure = on_both_cores(monkeypatch, lambda: _run(ops, seed))
    assert with_c[0] == pure[0]  # answers and errors, op by op
    assert with_c[2] == pure[2]  # header words
    assert with_c[1] == pure[1]  # every byte of the ring


def test_the_c_put_takes_the_usual_put_and_declines_the_rest(
    monkeypatch: pytest.MonkeyPatch, make_config: Any
) -> None:
    """Not a vacuous comparison: the C core did put plain items, and declined the others
    (before any side effect: the reference then made the same put)."""
    assert C is not None
    seen: list[bool] = []

    def spy(store: object, key: object, plan: object) -> Any:
        ref = C.put_plain(store, key, plan)
        seen.append(ref is not None)
        return ref

    monkeypatch.setattr(_store, "_put_plain", spy)
    rng = np.random.default_rng(0)
    with ShmObjectStore.create(make_config(1 << 20)) as store:
        store.put("plain", ITEMS[0](rng))
        store.put("not-contiguous", ITEMS[3](rng))
        store.put("datetimes", ITEMS[4](rng))
        store.put("nested", ITEMS[6](rng))
        with pytest.raises(DuplicateKeyError):
            store.put("plain", ITEMS[0](rng))
        order = store.keys()
        assert order == ["plain", "not-contiguous", "datetimes", "nested"]
        for key in order:
            ref = store.ref_of(key)
            assert ref is not None and store.get(ref) is not None
    assert seen == [True, False, False, True, False]


class _Flip(int):
    """An int whose ``__index__`` (Python code) answers 4 KiB further every other time."""

    asked = 0

    def __index__(self) -> int:
        type(self).asked += 1
        return int(self) + (type(self).asked % 2) * 4096


def test_a_plan_whose_slices_run_code_is_the_reference_s(make_config: Any) -> None:
    """The compiled put reads a plan's slices twice (checked, then copied to): one whose bounds
    are int subclasses could answer out of range the second time. It takes exact ints only
    and declines the rest, before any change."""
    assert C is not None
    with ShmObjectStore.create(make_config(1 << 20)) as store:
        plan = store.plan({"x": np.ones(8)})
        assert isinstance(plan, MsgpackPlan)
        nbytes, head, blob, ((sl, tiny, small),), gaps = plan._layout
        flipping = slice(_Flip(sl.start), _Flip(sl.stop))
        plan._layout = (nbytes, head, blob, ((flipping, tiny, small),), gaps)
        assert C.put_plain(store, "k", plan) is None
        assert store.keys() == [] and store.ring.used_bytes == 0


def test_a_slack_of_everything_evicts_the_same_batch_on_both_cores(make_config: Any) -> None:
    """``evict_slack = sys.maxsize`` ("free what you can"): the compiled pass added it to the
    put's need in 64 bits, the sum wrapped, and it freed one chunk where the reference frees a
    batch. The sum is now saturated; a slack that is not a non-negative int is refused."""

    def run() -> list[int]:
        with ShmObjectStore.create(make_config(256 * 1024, 200 * 1024, 1)) as store:
            store.evict_slack = sys.maxsize
            seen = []
            for i in range(16):
                store.put(f"k{i}", {"a": np.full(20_000, i, np.uint8)})
                seen.append(store.evictions)
            for bad in (-1, 1.5, True, "1"):
                with pytest.raises((TypeError, ValueError)):
                    store.evict_slack = bad  # type: ignore[assignment]
            assert store.evict_slack == sys.maxsize
            return seen

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    assert with_c == pure and max(pure) > 1  # the batch freed more than the put's need


def test_a_forged_plan_larger_than_any_ring_changes_nothing(make_config: Any) -> None:
    """A plan built by hand whose size is near 2**63 (``put_now`` takes any plan): its chunk's
    size wrapped negative in the compiled put, which committed it and set the ring's tail and
    bytes used negative. It is declined now; the reference raises ``CacheFullError``."""
    from aioshmcache._serde.encode import _new_plan

    def run() -> tuple[str, int, list[str]]:
        with ShmObjectStore.create(make_config(256 * 1024, 200 * 1024, 1)) as store:
            real = store.plan({"x": 1})
            assert isinstance(real, MsgpackPlan)
            forged = _new_plan((2**63 - 1, *real._layout[1:]), real._sources)
            with pytest.raises(CacheFullError) as caught:
                store.put_now("k", forged)
            store.put("k2", {"y": 2})  # the ring still works
            return type(caught.value).__name__, store.ring.used_bytes, store.keys()

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    assert with_c == pure


def test_a_hand_out_past_half_the_log_drains_however_many_are_undrained(
    make_config: Any,
) -> None:
    """The hand-out drains the readers' logs once the hand-outs since the last drain fill half
    a log; the compiled one tested ``(undrained + 1) * 2``, which overflowed for a count near
    2**62 and skipped the drain the reference makes."""

    def run() -> int:
        with ShmObjectStore.create(make_config(1 << 20, 1 << 18, 1)) as store:
            store._acks._undrained = 2**62 + 5
            store.put("k", {"x": 1})
            return int(store._acks._undrained)

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    assert with_c == pure == 0


def test_a_source_viewing_the_ring_itself_is_moved_as_the_reference_moves_it(
    make_config: Any,
) -> None:
    """An item whose array is a view of the ring's own bytes, overlapping where its chunk lands
    (the store's buffer is the caller's to read): the compiled put copies it as the reference's
    numpy copy does (a move), streamed copies included; it copied forwards."""

    def run() -> bytes:
        with ShmObjectStore.create(make_config(1 << 20, 1 << 19, 1)) as store:
            ring = np.frombuffer(store.ring.buf, np.uint8)
            ring[:] = (np.arange(ring.size) * 2654435761 % 251).astype(np.uint8)
            store.put("k", {"a": ring[4096 : 4096 + 150_000]})  # lands below its source
            tail = store.ring.used_bytes  # where the next chunk goes: its payload lands above
            store.put("k2", {"a": ring[tail : tail + 70_000]})  # its source, overlapping it
            return bytes(store.ring.buf)

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    assert with_c == pure


REQUESTS = st.lists(
    st.lists(st.tuples(KEYS, st.integers(-1, 3)), min_size=1, max_size=4), min_size=1, max_size=25
)


def _run_requests(
    requests: list[list[tuple[str, int]]], seed: int, inline_below: int
) -> tuple[list[object], bytes]:
    """Sender requests of one to four items (``-1``: a look-up), so that puts run under a
    request's guard, repeat a hash within a request, and evict, as the sender's do; with
    ``inline_below=0`` every put is a reservation, copied, then committed (``publish_plain``)."""
    rng = np.random.default_rng(seed)
    cache = _sender_for("diffreq")
    answers: list[object] = []
    try:
        for request in requests:
            items = [None if n < 0 else (ITEMS[n](rng), [n]) for _, n in request]
            try:
                hashes = [h for h, _ in request]
                out = cache._request(items, hashes, copy_inline_below=inline_below).run()
                answers.append(
                    [(_ref_fields(d) if isinstance(d, ShmRef) else "inline", u) for d, u in out]
                )
            except Exception as exc:
                answers.append(("error", type(exc).__name__))
            answers.append(("state", cache.store.keys(), cache.store.ring.used_bytes))
        return answers, bytes(cache.store.ring.buf)
    finally:
        cache.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(REQUESTS, st.integers(0, 2**32 - 1), st.sampled_from([1 << 20, 0]))
def test_sender_requests_answer_alike_and_write_the_same_segment_on_both_cores(
    monkeypatch: pytest.MonkeyPatch,
    requests: list[list[tuple[str, int]]],
    seed: int,
    inline_below: int,
) -> None:
    with_c, pure = on_both_cores(monkeypatch, lambda: _run_requests(requests, seed, inline_below))
    assert with_c[0] == pure[0]
    assert with_c[1] == pure[1]


def test_a_hand_out_s_reference_is_the_same_from_either_core(make_config: Any) -> None:
    """``make_ref`` against the reference ``StoreWriter._ref``, with the tag's base recomputed
    when the epoch moved since the row was written (and the row rewritten alike)."""
    assert C is not None
    with ShmObjectStore.create(make_config(1 << 20)) as store:
        for i in range(5):
            store.put(f"k{i}", ITEMS[1](np.random.default_rng(i)))
        cids = [store.index[f"k{i}"] for i in range(5)]
        for bump in (0, 1):
            store.words[L.H_EPOCH] = int(store.words[L.H_EPOCH]) + bump
            for cid in cids:
                for seq in (0, 1, 2**40):
                    before = store._rows[cid]
                    got = C.make_ref(store, cid, seq)
                    rewritten = store._rows[cid]
                    store._rows[cid] = before
                    with pytest.MonkeyPatch.context() as m:
                        m.setattr(_store, "_make_ref", _core_py.make_ref)
                        expected = store._ref(cid, seq)
                    assert got == expected and type(got) is ShmRef
                    assert store._rows[cid] == rewritten
        assert C.make_ref(store, 10**6, 0) is None  # no such row: the reference raises
        with pytest.raises(KeyError):
            store._ref(10**6, 0)


def test_a_source_that_changed_since_its_plan_is_refused_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan whose array is no longer the size it was planned at: the C core declines before
    any side effect, and the reference refuses it (``SerdeError``); both leave the same ring."""
    from aioshmcache import SerdeError

    def attempt() -> tuple[str, bytes, int]:
        store = _store_for(f"{RUN_PREFIX}diffsz-{uuid.uuid4().hex[:10]}")
        try:
            plan = store.plan({"x": np.arange(100, dtype=np.int64)})
            plan._sources = (np.arange(90, dtype=np.int64),)  # type: ignore[attr-defined]
            with pytest.raises(SerdeError):
                store.put_locked("k", plan)
            return repr(store.keys()), bytes(store.ring.buf), store.ring.next_id
        finally:
            store.close()

    with_c, pure = on_both_cores(monkeypatch, lambda: attempt())
    assert with_c == pure


def test_a_reservation_s_commit_is_published_by_the_c_core(
    monkeypatch: pytest.MonkeyPatch, make_config: Any
) -> None:
    """Not vacuous: ``publish_plain`` published the reservations' commits (and a put the C
    core declined to write), and declined a chunk that is not the one being written."""
    assert C is not None
    seen = _spied(monkeypatch, _store, "_publish_plain", C.publish_plain)
    rng = np.random.default_rng(0)
    with SenderCache(make_config(1 << 20)) as cache:
        cache._request([(ITEMS[0](rng), [])], ["a"], copy_inline_below=0).run()
        # written by Python: never the core's (a datetime array is, once the encoder has
        # validated its dtype in this process: an earlier test may have)
        cache.get_and_update_item((ITEMS[3](rng), []), "not-contiguous")
        assert seen == [True, True]
        store = cache.store
        ref = store.ref_of("a")
        assert ref is not None
        assert C.publish_plain(store, "b", ref.address, ref.id, ref.length) is None  # committed
        assert C.publish_plain(store, "b", 64 * 3 + 1, 5, 10) is None  # no chunk there
        assert store.keys() == ["a", "not-contiguous"]


ONE_ITEM_CALLS = st.lists(st.tuples(KEYS, st.integers(-1, len(ITEMS) - 1)), min_size=1, max_size=40)


def _run_one_item_calls(calls: list[tuple[str, int]], seed: int) -> tuple[list[object], bytes]:
    """``SenderCache.get_and_update_item`` calls (``-1``: a look-up): hits, misses that put,
    evict (the ring holds a few items) or are served inline (too large, not encodable), and
    look-ups of what is not cached; the answers, the counters and the whole segment."""
    rng = np.random.default_rng(seed)
    cache = _sender_for("diffone")
    answers: list[object] = []
    try:
        for h, n in calls:
            item = None if n < 0 else (ITEMS[n](rng), [n])
            try:
                data, updates = cache.get_and_update_item(item, h)
                answers.append(
                    (_ref_fields(data) if isinstance(data, ShmRef) else "inline", updates)
                )
            except Exception as exc:
                answers.append(("error", type(exc).__name__))
            snap = cache.snapshot()
            answers.append(("state", cache.store.keys(), snap.hits, snap.misses, snap.evictions))
            kept = cache._prompt_updates  # the prompt updates kept, and their count
            answers.append(("updates", sorted(kept.items()), len(kept)))
        words = [w if i not in _INSTANCE_WORDS else 0 for i, w in enumerate(cache.store.words[:64])]
        answers.append(("words", words))
        return answers, bytes(cache.store.ring.buf)
    finally:
        cache.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ONE_ITEM_CALLS, st.integers(0, 2**32 - 1))
def test_one_item_calls_answer_alike_and_write_the_same_segment_on_both_cores(
    monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, int]], seed: int
) -> None:
    """The compiled one-item miss (``put_item``) against the sender request it stands for."""
    with_c, pure = on_both_cores(monkeypatch, lambda: _run_one_item_calls(calls, seed))
    assert with_c[0] == pure[0]
    assert with_c[1] == pure[1]


def _evicting_puts(cache: SenderCache, n: int) -> list[str]:
    """``n`` misses of 64 KiB items with prompt updates into a ring that holds three: the keys
    whose prompt updates the sender still keeps afterwards."""
    for i in range(n):
        cache.get_and_update_item(({"a": np.full(64 * 1024, i, np.uint8)}, [i]), f"h{i}")
    return sorted(cache._prompt_updates)


def test_the_c_eviction_pass_forgets_the_senders_prompt_updates_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sender's own hook (``SenderBook.forget``) runs as its one step in C: the evicted
    hashes' prompt updates are gone, as on the pure core, without a call of ``forget``; a hook
    that is anything else is called for each evicted key."""
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is _request.SenderBook.forget.__code__:
            calls.append(frame.f_locals["mm_hash"])

    cache = _sender_for("forget")
    try:
        sys.setprofile(profile)
        try:
            kept = _evicting_puts(cache, 12)
        finally:
            sys.setprofile(None)
        assert cache.snapshot().evictions >= 8
        assert kept == sorted(cache.store.keys())  # exactly the cached ones keep updates
        # the compiled pass took the sender's own hook inline (with AIOSHM_PURE=1 the sender
        # runs the pure core, which calls it)
        assert calls == [] if implementation() == "c" else calls
        told: list[str] = []
        forget = cache.store.on_evict
        assert forget is not None

        def hook(key: str) -> None:  # another hook: called, and it still forgets
            told.append(key)
            forget(key)

        cache.store.on_evict = hook
        before = set(cache.store.keys())
        for i in range(12, 18):
            cache.get_and_update_item(({"a": np.full(64 * 1024, i, np.uint8)}, [i]), f"h{i}")
        assert told and set(told) <= before | {f"h{i}" for i in range(12, 18)}
        assert sorted(cache._prompt_updates) == sorted(cache.store.keys())
    finally:
        cache.close()
    with monkeypatch.context() as m:  # the pure core: the same prompt updates kept
        pure_core(m)
        pure = _sender_for("forgetpy")
        try:
            assert _evicting_puts(pure, 12) == kept
        finally:
            pure.close()


def test_the_c_one_item_miss_takes_plain_misses_and_declines_the_rest(
    monkeypatch: pytest.MonkeyPatch, make_config: Any
) -> None:
    """Not vacuous: ``put_item`` made the plain misses, the look-up and the hit in one call
    each, and declined (before any side effect: the request then decided) an item that is not
    a dict, one remembered too large, a miss whose eviction meets the head marked by a hit (its
    second chance: a relocation, the Python policy), and a call with its own
    ``wait_for_space`` (never offered to it). An item measured too large it serves inline."""
    assert C is not None
    seen = _spied(monkeypatch, _request, "_put_item", C.put_item)
    rng = np.random.default_rng(0)
    updates = ["u"]
    with SenderCache(CacheConfig(256 * 1024, 200 * 1024, 1)) as cache:
        ref, got = cache.get_and_update_item((ITEMS[0](rng), updates), "plain")
        assert isinstance(ref, ShmRef) and got == updates
        assert cache.get_and_update_item(None, "plain")[0].id == ref.id  # a look-up
        assert cache.get_and_update_item((ITEMS[0](rng), updates), "plain")[0].id == ref.id
        cache.get_and_update_item((ITEMS[7](rng), []), "a-list")  # not a dict
        huge: tuple[object, list[object]] = (ITEMS[8](rng), [])
        assert cache.get_and_update_item(huge, "huge") == huge  # too large: inline
        assert cache.get_and_update_item(huge, "huge") == huge  # remembered too large
        for i in range(4):  # the ring fills: these evict (or are served inline)
            cache.get_and_update_item((ITEMS[2](rng), []), f"big{i}")
        cache.get_and_update_item((ITEMS[0](rng), []), "waits", wait_for_space=0.0)
        assert cache.snapshot().misses == 9 and cache.snapshot().hits == 2
    # the look-up and the hit: taken; too large: served by the core
    assert seen[:6] == [True, True, True, False, True, False]
    assert seen[6] is True and False in seen[7:]  # a big one that fits; one meets "plain"
    assert len(seen) == 10  # the call with its own wait was never offered to the core
    declined = _core_py.put_item(None, None, (None, ()), "k", 0)  # type: ignore[func-returns-value]
    assert declined is None  # the reference declines every call


def test_the_c_one_item_miss_raises_what_the_request_raises(
    monkeypatch: pytest.MonkeyPatch, make_config: Any
) -> None:
    """A closed cache: ``ClosedCacheError`` from either core, and a bad item's ``TypeError``."""
    from aioshmcache import ClosedCacheError

    for pure in (False, True):
        with monkeypatch.context() as m:
            if pure:
                pure_core(m)
            cache = SenderCache(make_config(1 << 20))
            with pytest.raises(TypeError):
                cache.get_and_update_item(({"x": np.ones(3)}, [], "extra"), "k")  # type: ignore[arg-type]
            cache.close()
            with pytest.raises(ClosedCacheError):
                cache.get_and_update_item(({"x": np.ones(3)}, []), "k")


@pytest.mark.parametrize("pure", [False, True])
def test_the_one_item_miss_raises_the_plans_error_once_as_the_request_does(
    monkeypatch: pytest.MonkeyPatch, make_config: Any, pure: bool
) -> None:
    """An item whose plan raises (here ``KeyboardInterrupt``, as a signal may during any Python
    code): the error comes out of the call, the plan ran once, nothing was put or counted. The
    core's ``put_item`` must not swallow it and leave the request to plan the item again."""
    calls: list[int] = []
    real = MsgpackSerde.plan

    def plan(self: MsgpackSerde, value: object) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, value)

    with monkeypatch.context() as m:
        if pure:
            pure_core(m)
        m.setattr(MsgpackSerde, "plan", plan)
        cache = SenderCache(make_config(1 << 20))
        try:
            with pytest.raises(KeyboardInterrupt):
                cache.get_and_update_item(({"x": np.ones(3)}, []), "k")
            assert calls == [1]
            assert cache.store.keys() == []
            assert (cache.snapshot().hits, cache.snapshot().misses) == (0, 0)
        finally:
            cache.close()


@pytest.mark.parametrize("pure", [False, True])
def test_the_one_item_miss_counts_a_failed_put_as_the_request_does(
    monkeypatch: pytest.MonkeyPatch, make_config: Any, pure: bool
) -> None:
    """A put that raises after its plan (here the hand-out step) counts one miss on either core,
    as the request's ``put_now`` path does ("a failed copy counts as a miss")."""
    with monkeypatch.context() as m:
        if pure:
            pure_core(m)
        cache = SenderCache(make_config(1 << 20))
        try:
            real = cache.store._hand_out_seq

            def boom(cid: int) -> int:
                raise RuntimeError("hand-out failed")

            cache.store._hand_out_seq = boom
            with pytest.raises(RuntimeError, match="hand-out failed"):
                cache.get_and_update_item(({"x": np.ones(3)}, []), "k")
            cache.store._hand_out_seq = real
            snap = cache.snapshot()
            assert (snap.hits, snap.misses) == (0, 1)
            assert int(cache.store.words[L.H_MISSES]) == 1
        finally:
            cache.close()


def _ledger_state(store: StoreWriter) -> object:
    """The hand-out ledger and the published debts, sessions named by their slot (each run's
    sessions are random numbers)."""
    acks, ledger = store._acks, store._ledger
    slot_of = {st.session: i for i, st in enumerate(acks.slots) if st.session}

    def who(owers: tuple[int, ...] | None) -> object:
        return None if owers is None else [slot_of.get(s, -1) for s in owers]

    entries = {
        cid: (
            [(seq, who(owers), t) for seq, (owers, t) in e.out.items()],
            e.debt,
            e.pins,
            e.touched_at,
        )
        for cid, e in ledger.entries.items()
    }
    owed = sorted((slot_of.get(s, -1), n) for s, n in ledger.owed.items())
    progress = [ledger.last_acknowledged(st.session) for st in acks.slots]
    slots = [(st.cursor, st.alive, st.revoked) for st in acks.slots]
    consumed = [store._readers.word(i, L.WS_CONSUMED) for i in range(len(acks.slots))]
    words = list(store._readers.owed_words)
    return entries, owed, progress, slots, consumed, ledger.next_seq, words, acks._undrained


def _run_one_item_calls_read(
    calls: list[tuple[str, int]], seed: int, readers: int
) -> tuple[list[object], bytes]:
    """One-item calls with ``readers`` live readers, the first of which reads (and so
    acknowledges) every other reference it is given: each put's hand-out is owed by the live
    sessions (the C core's ``hand_out``), drained as they acknowledge. The ledger's clock is a
    counter, so that both runs record the same times."""
    rng = np.random.default_rng(seed)
    cache = _sender_for("diffho", 2)
    ticks = iter(range(1, 1 << 30))
    cache.store._ledger.clock = lambda: float(next(ticks))
    attached: list[Any] = []
    answers: list[object] = []
    try:
        attached += [ShmObjectStore.from_handle(cache.store.handle()) for _ in range(readers)]
        for i, (h, n) in enumerate(calls):
            item = None if n < 0 else (ITEMS[n](rng), [n])
            try:
                data, updates = cache.get_and_update_item(item, h)
                if attached and isinstance(data, ShmRef) and i % 2 == 0:
                    attached[0].get(data)  # read: acknowledged
                answers.append(
                    (_ref_fields(data) if isinstance(data, ShmRef) else "inline", updates)
                )
            except Exception as exc:
                answers.append(("error", type(exc).__name__))
            answers.append(("state", cache.store.keys(), _ledger_state(cache.store)))
        return answers, bytes(cache.store.ring.buf)
    finally:
        for r in attached:
            r.close()
        cache.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ONE_ITEM_CALLS, st.integers(0, 2**32 - 1), st.integers(0, 2))
def test_hand_outs_owed_by_live_readers_keep_the_same_ledger_on_both_cores(
    monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, int]], seed: int, readers: int
) -> None:
    """The compiled hand-out (``hand_out``, in every compiled put) against
    ``Acknowledgements.hand_out``: the same ledger (entries, debts, times, counts), the same
    published debts and the same segment, step by step, with 0-2 live readers acknowledging."""
    with_c, pure = on_both_cores(
        monkeypatch, lambda: _run_one_item_calls_read(calls, seed, readers)
    )
    assert with_c[0] == pure[0]
    assert with_c[1] == pure[1]


def test_the_c_hand_out_takes_the_usual_hand_out_and_declines_the_rest(
    make_config: Any,
) -> None:
    """Not vacuous: ``hand_out`` recorded a put's first hand-out owed by a live reader (one
    ``Debts``, counted and published as the reference does), then a second hand-out of that
    tracked entry (added to its ``Debts``, its touch ended), and declined, doing nothing, a
    changed session and one-of-N."""
    assert C is not None
    with SenderCache(make_config(1 << 20)) as cache:
        store = cache.store
        acks, ledger = store._acks, store._ledger
        with ShmObjectStore.from_handle(store.handle()):
            cache.get_and_update_item(({"x": np.ones(3)}, []), "a")  # syncs the new session
            (session,) = acks.live_sessions  # the reader's
            seq0 = ledger.next_seq
            assert C.hand_out(acks, 10**6) == seq0
            e = ledger.entries[10**6]
            owers = {seq: o for seq, (o, _t) in e.out.items()}
            assert (e.id, owers, e.debt, e.pins, e.touched_at) == (
                10**6,
                {seq0: (session,)},
                1,
                0,
                None,
            )
            assert ledger.owed[session] == 2 and int(store._readers.owed_words[0]) == 2
            ledger.touch(e)  # tracked: its next hand-out ends the touch, as ``hand_out(e)``
            assert C.hand_out(acks, 10**6) == seq0 + 1
            assert ledger.entries[10**6] is e and e.touched_at is None
            owers = {seq: o for seq, (o, _t) in e.out.items()}
            assert (owers, e.debt) == ({seq0: (session,), seq0 + 1: (session,)}, 2)
            assert [type(t) for _o, t in e.out.values()] == [float, float]
            assert ledger.owed[session] == 3 and int(store._readers.owed_words[0]) == 3
            seq0 += 1
            with ShmObjectStore.from_handle(store.handle()):  # a new session: sync first
                assert C.hand_out(acks, 10**6 + 1) is None
            assert ledger.next_seq == seq0 + 1 and 10**6 + 1 not in ledger.entries
            acks.one_of_n = True
            assert C.hand_out(acks, 10**6 + 2) is None
            acks.one_of_n = False


def test_the_c_hand_out_of_a_touched_or_pinned_entry_keeps_the_reference_s_ledger(
    make_config: Any,
) -> None:
    """An entry tracked only for a touch or a pin, handed out with no reader attached: the C
    hand-out ends the touch and stops tracking an entry left idle, and keeps a pinned one, as
    ``Acknowledgements.hand_out`` does (the same ledger, step by step, on a twin store)."""
    assert C is not None

    def steps(compiled: bool) -> list[tuple[str, object, object]]:
        with SenderCache(make_config(1 << 20)) as cache:
            store = cache.store
            acks, ledger = store._acks, store._ledger
            seen: list[tuple[str, object, object]] = []
            for key in ("t", "p", "tp"):
                cache.get_and_update_item(({"x": np.ones(3)}, []), key)
            cid = {k: ref.id for k in ("t", "p", "tp") if (ref := store.ref_of(k)) is not None}
            assert cid["t"] not in ledger.entries  # owed by nobody: not tracked
            store.touch("t"), store.pin("p"), store.touch("tp"), store.pin("tp")
            for key in ("t", "p", "tp", "t"):
                seq = C.hand_out(acks, cid[key]) if compiled else acks.hand_out(cid[key])
                e = ledger.entries.get(cid[key])
                seen.append(
                    (key, seq, None if e is None else (e.out, e.debt, e.pins, e.touched_at))
                )
            return seen

    compiled, reference = steps(True), steps(False)
    assert compiled == reference
    assert [row[2] is None for row in compiled] == [True, False, False, True]


def test_two_slots_with_one_session_are_the_reference_s_to_count(make_config: Any) -> None:
    """A reader table gone wrong (two slots holding one session number): the compiled hand-out
    declines, doing nothing, and the reference counts the session once per slot."""
    from aioshmcache._layout import RS_SESSION

    assert C is not None
    with SenderCache(make_config(1 << 20)) as cache:
        store = cache.store
        acks, ledger = store._acks, store._ledger
        with (
            ShmObjectStore.from_handle(store.handle()),
            ShmObjectStore.from_handle(store.handle()),
        ):
            cache.get_and_update_item(({"x": np.ones(3)}, []), "a")  # syncs both sessions
            first, second = acks.live_sessions
            store._readers.set_word(1, RS_SESSION, first)  # slot 1 now claims slot 0's session
            acks.sync_sessions()
            assert acks.live_sessions == (first, first)
            owed, seq = dict(ledger.owed), ledger.next_seq
            assert C.hand_out(acks, 10**6) is None
            assert (dict(ledger.owed), ledger.next_seq) == (owed, seq)  # nothing done
            assert acks.hand_out(10**6) == seq
            assert ledger.owed[first] == owed[first] + 2
            store._readers.set_word(1, RS_SESSION, second)  # as it was, for the slot's close
            acks.sync_sessions()


@pytest.mark.parametrize("also_released", [False, True])
def test_a_ledger_clock_that_changes_the_entry_meanwhile_leaves_the_reference_s_ledger(
    make_config: Any, also_released: bool
) -> None:
    """The ledger's clock is Python code, called inside the compiled hand-out of a tracked
    entry: one that gives back an earlier hand-out of that entry meanwhile (one of two, or its
    only one, which retires the entry) leaves the same hand-outs and debt as the reference,
    the compiled step taking the entry as the clock left it or declining to the reference."""
    assert C is not None

    def run(compiled: bool) -> tuple[list[int], int, list[int]]:
        with (
            ShmObjectStore.create(make_config(1 << 20)) as store,
            ShmObjectStore.from_handle(store.handle()),
        ):
            acks, ledger = store._acks, store._ledger
            store.put("a", {"x": np.ones(3)})  # its first hand-out, owed by the reader
            earlier = store.get_cached("a")
            assert earlier is not None
            if also_released:
                assert store.release(earlier)  # the put's hand-out left alone: one owed
            ticks = itertools.count(1)
            armed = [True]
            first = min(ledger.entries[earlier.id].out)

            def clock() -> float:
                if armed[0]:
                    armed[0] = False
                    ledger.release(earlier.id, first)  # the entry changed meanwhile
                return float(next(ticks))

            ledger.clock = clock
            seq = C.hand_out(acks, earlier.id) if compiled else None
            if seq is None:  # declined: the store's own step, as ``store_hand_out``
                seq = acks.hand_out(earlier.id)
            e = ledger.entries[earlier.id]
            assert seq in e.out
            return sorted(e.out), e.debt, sorted(ledger.owed.values())

    assert run(True) == run(False)


def test_the_c_put_sees_a_class_attribute_replaced_after_its_first_read(
    monkeypatch: pytest.MonkeyPatch, make_config: Any
) -> None:
    """The C core reads the writer's ``__slots__`` at their offsets, remembered per class: a
    class changed afterwards (here ``_pending`` made a property that reports a put in
    progress) is looked up again, so the core declines the duplicate and the reference raises,
    as ``getattr`` would have it."""
    assert C is not None
    first = _spied(monkeypatch, _store, "_put_plain", C.put_plain)
    rng = np.random.default_rng(0)
    with ShmObjectStore.create(make_config(1 << 20)) as store:
        store.put("first", ITEMS[0](rng))  # the slots' offsets remembered
        monkeypatch.setattr(StoreWriter, "_pending", property(lambda self: {"dup": None}))
        with pytest.raises(DuplicateKeyError):
            store.put("dup", ITEMS[0](rng))
        monkeypatch.undo()
        assert first == [True, False]  # the duplicate declined, before any side effect
        seen = _spied(monkeypatch, _store, "_put_plain", C.put_plain)
        store.put("dup", ITEMS[0](rng))  # the slot again: the core's put
        assert store.keys() == ["first", "dup"]
    assert seen == [True]


def test_the_c_one_item_miss_calls_a_keep_updates_replaced_on_the_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-item miss keeps the prompt updates inline only while ``SenderBook.keep_updates``
    is the class's own (a book has no instance dict to shadow it): replaced on the class, the
    core calls the replacement, as the request would."""
    assert C is not None
    seen = _spied(monkeypatch, _request, "_put_item", C.put_item)
    kept: list[str] = []
    own = SenderBook.keep_updates

    def counted(self: SenderBook, mm_hash: str, updates: Any) -> None:
        kept.append(mm_hash)
        own(self, mm_hash, updates)

    rng = np.random.default_rng(0)
    with SenderCache(CacheConfig(1 << 20, 200 * 1024, 1)) as cache:
        cache.get_and_update_item((ITEMS[0](rng), ("u",)), "inline")
        monkeypatch.setattr(SenderBook, "keep_updates", counted)
        cache.get_and_update_item((ITEMS[0](rng), ("v",)), "called")
        assert kept == ["called"]
        assert cache.get_and_update_item(None, "called")[1] == ["v"]
        assert cache.get_and_update_item(None, "inline")[1] == ["u"]
    assert seen[:2] == [True, True]  # both puts made by the core


# --- the compiled eviction pass (``put_plain`` makes its own room) -------------------------------

#: items of 1-90 KiB: a 256 KiB ring holds a few, so most puts free the oldest first (or wrap)
EVICT_ITEMS: list[Callable[[np.random.Generator], object]] = [
    lambda r: {"a": r.integers(0, 255, 1024, dtype=np.uint8)},
    lambda r: {"a": r.integers(0, 255, 20_000, dtype=np.uint8)},
    lambda r: {"a": r.integers(0, 255, 45_000, dtype=np.uint8), "n": 3},
    lambda r: {"a": r.integers(0, 255, 90_000, dtype=np.uint8)},
]
EVICT_KEYS = st.sampled_from([f"e{i}" for i in range(10)])
EVICT_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), EVICT_KEYS, st.integers(0, len(EVICT_ITEMS) - 1)),
        st.tuples(st.sampled_from(["hit", "read", "pin", "unpin", "touch"]), EVICT_KEYS),
        st.tuples(st.sampled_from(["invalidate", "release"]), EVICT_KEYS),
    ),
    min_size=1,
    max_size=60,
)


def _run_evicting(
    ops: list[tuple[Any, ...]], seed: int, second_chance: bool, slack: int
) -> tuple[list[object], bytes]:
    """Store puts that evict: hits (second-chance marks), a live reader that reads (so
    acknowledges) some of its hand-outs and owes the rest, pins, touches, invalidations,
    releases. The answers, the writer's maps, the ledger, the header words after each step,
    and the ring's bytes."""
    rng = np.random.default_rng(seed)
    store = _store_for(f"{RUN_PREFIX}diffev-{uuid.uuid4().hex[:10]}")
    store.second_chance = second_chance
    store.evict_slack = slack
    ticks = iter(range(1, 1 << 30))
    store._ledger.clock = lambda: float(next(ticks))
    evicted: list[str] = []
    store.on_evict = evicted.append
    reader = ShmObjectStore.from_handle(store.handle())
    refs: dict[str, ShmRef] = {}
    answers: list[object] = []
    try:
        for op in ops:
            kind, key = op[0], op[1]
            try:
                if kind == "put":
                    ref = store.put(key, EVICT_ITEMS[op[2]](rng))
                    refs[key] = ref
                    answers.append(("put", _ref_fields(ref)))
                elif kind == "hit":
                    hit = store.get_cached(key)
                    refs.update({} if hit is None else {key: hit})
                    answers.append(("hit", None if hit is None else _ref_fields(hit)))
                elif kind == "read" and key in refs:  # acknowledged (or a stale error)
                    answers.append(("read", sorted(reader.get(refs[key]))))
                elif kind == "pin":
                    answers.append(("pin", store.pin(key)))
                elif kind == "unpin":
                    store.unpin(key)
                elif kind == "touch":
                    answers.append(("touch", store.touch(key)))
                elif kind == "invalidate":
                    answers.append(("invalidate", store.invalidate(key)))
                elif kind == "release" and key in refs:
                    answers.append(("release", store.release(refs[key])))
            except Exception as exc:
                answers.append(("error", type(exc).__name__, str(exc)))
            words = [w if i not in _INSTANCE_WORDS else 0 for i, w in enumerate(store.words[:64])]
            answers.append(
                (
                    sorted(store.keys()),
                    sorted(store._evict.marked.items()),
                    list(evicted),
                    store.evictions,
                    store.ring.used_bytes,
                    store.ring.chunk_ids(),
                    _ledger_state(store),
                    words,
                )
            )
        return answers, bytes(store.ring.buf)
    finally:
        reader.close()
        store.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(EVICT_OPS, st.integers(0, 2**32 - 1), st.booleans(), st.sampled_from([0, 16 << 10]))
def test_puts_that_evict_answer_alike_and_leave_the_same_state_on_both_cores(
    monkeypatch: pytest.MonkeyPatch,
    ops: list[tuple[Any, ...]],
    seed: int,
    second_chance: bool,
    slack: int,
) -> None:
    """The compiled eviction pass of ``put_plain`` against ``Eviction.make_room``: the same
    answers and errors, the same keys, marks, evicted keys (``on_evict``), counters, ring
    bookkeeping, ledger and header words after every step, and the same ring bytes, with
    second chance on or off, with and without batch slack."""
    with_c, pure = on_both_cores(
        monkeypatch, lambda: _run_evicting(ops, seed, second_chance, slack)
    )
    assert with_c[0] == pure[0]
    assert with_c[1] == pure[1]


def test_the_c_put_evicts_the_usual_way_and_declines_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not vacuous: a put that must free the oldest items (nothing owed, pinned or marked) or
    wrap is made by ``put_plain`` itself; one whose room needs the Python policy — the head
    marked by a hit (a relocation), owed to a reader, or pinned — is declined (None), and
    ``make_room`` runs."""
    assert C is not None
    seen = _spied(monkeypatch, _store, "_put_plain", C.put_plain)
    store = _store_for(f"{RUN_PREFIX}diffev1-{uuid.uuid4().hex[:10]}")
    blob = {"a": np.ones(60_000, np.uint8)}  # four fit a 256 KiB ring
    try:
        for i in range(12):  # lap after lap: every put after the fourth frees the oldest
            store.put(f"k{i}", blob)
        assert all(seen) and store.evictions >= 8
        seen.clear()
        store.get_cached(store.keys()[0])  # the head is marked: its second chance
        store.put("marked", blob)
        assert seen[0] is False and store.relocations == 1  # declined: make_room moved it
        seen.clear()
        reader = ShmObjectStore.from_handle(store.handle())
        try:  # hand-outs owed by a live reader that never acknowledges: the ledger decides
            for i in range(6):
                store.put(f"owed{i}", blob)
        except Exception as exc:
            assert type(exc).__name__ == "CacheFullError"
        finally:
            reader.close()
        assert False in seen
        seen.clear()
        store.drain()
        store.evict()
        store.put("p0", blob)
        assert store.pin("p0")
        for i in range(5):  # the pinned head stops the pass: the reference raises
            try:
                store.put(f"after-pin{i}", blob)
            except Exception as exc:
                assert type(exc).__name__ == "CacheFullError"
        assert seen[0] is True and False in seen[1:]
    finally:
        store.close()


def test_a_touch_whose_time_runs_code_when_freed_is_the_reference_s_to_end(
    make_config: Any,
) -> None:
    """A review's case: the compiled hand-out of a touched entry ended the touch (freeing the
    clock's object, whose finalizer ran Python code) and then wrote the counts it had read
    before it. It now declines an entry whose touch or new time is not a plain float, int or
    None, and the reference keeps what the finalizer did."""
    assert C is not None

    def run(compiled: bool) -> tuple[object, int, int]:
        with SenderCache(make_config(1 << 20)) as cache:
            store = cache.store
            acks, ledger = store._acks, store._ledger
            with ShmObjectStore.from_handle(store.handle()):
                cache.get_and_update_item(({"x": np.ones(3)}, []), "a")  # syncs the session
                (session,) = acks.live_sessions

                class Stamp(float):
                    def __del__(self) -> None:
                        ledger.owed[session] = ledger.owed.get(session, 0) + 100

                ledger.clock = lambda: Stamp(5.0)
                e = ledger.debts_of(10**6)
                ledger.touch(e)  # its touch: a Stamp, held by the entry only
                seq = C.hand_out(acks, 10**6) if compiled else None
                if seq is None:  # declined: the store's own step
                    seq = acks.hand_out(10**6)
                return seq, ledger.owed[session], int(store._readers.owed_words[0])

    with_c, pure = run(True), run(False)
    assert with_c == pure and with_c[1] >= 100
