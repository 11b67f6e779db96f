"""Layer 1: a named POSIX shared-memory segment with a fixed header and kernel-tracked owner.

Layout of the segment (all words are native 8-byte unsigned, written with one aligned store)::

    0        +-------------------------------------------+
             | segment header (4096 bytes, word index):  |
             |  0 magic "AIOSHMC1"   1 layout version    |
             |  2 header size        3 ring capacity     |
             |  4 max object bytes   5 reader slots      |
             |  6 reader table off   7 reader slot size  |
             |  8 ring offset        9 nonce (random)    |
             | 10 writer pid        11 epoch             |
             | 12 owner uid         13 delivery mode     |
             | 14 next chunk id     15 writer waiting    |
             | 16 ack log entries   17 total size        |
             | 18 created (ns)      19 state (live/closed)|
             | 20..27 writer-published statistics        |
             | 28 reference tag secret                   |
             | 29 head position (reuse fence, ``_ring``) |
    4096     +-------------------------------------------+
             | reader table: n slots x slot size         |  (layer 3, ``_readers``)
    ring_off +-------------------------------------------+
             | ring: capacity bytes of chunks            |  (layer 2, ``_ring``)
             +-------------------------------------------+

Creation uses ``O_CREAT | O_EXCL``, mode 0600, reserves every page with ``posix_fallocate`` (a
too-small /dev/shm is an ``ShmSpaceError`` now, never a SIGBUS later) and prefaults the mapping.
Attaching uses ``os.open`` + ``mmap`` directly (``multiprocessing.shared_memory`` would register
the segment with the resource tracker, which unlinks it when an attaching process exits) and
verifies magic, layout version, owner uid and, when a handle is given, the nonce.

Liveness is proven with OFD byte-range locks (``F_OFD_SETLK``), which the kernel releases when the
holder dies, SIGKILL included: byte 0 is the writer's, byte ``1 + i`` reader slot ``i``'s. File
descriptors are opened ``O_CLOEXEC`` and closed in forked children (``os.register_at_fork``) so
that a child never keeps a dead parent looking alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import stat
import struct
import time
import weakref
from typing import Final

from ._types import SEGMENT_PREFIX, segment_name
from .errors import (
    ClosedCacheError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmCacheError,
    ShmSpaceError,
)

__all__ = ["SHM_DIR", "Segment", "Layout", "ofd_lock", "ofd_probe"]

SHM_DIR: Final = "/dev/shm"
MAGIC: Final = int.from_bytes(b"AIOSHMC1", "little")
LAYOUT_VERSION: Final = 2
HEADER_SIZE: Final = 4096
PAGE: Final = 4096

# header word indices
W_MAGIC, W_VERSION, W_HEADER_SIZE, W_CAPACITY, W_MAX_OBJECT, W_N_READERS = 0, 1, 2, 3, 4, 5
W_READER_OFF, W_SLOT_SIZE, W_RING_OFF, W_NONCE, W_WRITER_PID, W_EPOCH = 6, 7, 8, 9, 10, 11
W_OWNER_UID, W_DELIVERY, W_NEXT_ID, W_WAITING, W_LOG_ENTRIES, W_TOTAL = 12, 13, 14, 15, 16, 17
W_CREATED, W_STATE = 18, 19
# writer-published statistics (for ``inspect`` from another process)
W_HITS, W_MISSES, W_INLINE_LARGE, W_INLINE_FULL, W_EVICTIONS, W_BYTES_USED, W_ITEMS = (
    20,
    21,
    22,
    23,
    24,
    25,
    26,
)
W_HANDOUT_TTL_MS = 27
W_SECRET = 28  # keys the reference tag (see ``_types.ShmRef``)
W_HEAD_POS = 29  # ring position of the oldest live chunk: every byte before it may be reused

STATE_LIVE: Final = 1
STATE_CLOSED: Final = 2
DELIVERY_CODES: Final = {"broadcast": 0, "one_of_n": 1}

SLOT_HEADER: Final = 128  # two cache lines: reader-written words, then writer-written words

_F_OFD_GETLK: Final = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK: Final = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64 / aarch64 Linux (32 bytes)
_MADV_POPULATE_READ: Final = 22
_MADV_POPULATE_WRITE: Final = 23


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def ofd_lock(fd: int, byte: int, *, exclusive: bool = True) -> bool:
    """Take a non-blocking OFD lock on one byte; False if another open file holds it."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ofd_unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def ofd_probe(fd: int, byte: int) -> bool:
    """True when some *other* open file description holds a lock on ``byte`` (its owner lives)."""
    res = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    kind: int = _FLOCK.unpack(res)[0]
    return kind != fcntl.F_UNLCK


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
        self.slot_size = _align(SLOT_HEADER + 16 * log_entries, 64)  # (id, seq) per entry
        self.reader_off = HEADER_SIZE
        self.ring_off = _align(self.reader_off + n_readers * self.slot_size, PAGE)
        self.total = _align(self.ring_off + self.capacity, PAGE)


