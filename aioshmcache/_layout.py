"""The byte layout of a segment, in one place: header words, reader slots, chunks and names.

Every word is a native unsigned 64-bit integer written with one aligned store (a word has exactly
one writing process; see ``_readers``). Word indices are named by where they live:
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
    4096     +--------------------------------------------------+
             | reader table: H_N_READERS slots x H_SLOT_SIZE    |
    ring_off +--------------------------------------------------+  (page aligned)
             | ring: H_CAPACITY bytes of chunks                 |
             +--------------------------------------------------+

Reader slot (``slot_size`` bytes: SLOT_HEADER, then the acknowledgement log)::

    +0    words written by the reader        +64   words written by the writer
          0 RS_SESSION (0: free)                   8 WS_CONSUMED (acks the writer has read)
          1 RS_PID (information only)              9 WS_REVOKED (the revoked session)
          2 RS_HEAD (acks written)                10 WS_OWED (hand-outs not acknowledged)
          3 RS_START (head at attach)
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

Kernel locks (OFD byte-range locks on the segment file): byte 0 is the writer's, byte ``1 + i``
reader slot ``i``'s.

Names: a segment is ``/dev/shm/aioshm-<name>``; its wake-up semaphore is the POSIX semaphore
``/<segment>.<nonce low 32 bits, 8 hex digits>.wake``, which Linux keeps as
``/dev/shm/sem.<segment>.<nonce>.wake``. Both are built and parsed only here.
"""

from __future__ import annotations

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
    "is_segment_file",
    "parse_semaphore_file",
    "segment_name",
    "semaphore_file",
    "semaphore_name",
]

SHM_DIR: Final = "/dev/shm"
MAGIC: Final = int.from_bytes(b"AIOSHMC1", "little")
LAYOUT_VERSION: Final = 2
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

STATE_LIVE: Final = 1
STATE_CLOSED: Final = 2
DELIVERY_CODES: Final = {"broadcast": 0, "one_of_n": 1}

# --- reader slot words ------------------------------------------------------------------------
SLOT_HEADER: Final = 128  # two cache lines: reader-written words, then writer-written words
RS_SESSION, RS_PID, RS_HEAD, RS_START, RS_ATTACHED = 0, 1, 2, 3, 4
WS_CONSUMED, WS_REVOKED, WS_OWED = 8, 9, 10
LOG_ENTRY_BYTES: Final = 16  # (chunk id, seq)

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
        "log_entries",
        "n_readers",
        "reader_off",
        "ring_off",
        "slot_size",
        "total",
    )

    def __init__(self, capacity: int, n_readers: int, log_entries: int) -> None:
        self.capacity = _align(capacity, 64)
        self.n_readers = n_readers
        self.log_entries = log_entries
        self.slot_size = _align(SLOT_HEADER + LOG_ENTRY_BYTES * log_entries, 64)
        self.reader_off = HEADER_SIZE
        self.ring_off = _align(self.reader_off + n_readers * self.slot_size, PAGE)
        self.total = _align(self.ring_off + self.capacity, PAGE)


# --- names ------------------------------------------------------------------------------------
SEGMENT_PREFIX: Final = "aioshm-"
SEMAPHORE_FILE_PREFIX: Final = "sem."  # how glibc stores POSIX semaphores in /dev/shm
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
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


def is_segment_file(filename: str) -> bool:
    """Whether a /dev/shm entry has the shape of a segment of ours."""
    return filename.startswith(SEGMENT_PREFIX) and _NAME_RE.fullmatch(filename) is not None


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
