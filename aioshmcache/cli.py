"""``python -m aioshmcache``: the demo, the benchmarks and the stress harness; inspect and sweep.

``demo``, ``bench`` and ``stress`` live in :mod:`aioshmcache.tools`, imported only when one of
them runs (the library never imports its tools).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._inspect import inspect_segment
from ._sweep import sweep, sweep_named
from .errors import ShmCacheError

__all__ = ["SWEEP_EXIT", "main"]

#: ``sweep``'s exit status: (code, when); docs/operations.md has the same table
SWEEP_EXIT: tuple[tuple[int, str], ...] = (
    (0, "swept: the orphans found were removed (a --prefix or full sweep: even none)"),
    (1, "an error (a name no segment can have, a file that cannot be read), one line"),
    (2, "a usage error"),
    (3, "NAME is missing: no segment and no cache group has that name"),
    (4, "NAME (each of its shards) is live, or kept: nothing was removed"),
)

DESCRIPTION = (
    "aioshmcache: an async-first shared-memory object cache for numpy tensors. "
    "Run a tool (demo, bench, stress) or look at the caches of this machine (inspect, sweep)."
)

# subcommands implemented in their own modules: name -> (module, help)
_DELEGATED = {
    "demo": (
        "aioshmcache.tools.demo",
        "run the FastAPI multimodal gateway demo with worker processes "
        "(needs the 'examples' extra)",
    ),
    "stress": ("aioshmcache.tools.stress", "run the async stress and fault-injection harness"),
    "bench": (
        "aioshmcache.tools.bench",
        "benchmark against memcpy and peers (writes a table, a plot and JSON)",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aioshmcache", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_mod, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, description=help_, add_help=False)
    help_ = "show a cache segment's state from outside its writer"
    p_inspect = sub.add_parser(
        "inspect",
        help=help_,
        description=f"{help_[0].upper()}{help_[1:]}: capacity, use, hits, evictions and each "
        "reader slot (alive, acknowledged, behind, revoked). Attaches without claiming a slot.",
    )
    p_inspect.add_argument("name", help="segment name (with or without the aioshm- prefix)")
    help_ = "remove the segments of writers that died"
    p_sweep = sub.add_parser(
        "sweep",
        help=help_,
        description=f"{help_[0].upper()}{help_[1:]} (killed, out of memory) and their "
        "semaphores. A live writer's segment and other users' files are never touched. "
        "With NAME, each segment found is reported: removed (an orphan), live, kept (not "
        "this user's, or still being created), or NAME is missing.",
        epilog="exit status: " + "; ".join(f"{code} {when}" for code, when in SWEEP_EXIT),
    )
    p_sweep.add_argument(
        "name",
        nargs="?",
        help="only this segment (with or without the aioshm- prefix), or else every shard of "
        "the cache group of this name, if its writer died",
    )
    p_sweep.add_argument(
        "--prefix",
        help="consider only segments whose name starts with this (e.g. a test run's or a "
        "cache group's names)",
    )
    p_sweep.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    return parser


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _sweep_summary(removed: list[str], *, dry_run: bool) -> str:
    """``removed 2 orphan segments and 1 semaphore`` (or ``would remove ...``)."""
    if not removed:
        return "no orphan segment found"
    sems = sum(1 for n in removed if n.startswith("sem."))
    parts = [_plural(len(removed) - sems, "orphan segment")] if len(removed) > sems else []
    parts += [_plural(sems, "orphan semaphore" if not parts else "semaphore")] if sems else []
    return f"{'would remove' if dry_run else 'removed'} {' and '.join(parts)}"


def _sweep_name(name: str, *, dry_run: bool) -> int:
    """``sweep NAME``: a line per segment found (a group: per shard), then the exit status."""
    found, removed = sweep_named(name, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for n in removed:
        if n.startswith("sem."):
            print(f"{verb} {n}")
    for f in found:
        if f.state == "removed":
            print(f"{verb} {f.segment} ({f.why})")
        elif f.state == "missing":
            print(f"missing: {f.segment} ({f.why})")
        else:
            print(f"{f.state}: {f.segment} ({f.why}); left alone")
    states = {f.state for f in found}
    if "removed" in states:
        return 0
    if states == {"missing"}:
        return 3
    return 4


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m aioshmcache ARGV``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[args[0]][0])
        rc: int = module.main(args[1:])
        return rc
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.command == "inspect":
        try:
            print(inspect_segment(ns.name))
        except (OSError, ValueError, ShmCacheError) as exc:  # one line, never a traceback
            print(f"inspect: {exc}", file=sys.stderr)
            return 1
        return 0
    if ns.command == "sweep":
        try:
            if ns.name is not None and ns.prefix is None:
                return _sweep_name(ns.name, dry_run=ns.dry_run)
            removed = sweep(ns.name, prefix=ns.prefix, dry_run=ns.dry_run)
        except (OSError, ValueError, ShmCacheError) as exc:
            print(f"sweep: {exc}", file=sys.stderr)
            return 1
        verb = "would remove" if ns.dry_run else "removed"
        for n in removed:
            print(f"{verb} {n}")
        print(_sweep_summary(removed, dry_run=ns.dry_run))
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2