_open_segments: weakref.WeakSet[Segment] = weakref.WeakSet()


def _close_fds_in_child() -> None:
    for seg in list(_open_segments):
        seg._forget_fd_after_fork()


os.register_at_fork(after_in_child=_close_fds_in_child)


class Segment:
    """A mapped segment: its header words, the whole buffer, and the fd that carries our locks."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self._fd = fd
        self._mmap = mm
        self.buf = memoryview(mm)
        self.words = self.buf[:HEADER_SIZE].cast("Q")
        self.owner = owner
        self.pid = os.getpid()
        self.closed = False
        self.forked = False
        _open_segments.add(self)

    # --- creation and attachment -------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str | None,
        layout: Layout,
        *,
        max_object_bytes: int,
        delivery: str,
        handout_ttl: float,
        prefault: bool = True,
    ) -> Segment:
        """Create, reserve, prefault and lock a new segment; nothing is left behind on failure."""
        full = segment_name(name) if name is not None else SEGMENT_PREFIX + secrets.token_hex(8)
        path = os.path.join(SHM_DIR, full)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise SegmentExistsError(
                errno.EEXIST, f"segment {full!r} already exists", path
            ) from None
        mm: mmap.mmap | None = None
        try:
            if not ofd_lock(fd, 0):  # cannot fail on a file we just created, but never assume
                raise SegmentExistsError(errno.EEXIST, f"segment {full!r} has a writer", path)
            try:
                os.posix_fallocate(fd, 0, layout.total)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    free = os.statvfs(SHM_DIR)
                    raise ShmSpaceError(
                        errno.ENOSPC,
                        f"not enough space in {SHM_DIR} for segment {full!r}: need "
                        f"{layout.total} bytes, {free.f_bavail * free.f_frsize} available",
                    ) from None
                raise
            mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if prefault:
                _prefault(mm, write=True)
            seg = cls(full, fd, mm, owner=True)
            w = seg.words
            w[W_VERSION] = LAYOUT_VERSION
            w[W_HEADER_SIZE] = HEADER_SIZE
            w[W_CAPACITY] = layout.capacity
            w[W_MAX_OBJECT] = max_object_bytes
            w[W_N_READERS] = layout.n_readers
            w[W_READER_OFF] = layout.reader_off
            w[W_SLOT_SIZE] = layout.slot_size
            w[W_RING_OFF] = layout.ring_off
            w[W_NONCE] = secrets.randbits(64) | 1
            w[W_SECRET] = secrets.randbits(64)
            w[W_WRITER_PID] = os.getpid()
            w[W_EPOCH] = 1
            w[W_OWNER_UID] = os.getuid()
            w[W_DELIVERY] = DELIVERY_CODES[delivery]
            w[W_NEXT_ID] = 1
            w[W_LOG_ENTRIES] = layout.log_entries
            w[W_TOTAL] = layout.total
            w[W_CREATED] = time.time_ns()
            w[W_HANDOUT_TTL_MS] = int(handout_ttl * 1000)
            w[W_STATE] = STATE_LIVE
            w[W_MAGIC] = MAGIC  # last: a reader that sees the magic sees a complete header
            return seg
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise

    @classmethod
    def attach(cls, name: str, *, nonce: int | None = None, populate: bool = True) -> Segment:
        """Map an existing segment as a reader, verifying that it is ours and intact."""
        full = segment_name(name)
        path = os.path.join(SHM_DIR, full)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise SegmentNotFoundError(errno.ENOENT, f"no segment {full!r}", path) from None
        mm: mmap.mmap | None = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ShmCacheError(f"segment {full!r} is not a regular file owned by this user")
            if st.st_size < HEADER_SIZE:
                raise SegmentNotFoundError(errno.ENOENT, f"{full!r} is not an aioshmcache segment")
            head = os.pread(fd, HEADER_SIZE, 0)
            hw = memoryview(head).cast("Q")
            if hw[W_MAGIC] != MAGIC:
                raise SegmentNotFoundError(
                    errno.ENOENT, f"{full!r} is not an aioshmcache segment (or not yet initialised)"
                )
            if hw[W_VERSION] != LAYOUT_VERSION:
                raise ShmCacheError(
                    f"{full!r} has layout version {hw[W_VERSION]}, need {LAYOUT_VERSION}"
                )
            if hw[W_OWNER_UID] != os.getuid() or hw[W_TOTAL] != st.st_size:
                raise ShmCacheError(f"segment {full!r} has an inconsistent header")
            n, entries, cap = int(hw[W_N_READERS]), int(hw[W_LOG_ENTRIES]), int(hw[W_CAPACITY])
            if not (1 <= n <= 256 and 64 <= entries <= 1 << 24 and 4096 <= cap <= 1 << 46):
                raise ShmCacheError(f"segment {full!r} has an inconsistent header")
            expect = Layout(cap, n, entries)
            if (
                expect.capacity != cap
                or (expect.reader_off, expect.slot_size, expect.ring_off, expect.total)
                != (hw[W_READER_OFF], hw[W_SLOT_SIZE], hw[W_RING_OFF], hw[W_TOTAL])
                or int(hw[W_MAX_OBJECT]) + 64 > cap
            ):
                raise ShmCacheError(f"segment {full!r} has an inconsistent layout")
            if nonce is not None and hw[W_NONCE] != nonce:
                raise SegmentNotFoundError(
                    errno.ENOENT, f"segment {full!r} is another instance than the handle names"
                )
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if populate:
                _prefault(mm, write=False)
            return cls(full, fd, mm, owner=False)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise

    # --- accessors -----------------------------------------------------------------------
    @property
    def fd(self) -> int:
        if self.closed:
            raise ClosedCacheError(f"segment {self.name!r} is closed")
        return self._fd

    @property
    def nonce(self) -> int:
        return int(self.words[W_NONCE])

    def writer_alive(self) -> bool:
        """Kernel truth: does any process hold the writer's lock (and has it not closed)?"""
        if self.forked or self.words[W_STATE] != STATE_LIVE:
            return False
        if self.owner:
            return True
        return ofd_probe(self.fd, 0)

    def _forget_fd_after_fork(self) -> None:
        # The child must not keep the parent's locks alive: close its copy of the fd (the open
        # file description and its locks live on in the parent). The mapping stays usable.
        if not self.closed and not self.forked:
            self.forked = True
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Unmap and close; idempotent. The owner also unlinks the name."""
        if self.closed:
            return
        if self.owner and not self.forked:
            self.words[W_STATE] = STATE_CLOSED
            self.unlink()
        self.closed = True
        _open_segments.discard(self)
        with contextlib.suppress(BufferError):
            self.words.release()
            self.buf.release()
            # views still exported (a zero-copy array kept alive) keep the mapping; the kernel
            # frees it when the last one goes
            self._mmap.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


def _prefault(mm: mmap.mmap, *, write: bool) -> None:
    """Fault every page in now so that the first put runs at warm-copy speed."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
    except OSError:
        if write:  # kernels before 5.14: touch one byte per page
            import numpy as np

            arr = np.frombuffer(mm, dtype=np.uint8)
            arr[::PAGE] = 0
            del arr


def list_segments() -> list[str]:
    """Names of every ``aioshm-`` segment in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []
