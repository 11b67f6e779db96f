"""Helpers shared by tests (importable from spawned child processes)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from aioshmcache import MsgpackSerde

SPAWN = mp.get_context("spawn")


def checksum(arr: np.ndarray[Any, Any]) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)


def count_sender_requests(monkeypatch: Any) -> list[object]:
    """The arguments of every ``SenderRequest`` made from now on (its class patched, so every
    module naming it counts): a call that took the core's one-item miss makes none."""
    from aioshmcache._request import SenderRequest

    made: list[object] = []
    init = SenderRequest.__init__

    def counted(self: Any, *a: Any, **k: Any) -> None:
        made.append(a)
        init(self, *a, **k)

    monkeypatch.setattr(SenderRequest, "__init__", counted)
    return made


def random_item(rng: np.random.Generator, nbytes: int) -> dict[str, Any]:
    data = rng.integers(0, 255, size=max(1, nbytes), dtype=np.uint8)
    return {"data": data, "crc": checksum(data)}


class FakeClock:
    """A clock the test moves by hand: TTLs and revocation limits tested without sleeping.

    Set it as a store's ``ledger.clock`` (every hand-out time, touch and acknowledgement time is
    read from it), then ``advance`` past the limit: no wall-clock wait that load could stretch.
    """

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not reaped yet).

    Every thread of it, not only the main one: a killed process whose main thread is a zombie
    already may still have threads exiting, and its descriptors (a writer's kernel lock among
    them) are closed only when the last one is done.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return False
        except OSError:
            continue  # that thread is gone
    return True


def kill_and_reap(proc: Any, sig: int = signal.SIGKILL) -> None:
    if proc.is_alive():
        os.kill(proc.pid, sig)
    proc.join(10)


class HookAfterRead(MsgpackSerde):
    """A serde whose next read runs ``hook`` right after decoding: something another thread
    does mid-read (the writer clears, evicts and reuses the chunk) before the read's re-check."""

    hook: Any = None

    def read(self, buf: memoryview, *, copy: bool = True) -> object:
        value = super().read(buf, copy=copy)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return value


ROOT = Path(__file__).resolve().parent.parent


def run_quick_bench(
    cwd: Path, suite: str | None = None, *, timeout: float = 240
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run ``python -m aioshmcache bench --quick`` (``--suite suite``) in ``cwd``, where it
    writes its results; its JSON results and the finished process (which must have succeeded)."""
    args = ["--suite", suite] if suite else []
    proc = subprocess.run(
        [sys.executable, "-m", "aioshmcache", "bench", "--quick", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    stem = f"aioshmcache-bench-{suite}-quick" if suite else "aioshmcache-bench-quick"
    data: dict[str, Any] = json.loads((cwd / f"{stem}.json").read_text("utf-8"))
    return data, proc
