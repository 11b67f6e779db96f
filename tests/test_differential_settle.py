"""The compiled settlement of acknowledgements (``core.settle_pairs``) against its reference.

``HandoutLedger.settle_all`` (a drain's acknowledgements applied in order) runs its loop in the
compiled core as far as it goes and in its own Python loop from there; the pure core goes
nowhere, so the Python loop is the reference. Two ledgers made by the same operations on a fake
clock, one settling on each core, give the same answers and end in the same state; a pair
whose entry, hand-out or count the core does not know stops it there, before that pair changes
anything, and the reference goes on.
"""

from __future__ import annotations

import dis
import gc
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioshmcache
from aioshmcache import _core_py, _ledger
from aioshmcache._core_api import core
from aioshmcache._ledger import Debts, HandoutLedger

from .helpers import FakeClock

pytestmark = pytest.mark.skipif(
    aioshmcache.implementation() != "c", reason="the compiled core is not in use"
)

T = TypeVar("T")
SESSIONS = (11, 12, 13)
CIDS = st.integers(1, 6)
OPS = st.one_of(
    st.tuples(st.just("hand"), CIDS, st.sets(st.sampled_from(SESSIONS))),
    st.tuples(st.just("pin"), CIDS, st.just(frozenset())),
    st.tuples(st.just("unpin"), CIDS, st.just(frozenset())),
    st.tuples(st.just("touch"), CIDS, st.just(frozenset())),
    st.tuples(st.just("release"), CIDS, st.just(frozenset())),
    st.tuples(st.just("drop"), st.sampled_from(SESSIONS), st.just(frozenset())),
    st.tuples(st.just("tick"), st.just(0), st.just(frozenset())),
)
#: one drain: a session and its acknowledgements, each the index of a hand-out made so far
#: (counted from the latest: settled already, owed by another session, or still owed) or,
#: from ``FORGED`` on, a pair never made
FORGED = 40
DRAIN = st.tuples(st.sampled_from(SESSIONS), st.lists(st.integers(0, FORGED + 5), max_size=12))


def state(ledger: HandoutLedger) -> object:
    """Everything the settlement reads or writes, by value."""
    entries = {
        cid: (
            dict(e.out),
            e.debt,
            e.pins,
            e.touched_at,
        )
        for cid, e in ledger.entries.items()
    }
    return entries, dict(ledger.owed), ledger.last_acknowledged(11), ledger.next_seq


def on_both_cores(m: pytest.MonkeyPatch, run: Callable[[], T]) -> tuple[T, T]:
    """``run()`` settling on the compiled core, then again on the pure one."""
    with_c = run()
    with m.context() as pure:
        pure.setattr(_ledger, "_settle_pairs", _core_py.settle_pairs)
        return with_c, run()


def _run(one_of_n: bool, steps: list[tuple[list[Any], Any]]) -> list[object]:
    """The operations then a drain, step after step: each answer and the state after it."""
    clock = FakeClock(0.0)
    ledger = HandoutLedger(one_of_n=one_of_n, handout_ttl=10.0, clock=clock)
    seqs: dict[int, int] = {}
    made: list[tuple[int, int]] = []
    seen: list[object] = []
    for ops, (session, picks) in steps:
        for op, x, owers in ops:
            if op == "hand":
                seqs[x] = ledger.hand_out_id(x, sorted(owers))
                made.append((x, seqs[x]))
            elif op in ("pin", "touch"):
                getattr(ledger, op)(ledger.debts_of(x))
            elif op == "unpin" and (e := ledger.get(x)) is not None and e.pins:
                ledger.unpin(e)
            elif op == "release" and x in seqs:
                seen.append(ledger.release(x, seqs[x]))
            elif op == "drop":
                ledger.drop_session(x)
            elif op == "tick":
                clock.now += 1.0
        pairs = [made[-1 - i % len(made)] if made and i < FORGED else (i % 7, i) for i in picks]
        seen.append(ledger.settle_all([v for p in pairs for v in p], session))
        seen.append(state(ledger))
    return seen


@settings(max_examples=150, deadline=None)
@given(one_of_n=st.booleans(), steps=st.lists(st.tuples(st.lists(OPS, max_size=8), DRAIN)))
def test_random_drains_settle_alike_on_both_cores(
    one_of_n: bool, steps: list[tuple[list[Any], Any]]
) -> None:
    with pytest.MonkeyPatch.context() as m:
        with_c, pure = on_both_cores(m, lambda: _run(one_of_n, steps))
    assert with_c == pure


