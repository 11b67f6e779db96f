"""``AsyncSenderCache.get_or_put``: single-flight puts (one ``make`` per new hash among callers).

Every test ends by reading every hand-out it was given with an in-process reader and checking
that nothing is owed any more (reader lag 0, the item freeable): a hand-out leaked by a cancelled
or failed caller would show up there.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from anyio.abc import AsyncResource

from aioshmcache import (
    AsyncSenderCache,
    CacheSnapshot,
    FeatureSpec,
    ReceiverCache,
    ShmRef,
)
from aioshmcache.aio import SingleFlightStats

from .helpers import checksum, random_item

MiB = 1 << 20
N = 50


async def _until(pred: Callable[[], bool]) -> None:
    """Wait (on the loop) until ``pred()`` holds; fail after a generous deadline."""
    deadline = time.monotonic() + 30.0
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached before the deadline")
        await anyio.sleep(0.005)


def _nothing_owed(snap: CacheSnapshot) -> bool:
    return all(r.lag == 0 for r in snap.readers if r.attached)


async def _read_all(
    cache: AsyncSenderCache, rx: ReceiverCache, out: list[FeatureSpec], item: dict[str, Any]
) -> None:
    """Read every hand-out; each must be the item. Then nothing is owed."""
    back = rx.get_and_update_features(out)
    for f in back:
        assert checksum(f.data["data"]) == item["crc"]
        assert np.array_equal(f.data["data"], item["data"])
    await _until(lambda: _nothing_owed(cache.snapshot()))
    for h in cache.cached_order():
        assert cache.is_freeable(h)


def _distinct_refs(out: list[FeatureSpec]) -> list[ShmRef]:
    refs = [f.data for f in out if isinstance(f.data, ShmRef)]
    assert len({(r.id, r.seq) for r in refs}) == len(refs), "two callers got the same hand-out"
    return refs


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_fifty_callers_of_one_new_hash_run_make_once(make_config: Any, kind: str) -> None:
    item = random_item(np.random.default_rng(1), 256 * 1024)
    runs = 0
    go_thread = threading.Event()
    go_loop = anyio.Event()

    def make_sync() -> dict[str, Any]:
        nonlocal runs
        runs += 1
        if not go_thread.wait(60):
            raise TimeoutError("the test never let make finish")
        return item

    async def make_async() -> dict[str, Any]:
        nonlocal runs
        runs += 1
        await go_loop.wait()
        return item

    make: Callable[[], Any] = make_sync if kind == "sync" else make_async
    out: list[FeatureSpec] = []
    async with AsyncSenderCache.from_config(make_config(8 * MiB, 4 * MiB, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:

            async def call(i: int) -> None:
                out.append(await cache.get_or_put("h", make, identifier=f"id{i}"))

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(N):
                        tg.start_soon(call, i)
                    await _until(lambda: cache.single_flight_stats().calls == N)
                    go_thread.set()
                    go_loop.set()
            finally:
                go_thread.set()
            assert runs == 1
            assert len(out) == N
            assert sorted(f.identifier or "" for f in out) == sorted(f"id{i}" for i in range(N))
            assert len(_distinct_refs(out)) == N  # every caller its own hand-out
            assert cache.single_flight_stats() == SingleFlightStats(
                calls=N, hits=0, runs=1, saved=N - 1, failures=0, takeovers=0
            )
            assert cache.single_flight_stats().saved == N - 1
            assert cache.inline_busy == 0  # the waiters came after the put had committed
            await _read_all(cache, rx, out, item)
            # now a hit: make is not called again
            again = await cache.get_or_put("h", make)
            assert isinstance(again.data, ShmRef) and runs == 1
            await _read_all(cache, rx, [again], item)


class BoomError(RuntimeError):
    pass


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_failure_reaches_every_waiter_and_caches_nothing(
    make_config: Any, kind: str
) -> None:
    item = random_item(np.random.default_rng(2), 4096)
    runs = 0
    release = threading.Event()

    def fail_sync() -> Any:
        nonlocal runs
        runs += 1
        release.wait(60)
        raise BoomError("preprocessing failed")

    async def fail_async() -> Any:
        nonlocal runs
        runs += 1
        await anyio.to_thread.run_sync(release.wait, 60)
        raise BoomError("preprocessing failed")

    make = fail_sync if kind == "sync" else fail_async
    errors: list[BaseException] = []
    async with AsyncSenderCache.from_config(make_config(4 * MiB, 2 * MiB, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:

            async def call() -> None:
                try:
                    await cache.get_or_put("bad", make)
                except BoomError as exc:
                    errors.append(exc)

            try:
                async with anyio.create_task_group() as tg:
                    for _ in range(10):
                        tg.start_soon(call)
                    await _until(lambda: cache.single_flight_stats().calls == 10)
                    release.set()
            finally:
                release.set()
            assert runs == 1
            assert len(errors) == 10  # every caller got it, as the same type
            assert all(str(e) == "preprocessing failed" for e in errors)
            assert sum(e.__cause__ is not None for e in errors) == 9  # waiters: chained
            assert not cache.is_cached("bad") and cache.cached_order() == []
            assert cache.single_flight_stats().failures == 1
            # the next call tries again
            got = await cache.get_or_put("bad", lambda: item)
            assert isinstance(got.data, ShmRef)
            assert cache.single_flight_stats().runs == 2
            await _read_all(cache, rx, [got], item)


def _blocking_first_put(
    cache: AsyncSenderCache, started: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> threading.Event:
    """Make the first put's copy (a job in a worker thread) block until the event is set: the
    serde's write into the chunk, which runs outside the writer's lock. (Blocking where the
    copy takes its chunk's view, under the lock, held the lock: the event loop's next step
    that took it waited for the event's 60-second timeout.)"""
    serde_type = type(cache.sender.store.serde)
    original = serde_type.write
    release = threading.Event()
    first = [True]

    def write(self: Any, plan: Any, dst: Any) -> Any:
        if first[0]:
            first[0] = False
            started.set()
            release.wait(60)
        return original(self, plan, dst)

    monkeypatch.setattr(serde_type, "write", write)
    return release


@pytest.mark.parametrize("point", ["in_async_make", "in_sync_make", "after_make", "in_put"])
async def test_cancelling_the_first_caller_hands_the_flight_over(
    make_config: Any, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = random_item(np.random.default_rng(3), 2 * MiB)
    runs: list[str] = []
    leader_release = threading.Event()
    leader_made = anyio.Event()
    waiters_in = anyio.Event()
    put_started = threading.Event()

    async def leader_make_async() -> Any:
        runs.append("leader")
        await anyio.sleep(3600)  # cancelled before it returns

    def leader_make_sync() -> Any:
        runs.append("leader")
        leader_release.wait(60)
        return item

    async def leader_make_then_signal() -> Any:
        runs.append("leader")
        await waiters_in.wait()
        leader_made.set()
        return item

    def waiter_make() -> Any:
        runs.append("waiter")
        return item

    leader_make: Callable[[], Any] = {
        "in_async_make": leader_make_async,
        "in_sync_make": leader_make_sync,
        "after_make": leader_make_then_signal,
        "in_put": leader_make_then_signal,
    }[point]
    cfg = make_config(16 * MiB, 8 * MiB, 1)
    async with AsyncSenderCache.from_config(cfg, inline_threshold_bytes=0) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            put_release = (
                _blocking_first_put(cache, put_started, monkeypatch)
                if point == "in_put"
                else threading.Event()
            )
            try:
                leader = asyncio.ensure_future(cache.get_or_put("h", leader_make))
                await _until(lambda: bool(runs))
                waiters = [
                    asyncio.ensure_future(cache.get_or_put("h", waiter_make)) for _ in range(5)
                ]
                await _until(lambda: cache.single_flight_stats().calls == 6)
                waiters_in.set()
                if point in ("after_make", "in_put"):
                    await leader_made.wait()
                if point == "in_put":
                    await _until(put_started.is_set)
                leader.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leader
                put_release.set()
                leader_release.set()
                with anyio.fail_after(60):  # a waiter must never hang on a leader that left
                    out = list(await asyncio.gather(*waiters))
            finally:
                put_release.set()
                leader_release.set()
            stats = cache.single_flight_stats()
            assert stats.takeovers == 1
            # a make that had returned is not run again: the new leader only puts the item
            made_before = point in ("after_make", "in_put")
            assert runs == (["leader"] if made_before else ["leader", "waiter"])
            assert stats.saved == 4
            assert len(out) == 5
            _distinct_refs(out)
            for f in out:  # its own hand-out, or the item inline (if the put was still pending)
                if not isinstance(f.data, ShmRef):
                    assert f.data is item
            # the cancelled leader's request rolls back (in its thread, if one ran on)
            await _until(lambda: not cache.sender.store.is_pending("h"))
            await _read_all(cache, rx, out, item)


async def test_a_cancelled_waiter_leaves_the_others_alone(make_config: Any) -> None:
    item = random_item(np.random.default_rng(4), 4096)
    go = anyio.Event()

    async def make() -> Any:
        await go.wait()
        return item

    async with AsyncSenderCache.from_config(make_config(4 * MiB, 2 * MiB, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            leader = asyncio.ensure_future(cache.get_or_put("w", make))
            waiters = [asyncio.ensure_future(cache.get_or_put("w", make)) for _ in range(3)]
            await _until(lambda: cache.single_flight_stats().calls == 4)
            waiters[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiters[0]
            go.set()
            out = [await leader, *await asyncio.gather(*waiters[1:])]
            assert len(_distinct_refs(out)) == 3
            assert cache.single_flight_stats().runs == 1
            await _read_all(cache, rx, out, item)


async def test_a_hit_never_calls_make(make_config: Any) -> None:
    item = random_item(np.random.default_rng(5), 4096)
    calls = 0

    def make() -> Any:
        nonlocal calls
        calls += 1
        return item

    async with AsyncSenderCache.from_config(make_config(4 * MiB, 2 * MiB, 1)) as cache:
        with ReceiverCache.attach(cache.handle()) as rx:
            [first] = await cache.get_and_update_features(
                [FeatureSpec("c", item, prompt_updates=("u",))]
            )
            out = [await cache.get_or_put("c", make) for _ in range(3)]
            assert calls == 0
            assert all(f.prompt_updates == ("u",) for f in out)  # the stored ones
            assert cache.single_flight_stats() == SingleFlightStats(calls=3, hits=3)
            assert len(_distinct_refs([first, *out])) == 4
            await _read_all(cache, rx, [first, *out], item)


async def test_a_too_large_item_comes_back_inline_to_every_caller(make_config: Any) -> None:
    item = random_item(np.random.default_rng(6), 256 * 1024)  # over max_object_bytes
    runs = 0
    go = anyio.Event()

    async def make() -> Any:
        nonlocal runs
        runs += 1
        await go.wait()
        return item

    async with AsyncSenderCache.from_config(make_config(1 * MiB, 64 * 1024, 1)) as cache:
        out: list[FeatureSpec] = []

        async def call() -> None:
            out.append(await cache.get_or_put("big", make))

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(call)
            await _until(lambda: cache.single_flight_stats().calls == 10)
            go.set()
        assert runs == 1
        assert all(f.data is item for f in out)
        assert cache.cached_order() == [] and cache.snapshot().inline_too_large == 10
        assert cache.single_flight_stats().saved == 9


async def test_get_or_put_checks_the_hash(make_config: Any) -> None:
    async with AsyncSenderCache.from_config(make_config()) as cache:
        with pytest.raises(TypeError):
            await cache.get_or_put(b"h", dict)  # type: ignore[arg-type]
        assert cache.single_flight_stats().calls == 0


# --- across the processes of a cache group -----------------------------------------------------


def _group_config(name: str) -> Any:
    from aioshmcache import CacheConfig

    return CacheConfig(8 * MiB, 2 * MiB, 2, group=name)


@pytest.fixture
def group() -> Iterator[str]:
    """A group name of this run; its directory of single-flight markers is removed after."""
    import uuid

    from aioshmcache._flight import marker_directory

    from .conftest import RUN_PREFIX

    name = f"{RUN_PREFIX}sf{uuid.uuid4().hex[:8]}"
    yield name
    markers = marker_directory(name)
    assert not os.path.exists(markers)  # every marker was removed, and their directory


async def test_a_hash_of_any_str_is_put_in_a_group(group: str) -> None:
    """A hash with a lone surrogate (any ``str`` is a hash, as for a plain cache): the group's
    single-flight marker is named from it too (a review found its name's encoding raising an
    untyped ``UnicodeEncodeError`` on every call, so the item was never cached)."""
    item = random_item(np.random.default_rng(5), 1024)

    async def make() -> dict[str, Any]:
        return item

    async with AsyncSenderCache.from_config(_group_config(group)) as cache:
        for _ in range(2):
            got = await cache.get_or_put("sur\ud800rogate", make)
            assert isinstance(got.data, ShmRef)
        assert cache.single_flight_stats().runs == 1  # the second one was a hit


async def test_a_sibling_computing_the_hash_is_waited_for_not_repeated(group: str) -> None:
    """Two shards (as two gateway processes): b waits for a's make and reads a's item."""
    from aioshmcache._group import Siblings

    item = random_item(np.random.default_rng(3), 4096)
    started, release = anyio.Event(), anyio.Event()
    made: list[str] = []

    async def slow_make() -> dict[str, Any]:
        made.append("a")
        started.set()
        await release.wait()
        return item

    async def never() -> dict[str, Any]:
        made.append("b")
        return item

    cfg = _group_config(group)
    async with AsyncSenderCache.from_config(cfg) as a, AsyncSenderCache.from_config(cfg) as b:
        b.sender._siblings = Siblings(group, b.sender.store.name, rescan_interval=0.0)
        with ReceiverCache.attach_group(group) as rx:
            async with anyio.create_task_group() as tg:
                results: list[FeatureSpec] = []

                async def ask(cache: AsyncSenderCache, make: Any) -> None:
                    results.append(await cache.get_or_put("h", make))

                tg.start_soon(ask, a, slow_make)
                await started.wait()
                tg.start_soon(ask, b, never)
                await _until(lambda: b._group_flight is not None and b._group_flight.waited == 1)
                release.set()
            assert made == ["a"]  # computed once in the group
            assert b.single_flight_stats().runs == 0
            assert b.single_flight_stats().group_saved == 1
            assert b.sender.snapshot().sibling_hits == 1  # read from a's shard
            for f in rx.get_and_update_features(results):
                assert checksum(f.data["data"]) == f.data["crc"]


async def test_a_sibling_that_failed_lets_the_waiter_compute(group: str) -> None:
    started, release = anyio.Event(), anyio.Event()

    async def failing() -> dict[str, Any]:
        started.set()
        await release.wait()
        raise RuntimeError("preprocessing failed")

    made: list[str] = []

    async def works() -> dict[str, Any]:
        made.append("b")
        return random_item(np.random.default_rng(4), 1024)

    cfg = _group_config(group)
    async with AsyncSenderCache.from_config(cfg) as a, AsyncSenderCache.from_config(cfg) as b:
        async with anyio.create_task_group() as tg:

            async def lead() -> None:
                with pytest.raises(RuntimeError):
                    await a.get_or_put("h", failing)

            tg.start_soon(lead)
            await started.wait()
            got: list[FeatureSpec] = []

            async def wait() -> None:
                got.append(await b.get_or_put("h", works))

            tg.start_soon(wait)
            await _until(lambda: b._group_flight is not None and b._group_flight.waited == 1)
            release.set()
        assert made == ["b"]
        assert isinstance(got[0].data, ShmRef)
        assert b.single_flight_stats().runs == 1


def _hold_marker(group: str, conn: Any) -> None:
    """Claim the marker of "h" and sleep (to be SIGKILLed)."""
    from aioshmcache._flight import GroupFlight

    gf = GroupFlight(group)
    assert anyio.run(gf.claim, "h", lambda: False)
    conn.send("held")
    time.sleep(3600)


async def test_a_dead_siblings_marker_is_seen_dead(group: str) -> None:
    from aioshmcache._flight import GroupFlight

    from .helpers import SPAWN, kill_and_reap

    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_hold_marker, args=(group, child))
    proc.start()
    try:
        assert await anyio.to_thread.run_sync(parent.poll, 60)
        assert parent.recv() == "held"
        gf = GroupFlight(group, wait_s=60.0)
        with anyio.move_on_after(0.05):
            await gf.claim("h", lambda: False)  # held by the live child: still waiting
        assert gf.waited == 1 and not gf.holds("h")
        await anyio.to_thread.run_sync(kill_and_reap, proc)
        with anyio.fail_after(30):  # the kernel dropped the dead child's lock
            assert await gf.claim("h", lambda: False)
        gf.release("h")
    finally:
        kill_and_reap(proc)


async def test_a_sibling_hit_that_is_gone_again_is_computed_here(group: str) -> None:
    """The marker said a sibling cached it, but the copy finds it gone: make runs here."""
    made: list[str] = []

    async def make() -> dict[str, Any]:
        made.append("b")
        return random_item(np.random.default_rng(5), 1024)

    async def a_sibling_has_it(
        key: str, cached: Callable[[], bool], cached_now: Callable[[], bool] | None = None
    ) -> bool:
        return False  # "cached by a sibling" (which evicted it right after)

    async with AsyncSenderCache.from_config(_group_config(group)) as b:
        assert b._group_flight is not None
        b._group_flight.claim = a_sibling_has_it  # type: ignore[method-assign]
        out = await b.get_or_put("h", make)
        assert made == ["b"] and isinstance(out.data, ShmRef)


async def test_waiters_get_the_leaders_cache_miss_intact(make_config: Any) -> None:
    """A ``CacheMissError`` copied to a waiter keeps its message and ``mm_hashes``."""
    from aioshmcache import CacheMissError

    started = anyio.Event()

    async def fails() -> dict[str, Any]:
        started.set()
        await anyio.sleep(0.05)
        raise CacheMissError(["x1", "x2"])

    async with AsyncSenderCache.from_config(make_config(4 * MiB)) as cache:
        errors: list[BaseException] = []

        async def call() -> None:
            try:
                await cache.get_or_put("h", fails)
            except CacheMissError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await started.wait()
            tg.start_soon(call)
        assert len(errors) == 2
        for exc in errors:
            assert isinstance(exc, CacheMissError)
            assert exc.mm_hashes == ("x1", "x2")
            assert str(exc) == "not cached (resend with data): x1, x2"


async def test_concurrent_callers_of_a_hash_a_sibling_holds_never_make_it(group: str) -> None:
    """The race behind 1-2 duplicate preprocessings in 60 across two uvicorn workers.

    Shard a holds "h". Two callers in b ask for it at once: the first copies a's chunk into
    b's shard; the second, held at the instant that copy is under way, found the key pending
    (a miss), claimed the group marker, was told "a sibling has it", found it pending again
    and fell back to ``make`` — uncounted. Now a hit leads a flight: the second waits for the
    first's copy, then hits. The copy is held by a pause hook, not by load.
    """
    item = random_item(np.random.default_rng(8), 256 * 1024)
    made: list[str] = []

    async def make_a() -> dict[str, Any]:
        made.append("a")
        return item

    async def make_b() -> dict[str, Any]:
        made.append("b")
        return item

    cfg = _group_config(group)
    async with (
        AsyncSenderCache.from_config(cfg) as a,
        AsyncSenderCache.from_config(cfg, inline_threshold_bytes=0) as b,
    ):
        siblings = b.sender._siblings  # the requests' own (a copy is taken from its Sibling)
        assert siblings is not None
        siblings._interval = 0.0  # see a's shard at once
        with ReceiverCache.attach_group(group) as rx:
            first = await a.get_or_put("h", make_a)
            assert b.is_cached("h")  # from a's shard
            [sib] = siblings._by_name.values()
            entered, gate = threading.Event(), threading.Event()
            payload = sib.payload

            def held_payload(ref: ShmRef) -> memoryview:  # b's copy of a's chunk (a thread)
                entered.set()
                gate.wait(60)
                return payload(ref)

            sib.payload = held_payload  # type: ignore[method-assign]
            results: list[FeatureSpec] = []
            try:
                async with anyio.create_task_group() as tg:

                    async def ask() -> None:
                        results.append(await b.get_or_put("h", make_b))

                    tg.start_soon(ask)
                    await anyio.to_thread.run_sync(entered.wait, 60)  # the copy is under way
                    tg.start_soon(ask)
                    flight = b._flight
                    await _until(lambda: len(results) == 1 or flight.waiters("h") == 1)
                    gate.set()
            finally:
                gate.set()
            assert made == ["a"]  # never made in b
            stats = b.single_flight_stats()
            assert stats.runs == 0 and stats.hits == 2
            assert b.sender.snapshot().sibling_hits == 1  # copied once
            for f in rx.get_and_update_features([first, *results]):
                assert checksum(f.data["data"]) == f.data["crc"]


class _CountedTier(AsyncResource):
    """A second tier that serves some hashes itself (``make`` not called) and makes the rest."""

    def __init__(self, has: dict[str, Any]) -> None:
        self.has = has

    async def aclose(self) -> None:
        return None

    async def fetch_or_make(self, mm_hash: str, make: Callable[[], Any]) -> Any:
        if mm_hash in self.has:
            return self.has[mm_hash]
        return await make()

    def stats(self) -> Any:
        from aioshmcache.tier import TierSnapshot

        return TierSnapshot()


async def test_every_call_of_make_is_a_counted_run_on_every_path(group: str) -> None:
    """``runs`` (``single_flight_runs_total``) equals the calls of ``make`` after each path:
    a leader, its waiters, a failure, a cancelled leader's takeover, a tier that served the
    item (no call) or did not, a sibling's item gone before it was copied (the fallback)."""
    calls = 0
    item = random_item(np.random.default_rng(9), 4096)

    def counted(fail: bool = False, hold: anyio.Event | None = None) -> Callable[[], Any]:
        async def make() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if hold is not None:
                await hold.wait()
            if fail:
                raise BoomError("make failed")
            return item

        return make

    async def a_sibling_has_it(
        key: str, cached: Callable[[], bool], cached_now: Callable[[], bool] | None = None
    ) -> bool:
        return False  # "cached by a sibling" (which evicted it right after)

    tier = _CountedTier({"from-tier": item})
    async with AsyncSenderCache.from_config(_group_config(group), tier=tier) as b:

        def same() -> None:
            assert b.single_flight_stats().runs == calls

        async with anyio.create_task_group() as tg:  # a leader and its waiters
            for _ in range(5):
                tg.start_soon(b.get_or_put, "plain", counted())
        same()
        with pytest.raises(BoomError):
            await b.get_or_put("fails", counted(fail=True))
        same()
        leader = anyio.CancelScope()

        async def lead() -> None:
            with leader:
                await b.get_or_put("cancelled", counted(hold=anyio.Event()))

        async with anyio.create_task_group() as tg:  # the leader cancelled: a waiter re-runs
            tg.start_soon(lead)
            await _until(lambda: calls == 3)
            tg.start_soon(b.get_or_put, "cancelled", counted())
            await _until(lambda: b._flight.waiters("cancelled") == 1)
            leader.cancel()
        same()
        await b.get_or_put("from-tier", counted())  # the tier served it: make not called
        await b.get_or_put("through-tier", counted())
        same()
        assert b._group_flight is not None
        b._group_flight.claim = a_sibling_has_it  # type: ignore[method-assign]
        await b.get_or_put("sibling-gone", counted())  # the fallback: make runs after all
        same()
        assert calls == 6


async def test_a_sibling_shard_opened_after_the_last_scan_is_seen_by_the_claim(
    group: str,
) -> None:
    """b scanned the group before a's shard existed (and would not scan again for a second):
    a makes "h" and lets go of the marker; b then asks for "h". b's first look misses (a is
    not known yet), but the last look of its claim, made with the marker held, scans again and
    finds a's item: b reads it instead of making it a second time."""
    made: list[str] = []
    item = random_item(np.random.default_rng(10), 4096)

    async def make(who: str) -> dict[str, Any]:
        made.append(who)
        return item

    cfg = _group_config(group)
    async with AsyncSenderCache.from_config(cfg) as b:
        assert not b.is_cached("h")  # b's scan: no sibling yet (the next in RESCAN_INTERVAL)
        assert b.sender._siblings is not None
        # not for an hour, however long a loaded host takes to get to b's request (past the
        # one second, b's first look scanned again and simply found a's item)
        b.sender._siblings._interval = 3600.0
        async with AsyncSenderCache.from_config(cfg) as a:
            with ReceiverCache.attach_group(group) as rx:
                first = await a.get_or_put("h", lambda: make("a"))
                second = await b.get_or_put("h", lambda: make("b"))
                assert made == ["a"]
                assert b.single_flight_stats().group_saved == 1
                for f in rx.get_and_update_features([first, second]):
                    assert checksum(f.data["data"]) == f.data["crc"]
