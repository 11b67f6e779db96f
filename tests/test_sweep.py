"""Orphan removal: only dead writers' segments and semaphores go, one name or all of them."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import pytest

from aioshmcache import CacheConfig, SenderCache, ShmObjectStore
from aioshmcache import _sweep as sweep_module
from aioshmcache._layout import Layout
from aioshmcache._segment import Segment, remove_orphan, writer_state
from aioshmcache._sweep import sweep

from . import _procs
from .helpers import SPAWN, kill_and_reap, wait_until
from .test_segment import _killed_writer

SHM = "/dev/shm"


def _files(name: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if f"aioshm-{name}" in n)


def test_sweep_leaves_live_segments_alone(make_config: Any) -> None:
    with SenderCache(make_config()) as cache:
        assert cache.name not in sweep(dry_run=True)  # a dry run: never other runs' orphans
        assert os.path.exists(f"/dev/shm/{cache.name}")


def test_sweep_keeps_the_semaphore_of_a_live_dotted_name(make_config: Any, shm_name: str) -> None:
    with SenderCache(make_config(name=f"{shm_name}.with.dots")) as tx:
        assert not [n for n in sweep(dry_run=True) if tx.name in n]
        assert not [n for n in sweep(name=tx.name) if tx.name in n]
        assert any(n.startswith(f"sem.{tx.name}.") for n in os.listdir("/dev/shm"))


def test_sweep_by_name_removes_that_orphan_only(shm_name: str) -> None:
    a, b = f"{shm_name}-a", f"{shm_name}-b"
    _killed_writer(a)
    _killed_writer(b)
    try:
        assert len(_files(a)) == 2 and len(_files(b)) == 2  # segment and semaphore each
        files_a = _files(a)
        assert sorted(sweep(name=a, dry_run=True)) == files_a
        assert sorted(sweep(name=a)) == files_a
    finally:
        leftover_b = _files(b)
        sweep(name=a)
        sweep(name=b)
    assert not _files(a) and len(leftover_b) == 2 and not _files(b)


def test_sweep_by_name_leaves_a_live_writer_alone(make_config: Any, shm_name: str) -> None:
    with ShmObjectStore.create(make_config()) as store:
        assert sweep(name=shm_name) == []
        assert os.path.exists(os.path.join(SHM, store.name)) and len(_files(shm_name)) == 2


def test_sweep_never_takes_the_semaphore_of_a_writer_starting_meanwhile(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The semaphores are listed before any writer is judged: a late writer's is not listed."""
    late: list[ShmObjectStore] = []
    real = remove_orphan

    def start_a_writer_meanwhile(path: str, *, dry_run: bool = False) -> bool:
        if not late:
            late.append(ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)))
        return real(path, dry_run=dry_run)

    _killed_writer(f"{shm_name}-dead")  # something for sweep to judge
    monkeypatch.setattr(sweep_module, "remove_orphan", start_a_writer_meanwhile)
    try:
        removed = sweep(dry_run=True)  # the whole listing, but others' orphans stay untouched
        assert f"aioshm-{shm_name}-dead" in removed
        assert late and not [n for n in removed if n.startswith(f"sem.aioshm-{shm_name}.")]
        assert len(_files(shm_name)) == 4  # the late writer's two files, and (dry run) the dead's
    finally:
        for store in late:
            store.close()
        monkeypatch.undo()
        sweep(name=f"{shm_name}-dead")


