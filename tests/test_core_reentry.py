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
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aioshmcache import CacheConfig, ShmObjectStore, _acks, _core_py
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
