"""The command line: ``inspect`` and ``sweep`` from outside the writer, and the package hygiene."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from aioshmcache import ReceiverCache, SenderCache

from . import _procs
from .conftest import RUN_PREFIX
from .helpers import SPAWN

PKG = pathlib.Path(__file__).resolve().parent.parent / "aioshmcache"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioshmcache", *args], capture_output=True, text=True, timeout=120
    )


def test_inspect_of_another_layout_says_so_in_one_line(make_config: Any) -> None:
    """A segment of an older layout (left by an older version of the library) is a one-line
    error from ``inspect``, exit 1, never a traceback."""
    from aioshmcache._layout import H_VERSION, LAYOUT_VERSION, SHM_DIR

    with SenderCache(make_config(1 << 20, 1 << 18, 1)) as cache:
        fd = os.open(os.path.join(SHM_DIR, cache.name), os.O_RDWR)
        try:
            os.pwrite(fd, (LAYOUT_VERSION - 1).to_bytes(8, sys.byteorder), 8 * H_VERSION)
            out = run_cli("inspect", cache.name)
            assert out.returncode == 1, out
            assert "Traceback" not in out.stderr and "layout version" in out.stderr, out
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        finally:
            os.pwrite(fd, LAYOUT_VERSION.to_bytes(8, sys.byteorder), 8 * H_VERSION)
            os.close(fd)


def test_inspect_shows_the_state_from_outside(make_config: Any) -> None:
    with SenderCache(make_config(1 << 20, 1 << 18, 2)) as cache:
        rx = ReceiverCache.attach(cache.handle())
        try:
            ref, _ = cache.get_and_update_item(({"a": np.zeros(1000)}, ()), "h")
            cache.get_and_update_item(None, "h")
            rx.get_and_update_item(ref, "h")
            cache.snapshot()  # drains acknowledgements and publishes the lag
            out = run_cli("inspect", cache.name)
            assert out.returncode == 0, out.stderr
            text = out.stdout
            assert f"segment     {cache.name}" in text
            assert "alive" in text and "1 items" in text
            assert re.search(r"hits\s+1 of 2", text)
            rows = [ln.split() for ln in text.splitlines() if re.match(r"\s+[01]\s", ln)]
            assert rows[0][:3] == ["0", "yes", "yes"] and rows[0][4:6] == ["1", "1"]
            assert rows[1][:3] == ["1", "no", "no"]
        finally:
            rx.close()
    missing = run_cli("inspect", "no-such-segment")
    assert missing.returncode == 1 and "no segment" in missing.stderr


def _reader_rows(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines() if re.match(r"\s+\d+\s+(yes|no)\s", ln)]


def test_inspect_counts_what_a_reader_is_behind_without_the_writer_s_help(
    make_config: Any,
) -> None:
    """Issue 19 item 10: an idle writer never drains, yet ``inspect`` shows the true lag.

    The count comes from shared memory: the debt the writer last published, less the
    acknowledgements the reader wrote since the writer last read its log.
    """
    cache = SenderCache(make_config(1 << 20, 1 << 18, 1))
    with cache, ReceiverCache.attach(cache.handle()) as rx:
        refs = [
            cache.get_and_update_item(({"i": np.full(10, i)}, ()), f"h{i}")[0] for i in range(20)
        ]
        refs += [cache.get_and_update_item(None, f"h{i}")[0] for i in range(5)]  # hits
        for i, ref in enumerate(refs[:22]):
            rx.get_and_update_item(ref, f"h{i % 20}")
        out = run_cli("inspect", cache.name)  # the writer did nothing since its hand-outs
        assert out.returncode == 0, out.stderr
        row = _reader_rows(out.stdout)[0]
        assert row[:3] == ["0", "yes", "yes"] and row[4:6] == ["22", "3"], out.stdout
        for i, ref in enumerate(refs[22:], start=22):
            rx.get_and_update_item(ref, f"h{i % 20}")
        assert _reader_rows(run_cli("inspect", cache.name).stdout)[0][4:6] == ["25", "0"]
        assert cache.snapshot().readers[0].lag == 0  # the writer's own view agrees


def test_a_reader_new_in_a_slot_owes_nothing_of_the_closed_session_s_debt(
    make_config: Any,
) -> None:
    """A reader that closed owing hand-outs, and a new one in its slot, all while the writer
    is idle: from outside the new reader owes nothing (the writer's own view), not the closed
    session's debt the writer published for that slot."""
    from aioshmcache._inspect import read_snapshot

    with SenderCache(make_config(1 << 20, 1 << 18, 1)) as cache:
        with ReceiverCache.attach(cache.handle()):
            for i in range(5):
                cache.get_and_update_item(({"i": np.full(10, i)}, ()), f"h{i}")
            assert read_snapshot(cache.name)[0].readers[0].lag == 5  # never read: owed
        with ReceiverCache.attach(cache.handle()):  # the same slot, a new session
            row = _reader_rows(run_cli("inspect", cache.name).stdout)[0]
            assert row[:3] == ["0", "yes", "yes"] and row[4:6] == ["0", "0"], row
            outside = read_snapshot(cache.name)[0].readers[0]
            assert (outside.lag, outside.acknowledged) == (0, 0)
            assert cache.snapshot().readers[0].lag == 0  # the writer's own view agrees


@pytest.mark.slow
def test_sweep_cli_removes_only_orphans(make_config: Any, shm_name: str) -> None:
    a, b = SPAWN.Pipe()
    writer = SPAWN.Process(
        target=_procs.writer_forever, args=(shm_name + "-orphan", b), daemon=True
    )
    writer.start()
    with SenderCache(make_config()) as live:
        assert a.poll(60)
        a.recv()
        writer.kill()
        writer.join(10)
        out = run_cli("sweep", "--prefix", RUN_PREFIX)  # never other runs' orphans
        assert out.returncode == 0
        assert f"removed aioshm-{shm_name}-orphan" in out.stdout
        assert f"removed {live.name}\n" not in out.stdout
        assert os.path.exists(f"/dev/shm/{live.name}")
        assert not os.path.exists(f"/dev/shm/aioshm-{shm_name}-orphan")
        assert not any(shm_name + "-orphan" in n for n in os.listdir("/dev/shm"))


def test_no_pickle_and_no_asserts_for_control_flow() -> None:
    for path in PKG.rglob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import pickle|from pickle|import cPickle)", src, re.M), path
        assert "pickle.loads" not in src, path
        if "/bench/" not in str(path) and "/demo/" not in str(path):
            assert not re.search(r"^\s*assert ", src, re.M), f"assert in {path}"


