"""A segment's state read from outside its writer: the one reader of it, shared by every user.

``python -m aioshmcache inspect`` (:func:`inspect_segment`), the Prometheus collectors
(``aioshmcache.metrics``: ``GroupCollector``, and ``read_snapshot``, which it re-exports) and
the tools all read a segment they do not own through :func:`read_segment`. It needs no optional
dependency, no reader slot and nothing from the writer: it maps the segment, reads the words the
writer publishes in its header and each reader slot's words, and probes the kernel locks. A
reader's "behind" count needs no help from the writer either: it is the debt the writer last
published less the acknowledgements the reader wrote since (``_reader_table.reader_slots_info``), so
an idle gateway, which drains nothing, shows its readers' true lag.

A documented internal API (docs/design.md lists it for the tools): :func:`read_segment`,
:func:`read_snapshot` and :class:`SegmentState` keep their meaning for them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass

from ._layout import (
    H_BYTES_RELOCATED,
    H_BYTES_USED,
    H_CAPACITY,
    H_CREATED,
    H_DELIVERY,
    H_EPOCH,
    H_EVICTIONS,
    H_GROUP,
    H_HITS,
    H_INLINE_FULL,
    H_INLINE_LARGE,
    H_ITEMS,
    H_MAX_OBJECT,
    H_MISSES,
    H_NEXT_ID,
    H_RELOCATIONS,
    H_SIBLING_HITS,
    H_WRITER_PID,
    check_group,
    group_word,
    parse_shard_name,
)
from ._reader_table import ReaderTable, reader_slots_info
from ._segment import Segment, list_shards
from ._types import CacheSnapshot
from .errors import SegmentNotFoundError, ShmCacheError

__all__ = ["SegmentState", "inspect_segment", "read_segment", "read_snapshot"]


@dataclass(frozen=True)
class SegmentState:
    """What shared memory says of one segment, read from outside its writer.

    ``snapshot`` holds the counters and reader slots; what only the writer process knows (items
    served inline because busy, seconds waited for space, a second tier) is 0 or None there.
    """

    snapshot: CacheSnapshot
    writer_pid: int
    writer_alive: bool
    #: when the segment was created (ns since the epoch)
    created_ns: int
    #: the delivery the writer chose: ``"broadcast"`` or ``"one_of_n"``
    delivery: str
    max_object_bytes: int
    #: the id the next chunk will get
    next_id: int


def read_segment(name: str) -> SegmentState:
    """Segment ``name``'s counters, reader slots and writer, read from shared memory now.

    ``SegmentNotFoundError`` (or another ``ShmCacheError``) if the segment is gone or not ours.
    """
    seg = Segment.attach(name, populate=False)
    try:
        w = seg.words
        table = ReaderTable(seg)
        try:
            slots = tuple(reader_slots_info(table, probe=True))
        finally:
            table.release()
        shard = parse_shard_name(seg.name)
        if shard is not None and int(w[H_GROUP]) != group_word(shard[0]):
            shard = None  # named like a shard, but no member: its header does not prove it
        snap = CacheSnapshot(
            name=seg.name,
            hits=int(w[H_HITS]),
            misses=int(w[H_MISSES]),
            inline_too_large=int(w[H_INLINE_LARGE]),
            inline_full=int(w[H_INLINE_FULL]),
            evictions=int(w[H_EVICTIONS]),
            bytes_used=int(w[H_BYTES_USED]),
            items=int(w[H_ITEMS]),
            capacity_bytes=int(w[H_CAPACITY]),
            epoch=int(w[H_EPOCH]),
            readers=slots,
            sibling_hits=int(w[H_SIBLING_HITS]),
            group=None if shard is None else shard[0],
            shard=None if shard is None else shard[1],
            relocations=int(w[H_RELOCATIONS]),
            bytes_relocated=int(w[H_BYTES_RELOCATED]),
        )
        return SegmentState(
            snapshot=snap,
            writer_pid=int(w[H_WRITER_PID]),
            writer_alive=seg.writer_alive(),
            created_ns=int(w[H_CREATED]),
            delivery="one_of_n" if w[H_DELIVERY] else "broadcast",
            max_object_bytes=int(w[H_MAX_OBJECT]),
            next_id=int(w[H_NEXT_ID]),
        )
    finally:
        with contextlib.suppress(Exception):
            seg.close()


def read_snapshot(name: str) -> tuple[CacheSnapshot, bool]:
    """A segment's counters and reader slots read from shared memory, and its writer's liveness.

    :func:`read_segment`'s ``snapshot`` and ``writer_alive``: see there.
    """
    state = read_segment(name)
    return state.snapshot, state.writer_alive


def inspect_segment(name: str) -> str:
    """A human-readable report of segment ``name``, or of every shard of cache group ``name``."""
    try:
        return _report(read_segment(name))
    except SegmentNotFoundError as exc:
        not_found = exc
        try:
            shards = list_shards(check_group(name))
        except ValueError:  # not a group name either
            shards = []
        if not shards:
            raise
    parts = []
    for k, seg_name in shards:
        try:
            state = read_segment(seg_name)
        except (SegmentNotFoundError, ShmCacheError) as exc:
            parts.append(f"--- shard {k}\n{seg_name}: {exc}")
            continue
        if state.snapshot.group == name:  # a plain cache named like a shard is no member
            parts.append(f"--- shard {k}\n" + _report(state))
    if not parts:  # only plain caches named like its shards: no such group either
        raise not_found
    return "\n".join([f"group       {name}: {len(parts)} shard(s)", *parts])


def _report(state: SegmentState) -> str:
    """The lines ``inspect`` prints for one segment."""
    s = state.snapshot
    cap = s.capacity_bytes
    created = dt.datetime.fromtimestamp(state.created_ns / 1e9, tz=dt.UTC)
    total = s.total
    lines = [
        f"segment     {s.name}",
        f"writer      pid {state.writer_pid}, {'alive' if state.writer_alive else 'DEAD'}",
        f"created     {created:%Y-%m-%d %H:%M:%S} UTC",
        f"delivery    {state.delivery}",
        f"capacity    {cap} bytes (max object {state.max_object_bytes})",
        f"used        {s.bytes_used} bytes ({100 * s.bytes_used / cap:.1f}%), {s.items} items",
        f"epoch       {s.epoch}, next id {state.next_id}",
        f"hits        {s.hits} of {total}" + (f" ({100 * s.hits / total:.1f}%)" if total else ""),
        f"siblings    {s.sibling_hits} items served from sibling shards",
        f"inline      too large {s.inline_too_large}, full {s.inline_full}",
        f"evictions   {s.evictions}",
        f"relocated   {s.relocations} items, {s.bytes_relocated} bytes "
        "(second chance: hit items moved to the tail instead of evicted)",
        "readers     slot  attached  alive  pid      acked     behind  revoked",
    ]
    lines.extend(
        f"            {r.slot:<5} {'yes' if r.attached else 'no':<9} "
        f"{'yes' if r.alive else 'no':<6} {r.pid or '-':<8} {r.acknowledged:<9} "
        f"{r.lag:<7} {'yes' if r.revoked else 'no'}"
        for r in s.readers
    )
    return "\n".join(lines)
