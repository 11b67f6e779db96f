"""Layer 8: ``python -m aioshmcache`` (``demo``, ``stress``, ``bench``, ``inspect``, ``sweep``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._inspect import inspect_segment
from ._sweep import sweep

__all__ = ["main"]

# subcommands implemented in their own modules: name -> (module, help)
_DELEGATED = {
    "demo": ("aioshmcache.tools.demo", "the FastAPI multimodal gateway demo with worker processes"),
    "stress": ("aioshmcache.tools.stress", "async stress and fault-injection harness"),
    "bench": ("aioshmcache.tools.bench", "benchmarks against memcpy and peers (table + plot)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[args[0]][0])
        rc: int = module.main(args[1:])
        return rc
    parser = argparse.ArgumentParser(prog="python -m aioshmcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_mod, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    p_inspect = sub.add_parser("inspect", help="show a segment's state from outside its writer")
    p_inspect.add_argument("name", help="segment name (with or without the aioshm- prefix)")
    p_sweep = sub.add_parser("sweep", help="remove aioshm- segments whose writer is dead")
    p_sweep.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    ns = parser.parse_args(args)
    if ns.command == "inspect":
        try:
            print(inspect_segment(ns.name))
        except (OSError, ValueError) as exc:
            print(f"inspect: {exc}", file=sys.stderr)
            return 1
        return 0
    if ns.command == "sweep":
        removed = sweep(dry_run=ns.dry_run)
        verb = "would remove" if ns.dry_run else "removed"
        for n in removed:
            print(f"{verb} {n}")
        print(f"{len(removed)} {'orphan' if len(removed) == 1 else 'orphans'} {verb}")
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2
