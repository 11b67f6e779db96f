"""Orphan removal: only dead writers' segments and semaphores go, one name or all of them."""

from __future__ import annotations

import os
from typing import Any

import pytest

from aioshmcache import CacheConfig, SenderCache, ShmObjectStore
from aioshmcache import _sweep as sweep_module
from aioshmcache._segment import writer_state
from aioshmcache._sweep import sweep

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
    real = writer_state

    def start_a_writer_meanwhile(path: str) -> Any:
        if not late:
            late.append(ShmObjectStore.create(CacheConfig(1 << 16, 1 << 12, 1, name=shm_name)))
        return real(path)

    _killed_writer(f"{shm_name}-dead")  # something for sweep to judge
    monkeypatch.setattr(sweep_module, "writer_state", start_a_writer_meanwhile)
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


def test_cli_sweep_name_removes_that_orphan_only(shm_name: str) -> None:
    import subprocess
    import sys

    _killed_writer(shm_name)
    try:
        cmd = [sys.executable, "-m", "aioshmcache", "sweep"]
        dry = subprocess.run([*cmd, shm_name, "--dry-run"], capture_output=True, text=True)
        assert dry.returncode == 0 and "would remove 1 orphan segment" in dry.stdout, dry
        assert len(_files(shm_name)) == 2  # a dry run removes nothing
        done = subprocess.run([*cmd, shm_name], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and f"removed aioshm-{shm_name}\n" in done.stdout, done
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
