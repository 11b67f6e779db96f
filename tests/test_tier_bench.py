"""``python -m aioshmcache bench --suite fleet --quick`` runs and reports sane figures.

No timed assertions: every row is there and finite, no request failed, the tier never makes
more preprocessings than no tier, the targets carry a verdict, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from aioshmcache.tools.redis_server import redis_binaries

from .helpers import run_quick_bench

pytestmark = [
    pytest.mark.bench,
    pytest.mark.slow,
    pytest.mark.skipif(redis_binaries() is None, reason="redis-server is not installed"),
]


def test_fleet_suite_quick(tmp_path: Path) -> None:
    data, _proc = run_quick_bench(tmp_path, "fleet", timeout=600)
    rows = {r["label"] + "|" + r["param"]: r for r in data["rows"]}
    assert all(math.isfinite(r["value"]) for r in rows.values())
    by_label = {r["label"]: r for r in data["rows"]}
    assert by_label["failed requests"]["value"] == 0
    without = by_label["preprocessings per distinct item, no tier"]["value"]
    with_tier = by_label["preprocessings per distinct item, RedisTier"]["value"]
    assert 1.0 <= with_tier <= without
    for label in ("preprocessings per distinct item, RedisTier", "failed requests"):
        assert by_label[label]["holds"] in (True, False)
    assert sum(r["label"].startswith("tier hit:") for r in data["rows"]) == 3  # 1, 4, 16 MiB
    for load in ("quiet", "loaded (4 busy processes beside)"):  # one size, each beside no tier
        tier_row = by_label[f"preprocessings per distinct item, RedisTier, {load}"]
        base_row = by_label[f"preprocessings per distinct item, no tier, {load}"]
        assert 1.0 <= tier_row["value"] <= base_row["value"]
        assert tier_row["holds"] in (True, False)
    assert any(r["label"].startswith("learned fetch budget") for r in data["rows"])
