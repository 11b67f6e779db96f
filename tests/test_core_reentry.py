"""Python code run in the middle of a compiled put cannot make it write from what it read before.

The compiled put (``put_plain``) reads the ring, plans the eviction pass, then writes. Two kinds
of Python code can run in between: the readers' log drain that the pass starts with (and any
finalizer a collection started by one of its allocations runs), and an ``on_evict`` hook. A
review made either put another key into the same store meanwhile: the outer put then wrote its
chunk where the inner one had just been written, and "inner" served the outer item's bytes. Now
the put reads the ring and the key again after the drain and declines to the reference if
anything changed, and declines any hook but the sender's own (which it runs inline, keeping
the values it drops until the put is done); the pure core, the reference, was never affected.
"""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aioshmcache import CacheConfig, ShmObjectStore, _acks, _core_py
from aioshmcache import _layout as L
from aioshmcache._acks import Acknowledgements
from aioshmcache.store import StoreWriter

from .conftest import RUN_PREFIX
from .test_differential_store import on_both_cores


def _big(v: float) -> dict[str, Any]:
    return {"x": np.full(512, v, dtype=np.float64)}  # 4 KiB


def _small(v: float) -> dict[str, Any]:
    return {"x": np.full(8, v, dtype=np.float64)}


def _scenario(smalls: int, arm: Callable[[StoreWriter], Any]) -> dict[str, float | str]:
    """A 64 KiB ring one lap full of 4 KiB items, ``smalls`` small ones after them, then an
    outer 4 KiB put that must evict, with ``arm(store)`` set up around it (it puts "inner"
    once, mid-put). What every key reads back through a reader."""
    cfg = CacheConfig(1 << 16, 1 << 15, 2, name=f"{RUN_PREFIX}reentry-{uuid.uuid4().hex[:10]}")
    with ShmObjectStore.create(cfg) as store:
        for i in range(16):
            store.put(f"b{i}", _big(i))
        for j in range(smalls):
            store.put(f"s{j}", _small(100 + j))
        with arm(store):
            store.put("outer", _big(-2))
        seen: dict[str, float | str] = {}
        with ShmObjectStore.from_handle(store.handle()) as reader:
            keys = [f"b{i}" for i in range(16)] + [f"s{j}" for j in range(smalls)]
            for key in [*keys, "inner", "outer"]:
                ref = store.get_cached(key)
                seen[key] = "evicted" if ref is None else float(reader.get(ref)["x"][0])
        return seen


class _Once:
    """Puts "inner" the first time it is called."""

    def __init__(self, store: StoreWriter) -> None:
        self.store = store
        self.done = False

    def __call__(self, *_: Any) -> None:
        if not self.done:
            self.done = True
            self.store.put("inner", _small(-1))


def _hook(store: StoreWriter) -> Any:
    """An ``on_evict`` hook that puts "inner" at the first eviction."""
    import contextlib

    @contextlib.contextmanager
    def armed() -> Iterator[None]:
        store.on_evict = _Once(store)
        try:
            yield
        finally:
            store.on_evict = None

    return armed()


def _collection_in_drain(store: StoreWriter) -> Any:
    """A collection started inside the readers' log drain whose callback (as a finalizer
    could) puts "inner". The drain is the reference's, in Python: the compiled one
    (``drain_logs``) keeps the collector off, but the compiled put still calls a drain that
    is not the reference's (a subclass's) and declines to it."""
    import contextlib

    once = _Once(store)
    reference = Acknowledgements.drain
    drain = reference.__code__

    def python_drain(acks: Acknowledgements) -> int:
        return reference(acks)

    def callback(phase: str, info: dict[str, Any]) -> None:
        frame = inspect.currentframe()
        while frame is not None and frame.f_code is not drain:
            frame = frame.f_back
        if phase == "start" and frame is not None:
            once()

    @contextlib.contextmanager
    def armed() -> Iterator[None]:
        m = pytest.MonkeyPatch()
        m.setattr(Acknowledgements, "drain", python_drain)
        m.setattr(_acks, "_drain_logs", _core_py.drain_logs)
        gc.collect()
        threshold = gc.get_threshold()
        gc.callbacks.append(callback)
        gc.set_threshold(1)
        try:
            yield
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(callback)
            m.undo()
        assert once.done, "no collection started in the drain"

    return armed()


@pytest.mark.parametrize("arm", [_hook, _collection_in_drain], ids=["on_evict", "finalizer"])
@pytest.mark.parametrize("smalls", [1, 3, 7])
def test_a_put_made_amid_a_compiled_put_keeps_every_key_its_own_bytes(
    arm: Callable[[StoreWriter], Any], smalls: int
) -> None:
    """Every key reads its own bytes (or is evicted), "inner" (put mid-way) and "outer" too,
    and the compiled put ends as the reference does."""
    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, lambda: _scenario(smalls, arm))
    assert with_c["outer"] == -2.0 and with_c["inner"] in (-1.0, "evicted")
    assert with_c == pure


