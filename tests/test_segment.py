"""Layer 1: creation, attachment, header checks, owner lock, space reservation, fork safety."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any

import pytest

from aioshmcache import (
    CacheConfig,
    ReceiverCache,
    SegmentExistsError,
    SegmentNotFoundError,
    SenderCache,
    ShmCacheError,
    ShmObjectStore,
    ShmSpaceError,
)
from aioshmcache._layout import (
    HEADER_SIZE,
    MAGIC,
    Layout,
    parse_semaphore_file,
    segment_name,
    semaphore_file,
    semaphore_name,
)
from aioshmcache._segment import Segment, ofd_probe
from aioshmcache._sweep import sweep

from .helpers import SPAWN, kill_and_reap

SHM = "/dev/shm"


def test_create_reserves_space_mode_and_header(shm_name: str) -> None:
    layout = Layout(1 << 20, 2, 64)
    seg = Segment.create(
        shm_name, layout, max_object_bytes=1 << 19, delivery="broadcast", handout_ttl=30.0
    )
    try:
        path = os.path.join(SHM, seg.name)
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600
        assert st.st_size == layout.total
        assert st.st_blocks * 512 >= layout.total  # fallocate'd: not sparse
        assert seg.words[0] == MAGIC
        assert seg.nonce != 0
        assert seg.name == "aioshm-" + shm_name
    finally:
        seg.close()
    assert not os.path.exists(path)


def test_exclusive_create_and_not_found(shm_name: str) -> None:
    cfg = CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)
    with SenderCache(cfg), pytest.raises(SegmentExistsError) as ei:
        SenderCache(cfg)
    assert isinstance(ei.value, FileExistsError)
    with pytest.raises(SegmentNotFoundError) as nf:
        ReceiverCache.attach(shm_name)
    assert isinstance(nf.value, FileNotFoundError)


def test_attach_rejects_foreign_files_and_wrong_nonce(shm_name: str) -> None:
    path = os.path.join(SHM, "aioshm-" + shm_name)
    with open(path, "wb") as f:
        f.write(b"\0" * HEADER_SIZE * 2)
    try:
        with pytest.raises(SegmentNotFoundError):
            Segment.attach(shm_name)
    finally:
        os.unlink(path)
    cfg = CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)
    with SenderCache(cfg) as s:
        h = s.handle()
        with pytest.raises(SegmentNotFoundError):
            Segment.attach(h.name, nonce=h.nonce ^ 1)


def test_close_is_idempotent_and_only_owner_unlinks(shm_name: str) -> None:
    s = SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name))
    r = ReceiverCache.attach(s.handle())
    r.close()
    r.close()
    assert os.path.exists(os.path.join(SHM, s.name))
    s.close()
    s.close()
    assert not os.path.exists(os.path.join(SHM, s.name))


def test_segment_survives_a_reader_process_that_exits(shm_name: str) -> None:
    with SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)) as s:
        code = textwrap.dedent(f"""
            from aioshmcache import ReceiverCache
            r = ReceiverCache.attach({s.name!r})
            r.close()
            r2 = ReceiverCache.attach({s.name!r})  # and exit without closing
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert os.path.exists(os.path.join(SHM, s.name))
        ReceiverCache.attach(s.handle()).close()


def test_writer_lock_is_held_and_kernel_tracked(shm_name: str) -> None:
    with SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)) as s:
        fd = os.open(os.path.join(SHM, s.name), os.O_RDWR)
        try:
            assert ofd_probe(fd, 0)
        finally:
            os.close(fd)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 21, 1)  # object larger than the ring
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 10, 0)
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 10, 1, delivery="anycast")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 10, 1, name="bad/name")
    with pytest.raises(ValueError):
        CacheConfig(1 << 20, 1 << 10, 1, handout_ttl=float("nan"))
    cfg = CacheConfig.from_gb(0.5, 16, 2)
    assert cfg.capacity_bytes == 1 << 29 and cfg.max_object_bytes == 16 << 20


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare(1) is not installed")
def test_too_small_dev_shm_is_a_clean_error() -> None:
    code = textwrap.dedent("""
        import os, sys
        from aioshmcache import CacheConfig, SenderCache, ShmSpaceError
        try:
            SenderCache(CacheConfig(64 << 20, 1 << 20, 1, name="toobig"))
        except ShmSpaceError as exc:
            print("SPACE", exc)
        print("LEFT", sorted(os.listdir("/dev/shm")))
    """)
    script = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && {sys.executable} -c '{code}'"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0 and "SPACE" not in proc.stdout:
        pytest.skip(f"unshare -m is not permitted here: {proc.stderr.strip()[:200]}")
    assert "SPACE" in proc.stdout, proc.stdout + proc.stderr
    assert "LEFT []" in proc.stdout, proc.stdout
    assert issubclass(ShmSpaceError, ShmCacheError)


