"""The example gateway: FastAPI preprocesses each image once, an engine worker reads its tensors.

One implementation: ``examples/fastapi_app.py`` imports it and ``python -m aioshmcache demo``
drives it. docs/fastapi.md explains each piece; examples/README.md gives the commands, the HTTP
API, the bad-input table (:data:`BAD_INPUT`) and how to run it as a cache group.

Settings (environment): ``AIOSHM_EXAMPLE_NAME`` (segment name; random if unset),
``AIOSHM_EXAMPLE_CACHE_MB`` (default 512), ``AIOSHM_EXAMPLE_MAX_OBJECT_MB`` (default 32: a 1080p
photo is 23.7 MiB preprocessed), ``AIOSHM_EXAMPLE_CACHE=off`` (no cache: the demo's baseline).
Alone, a gateway process is its cache's single writer (not for ``uvicorn --workers N``); with
``AIOSHM_GROUP`` and ``AIOSHM_ENGINE_SOCKET`` each of N gateway processes writes its own shard
and connects to the group's one engine worker, started apart (:func:`group_engine_main`): it has
one clear owner, and no gateway process is special.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import os
import signal
import tempfile
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field, ValidationError

from aioshmcache import (
    AsyncReceiverCache,
    AsyncSenderCache,
    CacheConfig,
    CacheMissError,
    FeatureSpec,
    KeyMismatchError,
    ShmCacheError,
    ShmRef,
    content_key,
    lookup_key,
)
from aioshmcache.cache import GroupReceiverCache
from aioshmcache.channel import EngineClient, serve_engine
from aioshmcache.errors import EngineCallError, EngineTimeoutError, EngineUnavailableError
from aioshmcache.metrics import CacheCollector

MiB = 1 << 20
#: frames carry at most one inline 1080p image and then some; a bigger frame is refused
MAX_FRAME_BYTES = 64 * MiB
MAX_PIXELS = 4096 * 4096
#: the largest image's base64 (4 characters per RGB pixel) and the rest of the JSON
MAX_BODY_BYTES = MAX_PIXELS * 4 + MiB
START_TIMEOUT = 60.0
ENGINE_TIMEOUT = 60.0

MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def image_hash(pixels: bytes, height: int, width: int) -> str:
    """The ``mm_hash`` of an image: the content key of its RGB bytes, in its size's namespace.

    The size is what, beyond the bytes, decides the tensor (2x6 and 3x4 pixels may share bytes).
    """
    return content_key(pixels, namespace=f"rgb:{height}x{width}")


def preprocess(pixels: bytes, height: int, width: int) -> dict[str, Any]:
    """RGB bytes to normalised float32 CHW tensors: 4 bytes per channel value, 12 per pixel."""
    img = np.frombuffer(pixels, np.uint8).reshape(height, width, 3)
    x = (img.transpose(2, 0, 1).astype(np.float32) / 255.0 - MEAN) / STD
    return {"pixel_values": np.ascontiguousarray(x), "image_size": np.array([height, width])}


def tensor_crc(item: Any) -> int:
    """CRC-32 of the pixel tensor's bytes: what the worker answers, to prove what it read."""
    arr = np.ascontiguousarray(item["pixel_values"])
    return zlib.crc32(arr.view(np.uint8).reshape(-1).data)


def engine_answer(mm_hash: str, item: Any) -> dict[str, Any]:
    """The engine worker's answer for one item; the demo computes it locally to check each one."""
    shape = list(item["pixel_values"].shape)
    return {"mm_hash": mm_hash, "crc32": tensor_crc(item), "shape": shape}


def engine_main(handle_json: str, socket_path: str) -> None:
    """The engine worker process of one gateway: a reader of its cache, until SIGTERM."""
    _run(AsyncReceiverCache.attach(handle_json), socket_path)


def group_engine_main(group: str, socket_path: str) -> None:
    """The one engine worker of a cache group (``--engine --group``), until SIGTERM or SIGINT.

    A reader of every shard: one opened later is attached when its gateway process says hello
    (so that the reader owes its hand-outs from the first one on) or when a reference names it.
    """
    # None: started before its gateways, the group has no shard yet
    _run(AsyncReceiverCache.attach_group(group, wait_for_shard=None), socket_path)


