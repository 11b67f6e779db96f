"""``python -m aioshmcache stress``: an async stress and fault-injection harness.

It proves the guarantees of DESIGN.md section 6 under load and faults: no wrong data, no hang,
nothing lost (the cache drains), nothing left behind (no segment, semaphore or process)::

    parent (.parent): children, flow control, faults, watchdog, report
      | ^ req, probe, hb, re, violation         | ^ done, count, hb, re, violation
      v | handle, credit, stop, check, slots,   v | handle, group, req, probe, sync,
      |   fork, exit                            |   fork, exit
    writer process(es) (.writer)                reader processes (.reader)

one protocol (:mod:`.child`) over an abstract Unix socket. Items (:mod:`.workload`) are functions
of their hash and carry their crc32; readers check every array. Writers are children so that they
can be SIGKILLed for real; ``alternate`` delivery switches broadcast / one-of-N each writer
generation and rotates the writer at half time; ``--group N`` runs N writers of one cache group's
shards, read through ``attach_group``, every check per shard. The faults (``--faults all``) and
what each must not break are in :data:`.parent.PERIODIC` (``kill-readers``, ``stop-readers``,
``kill-writer``, ``fork``, ``sweep-restart``) and in the children (``cancel``, ``forge``,
``close-read``).

A violation (exit 1, listed in the report): wrong or torn data; a forged or stale reference that
returns data or an unexpected error; any unexpected exception; a missed deadline, a silent child,
a writer loop blocked past ``--max-loop-lag``; a dead writer not seen gone within 1 s, or not an
orphan to ``sweep``; a reader slot with fewer acknowledgements than its reader's verified reads;
a cache that does not drain after quiescence; a leftover segment, semaphore or process; a crashed
child; a stale genuine reference nothing explains (:meth:`.reader.ReaderProc.classify`). SIGINT /
SIGTERM end a run with the same cleanup (exit 2); ``--private-shm SIZE`` re-runs it in a private
/dev/shm (root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback

from ..units import parse_duration, parse_size
from .child import run_loop
from .options import FAULTS, StressOptions, parse_args
from .parent import IN_PRIVATE_SHM, Orchestrator
from .workload import Workload, item_size, verify_item

__all__ = [
    "FAULTS",
    "StressOptions",
    "Workload",
    "item_size",
    "main",
    "parse_duration",
    "parse_size",
    "verify_item",
]


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
