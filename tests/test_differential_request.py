"""Differential tests of the sender's requests of several items: the entry points that take
several items (``get_and_update``, ``get_and_update_features``, sync and async) run the same
random requests on the core in use and on the pure-Python reference, and give the same answers,
errors, counters, kept prompt updates, hand-out ledger and segment, bit for bit.

A request of several items decides each plain miss through the core's one-item miss
(``put_item``) within its own locked step and guard; the reference decides every item in
Python (``SenderRequest._decide_locked``). With ``AIOSHM_PURE=1`` both runs are the reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioshmcache import (
    AsyncSenderCache,
    CacheMissError,
    FeatureSpec,
    ReceiverCache,
    SenderCache,
    SerdeError,
    ShmObjectStore,
    ShmRef,
    _core_py,
    _request,
)
from aioshmcache._kept import restore

from .helpers import checksum, count_sender_requests, random_item
from .test_core import c_core
from .test_differential_store import (
    _INSTANCE_WORDS,
    ITEMS,
    KEYS,
    _ledger_state,
    _ref_fields,
    _sender_for,
    _spied,
    on_both_cores,
    pure_core,
)

C = c_core()
if C is not None:  # as ``_request`` does for the core in use (with AIOSHM_PURE=1, the pure one)
    C.configure_specs(FeatureSpec, ShmRef)

#: ``ITEMS``, then an item whose plan raises (``SerdeError``): its request fails half-way
BAD = len(ITEMS)
REQUESTS = st.lists(
    st.lists(st.tuples(KEYS, st.integers(-1, BAD)), min_size=2, max_size=8),
    min_size=1,
    max_size=10,
)
VIAS = ("list", "features", "async list", "async features")


def _make(rng: np.random.Generator, n: int) -> object:
    return {"bad": object()} if n == BAD else ITEMS[n](rng)


def _specs(items: Sequence[Any], hashes: Sequence[str]) -> list[FeatureSpec]:
    """The features of a request: data ``None`` is a look-up."""
    return [
        FeatureSpec(h, None) if it is None else FeatureSpec(h, it[0], prompt_updates=it[1])
        for it, h in zip(items, hashes)
    ]


async def _call(
    cache: SenderCache, face: AsyncSenderCache, via: str, items: list[Any], hashes: list[str]
) -> list[tuple[Any, Sequence[Any]]]:
    """One request through ``via``: each item's ``(data, prompt_updates)``."""
    if via == "list":
        return cache.get_and_update(items, hashes)
    if via == "async list":
        return await face.get_and_update(items, hashes)
    specs = _specs(items, hashes)
    if via == "features":
        got = cache.get_and_update_features(specs)
    else:
        got = await face.get_and_update_features(specs)
    return [(f.data, f.prompt_updates) for f in got]


def _kept(u: object) -> list[object]:
    """Prompt updates as the sender keeps them (``_kept``), as a list."""
    return list(restore(u))


def _state(cache: SenderCache) -> object:
    snap = cache.snapshot()
    counters = (snap.hits, snap.misses, snap.inline_too_large, snap.inline_full, snap.evictions)
    kept = sorted((h, _kept(u)) for h, u in cache._prompt_updates.items())
    return (
        cache.store.keys(),
        cache.store.ring.used_bytes,
        counters,
        cache.inline_busy,
        kept,
        _ledger_state(cache.store),
    )


def _run(
    requests: list[list[tuple[str, int]]], seed: int, via: str, threshold: int
) -> tuple[list[object], bytes]:
    """Each request through ``via`` (``-1``: a look-up; ``BAD``: an item whose plan raises),
    one live reader reading the references of every other request (the rest stay owed); the
    async face copies items of ``threshold`` bytes or more in a worker thread. The ledger's
    clock is a counter, so that both runs record the same times."""
    rng = np.random.default_rng(seed)
    cache = _sender_for("diffmulti", 1)
    ticks = iter(range(1, 1 << 30))
    cache.store._ledger.clock = lambda: float(next(ticks))
    face = AsyncSenderCache(cache, inline_threshold_bytes=threshold)
    reader = ShmObjectStore.from_handle(cache.store.handle())
    answers: list[object] = []

    async def main() -> None:
        for r, request in enumerate(requests):
            items = [None if n < 0 else (_make(rng, n), [n]) for _, n in request]
            try:
                out = await _call(cache, face, via, items, [h for h, _ in request])
                for data, _u in out:
                    if r % 2 == 0 and isinstance(data, ShmRef):
                        reader.get(data)  # read: acknowledged
                answers.append(
                    [
                        (_ref_fields(d) if isinstance(d, ShmRef) else "inline", list(u))
                        for d, u in out
                    ]
                )
            except Exception as exc:
                answers.append(("error", type(exc).__name__, getattr(exc, "mm_hashes", None)))
            answers.append(("state", _state(cache)))

    try:
        asyncio.run(main())
        words = [w if i not in _INSTANCE_WORDS else 0 for i, w in enumerate(cache.store.words[:64])]
        answers.append(("words", words))
        return answers, bytes(cache.store.ring.buf)
    finally:
        reader.close()
        cache.close()


