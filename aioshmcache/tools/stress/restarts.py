"""The ``sweep-restart`` fault: writers crash and restart under one name while ``sweep`` runs.

``python -m aioshmcache.tools.stress.restarts NAME ROUNDS`` forks a *sweeper* that sweeps
``NAME`` in a loop, then ``ROUNDS`` times a *writer* that creates a cache under ``NAME`` with
``reclaim_dead`` (its predecessor died holding the name), checks that the name leads to its own
segment before and after two more sweeper passes, and dies without closing. A writer whose name
no longer leads to its segment ``lost`` it to a sweep; one that raised ``failed`` to reclaim.
It prints one JSON line: ``rounds``, ``lost``, ``failed``, ``left`` (files under ``NAME`` after
a final sweep) and ``violations`` (in words). Forking is safe here: no thread, no event loop.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection, wait
from os import _exit  # a forked child leaves without running its parent's exit handlers
from typing import Any

from aioshmcache import CacheConfig, ReceiverCache, SegmentNotFoundError, SenderCache, sweep

from ..shm import segment_files

_FORK = mp.get_context("fork")


def _sweeper(name: str, stop: Any, passes: Any) -> None:
    """Sweep ``name`` until ``stop`` is set, counting the passes."""
    while not stop.is_set():
        sweep(name=name)
        with passes.get_lock():
            passes.value += 1


def _owns_its_name(tx: SenderCache) -> bool:
    """The name leads to this writer's segment: a reader attaches by its handle (nonce)."""
    try:
        ReceiverCache.attach(tx.handle()).close()
    except SegmentNotFoundError:
        return False
    return True


def _writer_round(name: str, passes: Any, prev: int | None, report: Connection, die: Any) -> None:
    """Forked writer: restart under ``name`` the moment the previous one died (its sentinel),
    check twice across sweeps, report, and die (``_exit``: its segment stays) on ``die``."""
    if prev is not None:
        wait([prev])  # the previous writer is gone: its lock is free, its file stays
    text = "ok"
    try:  # a failure is reported to the parent, which counts it as a violation
        tx = SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=name, reclaim_dead=True))
        mine, seen, deadline = _owns_its_name(tx), passes.value, time.monotonic() + 30.0
        while passes.value < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        if not (mine and _owns_its_name(tx)):
            text = "lost"
    except BaseException as exc:
        text = f"failed {type(exc).__name__}: {exc}"[:400]
    report.send(text)
    die.wait()
    _exit(0)


def run_rounds(name: str, rounds: int) -> dict[str, Any]:
    """``rounds`` crash-and-restart rounds under ``name`` against a sweeping process.

    Each writer restarts the moment its predecessor dies: the sweeper meets a freshly dead file
    while the restart reclaims it (the race that lost segments before ``sweep`` removed only the
    very file it judged)."""
    stop, passes = _FORK.Event(), _FORK.Value("q", 0)
    sweeper = _FORK.Process(target=_sweeper, args=(name, stop, passes), daemon=True)
    sweeper.start()
    outcomes: list[str] = []
    prev: tuple[Any, Any] | None = None  # the live writer and its ``die`` event
    try:
        for _ in range(rounds):
            (got, report), die = _FORK.Pipe(duplex=False), _FORK.Event()
            args = (name, passes, prev and prev[0].sentinel, report, die)
            (w := _FORK.Process(target=_writer_round, args=args)).start()
            report.close()
            if prev is not None:
                prev[1].set()  # the previous writer dies; this one restarts at once
                prev[0].join()
            prev = (w, die)
            try:
                outcomes.append(got.recv())
            except EOFError:
                outcomes.append("the writer died without a report")
    finally:
        if prev is not None:
            prev[1].set()
            prev[0].join(30)
        stop.set()
        sweeper.join(30)
        if sweeper.is_alive():
            sweeper.kill()
            sweeper.join(10)
        sweep(name=name)
    lost, errors = outcomes.count("lost"), [o for o in outcomes if o not in ("ok", "lost")]
    left, why = segment_files(name), []
    if lost:
        why.append(f"{lost} of {rounds} writers restarted under {name} lost their segment")
    if errors:
        why.append(f"{len(errors)} restarts under {name} could not reclaim: {errors[:5]}")
    if left:
        why.append(f"left after the final sweep: {left}")
    return {"rounds": rounds, "lost": lost, "failed": len(errors), "left": left, "violations": why}


def main(argv: list[str]) -> int:
    """``NAME ROUNDS``: print the result as one JSON line; exit 0 (the parent judges it)."""
    name, rounds = argv[0], int(argv[1])
    print(json.dumps(run_rounds(name, rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
