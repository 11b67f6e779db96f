"""``python -m aioshmcache bench``: the benchmark suites against the physical limit and the peers.

``store`` (put / get / lease against ``np.copyto`` into warm shared memory, steady state, churn,
gc), ``peers`` (the round trip against ``multiprocessing`` and Redis) and ``async`` run by
default; ``group``, ``trace``, ``fleet`` and ``vllm`` when named with ``--suite``. Each writes
``aioshmcache-bench[-SUITES][-quick]`` ``.md``, ``.png`` and ``.json``; bench/README.md gives the
method. ``--quick`` is the smoke run CI uses. A peer that is not installed is a skip line, never
an error; ``--check`` turns a missed target into exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..progress import Progress
from ..shm import files_with_prefix, remove
from .params import Params, segment_prefix
from .report import Report

__all__ = ["SUITES", "checkout_results_dir", "main", "results_stem", "run"]

#: suite: (module, its runner(params, report, progress)); the first three run by default
_RUNNERS = {
    "store": ("workloads", "run_store_suite"),
    "peers": ("peers", "run_peers_suite"),
    "async": ("asyncbench", "run_async_suite"),
    "group": ("group", "run_group_suite"),
    "trace": ("trace", "run_trace_suite"),
    "fleet": ("fleet", "run_fleet_suite"),
    "vllm": ("vllm", "run_vllm_suite"),
}
SUITES, EXTRA_SUITES = tuple(_RUNNERS)[:3], tuple(_RUNNERS)[3:]
_CHECKOUT = Path("<checkout>")  # a bare ``--results-dir``: the checkout's ``bench/results``


def checkout_results_dir() -> Path | None:
    """``bench/results`` beside the package's ``bench/`` scripts, in a source checkout only."""
    root = Path(__file__).resolve().parents[3]
    if (root / "bench").is_dir() and (root / "aioshmcache").is_dir():
        return root / "bench" / "results"
    return None


def results_stem(suites: tuple[str, ...], *, quick: bool) -> str:
    """``aioshmcache-bench``, then the suites if not all of them, then ``-quick``."""
    stem = "aioshmcache-bench" + ("" if set(suites) == set(SUITES) else "-" + "-".join(suites))
    return stem + ("-quick" if quick else "")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m aioshmcache bench",
        description="Benchmarks against np.copyto into shared memory and against peers "
        "(multiprocessing, redis.asyncio, vLLM). Writes a markdown table and a PNG plot.",
    )
    for flag, text in (
        ("--quick", "a ~30 s smoke run (CI)"),
        ("--check", "exit with status 1 if a target is missed"),
        ("--no-redis", "skip the redis peer"),
        ("--quiet", "no progress lines on stderr"),
        ("--no-print", "do not print the table"),
    ):
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument(
        "--results-dir",
        type=Path,
        nargs="?",
        const=_CHECKOUT,
        metavar="DIR",
        help="where the results go (default: the current directory); without DIR: the "
        "bench/results folder of the source checkout",
    )
    ap.add_argument(
        "--suite",
        action="append",
        choices=SUITES + EXTRA_SUITES,
        help="run only this suite (repeatable; default: " + ", ".join(SUITES) + ")",
    )
    text = "vLLM's shm_object_storage.py for --suite vllm (default: from an installed vllm)"
    ap.add_argument("--vllm-file", type=Path, metavar="PATH", help=text)
    return ap


def run(suites: Sequence[str], p: Params, progress: Progress | None = None) -> Report:
    """Run the given suites with ``p`` and return the report (:func:`main` writes the files)."""
    progress = progress or Progress()
    report = Report("aioshmcache benchmark", quick=p.quick)
    for suite in (s for s in _RUNNERS if s in suites):
        module, fn = _RUNNERS[suite]
        getattr(importlib.import_module(f".{module}", __name__), fn)(p, report, progress)
    report.finish()
    return report


def _targets_line(report: Report, *, check: bool) -> str:
    met = [r.holds for r in report.rows if r.target is not None]
    missed = report.missed()
    line = f"targets: {len(met) - len(missed)} of {len(met)} met"
    if missed:
        line += "; missed: " + "; ".join(r.what for r in missed[:5])
        line += " ..." if len(missed) > 5 else ""
        line += "" if check else " (--check turns a miss into exit status 1)"
    return line


def main(argv: list[str]) -> int:
    """``python -m aioshmcache bench ARGV``; 1 on an error, a leak or (with --check) a miss."""
    ap = _parser()
    ns = ap.parse_args(argv)
    suites = tuple(ns.suite) if ns.suite else SUITES
    progress = Progress(enabled=not ns.quiet)
    out_dir: Path = ns.results_dir if ns.results_dir is not None else Path.cwd()
    if out_dir == _CHECKOUT:
        found = checkout_results_dir()
        if found is None:
            ap.error("--results-dir without DIR needs a source checkout (with bench/): give DIR")
        out_dir = found
    t0, leaked = time.monotonic(), False
    try:
        p = Params.smoke() if ns.quick else Params()
        p = dataclasses.replace(p, redis=not ns.no_redis, vllm_file=ns.vllm_file)
        report = run(suites, p, progress)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        left = files_with_prefix(segment_prefix())
        if left:  # the library (or this benchmark) leaked: report it loudly, then clean up
            print(f"bench: LEFT BEHIND in /dev/shm: {left}", file=sys.stderr)
            remove(left)
            leaked = True
    files = report.write(out_dir, results_stem(suites, quick=ns.quick))
    if not ns.no_print:
        print(report.markdown())
    print(f"bench: {_targets_line(report, check=ns.check)}", file=sys.stderr)
    progress(f"done in {time.monotonic() - t0:.0f} s; wrote {', '.join(str(f) for f in files)}")
    return int(leaked or bool(report.errors) or (ns.check and bool(report.missed())))
