"""The whole integration in one screen: gateway processes, a cache group, one engine worker.

    uvicorn --workers 2 --app-dir examples minimal_app:app --port 8000
    curl --data-binary @photo.jpg http://127.0.0.1:8000/embed            # {"crc32": ...}
    curl --data-binary @photo.jpg -H "X-MM-Hash: sha256:$(sha256sum < photo.jpg | cut -c1-64)" \
        http://127.0.0.1:8000/embed                                       # the same, claimed

Each uvicorn worker process is a gateway: its lifespan opens its own shard of the cache group
(``CacheConfig(group=...)``) and an ``EngineClient`` to the engine worker's socket. The client
keeps one engine worker alive for the socket (``start=engine_main``): whichever gateway process
finds none starts it, in a process of its own, attached to the whole group. A request's image is
preprocessed once per ``mm_hash`` across both processes (``get_or_put`` reads what a sibling
shard holds), the worker gets a reference, reads the tensor from shared memory and answers with
the CRC-32 of the bytes it read. A stale reference (the worker missed it) is resent inline.

The key is the server's: ``content_key(body)``, the body's SHA-256. A client's ``X-MM-Hash`` is
only a claim, checked against the body (a mismatch is answered 400 and nothing is cached), so no
client can put its bytes under another image's key.

Settings: ``AIOSHM_GROUP`` (the cache group, default ``minimal``), ``AIOSHM_ENGINE_SOCKET``
(default: ``aioshm-<group>.sock`` in the temp directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, make_asgi_app

from aioshmcache import AsyncReceiverCache, AsyncSenderCache, CacheConfig, FeatureSpec, content_key
from aioshmcache.channel import EngineClient, serve_engine
from aioshmcache.errors import KeyMismatchError, ShmCacheError
from aioshmcache.metrics import GroupCollector

GROUP = os.environ.get("AIOSHM_GROUP", "minimal")
SOCKET = os.environ.get("AIOSHM_ENGINE_SOCKET") or f"{tempfile.gettempdir()}/aioshm-{GROUP}.sock"
MAX_BODY = 8 << 20  # bytes of one image; its tensor is four times that
REGISTRY = CollectorRegistry()


def preprocess(body: bytes) -> dict[str, np.ndarray[Any, Any]]:
    """Stands for the real preprocessing (decode, resize, normalise): one float32 per byte."""
    return {"pixel_values": np.frombuffer(body, np.uint8).astype(np.float32) / 255.0}


async def embed_in_engine(features: list[FeatureSpec], payload: Any) -> dict[str, int]:
    """The engine's work: here the CRC-32 of the tensor's bytes as this worker read them."""
    return {"crc32": zlib.crc32(features[0].data["pixel_values"])}


def engine_main(path: str) -> None:
    """The engine worker process: a reader of every shard of the group, serving ``path``."""

    async def main() -> None:
        async with AsyncReceiverCache.attach_group(GROUP) as rx:
            stop_on = (signal.SIGTERM, signal.SIGINT)
            await serve_engine(path, embed_in_engine, rx, shutdown_signals=stop_on)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    config = CacheConfig(256 << 20, 4 * MAX_BODY + (1 << 20), n_readers=1, group=GROUP)
    async with (
        AsyncSenderCache.from_config(config) as cache,
        EngineClient.connect(SOCKET, cache=cache, start=engine_main) as engine,
    ):
        app.state.cache, app.state.engine = cache, engine
        REGISTRY.register(GroupCollector(GROUP, cache))  # every shard, from either process
        yield


app = FastAPI(lifespan=lifespan)
app.mount("/metrics", make_asgi_app(REGISTRY))


# the engine worker is down, late or failed (EngineUnavailableError, EngineTimeoutError,
# EngineCallError), or it missed the item again after the resend (CacheMissError)
@app.exception_handler(ShmCacheError)
async def engine_failed(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=503)


@app.exception_handler(KeyMismatchError)  # X-MM-Hash is not the body's content key
async def bad_claim(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": "KeyMismatchError", "detail": str(exc)}, status_code=400)


@app.post("/embed")
async def embed(request: Request) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise HTTPException(413, f"the body exceeds {MAX_BODY} bytes")
    mm_hash = content_key(body, claimed=request.headers.get("x-mm-hash"))  # never the client's
    cache, engine = request.app.state.cache, request.app.state.engine
    feature = await cache.get_or_put(mm_hash, lambda: preprocess(bytes(body)))
    return await engine.call([feature], items=lambda h: preprocess(bytes(body)))
