"""The tier's pure parts: the circuit breaker (against a model), the cost policy, the value format.

No Redis here (these run in the default suite); the end-to-end tests are in ``test_tier.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aioshmcache import FeatureSpec, ShmRef
from aioshmcache._tier_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from aioshmcache._tier_policy import LinearCost, TierPolicy
from aioshmcache._tier_value import (
    DOMAIN,
    HEADER_SIZE,
    TierValueError,
    key_digest,
    keyspace,
    lease_key,
    open_value,
    seal_value,
    value_key,
)
from aioshmcache.tier import RedisTier, TierConfig, TierSnapshot
from aioshmcache.wire import pack_features

SECRET = b"k" * 32
KiB = 1 << 10
MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- circuit breaker ----------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=3, retry_after_s=1.0, max_retry_after_s=10.0, clock=clock)
    b.failure()
    b.failure()
    b.success()  # the count restarts
    b.failure()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow() and b.opened == 1


def test_breaker_half_open_lets_one_probe_through_and_backs_off_when_it_fails() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=1, retry_after_s=1.0, max_retry_after_s=3.0, clock=clock)
    b.failure()
    clock.now += 0.999
    assert not b.allow()
    clock.now += 0.002
    assert b.state == HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # nobody else while it runs
    b.failure()
    assert b.state == OPEN and b.retry_after_s == 2.0
    clock.now += 2.0
    assert b.allow()
    b.failure()
    assert b.retry_after_s == 3.0  # capped
    clock.now += 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.retry_after_s == 1.0 and b.allow() and b.allow()


def test_breaker_a_lost_probe_frees_its_slot_after_the_wait() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=1, retry_after_s=1.0, max_retry_after_s=10.0, clock=clock)
    b.failure()
    clock.now += 1.0
    assert b.allow()  # a probe that never reports (its task was cancelled)
    clock.now += 0.5
    assert not b.allow()
    clock.now += 0.5
    assert b.allow()


def test_breaker_failures_of_older_operations_while_open_change_nothing() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=2, retry_after_s=1.0, max_retry_after_s=10.0, clock=clock)
    b.failure()
    b.failure()
    clock.now += 0.5
    b.failure()  # started before the breaker opened
    assert b.retry_after_s == 1.0 and b.opened == 1
    clock.now += 0.5
    assert b.allow()


def test_breaker_a_failure_older_than_the_probe_is_not_the_probe_s() -> None:
    """An operation let through before the probe (it answered nothing for its whole socket
    timeout) reports its failure while the probe runs: the breaker stays half-open."""
    clock = Clock()
    b = CircuitBreaker(failures=1, retry_after_s=1.0, max_retry_after_s=10.0, clock=clock)
    old = b.now()
    b.failure()
    clock.now += 1.0
    assert b.allow()  # the probe
    b.failure(started_at=old)
    assert b.state == HALF_OPEN and b.opened == 1 and b.retry_after_s == 1.0
    b.failure(started_at=b.now())  # the probe's own failure
    assert b.state == OPEN and b.opened == 2 and b.retry_after_s == 2.0


def test_breaker_state_is_right_while_idle_and_retries_within_a_second_by_default() -> None:
    """Nobody calls ``allow``: the state still turns half-open when the wait is over (an idle
    host's metrics read it so), and the default wait never exceeds a second, so the tier is
    tried again within a second of Redis answering again."""
    clock = Clock()
    b = CircuitBreaker(clock=clock)
    for _ in range(20):  # Redis down for long: the wait doubles up to its cap
        while b.state != HALF_OPEN:
            b.failure()
            clock.now += 0.01
        clock.now += 30.0
        assert b.state == HALF_OPEN  # no call made: read from the clock
        assert b.allow()
        b.failure()
    assert b.state == OPEN and b.retry_after_s <= 1.0
    clock.now += 1.0
    assert b.state == HALF_OPEN and b.allow()
    b.success()
    assert b.state == CLOSED


@pytest.mark.parametrize(
    "kw",
    [{"failures": 0}, {"retry_after_s": 0.0}, {"retry_after_s": 5.0, "max_retry_after_s": 1.0}],
)
def test_breaker_rejects_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(**kw)


class BreakerModel(RuleBasedStateMachine):
    """The breaker against a plain restatement of its rules (the module docstring)."""

    THRESHOLD, BASE, MAX = 3, 1.0, 4.0

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.b = CircuitBreaker(
            failures=self.THRESHOLD,
            retry_after_s=self.BASE,
            max_retry_after_s=self.MAX,
            clock=self.clock,
        )
        self.mode = "closed"  # closed | open (until `until`)
        self.fails = 0
        self.wait = self.BASE
        self.until = 0.0
        self.probe: float | None = None
        self.opens = 0

    def _open(self) -> None:
        self.mode, self.until, self.probe, self.fails = "open", self.clock.now + self.wait, None, 0
        self.opens += 1

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 2.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def allow(self) -> None:
        got = self.b.allow()
        if self.mode == "closed":
            expect = True
        elif self.clock.now < self.until or (
            self.probe is not None and self.clock.now < self.probe + self.wait
        ):
            expect = False
        else:
            expect, self.probe = True, self.clock.now
        assert got == expect

    @rule()
    def success(self) -> None:
        self.b.success()
        self.mode, self.fails, self.wait, self.probe = "closed", 0, self.BASE, None

    @rule(ago=st.sampled_from([None, 0.0, 0.5, 3.0]))
    def failure(self, ago: float | None) -> None:
        started = None if ago is None else self.clock.now - ago
        self.b.failure(started)
        if self.mode == "closed":
            self.fails += 1
            if self.fails == self.THRESHOLD:
                self._open()
        elif self.probe is not None and (started is None or started >= self.probe):
            self.wait = min(2 * self.wait, self.MAX)
            self._open()

    @invariant()
    def same_state(self) -> None:
        if self.mode == "closed":
            expect = CLOSED
        else:
            expect = OPEN if self.clock.now < self.until else HALF_OPEN
        assert self.b.state == expect
        assert self.b.opened == self.opens
        assert self.b.retry_after_s == self.wait


TestBreakerModel = BreakerModel.TestCase
TestBreakerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- cost policy --------------------------------------------------------------------------------


def test_linear_cost_recovers_a_line_and_follows_a_change() -> None:
    fit = LinearCost(decay=0.9)
    for n in (0, MiB, 4 * MiB, 16 * MiB) * 5:
        fit.add(n, 0.001 + 2e-9 * n)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.001, rel=1e-6) and b == pytest.approx(2e-9, rel=1e-6)
    for n in (0, MiB, 4 * MiB, 16 * MiB) * 30:  # the network got twice as slow
        fit.add(n, 0.001 + 4e-9 * n)
    assert fit.coefficients()[1] == pytest.approx(4e-9, rel=0.01)


def test_linear_cost_one_size_only() -> None:
    flat, prop = LinearCost(), LinearCost(proportional=True)
    for _ in range(3):
        flat.add(MiB, 0.02)
        prop.add(MiB, 0.02)
    assert flat.coefficients() == pytest.approx((0.02, 0.0))
    assert prop.coefficients() == pytest.approx((0.0, 0.02 / MiB))
    assert LinearCost().coefficients() == (0.0, 0.0)
    with pytest.raises(ValueError):
        LinearCost(decay=0.0)


def _trained(
    make_s: float = 0.020,
    fixed: float = 0.0003,
    per_byte: float = 2.5e-9,
    probe: float = 0.0002,
    *,
    explore_every: int = 0,
) -> TierPolicy:
    p = TierPolicy(margin=0.8, explore_every=explore_every, warmup=0)
    for n in (MiB, 2 * MiB, 4 * MiB, 8 * MiB) * 4:
        p.observe_make(make_s, n)
        p.observe_probe(probe)
        p.observe_fetch(fixed + per_byte * n, n)
    return p


def test_policy_budget_is_where_fetching_stops_beating_the_make() -> None:
    p = _trained()
    budget = p.fetch_budget(64 * MiB)
    # 0.8 * 20 ms = 16 ms = 0.3 ms + 2.5 ns * n  ->  n = 6.28 MB
    assert budget == pytest.approx((0.016 - 0.0003) / 2.5e-9, rel=1e-3)
    assert p.fetch_cost(budget) <= 0.8 * 0.020 + 1e-9
    assert p.fetch_cost(budget + 1024) > 0.8 * 0.020
    assert p.worth_storing(4 * MiB, 0.020) and not p.worth_storing(8 * MiB, 0.020)
    assert p.fetch_budget(MiB) == MiB  # capped


def test_policy_weighs_only_what_a_fetch_adds_to_the_probe() -> None:
    """The probe's round trip is paid whether a value is then fetched or made (a sunk cost).

    Seen in the fleet bench at load 7: a probe took 20 ms of a 250 ms make, and counting it in
    every fetch shrank the budget and kept items out of the tier that a fetch still served
    faster than a make. Here a probe costs 50 ms, a fetch 1 ms + 10 ms per MiB, a make 100 ms.
    """
    p = _trained(make_s=0.100, fixed=0.001, per_byte=0.010 / MiB, probe=0.050)
    assert p.probe_cost() == pytest.approx(0.050)
    # 0.8 * 100 ms = 80 ms = 1 ms + 10 ms/MiB * n  ->  7.9 MiB (with the probe: 2.9 MiB)
    assert p.fetch_budget(64 * MiB) == pytest.approx(7.9 * MiB, rel=1e-3)
    assert p.worth_storing(6 * MiB, 0.100)  # 61 ms after the probe <= 80 ms
    assert not p.worth_storing(8 * MiB, 0.100)


def test_policy_stores_what_the_other_hosts_would_fetch_however_fast_its_make_ran() -> None:
    """The write is judged as the look-ups are: by the learned make cost too, not one sample.

    Seen in the fleet bench: on a loaded machine one 20 ms (CPU) make took 20-500 ms; items
    whose make ran in a quiet moment were not written, and every host then made them for
    ``skip_ttl_s``, although each would have fetched them (1.1 makes per item under 2 MiB).
    """
    p = _trained(make_s=0.100, fixed=0.001, per_byte=0.010 / MiB, probe=0.001)
    assert p.fetch_budget(64 * MiB) > 6 * MiB  # a host that looks 6 MiB up fetches it
    assert p.worth_storing(6 * MiB, 0.010)  # so it is stored, though this make took 10 ms
    assert not p.worth_storing(9 * MiB, 0.010)  # over the budget and a quick make: not
    assert p.worth_storing(9 * MiB, 0.500)  # an item whose own make was long: stored


def test_policy_skips_the_tier_when_a_round_trip_costs_more_than_a_make() -> None:
    p = _trained(make_s=0.0002, fixed=0.0003, probe=0.0003)
    assert p.fetch_budget(64 * MiB) == 0
    assert not p.worth_storing(1024, 0.0002)
    # however cheap the fetch of a value, a probe that costs more than the make skips the tier
    p = _trained(make_s=0.010, fixed=0.0, per_byte=1e-12, probe=0.009)
    assert p.fetch_budget(64 * MiB) == 0


def test_policy_before_learning_is_optimistic_and_explores() -> None:
    p = TierPolicy(explore_every=3)
    assert p.fetch_budget(64 * MiB) == 64 * MiB  # no make seen yet
    assert p.fetch_cost(0) == p.probe_cost() == pytest.approx(0.0005)  # the prior
    p = _trained(make_s=0.0002, fixed=0.0003, probe=0.0003, explore_every=3)
    assert [p.lookup_budget(64 * MiB) for _ in range(6)] == [0, 0, 64 * MiB, 0, 0, 64 * MiB]


def test_policy_keeps_its_prior_until_enough_samples() -> None:
    p = TierPolicy(min_samples=3, warmup=2, prior_fixed_s=0.0005, prior_per_byte_s=2e-9)
    p.observe_probe(1.0)  # warm-up: opening connections; never learned from
    p.observe_fetch(1.0, MiB)
    assert p.view(MiB).fetches_seen == p.view(MiB).probes_seen == 0
    p.observe_probe(0.050)
    p.observe_fetch(0.080, MiB)
    assert p.fetch_coefficients() == (0.0005, 2e-9) and p.probe_cost() == 0.0005
    assert p.worth_storing(MiB, 0.010)  # judged by the prior: 2.6 ms <= 8 ms
    for _ in range(2):
        p.observe_probe(0.050)
        p.observe_fetch(0.080, MiB)
    assert p.probe_cost() == pytest.approx(0.050)
    assert p.fetch_coefficients() == pytest.approx((0.0, 0.080 / MiB))  # one size: proportional
    assert not p.worth_storing(MiB, 0.010)  # learned: 80 ms per MiB


# The model: true costs (a make fixed, proportional or both; a fetch with a fixed part and a
# part per byte) at items of one size or of many, observed with a little noise; the policy's
# decisions must then match the truth at every size it saw (sizes not too near the break-even,
# where a 1 % noise may rightly tip the decision either way).
_MARGIN = 0.8


@st.composite
def _cost_tables(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["fixed", "proportional", "both"]))
    make_fixed = 0.0 if kind == "proportional" else draw(st.floats(0.001, 0.5))
    make_per_mb = 0.0 if kind == "fixed" else draw(st.floats(0.001, 0.5))
    fetch_fixed = draw(st.floats(0.0, 0.005))
    fetch_per_mb = draw(st.floats(0.0005, 0.1))
    base = draw(st.integers(4 * KiB, 32 * MiB))
    if draw(st.booleans()):  # one size: made at its array bytes, fetched at its value's bytes
        sizes = [base]
        value_extra = draw(st.integers(0, 512))
    else:
        factors = draw(st.lists(st.floats(0.1, 8.0), min_size=2, max_size=6, unique=True))
        sizes = sorted({max(1, int(base * f)) for f in [1.0, *factors]})
        value_extra = 0
    noise = draw(st.lists(st.floats(-0.01, 0.01), min_size=64, max_size=64))
    return {
        "make": lambda n: make_fixed + make_per_mb * n / MiB,
        "fetch": lambda n: fetch_fixed + fetch_per_mb * n / MiB,
        "sizes": sizes,
        "value_extra": value_extra,
        "noise": noise,
        "probe": draw(st.floats(0.0001, 0.002)),
    }


def _learned(t: dict[str, Any], samples: int = 40) -> TierPolicy:
    p = TierPolicy(margin=_MARGIN, explore_every=0, warmup=0, min_samples=1)
    noise = t["noise"]
    for i in range(samples):
        n = t["sizes"][i % len(t["sizes"])]
        e = 1.0 + noise[i % len(noise)]
        p.observe_make(t["make"](n) * e, n)  # made here
        if i % 3 == 0:  # made by another host: its make time carried in the value
            p.observe_make(t["make"](n) * e, n + t["value_extra"])
        p.observe_probe(t["probe"] * e)
        p.observe_fetch(t["fetch"](n + t["value_extra"]) * e, n + t["value_extra"])
    return p


@settings(max_examples=300, deadline=None)
@given(_cost_tables())
def test_policy_decides_as_the_true_costs_do_at_every_size_seen(t: dict[str, Any]) -> None:
    """Model test: at each size seen, the policy fetches exactly when fetching beats the make."""
    wins = {n: t["fetch"](n) <= _MARGIN * t["make"](n) for n in t["sizes"]}
    for n in t["sizes"]:  # far enough from the break-even for 1 % noise not to tip it
        assume(abs(t["fetch"](n) - _MARGIN * t["make"](n)) > 0.05 * _MARGIN * t["make"](n))
    assume(all(t["probe"] < 0.5 * _MARGIN * t["make"](n) for n in t["sizes"]))
    p = _learned(t)
    budget = p.fetch_budget(1 << 40)  # a cap over every size drawn
    # a make that grows faster than a fetch: only large values win, and a look-up cannot ask
    # for "at least n" bytes: the budget is then everything, and the reported size decides
    large_win = _MARGIN * p.make_coefficients()[1] >= p.fetch_coefficients()[1]
    for n in t["sizes"]:
        v = n + t["value_extra"]
        view = p.view(1 << 40)
        assert p.worth_fetching(v) == wins[n], (n, view)
        if wins[n]:  # the budget never keeps out a value that is worth fetching
            assert v <= budget, (n, view)
        elif not large_win:  # nor lets in one that is not
            assert v > budget, (n, view)
        assert p.worth_storing(v, t["make"](n)) == wins[n]


@settings(max_examples=100, deadline=None)
@given(_cost_tables(), st.floats(1.05, 20.0))
def test_policy_skips_the_tier_only_when_a_round_trip_loses_to_a_typical_make(
    t: dict[str, Any], times: float
) -> None:
    mean_make = sum(t["make"](n) for n in t["sizes"]) / len(t["sizes"])
    t["probe"] = _MARGIN * t["make"](max(t["sizes"])) * times  # more than any make is worth
    p = _learned(t)
    assert p.fetch_budget(64 * MiB) == 0
    t["probe"] = _MARGIN * min(t["make"](n) for n in t["sizes"]) / times
    p = _learned(t)
    assert p.probe_cost() < _MARGIN * mean_make


def test_policy_fetches_items_of_one_size_whose_make_is_long() -> None:
    """The fleet test's costs: 256 KiB items made in ~90 ms here (at their array bytes) and by
    other hosts (at their value's bytes, 200 more), fetched in ~2.3 ms: the budget was 0."""
    p = TierPolicy(warmup=0)
    for i in range(40):
        p.observe_make(0.085 + 0.005 * (i % 2), 256 * KiB)
        p.observe_make(0.095 + 0.005 * (i % 2), 256 * KiB + 200)  # by chance a bit longer
        p.observe_probe(0.0008)
        p.observe_fetch(0.0023, 256 * KiB + 200)
    assert p.fetch_budget(64 * MiB) > 256 * KiB + 200
    assert p.worth_fetching(256 * KiB + 200)
    assert p.view(64 * MiB).budget_bytes > 256 * KiB


def test_policy_with_a_make_proportional_to_its_size_uses_the_tier() -> None:
    """A make that grows with its size (intercept 0) is not "cheaper than a round trip"."""
    p = TierPolicy(warmup=0, explore_every=0)
    for n in (MiB, 2 * MiB, 4 * MiB, 8 * MiB) * 5:
        p.observe_make(0.050 * n / MiB, n)
        p.observe_probe(0.001)
        p.observe_fetch(0.0005 + 0.002 * n / MiB, n)
    assert p.make_coefficients()[0] == pytest.approx(0.0, abs=1e-9)
    assert p.fetch_budget(64 * MiB) == 64 * MiB


def test_policy_sizes_the_lookup_deadline_from_what_a_look_up_is_worth() -> None:
    p = TierPolicy(warmup=0, first_deadline_s=0.5, deadline_fraction=1.0)
    assert p.lookup_deadline(0.05) == 0.5  # no make seen: the first look-ups open connections
    for _ in range(5):
        p.observe_make(0.200, MiB)
    assert p.lookup_deadline(0.05) == pytest.approx(0.200)  # a look-up is worth a make
    for _ in range(100):
        p.observe_make(0.001, MiB)
    assert p.lookup_deadline(0.05) == pytest.approx(0.05)  # never under the floor
    half = TierPolicy(warmup=0, deadline_fraction=0.5)
    for n in (MiB, 4 * MiB) * 5:  # a make that grows with size: judged at the mean size made
        half.observe_make(0.1 * n / MiB, n)
    assert half.lookup_deadline(0.0) == pytest.approx(0.5 * 0.1 * 2.5, rel=0.05)
    for bad in (0.0, -1.0, 11.0):
        with pytest.raises(ValueError):
            TierPolicy(deadline_fraction=bad)
    with pytest.raises(ValueError):
        TierPolicy(first_deadline_s=-1.0)


def test_policy_that_does_not_learn_keeps_its_priors() -> None:
    p = TierPolicy(learn=False, prior_fixed_s=0.001, prior_per_byte_s=1e-9)
    p.observe_make(0.0001, MiB)
    p.observe_probe(1.0)
    p.observe_fetch(1.0, MiB)
    assert p.fetch_budget(64 * MiB) == 64 * MiB
    assert p.fetch_cost(MiB) == pytest.approx(0.001 + 1e-9 * MiB)
    assert p.worth_storing(MiB, 0.01) and not p.worth_storing(MiB, 0.001)


async def test_every_make_teaches_the_policy_not_only_those_stored() -> None:
    """A make whose item is not written (Redis down, a value too large to fetch) is learned.

    Before, only the makes of items written to Redis were: a policy that had stopped using the
    tier for some items never re-learned what making them costs.
    """
    policy = TierPolicy(warmup=0, explore_every=0)
    tier = RedisTier(
        "redis://127.0.0.1:1/0",  # nobody listens: every look-up fails or is bypassed
        secret=SECRET,
        breaker=CircuitBreaker(failures=1, retry_after_s=60.0, max_retry_after_s=60.0),
        policy=policy,
    )

    async def make() -> dict[str, Any]:
        return {"x": np.zeros(MiB, np.uint8)}

    async with tier:
        for i in range(3):
            await tier.fetch_or_make(f"m{i}", make)
    s = tier.stats()
    assert (s.makes, s.writes, s.errors + s.timeouts, s.bypassed + s.skipped) == (3, 0, 1, 2)
    assert policy.view(64 * MiB).makes_seen == 3
    assert policy.make_cost(MiB) is not None


def test_policy_rejects_nonsense() -> None:
    for kw in (
        {"margin": 0.0},
        {"margin": 1.5},
        {"prior_fixed_s": -1.0},
        {"explore_every": -1},
        {"min_samples": 0},
        {"warmup": -1},
    ):
        with pytest.raises(ValueError):
            TierPolicy(**kw)


# --- value format -------------------------------------------------------------------------------


def _item() -> dict[str, Any]:
    return {"pixel_values": np.arange(1000, dtype=np.float32).reshape(10, 100), "n": 3}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])
    assert a["pixel_values"].dtype == b["pixel_values"].dtype and a["n"] == b["n"]


