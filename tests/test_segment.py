"""Layer 1: creation, attachment, header checks, owner lock, space reservation, fork safety."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

from aioshmcache import (
    CacheConfig,
    ReceiverCache,
    SegmentExistsError,
    SegmentNotFoundError,
    SenderCache,
    ShmCacheError,
    ShmSpaceError,
)
from aioshmcache._layout import HEADER_SIZE, MAGIC, Layout
from aioshmcache._segment import Segment, ofd_probe

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
