"""The channel's round trip (``aioshmcache.channel``) next to a bare asyncio Unix-socket exchange.

    python bench/bench_channel.py [--quick] [--loop asyncio|uvloop] [--hog N] [--cpu N]

One engine worker process serves two sockets: ``serve_engine`` (reads the call's features with an
``AsyncReceiverCache``, answers ``{"n": bytes read}``) and a bare asyncio server that reads one
length-prefixed message and answers 8 bytes. The gateway side, in this process, times:

* ``bare``: N bytes through a bare asyncio Unix socket, 8 bytes back (the floor for inline);
* ``channel ref``: a cache hit (a new hand-out of the cached N-byte item) and an
  ``EngineClient.call`` with the reference: the worker copies the item out of shared memory
  (on the loop below the receiver's ``inline_threshold_bytes``, 2 MiB by default; in a worker
  thread above it: the 16 MiB row);
* ``channel ref, lease``: the same with ``serve_engine(lease=True)``: the handler gets views into
  shared memory, no copy (the call's fixed cost alone);
* ``channel ref, loop read``: the same as ``channel ref`` with a receiver that copies every item
  on the event loop (``inline_threshold_bytes`` above the item): no thread hop, the loop blocked
  for the copy (an engine worker whose loop serves nothing else may choose it);
* ``channel inline``: an ``EngineClient.call`` with the N-byte item itself in the frame;
* ``bare 64 B``: 64 bytes through the bare socket (the floor for a reference's round trip).

Every figure is the median of repeated sequential round trips, printed with its ratio to the
bare figure of the same row measured in the same run. ``--hog N`` runs N busy processes (pure
Python loops) beside the benchmark: the same figures on a loaded machine. ``--cpu N`` adds N
sequential 1 KiB calls by reference and N bare 64-byte echoes, with the CPU time each process
spent per round trip (``/proc/<pid>/schedstat``: user and system, the two processes apart).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheConfig,
    FeatureSpec,
    ReceiverCache,
)
from aioshmcache.channel import EngineClient, serve_engine

KiB, MiB = 1 << 10, 1 << 20
SIZES = [(KiB, "1 KiB"), (MiB, "1 MiB"), (16 * MiB, "16 MiB")]
_LEN = struct.Struct("<Q")


async def _read_n(features: list[FeatureSpec], payload: Any) -> dict[str, int]:
    return {"n": sum(int(f.data["x"].nbytes) for f in features)}


async def _bare(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            await reader.readexactly(n)
            writer.write(_LEN.pack(n))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass  # the client hung up, or the worker is stopping
    finally:
        writer.close()


def worker(handle: Any, channel_path: str, bare_path: str, loop: str) -> None:
    """The engine worker process: ``serve_engine`` (copying, and leasing) and the bare server."""

    async def main() -> None:
        server = await asyncio.start_unix_server(_bare, bare_path)
        sync_rx = ReceiverCache.attach(handle)
        try:
            async with (
                server,
                AsyncReceiverCache(
                    sync_rx
                ) as rx,  # borrows the reader: copies big reads in a thread
                AsyncReceiverCache(sync_rx, inline_threshold_bytes=1 << 30) as on_loop,
            ):
                others = [
                    asyncio.ensure_future(
                        serve_engine(_lease_path(channel_path), _read_n, rx, lease=True)
                    ),
                    asyncio.ensure_future(serve_engine(_loop_path(channel_path), _read_n, on_loop)),
                ]
                try:
                    await serve_engine(channel_path, _read_n, rx, shutdown_signals=(15,))
                finally:
                    for task in others:
                        task.cancel()
                    await asyncio.gather(*others, return_exceptions=True)
        finally:
            sync_rx.close()

    _run(main(), loop)


def _lease_path(channel_path: str) -> str:
    return channel_path + ".lease"


def _loop_path(channel_path: str) -> str:
    return channel_path + ".loop"


def _hog() -> None:
    """A busy process: a pure Python loop until terminated."""
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def _run(coro: Any, loop: str) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


async def _median_us(fn: Callable[[], Awaitable[Any]], reps: int) -> float:
    for _ in range(min(5, reps)):  # warm up
        await fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _cpu_ns(pid: int | str = "self") -> int:
    """The CPU time the process's main thread has run, in ns (Linux)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


async def _cpu_per_call(
    fn: Callable[[], Awaitable[Any]], reps: int, worker_pid: int
) -> tuple[float, float, float]:
    """Median wall time of ``fn``, and the CPU per call of this process and of the worker (us)."""
    for _ in range(min(200, reps)):
        await fn()
    times = []
    g0, w0 = _cpu_ns(), _cpu_ns(worker_pid)
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    g1, w1 = _cpu_ns(), _cpu_ns(worker_pid)
    return statistics.median(times) * 1e6, (g1 - g0) / reps / 1e3, (w1 - w0) / reps / 1e3


