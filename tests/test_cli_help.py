"""Every command line answers ``--help``; a gateway refuses a name whose writer is alive.

The ``--help`` runs are subprocesses, as a user types them: exit 0, a usage line, no traceback
(``examples/client.py --help`` used to crash asking the network for a URL named ``--help``).
A demo option the gateway would refuse (a size, a port, a log level, a name) is a usage error
(exit 2, one line), never a traceback from a gateway process; a group of gateway processes that
fails to start exits 3, as one gateway process does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aioshmcache import SenderCache
from aioshmcache.tools.demo import DemoOptions, ServeOptions, parse

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
MODULE = [sys.executable, "-m", "aioshmcache"]
COMMANDS = [
    [*MODULE],
    [*MODULE, "demo"],
    [*MODULE, "demo", "run"],
    [*MODULE, "demo", "serve"],
    [*MODULE, "stress"],
    [*MODULE, "bench"],
    [*MODULE, "inspect"],
    [*MODULE, "sweep"],
    [sys.executable, str(ROOT / "examples" / "client.py")],
    [sys.executable, str(ROOT / "examples" / "fastapi_app.py")],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(Path(a).name for a in c[1:]))
def test_every_cli_answers_help(cmd: list[str]) -> None:
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: "), out.stdout
    assert "Traceback" not in out.stderr


def test_a_gateway_on_a_name_with_a_live_writer_says_so_in_one_line(
    make_config: Any, shm_name: str
) -> None:
    """Checked before anything is announced: no "listening on", one line, exit code 2."""
    with SenderCache(make_config(1 << 20)) as live:
        cmd = [*MODULE, "demo", "serve", "--name", shm_name]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2
        assert "listening" not in out.stdout
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert shm_name in lines[0] and "live writer" in lines[0]
        assert live.snapshot().readers[0].attached is False  # the probe left no reader behind


BAD_DEMO_OPTIONS = [
    (DemoOptions, ["--cache-mb", "0"], "--cache-mb"),
    (DemoOptions, ["--cache-mb", "nan"], "--cache-mb"),
    (DemoOptions, ["--max-object-mb", "-1"], "--max-object-mb"),
    (DemoOptions, ["--cache-mb", "1", "--max-object-mb", "8"], "capacity_bytes"),
    (DemoOptions, ["--hash-first", "5"], "--hash-first"),
    (ServeOptions, ["--port", "70000"], "--port"),
    (ServeOptions, ["--port", "-1"], "--port"),
    (ServeOptions, ["--log-level", "bogus"], "--log-level"),
    (ServeOptions, ["--name", "a/b"], "segment name"),
    (ServeOptions, ["--name", "a.b", "--gateway-workers", "2"], "group name"),
]


@pytest.mark.parametrize(
    ("cls", "args", "what"), BAD_DEMO_OPTIONS, ids=[" ".join(a) for _c, a, _w in BAD_DEMO_OPTIONS]
)
def test_a_demo_option_the_gateway_would_refuse_is_a_usage_error(
    cls: Any, args: list[str], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(cls, args, "demo")
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("demo: error: ") and what in last, last


def test_demo_serve_with_a_bad_port_says_so_in_one_line() -> None:
    cmd = [*MODULE, "demo", "serve", "--port", "70000"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "listening" not in out.stdout and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("error: --port must be <= 65535")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_group_of_gateways_that_fails_to_start_exits_3(shm_name: str) -> None:
    """Each gateway process's lifespan fails (no room in /dev/shm for a 57 TiB shard): uvicorn's
    supervisor stops the rest, and ``serve`` says so with exit status 3, not 0."""
    cmd = [*MODULE, "demo", "serve", "--gateway-workers", "2", "--name", shm_name]
    cmd += ["--cache-mb", str(60 << 20)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert "ShmSpaceError" in out.stderr, out.stderr[-3000:]
    assert out.returncode == 3, out.stderr[-3000:]


@pytest.mark.parametrize(
    ("args", "code", "what"),
    [
        (["http://127.0.0.1:1"], 1, "cannot reach the gateway"),
        (["not-a-url"], 1, "cannot reach the gateway"),
        (["http://127.0.0.1:1", "no-such-image.png"], 2, "cannot read an image"),
        (["http://127.0.0.1:1", "README.md"], 2, "cannot read an image"),
    ],
    ids=["refused", "not-a-url", "missing-file", "not-an-image"],
)
def test_the_example_client_says_what_went_wrong_in_one_line(
    args: list[str], code: int, what: str
) -> None:
    """No gateway at the URL, or an image file it cannot read: one line, never a traceback."""
    cmd = [sys.executable, str(ROOT / "examples" / "client.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert what in out.stderr.strip().splitlines()[-1], out.stderr


def test_a_group_engine_worker_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, shm_name: str
) -> None:
    """``examples/fastapi_app.py --engine``: a group name no gateway could have (a usage error,
    exit 2), a socket in no directory, a socket another engine worker serves (exit 1): one
    line each, never a traceback."""
    app = [sys.executable, str(ROOT / "examples" / "fastapi_app.py"), "--engine"]
    sock = str(tmp_path / "engine.sock")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*app, *args], capture_output=True, text=True, timeout=120)

    bad_name = run("--group", "a.b", "--socket", sock)
    no_dir = run("--group", shm_name, "--socket", str(tmp_path / "no" / "engine.sock"))
    first = subprocess.Popen([*app, "--group", shm_name, "--socket", sock])
    try:
        assert wait_until(lambda: os.path.exists(sock), timeout=60)
        in_use = run("--group", shm_name, "--socket", sock)
    finally:
        first.terminate()  # SIGTERM: it stops serving
        assert first.wait(30) == 0
    for out, code, what in (
        (bad_name, 2, "invalid group name"),
        (no_dir, 1, "No such file or directory"),
        (in_use, 1, "another engine worker serves"),
    ):
        assert out.returncode == code, out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        assert what in out.stderr.strip().splitlines()[-1], out.stderr