@pytest.mark.parametrize("outer", ["hit", "miss"])
def test_a_call_counted_amid_a_compiled_one_is_counted_too(outer: str) -> None:
    """The ledger's clock (Python code the compiled hand-out calls; a collection's finalizer
    could do the same) makes one more hit on the same sender mid-call: both calls are counted,
    in the counters and in the header's words, as the reference counts them. The compiled call
    read the counters before its hand-out and wrote them after, losing the inner call's count."""
    from aioshmcache import ReceiverCache, SenderCache

    def run() -> tuple[object, object]:
        name = f"{RUN_PREFIX}count-{uuid.uuid4().hex[:10]}"
        with (
            SenderCache(CacheConfig(1 << 20, 1 << 18, 1, name=name)) as cache,
            ReceiverCache.attach(cache.handle()),  # a reader: each hand-out reads the clock
        ):
            cache.get_and_update_item((_small(1), ()), "a")
            ledger = cache.store._ledger
            real = ledger.clock
            nested: list[None] = []

            def clock() -> float:
                if not nested:
                    nested.append(None)
                    cache.get_and_update_item(None, "a")  # a hit, inside the outer call
                return real()

            before, snap = cache.make_stats(), cache.snapshot()
            ledger.clock = clock
            try:
                if outer == "hit":
                    cache.get_and_update_item(None, "a")
                else:
                    cache.get_and_update_item((_small(2), ()), "b")
            finally:
                ledger.clock = real
            assert nested
            after, snap2 = cache.make_stats(), cache.snapshot()
            counts = (after.total - before.total, after.hits - before.hits)
            return counts, (snap2.hits - snap.hits, snap2.misses - snap.misses)

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    expected = ((2, 2), (2, 0)) if outer == "hit" else ((2, 1), (1, 1))
    assert (with_c, pure) == (expected, expected)


class _Key(str):
    """A key whose ``__hash__`` and ``__eq__`` are Python code: each call counted, and the first
    one after ``arm`` runs ``act`` (a put into the same store, a close) before answering."""

    calls = 0
    act: Callable[[], object] | None = None
    collides_with: str | None = None  # hash as this key does: a put of it compares the two

    def __hash__(self) -> int:
        type(self).calls += 1
        act, type(self).act = type(self).act, None
        if act is not None:
            act()
        return str.__hash__(self if self.collides_with is None else self.collides_with)

    def __eq__(self, other: object) -> bool:
        type(self).calls += 1
        act, type(self).act = type(self).act, None
        if act is not None:
            act()
        return str.__eq__(self, other)


def _keys_held(store: StoreWriter) -> set[type]:
    """The types of every key the store's index holds."""
    keys = store.keys()  # a list in FIFO order (the store is no mapping)
    return {type(k) for k in keys}


@pytest.mark.parametrize("when", ["evicted", "published beside"])
def test_a_key_given_as_a_str_subclass_runs_no_code_of_its_own_in_a_put(when: str) -> None:
    """A key is kept as its characters alone (an exact ``str``). A review found a ``str``
    subclass's ``__hash__`` / ``__eq__`` run by the compiled put amid its changes: when the key
    was evicted (the frees' index look-up), a put made from there took the outer put's chunk
    and id ("inner" read the outer item's bytes); when the new key's shard held it, the publish
    stored a stale bytes-used word, or wrote the header after a close (a crash)."""

    def run() -> tuple[dict[str, float | str], set[type], int]:
        cfg = CacheConfig(
            256 * 1024, 200 * 1024, 1, name=f"{RUN_PREFIX}key-{uuid.uuid4().hex[:10]}"
        )
        with ShmObjectStore.create(cfg) as store:
            _Key.calls, _Key.act = 0, None

            def inner() -> None:
                store.put("inner", {"x": np.full(100, -1.0)})

            if when == "evicted":
                k = _Key("evil")
                store.put(k, {"x": np.full(7000, 1.0)})  # ~55 KiB: four fill the ring
                for i in range(3):
                    store.put(f"fill{i}", {"x": np.full(7000, 2.0 + i)})
            else:
                k = _Key("evil")
                k.collides_with = "outer"
                store.put(k, {"x": np.full(8, 1.0)})
            stored_calls = _Key.calls
            _Key.act = inner
            store.put("outer", {"x": np.full(7000, 9.0)})
            seen: dict[str, float | str] = {}
            with ShmObjectStore.from_handle(store.handle()) as reader:
                for key in ("evil", "fill0", "inner", "outer"):
                    ref = store.get_cached(key)
                    seen[key] = "absent" if ref is None else float(reader.get(ref)["x"][0])
            assert store.words[L.H_BYTES_USED] == store.ring.used_bytes
            return seen, _keys_held(store), _Key.calls - stored_calls

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    seen, held, calls = with_c
    assert (held, calls) == ({str}, 0)  # kept as a str: none of its code ran in the later put
    assert seen["outer"] == 9.0 and seen["inner"] == "absent"
    assert with_c == pure