def test_forked_child_cannot_write_or_reuse_parent_slot(shm_name: str) -> None:
    from aioshmcache import RoleError

    with SenderCache(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)) as s:
        r = ReceiverCache.attach(s.handle())
        ref, _ = s.get_and_update_item(({"x": 1}, ()), "h")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            pid = os.fork()
        if pid == 0:  # child: exit code tells the parent what happened
            code = 0
            try:
                s.get_and_update_item(({"y": 2}, ()), "h2")
                code |= 1
            except RoleError:
                pass
            try:
                r.get_and_update_item(ref, "h")
                code |= 2
            except RoleError:
                pass
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # the parent is unaffected, and the child did not keep the writer lock alive
        assert r.get_and_update_item(ref, "h") == {"x": 1}
        r.close()


# --- restart after a crash ------------------------------------------------------------------------
def _writer_sleeps(name: str, conn: Any) -> None:
    """A writer that creates its store, says so, and waits to be SIGKILLed."""
    from aioshmcache import ShmObjectStore

    store = ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=name))
    store.put("a", {"x": 1})
    conn.send((os.getpid(), store.nonce))
    time.sleep(3600)


def _killed_writer(name: str) -> tuple[int, int]:
    """Start a writer of segment ``name``, SIGKILL it; returns its pid and nonce."""
    a, b = SPAWN.Pipe()
    p = SPAWN.Process(target=_writer_sleeps, args=(name, b))
    p.start()
    try:
        assert a.poll(60)
        pid, nonce = a.recv()
    finally:
        kill_and_reap(p)
    return pid, nonce


def _sem_files(name: str) -> list[str]:
    return [n for n in os.listdir(SHM) if n.startswith(f"sem.aioshm-{name}.")]


def test_restart_reclaims_a_dead_writer_s_segment(shm_name: str) -> None:
    _pid, old_nonce = _killed_writer(shm_name)
    assert os.path.exists(os.path.join(SHM, "aioshm-" + shm_name)) and _sem_files(shm_name)
    with ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)) as store:
        assert store.nonce != old_nonce
        assert _sem_files(shm_name) == [semaphore_file(store.name, store.nonce)]
        ref = store.put("a", {"x": 2})
        with ShmObjectStore.from_handle(store.handle()) as reader:
            assert reader.get(ref) == {"x": 2}
    assert not _sem_files(shm_name)


def test_restart_without_reclaim_names_the_way_out(shm_name: str) -> None:
    pid, _nonce = _killed_writer(shm_name)
    try:
        cfg = CacheConfig(1 << 16, 1 << 12, 1, name=shm_name, reclaim_dead=False)
        with pytest.raises(SegmentExistsError, match=rf"pid {pid}\) is dead.*sweep"):
            ShmObjectStore.create(cfg)
        sems = _sem_files(shm_name)
        assert sweep(name=shm_name) == [f"aioshm-{shm_name}", *sems]
    finally:
        sweep(name=shm_name)
    assert not [n for n in os.listdir(SHM) if shm_name in n]
    with pytest.raises(ValueError, match="reclaim_dead"):
        CacheConfig(1 << 16, 1 << 12, 1, reclaim_dead=1)  # type: ignore[arg-type]


def test_a_live_writer_is_never_reclaimed_and_named_by_pid(shm_name: str) -> None:
    cfg = CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)
    with ShmObjectStore.create(cfg) as live:
        with pytest.raises(SegmentExistsError, match=rf"pid {os.getpid()}\) is alive"):
            ShmObjectStore.create(cfg)
        assert live.put("still", {"ok": True}).id > 0


def test_a_foreign_file_under_the_name_is_never_reclaimed(shm_name: str) -> None:
    path = os.path.join(SHM, "aioshm-" + shm_name)
    with open(path, "wb") as f:
        f.write(b"\0" * HEADER_SIZE * 2)
    try:
        with pytest.raises(SegmentExistsError, match="without a complete aioshmcache header"):
            ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name))
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_attach_through_a_symlink_is_a_typed_error(shm_name: str, tmp_path: Any) -> None:
    with ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)) as store:
        link = os.path.join(SHM, f"aioshm-{shm_name}-link")
        os.symlink(os.path.join(SHM, store.name), link)
        try:
            with pytest.raises(SegmentNotFoundError, match="symbolic link"):
                ShmObjectStore.from_handle(f"{shm_name}-link")
            with pytest.raises(SegmentExistsError):  # a link is never reclaimed either
                ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=f"{shm_name}-link"))
        finally:
            os.unlink(link)


def test_names_with_a_trailing_newline_are_rejected() -> None:
    for bad in ("cache\n", "cache\n\n", "a/b", "x" * 300):
        with pytest.raises(ValueError):
            segment_name(bad)
        with pytest.raises(ValueError):
            CacheConfig(1 << 16, 1 << 12, 1, name=bad)
    assert segment_name("/aioshm-ok.1") == "aioshm-ok.1"


