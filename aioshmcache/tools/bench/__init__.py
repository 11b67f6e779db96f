"""``python -m aioshmcache bench``: the benchmark suite against the physical limit and the peers.

Three suites, each also runnable alone (``--suite``) or through the scripts in ``bench/``:

* ``store`` — put / get / lease of single-array items from 1 KiB to 64 MiB against an
  ``np.copyto`` into warm shared memory; the 1 KiB steady state with a reader process; a fresh
  cache's first put; churn; reader-count and cache-size scaling;
* ``peers`` — the round trip writer → reader process → reply against ``multiprocessing`` Pipe
  and Queue, Redis (``redis.asyncio`` against a private ``redis-server``) and Ray (if installed);
* ``async`` — the asyncio facade: cache hits, offloaded puts, loop lag, concurrency and the
  inline-vs-thread threshold;
* ``group`` (only when asked for: ``--suite group``) — cache groups: preprocessings of a Zipf
  load with 1 and 4 gateway processes, the cost of a sibling look-up and of a sibling hit;
* ``trace`` (only when asked for: ``--suite trace``) — miss ratio and bytes written per request
  of FIFO and second-chance eviction on seeded Zipf traces replayed through the real cache,
  against an LRU model of the same capacity;
* ``fleet`` (only when asked for: ``--suite fleet``) — the Redis tier across 4 simulated hosts:
  preprocessings per distinct item with and without it, a tier hit's latency, Redis killed;
* ``vllm`` (only when asked for: ``--suite vllm``) — vLLM's own ``shm_object_storage.py`` side
  by side (from an installed vLLM, or the file named by ``--vllm-file PATH``).

It writes ``aioshmcache-bench[-SUITES][-quick]`` ``.md`` (the table), ``.png`` (the plot) and
``.json`` (every figure) to the current directory (``--results-dir DIR`` elsewhere; a bare
``--results-dir`` in a source checkout: its ``bench/results/``), prints the table and reports
progress on stderr. ``--quick`` is the smoke run CI uses (about 30 s): fewer sizes and
repetitions, no Ray. A peer that is not installed is skipped with a message, never an error.
Figures are medians of several runs with a ratio against a baseline measured in the same run.
The targets are reported; ``--check`` makes a missed one an exit status of 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..progress import Progress
from ..shm import files_with_prefix, remove
from .params import Params, segment_prefix
from .report import Report

__all__ = ["SUITES", "checkout_results_dir", "main", "results_stem", "run"]

SUITES = ("store", "peers", "async")
#: suites run only when named with ``--suite``
EXTRA_SUITES = ("group", "trace", "fleet", "vllm")


#: a bare ``--results-dir``: the ``bench/results`` folder of the source checkout
_CHECKOUT = Path("<checkout>")


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
        "(multiprocessing, redis.asyncio, Ray). Writes a markdown table and a PNG plot.",
    )
    ap.add_argument("--quick", action="store_true", help="a ~30 s smoke run (CI)")
    ap.add_argument(
        "--results-dir",
        type=Path,
        nargs="?",
        const=_CHECKOUT,
        default=None,
        metavar="DIR",
        help="where the results go (default: the current directory); without DIR: the "
        "bench/results folder of the source checkout",
    )
    ap.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    ap.add_argument(
        "--suite",
        action="append",
        choices=SUITES + EXTRA_SUITES,
        help="run only this suite (repeatable; default: " + ", ".join(SUITES) + ")",
    )
    ray = ap.add_mutually_exclusive_group()
    ray.add_argument(
        "--ray",
        dest="ray",
        action="store_true",
        default=None,
        help="compare with Ray (default: yes if installed, except with --quick)",
    )
    ray.add_argument("--no-ray", dest="ray", action="store_false")
    ap.add_argument("--no-redis", action="store_true", help="skip the redis peer")
    ap.add_argument(
        "--vllm-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="vLLM's shm_object_storage.py for --suite vllm (default: from an installed vllm)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--no-print", action="store_true", help="do not print the table")
    return ap


def run(
    suites: tuple[str, ...] | list[str],
    *,
    quick: bool,
    want_ray: bool,
    want_redis: bool = True,
    progress: Progress | None = None,
    vllm_file: Path | None = None,
) -> Report:
    """Run the given suites and return the report (files are written by :func:`main`)."""
    from .asyncbench import run_async_suite
    from .fleet import run_fleet_suite
    from .group import run_group_suite
    from .peers import run_peers_suite
    from .trace import run_trace_suite
    from .vllm import run_vllm_suite
    from .workloads import run_store_suite

    p = Params.smoke() if quick else Params.full()
    progress = progress or Progress()
    report = Report("aioshmcache benchmark", quick=quick)
    if "store" in suites:
        run_store_suite(p, report, progress)
    if "peers" in suites:
        if not want_redis:
            report.skip("redis: --no-redis")
        run_peers_suite(p, report, progress, want_ray=want_ray, want_redis=want_redis)
    if "async" in suites:
        run_async_suite(p, report, progress)
    if "group" in suites:
        run_group_suite(p, report, progress)
    if "trace" in suites:
        run_trace_suite(p, report, progress)
    if "fleet" in suites:
        run_fleet_suite(p, report, progress)
    if "vllm" in suites:
        run_vllm_suite(p, report, progress, vllm_file)
    report.finish()
    return report


def _leftovers() -> list[str]:
    return files_with_prefix(segment_prefix())


def _targets_line(report: Report, *, check: bool) -> str:
    with_target = [r for r in report.rows if r.target is not None]
    missed = report.missed()
    line = f"targets: {len(with_target) - len(missed)} of {len(with_target)} met"
    if missed:
        names = "; ".join(f"{r.label} ({r.param})" if r.param else r.label for r in missed[:5])
        line += f"; missed: {names}" + (" ..." if len(missed) > 5 else "")
        line += "" if check else " (--check turns a miss into exit status 1)"
    return line


def main(argv: list[str]) -> int:
    """``python -m aioshmcache bench ARGV``; 1 on an error, a leak or (with --check) a miss."""
    ap = _parser()
    ns = ap.parse_args(argv)
    suites = tuple(ns.suite) if ns.suite else SUITES
    want_ray = (not ns.quick) if ns.ray is None else bool(ns.ray)
    progress = Progress(enabled=not ns.quiet)
    out_dir: Path = ns.results_dir if ns.results_dir is not None else Path.cwd()
    if out_dir == _CHECKOUT:
        found = checkout_results_dir()
        if found is None:
            ap.error("--results-dir without DIR needs a source checkout (with bench/): give DIR")
        out_dir = found
    stem = results_stem(suites, quick=ns.quick)
    t0 = time.monotonic()
    rc = 0
    try:
        report = run(
            suites,
            quick=ns.quick,
            want_ray=want_ray,
            want_redis=not ns.no_redis,
            progress=progress,
            vllm_file=ns.vllm_file,
        )
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        left = _leftovers()
        if left:  # the library (or this benchmark) leaked: report it loudly, then clean up
            print(f"bench: LEFT BEHIND in /dev/shm: {left}", file=sys.stderr)
            remove(left)
            rc = 1
    if report.errors:
        rc = 1
    files = report.write(out_dir, stem)
    if not ns.no_print:
        print(report.markdown())
    print(f"bench: {_targets_line(report, check=ns.check)}", file=sys.stderr)
    if ns.check and report.missed():
        rc = 1
    progress(f"done in {time.monotonic() - t0:.0f} s; wrote {', '.join(str(f) for f in files)}")
    return rc