def test_value_round_trip_and_layout() -> None:
    key = value_key("p:", "h1")
    data = seal_value(SECRET, key, "h1", _item(), make_ns=12345)
    magic, version, flags, header, length, make_ns = struct.unpack_from("<8sHHIQQ", data)
    assert (magic, version, flags, header) == (b"AIOSHMTV", 1, 0, HEADER_SIZE)
    assert length == len(data) - HEADER_SIZE and make_ns == 12345
    payload = data[HEADER_SIZE:]
    assert payload == pack_features([FeatureSpec("h1", _item())])
    kb = key.encode()
    tag = hmac.new(
        SECRET, DOMAIN + struct.pack("<I", len(kb)) + kb + data[:32] + payload, hashlib.sha256
    ).digest()
    assert data[32:64] == tag
    item, ns = open_value(SECRET, key, "h1", data, max_item_bytes=MiB)
    _same(item, _item())
    assert ns == 12345


def test_keys_share_a_hash_tag_whatever_the_hash_looks_like() -> None:
    for h in ("abc", "{x}y}", "é" * 300, ""):
        v, lk = value_key("aioshm:", h), lease_key("aioshm:", h)
        tag = "{" + key_digest(h) + "}"
        assert v == f"aioshm:{tag}:v" and lk == f"aioshm:{tag}:l"


