"""The engine client's pool bookkeeping, pure: a state machine against a plain model, then rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aioshmcache._channel_pool import PoolBook
from aioshmcache.channel import EngineClient

MAX = 3
INITIAL, CAP, FACTOR, JITTER = 0.1, 1.0, 2.0, 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PoolModel(RuleBasedStateMachine):
    """Random plans, opens, failures, returns, clock steps and a close, checked step by step.

    Callers told to wait are kept as sleepers: each wakes at its ``until`` or when the book
    signals a change (``on_change``); none may sleep through a change that would let it go on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.r = 0.5
        self.book: PoolBook[int] = PoolBook(
            MAX,
            backoff_initial=INITIAL,
            backoff_max=CAP,
            backoff_factor=FACTOR,
            jitter=JITTER,
            clock=self.clock,
            rand=lambda: self.r,
            on_change=self.woken,
        )
        # the model
        self.idle: list[int] = []
        self.lent: set[int] = set()
        self.opening = 0
        self.failures = 0
        self.retry_at = 0.0
        self.closed = False
        self.next_conn = 0
        self.wakes = 0
        self.sleepers: list[tuple[int, float | None]] = []  # (wakes when it slept, until)

    def woken(self) -> None:
        self.wakes += 1

    def expected_kind(self) -> str:
        if self.closed:
            return "closed"
        if self.idle:
            return "reuse"
        if len(self.lent) + self.opening >= MAX:
            return "wait"
        if self.failures and self.opening:
            return "wait"
        if self.clock.now < self.retry_at:
            return "wait"
        return "open"

    @rule()
    def plan(self) -> None:
        kind = self.expected_kind()
        step = self.book.plan()
        assert step.kind == kind
        if kind == "reuse":
            assert step.conn == self.idle.pop()  # most recently returned first
            self.lent.add(step.conn)
        elif kind == "open":
            self.opening += 1
        elif kind == "wait" and self.clock.now < self.retry_at and not self.opening:
            assert step.until == (self.retry_at if len(self.lent) < MAX else None)
        if kind == "wait":
            self.sleepers.append((self.wakes, step.until))

    @rule()
    def take_idle(self) -> None:
        """The fast path: ``plan``'s reuse when it would reuse, nothing (no change) otherwise."""
        kind = self.expected_kind()
        conn = self.book.take_idle()
        if kind == "reuse":
            assert conn == self.idle.pop()
            self.lent.add(conn)
        else:
            assert conn is None

    @precondition(lambda self: self.opening > 0)
    @rule()
    def open_succeeds(self) -> None:
        self.next_conn += 1
        self.book.opened(self.next_conn)
        self.opening -= 1
        self.lent.add(self.next_conn)
        if not self.closed:
            self.failures = 0
            self.retry_at = 0.0

    @precondition(lambda self: self.opening > 0)
    @rule(r=st.floats(0.0, 0.999))
    def open_fails(self, r: float) -> None:
        self.r = r
        self.book.open_failed(OSError("refused"))
        self.opening -= 1
        self.failures += 1
        delay = min(CAP, INITIAL * FACTOR ** (self.failures - 1)) * (1 - JITTER * r)
        self.retry_at = self.clock.now + delay

    @precondition(lambda self: self.opening > 0)
    @rule()
    def open_abandoned(self) -> None:
        self.book.open_abandoned()
        self.opening -= 1

    @precondition(lambda self: bool(self.lent))
    @rule(reusable=st.booleans(), data=st.data())
    def give_back(self, reusable: bool, data: st.DataObject) -> None:
        conn = data.draw(st.sampled_from(sorted(self.lent)))
        self.lent.discard(conn)
        out = self.book.give_back(conn, reusable=reusable)
        if reusable and not self.closed:
            assert out is None
            self.idle.append(conn)
        else:
            assert out == conn

    @rule()
    def drop_idle(self) -> None:
        assert self.book.drop_idle() == self.idle
        self.idle = []

    @rule(dt=st.floats(0.0, 2.0))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        assert sorted(self.book.close()) == sorted(self.idle)
        self.idle = []
        self.closed = True

    @invariant()
    def no_sleeper_misses_a_change(self) -> None:
        now = self.clock.now
        self.sleepers = [
            (w, until)
            for w, until in self.sleepers
            if w == self.wakes and (until is None or now < until)  # the others planned again
        ]
        if self.sleepers:
            assert self.expected_kind() == "wait"

    @invariant()
    def agrees(self) -> None:
        assert self.book.lent == len(self.lent)
        assert self.book.opening == self.opening
        assert self.book.idle == self.idle
        assert self.book.failures == self.failures
        assert self.book.retry_at == pytest.approx(self.retry_at)
        assert self.book.lent + self.book.opening <= MAX


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_backoff_doubles_up_to_the_cap_and_ends_at_the_first_success() -> None:
    clock = Clock()
    book: PoolBook[str] = PoolBook(2, backoff_initial=0.1, backoff_max=0.5, jitter=0.0, clock=clock)
    delays = []
    for _ in range(5):
        assert book.plan().kind == "open"
        book.open_failed(OSError())
        delays.append(book.retry_at - clock.now)
        step = book.plan()
        assert step.kind == "wait" and step.until == book.retry_at  # no open before retry_at
        clock.now = book.retry_at
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert book.plan().kind == "open"
    book.opened("c")
    assert book.failures == 0 and book.retry_at == 0.0
    book.give_back("c", reusable=True)
    assert book.plan().conn == "c"  # reuse before opening another