@pytest.mark.parametrize("via", VIAS)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(REQUESTS, st.integers(0, 2**32 - 1), st.sampled_from([1 << 20, 4096]))
def test_requests_of_several_items_answer_alike_on_both_cores(
    monkeypatch: pytest.MonkeyPatch,
    via: str,
    requests: list[list[tuple[str, int]]],
    seed: int,
    threshold: int,
) -> None:
    """Hits, look-ups (some not cached: ``CacheMissError``, nothing taken), a hash repeated
    within a request, misses that evict, items too large, not encodable (a failed request gives
    back what it took) or copied in a thread: the same on both cores, step by step."""
    with_core, pure = on_both_cores(monkeypatch, lambda: _run(requests, seed, via, threshold))
    assert with_core[0] == pure[0]
    assert with_core[1] == pure[1]


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@pytest.mark.parametrize("via", VIAS)
def test_a_request_of_several_items_puts_its_plain_misses_through_the_core(
    monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """Not vacuous: one request of eight specs (one ``SenderRequest``) whose plain misses each
    took the core's one-item miss; a hit, a look-up, a repeat of a hash the request just put, a
    big item the async face copies in a thread (a job) and an item too large (served inline by
    the core) in one request: the core took all but the job. A look-up of a hash an earlier
    item served inline (not cached) is declined, and the request's ``CacheMissError``."""
    assert C is not None
    seen = _spied(monkeypatch, _request, "_put_item", C.put_item)
    made = count_sender_requests(monkeypatch)
    rng = np.random.default_rng(0)
    cache = _sender_for("diffmultitaken", 1)
    face = AsyncSenderCache(cache, inline_threshold_bytes=4096)

    try:
        plain = [(ITEMS[0](rng), [i]) for i in range(8)]
        out = asyncio.run(_call(cache, face, via, plain, [f"p{i}" for i in range(8)]))
        assert len(made) == 1 and seen == [True] * 8
        assert [list(u) for _d, u in out] == [[i] for i in range(8)]
        assert all(isinstance(d, ShmRef) for d, _u in out)
        seen.clear()
        huge = (ITEMS[8](rng), ["h"])
        mixed = [(ITEMS[0](rng), ["a"]), plain[0], None, (ITEMS[0](rng), ["a2"])]
        mixed += [(ITEMS[2](rng), ["big"]), huge]
        hashes = ["a", "p0", "p1", "a", "big", "huge"]
        out = asyncio.run(_call(cache, face, via, mixed, hashes))
        # offered: "a" (taken), "p0" (a hit: taken), "p1" (a look-up's hit: taken), "a" again
        # (now a hit: taken), "big" (taken by the sync faces; a job on the async one:
        # declined), "huge" (served inline)
        job = via.startswith("async")
        assert seen == [True, True, True, True, not job, True]
        assert [list(u) for _d, u in out] == [["a"], [0], [1], ["a2"], ["big"], ["h"]]
        assert out[0][0].id == out[3][0].id  # the repeat is a hand-out of the same chunk
        assert out[5][0] is huge[0]  # served inline
        assert cache.snapshot().inline_too_large == 1
        seen.clear()
        with pytest.raises(CacheMissError) as miss:
            asyncio.run(_call(cache, face, via, [huge, None], ["huge2", "huge2"]))
        assert miss.value.mm_hashes == ("huge2",) and seen == [True, False]
    finally:
        cache.close()


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("via", VIAS)
def test_a_request_that_fails_half_way_gives_back_what_its_plain_misses_took(
    monkeypatch: pytest.MonkeyPatch, via: str, pure: bool
) -> None:
    """Items put before an item whose plan raises: the error reaches the caller, their
    hand-outs are given back (a reader owes nothing: they may be evicted), the items after it
    are never decided, and the request counts what it decided (a failed plan counts nothing)."""
    with monkeypatch.context() as m:
        if pure:
            pure_core(m)
        rng = np.random.default_rng(1)
        cache = _sender_for("diffmultifail", 1)
        face = AsyncSenderCache(cache)
        reader = ShmObjectStore.from_handle(cache.store.handle())

        try:
            items: list[Any] = [
                (ITEMS[0](rng), []),
                (ITEMS[1](rng), []),
                (_make(rng, BAD), []),
                (ITEMS[0](rng), []),
            ]
            with pytest.raises(SerdeError):
                asyncio.run(_call(cache, face, via, items, ["a", "b", "bad", "c"]))
            assert cache.store.keys() == ["a", "b"]
            assert cache.is_freeable("a") and cache.is_freeable("b")
            snap = cache.snapshot()
            assert (snap.hits, snap.misses) == (0, 2)
            assert sorted(cache._prompt_updates) == ["a", "b"]
        finally:
            reader.close()
            cache.close()


class _Spec(FeatureSpec):
    """A subclass: the core declines it (the reference takes it as a ``FeatureSpec``)."""


class _Ref(ShmRef):
    """A reference subclass: a look-up for both (``isinstance``)."""


_REF = ShmRef(1, 0, 64, 1, 10, 99, 0, 0)
DATA = st.sampled_from(["none", "dict", "ref", "ref-sub", "list", "int"])
UPDATES = st.sampled_from(["empty", "tuple", "list", "str", "iter", "int"])
SPECS = st.lists(
    st.tuples(st.sampled_from(["spec", "sub", "other", "bad-hash"]), DATA, UPDATES),
    max_size=6,
)


def _data(kind: str) -> object:
    return {
        "none": None,
        "dict": {"x": 1},
        "ref": _REF,
        "ref-sub": _Ref(*_REF),
        "list": [1, 2],
        "int": 7,
    }[kind]


def _updates(kind: str) -> Any:
    return {
        "empty": (),
        "tuple": (1, "a"),
        "list": [1, {"u": 2}],
        "str": "ab",
        "iter": iter([3, 4]),
        "int": 5,  # not iterable: ``tuple(5)`` raises
    }[kind]


def _build(desc: list[tuple[str, str, str]]) -> list[Any]:
    """Fresh specs of ``desc`` (an iterator is consumed once: each run gets its own)."""
    out: list[Any] = []
    for i, (kind, data, updates) in enumerate(desc):
        if kind == "other":
            out.append((f"h{i}", _data(data)))
            continue
        cls = _Spec if kind == "sub" else FeatureSpec
        f = cls(f"h{i}", _data(data), identifier=f"id{i}")
        # set as given, past the constructor (which keeps an iterator whole and refuses what is
        # not iterable): the cores must still handle any stored value alike
        object.__setattr__(f, "prompt_updates", _updates(updates))
        if kind == "bad-hash":
            object.__setattr__(f, "mm_hash", i)  # not a str
        out.append(f)
    return out


def _outcome(fn: Any) -> tuple[object, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc), str(exc))