def test_help_lists_every_command() -> None:
    out = run_cli("--help")
    for cmd in ("demo", "stress", "bench", "inspect", "sweep"):
        assert cmd in out.stdout


def test_help_describes_every_command() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: python -m aioshmcache")
    description = out.stdout.split("\n\n")[1]
    assert description.startswith("aioshmcache: ") and "Layer" not in out.stdout
    for cmd in ("inspect", "sweep"):
        sub = run_cli(cmd, "--help")
        assert sub.returncode == 0
        text = sub.stdout.split("\n\n")[1]  # the paragraph after usage: the description
        assert not text.startswith(("options:", "positional")), (cmd, sub.stdout)
        assert len(text.split()) > 8, (cmd, text)
    listed = re.findall(r"^    (\w+)\s+(\S.*)$", out.stdout, re.M)
    assert {name for name, _help in listed} == {"demo", "stress", "bench", "inspect", "sweep"}


@pytest.mark.slow
def test_sweep_dry_run_says_what_it_would_remove(make_config: Any, shm_name: str) -> None:
    """The summary line is a sentence: 'would remove 1 orphan segment', not '1 orphan would ...'."""
    a, b = SPAWN.Pipe()
    writer = SPAWN.Process(target=_procs.writer_forever, args=(shm_name + "-dry", b), daemon=True)
    writer.start()
    try:
        assert a.poll(60)
        a.recv()
        writer.kill()
        writer.join(10)
        out = run_cli("sweep", "--prefix", RUN_PREFIX, "--dry-run")
        assert out.returncode == 0
        assert f"would remove aioshm-{shm_name}-dry\n" in out.stdout
        last = out.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"would remove \d+ orphan segments?( and \d+ semaphores?)?", last), last
        assert os.path.exists(f"/dev/shm/aioshm-{shm_name}-dry")  # a dry run removes nothing
    finally:
        done = run_cli("sweep", "--prefix", RUN_PREFIX)
        assert f"removed aioshm-{shm_name}-dry" in done.stdout
        assert re.search(r"^removed \d+ orphan segments?", done.stdout, re.M)


