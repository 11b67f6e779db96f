"""An engine worker process: a cache reader that turns references back into tensors.

Started by the gateway as ``python -m aioshmcache demo worker ...`` (a fresh interpreter: no
state inherited from the gateway, like the ``spawn`` start method). It attaches to the gateway's
segment with ``AsyncReceiverCache.attach(handle)``, connects to the gateway's Unix socket, says
hello, and then serves ``infer`` messages: it resolves each request's features with
``await rx.get_and_update_features(...)`` and answers with a summary of every image (shape, a
CRC-32 of the ``pixel_values`` bytes and a small deterministic embedding) that proves it read
exactly the tensors the gateway preprocessed.

Reads through the receiver are serialised by one ``asyncio.Lock`` (an engine's input stage is
sequential, and one reader slot has one acknowledgement log written by one thread at a time);
the embedding is computed outside it. Errors become typed replies: a ``CacheMissError`` (stale
references) is ``cache_miss`` with the hashes, which the gateway answers with ``invalidate``
and a resend. The worker ignores SIGINT (the gateway owns its lifetime), stops on ``stop``,
SIGTERM, or when the gateway's socket closes, and frees its reader slot on the way out.

With ``--group G --dir D`` (the demo's ``--gateway-workers N``) the worker is started once by
the serving process, not by a gateway: it attaches to the whole cache group
(``AsyncReceiverCache.attach_group``), connects to every gateway process's socket it finds in
``D`` (``gw-<pid>.sock``, looked for every 0.1 s) and serves each connection as above; a
``stop`` or the end of one connection ends that connection only. A reference from a gateway
process that died is a ``WriterGoneError`` reply, not the worker's end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import signal
import sys
from typing import Any

import anyio.to_thread

from aioshmcache import (
    AsyncReceiverCache,
    CacheHandle,
    CacheMissError,
    InvalidReferenceError,
    ReaderEvictedError,
    ShmCacheError,
    WriterGoneError,
)

from ..framing import ProtocolError, read_frame, write_frame
from .imaging import ProcessorConfig, summarize
from .ipc import decode_features

__all__ = ["main", "serve_worker"]

TOKEN_ENV = "AIOSHM_DEMO_TOKEN"
EXIT_EVICTED = 3


class _Worker:
    def __init__(
        self,
        rx: AsyncReceiverCache,
        writer: asyncio.StreamWriter,
        index: int,
        processor: ProcessorConfig,
        read_lock: asyncio.Lock | None = None,
        group: bool = False,
    ) -> None:
        self.rx = rx
        self.writer = writer
        self.index = index
        self.processor = processor
        self.read_lock = read_lock or asyncio.Lock()
        self.group = group
        self.write_lock = asyncio.Lock()
        self.fatal: BaseException | None = None
        self.served = 0

    async def handle(self, msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        reply: dict[str, Any] = {"t": "result", "id": rid}
        try:
            features = decode_features(msg.get("features"))
            async with self.read_lock:
                resolved = await self.rx.get_and_update_features(features)
            items = [f.data for f in resolved]
            summaries = await anyio.to_thread.run_sync(
                lambda: [summarize(it, self.processor) for it in items]
            )
            for f, s in zip(resolved, summaries):
                s["mm_hash"] = f.mm_hash
            reply.update(ok=True, results=summaries, worker=self.index, pid=os.getpid())
            self.served += 1
        except CacheMissError as exc:
            reply.update(
                ok=False, error="cache_miss", message=str(exc), mm_hashes=list(exc.mm_hashes)
            )
        except InvalidReferenceError as exc:
            reply.update(ok=False, error="invalid_reference", message=str(exc))
        except (WriterGoneError, ReaderEvictedError) as exc:
            reply.update(ok=False, error=type(exc).__name__, message=str(exc))
            if not (self.group and isinstance(exc, WriterGoneError)):
                self.fatal = exc
        except (ProtocolError, ShmCacheError, ValueError, TypeError, KeyError) as exc:
            reply.update(ok=False, error="bad_request", message=f"{type(exc).__name__}: {exc}")
        await write_frame(self.writer, reply, self.write_lock)


async def serve_worker(
    socket_path: str, index: int, handle: dict[str, Any], processor: ProcessorConfig, token: str
) -> int:
    """The worker's main coroutine; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks: set[asyncio.Task[None]] = set()
    async with AsyncReceiverCache.attach(CacheHandle.from_dict(handle)) as rx:
        reader, writer = await asyncio.open_unix_connection(socket_path)
        worker = _Worker(rx, writer, index, processor)
        try:
            hello = {"t": "hello", "worker": index, "pid": os.getpid(), "token": token}
            await write_frame(writer, hello, worker.write_lock)
            stop_wait = asyncio.ensure_future(stop.wait())
            try:
                while worker.fatal is None:
                    read = asyncio.ensure_future(read_frame(reader))
                    done, _ = await asyncio.wait(
                        {read, stop_wait}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if read not in done:
                        read.cancel()
                        break
                    msg = read.result()
                    if msg is None or msg["t"] == "stop":
                        break
                    if msg["t"] == "infer":
                        task = asyncio.ensure_future(worker.handle(msg))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
            finally:
                stop_wait.cancel()
            if tasks:  # let requests in flight finish (bounded)
                await asyncio.wait(tasks, timeout=5.0)
            for t in tasks:
                t.cancel()
        except (ConnectionError, ProtocolError) as exc:
            print(f"worker {index}: channel error: {exc}", file=sys.stderr)
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, asyncio.TimeoutError):
                pass
        if isinstance(worker.fatal, ReaderEvictedError):
            print(f"worker {index}: {worker.fatal}; exiting", file=sys.stderr)
            return EXIT_EVICTED
    return 0