def _run(receiver: AsyncReceiverCache, socket_path: str) -> None:
    """Serve the gateways' calls until SIGTERM or SIGINT: a checksum of each tensor read."""

    async def main() -> None:
        async with receiver as rx:

            async def handler(features: list[FeatureSpec], payload: Any) -> dict[str, Any]:
                answer: dict[str, Any] = {"engine_pid": os.getpid()}
                if payload != "hello":
                    answer["results"] = [engine_answer(f.mm_hash, f.data) for f in features]
                elif isinstance(rx.receiver, GroupReceiverCache):  # a gateway process connected:
                    await asyncio.to_thread(rx.receiver.rescan)  # see its shard from now on
                return answer

            stop_on = (signal.SIGTERM, signal.SIGINT)
            await serve_engine(
                socket_path, handler, rx, max_frame_bytes=MAX_FRAME_BYTES, shutdown_signals=stop_on
            )

    try:
        import uvloop
    except ImportError:  # pragma: no cover - the examples extra brings it
        asyncio.run(main())
    else:
        uvloop.run(main())


class EmbedRequest(BaseModel):
    """One image: its hash, and its pixels unless the client trusts the gateway to hold it."""

    mm_hash: str = Field(min_length=1, max_length=128)
    pixels: str | None = None  # base64 of height * width * 3 RGB bytes, row-major
    height: int | None = Field(None, gt=0)
    width: int | None = Field(None, gt=0)


#: every answer ``POST /v1/embed`` gives to bad input: (status, ``error``, when); examples/README
#: lists the same table and tests/test_examples_app.py sends each case
BAD_INPUT: tuple[tuple[int, str, str], ...] = (
    (413, "too_large", f"a body over {MAX_BODY_BYTES} bytes, or over {MAX_PIXELS} pixels"),
    (415, "unsupported_media_type", "a Content-Type other than application/json"),
    (400, "bad_json", "a body that is not JSON"),
    (422, "bad_request", "JSON that does not validate: fields, base64, size, a lone dimension"),
    (400, "bad_hash", "an mm_hash that is not a content key, or not the image_hash of the pixels"),
)


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message, **extra}, status_code=status)


