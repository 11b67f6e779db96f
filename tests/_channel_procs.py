"""Engine worker bodies for the channel tests (spawned, so they must be importable)."""

from __future__ import annotations

import asyncio
import os
import signal
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from aioshmcache import AsyncReceiverCache, FeatureSpec
from aioshmcache.channel import serve_engine


def crc(arr: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)


class HandlerBaseError(BaseException):
    """A ``BaseException`` that is not the process's own end (as some libraries raise)."""


class UnprintableError(Exception):
    """An exception whose ``str()`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no message today")


#: the ``raise`` op's runs in this process (an in-process worker's), by kind
RAISED: list[str] = []


async def handler(features: list[FeatureSpec], payload: Any) -> Any:
    """What the tests ask of a worker, by ``payload["op"]``."""
    op = payload.get("op", "crc") if isinstance(payload, dict) else "crc"
    if op == "sleep":
        if "mark" in payload:  # tells the test the call reached the handler
            Path(payload["mark"]).touch()  # noqa: ASYNC240 (a test marker: one tiny file)
        await asyncio.sleep(float(payload["s"]))
    elif op == "fail":
        raise ZeroDivisionError("the handler divided by zero")
    elif op == "cancelled":  # a CancelledError of the handler's own (the worker is not cancelled)
        raise asyncio.CancelledError("the handler's own cancellation")
    elif op == "base":
        raise HandlerBaseError("a BaseException from a library")
    elif op == "raise":  # an exception whose message is hard to send; each run counted
        RAISED.append(payload["kind"])
        if payload["kind"] == "surrogate":  # as a file name's undecodable bytes give
            raise ValueError("no file named b\udcff.txt")
        if payload["kind"] == "str-raises":
            raise UnprintableError()
        raise ValueError("x" * int(payload["n"]))
    elif op == "big":
        return {"big": np.zeros(int(payload["n"]), dtype=np.uint8)}
    elif op == "unencodable":
        return {"x": object()}
    elif op == "int_keys":  # map keys neither form of an envelope carries
        return {"x": {1: "a", None: "b"}}
    elif op == "echo":
        return {"payload": payload, "pid": os.getpid()}
    return {
        "pid": os.getpid(),
        "hashes": [f.mm_hash for f in features],
        "crcs": [crc(f.data["x"]) for f in features],
        "tag": payload.get("tag") if isinstance(payload, dict) else None,
        "first": np.asarray(features[0].data["x"][:4]).copy() if features else None,
    }


def engine_main(path: str, handle: Any, lease: bool = False) -> None:
    """Attach to ``handle`` (a handle, or a group name when ``group``), serve until SIGTERM."""

    async def main() -> None:
        async with AsyncReceiverCache.attach(handle) as rx:
            await serve_engine(
                path, handler, rx, lease=lease, shutdown_signals=(signal.SIGTERM, signal.SIGINT)
            )

    asyncio.run(main())


def crash(path: str) -> None:
    """An engine worker that cannot start."""
    raise RuntimeError(f"no engine for {path} today")


def gateway_starting_a_worker(path: str, name: str, conn: Any) -> None:
    """A gateway whose ``EngineClient(start=)`` starts the engine worker; says "ready" once the
    worker answered, then waits to be killed."""
    import functools

    from aioshmcache import AsyncSenderCache, CacheConfig
    from aioshmcache.channel import EngineClient

    async def main() -> None:
        start = functools.partial(engine_main, handle=name)
        async with (
            AsyncSenderCache.from_config(CacheConfig(1 << 20, 1 << 19, 1, name=name)) as cache,
            EngineClient.connect(path, cache=cache, start=start) as engine,
        ):
            await engine.call([], payload={"op": "echo"}, timeout=60)
            conn.send("ready")
            await asyncio.sleep(3600)

    asyncio.run(main())


def bare_worker(path: str) -> None:
    """An engine worker that is never called (no cache), serving until SIGTERM or SIGINT."""

    async def main() -> None:
        receiver: Any = None
        await serve_engine(
            path, handler, receiver, shutdown_signals=(signal.SIGTERM, signal.SIGINT)
        )

    asyncio.run(main())


def gateway_killed_while_starting_a_worker(path: str, conn: Any) -> None:
    """A gateway whose ``EngineClient(start=)`` starts a bare worker; sends that worker's pid as
    soon as it is spawned (before it has run any of its own code), then waits to be killed."""
    import multiprocessing

    from aioshmcache.channel import EngineClient

    async def main() -> None:
        async with EngineClient.connect(path, start=bare_worker):
            while not (children := multiprocessing.active_children()):  # noqa: ASYNC110 (no event to wait for)
                await asyncio.sleep(0.001)
            conn.send(children[0].pid)
            await asyncio.sleep(3600)

    asyncio.run(main())
