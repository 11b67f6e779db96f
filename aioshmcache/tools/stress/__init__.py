"""``python -m aioshmcache stress``: an async stress and fault-injection harness.

It proves the guarantees of DESIGN.md section 6 under load and faults: no wrong data, no hang,
nothing lost (the cache drains), nothing left behind (no segment, no semaphore, no child).

Processes and channels (every arrow is an abstract Unix socket carrying msgpack messages in
:mod:`aioshmcache.wire` frames, :mod:`.protocol`; references travel as ``pack_features`` bytes)::

    parent: orchestrator (asyncio) -- faults, flow control, watchdog, report
      |  ^                                   |  ^
      |  | req (references), probe, hb       |  | done, probe_done, synced, hb
      v  | credit, stop, check, exit         v  | handle, req, probe, sync, exit
    writer process, generation g            reader process x N (fresh interpreters)
    AsyncSenderCache, M writer tasks,       AsyncReceiverCache, K concurrent reads,
    forged/stale reference injector         checksum verification of every array

The writer is a child process so that it can be SIGKILLed for real. The parent then checks that
``sweep(prefix=<this run's names>)`` lists the dead writer's segment as an orphan and removes it
(other programs' segments on the machine are never looked at), starts generation ``g + 1`` and
hands its handle to the readers. A reader that was attached to generation ``g`` must then see
``WriterGoneError`` from it, at the latest on a call made 1 s after the death. In ``alternate``
delivery each generation switches between broadcast and one-of-N, and the writer is also rotated
gracefully at half time.

The ``fork`` fault does the same after the writer, or a reader (in turn), has forked a child that
outlives it by ``--fork-linger`` seconds (what a prefork server or multiprocessing's ``fork``
start method does): the dead writer must still be reported gone within 1 s and be an orphan to
``sweep``, and a dead reader's slot must look dead to the writer within 3 s (so its debts are
dropped) while its forked child still lives; every forked child must exit after its linger.

``--group N`` runs N writer processes instead of one, each the writer of its own shard of one
cache group (named after the run, ``CacheConfig(group=...)``); readers attach to the whole group
(``AsyncReceiverCache.attach_group``) once and read every writer's references. All writers
sample the same Zipf hash space, so a writer often asks for a hash (passing ``None``) that only
a sibling shard holds: the copies are counted (``sibling_hits``). Every check applies per
shard: flow control and delivery mode per writer generation, acknowledgements per shard (the
reader counts its reads by nonce), the drain check on every shard at each quiescence. The
``kill-writer`` and ``fork`` faults kill one of the N writers: its replacement must reclaim the
dead shard (counted), readers get ``WriterGoneError`` for its references and go on with the
others, and its old references are refused (``WriterGoneError`` or ``InvalidReferenceError``).
In ``alternate`` delivery the first writer is rotated at half time. No fault is disabled
with groups.

Items are deterministic functions of their hash (heavy-tailed sizes from 1 KiB to 32 MiB, mostly
small; content sliced from a seeded random buffer), so every writer generation produces the
same bytes for the same hash. An item carries its crc32 (over dtype, shape and bytes of each
array) in a field and the request message carries it too: readers recompute it for every array.
Hashes repeat with a Zipf distribution; the ring is small enough to evict all the time and wrap.

What counts as a violation (exit status 1, listed in the report): wrong or torn data; a forged
or stale reference that returns data, or raises anything but the expected typed error; any
unexpected exception; an operation past its deadline, a silent child (hang), a writer event
loop blocked longer than ``--max-loop-lag``; a reader whose slot holds fewer (or, without
cancellations, other than exactly as many) acknowledgements than the references it read and
verified; a cache that does not drain after quiescence; a segment, semaphore or child process
left behind; a crashed child; and a "stale" genuine reference that nothing explains. A stale
genuine reference means the writer reclaimed a hand-out before this reader acknowledged it:

* broadcast: explained if the hand-out may predate the reader's session (its request started
  before the reader attached), if the session acknowledged the same chunk through such an
  unowed hand-out before, or if the reader was revoked (checked at once by reading the stale
  references again, which must raise ``ReaderEvictedError``: a group reader is revoked per shard,
  so only a request routed to that shard can tell; a stale reference owes nothing, so reading it
  again settles nothing),
  or if it lapsed by the ledger's lost-hand-out rule: older than ``handout_ttl`` while this
  session had already acknowledged a later hand-out of the same writer (a delivery delayed that
  long under load and faults);
* one-of-N: explained only if the hand-out is older than ``handout_ttl``.

Flow control: the parent forwards each request to its readers (all of them in broadcast, one in
one-of-N) and returns one credit to the writer when every target has reported it (a killed or
stopped target is written off), so the writer runs at most ``--window`` requests ahead.

Cancellation: a raw ``Task.cancel()`` lands while the call is suspended (a call that finishes
without suspending cannot be cancelled and is counted as "completed first"); an
``anyio.move_on_after`` scope can only cancel at anyio checkpoints, because
``anyio.to_thread.run_sync`` holds scope cancellation back until its thread returns.

At the end (and before each planned rotation) the harness quiesces: faults stop, stopped readers
resume, the writer stops issuing requests, every reader reports every request and syncs, then
the writer checks that every cached item becomes freeable (one-of-N: within ``handout_ttl``),
frees them all and that the ring is empty. SIGINT / SIGTERM end a run early with the same
cleanup (exit status 2); children die with the parent (``PR_SET_PDEATHSIG``) even on SIGKILL.
``--private-shm SIZE`` re-runs everything in its own mount namespace with a private tmpfs on
/dev/shm (root only), immune to other processes' cleanups of the shared /dev/shm.

Modules, by role: :mod:`.options` (the options and their command line), :mod:`.workload` (items
and digests), :mod:`.calls` (deadlines and injected cancellation), :mod:`.writer` and
:mod:`.reader` (the two kinds of child), :mod:`.entry` (a child's entry point), :mod:`.protocol`
(the channel), :mod:`.children` (the parent's view of its children), :mod:`.flow` (flow control),
:mod:`.faults`, :mod:`.orchestrator` (the parent), :mod:`.report` (counters, progress, table).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback

from ..units import parse_duration, parse_size
from .entry import run_loop
from .options import FAULTS, StressOptions, parse_args
from .orchestrator import IN_PRIVATE_SHM, Orchestrator
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
    env = dict(os.environ, **{IN_PRIVATE_SHM: "1"})
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 2


def main(argv: list[str]) -> int:
    """``python -m aioshmcache stress [options]``; exit 0 clean, 1 violations, 2 usage/harness."""
    try:
        opts = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
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
