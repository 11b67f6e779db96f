"""The sync caches and their async twins offer the same public surface: methods and properties.

Every public name of one face exists on the other, of the same kind (a property stays a
property; a sync method is an ``async def`` on the async face unless it only reads state), or
is listed below with the reason it differs. The lists are checked too: a name listed as
one-sided that the other face gains (or that no longer exists) fails, so they cannot go stale.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioshmcache
from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheConfig,
    FeatureSpec,
    MsgpackSerde,
    ReceiverCache,
    SenderCache,
    ShmRef,
)
from aioshmcache._request import SenderRequest
from aioshmcache._store import StoreWriter
from aioshmcache._store_reader import StoreReader
from aioshmcache.cache import GroupReceiverCache, Receiver

from .conftest import RUN_PREFIX

#: names only the sync face has, and why
SYNC_ONLY = {
    "close": "the async face's is aclose (the one name that differs between twins)",
    "store": "the store's calls block: from a loop reach it as .sender.store / .receiver.store",
}
#: names only the async face has, and why
ASYNC_ONLY = {
    "aclose": "close, awaited",
    "from_config": "the async sender is built before the loop runs, opened by async with",
    "limiter": "the worker threads of big copies: the sync face copies in the caller's thread",
    "make_limiter": "the worker threads of get_or_put's sync make",
    "sender": "the wrapped sync cache",
    "receiver": "the wrapped sync cache",
    "get_or_put": "single flight joins concurrent tasks: only tasks have it",
    "single_flight_stats": "the counters of get_or_put",
    "tier": "the second tier (aioshmcache.tier.RedisTier) get_or_put looks in: async only",
    "tier_stats": "the counters of that tier",
    "inline_threshold_bytes": "copies below it run on the loop, bigger ones in a worker thread",
}
#: sync methods that stay plain (not awaited) on the async face: they only read state
NOT_AWAITED = {
    "handle",
    "make_stats",
    "is_cached",
    "is_freeable",
    "snapshot",
    "cached_order",
    "lease",  # an async context manager on the async face
}


def _public(cls: type) -> dict[str, Any]:
    return {n: inspect.getattr_static(cls, n) for n in dir(cls) if not n.startswith("_")}


def _public_of(obj: object) -> dict[str, Any]:
    """An instance's public surface: its class's, plus the attributes set in ``__init__``."""
    names = getattr(obj, "__dict__", {}).keys()
    return _public(type(obj)) | {n: getattr(obj, n) for n in names if not n.startswith("_")}


def _kind(attr: Any) -> str:
    if isinstance(attr, property):
        return "property"
    if isinstance(attr, classmethod | staticmethod):
        return "classmethod"
    return "method" if callable(attr) else "attribute"


def surface_gaps(sync: type | object, aio: type | object) -> list[str]:
    """Every way ``sync`` and ``aio`` (classes, or instances with their attributes) differ
    beyond the listed reasons (empty: in step). An instance attribute is a property's match."""
    s = _public(sync) if isinstance(sync, type) else _public_of(sync)
    a = _public(aio) if isinstance(aio, type) else _public_of(aio)
    sn = sync.__name__ if isinstance(sync, type) else type(sync).__name__
    an = aio.__name__ if isinstance(aio, type) else type(aio).__name__
    gaps = [f"{an} lacks {n}" for n in sorted(s.keys() - a.keys() - SYNC_ONLY.keys())]
    gaps += [f"{sn} lacks {n}" for n in sorted(a.keys() - s.keys() - ASYNC_ONLY.keys())]
    for n in sorted(s.keys() & a.keys()):
        ks, ka = _kind(s[n]), _kind(a[n])
        if {ks, ka} == {"property", "attribute"}:
            continue  # a value either way
        if ks != ka:
            gaps.append(f"{n}: {ks} on {sn}, {ka} on {an}")
        elif ks == "method" and n not in NOT_AWAITED and not inspect.iscoroutinefunction(a[n]):
            gaps.append(f"{an}.{n} is not awaitable")
    return gaps


@pytest.fixture
def open_twins(make_config: Any) -> Iterator[list[tuple[object, object]]]:
    """An open instance of each cache and of its async face, attributes set."""
    with SenderCache(make_config()) as sender, ReceiverCache.attach(sender.handle()) as receiver:
        yield [(sender, AsyncSenderCache(sender)), (receiver, AsyncReceiverCache(receiver))]