def test_the_key_namespace_is_a_keyed_digest_of_the_secret() -> None:
    space = keyspace("aioshm:", SECRET)
    ns = hmac.new(SECRET, b"aioshmcache.tier/namespace", hashlib.sha256).hexdigest()[:16]
    assert space == f"aioshm:{ns}:"
    assert keyspace("aioshm:", SECRET + b"x") != space  # another secret, other keys
    assert SECRET.hex()[:16] not in space  # names the secret without revealing it
    assert RedisTier("redis://127.0.0.1:1/0", secret=SECRET).keyspace == space


def _reason(data: bytes, *, key: str | None = None, h: str = "h1", limit: int = MiB) -> str:
    with pytest.raises(TierValueError) as ei:
        open_value(SECRET, key or value_key("p:", "h1"), h, data, max_item_bytes=limit)
    assert isinstance(ei.value, ValueError)
    return ei.value.reason


def test_value_under_another_secret_is_refused() -> None:
    key = value_key("p:", "h1")
    assert _reason(seal_value(b"q" * 32, key, "h1", _item())) == "signature"


def test_value_copied_under_another_key_or_for_another_hash_is_refused() -> None:
    data = seal_value(SECRET, value_key("p:", "h2"), "h2", _item())
    assert _reason(data) == "signature"  # signed for another key
    forged_hash = seal_value(SECRET, value_key("p:", "h1"), "h2", _item())
    assert _reason(forged_hash) == "decoding"  # right key, the payload says another hash