async def measure(quick: bool, loop: str, cpu: int = 0) -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="aioshm-bench-")
    channel_path, bare_path = os.path.join(tmp, "engine.sock"), os.path.join(tmp, "bare.sock")
    config = CacheConfig(256 * MiB, 64 * MiB, 1)
    rows = []
    async with AsyncSenderCache.from_config(config) as cache:
        proc = mp.get_context("spawn").Process(
            target=worker, args=(cache.handle(), channel_path, bare_path, loop)
        )
        proc.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(bare_path)
                    break
                except OSError:
                    if time.monotonic() > deadline or not proc.is_alive():
                        raise RuntimeError("the worker did not start") from None
                    await asyncio.sleep(0.05)

            payloads = {64: bytes(64)}  # made before the clock, as the channel's items are

            async def bare(n: int) -> None:
                writer.write(_LEN.pack(n))
                writer.write(payloads[n])
                await writer.drain()
                await reader.readexactly(_LEN.size)

            async with (
                EngineClient.connect(channel_path, cache=cache, max_connections=1) as eng,
                EngineClient.connect(
                    _lease_path(channel_path), cache=cache, max_connections=1
                ) as leasing,
                EngineClient.connect(
                    _loop_path(channel_path), cache=cache, max_connections=1
                ) as on_loop,
            ):
                for nbytes, label in SIZES:
                    reps = (20 if quick else 60) if nbytes >= 16 * MiB else (50 if quick else 300)
                    item = {"x": np.random.default_rng(1).integers(0, 255, nbytes, np.uint8)}
                    key = f"item-{nbytes}"
                    payloads[nbytes] = bytes(nbytes)
                    [first] = await cache.get_and_update_features([FeatureSpec(key, item)])
                    assert (await eng.call([first]))["n"] == nbytes

                    async def ref_call(
                        key: str = key, n: int = nbytes, engine: EngineClient = eng
                    ) -> None:
                        [f] = await cache.get_and_update_features([FeatureSpec(key, None)])
                        if (await engine.call([f], timeout=60))["n"] != n:
                            raise RuntimeError("wrong answer")

                    async def inline_call(item: Any = item, n: int = nbytes) -> None:
                        if (await eng.call([FeatureSpec("inline", item)]))["n"] != n:
                            raise RuntimeError("wrong answer")

                    if cpu and nbytes == KiB:
                        for what, fn in (
                            ("ref", ref_call),
                            ("bare64", functools.partial(bare, 64)),
                        ):
                            wall, gw, wk = await _cpu_per_call(fn, cpu, proc.pid or 0)
                            rows.append({"cpu": what, "wall": wall, "gateway": gw, "worker": wk})
                    rows.append(
                        {
                            "size": label,
                            "bare": await _median_us(functools.partial(bare, nbytes), reps),
                            "bare64": await _median_us(functools.partial(bare, 64), reps),
                            "ref": await _median_us(ref_call, reps),
                            "lease": await _median_us(
                                functools.partial(ref_call, engine=leasing), reps
                            ),
                            "loop": await _median_us(
                                functools.partial(ref_call, engine=on_loop), reps
                            ),
                            "inline": await _median_us(inline_call, reps),
                        }
                    )
            writer.close()
        finally:
            if proc.is_alive():
                proc.terminate()
            proc.join(30)
            shutil.rmtree(tmp, ignore_errors=True)  # the bare server's socket file stays behind
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a markdown table (medians in microseconds, ratios to the bare rows)."""
    out = [
        "| size | bare N bytes | channel inline | x bare | bare 64 B | channel ref | x bare 64 B "
        "| ref, lease | x bare 64 B | ref, loop read | x bare 64 B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['size']} | {r['bare']:.0f} us | {r['inline']:.0f} us | "
        f"{r['inline'] / r['bare']:.2f} | {r['bare64']:.0f} us | {r['ref']:.0f} us | "
        f"{r['ref'] / r['bare64']:.2f} | {r['lease']:.0f} us | {r['lease'] / r['bare64']:.2f} | "
        f"{r['loop']:.0f} us | {r['loop'] / r['bare64']:.2f} |"
        for r in rows
        if "size" in r
    ]
    out += [
        f"{r['cpu']}: median {r['wall']:.1f} us, CPU per call: gateway "
        f"{r['gateway']:.1f} us, worker {r['worker']:.1f} us"
        for r in rows
        if "cpu" in r
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    p.add_argument("--hog", type=int, default=0, help="busy processes to run beside it")
    p.add_argument("--cpu", type=int, default=0, help="also count CPU per call over N calls")
    ns = p.parse_args(argv)
    hogs = [mp.get_context("spawn").Process(target=_hog, daemon=True) for _ in range(ns.hog)]
    for h in hogs:
        h.start()
    try:
        rows = _run(measure(ns.quick, ns.loop, ns.cpu), ns.loop)
    finally:
        for h in hogs:
            h.terminate()
            h.join(10)
    hog = f", beside {ns.hog} busy processes" if ns.hog else ""
    print(f"loop {ns.loop}, median of sequential round trips, one connection{hog}")
    print(table(rows))
    return 0


if __name__ == "__main__":  # the guard matters: the benchmark spawns a worker process
    sys.exit(main(sys.argv[1:]))
