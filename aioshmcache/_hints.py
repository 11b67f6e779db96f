"""Key hints: a shard publishes where its keys are, for its siblings to read without a lock.

A direct-mapped table in the shard's own segment (the region at ``H_HINT_OFF``, ``H_HINT_SLOTS``
slots of 64 bytes, see ``_layout``). Slot ``digest mod n`` of a key holds a 128-bit digest of the
key (blake2b) and its chunk's reference fields (epoch, address, id, length, position). Only the
shard's writer writes it, as a seqlock: the sequence word is made odd, the fields written, then
the word made even again (one aligned 8-byte store each; x86-64 keeps stores in order). A reader
in another process reads the word, the fields, and the word again: equal and even means the
fields are one writer's consistent snapshot.

It is only a *hint*: a slot shared by two keys keeps the latest (the older key just cannot be
found by siblings), and a hint may name a chunk freed or reused since. Whoever uses a hint
verifies the chunk itself (``ShmRingBuffer.access`` before, ``verify`` after the copy), so a
stale, overwritten or torn hint only ever means "not found".
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from ._layout import (
    H_HINT_OFF,
    H_HINT_SLOTS,
    HINT_SLOT_SIZE,
    HS_D0,
    HS_D1,
    HS_SEQ,
)
from ._segment import Segment

__all__ = ["Hint", "HintTable", "key_digest"]

_WORDS = HINT_SLOT_SIZE // 8


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
        hw = segment.words
        self.n_slots = n = int(hw[H_HINT_SLOTS])
        off = int(hw[H_HINT_OFF])
        self._w = segment.buf[off : off + n * HINT_SLOT_SIZE].cast("Q")
        self._mask = n - 1

    def __bool__(self) -> bool:
        return self.n_slots > 0

    def _index(self, d0: int) -> int:
        return (d0 & self._mask) * _WORDS

    def publish(self, key: str, hint: Hint) -> None:
        """Writer only: say where ``key`` is now (replaces whatever the slot held)."""
        d0, d1 = key_digest(key)
        w, i = self._w, self._index(d0)
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
        w, i = self._w, self._index(d0)
        if w[i + HS_D0] != d0 or w[i + HS_D1] != d1 or w[i + 5] != cid:
            return  # the slot holds another key (or a newer chunk of this one)
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
        w, i = self._w, self._index(d0)
        seq = w[i + HS_SEQ]
        if seq & 1:
            return None
        fields = w[i + 1 : i + _WORDS].tolist()
        if w[i + HS_SEQ] != seq or fields[0] != d0 or fields[1] != d1:
            return None
        return Hint(*fields[2:])

    def release(self) -> None:
        """Drop the view (before the segment is closed)."""
        self._w.release()
