"""``python -m aioshmcache inspect NAME``: a segment's state, read from outside its writer.

Attaches read-only in spirit: maps the segment without claiming a reader slot, reads the header
words the writer publishes, and probes each slot's kernel lock for liveness. A reader's
"behind" count needs no help from the writer: it is the debt the writer last published less the
acknowledgements the reader wrote since (``_readers.reader_slots_info``), so an idle gateway,
which drains nothing, shows its readers' true lag.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re

from ._group import list_shards
from ._layout import (
    H_BYTES_RELOCATED,
    H_BYTES_USED,
    H_CAPACITY,
    H_CREATED,
    H_DELIVERY,
    H_EPOCH,
    H_EVICTIONS,
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
)
from ._readers import ReaderTable, reader_slots_info
from ._segment import Segment
from .errors import SegmentNotFoundError, ShmCacheError

_GROUP_RE = re.compile(r"[A-Za-z0-9_\-]{1,180}")

__all__ = ["inspect_segment"]


def inspect_segment(name: str) -> str:
    """A human-readable report of segment ``name``, or of every shard of cache group ``name``."""
    try:
        return _inspect_one(name)
    except SegmentNotFoundError:
        shards = list_shards(name) if _GROUP_RE.fullmatch(name) else []
        if not shards:
            raise
    parts = [f"group       {name}: {len(shards)} shard(s)"]
    for k, seg_name in shards:
        try:
            parts.append(f"--- shard {k}\n" + _inspect_one(seg_name))
        except (SegmentNotFoundError, ShmCacheError) as exc:
            parts.append(f"--- shard {k}\n{seg_name}: {exc}")
    return "\n".join(parts)


def _inspect_one(name: str) -> str:
    seg = Segment.attach(name, populate=False)
    try:
        w = seg.words
        table = ReaderTable(seg)
        try:
            slots = reader_slots_info(table, probe=True)
        finally:
            table.release()
        cap = int(w[H_CAPACITY])
        used = int(w[H_BYTES_USED])
        created = dt.datetime.fromtimestamp(int(w[H_CREATED]) / 1e9, tz=dt.UTC)
        hits, misses = int(w[H_HITS]), int(w[H_MISSES])
        total = hits + misses
        lines = [
            f"segment     {seg.name}",
            f"writer      pid {int(w[H_WRITER_PID])}, {'alive' if seg.writer_alive() else 'DEAD'}",
            f"created     {created:%Y-%m-%d %H:%M:%S} UTC",
            f"delivery    {'one_of_n' if w[H_DELIVERY] else 'broadcast'}",
            f"capacity    {cap} bytes (max object {int(w[H_MAX_OBJECT])})",
            f"used        {used} bytes ({100 * used / cap:.1f}%), {int(w[H_ITEMS])} items",
            f"epoch       {int(w[H_EPOCH])}, next id {int(w[H_NEXT_ID])}",
            f"hits        {hits} of {total}" + (f" ({100 * hits / total:.1f}%)" if total else ""),
            f"siblings    {int(w[H_SIBLING_HITS])} items copied from sibling shards",
            f"inline      too large {int(w[H_INLINE_LARGE])}, full {int(w[H_INLINE_FULL])}",
            f"evictions   {int(w[H_EVICTIONS])}",
            f"relocated   {int(w[H_RELOCATIONS])} items, {int(w[H_BYTES_RELOCATED])} bytes "
            "(second chance: hit items moved to the tail instead of evicted)",
            "readers     slot  attached  alive  pid      acked     behind  revoked",
        ]
        lines.extend(
            f"            {s.slot:<5} {'yes' if s.attached else 'no':<9} "
            f"{'yes' if s.alive else 'no':<6} {s.pid or '-':<8} {s.acknowledged:<9} "
            f"{s.lag:<7} {'yes' if s.revoked else 'no'}"
            for s in slots
        )
        return "\n".join(lines)
    finally:
        with contextlib.suppress(Exception):
            seg.close()
