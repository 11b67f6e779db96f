"""The ``fork`` fault's child side: fork a grandchild that outlives its parent for a while.

A writer or a reader that forks (a prefork server, multiprocessing's ``fork`` start method) and is
then SIGKILLed must still look dead: the grandchild inherits the segment's mapping and whatever
descriptors the core did not close at fork, but not the kernel locks that carry liveness. The
grandchild here does nothing with the cache (a forked child cannot use its parent's cache
objects); it closes only the harness's channel (so the parent sees its parent's death), lingers
and exits. The parent records its pid and start time and checks at the end that it is gone.
"""

from __future__ import annotations

import os
import time
from os import _exit  # a forked child leaves without running its parent's exit handlers

from ..framing import Link

__all__ = ["fork_lingering", "process_start"]


def fork_lingering(link: Link, linger: float) -> int:
    """Fork a grandchild that lives ``linger`` seconds, then exits; its pid (in the caller)."""
    sock = link.writer.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    pid = os.fork()
    if pid == 0:  # the grandchild: no cache, no event loop, nothing but waiting
        try:
            if fd >= 0:
                os.close(fd)
            time.sleep(linger)
        finally:
            _exit(0)
    return pid


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot); None if it does not exist.

    A pid and its start time name one process even after the pid is reused.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] == b"Z":
        return None
    return int(fields[19])