def test_twins_have_the_same_methods_properties_and_attributes(
    open_twins: list[tuple[object, object]],
) -> None:
    """Open instances: attributes set in ``__init__`` (not in a class's ``dir``) count too."""
    for sync, aio in open_twins:
        assert surface_gaps(sync, aio) == []


def test_the_listed_differences_are_real(open_twins: list[tuple[object, object]]) -> None:
    """A name listed as one-sided must exist on exactly that side, on some pair."""
    pairs = [(_public_of(s), _public_of(a)) for s, a in open_twins]
    for n in SYNC_ONLY:
        assert any(n in s and n not in a for s, a in pairs), n
    for n in ASYNC_ONLY:
        assert any(n in a and n not in s for s, a in pairs), n


def test_the_check_sees_a_missing_property_and_a_sync_method() -> None:
    """The checker itself: a twin without a property, or with a plain method, is reported."""

    class Sync:
        @property
        def closed(self) -> bool:
            return False

        def invalidate(self, h: str) -> bool:
            return True

    class Async:
        def invalidate(self, h: str) -> bool:  # should be awaitable
            return True

    assert surface_gaps(Sync, Async) == ["Async lacks closed", "Async.invalidate is not awaitable"]


def test_the_check_sees_a_missing_instance_attribute() -> None:
    """An attribute set in ``__init__`` on one face only is reported; as a property it matches."""

    class Sync:
        def __init__(self) -> None:
            self.config = 1

    class Async:
        @property
        def config(self) -> int:
            return 1

    assert surface_gaps(Sync(), object()) == ["object lacks config"]
    assert surface_gaps(Sync(), Async()) == []


async def test_async_properties_answer_as_the_sync_ones(make_config: Any) -> None:
    cfg = make_config()
    async with (
        AsyncSenderCache.from_config(cfg) as tx,
        AsyncReceiverCache.attach(tx.handle()) as rx,
    ):
        assert (tx.name, tx.group, tx.closed) == (tx.sender.name, tx.sender.group, False)
        assert rx.closed is False
    assert tx.closed and rx.closed
    with SenderCache(make_config()) as sender:
        face = AsyncSenderCache(sender)
        await face.aclose()  # a borrowed cache stays open, the face is closed
        assert face.closed and not sender.closed


class _CountingSerde(MsgpackSerde):
    """The default serde, counting the items it encodes and decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.plans = 0
        self.reads = 0

    def plan(self, value: Any) -> Any:
        self.plans += 1
        return super().plan(value)

    def read(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return super().read(*args, **kwargs)


async def test_serde_is_taken_wherever_a_cache_is_created_or_attached(make_config: Any) -> None:
    tx_serde, rx_serde = _CountingSerde(), _CountingSerde()
    async with (
        AsyncSenderCache.from_config(make_config(), serde=tx_serde) as tx,
        AsyncReceiverCache.attach(tx.handle(), serde=rx_serde) as rx,
    ):
        [f] = await tx.get_and_update_features([FeatureSpec("a", {"x": np.arange(10)})])
        assert isinstance(f.data, ShmRef)
        [back] = await rx.get_and_update_features([f])
        assert np.array_equal(back.data["x"], np.arange(10))
    assert tx_serde.plans == 1 and rx_serde.reads == 1


def test_every_async_class_is_an_async_resource() -> None:
    """One lifetime style: anyio's ``AsyncResource`` (``async with``, ``aclose``), no ``open``."""
    from anyio.abc import AsyncResource

    from aioshmcache.tier import RedisTier

    for cls in (AsyncSenderCache, AsyncReceiverCache, RedisTier):
        assert issubclass(cls, AsyncResource) and not hasattr(cls, "open"), cls


def test_one_constructor_per_way_to_get_an_async_face(make_config: Any) -> None:
    """Wrapping (borrowed) takes a cache and no serde (it has its own); ``from_config`` /
    ``attach`` / ``attach_group`` (owned) take the serde; a wrong first argument is a
    ``TypeError`` that names the constructor it needed."""
    for wrap in (AsyncSenderCache, AsyncReceiverCache):
        params = inspect.signature(wrap).parameters
        assert "serde" not in params and next(iter(params)) in ("sender", "receiver")
    for owned in (
        AsyncSenderCache.from_config,
        AsyncReceiverCache.attach,
        AsyncReceiverCache.attach_group,
    ):
        assert "serde" in inspect.signature(owned).parameters
    with pytest.raises(TypeError, match="from_config"):
        AsyncSenderCache(make_config())
    with pytest.raises(TypeError, match="attach"):
        AsyncReceiverCache("aioshm-x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CacheConfig"):
        AsyncSenderCache.from_config("aioshm-x")  # type: ignore[arg-type]
    with SenderCache(make_config()) as sender, ReceiverCache.attach(sender.handle()) as rx:
        assert AsyncSenderCache(sender).sender is sender
        assert AsyncReceiverCache(rx).receiver is rx


