"""Differential tests of the sender's one-item hit and look-up: the core's ``put_item`` hands
out a cached hash in one compiled call (``hit_locked`` in ``_core_put.c``), the steps of
``SenderRequest._decide_locked``'s hit (the reference). Every one-item entry point (sync and
async, items and features) runs the same random calls on the core in use and on the pure-Python
reference and gives the same answers, errors, counters, second-chance marks, kept prompt
updates, hand-out ledger, header words and segment, bit for bit. With ``AIOSHM_PURE=1`` both
runs are the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioshmcache.aio
from aioshmcache import (
    AsyncSenderCache,
    CacheMissError,
    FeatureSpec,
    SenderCache,
    ShmObjectStore,
    ShmRef,
    _request,
)
from aioshmcache._kept import restore

from .helpers import count_sender_requests
from .test_core import c_core
from .test_differential_store import (
    _INSTANCE_WORDS,
    ITEMS,
    _ledger_state,
    _ref_fields,
    _sender_for,
    _spied,
    on_both_cores,
    pure_core,
)

C = c_core()


@dataclasses.dataclass
class _Update:
    """A prompt update the sender keeps packed (``_kept``): restored as a new, equal object."""

    offset: int
    tokens: list[int]


def _by_reference(x: int) -> int:
    """Its module names it: numbered, kept as itself (the same object in both runs)."""
    return x


def _updates(kind: int, n: int) -> list[Any]:
    """Prompt updates of every form the sender keeps: none, atoms (kept as they are), lists and
    dicts, a dataclass (packed), a function its module names (numbered: the same object)."""
    forms: list[list[Any]] = [
        [],
        [n, "u"],
        [[1, 2, n], {"k": n}],
        [_Update(n, [n, n + 1])],
        [_by_reference, n],
    ]
    return forms[kind]


KEYS = st.sampled_from([f"k{i}" for i in range(6)])
#: (hash, item: -1 a look-up, else ``ITEMS``' index, updates' kind, ``touch`` first)
CALLS = st.lists(
    st.tuples(KEYS, st.integers(-1, 3), st.integers(0, 4), st.booleans()),
    min_size=1,
    max_size=30,
)
VIAS = ("item", "features", "list", "async item", "async features", "async list")


async def _call(
    cache: SenderCache, face: AsyncSenderCache, via: str, item: Any, h: str
) -> tuple[Any, Sequence[Any]]:
    """One item through ``via``: its ``(data, prompt_updates)``."""
    if via == "item":
        return cache.get_and_update_item(item, h)
    if via == "async item":
        return await face.get_and_update_item(item, h)
    if via == "list":
        return cache.get_and_update([item], [h])[0]
    if via == "async list":
        return (await face.get_and_update([item], [h]))[0]
    spec = FeatureSpec(h, None) if item is None else FeatureSpec(h, item[0], prompt_updates=item[1])
    got = (
        cache.get_and_update_features([spec])
        if via == "features"
        else await face.get_and_update_features([spec])
    )
    return got[0].data, got[0].prompt_updates


def _words(cache: SenderCache) -> list[int]:
    """The header words, but those of the instance (nonce, pid, times)."""
    return [w if i not in _INSTANCE_WORDS else 0 for i, w in enumerate(cache.store.words[:64])]


def _state(cache: SenderCache) -> tuple[Any, ...]:
    snap = cache.snapshot()
    kept = sorted((h, list(restore(u))) for h, u in cache._prompt_updates.items())
    return (
        cache.store.keys(),
        (snap.hits, snap.misses, snap.inline_too_large, snap.evictions),
        sorted(cache.store._evict.marked.items()),
        kept,
        _ledger_state(cache.store),
    )


def _run(
    calls: list[tuple[str, int, int, bool]], seed: int, via: str, second_chance: bool
) -> tuple[list[object], bytes]:
    """Each call through ``via``, a live reader reading (so acknowledging) every other
    reference; the ledger's clock a counter, so that both runs record the same times."""
    rng = np.random.default_rng(seed)
    cache = _sender_for("diffhit", 1)
    cache.store.second_chance = second_chance
    ticks = iter(range(1, 1 << 30))
    cache.store._ledger.clock = lambda: float(next(ticks))
    face = AsyncSenderCache(cache)
    reader = ShmObjectStore.from_handle(cache.store.handle())
    answers: list[object] = []

    async def main() -> None:
        for i, (h, n, kind, touch) in enumerate(calls):
            if touch:
                answers.append(("touch", cache.touch(h)))
            item = None if n < 0 else (ITEMS[n](rng), _updates(kind, i))
            try:
                data, u = await _call(cache, face, via, item, h)
                if i % 2 == 0 and isinstance(data, ShmRef):
                    reader.get(data)
                got = _ref_fields(data) if isinstance(data, ShmRef) else "inline"
                answers.append((got, type(u).__name__, list(u)))
            except Exception as exc:
                answers.append(("error", type(exc).__name__, getattr(exc, "mm_hashes", None)))
            answers.append(("state", _state(cache)))

    with contextlib.closing(reader), cache:
        asyncio.run(main())
        answers.append(("words", _words(cache)))
        return answers, bytes(cache.store.ring.buf)


