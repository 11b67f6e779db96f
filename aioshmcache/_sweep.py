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

``sweep_named`` is what ``python -m aioshmcache sweep NAME`` runs: NAME is a segment, or else a
cache group whose shards are swept one by one, and each one found is reported as *removed*
(an orphan), *live* (its writer holds its lock), or *kept* (not this user's, or a creation
still in its grace time); a NAME that is neither is *missing*.
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal, NamedTuple

from ._layout import SEGMENT_PREFIX, SHM_DIR, segment_name
from ._segment import (
    CREATION_GRACE,
    list_segments,
    list_semaphores,
    list_shards,
    remove_orphan,
    writer_state,
)

__all__ = ["Found", "sweep", "sweep_named"]


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

    sems = [s for s in list_semaphores() if mine(s[1])]
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


class Found(NamedTuple):
    """What ``sweep_named`` found under one segment name."""

    segment: str  # the segment's name in /dev/shm (``aioshm-...``)
    state: Literal["removed", "live", "kept", "missing"]
    why: str  # a few words for a person: the writer's pid, or why the file was kept


def sweep_named(name: str, *, dry_run: bool = False) -> tuple[list[Found], list[str]]:
    """Sweep segment ``name``, or every shard of cache group ``name`` if no segment has it.

    Returns what was found, segment by segment (``[Found(aioshm-NAME, "missing", ...)]`` when
    neither exists), and every file removed (segments and semaphores; ``dry_run``: would be).
    """
    full = segment_name(name)  # ValueError for a name no segment can have
    if os.path.lexists(os.path.join(SHM_DIR, full)):
        targets = [full]
    else:
        # the group's name as given, else as normalised (``aioshm-G`` for group ``G``, as a
        # segment's name may be given with its prefix; a group may itself be named ``aioshm-x``)
        targets = [seg for _k, seg in list_shards(name.removeprefix("/"))] or [
            seg for _k, seg in list_shards(full.removeprefix(SEGMENT_PREFIX))
        ]
    if not targets:
        removed = sweep(full, dry_run=dry_run)  # semaphores a missing segment left, if any
        return [Found(full, "missing", "no such segment or cache group")], removed
    found: list[Found] = []
    removed = []
    for seg in targets:
        gone = sweep(seg, dry_run=dry_run)
        removed += gone
        st = writer_state(os.path.join(SHM_DIR, seg))
        if seg in gone:
            found.append(Found(seg, "removed", "orphan: its writer is dead"))
        elif not st.exists:
            found.append(Found(seg, "missing", "removed by another process meanwhile"))
        elif st.alive:
            pid = f"pid {st.pid}" if st.pid else "a process creating it"
            found.append(Found(seg, "live", f"its writer ({pid}) is alive"))
        elif not st.ours:
            found.append(Found(seg, "kept", "not a segment of this user"))
        else:
            why = f"no complete header yet, created under {CREATION_GRACE:g} s ago"
            found.append(Found(seg, "kept", f"{why}: sweep again later"))
    return found, removed
