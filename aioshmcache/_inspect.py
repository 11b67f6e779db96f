"""``python -m aioshmcache inspect NAME``: a segment's state, read from outside its writer.

Attaches read-only in spirit: maps the segment without claiming a reader slot, reads the header
words the writer publishes, and probes each slot's kernel lock for liveness.
"""

from __future__ import annotations

import contextlib
import datetime as dt

from ._readers import ReaderTable
from ._segment import (
    W_BYTES_USED,
    W_CAPACITY,
    W_CREATED,
    W_DELIVERY,
    W_EPOCH,
    W_EVICTIONS,
    W_HITS,
    W_INLINE_FULL,
    W_INLINE_LARGE,
    W_ITEMS,
    W_MAX_OBJECT,
    W_MISSES,
    W_NEXT_ID,
    W_WRITER_PID,
    Segment,
)
from ._store import reader_slots_info

__all__ = ["inspect_segment"]


def inspect_segment(name: str) -> str:
    """A human-readable report of segment ``name``."""
    seg = Segment.attach(name, populate=False)
    try:
        w = seg.words
        table = ReaderTable(seg)
        try:
            slots = reader_slots_info(table, probe=True)
        finally:
            table.release()
        cap = int(w[W_CAPACITY])
        used = int(w[W_BYTES_USED])
        created = dt.datetime.fromtimestamp(int(w[W_CREATED]) / 1e9, tz=dt.timezone.utc)
        hits, misses = int(w[W_HITS]), int(w[W_MISSES])
        total = hits + misses
        lines = [
            f"segment     {seg.name}",
            f"writer      pid {int(w[W_WRITER_PID])}, {'alive' if seg.writer_alive() else 'DEAD'}",
            f"created     {created:%Y-%m-%d %H:%M:%S} UTC",
            f"delivery    {'one_of_n' if w[W_DELIVERY] else 'broadcast'}",
            f"capacity    {cap} bytes (max object {int(w[W_MAX_OBJECT])})",
            f"used        {used} bytes ({100 * used / cap:.1f}%), {int(w[W_ITEMS])} items",
            f"epoch       {int(w[W_EPOCH])}, next id {int(w[W_NEXT_ID])}",
            f"hits        {hits} of {total}" + (f" ({100 * hits / total:.1f}%)" if total else ""),
            f"inline      too large {int(w[W_INLINE_LARGE])}, full {int(w[W_INLINE_FULL])}",
            f"evictions   {int(w[W_EVICTIONS])}",
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
