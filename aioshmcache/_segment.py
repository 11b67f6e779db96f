"""Layer 1: a named POSIX shared-memory segment with a fixed header and kernel-tracked owner.

The byte layout (header words, reader slots, chunks) and the names are in ``_layout``.

Creation uses ``O_CREAT | O_EXCL``, mode 0600, reserves every page with ``posix_fallocate`` (a
too-small /dev/shm is an ``ShmSpaceError`` now, never a SIGBUS later) and prefaults the mapping.
Attaching uses ``os.open`` + ``mmap`` directly (``multiprocessing.shared_memory`` would register
the segment with the resource tracker, which unlinks it when an attaching process exits) and
verifies magic, layout version, owner uid and, when a handle is given, the nonce.

Liveness is proven with OFD byte-range locks (``F_OFD_SETLK``), which the kernel releases when the
holder dies, SIGKILL included: byte 0 is the writer's, byte ``1 + i`` reader slot ``i``'s.

**Removing a dead writer's file** (``sweep``, a restart that reclaims its name) races with the
others that do the same and with restarts that put a new file under the name. The rule: only
the very file judged dead is ever unlinked. A remover opens the file, takes its *remover lock*
(byte :data:`REMOVER_BYTE`, far past every other lock), judges it (nobody holds the writer's
byte 0), then, still holding the remover lock, checks that the name still leads to that file
(device and inode) and unlinks it. Another remover of the same file cannot get in between (it
waits for the remover lock, or finds the file gone), and nobody else unlinks a dead writer's
file, so the name cannot be given to a new file between the check and the unlink. The remover
lock is not byte 0: a writer's liveness is probed on byte 0, and a remover must never look
like a live writer (a restart would then refuse the name).

**A restart replaces a dead writer's file in one step.** A name that no file holds is created in
place (``O_EXCL`` decides a race; no reference of any instance can name it). A name whose writer
is provably dead is *reclaimed*: under the dead file's remover lock (and its *reclaimer lock*,
byte :data:`RECLAIMER_BYTE`, which tells another restart of the name that a new writer is on its
way), the new segment is made whole under a name of its own (``_layout.building_name``: space
reserved, prefaulted, writer lock held, header complete with the dead instances it replaces),
then ``rename(2)``-d over the dead file, which the remover lock proves is still the one judged.
So a reader that looks up the name at any instant finds the dead file or the whole new one,
which names the dead instance: never no file, nor a header not yet written (a group reader
that never saw the dead instance would take its references for forged ones). A build whose
process died is an orphan under its own name (``sweep``, or the next reclaim of the name,
removes it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Callable
from typing import Final, NamedTuple

from ._layout import (
    DELIVERY_CODES,
    H_CAPACITY,
    H_CREATED,
    H_DELIVERY,
    H_EPOCH,
    H_HANDOUT_TTL_MS,
    H_HEADER_SIZE,
    H_HINT_OFF,
    H_HINT_SLOTS,
    H_LOG_ENTRIES,
    H_MAGIC,
    H_MAX_OBJECT,
    H_N_READERS,
    H_NEXT_ID,
    H_NONCE,
    H_OWNER_UID,
    H_PAST,
    H_READER_OFF,
    H_RING_OFF,
    H_SECRET,
    H_SLOT_SIZE,
    H_STATE,
    H_TOTAL,
    H_VERSION,
    H_WRITER_PID,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_HINT_SLOTS,
    PAGE,
    PAST_NONCES,
    SEGMENT_PREFIX,
    SHM_DIR,
    STATE_CLOSED,
    STATE_LIVE,
    Layout,
    building_name,
    is_segment_file,
    parse_semaphore_file,
    parse_shard_name,
    segment_name,
    semaphore_file,
)
from .errors import (
    ClosedCacheError,
    RoleError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmCacheError,
    ShmSpaceError,
)

__all__ = [
    "RECLAIMER_BYTE",
    "REMOVER_BYTE",
    "Segment",
    "WriterState",
    "list_segments",
    "list_semaphores",
    "list_shards",
    "ofd_lock",
    "ofd_probe",
    "ofd_unlock",
    "remove_orphan",
    "writer_state",
]

log = logging.getLogger("aioshmcache")

_F_OFD_GETLK: Final = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK: Final = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64 / aarch64 Linux (32 bytes)
_MADV_POPULATE_READ: Final = 22
_MADV_POPULATE_WRITE: Final = 23


def ofd_lock(fd: int, byte: int) -> bool:
    """Take a non-blocking exclusive OFD lock on one byte; False if another open file holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ofd_unlock(fd: int, byte: int) -> None:
    """Drop this open file description's lock on one byte."""
    fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def ofd_probe(fd: int, byte: int) -> bool:
    """True when some *other* open file description holds a lock on ``byte`` (its owner lives)."""
    res = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    kind: int = _FLOCK.unpack(res)[0]
    return kind != fcntl.F_UNLCK


