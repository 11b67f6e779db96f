"""The benchmark scripts that no suite of ``python -m aioshmcache bench`` runs: a smoke run
of each, as a user runs it (a subprocess), so the scripts cannot rot.

``bench/bench_channel.py`` (the channel's round trip against a bare echo),
``bench/bench_lean.py`` (every entry point's cost, the first lap's worst put) and
``bench/bench_core_copy.py`` (the compiled copy's kinds and threshold, and a put read back by
another process). No timed
assertions: only that every row is reported with sane figures and nothing is left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, *args: str) -> tuple[str, int]:
    """The script's output, and its pid (its segments' names carry it)."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out
    return out, proc.pid


def test_the_channel_benchmark_reports_every_row_against_the_echo() -> None:
    out, _ = _run("bench_channel.py", "--quick", "--cpu", "50")
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (1 KiB|1 MiB|16 MiB) \|(.*)$", out, re.M)}
    assert sorted(rows) == ["1 KiB", "1 MiB", "16 MiB"], out
    for size, cells in rows.items():
        figures = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?)(?: us)? \|", cells)]
        assert len(figures) == 10 and all(f > 0 for f in figures), (size, cells)
    for what in ("ref", "bare64"):  # the CPU per call of both processes
        m = re.search(
            rf"^{what}: median ([\d.]+) us, CPU per call: gateway ([\d.]+) us, "
            r"worker ([\d.]+) us$",
            out,
            re.M,
        )
        assert m is not None and all(float(x) > 0 for x in m.groups()), out


def test_the_entry_point_and_first_lap_benchmarks_report_every_cell() -> None:
    out, pid = _run(
        "bench_lean.py",
        "entry",
        "lap",
        "--rounds",
        "2",
        "--batch",
        "16",
        "--puts",
        "3000",
        "--capacity-mib",
        "8",
        "--updates",
        "empty",
        "closures",
    )
    cells = re.findall(r"^\| (miss|hit): (.+?) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    names = {f"{kind}: {name}" for kind, name, _median, _min in cells}
    for kind in ("miss", "hit"):
        for name in (
            "sync item",
            "sync list([8]) [8]",
            "async features([1])",
            "async features([8]) [8]",
        ):
            assert f"{kind}: {name}" in names, out
    assert all(float(median) > 0 and float(low) > 0 for _k, _n, median, low in cells)
    laps = re.findall(r"^thread CPU: median ([\d.]+) µs, worst ([\d.]+) ms", out, re.M)
    assert len(laps) == 2 and all(float(a) > 0 and float(b) > 0 for a, b in laps), out
    assert not [n for n in os.listdir("/dev/shm") if f"bench-lean-{pid}-" in n]


def test_the_copy_benchmark_reports_every_size_and_the_cross_process_pair() -> None:
    from aioshmcache import implementation

    if implementation() != "c":
        pytest.skip("the copy benchmark measures the C core")
    out, _ = _run("bench_core_copy.py", "1")
    sizes = re.findall(r"^ *(\d+ [KM]iB) +([\d.]+) ", out, re.M)
    assert len(sizes) == 9 and all(float(us) > 0 for _s, us in sizes), out
    out, pid = _run("bench_core_copy.py", "pair", "1")
    rows = re.findall(r"^ *(\d+ [KM]iB) \|(.*)\| +([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["64 KiB", "256 KiB", "600 KiB", "1 MiB", "4 MiB"], out
    assert all(float(r[2]) > 0 for r in rows)
    assert not [n for n in os.listdir("/dev/shm") if f"bench-copy-pair-{pid}" in n]