def test_one_threshold_for_a_copy_under_the_writer_lock(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request copies holding the writer lock exactly what ``put`` would, and no more.

    Review: the one-item fast path held the lock for copies up to 1 MiB, the store's ``put``
    for copies up to 64 KiB: two constants for one decision. Now one threshold decides both
    for requests (and the async face, whose copy jobs leave the loop). The sync face's one-item
    puts are deliberately one step at every size (``SYNC_ONE_STEP_PUT_UNDER``: measured fewer
    instructions at 1-16 MiB, the copy made without the GIL by the calling thread either way),
    so they stay above the requests' threshold, never below it.
    """
    from aioshmcache._request import DEFAULT_INLINE_THRESHOLD
    from aioshmcache._store import INLINE_COPY_UNDER_LOCK, SYNC_ONE_STEP_PUT_UNDER

    assert DEFAULT_INLINE_THRESHOLD == INLINE_COPY_UNDER_LOCK <= SYNC_ONE_STEP_PUT_UNDER
    with SenderCache(make_config(8 << 20, 4 << 20, 1)) as tx:
        small = ({"x": np.zeros(INLINE_COPY_UNDER_LOCK // 2, np.uint8)}, ())
        bigger = ({"x": np.zeros(INLINE_COPY_UNDER_LOCK * 2, np.uint8)}, ())
        req = tx._request([small, bigger], ["small", "bigger"])
        try:
            req.begin()
            assert tx.is_cached("small")  # copied and committed in the locked step
            assert req.has_jobs and not tx.is_cached("bigger")  # left for outside the lock
            req.run_jobs()
        except BaseException:
            req.abandon()
            raise
        req.finish()
        assert tx.is_cached("bigger")
        one = ({"x": np.ones(INLINE_COPY_UNDER_LOCK * 2, np.uint8)}, ())
        if aioshmcache.implementation() == "c":  # the core's one step: no request, no job
            from aioshmcache._request import SenderRequest

            def no_request(*a: object, **k: object) -> None:
                raise AssertionError("the sync one-item put made a request")

            # the class itself: every module that names it (the face, run_one) makes none
            monkeypatch.setattr(SenderRequest, "__init__", no_request)
        ref, _ = tx.get_and_update_item(one, "one")  # the sync one-item put, updates a tuple
        assert isinstance(ref, ShmRef) and tx.is_cached("one")
        two: tuple[object, list[object]] = (
            {"x": np.full(INLINE_COPY_UNDER_LOCK * 2, 2, np.uint8)},
            [],
        )
        ref, _ = tx.get_and_update_item(two, "two")  # the same with updates given as a list
        assert isinstance(ref, ShmRef) and tx.is_cached("two")


# --- no public method returns a private type --------------------------------------------------

#: public methods of the lower layers (``ShmObjectStore`` and its two roles, ``ShmRingBuffer``:
#: the layers the caches are built on, docs/design.md) that hand out their private building
#: blocks, and why. The writer's request steps are its documented internal interface (the
#: sender request drives them, without reaching into the writer's private names): the
#: reservation a put's copy job finishes and the pins a request holds are theirs to hand out.
PRIVATE_RETURNS: dict[str, str] = {
    "StoreWriter.reserve": "aioshmcache._store.Reservation",
    "StoreWriter.pin_entry": "aioshmcache._ledger.Debts",
    "StoreWriter.pin_ids": "aioshmcache._ledger.Debts",
    # the reader's read path, the internal API its cache's requests drive step by step
    "StoreReader.read_path": "aioshmcache._read_path.ReadPath",
    # the channel pool's book, to read in tests and diagnostics (counts, backoff), not to drive
    "EngineClient.pool": "aioshmcache._channel_conn.ClientConnection",
}


def _public_modules() -> list[Any]:
    """The package and its public modules (those of an extra that is not installed left out)."""
    modules: list[Any] = [aioshmcache]
    for info in pkgutil.iter_modules(aioshmcache.__path__):
        if info.name.startswith("_"):
            continue
        try:
            modules.append(importlib.import_module(f"aioshmcache.{info.name}"))
        except ModuleNotFoundError as exc:  # a module of an extra that is not installed
            if (exc.name or "").startswith("aioshmcache"):
                raise
    return modules


def _exported(modules: list[Any]) -> list[Any]:
    return [getattr(m, n) for m in modules for n in getattr(m, "__all__", ())]


def _exported_ids() -> set[int]:
    """Ids of everything the package and its public modules export by ``__all__``."""
    return {id(obj) for obj in _exported(_public_modules())}


def _classes_in(hint: Any) -> Iterator[type]:
    """Every class an annotation names (``X | None``, ``list[X]``, ``Iterator[X]`` ...)."""
    if isinstance(hint, type):
        yield hint
    origin = typing.get_origin(hint)
    if isinstance(origin, type):
        yield origin
    for arg in typing.get_args(hint):
        yield from _classes_in(arg)


def _is_private(cls: type, exported: set[int]) -> bool:
    """Defined in aioshmcache, not exported, and private by its module's or its own name."""
    module = cls.__module__
    if module.split(".")[0] != "aioshmcache" or id(cls) in exported:
        return False
    return cls.__name__.startswith("_") or any(p.startswith("_") for p in module.split("."))


def private_returns(classes: list[type], exported: set[int]) -> dict[str, str]:
    """``"Class.name": "module.Type"`` for each public method/property returning a private type."""
    found: dict[str, str] = {}
    for cls in classes:
        for name in dir(cls):
            if name.startswith("_"):
                continue
            attr = inspect.getattr_static(cls, name)
            func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if not inspect.isfunction(func):
                continue
            for c in _classes_in(typing.get_type_hints(func).get("return")):
                if _is_private(c, exported):
                    found[f"{cls.__name__}.{name}"] = f"{c.__module__}.{c.__qualname__}"
    return found


#: the stores' public attributes (slots), and why each is public; every other slot is private
#: (eviction's counters and settings are the writer's properties over its eviction part)
STORE_ATTRIBUTES = {
    "ring": "the ring buffer (capacity, used_bytes): read by snapshots, inspect and the bench",
    "serde": "the codec the caches encode and decode with",
    "max_object_bytes": "the largest item, from the segment's header: callers check before a put",
    "handout_ttl": "seconds before an unacknowledged hand-out is reclaimed, from the header",
    "one_of_n": "whether one reader acknowledges for all (delivery='any'), from the header",
    "index": "the writer's key -> chunk id map: a sender request looks hits up in it (read only)",
    "words": "the segment header's words: a sender request publishes its counters there",
}


def _public_slots(cls: type) -> set[str]:
    return {n for c in cls.__mro__ for n in getattr(c, "__slots__", ()) if not n.startswith("_")}


def test_every_public_attribute_of_a_store_is_listed_with_its_reason() -> None:
    """A store's state is private unless listed: a new public slot must say why it is."""
    found = _public_slots(StoreWriter) | _public_slots(StoreReader)
    assert found == STORE_ATTRIBUTES.keys()
    assert _public_slots(StoreReader) <= _public_slots(StoreWriter)  # a reader adds none


def test_no_public_method_returns_a_private_type() -> None:
    """A caller can name what the API hands out: its return types are exported too.

    Review (issue 23): ``SenderCache.request`` returned the private ``SenderRequest``; the
    request steps are now ``_request`` / ``_features_request``, for the async face only.
    """
    exported = _exported(_public_modules())  # the store's roles live in ``aioshmcache.store``
    public = list({id(c): c for c in exported if isinstance(c, type)}.values())
    found = private_returns(public, {id(obj) for obj in exported})
    assert found.keys() - PRIVATE_RETURNS.keys() == set(), found
    assert PRIVATE_RETURNS.keys() - found.keys() == set(), "a listed exception no longer is one"


def test_the_check_sees_a_private_return_type() -> None:
    """The checker itself: a method or a property returning a private class is reported."""

    class Face:
        def request(self) -> SenderRequest | None:
            return None

        @property
        def steps(self) -> list[SenderRequest]:
            return []

        def _own(self) -> SenderRequest | None:  # private: not reported
            return None

        def info(self) -> aioshmcache.CacheInfo | None:  # exported: not reported
            return None

    where = "aioshmcache._request.SenderRequest"
    assert private_returns([Face], _exported_ids()) == {"Face.request": where, "Face.steps": where}


# --- a group reader offers only what works --------------------------------------------------


def test_every_public_name_of_a_group_reader_works() -> None:
    """A ``GroupReceiverCache`` has no method that fails by design (no ``handle``, no ``store``).

    Review (issue 23): it subclassed ``ReceiverCache``, so it inherited ``handle()`` (which it
    made raise ``RoleError``), ``attach`` and ``attach_group`` (which built a single-segment
    reader) and a ``store`` it never had. It now shares the read methods, not the class. Every
    public name is called here; the table must list exactly the public names, so a name added
    later is exercised too.
    """
    group = f"{RUN_PREFIX}tw{uuid.uuid4().hex[:10]}"
    with SenderCache(CacheConfig(1 << 20, 1 << 18, 2, group=group)) as tx:
        item = {"x": np.arange(8)}
        [f1, f2, f3] = tx.get_and_update_features(
            [FeatureSpec("h1", item), FeatureSpec("h2", item), FeatureSpec("h3", item)]
        )
        shard = tx.handle()
        rx = ReceiverCache.attach_group(group)
        try:

            def lease() -> object:
                with rx.lease([f2]) as got:
                    return got[0].data["x"].sum()

            calls: dict[str, Any] = {
                "get_and_update_features": lambda: rx.get_and_update_features([f1])[0].data,
                "get_and_update_item": lambda: rx.get_and_update_item(f3.data, "h3"),
                "lease": lease,
                "touch": lambda: rx.touch("h1", f1.data),
                "release": lambda: rx.release(f1.data),
                "make_stats": lambda: rx.make_stats(delta=True),
                "shard_handles": rx.shard_handles,
                "rescan": rx.rescan,
                "clear": rx.clear,
                "closed": lambda: rx.closed,
                "close": rx.close,  # last
            }
            assert set(calls) == set(_public(GroupReceiverCache))
            got = {name: call() for name, call in calls.items()}
        finally:
            rx.close()
    assert np.array_equal(got["get_and_update_features"]["x"], item["x"])
    assert np.array_equal(got["get_and_update_item"]["x"], item["x"])
    assert got["lease"] == item["x"].sum()
    assert got["shard_handles"] == [shard] and got["closed"] is False and rx.closed
    assert not isinstance(rx, ReceiverCache)
    assert not hasattr(rx, "handle") and not hasattr(rx, "store")


def _read_with(receiver: Receiver, features: list[FeatureSpec]) -> list[float]:
    """Code typed for any reader (mypy checks these calls against ``Receiver``)."""
    for f in features:
        receiver.touch(f.mm_hash, f.data)
    with receiver.lease(features[:1]) as leased:
        sums = [float(leased[0].data["x"].sum())]
    sums += [float(f.data["x"].sum()) for f in receiver.get_and_update_features(features[1:])]
    sums.append(
        float(receiver.get_and_update_item(features[0].data, features[0].mm_hash)["x"].sum())
    )
    receiver.clear()
    assert receiver.make_stats() == aioshmcache.CacheInfo(0, 0) and not receiver.closed
    return sums


def test_a_group_reader_goes_wherever_a_reader_does() -> None:
    """``GroupReceiverCache`` and ``ReceiverCache`` share ``Receiver``: the same read methods
    with the same signatures, so code typed for ``Receiver`` (and the faces that wrap a reader)
    takes either, with the same results."""
    from aioshmcache.vllm import VllmReceiverCache

    shared = {n for n in dir(Receiver) if not n.startswith("_")}
    assert {"get_and_update_features", "get_and_update_item", "lease", "touch", "release"} <= shared
    for cls in (ReceiverCache, GroupReceiverCache):
        assert issubclass(cls, Receiver)
        for n in shared:
            mine, base = inspect.getattr_static(cls, n), inspect.getattr_static(Receiver, n)
            if callable(mine):
                assert inspect.signature(mine) == inspect.signature(base), (cls, n)
    group = f"{RUN_PREFIX}tw{uuid.uuid4().hex[:10]}"
    with (
        SenderCache(CacheConfig(1 << 20, 1 << 18, 2, group=group)) as tx,
        ReceiverCache.attach(tx.handle()) as one,
        ReceiverCache.attach_group(group) as whole,
    ):
        feats = tx.get_and_update_features(
            [FeatureSpec(f"h{i}", {"x": np.arange(8) * i}) for i in range(3)]
        )
        assert _read_with(one, feats) == _read_with(whole, feats) == [0.0, 28.0, 56.0, 0.0]
        for reader in (one, whole):  # the faces that wrap a reader take either
            assert AsyncReceiverCache(reader).receiver is reader
            assert VllmReceiverCache(reader).receiver is reader