def test_semaphore_names_are_built_and_parsed_in_one_place() -> None:
    for name in ("aioshm-x", "aioshm-with.dots.1.wake", "aioshm-", "aioshm-" + "y" * 193):
        for nonce in (1, 0xFFFFFFFF, (1 << 64) - 1, 0x1234_5678_9ABC_DEF1):
            parsed = parse_semaphore_file(semaphore_file(name, nonce))
            assert parsed == (name, nonce & 0xFFFFFFFF)
            assert semaphore_name(name, nonce) == "/" + semaphore_file(name, nonce)[4:]
    for junk in ("sem.aioshm-x.wake", "sem.other-x.12345678.wake", "sem.aioshm-x.1234567G.wake"):
        assert parse_semaphore_file(junk) is None
    assert parse_semaphore_file("sem.aioshm-x.12345678.wake\n") is None


def test_closing_a_writer_whose_file_was_replaced_leaves_the_new_file(shm_name: str) -> None:
    """A writer unlinks its name on close only while the name still leads to its own file."""
    layout = Layout(4096, 1, 64)
    kw: dict[str, Any] = {"max_object_bytes": 1024, "delivery": "broadcast", "handout_ttl": 30.0}
    old = Segment.create(shm_name, layout, **kw)
    os.unlink(os.path.join(SHM, old.name))  # removed by hand...
    new = Segment.create(shm_name, layout, **kw)  # ...and the name taken again
    try:
        old.close()
        assert os.path.exists(os.path.join(SHM, new.name))
        Segment.attach(shm_name, nonce=new.nonce).close()  # still the new one, attachable
    finally:
        new.close()
    assert not os.path.exists(os.path.join(SHM, new.name))


def test_a_restart_gives_way_at_once_to_another_restart_reclaiming_the_name(
    shm_name: str,
) -> None:
    """A restart that meets a dead file another restart is replacing (its remover and
    reclaimer locks held while it builds the new segment) gets ``SegmentExistsError`` at once:
    a new writer is on its way (a cache group's writer then takes the next shard index, rather
    than waiting for that build and then finding the name live)."""
    from aioshmcache._segment import RECLAIMER_BYTE, REMOVER_BYTE, ofd_lock

    from .test_sweep import _crash, _new_segment, _owns_its_file

    _crash(_new_segment(shm_name))
    fd = os.open(os.path.join(SHM, f"aioshm-{shm_name}"), os.O_RDWR)
    try:
        assert ofd_lock(fd, REMOVER_BYTE) and ofd_lock(fd, RECLAIMER_BYTE)
        with pytest.raises(SegmentExistsError, match="being reclaimed by another writer"):
            _new_segment(shm_name)
    finally:
        os.close(fd)
    seg = _new_segment(shm_name)  # that restart died before its rename: reclaimed now
    try:
        assert _owns_its_file(seg)
    finally:
        seg.close()


def test_a_reclaim_that_fails_leaves_the_dead_file_and_no_build(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reclaim whose build fails (no room) leaves the dead writer's file where it was (its
    late references stay known as a dead writer's) and nothing of its own."""
    import errno

    from aioshmcache import _segment
    from aioshmcache._segment import writer_state

    from .test_sweep import _crash, _new_segment

    dead = _new_segment(shm_name)
    nonce = dead.nonce
    _crash(dead)
    path = os.path.join(SHM, f"aioshm-{shm_name}")

    class NoRoom:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def posix_fallocate(self, *args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_segment, "os", NoRoom())
    with pytest.raises(ShmSpaceError):
        _new_segment(shm_name)
    monkeypatch.undo()
    st = writer_state(path)
    assert st.initialised and not st.alive and st.nonce == nonce
    assert [n for n in os.listdir(SHM) if shm_name in n] == [f"aioshm-{shm_name}"]
    assert sweep(name=shm_name) == [f"aioshm-{shm_name}"]


def test_a_build_left_by_a_reclaimer_that_died_is_removed(shm_name: str) -> None:
    """A reclaimer killed while it builds leaves its build under a name of its own: never the
    shard's name, and removed by the next reclaim of the name (or by ``sweep``)."""
    from aioshmcache._layout import building_name, is_segment_file
    from aioshmcache._segment import list_segments

    from .test_sweep import _crash, _new_segment, _owns_its_file

    long = "aioshm-" + "y" * 193
    assert is_segment_file(building_name(long, "0123abcd"))  # listed even past 200 bytes
    assert not is_segment_file(building_name(long, "0123abcd") + "\n")
    build = building_name(f"aioshm-{shm_name}", "0badf00d")
    _crash(_new_segment(shm_name))
    _crash(_new_segment(build))  # what a reclaimer killed after its header leaves
    assert build in list_segments()
    seg = _new_segment(shm_name)  # reclaims the dead file, and removes the dead build
    try:
        assert _owns_its_file(seg)
        assert [n for n in os.listdir(SHM) if shm_name in n] == [seg.name]
    finally:
        seg.close()