async def _serve_connection(
    worker: _Worker, reader: asyncio.StreamReader, stop: asyncio.Event, token: str
) -> None:
    """One gateway's connection: hello, then ``infer`` until stop, EOF or a fatal error."""
    tasks: set[asyncio.Task[None]] = set()
    hello = {"t": "hello", "worker": worker.index, "pid": os.getpid(), "token": token}
    await write_frame(worker.writer, hello, worker.write_lock)
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        while worker.fatal is None:
            read = asyncio.ensure_future(read_frame(reader))
            done, _ = await asyncio.wait({read, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                break
            msg = read.result()
            if msg is None or msg["t"] == "stop":
                break
            if msg["t"] == "infer":
                task = asyncio.ensure_future(worker.handle(msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        stop_wait.cancel()
        if tasks:  # let requests in flight finish (bounded)
            await asyncio.wait(tasks, timeout=5.0)
        for t in tasks:
            t.cancel()
        worker.writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(worker.writer.wait_closed(), 1.0)


async def serve_group_worker(
    group: str, sock_dir: str, index: int, processor: ProcessorConfig, token: str
) -> int:
    """A worker of a cache group, serving every gateway process found in ``sock_dir``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    read_lock = asyncio.Lock()  # one reader (one slot per shard) for every connection
    conns: dict[str, asyncio.Task[None]] = {}
    evicted: list[BaseException] = []
    async with AsyncReceiverCache.attach_group(group) as rx:
        while not stop.is_set() and not evicted:
            for path in sorted(glob.glob(os.path.join(sock_dir, "gw-*.sock"))):
                if path in conns:
                    continue
                try:
                    reader, writer = await asyncio.open_unix_connection(path)
                except OSError:
                    continue  # not listening yet, or gone: looked for again
                worker = _Worker(rx, writer, index, processor, read_lock, group=True)

                async def serve(w: _Worker = worker, r: asyncio.StreamReader = reader) -> None:
                    try:
                        await _serve_connection(w, r, stop, token)
                    except (ConnectionError, ProtocolError) as exc:
                        print(f"worker {index}: channel error: {exc}", file=sys.stderr)
                    if isinstance(w.fatal, ReaderEvictedError):
                        evicted.append(w.fatal)

                conns[path] = asyncio.ensure_future(serve())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
        stop.set()
        if conns:
            await asyncio.wait(conns.values(), timeout=10.0)
    if evicted:
        print(f"worker {index}: {evicted[0]}; exiting", file=sys.stderr)
        return EXIT_EVICTED
    return 0


def main(argv: list[str]) -> int:
    """``python -m aioshmcache demo worker --socket P --index I --handle JSON [...]``."""
    p = argparse.ArgumentParser(prog="python -m aioshmcache demo worker")
    p.add_argument("--socket")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--handle", help="CacheHandle.to_dict() as JSON")
    p.add_argument("--group", help="attach to this cache group instead (with --dir)")
    p.add_argument("--dir", help="with --group: where the gateway processes' sockets are")
    p.add_argument("--processor", default="{}", help="ProcessorConfig fields as JSON")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ns = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the gateway's to handle
    proc_fields = json.loads(ns.processor)
    for k in ("image_mean", "image_std"):
        if k in proc_fields:
            proc_fields[k] = tuple(proc_fields[k])
    processor = ProcessorConfig(**proc_fields)
    token = os.environ.get(TOKEN_ENV, "")
    if ns.group:
        if not ns.dir:
            p.error("--group needs --dir")
        coro = serve_group_worker(ns.group, ns.dir, ns.index, processor, token)
    elif ns.handle and ns.socket:
        coro = serve_worker(ns.socket, ns.index, json.loads(ns.handle), processor, token)
    else:
        p.error("give --socket and --handle, or --group and --dir")
    try:
        if ns.loop == "uvloop":
            import uvloop

            return uvloop.run(coro)
        return asyncio.run(coro)
    except (WriterGoneError, ConnectionError, FileNotFoundError) as exc:
        print(f"worker {ns.index}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