def _spec_fields(specs: list[FeatureSpec]) -> list[object]:
    """Each spec's type and fields (an iterator as what is left of it: consumed or not)."""
    return [(type(s), s.mm_hash, s.data, s.identifier, _left(s.prompt_updates)) for s in specs]


def _left(u: object) -> object:
    return ("iterator", list(u)) if isinstance(u, Iterator) else u


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@settings(max_examples=300, deadline=None)
@given(SPECS, st.sampled_from(["list", "tuple", "deque"]))
def test_the_cores_split_of_features_is_the_reference_s(
    desc: list[tuple[str, str, str]], container: str
) -> None:
    """``split_features`` against ``SenderRequest.for_features``'s steps (``feature_item`` of
    each spec, and its hash): the same specs, items and hashes, or the same error, or declined
    (a subclass, a hash that is not a str, a sequence other than a list or tuple)."""
    from collections import deque

    wrap: Any = {"list": list, "tuple": tuple, "deque": deque}[container]

    def reference() -> object:
        features = list(wrap(_build(desc)))
        items = [_request.feature_item(f) for f in features]
        return _spec_fields(features), items, [_request.check_hash(f.mm_hash) for f in features]

    def core() -> object:
        assert C is not None
        got = C.split_features(wrap(_build(desc)))
        if got is None:
            return None
        features, items, hashes = got
        assert type(features) is list and type(items) is list and type(hashes) is list
        return _spec_fields(features), items, hashes

    expected, got = _outcome(reference), _outcome(core)
    unusual = container == "deque" or any(k in ("sub", "other", "bad-hash") for k, _d, _u in desc)
    if got == ("ok", None):
        assert unusual  # declined: only what the core leaves to the reference
    else:
        assert not unusual or got[0] == "error"
        assert got == expected


