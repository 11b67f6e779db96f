"""A FastAPI gateway that preprocesses images once and hands the tensors to an engine worker.

    uvicorn --loop uvloop --app-dir examples fastapi_app:app --host 127.0.0.1 --port 8000

The pieces, in the order a request meets them (docs/fastapi.md explains each):

- the lifespan creates the ``AsyncSenderCache`` (the writer: it owns the segment) and starts
  one engine worker process with the ``spawn`` start method, giving it the cache's handle as
  JSON; the worker attaches with ``AsyncReceiverCache`` and connects back over a Unix socket;
- ``POST /v1/embed`` takes ``{"mm_hash", "pixels"?, "height"?, "width"?}`` (pixels: base64 of
  ``height * width * 3`` RGB bytes; ``mm_hash``: :func:`image_hash` of them). Hash first: a
  client sends the hash alone; if the gateway does not hold it the answer is 409
  ``{"error": "cache_miss", "missing": [...]}`` and the client resends with the pixels;
- ``get_or_put`` runs the preprocessing once per new hash, however many requests carry it at
  the same moment, and gives each request its own hand-out;
- the features travel to the worker as ``aioshmcache.wire`` frames: a reference (a few dozen
  bytes) or, when the item could not be cached, the tensors themselves;
- the worker reads them, acknowledges them, and answers with a CRC-32 of the tensor it read;
- ``GET /metrics`` is Prometheus text from ``aioshmcache.metrics.CacheCollector``; ``GET /stats``
  is the cache snapshot and the single-flight counters as JSON; ``GET /healthz`` says ready.

Settings (environment): ``AIOSHM_EXAMPLE_NAME`` (segment name; random if unset; must be unique
per gateway process), ``AIOSHM_EXAMPLE_CACHE_MB`` (default 512), ``AIOSHM_EXAMPLE_MAX_OBJECT_MB``
(default 32: a 1080p photo is 23.7 MiB once preprocessed to float32).

Without a group, one gateway process is the cache's single writer: do not run it with
``uvicorn --workers N`` (every process would create its own segment; with
``AIOSHM_EXAMPLE_NAME`` set, all but the first fail with ``SegmentExistsError``, and uvicorn
stops the whole server). Scale the engine workers instead, or use a cache group:

Several gateway processes (``uvicorn --workers N``): set ``AIOSHM_GROUP`` (a cache group name)
and ``AIOSHM_ENGINE_SOCKET`` (a Unix socket path), and start ONE engine worker for the whole
group yourself, before or after the gateways::

    python examples/fastapi_app.py --engine --group mm --socket /tmp/mm-engine.sock &
    AIOSHM_GROUP=mm AIOSHM_ENGINE_SOCKET=/tmp/mm-engine.sock \
        uvicorn --workers 2 --app-dir examples fastapi_app:app --port 8000

Each gateway process's lifespan then opens its own shard of the group (``CacheConfig(group=)``;
uvicorn spawns its workers, so each opens its shard in its own process) and connects to the
engine worker, which is attached to the whole group (``AsyncReceiverCache.attach_group``) and
serves every gateway on the one socket. Why the engine worker is not started by a gateway
process: with ``--workers N`` each process runs its own lifespan, and none of them is special
(the one holding shard 0 may die and be replaced); a process of its own, started by whatever
starts uvicorn (systemd, the container's entry point, a test), has one clear owner. An image
preprocessed by one gateway process is a hit in the others: their ``is_cached_item`` finds it
in the sibling's shard and ``get_or_put`` copies it into their own instead of preprocessing
(``/stats``: ``cache.sibling_hits``). Stop the gateways first (each unlinks its shard), then
the engine worker (SIGTERM or SIGINT: it closes its reader and exits).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import struct
import tempfile
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheConfig,
    CacheMissError,
    FeatureSpec,
    GroupReceiverCache,
    ShmRef,
    coerce_handle,
)
from aioshmcache.errors import EndOfFramesError
from aioshmcache.metrics import CacheCollector
from aioshmcache.wire import pack_features, read_frame, unpack_features, write_frame

MiB = 1 << 20
#: frames carry at most one inline 1080p image and then some; a bigger frame is refused
MAX_FRAME_BYTES = 64 * MiB
MAX_PIXELS = 4096 * 4096
START_TIMEOUT = 60.0
ENGINE_TIMEOUT = 60.0
_RID = struct.Struct("<Q")  # every frame starts with the request id it belongs to

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def image_hash(pixels: bytes, height: int, width: int) -> str:
    """The ``mm_hash`` of an image: BLAKE2b-128 of its size and RGB bytes, in hex."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{height}x{width}:".encode())
    h.update(pixels)
    return h.hexdigest()