@pytest.mark.parametrize("via", VIAS)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(CALLS, st.integers(0, 2**32 - 1), st.booleans())
def test_one_item_hits_and_look_ups_answer_alike_on_both_cores(
    monkeypatch: pytest.MonkeyPatch,
    via: str,
    calls: list[tuple[str, int, int, bool]],
    seed: int,
    second_chance: bool,
) -> None:
    """Hits of given items (the caller's updates back), look-ups (the kept updates restored;
    ``CacheMissError`` for a hash not cached, nothing taken), touched entries, hand-outs owed
    by a live reader or acknowledged, misses that evict, second chance on or off: the same on
    both cores, step by step."""
    with_core, pure = on_both_cores(monkeypatch, lambda: _run(calls, seed, via, second_chance))
    assert with_core[0] == pure[0]
    assert with_core[1] == pure[1]


def _hits_and_look_ups(
    monkeypatch: pytest.MonkeyPatch, via: str
) -> tuple[list[Any], list[object], list[int]]:
    """A put, then a hit, a look-up and a look-up of a hash not cached through ``via``: the
    answers (with whether a given item's own updates came back), the state after each, and the
    ``SenderRequest``s made after the put."""
    monkeypatch.setattr(aioshmcache.aio, "CHECKPOINT_AFTER", 1e9)  # no turn due: no yield path
    rng = np.random.default_rng(3)
    cache = _sender_for("hittaken", 1)
    face = AsyncSenderCache(cache)
    answers: list[Any] = []
    try:

        async def main() -> list[object]:
            await _call(cache, face, via, (ITEMS[0](rng), _updates(3, 1)), "a")
            made = count_sender_requests(monkeypatch)
            given = (ITEMS[0](rng), _updates(2, 2))
            ref, u = await _call(cache, face, via, given, "a")  # a hit
            own = u is given[1] if via.endswith("item") or via.endswith("list") else None
            answers.append((_ref_fields(ref), list(u), own, _state(cache)))
            ref, u = await _call(cache, face, via, None, "a")  # a look-up
            answers.append((_ref_fields(ref), type(u).__name__, list(u), _state(cache)))
            with pytest.raises(CacheMissError):
                await _call(cache, face, via, None, "absent")
            answers.append(_state(cache))
            return made

        made = asyncio.run(main())
        return answers, made, _words(cache)
    finally:
        cache.close()


@pytest.mark.skipif(C is None, reason="the C core is not built here")
@pytest.mark.parametrize("via", VIAS)
def test_the_core_takes_the_hit_and_the_look_up_and_the_request_answers_the_same(
    monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """Not vacuous: on the C core a hit and a look-up through every one-item entry point make no
    ``SenderRequest`` (``put_item`` took them: a given item's own updates come back, the kept
    ones restored for a look-up, one hit counted each); a look-up of a hash not cached is
    declined (the request raises ``CacheMissError``, taking nothing). On the pure core the
    requests give the same answers, state and header words."""
    assert C is not None
    seen = _spied(monkeypatch, _request, "_put_item", C.put_item)
    with_c, made, words = _hits_and_look_ups(monkeypatch, via)
    assert seen == [True, True, True, False]  # the put, the hit, the look-up; the absent one
    assert len(made) == 1  # only the absent look-up's request
    assert with_c[0][1] == _updates(2, 2) and with_c[0][2] is not False  # the caller's own
    assert with_c[1][2] == [_Update(1, [1, 2])]  # the kept updates, restored
    assert with_c[0][3][1][0] == 1 and with_c[1][3][1][0] == 2  # the hits counted
    with monkeypatch.context() as m:
        pure_core(m)
        pure, made_pure, words_pure = _hits_and_look_ups(m, via)
    assert len(made_pure) == 3  # the reference: a request each
    assert with_c == pure
    assert words == words_pure
