"""The trace suite: its Zipf traces, its reference models and its report.

The Zipf generator and the size draw are deterministic (seeded); the LRU and FIFO models are
checked on small traces computed by hand; a replay through the real cache with room for every
item misses exactly once per distinct item; the report puts the targets where they belong;
``python -m aioshmcache bench --suite trace --quick`` writes a row for every trace and policy,
with miss ratios in [0, 1]. No timed assertions.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from aioshmcache.tools.bench import trace as tr
from aioshmcache.tools.bench.params import Params
from aioshmcache.tools.bench.report import Report

from .helpers import run_quick_bench


def test_zipf_trace_is_deterministic_and_skewed() -> None:
    a = tr.zipf_trace(5000, 300, 1.0, seed=7)
    assert a.dtype == np.int64 and a.shape == (5000,)
    assert int(a.min()) >= 0 and int(a.max()) < 300
    assert np.array_equal(a, tr.zipf_trace(5000, 300, 1.0, seed=7))  # same seed: same trace
    assert not np.array_equal(a, tr.zipf_trace(5000, 300, 1.0, seed=8))
    assert not np.array_equal(a, tr.zipf_trace(5000, 300, 1.2, seed=7))
    # rank 0 is the most asked for, and more so at a higher skew
    counts = np.bincount(a, minlength=300)
    assert int(counts.argmax()) == 0
    steep = np.bincount(tr.zipf_trace(5000, 300, 1.2, seed=7), minlength=300)
    assert steep[0] > counts[0]
    assert len(tr.zipf_trace(0, 10, 1.0, seed=0)) == 0
    with pytest.raises(ValueError):
        tr.zipf_trace(10, 0, 1.0, seed=0)


def test_item_sizes_are_seeded_log_uniform_multiples_of_64() -> None:
    lo, hi = 512 * 1024, 8 << 20
    sizes = tr.item_sizes(4000, lo, hi, seed=3)
    assert np.array_equal(sizes, tr.item_sizes(4000, lo, hi, seed=3))
    assert not np.array_equal(sizes, tr.item_sizes(4000, lo, hi, seed=4))
    assert int(sizes.min()) >= lo and int(sizes.max()) <= hi
    assert not np.any(sizes % 64)
    # log-uniform: half of the items below the geometric mean of the bounds (4000 draws)
    below = float(np.mean(sizes < math.sqrt(lo * hi)))
    assert 0.45 < below < 0.55
    with pytest.raises(ValueError):
        tr.item_sizes(10, 1024, 512, seed=0)


SIZES = [1, 1, 1, 2, 10]  # item 4 never fits a capacity of 3


def test_lru_model_on_a_hand_computed_trace() -> None:
    # capacity 3: 0 1 2 fill it; 0 hits (0 becomes newest); 3 (2 bytes) evicts 1 and 2;
    # 0 hits; 1 evicts 3 (the least recent); 4 is larger than the cache: a miss, never cached;
    # 0 hits again
    res = tr.simulate([0, 1, 2, 0, 3, 0, 1, 4, 0], SIZES, 3, lru=True)
    assert (res.requests, res.misses, res.evictions, res.inline) == (9, 6, 3, 1)
    assert res.bytes_written == 1 + 1 + 1 + 2 + 1  # item 4 is not written
    assert res.miss_ratio == pytest.approx(6 / 9)
    assert res.bytes_per_request == pytest.approx(6 / 9)


def test_fifo_model_ignores_hits() -> None:
    # the same trace under FIFO: 3 evicts 0 and 1 (the oldest) although 0 was just hit, so the
    # next 0 misses and evicts 2; 1 then evicts 3 (3 + 1 > 3)
    res = tr.simulate([0, 1, 2, 0, 3, 0, 1, 4, 0], SIZES, 3, lru=False)
    assert (res.misses, res.evictions, res.inline) == (7, 4, 1)
    # where the models differ, LRU keeps the hit item
    assert tr.simulate([0, 1, 2, 0, 3, 0], SIZES, 3, lru=True).misses == 4
    assert tr.simulate([0, 1, 2, 0, 3, 0], SIZES, 3, lru=False).misses == 5


def test_models_with_room_for_everything_miss_once_per_item() -> None:
    trace = [int(i) for i in tr.zipf_trace(3000, 200, 0.8, seed=1)]
    sizes = [int(s) for s in tr.item_sizes(200, 64, 4096, seed=1)]
    room = sum(sizes)
    for lru in (True, False):
        res = tr.simulate(trace, sizes, room, lru=lru)
        assert res.misses == len(set(trace)) and res.evictions == 0


def test_replay_through_the_real_cache() -> None:
    trace = [int(i) for i in tr.zipf_trace(600, 80, 1.0, seed=2)]
    sizes = [int(s) for s in tr.item_sizes(80, 4096, 64 * 1024, seed=2)]
    # room for everything: exactly one miss per distinct item, nothing evicted
    roomy = tr.replay(trace, sizes, 2 * sum(sizes) + (1 << 20), second_chance=True)
    assert roomy.misses == len(set(trace)) and roomy.evictions == 0 and roomy.inline == 0
    assert roomy.bytes_written >= sum(sizes[i] for i in set(trace))  # plus structure headers
    # a tenth of the bytes: the ring evicts, and misses about as often as its FIFO model
    small = sum(sizes) // 10
    real = tr.replay(trace, sizes, small, second_chance=True)
    model = tr.simulate(trace, sizes, small, lru=False)
    assert real.evictions > 0 and real.inline == 0
    assert abs(real.misses - model.misses) <= 0.1 * model.misses
    assert 0.0 < real.miss_ratio < 1.0


def test_replay_second_chance_moves_hit_items_instead_of_dropping_them() -> None:
    """``second_chance=`` reaches ``CacheConfig``: only the second-chance replay relocates."""
    trace = [int(i) for i in tr.zipf_trace(800, 100, 1.2, seed=4)]
    sizes = [int(s) for s in tr.item_sizes(100, 4096, 64 * 1024, seed=4)]
    small = sum(sizes) // 10
    assert [name for name, _ in tr.POLICIES] == [tr.FIFO, tr.SECOND_CHANCE]
    fifo = tr.replay(trace, sizes, small, second_chance=False)
    second = tr.replay(trace, sizes, small, second_chance=True)
    assert fifo.relocations == 0 and fifo.bytes_relocated == 0
    # a skewed trace with eviction: hit items reach the head and are moved, not dropped
    assert second.relocations > 0 and second.bytes_relocated > 0
    assert second.bytes_written > second.bytes_relocated
    assert second.misses + second.inline <= len(trace)


def _fake(misses: int, requests: int = 100, relocations: int = 0) -> tr.PolicyResult:
    return tr.PolicyResult(requests, misses, misses * 1000, relocations=relocations)


def test_report_targets_with_second_chance() -> None:
    """With second-chance results the targets sit where the issue puts them (fabricated runs)."""
    p = Params.smoke()
    results: dict[tuple[float, float], dict[str, list[tr.PolicyResult]]] = {}
    distinct: dict[tuple[float, float], list[int]] = {}
    caps: dict[tuple[float, float], list[int]] = {}
    for s in tr.SKEWS:
        for f in tr.CAPACITY_FRACTIONS:
            results[(s, f)] = {
                tr.FIFO: [_fake(60)],
                tr.SECOND_CHANCE: [_fake(54, relocations=7)],
                tr.LRU: [_fake(55)],
                tr.FIFO_MODEL: [_fake(59)],
            }
            distinct[(s, f)], caps[(s, f)] = [300], [1 << 20]
    report = Report("t", quick=True)
    tr.report_results(p, report, results, distinct, caps, [tr.FIFO, tr.SECOND_CHANCE])
    with_target = [r for r in report.rows if r.target is not None]
    vs_fifo = [r for r in with_target if r.label == "misses: second chance ÷ FIFO"]
    vs_lru = [r for r in with_target if r.label == "misses: second chance ÷ LRU model"]
    assert [r.param for r in vs_fifo] == ["s=1.0, 5% capacity"]
    assert vs_fifo[0].value == pytest.approx(0.9) and vs_fifo[0].holds is True
    assert len(vs_lru) == 6 and all(r.holds is True for r in vs_lru)
    assert not report.missed()
    heading, block = report.blocks[0]
    assert "miss ratio" in heading and len(block) == 2 + 6
    assert "| 60.0% | 54.0% | 55.0% | 10.0% fewer misses |" in block[2]
    # second chance worse than LRU: a miss
    results[(0.8, 0.05)][tr.SECOND_CHANCE] = [_fake(56)]
    report = Report("t", quick=True)
    tr.report_results(p, report, results, distinct, caps, [tr.FIFO, tr.SECOND_CHANCE])
    assert [(r.label, r.param) for r in report.missed()] == [
        ("misses: second chance ÷ LRU model", "s=0.8, 5% capacity")
    ]


@pytest.mark.bench
def test_trace_suite_quick(tmp_path: Path) -> None:
    data, _proc = run_quick_bench(tmp_path, "trace")
    assert not data["errors"]
    rows = data["rows"]
    policies = [tr.FIFO, tr.LRU, tr.FIFO_MODEL, tr.SECOND_CHANCE]
    params = {f"s={s:.1f}, {f:.0%} capacity" for s in tr.SKEWS for f in tr.CAPACITY_FRACTIONS}
    assert {r["param"] for r in rows} == params
    for param in params:
        here = [r for r in rows if r["param"] == param]
        for name in policies:
            mine = [r for r in here if r["series"] == name]
            miss = [r for r in mine if r["label"].startswith("miss ratio: ")]
            written = [r for r in mine if r["label"].startswith("bytes written per request: ")]
            assert len(miss) == 1 and len(written) == 1, (param, name)
            assert 0.0 < miss[0]["value"] < 1.0, miss[0]
            assert miss[0]["kind"] == "fraction" and written[0]["value"] > 0
    for r in rows:
        if r["target"] is not None:
            assert r["holds"] in (True, False), r
    md = (tmp_path / "aioshmcache-bench-trace-quick.md").read_text("utf-8")
    assert "## Trace: miss ratio" in md and md.count("| s=") >= 6
    png = tmp_path / "aioshmcache-bench-trace-quick.png"
    assert not png.exists() or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
