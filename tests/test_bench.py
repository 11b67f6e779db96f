"""The benchmark's smoke run produces a sane table, JSON and plot (so the bench code cannot rot).

``python -m aioshmcache bench --quick`` runs in a subprocess, as CI and users run it. No timed
assertions: only that every workload reported, that its figures are finite and positive, that
targets carry a verdict, and that the plot is a real PNG. A missing ``redis-server`` is a skip
message in the report, never a failure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from aioshmcache.tools import bench
from aioshmcache.tools.bench.report import Report, Row, Target

from .helpers import ROOT, run_quick_bench

pytestmark = pytest.mark.bench

SECTIONS = (
    "Store: one array item",
    "Small items steady state",
    "Churn",
    "Round trip",
    "Async: cache hit",
    "Async: 16 MiB put",
    "Async: loop lag",
    "Async: inline vs thread",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("bench")
    _data, proc = run_quick_bench(out)  # the results go to the current directory by default
    return out, proc.stdout, proc.stderr


def _rows(out: Path) -> list[dict[str, Any]]:
    data = json.loads((out / "aioshmcache-bench-quick.json").read_text(encoding="utf-8"))
    assert data["quick"] is True
    rows: list[dict[str, Any]] = data["rows"]
    return rows


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_files_are_written(quick_run: tuple[Path, str, str]) -> None:
    out, stdout, stderr = quick_run
    stem = "aioshmcache-bench-quick"
    names = [f"{stem}.md", f"{stem}.json"] + ([f"{stem}.png"] if HAS_MATPLOTLIB else [])
    for name in names:
        assert (out / name).is_file(), name
    md = (out / "aioshmcache-bench-quick.md").read_text(encoding="utf-8")
    assert "## Targets" in md and "| target |" in md
    assert "## Targets" in stdout  # the table is printed too
    assert "done in" in stderr  # progress lines go to stderr
    assert re.search(r"targets: \d+ of \d+ met", stderr)
    assert not re.search(r"\bissues? \d", stdout + md), "no issue numbers in the output"
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # nothing else, no bench/


def _fake_report(*, miss: bool) -> Report:
    report = Report("fake", quick=True)
    held = Row("S", "fast enough", "1 KiB", 1e-6, target=Target("<=", 2e-6))
    report.add(held)
    report.add(Row("S", "no target", "", 5.0))
    if miss:
        report.add(Row("S", "too slow", "16 MiB", 3e-3, target=Target("<=", 2e-3)))
    report.finish()
    return report


@pytest.mark.parametrize("miss", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_check_fails_on_a_missed_target(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    miss: bool,
    check: bool,
) -> None:
    """``--check`` turns a missed target into exit status 1; without it a miss is reported."""
    monkeypatch.setattr(bench, "run", lambda *a, **k: _fake_report(miss=miss))
    args = ["--quick", "--no-print", "--quiet", "--results-dir", str(tmp_path / "r")]
    rc = bench.main(args + (["--check"] if check else []))
    assert rc == (1 if check and miss else 0)
    err = capsys.readouterr().err
    assert f"targets: 1 of {2 if miss else 1} met" in err
    assert ("missed: too slow (16 MiB)" in err) == miss
    assert (tmp_path / "r" / "aioshmcache-bench-quick.md").is_file()


def test_bare_results_dir_is_the_checkouts_bench_results() -> None:
    assert bench.checkout_results_dir() == ROOT / "bench" / "results"
    assert bench.results_stem(("store",), quick=False) == "aioshmcache-bench-store"


def test_every_workload_reports_sane_figures(quick_run: tuple[Path, str, str]) -> None:
    rows = _rows(quick_run[0])
    for section in SECTIONS:
        assert any(r["section"].startswith(section) for r in rows), f"no rows for {section!r}"
    for r in rows:
        v = r["value"]
        if r["kind"] == "bytes" and (v is None or math.isnan(v)):
            continue  # "no crossover in the sizes measured" is a legitimate answer
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, r
        if r["kind"] == "time":
            assert v < 60.0, r  # seconds per operation: a unit mix-up would show here
        if r["ratio"] is not None:
            assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        if r["target"] is not None:
            assert r["holds"] in (True, False), r
        stat = r["stat"]
        if stat is not None:
            assert stat["n"] >= 1 and stat["lo"] <= stat["median"] <= stat["hi"], r


def test_baselines_are_measured_in_the_same_run(quick_run: tuple[Path, str, str]) -> None:
    rows = _rows(quick_run[0])
    store = [r for r in rows if r["section"].startswith("Store: one array item")]
    sizes = {r["param"] for r in store}
    for size in sizes:
        labels = {r["label"] for r in store if r["param"] == size}
        assert "np.copyto into warm shm (baseline)" in labels
        assert {"put", "get (copy)", "get (lease: view + ack)"} <= labels
        for r in store:
            if r["param"] == size and r["label"] == "put":
                assert r["baseline"] == "np.copyto" and r["ratio"] is not None


def test_missing_peers_are_skipped_not_failed(quick_run: tuple[Path, str, str]) -> None:
    out = quick_run[0]
    rows = _rows(out)
    data = json.loads((out / "aioshmcache-bench-quick.json").read_text(encoding="utf-8"))
    skipped = " ".join(data["skipped"])
    has_redis = any("redis" in r["label"] for r in rows)
    if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None:
        assert not has_redis and "redis" in skipped
    else:
        assert has_redis, "redis-server is installed but the redis peer did not run"


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the bench extra)")
def test_plot_is_a_png(quick_run: tuple[Path, str, str]) -> None:
    raw = (quick_run[0] / "aioshmcache-bench-quick.png").read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])  # the IHDR chunk
    assert width >= 600 and height >= 400
    assert len(raw) > 20_000  # drawn panels, not an empty canvas
