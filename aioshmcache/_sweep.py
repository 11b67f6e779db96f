"""Orphan removal: segments whose writer died (SIGKILL, OOM) are unlinked by ``sweep``.

A segment is an orphan exactly when nobody holds its writer lock (byte 0, an OFD lock the kernel
releases when the writer dies). A live writer's segment is never touched, nor a file of another
user. Wake-up semaphores (``sem.aioshm-...``) whose segment is gone are removed too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time

from ._segment import MAGIC, SHM_DIR, list_segments, ofd_probe
from ._types import SEGMENT_PREFIX

__all__ = ["sweep"]


#: a segment without its magic yet may be in the microseconds between ``open`` and the writer's
#: lock: only one older than this is an orphan of a creation that died
_CREATION_GRACE = 10.0


def _writer_dead(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        if ofd_probe(fd, 0):
            return False
        head = os.pread(fd, 8, 0)
        initialised = len(head) == 8 and int.from_bytes(head, sys.byteorder) == MAGIC
        return initialised or time.time() - st.st_mtime > _CREATION_GRACE
    finally:
        os.close(fd)


def sweep(*, dry_run: bool = False) -> list[str]:
    """Remove every ``aioshm-`` segment whose writer is dead; returns the names removed."""
    removed: list[str] = []
    for name in list_segments():
        path = os.path.join(SHM_DIR, name)
        if _writer_dead(path):
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            removed.append(name)
    live = set(list_segments()) if not dry_run else set(list_segments()) - set(removed)
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        names = []
    for n in names:
        if not n.startswith("sem." + SEGMENT_PREFIX):
            continue
        seg = n[4:].rsplit(".", 2)[0]  # sem.<segment>.<nonce>.wake; segment names may hold dots
        if seg in live:
            continue
        path = os.path.join(SHM_DIR, n)
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid != os.getuid():
                continue
            if not dry_run:
                os.unlink(path)
            removed.append(n)
    return removed