def preprocess(pixels: bytes, height: int, width: int) -> dict[str, Any]:
    """RGB bytes to normalised float32 CHW tensors: 4 bytes per channel value, 12 per pixel."""
    img = np.frombuffer(pixels, np.uint8).reshape(height, width, 3)
    x = (img.transpose(2, 0, 1).astype(np.float32) / 255.0 - MEAN) / STD
    return {"pixel_values": np.ascontiguousarray(x), "image_size": np.array([height, width])}


def tensor_crc(item: Any) -> int:
    """CRC-32 of the pixel tensor's bytes: what the worker answers, to prove what it read."""
    arr = np.ascontiguousarray(item["pixel_values"])
    return zlib.crc32(arr.view(np.uint8).reshape(-1).data)


def engine_main(handle_json: str, socket_path: str) -> None:
    """Entry point of the worker process (started with ``spawn``)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the examples extra brings it
        asyncio.run(engine(handle_json, socket_path))
    else:
        uvloop.run(engine(handle_json, socket_path))


async def engine(handle_json: str, socket_path: str) -> None:
    """Attach, connect back to the gateway, and answer requests until the gateway hangs up.

    Reading a reference acknowledges it; a request whose read fails owes nothing (the receiver
    gives its references back). Leaving the ``async with`` frees the reader slot.
    """
    async with AsyncReceiverCache.attach(coerce_handle(handle_json)) as rx:
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            while True:
                try:
                    frame = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
                except EndOfFramesError:
                    return  # the gateway is shutting down
                rid = frame[: _RID.size]
                features = unpack_features(memoryview(frame)[_RID.size :])
                answer = await _answer(rx, features)
                await write_frame(writer, rid + json.dumps(answer).encode())
        finally:
            writer.close()


def group_engine_main(group: str, socket_path: str) -> None:
    """Entry point of the one engine worker of a cache group (``--engine --group``)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the examples extra brings it
        asyncio.run(group_engine(group, socket_path))
    else:
        uvloop.run(group_engine(group, socket_path))