def test_demo_without_the_examples_extra_says_how_to_install_it() -> None:
    """No raw ModuleNotFoundError: the missing package and the install command."""
    for blocked, command in (("fastapi", "run"), ("httpx", "run"), ("uvicorn", "serve")):
        code = (
            "import sys\n"
            f"sys.modules[{blocked!r}] = None  # as if it were not installed\n"
            "from aioshmcache.cli import main\n"
            f"sys.exit(main(['demo', {command!r}, '--help']))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr
        assert "pip install -e '.[examples]' in a clone of aioshmcache" in out.stderr
        assert f"{blocked} is not installed" in out.stderr, out.stderr


def test_one_reader_of_a_segment_serves_inspect_the_metrics_and_the_tools(
    make_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_inspect.read_segment`` is the package's one reader of a segment from outside: it
    agrees with the writer's own snapshot, ``inspect`` prints what it read, the metrics
    re-export it, and it needs no optional dependency (prometheus_client blocked)."""
    import aioshmcache._inspect as inspect_module
    import aioshmcache.metrics

    assert aioshmcache.metrics.read_snapshot is inspect_module.read_snapshot
    with SenderCache(make_config(1 << 20, 1 << 18, 2)) as cache:
        cache.get_and_update_item(({"a": np.zeros(100)}, ()), "h")
        cache.get_and_update_item(None, "h")
        state = inspect_module.read_segment(cache.name)
        own = cache.snapshot()
        got = state.snapshot
        assert (got.name, got.hits, got.misses, got.items) == (own.name, 1, 1, 1)
        assert (got.bytes_used, got.capacity_bytes, got.epoch) == (
            own.bytes_used,
            own.capacity_bytes,
            own.epoch,
        )
        assert state.writer_alive and state.writer_pid == os.getpid()
        assert state.delivery == "broadcast" and state.next_id > 0
        assert inspect_module.read_snapshot(cache.name) == (got, True)

        code = (
            "import sys\n"
            "sys.modules['prometheus_client'] = None  # as without the metrics extra\n"
            "from aioshmcache._inspect import read_segment\n"
            f"s = read_segment({cache.name!r})\n"
            "print(s.snapshot.hits, s.snapshot.items, s.writer_alive)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "1", "True"]

        # ``inspect`` prints what the shared reader read, and reads nothing on its own
        fake = dataclasses.replace(
            state, snapshot=dataclasses.replace(got, hits=12345), writer_pid=424242
        )
        monkeypatch.setattr(inspect_module, "read_segment", lambda name: fake)
        text = inspect_module.inspect_segment(cache.name)
        assert re.search(r"hits\s+12345 of 12346", text) and "pid 424242" in text, text


def test_the_cli_uses_only_public_names() -> None:
    """``cli`` and ``__main__`` import no private name, and of a private module only what it
    exports (``__all__``): the shared segment reader (``_inspect``) and ``_sweep``."""
    import importlib

    for path in (PKG / "cli.py", PKG / "__main__.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                module = importlib.import_module(f"aioshmcache.{node.module}")
                for alias in node.names:
                    assert not alias.name.startswith("_"), (path.name, alias.name)
                    assert alias.name in module.__all__, (path.name, node.module, alias.name)