RESULTS = st.lists(
    st.tuples(DATA, UPDATES, st.sampled_from(["pair", "pair", "pair", "triple", "list"])),
    max_size=6,
)


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@settings(max_examples=300, deadline=None)
@given(SPECS, RESULTS)
def test_the_cores_new_specs_are_the_reference_s(
    desc: list[tuple[str, str, str]], results: list[tuple[str, str, str]]
) -> None:
    """``specs_from`` against ``features_from``'s steps: the same new specs (exactly
    ``FeatureSpec``, the spec's hash and identifier, the result's data, its updates as a
    tuple), or the same error, or declined (lengths that differ, a spec not exactly a
    ``FeatureSpec``, a result that is not a pair)."""

    def make() -> tuple[list[Any], list[Any]]:
        specs = _build(desc)
        out: list[Any] = []
        for data, updates, shape in results:
            pair = (_data(data), _updates(updates))
            out.append(pair if shape == "pair" else (*pair, 0) if shape == "triple" else list(pair))
        return specs, out

    def reference() -> object:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(_request, "_specs_from", _core_py.specs_from)
            return _spec_fields(_request.features_from(*make()))

    def core() -> object:
        assert C is not None
        got = C.specs_from(*make())
        return None if got is None else _spec_fields(got)

    expected, got = _outcome(reference), _outcome(core)
    unusual = len(desc) != len(results) or any(k in ("sub", "other") for k, _d, _u in desc)
    unusual |= any(shape != "pair" for _d, _u, shape in results)
    unusual |= any(u not in ("empty", "tuple", "list") for _d, u, _s in results)  # Python code
    if got == ("ok", None):
        assert unusual
    else:
        assert not unusual or got[0] == "error"
        assert got == expected


class _Updates(Sequence[Any]):
    """Prompt updates whose ``tuple()`` runs ``act`` first (the Python code of a user's class)."""

    def __init__(self, act: Any) -> None:
        self.act = act

    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: Any) -> Any:
        raise IndexError(i)

    def __iter__(self) -> Iterator[Any]:
        act, self.act = self.act, None
        if act is not None:
            act()
        return iter(())


class _Data(dict[str, Any]):
    """Data whose ``isinstance`` check (its ``__class__``) runs ``act`` first."""

    act: Any = None

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        act, type(self).act = type(self).act, None
        if act is not None:
            act()
        return dict


def _hostile(change: str) -> tuple[list[FeatureSpec], list[Any]]:
    """Two specs whose first one's check or updates change it; what the change keeps alive."""
    first = FeatureSpec("h0", None)
    keep: list[Any] = []

    def replace_data() -> None:
        object.__setattr__(first, "data", None)  # the spec held the data's last reference
        keep.append({"impostor": True})  # (a new dict takes the freed one's memory)

    acts = {
        "data replaced": replace_data,
        "hash deleted": lambda: object.__delattr__(first, "mm_hash"),
        "hash a subclass": lambda: object.__setattr__(first, "mm_hash", _StrKey("h9")),
        "updates deleted": lambda: object.__delattr__(first, "prompt_updates"),
        # the spec held the updates' last reference: freed once their ``__iter__`` returns
        "updates replaced": lambda: object.__setattr__(first, "prompt_updates", ("x",)),
    }
    if change in ("data replaced", "updates replaced"):  # from the updates' ``tuple()``
        object.__setattr__(first, "data", {"x": 1})
        object.__setattr__(first, "prompt_updates", _Updates(acts[change]))
    else:  # from the data's ``isinstance`` check, before the updates and the hash are read
        object.__setattr__(first, "data", _Data(x=1))
        _Data.act = acts[change]
    return [first, FeatureSpec("h1", {"y": 2})], keep


