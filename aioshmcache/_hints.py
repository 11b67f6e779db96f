"""Key hints: a shard publishes where its keys are, for its siblings to read without a lock.

A 4-way set-associative table in the shard's own segment (the region at ``H_HINT_OFF``,
``H_HINT_SLOTS`` slots of 64 bytes, see ``_layout``). A key's bucket is ``digest mod buckets``
(4 slots, 256 bytes); its slot holds a 128-bit digest of the key (blake2b) and its chunk's
reference fields (epoch, address, id, length, position). A put takes the key's own slot, else an
empty one, else the oldest (lowest position: the first the FIFO ring will evict anyway). Only the
shard's writer writes it, as a seqlock: the sequence word is made odd, the fields written, then
the word made even again (one aligned 8-byte store each; x86-64 keeps stores in order). A reader
in another process reads the word, the fields, and the word again: equal and even means the
fields are one writer's consistent snapshot.

It is only a *hint*: a full bucket drops its oldest key (siblings then cannot find it), and a
hint may name a chunk freed or reused since. Whoever uses a hint verifies the chunk itself
(``ShmRingBuffer.access`` before, ``verify`` after the copy), so a
stale, overwritten or torn hint only ever means "not found".
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from ._layout import (
    HINT_SLOT_SIZE,
    HS_D0,
    HS_D1,
    HS_ID,
    HS_POSITION,
    HS_SEQ,
)
from ._segment import Segment

__all__ = ["Hint", "HintTable", "key_digest"]

_WORDS = HINT_SLOT_SIZE // 8
WAYS = 4  # slots per bucket


def key_digest(key: str) -> tuple[int, int]:
    """The 128-bit digest of a key as two words (never ``(0, 0)``, which marks an empty slot)."""
    d = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1


class Hint(NamedTuple):
    """Where a shard says a key's chunk is (unverified)."""

    epoch: int
    address: int
    id: int
    length: int
    position: int


class HintTable:
    """The key-hint region of one segment: written by its writer, read by anyone."""

    def __init__(self, segment: Segment) -> None:
        # the geometry checked at attach (or made at create), not the header words again
        self.n_slots = n = segment.layout.hint_slots
        off = segment.layout.hint_off
        self._w = segment.buf[off : off + n * HINT_SLOT_SIZE].cast("Q")
        self._buckets = max(1, n // WAYS)

    def __bool__(self) -> bool:
        return self.n_slots > 0

    def _bucket(self, d0: int) -> range:
        """Word indices of the slots of ``d0``'s bucket."""
        start = (d0 % self._buckets) * WAYS * _WORDS
        return range(start, start + min(WAYS, self.n_slots) * _WORDS, _WORDS)

    def _slot_for(self, d0: int, d1: int) -> int:
        """Writer only: the key's slot, else an empty one, else the oldest of its bucket."""
        w = self._w
        empty = oldest = -1
        for i in self._bucket(d0):
            a, b = w[i + HS_D0], w[i + HS_D1]
            if a == d0 and b == d1:
                return i
            if a == 0 and b == 0:
                if empty < 0:
                    empty = i
            elif oldest < 0 or w[i + HS_POSITION] < w[oldest + HS_POSITION]:
                oldest = i
        return empty if empty >= 0 else oldest

    def publish(self, key: str, hint: Hint) -> None:
        """Writer only: say where ``key`` is now (replaces an older hint if its bucket is full)."""
        d0, d1 = key_digest(key)
        w, i = self._w, self._slot_for(d0, d1)
        seq = int(w[i + HS_SEQ])
        w[i + HS_SEQ] = seq + 1 | 1  # odd: being written
        w[i + HS_D0] = d0
        w[i + HS_D1] = d1
        for k, v in enumerate(hint, start=3):
            w[i + k] = v
        w[i + HS_SEQ] = (seq | 1) + 1  # even again: complete

    def remove(self, key: str, cid: int) -> None:
        """Writer only: forget ``key``'s hint if the slot still names its chunk ``cid``."""
        d0, d1 = key_digest(key)
        w = self._w
        for i in self._bucket(d0):
            if w[i + HS_D0] == d0 and w[i + HS_D1] == d1 and w[i + HS_ID] == cid:
                break
        else:
            return  # not here (dropped, or a newer chunk of this key)
        seq = int(w[i + HS_SEQ])
        w[i + HS_SEQ] = seq + 1 | 1
        w[i + HS_D0] = 0
        w[i + HS_D1] = 0
        w[i + HS_SEQ] = (seq | 1) + 1

    def lookup(self, key: str) -> Hint | None:
        """Any process: ``key``'s hint, or None (absent, or being rewritten right now)."""
        if not self.n_slots:
            return None
        d0, d1 = key_digest(key)
        w = self._w
        for i in self._bucket(d0):
            seq = w[i + HS_SEQ]
            if seq & 1 or w[i + HS_D0] != d0:
                continue
            fields = w[i + 1 : i + _WORDS].tolist()
            if w[i + HS_SEQ] == seq and fields[0] == d0 and fields[1] == d1:
                return Hint(*fields[2:])
        return None

    def release(self) -> None:
        """Drop the view (before the segment is closed)."""
        self._w.release()
