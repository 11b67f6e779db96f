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
import os
import sys
import time
from os import _exit  # a forked child leaves without running its parent's exit handlers
from typing import Any

from aioshmcache import (
    CacheConfig,
    ReceiverCache,
    SegmentNotFoundError,
    SenderCache,
    sweep,
)

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


def _read_to_eof(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _writer_round(name: str, passes: Any, after: int, report: int, die: int) -> None:
    """Forked writer: restart under ``name`` once the previous one died (EOF on ``after``),
    check twice across sweeps, report, die (``_exit``: its segment stays) at EOF on ``die``."""
    if after >= 0:
        _read_to_eof(after)  # the previous writer is gone: its lock is free, its file stays
    text = b"ok"
    try:  # a failure is reported to the parent, which counts it as a violation
        tx = SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=name, reclaim_dead=True))
        mine = _owns_its_name(tx)
        seen = passes.value
        deadline = time.monotonic() + 30.0
        while passes.value < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.0005)
        if not (mine and _owns_its_name(tx)):
            text = b"lost"
    except BaseException as exc:
        text = f"failed {type(exc).__name__}: {exc}".encode()[:400]
    os.write(report, text + b"\n")
    os.close(report)
    _read_to_eof(die)
    _exit(0)


def run_rounds(name: str, rounds: int) -> dict[str, Any]:
    """``rounds`` crash-and-restart rounds under ``name`` against a sweeping process.

    Each writer restarts the moment its predecessor dies: the sweeper meets a freshly dead file
    while the restart reclaims it (the race that lost segments before ``sweep`` removed only the
    very file it judged)."""
    stop, passes = _FORK.Event(), _FORK.Value("q", 0)
    sweeper = _FORK.Process(target=_sweeper, args=(name, stop, passes), daemon=True)
    sweeper.start()
    lost = failed = 0
    errors: list[str] = []
    prev: tuple[int, int] | None = None  # the live writer: pid, the write end of its die pipe
    after = -1  # read end of the live writer's death pipe
    try:
        for _ in range(rounds):
            death_r, death_w = os.pipe()
            report_r, report_w = os.pipe()
            die_r, die_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the forked writer
                for fd in (death_r, report_r, die_w):
                    os.close(fd)
                if prev is not None:
                    os.close(prev[1])
                _writer_round(name, passes, after, report_w, die_r)
            for fd in (death_w, report_w, die_r):
                os.close(fd)
            if after >= 0:
                os.close(after)
            if prev is not None:
                os.close(prev[1])  # the previous writer dies; this one restarts at once
                os.waitpid(prev[0], 0)
            after, prev = death_r, (pid, die_w)
            line = _read_to_eof(report_r).decode(errors="replace").strip()
            os.close(report_r)
            if line == "lost":
                lost += 1
            elif line != "ok":
                failed += 1
                if len(errors) < 5:
                    errors.append(line or "the writer died without a report")
    finally:
        if prev is not None:
            os.close(prev[1])
            os.waitpid(prev[0], 0)
        if after >= 0:
            os.close(after)
        stop.set()
        sweeper.join(30)
        if sweeper.is_alive():
            sweeper.kill()
            sweeper.join(10)
        sweep(name=name)
    left, why = segment_files(name), []
    if lost:
        why.append(
            f"{lost} of {rounds} writers restarted under {name} lost their segment to a sweep"
        )
    if failed:
        why.append(
            f"{failed} restarts under {name} could not reclaim a dead writer's name: {errors}"
        )
    if left:
        why.append(f"left after the final sweep: {left}")
    return {"rounds": rounds, "lost": lost, "failed": failed, "left": left, "violations": why}


def main(argv: list[str]) -> int:
    """``NAME ROUNDS``: print the result as one JSON line; exit 0 (the parent judges it)."""
    name, rounds = argv[0], int(argv[1])
    print(json.dumps(run_rounds(name, rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
