"""The byte layout of a segment, in one place: header words, reader slots, chunks and names.

Every word is a native unsigned 64-bit integer written with one aligned store (a word has exactly
one writing process; see ``_reader_table``). Word indices are named by where they live:
``H_`` segment header, ``RS_`` reader slot words written by the reader, ``WS_`` reader slot words
written by the writer, ``C_`` chunk header.

Segment (``total`` bytes, a multiple of the page size)::

    0        +--------------------------------------------------+
             | segment header (HEADER_SIZE = 4096 bytes)        |
             |  word  0 H_MAGIC "AIOSHMC1" (written last)       |
             |        1 H_VERSION layout version                |
             |        2 H_HEADER_SIZE    3 H_CAPACITY (ring)     |
             |        4 H_MAX_OBJECT     5 H_N_READERS (slots)   |
             |        6 H_READER_OFF     7 H_SLOT_SIZE           |
             |        8 H_RING_OFF       9 H_NONCE (random, odd) |
             |       10 H_WRITER_PID    11 H_EPOCH (clear bumps) |
             |       12 H_OWNER_UID     13 H_DELIVERY            |
             |       14 H_NEXT_ID (next chunk id)               |
             |       15 H_WAITING (the writer waits for space)  |
             |       16 H_LOG_ENTRIES   17 H_TOTAL (bytes)       |
             |       18 H_CREATED (ns)  19 H_STATE live/closed   |
             |       20..26 statistics the writer publishes:    |
             |              H_HITS H_MISSES H_INLINE_LARGE      |
             |              H_INLINE_FULL H_EVICTIONS           |
             |              H_BYTES_USED H_ITEMS                |
             |       27 H_HANDOUT_TTL_MS                        |
             |       28 H_SECRET (keys the reference tag)       |
             |       29 H_HEAD_POS (reuse fence: position of    |
             |          the oldest live chunk, see ``_ring``)   |
             |       30 H_HINT_OFF  31 H_HINT_SLOTS (0: none)   |
             |       32 H_SIBLING_HITS (items a group shard     |
             |          served from a sibling shard)            |
             |       33 H_RELOCATIONS  34 H_BYTES_RELOCATED     |
             |          (second chance: chunks moved to the     |
             |          tail instead of evicted, their bytes)   |
             |       35 H_GROUP: ``group_word(G)`` in a shard   |
             |          of cache group G, 0 in a plain cache    |
             |       48..63 H_PAST: nonces of the earlier       |
             |          writers of this name (reclaimed from    |
             |          dead writers; latest first, 0: none)    |
    4096     +--------------------------------------------------+
             | reader table: H_N_READERS slots x H_SLOT_SIZE    |
    hint_off +--------------------------------------------------+  (64 aligned; group shards)
             | key hints: H_HINT_SLOTS x 64 bytes (``_hints``)  |
    ring_off +--------------------------------------------------+  (page aligned)
             | ring: H_CAPACITY bytes of chunks                 |
             +--------------------------------------------------+

Reader slot (``slot_size`` bytes: SLOT_HEADER, then the acknowledgement log)::

    +0    words written by the reader        +64   words written by the writer
          0 RS_SESSION (0: free)                   8 WS_CONSUMED (acks the writer has read)
          1 RS_PID (information only)              9 WS_REVOKED (the revoked session)
          2 RS_HEAD (acks written)                10 WS_OWED (hand-outs not acknowledged)
          3 RS_START (head at attach)             11 WS_SESSION (the session WS_OWED is of)
          4 RS_ATTACHED (ns)
    +128  acknowledgement log: ``log_entries`` pairs of words; entry ``k % log_entries`` =
          (chunk id, hand-out seq)

Chunk (at ``address``, a multiple of 64, in the ring)::

    +0    C_ID     64-bit chunk id (generation), never reused
    +8    C_LENGTH payload bytes
    +16   C_STATE  WRITING 1, COMMITTED 2, FREED 3, DEAD 4 (abandoned)
    +24   C_CHECK  id ^ length ^ CHUNK_MAGIC
    +32   reserved (4 words)
    +64   payload, padded to 64 bytes

Key hint slot (64 bytes, written by the writer only; a seqlock, see ``_hints``)::

    0 HS_SEQ (odd while being written)   1, 2 HS_D0, HS_D1 key digest (0, 0: empty)
    3 HS_EPOCH  4 HS_ADDRESS  5 HS_ID  6 HS_LENGTH  7 HS_POSITION (the chunk, as in a ``ShmRef``)

Kernel locks (OFD byte-range locks on the segment file): byte 0 is the writer's, byte ``1 + i``
reader slot ``i``'s.

Names: a segment is ``/dev/shm/aioshm-<name>``; its wake-up semaphore is the POSIX semaphore
``/<segment>.<nonce low 32 bits, 8 hex digits>.wake``, which Linux keeps as
``/dev/shm/sem.<segment>.<nonce>.wake``. A shard of cache group ``G`` is the segment
``aioshm-G.shard<k>`` (``k`` in ``0 .. MAX_SHARDS - 1``; a group name has no ``.``, so a shard
name parses one way only). All are built and parsed only here.

Group membership is proven by the header, not by the name: a plain cache may be named
``G.shard0`` too. A shard's writer writes ``H_GROUP`` (a 64-bit digest of the group name, never
0) once, right after creating its segment and before it hands out anything or publishes a key;
a plain cache leaves it 0. Readers and sibling writers look only at files whose word is their
group's; a shard seen in the instant before its word is written is skipped and found at the
next scan (no reference of it can exist yet). Layout version 4 added the word (a version-3
segment has no such proof, and is refused as any other version mismatch).
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

__all__ = [
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "MAGIC",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Layout",
    "chunk_size",
    "check_group",
    "group_word",
    "hint_slots_for",
    "building_name",
    "is_segment_file",
    "parse_shard_name",
    "parse_semaphore_file",
    "segment_name",
    "semaphore_file",
    "semaphore_name",
    "shard_name",
]

SHM_DIR: Final = "/dev/shm"
MAGIC: Final = int.from_bytes(b"AIOSHMC1", "little")
LAYOUT_VERSION: Final = 4  # 3: the key-hint region (H_HINT_OFF, H_HINT_SLOTS); 4: H_GROUP
HEADER_SIZE: Final = 4096
PAGE: Final = 4096

# --- segment header words ---------------------------------------------------------------------
H_MAGIC, H_VERSION, H_HEADER_SIZE, H_CAPACITY, H_MAX_OBJECT, H_N_READERS = 0, 1, 2, 3, 4, 5
H_READER_OFF, H_SLOT_SIZE, H_RING_OFF, H_NONCE, H_WRITER_PID, H_EPOCH = 6, 7, 8, 9, 10, 11
H_OWNER_UID, H_DELIVERY, H_NEXT_ID, H_WAITING, H_LOG_ENTRIES, H_TOTAL = 12, 13, 14, 15, 16, 17
H_CREATED, H_STATE = 18, 19
H_HITS, H_MISSES, H_INLINE_LARGE, H_INLINE_FULL, H_EVICTIONS, H_BYTES_USED, H_ITEMS = (
    20,
    21,
    22,
    23,
    24,
    25,
    26,
)
H_HANDOUT_TTL_MS: Final = 27
H_SECRET: Final = 28
H_HEAD_POS: Final = 29
H_HINT_OFF: Final = 30
H_HINT_SLOTS: Final = 31
H_SIBLING_HITS: Final = 32
H_RELOCATIONS: Final = 33
H_BYTES_RELOCATED: Final = 34
#: a group shard's proof of membership (``group_word``); 0 in a plain cache
H_GROUP: Final = 35
#: words ``H_PAST .. H_PAST + PAST_NONCES - 1``: the nonces of the dead writers this segment name
#: was reclaimed from, latest first (zeros: none; a segment of an older build reads as none)
H_PAST: Final = 48
PAST_NONCES: Final = 16

STATE_LIVE: Final = 1
STATE_CLOSED: Final = 2
DELIVERY_CODES: Final = {"broadcast": 0, "one_of_n": 1}

# --- reader slot words ------------------------------------------------------------------------
SLOT_HEADER: Final = 128  # two cache lines: reader-written words, then writer-written words
RS_SESSION, RS_PID, RS_HEAD, RS_START, RS_ATTACHED = 0, 1, 2, 3, 4
WS_CONSUMED, WS_REVOKED, WS_OWED, WS_SESSION = 8, 9, 10, 11
LOG_ENTRY_BYTES: Final = 16  # (chunk id, seq)

# --- key hint slots (group shards) -------------------------------------------------------------
HINT_SLOT_SIZE: Final = 64
HS_SEQ, HS_D0, HS_D1, HS_EPOCH, HS_ADDRESS, HS_ID, HS_LENGTH, HS_POSITION = range(8)
MAX_HINT_SLOTS: Final = 1 << 22

# --- chunk header -----------------------------------------------------------------------------
CHUNK_HEADER: Final = 64
CHUNK_MAGIC: Final = 0x9E3779B97F4A7C15
C_ID, C_LENGTH, C_STATE, C_CHECK = 0, 1, 2, 3
WRITING, COMMITTED, FREED, DEAD = 1, 2, 3, 4
MAX_CHUNK_ID: Final = (1 << 64) - 2


def chunk_size(payload: int) -> int:
    """Bytes a chunk with ``payload`` bytes occupies in the ring."""
    return CHUNK_HEADER + (payload + 63) // 64 * 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Layout:
    """Offsets derived from the configuration; identical in writer and readers."""

    __slots__ = (
        "capacity",
        "hint_off",
        "hint_slots",
        "log_entries",
        "n_readers",
        "reader_off",
        "ring_off",
        "slot_size",
        "total",
    )

    def __init__(
        self, capacity: int, n_readers: int, log_entries: int, hint_slots: int = 0
    ) -> None:
        self.capacity = _align(capacity, 64)
        self.n_readers = n_readers
        self.log_entries = log_entries
        self.slot_size = _align(SLOT_HEADER + LOG_ENTRY_BYTES * log_entries, 64)
        self.reader_off = HEADER_SIZE
        self.hint_slots = hint_slots
        self.hint_off = _align(self.reader_off + n_readers * self.slot_size, 64)
        self.ring_off = _align(self.hint_off + hint_slots * HINT_SLOT_SIZE, PAGE)
        self.total = _align(self.ring_off + self.capacity, PAGE)


def hint_slots_for(capacity: int) -> int:
    """The key-hint slots of a shard of ``capacity`` ring bytes: a power of two, about one per
    4 KiB of ring (64 bytes each: 1.6% of the ring; a shard full of items of 16 KiB or more
    fills at most a quarter of them), at least 1024 and at most ``MAX_HINT_SLOTS``."""
    want = min(max(capacity // 4096, 1024), MAX_HINT_SLOTS)
    return 1 << (want - 1).bit_length()


# --- names ------------------------------------------------------------------------------------
SEGMENT_PREFIX: Final = "aioshm-"
SEMAPHORE_FILE_PREFIX: Final = "sem."  # how glibc stores POSIX semaphores in /dev/shm
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
#: a group name: no ``.`` (the shard suffix starts with one) and room for the suffix
_GROUP_RE: Final = re.compile(r"[A-Za-z0-9_\-]{1,180}")
_SHARD_RE: Final = re.compile(r"aioshm-([A-Za-z0-9_\-]{1,180})\.shard(0|[1-9][0-9]{0,2})")
#: shards a group can have (writer processes at once)
MAX_SHARDS: Final = 64
_BUILDING_RE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,200}\.new-[0-9a-f]{8}")
_SEM_FILE_RE: Final = re.compile(r"sem\.(aioshm-[A-Za-z0-9_.\-]{0,193})\.([0-9a-f]{8})\.wake")


def segment_name(name: str) -> str:
    """Normalise a user name to a segment name under /dev/shm (``aioshm-<name>``).

    ``ValueError`` for anything but 1-200 letters, digits, ``_``, ``.`` and ``-`` (a trailing
    newline included: the whole name must match).
    """
    if not isinstance(name, str):
        raise TypeError(f"segment name must be a str, not {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not bare.startswith(SEGMENT_PREFIX):
        bare = SEGMENT_PREFIX + bare
    if _NAME_RE.fullmatch(bare) is None:
        raise ValueError(f"invalid segment name {name!r}: use letters, digits, '_', '.', '-'")
    return bare


def check_group(group: str) -> str:
    """``group`` if it is a valid cache-group name (1-180 letters, digits, ``_``, ``-``)."""
    if not isinstance(group, str):
        raise TypeError(f"group name must be a str, not {type(group).__name__}")
    if _GROUP_RE.fullmatch(group) is None:
        raise ValueError(
            f"invalid group name {group!r}: use 1-180 letters, digits, '_', '-' (no '.')"
        )
    return group


def group_word(group: str) -> int:
    """The ``H_GROUP`` word of a shard of ``group``: a 64-bit digest of its name, never 0."""
    digest = hashlib.blake2b(check_group(group).encode(), digest_size=8, person=b"aioshm-g")
    return int.from_bytes(digest.digest(), "little") | 1


def shard_name(group: str, k: int) -> str:
    """The segment name of shard ``k`` of cache group ``group``."""
    if not 0 <= k < MAX_SHARDS:
        raise ValueError(f"shard index {k} out of range [0, {MAX_SHARDS})")
    return f"{SEGMENT_PREFIX}{check_group(group)}.shard{k}"


def parse_shard_name(filename: str) -> tuple[str, int] | None:
    """``(group, k)`` of a shard segment name (``aioshm-G.shard<k>``), or None."""
    m = _SHARD_RE.fullmatch(filename)
    if m is None or int(m.group(2)) >= MAX_SHARDS:
        return None
    return m.group(1), int(m.group(2))


def building_name(segment: str, token: str) -> str:
    """The name a reclaimer builds segment ``segment``'s replacement under (``token``: 8 hex
    digits), until it renames it over the dead one (see ``_segment``)."""
    return f"{segment}.new-{token}"


def is_segment_file(filename: str) -> bool:
    """Whether a /dev/shm entry has the shape of a segment of ours (or of one being built)."""
    return filename.startswith(SEGMENT_PREFIX) and (
        _NAME_RE.fullmatch(filename) is not None or _BUILDING_RE.fullmatch(filename) is not None
    )


def semaphore_name(segment: str, nonce: int) -> str:
    """The POSIX name of the wake-up semaphore of segment ``segment`` (instance ``nonce``)."""
    return f"/{segment}.{nonce & 0xFFFFFFFF:08x}.wake"


def semaphore_file(segment: str, nonce: int) -> str:
    """The /dev/shm file name under which Linux keeps :func:`semaphore_name`."""
    return SEMAPHORE_FILE_PREFIX + semaphore_name(segment, nonce)[1:]


def parse_semaphore_file(filename: str) -> tuple[str, int] | None:
    """``(segment, nonce low 32 bits)`` of a wake-semaphore file in /dev/shm, or None."""
    m = _SEM_FILE_RE.fullmatch(filename)
    if m is None:
        return None
    return m.group(1), int(m.group(2), 16)