def test_a_close_from_a_colliding_key_s_code_cannot_happen_amid_a_publish() -> None:
    """The crash of the review, in a process of its own: a stored key whose ``__eq__`` closed
    the store when the compiled publish compared it with the new key (the header's words were
    then written to unmapped memory). The key is kept as a plain ``str``: nothing runs."""
    name = f"{RUN_PREFIX}close-{uuid.uuid4().hex[:10]}"
    script = f"""
import numpy as np
from aioshmcache import CacheConfig, ShmObjectStore
class K(str):
    def __hash__(self):
        return hash("k2")
    def __eq__(self, other):
        store.close()
        return str.__eq__(self, other)
store = ShmObjectStore.create(CacheConfig(1 << 18, 1 << 17, 1, name="{name}"))
store.put(K("evil"), {{"x": np.zeros(10)}})
store.put("k2", {{"x": np.arange(10.0)}})
print(sorted(store.keys()))
store.close()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["['evil',", "'k2']"]


def test_the_sender_keeps_hashes_given_as_str_subclasses_as_plain_str() -> None:
    """Through every sender entry point that stores a hash (the one-item miss, a request of
    several, a request over features, and their fall-backs on the pure core), the index and
    the book of prompt updates hold exact ``str``s; a look-up by the subclass still finds them."""
    from aioshmcache import FeatureSpec, SenderCache

    def run() -> tuple[set[type], set[type], list[bool]]:
        name = f"{RUN_PREFIX}hashes-{uuid.uuid4().hex[:10]}"
        with SenderCache(CacheConfig(1 << 20, 1 << 18, 1, name=name)) as cache:
            cache.get_and_update_item((_small(1), ("u",)), _Key("a"))
            cache.get_and_update([(_small(2), ()), (_small(3), ())], [_Key("b"), "c"])
            cache.get_and_update_features(
                [FeatureSpec(_Key("d"), _small(4)), FeatureSpec("e", _small(5))]
            )
            book = cache._prompt_updates
            kept = {type(k) for shard in book.shards for k in shard}
            found = [cache.is_cached(_Key(h)) for h in "abcde"]
            return _keys_held(cache.store), kept, found

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    assert with_c == pure == ({str}, {str}, [True] * 5)


def test_a_collection_amid_the_sender_s_frees_cannot_put_into_their_room() -> None:
    """A review started a collection amid the compiled eviction pass of a sender's put (the
    list of dropped prompt updates was the one object it allocated there that the collector
    tracks) and put "inner" from its callback, as a finalizer could: the frees were applied,
    the outer put's chunk not yet allocated, so "inner" took the same chunk and id and read
    the outer item's bytes. That list is now made before the first change: every key reads
    its own bytes, or is absent, as on the pure core."""
    from aioshmcache import SenderCache

    def run() -> dict[str, float | str]:
        name = f"{RUN_PREFIX}frees-{uuid.uuid4().hex[:10]}"
        cfg = CacheConfig(1 << 16, 1 << 15, 2, name=name, second_chance=False)
        with SenderCache(cfg) as cache:
            store = cache.store
            for i in range(16):
                cache.get_and_update_item((_big(i), ()), f"b{i}")
            for j in range(3):
                cache.get_and_update_item((_small(100 + j), ()), f"s{j}")
            present = [f"b{i}" for i in range(16) if store.is_cached(f"b{i}")]
            once = _Once(store)
            primed: list[object] = []

            def callback(phase: str, info: dict[str, Any]) -> None:
                if phase == "stop":  # one tracked object: the next allocation collects
                    primed.append([])
                if phase != "start" or once.done or store.is_cached("outer"):
                    return
                if not all(store.is_cached(k) for k in present):  # amid the pass
                    once()

            gc.collect()
            threshold = gc.get_threshold()
            gc.callbacks.append(callback)
            gc.set_threshold(1)
            try:
                cache.get_and_update_item((_big(-2), ()), "outer")
            finally:
                gc.set_threshold(*threshold)
                gc.callbacks.remove(callback)
            seen: dict[str, float | str] = {}
            with ShmObjectStore.from_handle(store.handle()) as reader:
                for key in ("inner", "outer"):
                    ref = store.get_cached(key)
                    seen[key] = "absent" if ref is None else float(reader.get(ref)["x"][0])
            return seen

    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, run)
    for seen in (with_c, pure):
        assert seen["outer"] == -2.0 and seen["inner"] in (-1.0, "absent"), seen