class _OwnDebts(Debts):
    """An entry of a type the core does not know (a subclass)."""

    __slots__ = ()


def _odd_drain(case: str) -> tuple[HandoutLedger, list[Any]]:
    """A ledger owing three hand-outs to session 11, the second of them odd (``case``: its
    entry a ``Debts`` subclass, its ower a float; or the session's count a float, which every
    pair reads), and the drain that acknowledges all three."""
    ledger = HandoutLedger(one_of_n=False, handout_ttl=10.0, clock=FakeClock(0.0))
    first = ledger.hand_out_id(1, [11])
    if case == "count":
        odd = ledger.hand_out_id(2, [11])
        ledger.owed[11] = 2.0  # type: ignore[assignment]
    else:
        e = _OwnDebts(2) if case == "entry" else Debts(2)
        ledger.add(e)
        owers: list[Any] = [11] if case == "entry" else [11.0]  # 11.0 == 11
        odd = ledger.hand_out(e, owers)
    last = ledger.hand_out_id(3, [11])
    return ledger, [1, first, 2, odd, 3, last]


@pytest.mark.parametrize("case", ["entry", "ower", "count"])
def test_a_pair_the_core_does_not_know_stops_it_and_the_reference_goes_on(case: str) -> None:
    """The core settles in order up to a pair whose entry is not a ``Debts``, whose ower is
    not an int, or whose session's count is not an int, and leaves that pair untouched: the ledger's
    own loop settles it and the rest, so the whole drain ends as the reference's."""
    ledger, acks = _odd_drain(case)
    # stopped at the second pair, the first settled; at the first for the session's count
    stop = 0 if case == "count" else 1
    assert core.settle_pairs(ledger, acks, 11) == (stop, 2 * stop)
    left = ledger.get(stop + 1)
    assert left is not None and left.debt == 1  # ... and that pair left alone

    def drain(settle_c: bool) -> tuple[int, object]:
        ledger, acks = _odd_drain(case)
        with pytest.MonkeyPatch.context() as m:
            if not settle_c:
                m.setattr(_ledger, "_settle_pairs", _core_py.settle_pairs)
            return ledger.settle_all(acks, 11), state(ledger)

    with_c, pure = drain(True), drain(False)
    assert with_c == pure and with_c[0] == 3


def test_a_hand_out_that_is_not_a_pair_raises_as_the_reference_does() -> None:
    """A hand-out recorded as something other than an ``(owers, when)`` pair (a ledger gone
    wrong) is the reference's ``TypeError``, with the same state left: the core stops before
    that pair."""

    def drain(settle_c: bool) -> object:
        ledger = HandoutLedger(one_of_n=False, handout_ttl=10.0, clock=FakeClock(0.0))
        first = ledger.hand_out_id(1, [11])
        broken = ledger.hand_out_id(2, [11])
        ledger.entries[2].out[broken] = 7  # type: ignore[assignment]
        with pytest.MonkeyPatch.context() as m:
            if not settle_c:
                m.setattr(_ledger, "_settle_pairs", _core_py.settle_pairs)
            with pytest.raises(TypeError):
                ledger.settle_all([1, first, 2, broken], 11)
        return state(ledger)

    assert drain(True) == drain(False)


def test_the_core_declines_what_is_not_a_ledger_s_drain() -> None:
    """Not the ledger's class, not a list of pairs, not an int session: nothing gone through."""
    ledger = HandoutLedger(one_of_n=False, handout_ttl=10.0)
    seq = ledger.hand_out_id(1, [11])

    class OwnLedger(HandoutLedger):
        __slots__ = ()

    for args in (
        (OwnLedger(one_of_n=False, handout_ttl=10.0), [1, seq], 11),
        (ledger, (1, seq), 11),
        (ledger, [1, seq, 2], 11),
        (ledger, [1, seq], 11.0),
    ):
        assert core.settle_pairs(*args) == (0, 0)
    assert ledger.owed == {11: 1}
    assert core.settle_pairs(ledger, [1, seq], 11) == (1, 2) and ledger.owed == {11: 0}


def _consistent(ledger: HandoutLedger) -> None:
    """Each entry's debt is what its hand-outs are owed, and each session's count the hand-outs
    that list it."""
    per: dict[int, int] = {}
    for e in ledger.entries.values():
        assert e.debt == sum(1 if o is None else len(o) for o, _t in e.out.values())
        for o, _t in e.out.values():
            for session in o or ():
                per[session] = per.get(session, 0) + 1
    assert {s: n for s, n in ledger.owed.items() if n} == per