async def _read_body(request: Request) -> EmbedRequest | JSONResponse:
    """The JSON body as an ``EmbedRequest``, read up to ``MAX_BODY_BYTES`` and no further.

    By hand: a FastAPI body parameter reads a body whatever its size, and answers 422 to a wrong
    media type and to broken JSON alike.
    """
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        return _error(415, "unsupported_media_type", "send the request as application/json")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return _error(413, "too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies too: counted as they arrive
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _error(413, "too_large", f"the body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return EmbedRequest.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":  # broken, or not UTF-8
            return _error(400, "bad_json", "the body is not JSON")
        problems = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()]
        return _error(422, "bad_request", "; ".join(problems))


def _cache_miss(missing: Sequence[str]) -> JSONResponse:
    return _error(409, "cache_miss", "resend these images with their pixels", missing=missing)


def _settings() -> CacheConfig:
    group = os.environ.get("AIOSHM_GROUP") or None
    # in a group the name does not apply, and the size is per gateway process (its shard)
    name = None if group else os.environ.get("AIOSHM_EXAMPLE_NAME") or None
    cache_mb = float(os.environ.get("AIOSHM_EXAMPLE_CACHE_MB", "512"))
    max_object_mb = float(os.environ.get("AIOSHM_EXAMPLE_MAX_OBJECT_MB", "32"))
    # one worker: broadcast and one-of-N agree; a hand-out is owed by that worker alone
    return CacheConfig.from_gb(cache_mb / 1024, max_object_mb, n_readers=1, name=name, group=group)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Create the cache and reach the engine worker; on the way out, the shutdown order.

    Alone, ``EngineClient(start=...)`` spawns this gateway's engine worker, replaces it if it dies
    and stops it on close; in a group it only connects (retrying until the worker is up). The
    client is closed first, then the sender's ``async with`` unlinks the segment.
    """
    group, group_socket = os.environ.get("AIOSHM_GROUP"), os.environ.get("AIOSHM_ENGINE_SOCKET")
    if group and not group_socket:
        raise RuntimeError("AIOSHM_GROUP needs AIOSHM_ENGINE_SOCKET (the group's engine worker)")
    with tempfile.TemporaryDirectory(prefix="aioshm-example-") as sockdir:
        async with AsyncSenderCache.from_config(_settings()) as cache:
            if group and group_socket:  # the group's engine worker, started apart: connect
                path, start = group_socket, None
            else:
                path = os.path.join(sockdir, "engine.sock")
                start = functools.partial(engine_main, cache.handle().to_json())
            async with EngineClient.connect(
                path, cache=cache, start=start, max_frame_bytes=MAX_FRAME_BYTES
            ) as engine:
                hello = await engine.call([], "hello", timeout=START_TIMEOUT)
                app.state.cache, app.state.engine = cache, engine
                app.state.use_cache = os.environ.get("AIOSHM_EXAMPLE_CACHE", "on") != "off"
                app.state.pid = hello["engine_pid"]
                app.state.registry = CollectorRegistry()
                app.state.registry.register(CacheCollector(cache))
                yield  # serving; uvicorn stops sending requests before we go on


app = FastAPI(title="aioshmcache example gateway", lifespan=lifespan)


def _decode(body: EmbedRequest) -> tuple[str, bytes, int, int] | JSONResponse:
    """The key and pixels of a request that carries them, checked against its hash and size."""
    if body.height is None or body.width is None or body.pixels is None:
        return _error(422, "bad_request", "pixels need height and width")
    h, w = body.height, body.width
    if h * w > MAX_PIXELS:
        return _error(413, "too_large", f"at most {MAX_PIXELS} pixels")
    try:
        pixels = base64.b64decode(body.pixels, validate=True)
    except (binascii.Error, ValueError):
        return _error(422, "bad_request", "pixels are not base64")
    if len(pixels) != h * w * 3:
        return _error(422, "bad_request", f"expected {h * w * 3} bytes of RGB, got {len(pixels)}")
    try:  # the key is the server's; the client's hash is a claim: never cache under a wrong one
        key = content_key(pixels, namespace=f"rgb:{h}x{w}", claimed=body.mm_hash)
    except KeyMismatchError:
        return _error(400, "bad_hash", "mm_hash is not the image_hash of the pixels")
    return key, pixels, h, w


@app.post("/v1/embed", response_model=None)
async def embed(request: Request) -> dict[str, Any] | JSONResponse:
    """Hash first: features from the cache, or preprocessed once (single flight)."""
    body = await _read_body(request)
    if isinstance(body, JSONResponse):
        return body
    cache: AsyncSenderCache = request.app.state.cache
    engine: EngineClient = request.app.state.engine
    use_cache: bool = request.app.state.use_cache
    image: tuple[bytes, int, int] | None = None
    if body.pixels is not None:
        decoded = _decode(body)
        if isinstance(decoded, JSONResponse):
            return decoded
        key, image = decoded[0], decoded[1:]
    else:  # the hash alone: only ever a look-up of an item this server keyed by content
        try:
            key = lookup_key(body.mm_hash)
        except KeyMismatchError:
            return _error(400, "bad_hash", "mm_hash is not a content key")
        if not (use_cache and cache.is_cached(key)):
            return _cache_miss([body.mm_hash])  # asked before any work: 409, the client resends
    ran = False

    def make() -> Any:  # runs in a worker thread, once per hash among concurrent requests
        nonlocal ran
        if image is None:  # the hash alone, evicted since the look-up: the client must resend
            raise CacheMissError([key])
        ran = True
        return preprocess(*image)

    try:
        if use_cache:
            try:
                feature = await cache.get_or_put(key, make)
            except CacheMissError:
                if image is None:
                    raise
                # it waited on the flight of a hash sent alone whose item was evicted since
                # its look-up: that one has no pixels to make it with, this one has
                feature = await cache.get_or_put(key, make)
        else:  # the baseline: preprocessed every time, the tensors sent over the socket
            feature = FeatureSpec(key, await asyncio.to_thread(make))
        # the worker missed the reference (evicted, cleared): the pixels are here, resend them
        resend = None if image is None else lambda h: preprocess(*image)
        answer = await engine.call([feature], timeout=ENGINE_TIMEOUT, items=resend)
    except CacheMissError as exc:  # a hash alone: evicted since the look-up, the client resends
        return _cache_miss(list(exc.mm_hashes))
    except (EngineUnavailableError, EngineTimeoutError, EngineCallError) as exc:
        return _error(502, "engine_failed", f"the engine worker failed: {exc}")
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
    snapshot, single_flight = cache.snapshot(), cache.single_flight_stats()
    return {"cache": snapshot.to_dict(), "single_flight": single_flight.to_dict()}


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
    try:  # the name, checked as each gateway process checks it
        CacheConfig(1 << 20, 1 << 16, 1, group=args.group)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        group_engine_main(args.group, args.socket)
    except (OSError, ShmCacheError) as exc:  # no such directory, another worker serves it, ...
        raise SystemExit(f"engine worker: {exc}") from None


if __name__ == "__main__":
    main()