async def group_engine(group: str, socket_path: str) -> None:
    """Attach to every shard of ``group``, serve each gateway process that connects, until
    SIGTERM or SIGINT; then close the socket and the reader (freeing a slot on every shard).

    A gateway process connects after it opened its shard: the reader rescans the group then,
    so it owes the hand-outs of that shard from the first one on (a reader attached later
    owes nothing older).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncReceiverCache.attach_group(group) as rx:
        reader_of_group = rx.receiver
        conns: set[asyncio.Task[None]] = set()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                conns.add(task)
            try:
                if isinstance(reader_of_group, GroupReceiverCache):
                    await asyncio.to_thread(reader_of_group.rescan)
                while True:
                    try:
                        frame = await read_frame(reader, max_bytes=MAX_FRAME_BYTES)
                    except EndOfFramesError:
                        return  # this gateway process is shutting down
                    rid = frame[: _RID.size]
                    features = unpack_features(memoryview(frame)[_RID.size :])
                    answer = await _answer(rx, features)
                    await write_frame(writer, rid + json.dumps(answer).encode())
            except (ConnectionError, asyncio.IncompleteReadError):
                return  # a gateway process died: its shard's references fail typed
            finally:
                writer.close()
                if task is not None:
                    conns.discard(task)

        server = await asyncio.start_unix_server(serve, socket_path)
        try:
            await stop.wait()
        finally:
            server.close()
            for task in list(conns):
                task.cancel()
            if conns:
                await asyncio.wait(conns, timeout=10.0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)


async def _answer(rx: AsyncReceiverCache, features: list[FeatureSpec]) -> dict[str, Any]:
    try:
        items = await rx.get_and_update_features(features)
    except CacheMissError as exc:  # stale references: the gateway invalidates, client resends
        return {"error": "cache_miss", "missing": list(exc.mm_hashes)}
    return {
        "engine_pid": os.getpid(),
        "results": [
            {
                "mm_hash": f.mm_hash,
                "crc32": tensor_crc(f.data),
                "shape": list(f.data["pixel_values"].shape),
            }
            for f in items
        ],
    }


@dataclass
class EngineLink:
    """The gateway's end of the worker's socket: one frame per request, answers by request id."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    next_id: int = 0
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the task that reads answers and hands each to its waiting request."""
        self.task = asyncio.ensure_future(self._read_answers())

    async def _read_answers(self) -> None:
        error: BaseException = ConnectionError("the engine worker closed the connection")
        try:
            while True:
                frame = await read_frame(self.reader, max_bytes=MAX_FRAME_BYTES)
                (rid,) = _RID.unpack_from(frame)
                fut = self.pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(json.loads(frame[_RID.size :]))
        except EndOfFramesError:
            pass
        except Exception as exc:  # a broken stream: every request waiting fails with it
            error = exc
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(error)
            self.pending.clear()

    async def call(self, cache: AsyncSenderCache, features: Sequence[FeatureSpec]) -> Any:
        """Send a request's features, wait for the worker's answer (bounded).

        If the frame cannot be sent, the hand-outs never reach a reader: give them back.
        """
        self.next_id += 1
        rid = self.next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            payload = _RID.pack(rid) + pack_features(features)
            async with self.write_lock:  # frames of concurrent requests must not interleave
                await write_frame(self.writer, payload, max_bytes=MAX_FRAME_BYTES)
        except BaseException:
            self.pending.pop(rid, None)
            for f in features:
                if isinstance(f.data, ShmRef):
                    await cache.release(f.data)
            raise
        try:
            return await asyncio.wait_for(fut, ENGINE_TIMEOUT)
        finally:
            self.pending.pop(rid, None)

    async def close(self) -> None:
        """Hang up: the worker sees the end of the stream, closes its receiver and exits."""
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, 10.0)


class EmbedRequest(BaseModel):
    """One image: its hash, and its pixels unless the client trusts the gateway to hold it."""

    mm_hash: str
    pixels: str | None = None  # base64 of height * width * 3 RGB bytes, row-major
    height: int | None = None
    width: int | None = None


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message, **extra}, status_code=status)


def _cache_miss(missing: Sequence[str]) -> JSONResponse:
    return _error(409, "cache_miss", "resend these images with their pixels", missing=missing)


def _settings() -> CacheConfig:
    name = os.environ.get("AIOSHM_EXAMPLE_NAME") or None
    group = os.environ.get("AIOSHM_GROUP") or None
    cache_mb = float(os.environ.get("AIOSHM_EXAMPLE_CACHE_MB", "512"))
    max_object_mb = float(os.environ.get("AIOSHM_EXAMPLE_MAX_OBJECT_MB", "32"))
    # one worker: broadcast and one-of-N agree; a hand-out is owed by that worker alone
    if group is not None:  # this process's shard: the cache size is per gateway process
        return CacheConfig.from_gb(cache_mb / 1024, max_object_mb, n_readers=1, group=group)
    return CacheConfig.from_gb(cache_mb / 1024, max_object_mb, n_readers=1, name=name)


async def _connect_engine(path: str) -> EngineLink:
    """Connect to a group's engine worker (retried: it may start after the gateways)."""
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT
    while True:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        return EngineLink(reader, writer)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Create the cache, start the worker; on the way out, the shutdown order of the README."""
    if os.environ.get("AIOSHM_GROUP"):
        async with group_lifespan(app):
            yield
        return
    sockdir = tempfile.mkdtemp(prefix="aioshm-example-")
    path = os.path.join(sockdir, "engine.sock")
    connected: asyncio.Future[EngineLink] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connected.done():  # one worker only
            writer.close()
            return
        connected.set_result(EngineLink(reader, writer))

    server = await asyncio.start_unix_server(on_connect, path)
    proc: multiprocessing.process.BaseProcess | None = None
    link: EngineLink | None = None
    try:
        async with AsyncSenderCache.from_config(_settings()) as cache:
            try:
                ctx = multiprocessing.get_context("spawn")  # never fork a running event loop
                proc = ctx.Process(
                    target=engine_main, args=(cache.handle().to_json(), path), daemon=True
                )
                proc.start()
                link = await asyncio.wait_for(connected, START_TIMEOUT)
                link.start()
                app.state.cache, app.state.engine, app.state.pid = cache, link, proc.pid
                registry = CollectorRegistry()
                registry.register(CacheCollector(cache))
                app.state.registry = registry
                yield  # serving; uvicorn stops sending requests before we go on
            finally:
                # 1. hang up: the worker closes its receiver (frees its slot) and exits
                if link is not None:
                    await link.close()
                if proc is not None:
                    await asyncio.to_thread(proc.join, 10.0)
                    if proc.is_alive():
                        proc.kill()
                        await asyncio.to_thread(proc.join, 5.0)
        # 2. the sender's ``async with`` has exited: aclose unlinked the segment
    finally:
        server.close()
        shutil.rmtree(sockdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def group_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One gateway process of a cache group: open our shard, connect to the group's engine.

    The engine worker is not ours (see the module docstring): hanging up tells it this process
    is done; then leaving the sender's ``async with`` unlinks our shard.
    """
    path = os.environ.get("AIOSHM_ENGINE_SOCKET")
    if not path:
        raise RuntimeError("AIOSHM_GROUP needs AIOSHM_ENGINE_SOCKET (the group's engine worker)")
    link: EngineLink | None = None
    async with AsyncSenderCache.from_config(_settings()) as cache:
        try:
            link = await _connect_engine(path)
            link.start()
            hello = await link.call(cache, [])  # the engine has attached to our shard now
            app.state.cache, app.state.engine = cache, link
            app.state.pid = hello["engine_pid"]
            registry = CollectorRegistry()
            registry.register(CacheCollector(cache))
            app.state.registry = registry
            yield
        finally:
            if link is not None:
                await link.close()