def test_truncated_values_are_refused() -> None:
    data = seal_value(SECRET, value_key("p:", "h1"), "h1", _item())
    for cut in (0, 10, HEADER_SIZE - 1, HEADER_SIZE, len(data) - 1):
        assert _reason(data[:cut]) == "truncated"


def test_oversized_and_malformed_values_are_refused() -> None:
    data = seal_value(SECRET, value_key("p:", "h1"), "h1", _item())
    assert _reason(data, limit=len(data) - HEADER_SIZE - 1) == "oversized"
    assert _reason(data + b"\0") == "malformed"
    for offset, value in ((0, b"X"), (8, b"\x02"), (10, b"\x01"), (12, b"\x40\x01")):
        bad = bytearray(data)
        bad[offset : offset + len(value)] = value
        assert _reason(bytes(bad)) == "malformed"


def test_forged_values_are_refused() -> None:
    key = value_key("p:", "h1")
    data = bytearray(seal_value(SECRET, key, "h1", _item()))
    for offset in (24, 40, HEADER_SIZE + 5, len(data) - 1):  # make time, tag, payload
        bad = bytearray(data)
        bad[offset] ^= 0x01
        assert _reason(bytes(bad)) == "signature"
    # a well-signed value whose payload is not a features message (the key holder's mistake)
    payload = b"\x93\xa1x\x01\x90"  # msgpack ["x", 1, []]
    head = struct.pack("<8sHHIQQ", b"AIOSHMTV", 1, 0, HEADER_SIZE, len(payload), 0)
    kb = key.encode()
    tag = hmac.new(
        SECRET, DOMAIN + struct.pack("<I", len(kb)) + kb + head + payload, hashlib.sha256
    ).digest()
    assert _reason(head + tag + payload) == "decoding"
    ref = ShmRef(1, 1, 0, 1, 64, 0, 0, 0)
    assert _reason(seal_value(SECRET, key, "h1", ref)) == "decoding"  # a reference, not an item


