"""Orphan removal: segments whose writer died (SIGKILL, OOM) are unlinked by ``sweep``.

A segment is an orphan exactly when nobody holds its writer lock (byte 0, an OFD lock the kernel
releases when the writer dies). A live writer's segment is never touched, nor a file of another
user. Wake-up semaphores (``sem.aioshm-...``) whose segment is gone are removed too.

The semaphores are listed *before* the segments are judged: a writer that starts while ``sweep``
runs creates its semaphore after its segment, so its semaphore is not in that list and cannot be
taken for an orphan's.

A segment is judged and unlinked by ``_segment.remove_orphan``: under the file's remover lock,
and only if the name still leads to the very file judged dead. So a writer that restarts under
the name meanwhile (reclaiming the dead file, creating its own) never loses its new segment.
"""

from __future__ import annotations

import contextlib
import os

from ._layout import SHM_DIR, parse_semaphore_file, segment_name
from ._segment import list_segments, remove_orphan, writer_state

__all__ = ["sweep"]


def _semaphore_files() -> list[tuple[str, str, int]]:
    """(file name, segment, nonce low bits) of every wake semaphore of ours in /dev/shm."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        parsed = parse_semaphore_file(n)
        if parsed is not None:
            out.append((n, *parsed))
    return out


def sweep(
    name: str | None = None, *, prefix: str | None = None, dry_run: bool = False
) -> list[str]:
    """Remove segments whose writer is dead, and their wake semaphores; returns the names removed.

    With ``name``, only that segment (and its semaphores) is considered; a live one is left
    alone and nothing is returned. With ``prefix``, only segments whose name starts with it
    (``name`` as given to ``CacheConfig``, without ``aioshm-``; a cache group's shards start with
    the group's name): what a test run, a deployment or a tool uses to clean up after itself
    without touching anyone else's. ``dry_run`` only lists what would be removed.
    """
    if name is not None and prefix is not None:
        raise ValueError("pass name or prefix, not both")
    only = segment_name(name) if name is not None else None
    start = segment_name(prefix) if prefix is not None else ""  # validated like a name

    def mine(seg: str) -> bool:
        return seg == only if only is not None else seg.startswith(start)

    sems = [s for s in _semaphore_files() if mine(s[1])]
    candidates = [only] if only is not None else [s for s in list_segments() if mine(s)]
    removed = [
        seg for seg in candidates if remove_orphan(os.path.join(SHM_DIR, seg), dry_run=dry_run)
    ]
    present = set(list_segments()) - (set(removed) if dry_run else set())
    live_nonces: dict[str, int | None] = {}
    for fname, seg, low in sems:
        if seg in present:
            if seg not in live_nonces:
                live_nonces[seg] = writer_state(os.path.join(SHM_DIR, seg)).nonce
            nonce = live_nonces[seg]
            if nonce is None or nonce & 0xFFFFFFFF == low:
                continue  # the semaphore of a present segment (or one we cannot read): keep it
        path = os.path.join(SHM_DIR, fname)
        with contextlib.suppress(OSError):
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid():
                continue
            if not dry_run:
                os.unlink(path)
            removed.append(fname)
    return removed
