"""Child-process bodies for the multi-process tests (spawned, so they must be importable)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .helpers import checksum


def reader_loop(handle: Any, conn: Any) -> None:
    """Attach, then answer each message: a ref dict -> (key, ok or error name); None -> stop."""
    from aioshmcache import ReceiverCache, ShmCacheError, ShmRef

    rx = ReceiverCache.attach(handle)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg == "sleep":
            time.sleep(3600)
        try:
            value = rx.store.get(ShmRef.from_dict(msg["ref"]))
            ok = checksum(value["data"]) == value["crc"] == msg.get("crc", value["crc"])
            conn.send((msg["key"], "ok" if ok else "WRONG"))
        except ShmCacheError as exc:
            conn.send((msg["key"], type(exc).__name__))
    rx.close()
    conn.send(("done", 0))


def writer_forever(name: str, conn: Any) -> None:
    """Create a cache and put big items forever (to be SIGKILLed mid-put)."""
    from aioshmcache import CacheConfig, SenderCache

    cache = SenderCache(CacheConfig(256 << 20, 80 << 20, 2, name=name))
    big = {"data": np.ones(64 << 20, np.uint8)}
    ref, _ = cache.get_and_update_item(({"data": np.arange(10), "crc": 0}, ()), "small")
    conn.send(ref.to_dict())
    i = 0
    while True:
        cache.get_and_update_item((big, ()), f"big{i}")
        i += 1


def one_of_n_reader(handle: Any, queue: Any, results: Any) -> None:
    """Take refs from a shared queue (each read by exactly one reader); report the keys read."""
    from aioshmcache import ReceiverCache, ShmRef

    rx = ReceiverCache.attach(handle)
    results.put(("ready", os.getpid()))
    seen: list[str] = []
    bad = 0
    while True:
        msg = queue.get(timeout=60)
        if msg is None:
            break
        value = rx.store.get(ShmRef.from_dict(msg["ref"]))
        if checksum(value["data"]) != value["crc"]:
            bad += 1
        seen.append(msg["key"])
    rx.close()
    results.put(("done", seen, bad))


def attach_and_exit(handle: Any) -> None:
    from aioshmcache import ReceiverCache

    ReceiverCache.attach(handle)  # never closed: the process just ends


def slow_acker(handle: Any, conn: Any) -> None:
    """Attach, say ready, then on each message wait ``delay`` s and read the refs given."""
    from aioshmcache import ReceiverCache, ShmRef

    rx = ReceiverCache.attach(handle)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        delay, refs = msg
        time.sleep(delay)
        for r in refs:
            rx.store.get(ShmRef.from_dict(r))
        conn.send(time.monotonic())
    rx.close()


def async_receiver(handle: Any, conn: Any) -> None:
    """An asyncio reader: gets lists of (hash, ref dict, crc) and answers with checksums ok."""
    import asyncio

    from aioshmcache import AsyncReceiverCache, FeatureSpec, ShmRef

    async def run() -> None:
        async with AsyncReceiverCache.attach(handle) as rx:
            conn.send("ready")
            loop = asyncio.get_running_loop()
            while True:
                msg = await loop.run_in_executor(None, conn.recv)
                if msg is None:
                    break
                feats = [FeatureSpec(h, ShmRef.from_dict(d)) for h, d, _crc in msg]
                out = await rx.get_and_update_features(feats)
                conn.send([checksum(f.data["data"]) == crc for f, (_h, _d, crc) in zip(out, msg)])

    asyncio.run(run())


def sweeper_loop(name: str, stop: Any, passes: Any) -> None:
    """Sweep one name over and over until ``stop`` is set; count the passes in ``passes``."""
    from aioshmcache import sweep

    while not stop.is_set():
        sweep(name=name)
        with passes.get_lock():
            passes.value += 1


# --- process trees a test starts -----------------------------------------------------------------
#: the environment variable that marks every process of one test's tree (inherited by every
#: descendant, whatever session or process group it moves to, and kept when it is orphaned)
TREE_TAG_ENV = "AIOSHM_TEST_TREE"


def tagged_env(tag: str) -> dict[str, str]:
    """The environment for a process tree a test can find again (:func:`tree_pids`)."""
    return dict(os.environ, **{TREE_TAG_ENV: tag})


def pids_with_env(entry: str) -> list[int]:
    """Live processes of this user whose environment holds ``entry`` (``NAME=value``)."""
    needle = entry.encode() + b"\0"
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or not ours
        if needle in env or env.endswith(needle[:-1]):
            found.append(int(d))
    return found


def tree_pids(tag: str) -> list[int]:
    """The processes of the tree started with ``tagged_env(tag)`` that are still alive."""
    return pids_with_env(f"{TREE_TAG_ENV}={tag}")


def kill_pids(pids: list[int], timeout: float = 30.0) -> list[int]:
    """SIGKILL ``pids`` and wait (bounded) until every thread of them has exited; returns those
    that have not."""
    import signal

    from .helpers import gone, wait_until

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    return [pid for pid in pids if not wait_until(lambda p=pid: gone(p), timeout=timeout)]


def kill_tree(tag: str, *, sweep_prefix: str | None = None) -> list[int]:
    """End a test's process tree on any path (a timeout included): SIGKILL every process of
    it, wherever it went, then remove the segments it left (``sweep_prefix``: their name
    prefix; only orphans go, so a live writer elsewhere is never touched). Returns the pids
    that were still running."""
    from aioshmcache import sweep

    left = tree_pids(tag)
    kill_pids(left)
    for _ in range(10):  # one that forked while it was being killed
        if not (more := tree_pids(tag)):
            break
        kill_pids(more)
        left += more
    if sweep_prefix is not None:
        sweep(prefix=sweep_prefix)
    return left
