"""``python -m aioshmcache bench --suite group --quick`` runs and reports sane figures.

No timed assertions: every row is there and finite, the preprocessing counts are consistent
(a group never preprocesses fewer than one process, nor more than plain caches apart), the
Zipf target carries a verdict, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from .helpers import run_quick_bench

pytestmark = pytest.mark.bench


def test_group_suite_quick(tmp_path: Path) -> None:
    data, _proc = run_quick_bench(tmp_path, "group")
    rows = {r["label"] + "|" + r["param"]: r for r in data["rows"]}
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in rows.values())
    counts = {label.split("|")[0]: r["value"] for label, r in rows.items() if r["kind"] == "count"}
    one = counts["preprocessings, 1 process"]
    grouped = counts["preprocessings, 4 processes of one group"]
    apart = counts["preprocessings, 4 processes, a plain cache each (no group)"]
    assert one <= grouped <= apart
    zipf = next(r for r in rows.values() if r["label"].endswith("of one group"))
    assert zipf["holds"] in (True, False)  # a verdict, whichever it is on this machine
    labels = " ".join(rows)
    assert "held by a sibling" in labels and "held by nobody" in labels
    assert sum("sibling hit:" in k for k in rows) == 2  # 1 MiB and 16 MiB