@pytest.mark.slow
def test_cli_sweep_name_removes_that_orphan_only(shm_name: str) -> None:
    import subprocess
    import sys

    _killed_writer(shm_name)
    try:
        cmd = [sys.executable, "-m", "aioshmcache", "sweep"]
        dry = subprocess.run([*cmd, shm_name, "--dry-run"], capture_output=True, text=True)
        assert dry.returncode == 0 and f"would remove aioshm-{shm_name} (orphan" in dry.stdout
        assert len(_files(shm_name)) == 2  # a dry run removes nothing
        done = subprocess.run([*cmd, shm_name], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and f"removed aioshm-{shm_name} (orphan" in done.stdout, done
        assert _files(shm_name) == []
        bad = subprocess.run([*cmd, "bad/name"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "sweep:" in bad.stderr
    finally:
        sweep(name=shm_name)


def test_sweep_with_a_prefix_touches_only_names_that_start_with_it(shm_name: str) -> None:
    """``sweep(prefix=...)``: a test run or a deployment cleans up its own orphans only."""
    _killed_writer(f"{shm_name}-a")
    _killed_writer(f"{shm_name}x-b")  # shares a shorter prefix only
    try:
        mine = _files(f"{shm_name}-a")  # the segment and its semaphore
        assert len(mine) == 2
        assert sorted(sweep(prefix=f"{shm_name}-", dry_run=True)) == mine
        assert sorted(sweep(prefix=f"{shm_name}-")) == mine
        assert _files(f"{shm_name}-a") == [] and len(_files(f"{shm_name}x-b")) == 2
        with pytest.raises(ValueError):
            sweep(name=shm_name, prefix=shm_name)
        with pytest.raises(ValueError):
            sweep(prefix="bad/prefix")
    finally:
        sweep(name=f"{shm_name}x-b")


def _new_segment(name: str) -> Segment:
    """A writer's segment under ``name``, reclaiming a dead writer's (as a restart does)."""
    layout = Layout(4096, 1, 64)
    return Segment.create(
        name,
        layout,
        max_object_bytes=1024,
        delivery="broadcast",
        handout_ttl=30.0,
        prefault=False,
        reclaim_dead=True,
    )


def _crash(seg: Segment) -> None:
    """Make ``seg``'s writer dead as a SIGKILL would: its lock goes, its file stays."""
    os.close(seg._fd)
    seg._fd = -1
    seg.closed = True
    seg.words.release()
    seg.buf.release()
    seg._mmap.close()


def _owns_its_file(seg: Segment) -> bool:
    """The name in /dev/shm is still this writer's very file (same device and inode)."""
    try:
        st = os.stat(os.path.join(SHM, seg.name))
    except FileNotFoundError:
        return False
    mine = os.fstat(seg.fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def test_a_restart_between_sweep_s_judgement_and_its_unlink_keeps_its_segment(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 item 1: sweep removes only the very file it judged dead.

    A dead writer's segment is judged an orphan by ``sweep``; right then (in the sweep's unlink
    call) a new writer restarts under the same name, reclaiming it. Before the fix the restart
    replaced the file and the sweep then unlinked the *new, live* segment. Now the restart waits
    for the sweep (which holds the remover lock of the file it judged) or finds the file gone,
    and the sweep unlinks only what it judged.
    """
    _crash(_new_segment(shm_name))
    path = os.path.join(SHM, f"aioshm-{shm_name}")
    sweeper = threading.get_ident()
    restarted: list[Segment] = []
    failures: list[BaseException] = []
    real_unlink = os.unlink

    def restart() -> None:
        try:
            restarted.append(_new_segment(shm_name))
        except BaseException as exc:  # reported to the test
            failures.append(exc)

    def unlink_after_a_restart(p: Any, *args: Any, **kw: Any) -> None:
        if threading.get_ident() == sweeper and p == path and not restarted and not failures:
            t = threading.Thread(target=restart)
            t.start()
            # Without the fix the restart is done in milliseconds; with it, it waits for this
            # sweep to finish (far below its own deadline), so the wait here is only a bound.
            t.join(0.5)
            threads.append(t)
        real_unlink(p, *args, **kw)

    threads: list[threading.Thread] = []
    monkeypatch.setattr(os, "unlink", unlink_after_a_restart)
    try:
        removed = sweep(name=shm_name)
        for t in threads:
            t.join(30)
        monkeypatch.undo()
        assert threads and not failures, failures
        assert f"aioshm-{shm_name}" in removed  # the dead one went...
        assert _owns_its_file(restarted[0])  # ...and the restarted writer keeps its own
        assert sweep(name=shm_name) == []
        assert _owns_its_file(restarted[0])
    finally:
        monkeypatch.undo()
        for seg in restarted:
            seg.close()
        sweep(name=shm_name)


@pytest.mark.slow
def test_restarts_racing_a_sweeping_process_never_lose_their_segment(shm_name: str) -> None:
    """Issue 19 item 1, the natural race: a writer crashes and restarts under one name over and
    over while another process sweeps that name in a loop. Every restarted writer keeps its
    own file: the name always names the very file it created, across sweeps."""
    stop = SPAWN.Event()
    passes = SPAWN.Value("q", 0)
    sweeper = SPAWN.Process(target=_procs.sweeper_loop, args=(shm_name, stop, passes))
    sweeper.start()
    lost: list[int] = []
    seg: Segment | None = None
    try:
        assert wait_until(lambda: passes.value > 0, timeout=60)
        for i in range(2000):  # before the fix: ~2% of the restarts lost their segment
            seg = _new_segment(shm_name)
            seen = passes.value
            # give the sweeper a full pass (it may have judged the dead file just before)
            assert wait_until(lambda s=seen: passes.value > s + 1, timeout=60, interval=0.0005)
            if not _owns_its_file(seg):
                lost.append(i)
            _crash(seg)
            seg = None
    finally:
        stop.set()
        sweeper.join(30)
        if sweeper.is_alive():
            kill_and_reap(sweeper)
        if seg is not None:
            seg.close()
        sweep(name=shm_name)
    assert sweeper.exitcode == 0
    assert lost == []


def test_a_restart_waits_for_a_removal_in_progress_within_a_bound(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart meeting a dead file that another process is removing (its remover lock held)
    waits for it, a bounded time: then a typed ``SegmentExistsError`` naming why."""
    from aioshmcache import SegmentExistsError
    from aioshmcache import _segment as segment_module
    from aioshmcache._segment import REMOVER_BYTE, ofd_lock

    _crash(_new_segment(shm_name))
    path = os.path.join(SHM, f"aioshm-{shm_name}")
    fd = os.open(path, os.O_RDWR)
    try:
        assert ofd_lock(fd, REMOVER_BYTE)  # a remover that stalls
        assert not writer_state(path).alive  # a remover never looks like a live writer
        assert sweep(name=shm_name) == []  # another sweep leaves the file to it
        monkeypatch.setattr(segment_module, "REMOVAL_WAIT", 0.2)
        with pytest.raises(SegmentExistsError, match="being removed by another process"):
            _new_segment(shm_name)
        assert os.path.exists(path)
    finally:
        os.close(fd)
    seg = _new_segment(shm_name)  # the remover gone, the restart reclaims at once
    try:
        assert _owns_its_file(seg)
    finally:
        seg.close()


def test_sweep_never_takes_a_writer_that_locks_and_initialises_while_judged(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer creating its segment (file made, lock not yet taken) finishes its creation
    exactly while ``sweep`` judges the file: between the probe of its lock and the read of its
    header. Judged in that order, it looked dead *and* initialised, and sweep removed a segment
    just born; the header is read first now. (Found by the natural race test, ~1 in 10,000.)"""
    from aioshmcache import _segment as segment_module

    created = threading.Event()  # the writer made its file (O_EXCL), before taking its lock
    finish = threading.Event()  # let it take the lock and write its header
    real_open_lock_fd = segment_module._open_lock_fd
    real_probe = segment_module.ofd_probe
    writer_thread = 0  # set once the writer's thread runs
    born: list[Segment] = []
    failures: list[BaseException] = []

    def paused_open_lock_fd(fd: int) -> int:
        created.set()
        assert finish.wait(30)
        return real_open_lock_fd(fd)

    def probe_while_the_writer_finishes(fd: int, byte: int) -> bool:
        alive = real_probe(fd, byte)
        if byte == 0 and threading.get_ident() != writer_thread and not finish.is_set():
            finish.set()
            t.join(30)  # the writer has locked and written its magic
        return alive

    def create() -> None:
        try:
            born.append(_new_segment(shm_name))
        except BaseException as exc:  # reported to the test
            failures.append(exc)

    monkeypatch.setattr(segment_module, "_open_lock_fd", paused_open_lock_fd)
    monkeypatch.setattr(segment_module, "ofd_probe", probe_while_the_writer_finishes)
    t = threading.Thread(target=create)
    t.start()
    writer_thread = t.ident or 0
    try:
        assert created.wait(30)
        assert sweep(name=shm_name) == []
        t.join(30)
        assert finish.is_set() and not failures and born, failures
        monkeypatch.undo()
        assert _owns_its_file(born[0])
    finally:
        finish.set()
        t.join(30)
        monkeypatch.undo()
        for seg in born:
            seg.close()
        sweep(name=shm_name)


def test_cli_sweep_name_says_what_it_found_and_understands_groups(
    shm_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sweep NAME`` (issue 28): a group's name sweeps its orphan shards (it said "no orphan
    segment found" while both shards of the group were orphans), and each name found is
    reported apart: removed, live, kept, missing, each with its own exit status."""
    from aioshmcache._layout import shard_name
    from aioshmcache.cli import SWEEP_EXIT, main

    def cli(*args: str) -> tuple[int, list[str]]:
        rc = main(["sweep", *args])
        return rc, capsys.readouterr().out.splitlines()

    group = f"{shm_name}-grp"
    dead = [_new_segment(shard_name(group, k)) for k in (0, 1)]
    for seg in dead:
        _crash(seg)
    live = _new_segment(shard_name(group, 2))
    shards = [shard_name(group, k) for k in range(3)]  # segment names, aioshm- included
    creating = os.path.join(SHM, f"aioshm-{shm_name}-new")
    try:
        rc, out = cli(group, "--dry-run")
        assert rc == 0 and all(os.path.exists(os.path.join(SHM, n)) for n in shards)
        assert f"would remove {shards[0]} (orphan: its writer is dead)" in out, out
        assert f"would remove {shards[1]} (orphan: its writer is dead)" in out, out
        assert f"live: {shards[2]} (its writer (pid {os.getpid()}) is alive); left alone" in out
        rc, out = cli(group)
        assert rc == 0 and f"removed {shards[0]} (orphan: its writer is dead)" in out, out
        assert not any(os.path.exists(os.path.join(SHM, n)) for n in shards[:2])
        assert os.path.exists(os.path.join(SHM, shards[2]))
        rc, out = cli(group)  # only the live shard is left
        assert (rc, out) == (4, [f"live: {shards[2]} (its writer (pid {os.getpid()}) is alive); "
                                 "left alone"])  # fmt: skip
        rc, out = cli(shards[2])  # a segment by its name: the same answer
        assert rc == 4 and out[0].startswith(f"live: {shards[2]}")
        rc, out = cli(f"aioshm-{group}")  # the group by its files' prefix, as a segment's
        assert rc == 4 and out[0].startswith(f"live: {shards[2]}"), out
        rc, out = cli(f"{shm_name}-nothing")
        assert (rc, out) == (3, [f"missing: aioshm-{shm_name}-nothing (no such segment or cache "
                                 "group)"])  # fmt: skip
        os.close(os.open(creating, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # being created
        rc, out = cli(f"{shm_name}-new")
        assert rc == 4 and out[0].startswith(f"kept: aioshm-{shm_name}-new (no complete header")
        assert os.path.exists(creating)
        assert cli("bad/name")[0] == 1
        assert [code for code, _when in SWEEP_EXIT] == [0, 1, 2, 3, 4]
    finally:
        _crash(live)
        for seg in dead:
            sweep(name=seg.name)
        sweep(name=live.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(creating)
    assert _files(group) == []


def test_the_tools_find_a_cache_s_files_by_the_core_s_names(
    make_config: Any, shm_name: str
) -> None:
    """``aioshmcache.tools.shm`` lists a segment and its wake semaphore through the core's own
    naming (``_layout``'s internal API), not a copy of the rules."""
    from aioshmcache.tools.shm import files_with_prefix, segment_files

    longer = make_config(name=f"{shm_name}-longer")
    with SenderCache(make_config()) as cache, SenderCache(longer) as other:
        mine = [n for n in os.listdir(SHM) if n == cache.name or n.startswith(f"sem.{cache.name}.")]
        assert len(mine) == 2  # the segment and its wake semaphore
        assert segment_files(cache.name) == sorted(mine)
        assert segment_files(shm_name) == sorted(mine)  # without the prefix: the same
        both = files_with_prefix(shm_name)
        assert set(mine) < set(both) and other.name in both and len(both) == 4
    assert segment_files(cache.name) == [] and files_with_prefix(shm_name) == []