_open_segments: weakref.WeakSet[Segment] = weakref.WeakSet()


def _close_lock_fds_in_child() -> None:
    for seg in list(_open_segments):
        seg.forget_after_fork()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)

_OPEN_FLAGS: Final = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_SPACE_ERRNOS: Final = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM)
#: a segment without its magic yet may be in the microseconds between ``open`` and the writer's
#: lock: only one older than this is an orphan of a creation that died
CREATION_GRACE: Final = 10.0
#: the lock byte held by whoever removes a dead writer's file (see the module docstring)
REMOVER_BYTE: Final = 1 << 62
#: held with it by a restart that replaces the dead file with its own (see the module docstring)
RECLAIMER_BYTE: Final = REMOVER_BYTE + 1
#: how long a restart waits for another process that is removing the dead file under its name
#: (a removal holds its lock for microseconds; this only bounds a stalled one)
REMOVAL_WAIT: Final = 5.0


def _typed(exc: OSError, full: str, path: str, doing: str) -> ShmCacheError:
    """The typed error for an ``OSError`` met while attaching to or creating ``full``.

    A symbolic link (``ELOOP`` under ``O_NOFOLLOW``), a directory or a file we may not open is
    not a segment of ours under that name: ``SegmentNotFoundError``, the same answer as for a
    file without our magic, so that a caller that handles "no such cache" handles it too.
    """
    no = exc.errno
    if no == errno.ENOENT:
        return SegmentNotFoundError(no, f"no segment {full!r}", path)
    if no == errno.ELOOP:
        return SegmentNotFoundError(
            no, f"{path} is a symbolic link, not a segment (links are never followed)", path
        )
    if no in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENXIO, errno.ENODEV):
        return SegmentNotFoundError(
            no, f"{path} is not a segment this user can use ({exc.strerror})", path
        )
    if no == errno.EEXIST:
        return SegmentExistsError(no, f"segment {full!r} already exists", path)
    if no in _SPACE_ERRNOS:
        return ShmSpaceError(no, f"no room to {doing} segment {full!r}: {exc.strerror}", path)
    return ShmCacheError(f"cannot {doing} segment {full!r}: {exc}")


def _open_lock_fd(fd: int) -> int:
    """A second open file description of the file behind ``fd``, for the kernel locks only.

    It is never mapped: a forked child that closes its copy (see ``forget_after_fork``) drops
    every reference it had to it, while the mapping keeps its own open file description alive.
    Re-opening through ``/proc/self/fd`` guarantees the same file, never a replacement.
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


class WriterState(NamedTuple):
    """What a segment file says about its writer, read from outside (sweep, reclaim)."""

    exists: bool
    ours: bool  # a regular file of this user
    initialised: bool  # our magic and layout version
    alive: bool  # some open file description holds the writer lock
    pid: int
    nonce: int | None
    old: bool  # older than CREATION_GRACE
    past: tuple[int, ...] = ()  # nonces of the dead writers this name was reclaimed from

    @property
    def lineage(self) -> tuple[int, ...]:
        """Every writer instance this name has held, this one first (newest to oldest)."""
        return ((self.nonce,) if self.nonce is not None else ()) + self.past

    @property
    def orphan(self) -> bool:
        """Provably without a writer, and ours to remove."""
        return self.exists and self.ours and not self.alive and (self.initialised or self.old)


def _state_of(fd: int) -> WriterState:
    """The state of the segment file open as ``fd``.

    The header is read *before* the writer's lock is probed: a writer takes its lock before it
    writes the magic, so a magic seen first and a lock found free next mean a dead writer. The
    other order would take a writer that locked and wrote its header between the two reads for
    a dead one (and ``sweep`` would remove a segment just born).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return WriterState(True, False, False, False, 0, None, False)
    words = H_PAST + PAST_NONCES
    head = os.pread(fd, 8 * words, 0)
    alive = ofd_probe(fd, 0)
    init = False
    pid, nonce = 0, None
    past: tuple[int, ...] = ()
    if len(head) == 8 * words:
        hw = memoryview(head).cast("Q")
        init = hw[H_MAGIC] == MAGIC and hw[H_VERSION] == LAYOUT_VERSION
        if init:
            pid, nonce = int(hw[H_WRITER_PID]), int(hw[H_NONCE])
            past = tuple(int(n) for n in hw[H_PAST:words] if n)
    old = time.time() - st.st_mtime > CREATION_GRACE
    return WriterState(True, True, init, alive, pid, nonce, old, past)