class _StrKey(str):
    pass


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@pytest.mark.parametrize(
    "change",
    ["data replaced", "hash deleted", "hash a subclass", "updates deleted", "updates replaced"],
)
def test_python_code_amid_the_cores_split_changes_the_spec_as_in_the_reference(
    change: str,
) -> None:
    """A review found ``split_features`` holding borrowed slots across ``isinstance`` and
    ``tuple(updates)``, which may run Python code that changes the spec: a replaced data was
    freed and its memory, reused by another object, was cached under the spec's hash; a hash
    deleted was read as NULL (a crash); updates that replaced themselves in the spec were
    read after their last reference went (AddressSanitizer sees it with ``PYTHONMALLOC=malloc``).
    The core now holds what it read, reads the hash after, as the reference does, and gives
    the reference's item, hash or error."""

    def reference() -> object:
        features, _alive = _hostile(change)
        items = [_request.feature_item(f) for f in features]
        return items, [_request.check_hash(f.mm_hash) for f in features]

    def core() -> object:
        assert C is not None
        features, _alive = _hostile(change)
        got = C.split_features(features)
        assert got is not None
        return got[1], got[2]

    expected, got = _outcome(reference), _outcome(core)
    assert got == expected
    if got[0] == "ok":
        assert all(type(h) is str for h in got[1][1])  # type: ignore[index]


@pytest.mark.skipif(C is None, reason="the C core is not built here")
def test_the_cores_new_specs_leave_updates_that_run_code_to_the_reference() -> None:
    """``specs_from`` held borrowed items of the caller's lists across ``tuple(updates)``; an
    ``__iter__`` that emptied the lists made it read freed memory (a crash). Updates that are not
    a tuple or a list are now the reference's, which the core declines before building."""
    assert C is not None
    features = [FeatureSpec("a", None), FeatureSpec("b", None)]
    results: list[Any] = []

    def empty_both() -> None:
        features.clear()
        results.clear()

    results += [({"x": 1}, _Updates(empty_both)), ({"y": 2}, ())]
    assert C.specs_from(features, results) is None
    made = _request.features_from(features, results)
    assert [(f.mm_hash, f.data, f.prompt_updates) for f in made] == [("a", {"x": 1}, ())]


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@settings(max_examples=200, deadline=None)
@given(SPECS, DATA)
def test_the_cores_spec_with_data_is_the_reference_s(
    desc: list[tuple[str, str, str]], data: str
) -> None:
    """``spec_with`` against ``FeatureSpec.with_data``: exactly a ``FeatureSpec`` with the
    spec's hash, identifier and updates (as they are, unconverted) and the new data; declined
    for a subclass or what is not a spec (the reference then builds, or fails alike)."""
    assert C is not None
    new = _data(data)
    for f in _build(desc):
        got = C.spec_with(f, new)
        if type(f) is not FeatureSpec:
            assert got is None
            continue
        want = f.with_data(new)
        assert type(got) is FeatureSpec and got == want
        assert got.data is new and got.prompt_updates is f.prompt_updates
        assert got.mm_hash is f.mm_hash and got.identifier is f.identifier


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("delay", [0, 0.0002, 0.001, 0.005])
async def test_a_cancelled_request_gives_back_what_its_compiled_misses_took(
    make_config: Any, monkeypatch: pytest.MonkeyPatch, pure: bool, delay: float
) -> None:
    """An async request of small items (put in its first step, by the core's one-item miss on
    the C core) and big ones (copied in a worker thread) cancelled at any point: every hand-out
    it took is given back or, if it finished, read; nothing is half-allocated or pinned; the
    same request then works and reads back what was put."""
    with monkeypatch.context() as m:
        if pure:
            pure_core(m)
        rng = np.random.default_rng(2)
        sizes = (1024, 2 << 20, 3000, 1 << 20, 512)
        feats = [FeatureSpec(f"m{i}", random_item(rng, n)) for i, n in enumerate(sizes)]
        with (
            SenderCache(make_config(16 << 20, 4 << 20, 1)) as tx,
            ReceiverCache.attach(tx.handle()) as rx,
        ):
            face = AsyncSenderCache(tx, inline_threshold_bytes=64 << 10)
            task = asyncio.ensure_future(face.get_and_update_features(feats))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                rx.get_and_update_features(await task)  # finished first: read it
            except asyncio.CancelledError:
                pass
            await face.aclose()  # waits for a thread that may still run
            rx.get_and_update_features([])  # its acknowledgements are published
            tx.remove_dangling_items()
            assert all(tx.is_freeable(h) for h in tx.cached_order())
            assert not tx.store.is_pending("m1") and not tx.store.is_pending("m3")
            assert tx.snapshot().readers[0].lag == 0
            back = rx.get_and_update_features(tx.get_and_update_features(feats))
            assert [f.mm_hash for f in back] == [f.mm_hash for f in feats]
            for f in back:
                assert checksum(f.data["data"]) == f.data["crc"]