def test_a_collection_cannot_start_inside_the_settlement() -> None:
    """No collection starts while the core settles (the collector is off for the call): a
    finalizer that a collection there ran could change the ledger under the loop. A review made
    one release the hand-outs being settled, from a collection started by the first allocation
    of the call (the owers without the session): the owers read from ``out`` were freed, and a
    session's count was left at 6 with nothing owed."""
    big = 10**15
    s1, s2, s3 = big + 1, big + 2, big + 3
    ledger = HandoutLedger(one_of_n=False, handout_ttl=60.0, clock=FakeClock(0.0))
    outs = [(cid, ledger.hand_out_id(cid, (s1, s2, s3))) for cid in range(1, 9)]
    ledger.settle_all([v for p in outs for v in p], s1)  # each owers now (s2, s3), out's own
    lines, first = inspect.getsourcelines(HandoutLedger.settle_all)
    line = first + next(i for i, text in enumerate(lines) if "_settle_pairs(" in text)
    code = HandoutLedger.settle_all.__code__
    call = next(  # the instruction that calls the core: a collection started inside it
        ins.offset
        for ins in dis.get_instructions(code)
        if ins.opname == "CALL" and ins.positions is not None and ins.positions.lineno == line
    )
    fired: list[None] = []

    def inside(phase: str, info: dict[str, Any]) -> None:
        here = inspect.currentframe()
        frame = here.f_back if here is not None else None  # where the collection started
        if phase != "start" or fired or frame is None:
            return
        if (frame.f_code, frame.f_lasti) == (code, call):
            fired.append(None)
            for cid, seq in outs:
                ledger.release(cid, seq)

    gc.collect()
    threshold = gc.get_threshold()
    gc.callbacks.append(inside)
    gc.set_threshold(1)
    try:
        settled = ledger.settle_all([v for p in outs for v in p], s2)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(inside)
    assert fired == [] and settled == len(outs)
    _consistent(ledger)
    assert ledger.owed == {s1: 0, s2: 0, s3: len(outs)}


class _Stamp(float):
    """A clock's time that is not a plain float: a finalizer of its own, and a ``__dict__``
    (so a tuple holding it must stay tracked by the collector)."""

    on_free: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self.on_free is not None:
            self.on_free()


def test_a_time_that_is_not_a_plain_float_is_the_reference_s_to_release() -> None:
    """A review's case: a hand-out whose time is the clock's own object, whose release runs
    Python code (it replaced the entry's ``out`` under the loop: a use after free on the
    sanitizer build). The core stops before such a pair, and the reference settles it, with
    the same answer and state; a pair kept with such a time stays tracked by the collector."""
    cid = 10**12 + 7

    def drain(settle_c: bool) -> tuple[int, object, bool]:
        ledger = HandoutLedger(one_of_n=False, handout_ttl=10.0, clock=lambda: _Stamp(1.0))
        seq = ledger.hand_out_id(cid, (11, 12))
        ledger.settle_all([cid, seq], 12)  # partial: out[seq] = ((11,), when)
        e = ledger.entries[cid]
        tracked = gc.is_tracked(e.out[seq])
        when = e.out[seq][1]
        assert isinstance(when, _Stamp)

        def replace_out() -> None:
            if (again := ledger.entries.get(cid)) is not None:
                again.out = {}

        when.on_free = replace_out
        del when
        with pytest.MonkeyPatch.context() as m:
            if not settle_c:
                m.setattr(_ledger, "_settle_pairs", _core_py.settle_pairs)
            n = ledger.settle_all([cid, seq], 11)
        return n, state(ledger), tracked

    with_c, pure = drain(True), drain(False)
    assert with_c == pure
    assert with_c[0] == 1 and with_c[2] is True and cid not in with_c[1][0]  # type: ignore[index]


def test_a_clock_that_raises_changes_nothing_on_either_core() -> None:
    """A review's case: the reference read the clock after taking the seq and making the entry,
    the compiled hand-out before anything; a clock that raises now leaves the ledger as it was
    in both (no seq taken, no empty entry tracked)."""

    def boom() -> float:
        raise RuntimeError("clock")

    for one_of_n in (False, True):
        ledger = HandoutLedger(one_of_n=one_of_n, handout_ttl=10.0, clock=boom)
        with pytest.raises(RuntimeError):
            ledger.hand_out_id(5, (11,))
        e = Debts(6)
        with pytest.raises(RuntimeError):
            ledger.hand_out(e, (11,))
        assert ledger.next_seq == 1 and not ledger.entries and not ledger.owed