app = FastAPI(title="aioshmcache example gateway", lifespan=lifespan)


def _decode(body: EmbedRequest) -> tuple[bytes, int, int] | JSONResponse:
    """The pixels of a request that carries them, checked against its hash and size."""
    if body.height is None or body.width is None or body.pixels is None:
        return _error(422, "bad_request", "pixels need height and width")
    h, w = body.height, body.width
    if h <= 0 or w <= 0:
        return _error(422, "bad_request", "height and width must be positive")
    if h * w > MAX_PIXELS:
        return _error(413, "too_large", f"at most {MAX_PIXELS} pixels")
    try:
        pixels = base64.b64decode(body.pixels, validate=True)
    except (binascii.Error, ValueError):
        return _error(422, "bad_request", "pixels are not base64")
    if len(pixels) != h * w * 3:
        return _error(422, "bad_request", f"expected {h * w * 3} bytes of RGB, got {len(pixels)}")
    if image_hash(pixels, h, w) != body.mm_hash:  # never cache data under someone else's hash
        return _error(422, "bad_hash", "mm_hash does not match the pixels")
    return pixels, h, w


@app.post("/v1/embed", response_model=None)
async def embed(body: EmbedRequest, request: Request) -> dict[str, Any] | JSONResponse:
    """Hash first: features from the cache, or preprocessed once (single flight)."""
    cache: AsyncSenderCache = request.app.state.cache
    link: EngineLink = request.app.state.engine
    ran = False
    make: Callable[[], Any]
    if body.pixels is None:
        if not cache.is_cached_item(body.mm_hash):  # ask before any work: 409, client resends
            return _cache_miss([body.mm_hash])

        def make() -> Any:  # evicted since the look-up: the client must resend
            raise CacheMissError([body.mm_hash])

    else:
        decoded = _decode(body)
        if isinstance(decoded, JSONResponse):
            return decoded
        pixels, h, w = decoded

        def make() -> Any:  # runs in a worker thread, once per hash among concurrent requests
            nonlocal ran
            ran = True
            return preprocess(pixels, h, w)

    try:
        feature = await cache.get_or_put(body.mm_hash, make)
    except CacheMissError as exc:
        return _cache_miss(list(exc.mm_hashes))
    try:
        answer = await link.call(cache, [feature])
    except (ConnectionError, TimeoutError, OSError) as exc:
        return _error(502, "engine_failed", f"the engine worker failed: {exc}")
    if "error" in answer:  # stale references: forget them; the client resends the pixels
        for h in answer["missing"]:
            await cache.invalidate(h)
        return _cache_miss(answer["missing"])
    [result] = answer["results"]
    return {
        **result,
        "transport": "shm" if isinstance(feature.data, ShmRef) else "inline",
        "preprocessed": ran,
        "segment": cache.handle().name,  # which gateway process (shard of a group) answered
    }


@app.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    """Ready once the worker has attached and connected (the lifespan waits for it)."""
    cache: AsyncSenderCache = request.app.state.cache
    return {"ok": True, "segment": cache.handle().name, "worker_pid": request.app.state.pid}


@app.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    """The cache snapshot and the single-flight counters, as JSON."""
    cache: AsyncSenderCache = request.app.state.cache
    return {
        "cache": cache.snapshot().to_dict(),
        "single_flight": cache.single_flight_stats().to_dict(),
    }


@app.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text: hits, misses, inline serves, bytes, items, readers."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


def main() -> None:
    """``python examples/fastapi_app.py --engine --group NAME --socket PATH``."""
    import argparse

    parser = argparse.ArgumentParser(description="the engine worker of a cache group")
    parser.add_argument("--engine", action="store_true", required=True)
    parser.add_argument("--group", required=True, help="the cache group (AIOSHM_GROUP)")
    parser.add_argument("--socket", required=True, help="Unix socket (AIOSHM_ENGINE_SOCKET)")
    args = parser.parse_args()
    group_engine_main(args.group, args.socket)


if __name__ == "__main__":
    main()