def test_the_tier_s_public_names_have_docstrings() -> None:
    for cls in (RedisTier, TierSnapshot, TierPolicy, CircuitBreaker, LinearCost):
        assert inspect.getdoc(cls), cls
        for name, member in vars(cls).items():
            if name.startswith("_") and name not in ("__init__", "__aenter__"):
                continue
            if callable(member) or isinstance(member, property):
                assert inspect.getdoc(member), f"{cls.__name__}.{name}"


def test_tier_arguments_are_checked() -> None:
    url = "redis://127.0.0.1:1/0"
    for kw in (
        {"secret": b"short"},
        {"secret": SECRET, "ttl_s": 0},
        {"secret": SECRET, "lookup_timeout_s": -1.0},
        {"secret": SECRET, "max_item_bytes": 0},
        {"secret": SECRET, "prefix": "a{b}"},
        # Redis refuses an expiry of 0 ms (or one past its clock) on every command
        {"secret": SECRET, "ttl_s": 0.0004},
        # every key would fail to encode: each request an error, the breaker open for good
        {"secret": SECRET, "prefix": "bad\ud800:"},
    ):
        with pytest.raises(ValueError):
            RedisTier(url, **kw)
    for tuning in (
        {"max_wait_s": float("nan")},
        {"lease_s": 1e-6},  # an expiry too short for Redis, as ttl_s above
        {"skip_ttl_s": 1e300},
        {"write_timeout_s": 0},
        {"flush_timeout_s": -1.0},
        {"write_queue_items": 0},
        {"write_queue_bytes": 1.5},
    ):
        with pytest.raises(ValueError, match=next(iter(tuning))):
            TierConfig(**tuning)
    with pytest.raises(TypeError):
        RedisTier("", secret=SECRET)
    with pytest.raises(TypeError, match="TierConfig"):
        RedisTier(url, secret=SECRET, config={"lease_s": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the tuning is in the config, not a keyword of its own
        RedisTier(url, secret=SECRET, lease_s=1.0)  # type: ignore[call-arg]
    assert RedisTier(url, secret=SECRET, config=TierConfig(lease_s=9.0)).lease_s == 9.0
    # every GET of a value would fail to decode (the URL's query wins over the tier's options)
    for bad in ("redis://127.0.0.1:1/0?decode_responses=True", "http://127.0.0.1:1/0"):
        with pytest.raises(ValueError, match="url"):
            RedisTier(bad, secret=SECRET)
    RedisTier(url + "?decode_responses=false", secret=SECRET)


# --- a server that is not a sane Redis ----------------------------------------------------------


async def _serve_resp(reply: bytes, reader: Any, writer: Any) -> None:
    """Answer every RESP command with ``reply`` (a wrong URL, a proxy, a tampering middlebox)."""
    try:
        while line := await reader.readline():
            for _ in range(int(line[1:])):
                size = int((await reader.readline())[1:])
                await reader.readexactly(size + 2)
            writer.write(reply)
            await writer.drain()
    except (ValueError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _one_request(reply: bytes, **kw: Any) -> RedisTier:
    """One ``fetch_or_make`` on a tier whose server answers ``reply`` to everything; the
    request must be answered by ``make`` at once. The tier, closed, for its counters."""
    server = await asyncio.start_server(lambda r, w: _serve_resp(reply, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tier = RedisTier(
        f"redis://127.0.0.1:{port}/0",
        secret=SECRET,
        lookup_timeout_s=5.0,
        config=TierConfig(max_wait_s=30.0),
        policy=TierPolicy(learn=False, explore_every=0),
        **kw,
    )
    item = {"x": np.arange(4)}

    async def make() -> dict[str, Any]:
        return item

    try:
        async with tier:
            assert await asyncio.wait_for(tier.fetch_or_make("h", make), 20) is item
    finally:
        server.close()
        await server.wait_closed()
    s = tier.stats()
    assert s.makes == 1 and s.waits == 0 and s.hits == 0 and s.bytes_read == 0
    return tier


@pytest.mark.parametrize(
    "reply",
    [
        b"+OK\r\n",  # a status where the probe script returns a pair: was "leased", max_wait_s
        b":5\r\n",  # an integer: was TypeError out of the request
        b"*1\r\n:1\r\n",  # one element: was IndexError
        b"*2\r\n:1\r\n$1\r\nx\r\n",  # a size that is not a number: was ValueError
        b"*2\r\n:9\r\n:0\r\n",  # an unknown kind: was "leased by another", max_wait_s
        b"*2\r\n:1\r\n:99\r\n",  # "a value of 99 bytes", then the GET answers a pair
        b"*3\r\n:2\r\n:0\r\n$1\r\nx\r\n",  # a value with a claim
        b"*4\r\n:1\r\n:1\r\n$1\r\nx\r\n$1\r\ny\r\n",  # four elements
    ],
)
async def test_a_server_answering_nonsense_fails_no_request_and_holds_none(reply: bytes) -> None:
    """Whatever the server answers, the request is made here at once and the error counted."""
    s = (await _one_request(reply)).stats()
    assert s.errors + s.rejected_total >= 1


@pytest.mark.parametrize(
    "reply",
    [
        b"*3\r\n:1\r\n:5\r\n$3\r\nabc\r\n",  # another size than stated
        b"*3\r\n:1\r\n:100\r\n$100\r\n" + b"x" * 100 + b"\r\n",  # a value carried back
        b"*3\r\n:3\r\n:0\r\n$0\r\n\r\n",  # a value with "leased by another"
        b"*3\r\n:1\r\n:1\r\n*1\r\n$1\r\nx\r\n",  # a list where the value goes
    ],
)
async def test_a_garbage_three_element_probe_reply_is_a_counted_error(reply: bytes) -> None:
    """A reply of three elements (the probe answers two): an error, counted; never served,
    whatever the third one looks like."""
    tier = await _one_request(reply, max_item_bytes=16)
    s = tier.stats()
    assert s.errors == 1 and s.rejected_total == 0


def test_stats_never_iterate_the_write_queue() -> None:
    """``stats()`` runs in a metrics scrape's thread while the loop changes the write queue.

    Before, it counted the queue by iterating it, and a scrape thread got ``RuntimeError:
    deque mutated during iteration`` (reproduced with a real scrape thread against Redis). Here
    the loop's change is made by the queue entry itself, as the iteration reads it.
    """
    tier = RedisTier("redis://127.0.0.1:1/0", secret=SECRET)

    class Racing:
        """A queued write whose reading appends another (the loop, between two steps)."""

        @property
        def has_item(self) -> bool:
            if len(tier._queue) < 3:
                tier._queue.append(Racing())  # type: ignore[arg-type]
            return True

    tier._queue.append(Racing())  # type: ignore[arg-type]
    assert tier.stats().queued_writes == 1


def test_breaker_state_read_while_the_loop_closes_it() -> None:
    """``state`` (read by a metrics scrape's thread) while the loop reports a success.

    Before, it read ``_opened_at`` twice and the second read could be None: a ``TypeError``
    in the scrape (reproduced with a real scrape thread). Here the clock, called between the
    two reads, does what the loop would.
    """
    armed = False
    breaker: CircuitBreaker | None = None

    def clock() -> float:
        if armed and breaker is not None:
            breaker.success()  # the loop, between the state's check and its arithmetic
        return 100.0

    breaker = CircuitBreaker(failures=1, clock=clock)
    breaker.failure()
    armed = True
    assert breaker.state in (OPEN, HALF_OPEN)
    assert breaker.state == CLOSED


async def test_a_tier_is_an_async_resource() -> None:
    """One lifetime style: ``async with`` (no round trip: nobody listens here) and an
    idempotent ``aclose``; a closed tier refuses requests with ``ClosedCacheError``."""
    from anyio.abc import AsyncResource

    from aioshmcache.errors import ClosedCacheError

    tier = RedisTier("redis://127.0.0.1:1/0", secret=SECRET)
    assert isinstance(tier, AsyncResource) and not hasattr(tier, "open")
    async with tier as entered:
        assert entered is tier and tier.is_open
    assert not tier.is_open
    await tier.aclose()

    async def make() -> dict[str, Any]:
        return {}

    with pytest.raises(ClosedCacheError):
        await tier.fetch_or_make("h", make)