def writer_state(path: str) -> WriterState:
    """Probe the segment file at ``path`` (never follows a link)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return WriterState(False, False, False, False, 0, None, False)
    except OSError:
        return WriterState(True, False, False, False, 0, None, False)
    try:
        return _state_of(fd)
    finally:
        os.close(fd)


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` (never followed) names the very file open as ``fd``."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def remove_orphan(path: str, *, dry_run: bool = False) -> bool:
    """Unlink the segment file at ``path`` if it is an orphan, and only that very file.

    True when it was removed (``dry_run``: when it would be). False when it is not an orphan
    (a live writer, another user's file, a creation still in its grace time), is gone, or is
    being removed by another process right now (which holds its remover lock).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return False  # gone, or not a file of ours to open: never an orphan of ours
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False  # not a segment of ours: not even locked
        if not ofd_lock(fd, REMOVER_BYTE):
            return False  # another sweep or a restart is removing this file now
        if not _state_of(fd).orphan:
            return False
        if dry_run:
            return True
        if not _same_file(path, fd):
            return False  # replaced since we opened it: the new file was not judged
        try:
            os.unlink(path)  # still holding the remover lock: the name still leads to this file
        except FileNotFoundError:
            return False  # removed by hand meanwhile
        return True
    finally:
        os.close(fd)  # drops the remover lock


def _remove_dead_builds(full: str) -> None:
    """Remove the orphans of builds of ``full``'s replacement whose process died (their own
    names; only provably dead ones, as ``sweep`` would)."""
    start = building_name(full, "")
    with contextlib.suppress(OSError):
        for n in os.listdir(SHM_DIR):
            if n.startswith(start) and is_segment_file(n):
                remove_orphan(os.path.join(SHM_DIR, n))


def _reclaim(
    full: str, path: str, *, allowed: bool, build: Callable[[int, str, tuple[int, ...]], Segment]
) -> Segment | None:
    """Replace the segment at ``path`` with a new one if its writer is provably dead, or say
    why not.

    Provably dead: a regular file of this user, with our magic and layout version, whose writer
    lock nobody holds. The new segment is built by ``build(fd, file, past)`` under a name of its
    own, whole, then renamed over the dead file under that file's remover lock, and only if the
    name still leads to it (see the module docstring): so two writers restarting at once, or a
    restart and a ``sweep``, never replace each other's new file, and a reader sees the dead
    file or the new one. ``past`` is the dead segment's lineage (its nonce, then its own past
    ones), which the new segment records, so that a late reference of a dead instance is known
    as such (``WriterGoneError``) by a reader that never saw that instance (a group's reader).
    The wake semaphore goes too. Returns the new segment; None when the file went meanwhile or
    a sweep is removing it right now (try again).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None  # gone meanwhile: just create
    except OSError as exc:
        raise SegmentExistsError(
            errno.EEXIST, f"{path} exists and is not a segment of ours ({exc.strerror})", path
        ) from None
    try:
        if not ofd_lock(fd, REMOVER_BYTE):
            if ofd_probe(fd, RECLAIMER_BYTE):
                raise SegmentExistsError(
                    errno.EEXIST, f"segment {full!r} is being reclaimed by another writer", path
                )
            return None  # a sweep is removing it: wait for it
        st = _state_of(fd)
        if not st.ours:
            raise SegmentExistsError(
                errno.EEXIST, f"{path} exists and is not a segment of this user", path
            )
        if st.alive:
            pid = f"pid {st.pid}" if st.pid else "a process still creating it"
            raise SegmentExistsError(
                errno.EEXIST, f"segment {full!r} exists and its writer ({pid}) is alive", path
            )
        if not st.initialised:
            raise SegmentExistsError(
                errno.EEXIST,
                f"{path} exists without a complete aioshmcache header of layout "
                f"{LAYOUT_VERSION}; remove it with sweep(name=...) once it is stale",
                path,
            )
        if not allowed:
            raise SegmentExistsError(
                errno.EEXIST,
                f"segment {full!r} already exists; its writer (pid {st.pid}) is dead: "
                "remove it with sweep(name=...) or create with reclaim_dead=True",
                path,
            )
        ofd_lock(fd, RECLAIMER_BYTE)  # another restart of the name now gives way at once
        _remove_dead_builds(full)
        tmp = os.path.join(SHM_DIR, building_name(full, secrets.token_hex(4)))
        try:
            new_fd = os.open(tmp, os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        except OSError as exc:
            raise _typed(exc, full, tmp, "create") from None
        seg = build(new_fd, tmp, st.lineage[:PAST_NONCES])  # removes ``tmp`` if it fails
        try:
            if not _same_file(path, fd):
                seg.close()  # removed (and maybe replaced) meanwhile: try to create again
                os.unlink(tmp)
                return None
            os.rename(tmp, path)  # under the remover lock: still the file judged
        except BaseException:
            seg.close()  # the name does not lead to it: nothing but ``tmp`` is removed
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if st.nonce is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, semaphore_file(full, st.nonce)))
        log.info("reclaimed segment %r of dead writer pid %d", full, st.pid)
        return seg
    finally:
        os.close(fd)


class Segment:
    """A mapped segment: its header words, the whole buffer, and the descriptor of its locks.

    The kernel locks (the writer's, a reader's slot) are held on ``fd``, an open file
    description of their own that is never mapped and is closed in a forked child; the mapping
    is made from another descriptor, closed at once (``mmap`` keeps its own).
    """

    # ``closed`` and ``forked`` are read by the compiled put at the slots' offsets (a look-up by
    # name in an instance dict costs ~150 instructions); ``__weakref__`` for ``_open_segments``
    __slots__ = (
        "__weakref__",
        "_fd",
        "_mmap",
        "buf",
        "closed",
        "forked",
        "layout",
        "name",
        "owner",
        "pid",
        "words",
    )

    def __init__(
        self, name: str, lock_fd: int, mm: mmap.mmap, *, owner: bool, layout: Layout
    ) -> None:
        self.name = name
        #: the geometry this segment was created with, or checked at attach against the header
        #: read then: the regions are sized and placed from it, never from the header words
        #: again (any process that maps the segment can rewrite them after the check)
        self.layout = layout
        self._fd = lock_fd
        self._mmap = mm
        self.buf = memoryview(mm)
        self.words = self.buf[:HEADER_SIZE].cast("Q")
        self.owner = owner
        self.pid = os.getpid()
        self.closed = False
        self.forked = False
        _open_segments.add(self)

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
        reclaim_dead: bool = False,
    ) -> Segment:
        """Create, reserve, prefault and lock a new segment; nothing is left behind on failure.

        ``SegmentExistsError`` if the name is taken, unless its writer is provably dead and
        ``reclaim_dead`` is set: then the new segment replaces the old one in one step (see the
        module docstring) and the old semaphore is removed.
        """
        full = segment_name(name) if name is not None else SEGMENT_PREFIX + secrets.token_hex(8)
        path = os.path.join(SHM_DIR, full)

        def build(fd: int, file: str, past: tuple[int, ...]) -> Segment:
            return cls._build(
                fd,
                full,
                file,
                layout,
                past=past,
                max_object_bytes=max_object_bytes,
                delivery=delivery,
                handout_ttl=handout_ttl,
                prefault=prefault,
            )

        deadline = time.monotonic() + REMOVAL_WAIT
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _typed(exc, full, path, "create") from None
            else:
                return build(fd, path, ())  # a name nobody holds: made in place
            if time.monotonic() > deadline:
                raise SegmentExistsError(
                    errno.EEXIST,
                    f"segment {full!r} is still being removed by another process "
                    f"after {REMOVAL_WAIT:g} s",
                    path,
                )
            try:
                seg = _reclaim(full, path, allowed=reclaim_dead, build=build)  # or raises why
            except OSError as exc:
                if isinstance(exc, ShmCacheError):
                    raise
                raise _typed(exc, full, path, "create") from None
            if seg is not None:
                return seg
            time.sleep(0.001)  # gone meanwhile, or a sweep is removing it: microseconds

    @classmethod
    def _build(
        cls,
        fd: int,
        full: str,
        file: str,
        layout: Layout,
        *,
        past: tuple[int, ...],
        max_object_bytes: int,
        delivery: str,
        handout_ttl: float,
        prefault: bool,
    ) -> Segment:
        """Make the file just created as ``fd`` (at ``file``) segment ``full``: the writer lock,
        the space, the prefault, the header (the magic last); closes ``fd``. On failure the
        file is removed and nothing is left behind."""
        lock_fd = -1
        mm: mmap.mmap | None = None
        try:
            lock_fd = _open_lock_fd(fd)
            if not ofd_lock(lock_fd, 0):  # cannot fail on a file we just created; never assume
                raise SegmentExistsError(errno.EEXIST, f"segment {full!r} has a writer", file)
            try:
                os.posix_fallocate(fd, 0, layout.total)
            except OSError as exc:
                if exc.errno in _SPACE_ERRNOS:
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
            seg = cls(full, lock_fd, mm, owner=True, layout=layout)
            w = seg.words
            w[H_VERSION] = LAYOUT_VERSION
            w[H_HEADER_SIZE] = HEADER_SIZE
            w[H_CAPACITY] = layout.capacity
            w[H_MAX_OBJECT] = max_object_bytes
            w[H_N_READERS] = layout.n_readers
            w[H_READER_OFF] = layout.reader_off
            w[H_SLOT_SIZE] = layout.slot_size
            w[H_RING_OFF] = layout.ring_off
            w[H_HINT_OFF] = layout.hint_off
            w[H_HINT_SLOTS] = layout.hint_slots
            w[H_NONCE] = secrets.randbits(64) | 1
            w[H_SECRET] = secrets.randbits(64)
            w[H_WRITER_PID] = os.getpid()
            w[H_EPOCH] = 1
            w[H_OWNER_UID] = os.getuid()
            w[H_DELIVERY] = DELIVERY_CODES[delivery]
            w[H_NEXT_ID] = 1
            w[H_LOG_ENTRIES] = layout.log_entries
            w[H_TOTAL] = layout.total
            w[H_CREATED] = time.time_ns()
            w[H_HANDOUT_TTL_MS] = int(handout_ttl * 1000)
            w[H_STATE] = STATE_LIVE
            for i, old_nonce in enumerate(past):
                w[H_PAST + i] = old_nonce
            w[H_MAGIC] = MAGIC  # last: a reader that sees the magic sees a complete header
            return seg
        except BaseException as exc:
            if mm is not None:
                mm.close()
            if lock_fd >= 0:
                os.close(lock_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)
            if isinstance(exc, OSError) and not isinstance(exc, ShmCacheError):
                raise _typed(exc, full, file, "create") from None
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str, *, nonce: int | None = None, populate: bool = True) -> Segment:
        """Map an existing segment as a reader, verifying that it is ours and intact."""
        full = segment_name(name)
        path = os.path.join(SHM_DIR, full)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise _typed(exc, full, path, "attach to") from None
        lock_fd = -1
        mm: mmap.mmap | None = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise SegmentNotFoundError(
                    errno.ENOENT, f"{path} is not a regular file owned by this user", path
                )
            if st.st_size < HEADER_SIZE:
                raise SegmentNotFoundError(errno.ENOENT, f"{full!r} is not an aioshmcache segment")
            head = os.pread(fd, HEADER_SIZE, 0)
            hw = memoryview(head).cast("Q")
            if hw[H_MAGIC] != MAGIC:
                raise SegmentNotFoundError(
                    errno.ENOENT, f"{full!r} is not an aioshmcache segment (or not yet initialised)"
                )
            if hw[H_VERSION] != LAYOUT_VERSION:
                raise ShmCacheError(
                    f"{full!r} has layout version {hw[H_VERSION]}, need {LAYOUT_VERSION}"
                )
            if hw[H_OWNER_UID] != os.getuid() or hw[H_TOTAL] != st.st_size:
                raise ShmCacheError(f"segment {full!r} has an inconsistent header")
            n, entries, cap = int(hw[H_N_READERS]), int(hw[H_LOG_ENTRIES]), int(hw[H_CAPACITY])
            hints = int(hw[H_HINT_SLOTS])
            if not (
                1 <= n <= 256
                and 64 <= entries <= 1 << 24
                and 4096 <= cap <= 1 << 46
                and 0 <= hints <= MAX_HINT_SLOTS
                and hints & (hints - 1) == 0
            ):
                raise ShmCacheError(f"segment {full!r} has an inconsistent header")
            expect = Layout(cap, n, entries, hints)
            if (
                expect.capacity != cap
                or (
                    expect.reader_off,
                    expect.slot_size,
                    expect.hint_off,
                    expect.ring_off,
                    expect.total,
                )
                != (hw[H_READER_OFF], hw[H_SLOT_SIZE], hw[H_HINT_OFF], hw[H_RING_OFF], hw[H_TOTAL])
                or int(hw[H_MAX_OBJECT]) + 64 > cap
            ):
                raise ShmCacheError(f"segment {full!r} has an inconsistent layout")
            if nonce is not None and hw[H_NONCE] != nonce:
                raise SegmentNotFoundError(
                    errno.ENOENT, f"segment {full!r} is another instance than the handle names"
                )
            lock_fd = _open_lock_fd(fd)
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if populate:
                _prefault(mm, write=False)
            return cls(full, lock_fd, mm, owner=False, layout=expect)
        except BaseException as exc:
            if mm is not None:
                mm.close()
            if lock_fd >= 0:
                os.close(lock_fd)
            if isinstance(exc, OSError) and not isinstance(exc, ShmCacheError):
                raise _typed(exc, full, path, "attach to") from None
            raise
        finally:
            os.close(fd)

    # --- accessors -----------------------------------------------------------------------
    @property
    def fd(self) -> int:
        """The descriptor that carries this process's kernel locks on the segment."""
        if self.closed:
            raise ClosedCacheError(f"segment {self.name!r} is closed")
        if self.forked:
            raise RoleError(
                f"segment {self.name!r} was opened by process {self.pid}, the parent of this "
                "forked child: attach again in the child"
            )
        return self._fd

    @property
    def nonce(self) -> int:
        """The random number that tells this instance of the name from any other."""
        return int(self.words[H_NONCE])

    def writer_alive(self) -> bool:
        """Kernel truth: does any process hold the writer's lock (and has it not closed)?"""
        if self.forked or self.words[H_STATE] != STATE_LIVE:
            return False
        if self.owner:
            return True
        return ofd_probe(self.fd, 0)

    def forget_after_fork(self) -> None:
        """In a forked child (the module's at-fork hook): drop the parent's locks.

        The child must not keep them alive: it closes its copy of the lock descriptor (its
        only reference to that open file description). The mapping, made from another one,
        stays readable, but this object refuses to be used (``fd``).
        """
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
            self.words[H_STATE] = STATE_CLOSED
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
        """Remove the name from /dev/shm if it still names this segment (mappings stay valid).

        A name that leads to another file (this one was removed by hand, and the name reused)
        is left to its owner.
        """
        path = os.path.join(SHM_DIR, self.name)
        if self._fd >= 0 and not _same_file(path, self._fd):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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


def _shm_names() -> list[str]:
    """Every entry of /dev/shm (none if it does not exist)."""
    try:
        return os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []


def list_segments() -> list[str]:
    """Names of every ``aioshm-`` segment in /dev/shm."""
    return sorted(n for n in _shm_names() if is_segment_file(n))


def list_shards(group: str) -> list[tuple[int, str]]:
    """``(k, segment name)`` of every shard of cache group ``group`` in /dev/shm, by index.

    By name only: whether a segment proves it is a member is the group's business (``_group``).
    """
    shards = [(parse_shard_name(n), n) for n in _shm_names()]
    return sorted((p[1], n) for p, n in shards if p is not None and p[0] == group)


def list_semaphores() -> list[tuple[str, str, int]]:
    """``(file name, segment, nonce low 32 bits)`` of every wake semaphore of ours in /dev/shm."""
    sems = [(n, parse_semaphore_file(n)) for n in _shm_names()]
    return [(n, *p) for n, p in sems if p is not None]