def test_the_probes_open_wakes_the_callers_queued_behind_it() -> None:
    """After a restart the probe's connect, not its whole call, lets the queued callers open."""
    wakes: list[str] = []
    book: PoolBook[str] = PoolBook(
        4, jitter=0.0, clock=Clock(), on_change=lambda: wakes.append("wake")
    )
    assert book.plan().kind == "open"
    book.open_failed(OSError())
    book.retry_at = 0.0  # the backoff has passed
    assert book.plan().kind == "open"  # the probe
    queued = [book.plan() for _ in range(3)]
    assert [s.kind for s in queued] == ["wait"] * 3 and all(s.until is None for s in queued)
    wakes.clear()
    book.opened("probe")  # the probe's call now runs for as long as it likes
    assert wakes  # the queued callers are woken ...
    assert [book.plan().kind for _ in range(3)] == ["open"] * 3  # ... and open their own


def test_a_restarted_engine_waits_at_most_half_a_second_for_its_first_call() -> None:
    """The default backoff's cap (a probe of a local socket is one cheap connect)."""
    clock = Clock()
    book: PoolBook[str] = PoolBook(4, clock=clock)
    for _ in range(20):  # a long outage
        clock.now = book.retry_at
        assert book.plan().kind == "open"
        book.open_failed(OSError())
    assert book.retry_at - clock.now <= 0.5
    assert EngineClient.connect(Path("x")).pool.backoff_max == book.backoff_max  # the client too


def test_one_probe_at_a_time_while_the_engine_fails() -> None:
    book: PoolBook[str] = PoolBook(4, jitter=0.0, clock=Clock())
    assert book.plan().kind == "open"
    book.open_failed(OSError())
    book.retry_at = 0.0  # the backoff has passed
    assert book.plan().kind == "open"
    assert book.plan().kind == "wait"  # half-open: the second caller waits for the probe


def test_a_closed_pool_lends_nothing_and_hands_back_what_returns() -> None:
    book: PoolBook[str] = PoolBook(2, clock=Clock())
    assert book.plan().kind == "open"
    book.opened("a")
    book.give_back("a", reusable=True)
    assert book.plan().kind == "reuse"
    assert book.close() == []
    assert book.give_back("a", reusable=True) == "a"
    assert book.plan().kind == "closed"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_connections": 0},
        {"max_connections": 1, "backoff_initial": 0.0},
        {"max_connections": 1, "backoff_initial": 2.0, "backoff_max": 1.0},
        {"max_connections": 1, "jitter": 1.0},
        {"max_connections": 1, "backoff_factor": 0.5},
    ],
)
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PoolBook(**kwargs)  # type: ignore[arg-type]


def test_bookkeeping_misuse_raises() -> None:
    book: PoolBook[str] = PoolBook(1, clock=Clock())
    with pytest.raises(RuntimeError):
        book.opened("x")
    with pytest.raises(RuntimeError):
        book.give_back("x", reusable=True)
