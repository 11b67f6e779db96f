"""``python -m aioshmcache stress``: an async stress and fault-injection harness.

It proves the guarantees of docs/guarantees.md under load and faults: no wrong data, no hang,
nothing lost (the cache drains), nothing left behind. The parent (:mod:`.parent`) starts writer
(:mod:`.writer`) and reader (:mod:`.reader`) processes, routes their messages (:mod:`.child`),
injects the faults (:data:`.options.FAULTS`) and checks the end state; items (:mod:`.workload`)
are functions of their hash and carry their crc32. A violation (exit 1, listed in the report):
wrong or torn data; an unexpected exception; a missed deadline, a silent child, a blocked writer
loop; a dead writer not seen gone within 1 s or not swept; lost acknowledgements; a cache that
does not drain; anything left behind; a stale genuine reference nothing explains. SIGINT /
SIGTERM end a run with the same cleanup (exit 2); ``--private-shm SIZE`` re-runs it in a private
/dev/shm (root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback

from .child import run_loop
from .options import FAULTS, StressOptions, parse_args
from .parent import IN_PRIVATE_SHM, Orchestrator
from .workload import Workload, item_size, verify_item

__all__ = ["FAULTS", "StressOptions", "Workload", "item_size", "main", "verify_item"]


def _run_in_private_shm(size: int, argv: list[str]) -> int:
    """Re-run this command in a new mount namespace with its own tmpfs on /dev/shm."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        print("--private-shm needs root and unshare(1)", file=sys.stderr)
        return 2
    script = 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"'
    cmd = [unshare, "-m", "--propagation", "private", "sh", "-c", script, str(size)]
    cmd += [sys.executable, "-m", "aioshmcache", "stress", *argv]
    try:
        return subprocess.run(cmd, env=dict(os.environ, **{IN_PRIVATE_SHM: "1"})).returncode
    except KeyboardInterrupt:
        return 2


def main(argv: list[str]) -> int:
    """``python -m aioshmcache stress [options]``; exit 0 clean, 1 violations, 2 usage/harness."""
    try:
        opts = parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if opts.private_shm and not os.environ.get(IN_PRIVATE_SHM):
        return _run_in_private_shm(opts.private_shm, argv)
    orch = Orchestrator(opts)
    try:
        return run_loop(opts.loop, orch.run)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"harness failure; logs in {orch.tmp}", file=sys.stderr)
        return 2
