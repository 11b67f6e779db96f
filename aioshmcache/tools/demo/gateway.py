"""The multimodal API gateway: a FastAPI app whose lifespan owns the cache and the workers.

The gateway is the cache's writer. For every request (a prompt plus 1..N images) it hashes each
image's raw bytes with the processor settings (``mm_hash``) and makes one hand-out per image with
``await cache.get_or_put(h, make)``: a cached image comes back as a ``ShmRef`` without any copy
and is not preprocessed again; a new one is preprocessed by ``make`` (in a worker thread, never on
the loop) and put, once even when concurrent requests carry it (single flight: the others wait
for that put, and ``single_flight_stats().saved`` counts the preprocessings saved); images whose
tensors exceed ``max_object_bytes`` come back inline. Only references (or inline tensors) travel
to the engine workers over a Unix socket (``aioshmcache.wire``); their answers prove they read
the right bytes.

Endpoints::

    POST /v1/generate          JSON {"prompt", "images": [{"data": base64} | {"mm_hash": h}]}
    POST /v1/generate/upload   multipart: prompt, images (files), mm_hashes (hash-only items)
    GET  /v1/processor         the processor settings (clients compute mm_hash with them)
    GET  /healthz              200 when the workers are ready, 503 otherwise
    GET  /metrics              Prometheus text format: aioshmcache.metrics.CacheCollector and
                               the gateway's own metrics (its own CollectorRegistry)
    GET  /stats                the same and more as JSON;  POST /stats/reset resets loop lag

The drift path: an image sent as a hash only (no bytes) that the cache does not hold is a 409
naming the missing hashes; the client resends with the bytes. A worker that reports stale
references (``cache_miss``) makes the gateway ``invalidate`` them and retry with fresh data.

Every error is JSON ``{"error": kind, "message": text, ...}`` (FastAPI's validation errors and
404/405 included): 413 (too many images, image or body too large: the body is counted as it
arrives, chunked or not, and reading stops at the limit), 415 (a body that is not JSON on
``/v1/generate`` or not a form on ``/v1/generate/upload``; an image that does not decode), 422
(bad base64, bad hash, malformed or invalid body: ``invalid_request`` with ``errors``), 409
(drift), 503 (workers restarting), 502/504 (a worker failed or was late).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Annotated, Any, Final, Literal

import anyio
import anyio.to_thread
import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from aioshmcache import (
    AsyncSenderCache,
    CacheSnapshot,
    FeatureSpec,
    ShmRef,
)
from aioshmcache.metrics import CacheCollector

from ..framing import ProtocolError
from ..lag import LoopLagMeter
from .group import mark_ready, ready_count, write_stats
from .imaging import (
    ImageDecodeError,
    ImageTooLargeError,
    image_nbytes,
    is_mm_hash,
    mm_hash,
    num_image_tokens,
    preprocess,
)
from .ipc import encode_features
from .pool import WorkerDied, WorkerPool, WorkerUnavailable
from .settings import GatewaySettings
from .worker import TOKEN_ENV

__all__ = ["Gateway", "GatewayError", "GatewaySettings", "ImageInput", "create_app"]

log = logging.getLogger("aioshmcache.tools.demo")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MiB = 1 << 20
MAX_ATTEMPTS = 3


class GatewayError(Exception):
    """An HTTP error with a JSON body ``{"error": kind, "message": message, **extra}``."""

    def __init__(self, status: int, kind: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.extra = extra

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        body = {"error": self.kind, "message": self.message, **self.extra}
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class ImageInput:
    """One image of a request: its position, its bytes (None: hash only) and its hash."""

    index: int
    data: bytes | None
    mm_hash: str
    filename: str | None = None


class _GatewayCollector:
    """The demo's own metrics, read at every scrape (the cache's come from ``CacheCollector``).

    Which engine worker holds which reader slot (``gateway_reader_slot_info``, an info metric:
    value 1, the facts in its labels), the workers' state, and the gateway's event-loop lag.
    """

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        gw = self.gw
        out: list[Metric] = []
        pool = gw.pool
        snap = gw.snapshot()
        if snap is not None:
            pid_to_worker = {w.pid: w.index for w in pool.info()} if pool else {}
            slots = GaugeMetricFamily(
                "gateway_reader_slot_info",
                "The engine worker attached in each reader slot of the cache",
                labels=["cache", "slot", "worker", "pid"],
            )
            for r in snap.readers:
                if r.attached:
                    worker = str(pid_to_worker.get(r.pid, "-"))
                    slots.add_metric([snap.name, str(r.slot), worker, str(r.pid)], 1.0)
            out.append(slots)
        if pool is not None:
            up = GaugeMetricFamily("gateway_worker_up", "Engine worker ready", labels=["worker"])
            served = CounterMetricFamily(
                "gateway_worker_requests", "Requests answered per worker", labels=["worker"]
            )
            for w in pool.info():
                up.add_metric([str(w.index)], 1.0 if w.ready else 0.0)
                served.add_metric([str(w.index)], w.served)
            out += [up, served]
            out.append(
                CounterMetricFamily(
                    "gateway_worker_restarts", "Replacement workers started", value=pool.restarts
                )
            )
        lagsum = gw.loop_lag.summary()
        out.append(
            GaugeMetricFamily(
                "gateway_loop_lag_p99_seconds",
                "p99 event-loop wake-up lateness",
                value=lagsum["p99_ms"] / 1e3,
            )
        )
        out.append(
            GaugeMetricFamily(
                "gateway_loop_lag_max_seconds",
                "Largest event-loop wake-up lateness",
                value=lagsum["max_ms"] / 1e3,
            )
        )
        return out


class Gateway:
    """The cache, the worker pool and the request logic behind the HTTP endpoints."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.processor = settings.processor
        self.cache: AsyncSenderCache | None = None
        self.pool: WorkerPool | None = None
        self.loop_lag = LoopLagMeter(0.02)
        self._limiter: anyio.CapacityLimiter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._unregister: list[CacheCollector] = []  # collectors of this lifespan's cache
        self.counters: dict[str, int] = {
            "requests": 0,
            "images": 0,
            "preprocessed": 0,
            "preprocess_skipped": 0,
            "bytes_from_cache": 0,
            "bytes_put": 0,
            "bytes_inline": 0,
            "drift_409": 0,
            "worker_cache_miss": 0,
            "retries": 0,
        }
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "gateway_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "gateway_request_duration_seconds",
            "Latency of the generate endpoints",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.preprocess_seconds = Histogram(
            "gateway_preprocess_seconds",
            "Decode + preprocess time per image (cache misses only)",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
        )
        self.bytes_total = Counter(
            "gateway_feature_bytes",
            "Tensor bytes by path: from_cache (no copy), put (copied once), inline (sent)",
            ["path"],
            registry=self.registry,
        )
        self.registry.register(_GatewayCollector(self))

    # --- lifetime ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Gateway]:
        """The lifespan: create the cache, start the workers; on exit stop both (bounded)."""
        s = self.settings
        self._limiter = anyio.CapacityLimiter(s.preprocess_threads)
        self._tasks.append(asyncio.ensure_future(self.loop_lag.run()))
        if s.exit_with_parent:
            self._tasks.append(asyncio.ensure_future(_watch_parent()))
        try:
            async with AsyncSenderCache.from_config(s.cache_config()) as cache:
                self.cache = cache
                cache_metrics = CacheCollector(cache)
                self.registry.register(cache_metrics)
                self._unregister.append(cache_metrics)
                pool = WorkerPool(
                    s.workers,
                    cache.handle().to_dict(),
                    delivery=s.delivery,
                    processor=self.processor,
                    loop=s.worker_loop,
                    restart=s.restart_workers,
                    # --gateway-workers: the engine workers are the serving process's
                    worker_dir=s.worker_dir,
                    token=os.environ.get(TOKEN_ENV) if s.worker_dir else None,
                )
                self.pool = pool
                await pool.start()
                if s.worker_dir is not None:
                    mark_ready(s.worker_dir)
                log.info(
                    "gateway ready: segment %s, %d %s workers",
                    cache.sender.name,
                    s.workers,
                    s.delivery,
                )
                try:
                    yield self
                finally:
                    if s.worker_dir is not None:  # for the group's merged stats
                        with contextlib.suppress(OSError):
                            write_stats(s.worker_dir, self.stats())
                    with anyio.CancelScope(shield=True):
                        await pool.stop()
        finally:
            for t in self._tasks:
                t.cancel()
            self._tasks.clear()
            for c in self._unregister:
                self.registry.unregister(c)
            self._unregister.clear()
            self.cache = None

    def snapshot(self) -> CacheSnapshot | None:
        cache = self.cache
        if cache is None:
            return None
        try:
            return cache.snapshot()
        except Exception:  # closing
            return None

    # --- request handling ----------------------------------------------------------------
    async def _preprocess(self, img: ImageInput) -> dict[str, Any]:
        data = img.data
        if data is None:  # guarded by the caller
            raise GatewayError(409, "cache_miss", f"image {img.index} has no data")
        t0 = time.perf_counter()
        try:
            item = await anyio.to_thread.run_sync(
                preprocess, data, self.processor, limiter=self._limiter
            )
        except ImageDecodeError as exc:
            name = f" ({img.filename})" if img.filename else ""
            raise GatewayError(
                415, "unsupported_image", f"image {img.index}{name}: {exc}", index=img.index
            ) from None
        except ImageTooLargeError as exc:
            raise GatewayError(413, "image_too_large", f"image {img.index}: {exc}") from None
        self.preprocess_seconds.observe(time.perf_counter() - t0)
        self.counters["preprocessed"] += 1
        return item

    def _spec(self, h: str, item: dict[str, Any]) -> FeatureSpec:
        """The feature of a preprocessed item; its prompt update is its number of image tokens."""
        tokens = num_image_tokens(item["image_grid_thw"], self.processor)
        return FeatureSpec(h, item, prompt_updates=(tokens,))

    async def _hand_out(
        self,
        cache: AsyncSenderCache,
        unique: list[str],
        data_of: dict[str, ImageInput],
        prepared: dict[str, dict[str, Any]],
        made: set[str],
    ) -> list[FeatureSpec]:
        """One hand-out per image, preprocessing with single flight (``get_or_put``).

        Concurrent requests for the same new image preprocess it once: the others wait for that
        put and get their own hand-outs (``single_flight_stats().saved`` counts them). If any
        image fails, or the request is cancelled, the hand-outs already made are given back.
        """
        got: dict[str, FeatureSpec] = {}

        async def one(h: str) -> None:
            if h in prepared:  # made in an earlier attempt and not cached then: try again
                [got[h]] = await cache.get_and_update_features([self._spec(h, prepared[h])])
                return
            img = data_of[h]

            async def make() -> dict[str, Any]:
                if img.data is None:  # a hash-only image evicted since the check
                    raise GatewayError(
                        409,
                        "cache_miss",
                        f"images not cached, resend them with their data: {h}",
                        missing=[h],
                    )
                item = await self._preprocess(img)
                made.add(h)
                return item

            got[h] = await cache.get_or_put(h, make)

        tasks = [asyncio.ensure_future(one(h)) for h in unique]
        try:
            await asyncio.gather(*tasks)  # the first error (or a cancellation) ends them all
        except BaseException:
            with anyio.CancelScope(shield=True):
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each rolls itself back
                for f in got.values():
                    if isinstance(f.data, ShmRef):
                        await cache.release(f.data)
            raise
        return [got[h] for h in unique]

    async def generate(
        self, prompt: str, images: list[ImageInput], request_id: str | None = None
    ) -> dict[str, Any]:
        """Resolve, hand out, dispatch to the workers, check and assemble the answer."""
        s = self.settings
        cache, pool = self.cache, self.pool
        if cache is None or pool is None:
            raise GatewayError(503, "unavailable", "the gateway is starting or stopping")
        if not images:
            raise GatewayError(422, "no_images", "a request needs at least one image")
        if len(images) > s.max_images:
            raise GatewayError(
                413, "too_many_images", f"{len(images)} images, at most {s.max_images} per request"
            )
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        self.counters["images"] += len(images)
        unique: list[str] = []
        data_of: dict[str, ImageInput] = {}
        for img in images:
            if img.mm_hash not in data_of:
                unique.append(img.mm_hash)
                data_of[img.mm_hash] = img
            elif data_of[img.mm_hash].data is None and img.data is not None:
                data_of[img.mm_hash] = img
        prepared: dict[str, dict[str, Any]] = {}  # items made here that the cache did not keep
        use_cache = s.cache_enabled
        made: set[str] = set()  # hashes this request preprocessed
        last_error: GatewayError | None = None
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                self.counters["retries"] += 1
            # 1. an image sent as a hash only must be cached (else the client resends its bytes)
            missing = [
                h
                for h in unique
                if data_of[h].data is None and not (use_cache and cache.is_cached_item(h))
            ]
            if missing:
                self.counters["drift_409"] += 1
                raise GatewayError(
                    409,
                    "cache_miss",
                    "images not cached, resend them with their data: " + ", ".join(missing),
                    missing=missing,
                )
            # 2. hand-outs (the group must be complete and unchanged for broadcast)
            try:
                pool.check_available()
            except WorkerUnavailable as exc:
                raise GatewayError(503, "workers_unavailable", str(exc)) from None
            generation = pool.generation
            if use_cache:
                out = await self._hand_out(cache, unique, data_of, prepared, made)
                if attempt == 0:
                    self.counters["preprocess_skipped"] += len(unique) - len(made)
                for f in out:  # served inline (too large, no room): keep it for a retry
                    if isinstance(f.data, dict):
                        prepared[f.mm_hash] = f.data
            else:
                todo = [h for h in unique if h not in prepared]
                items = await asyncio.gather(*(self._preprocess(data_of[h]) for h in todo))
                prepared.update(zip(todo, items))
                made.update(todo)
                out = [self._spec(h, prepared[h]) for h in unique]
            cached = {h for h in unique if h not in made}
            refs = [f.data for f in out if isinstance(f.data, ShmRef)]
            # No await between the hand-out and the (synchronous) send in dispatch: nothing
            # can cancel us in between. Errors raised before the send give the hand-outs back.
            try:
                if s.delivery == "broadcast" and pool.generation != generation:
                    raise WorkerUnavailable("the worker group changed during the hand-out")
                encoded = encode_features(out)
                replies = await pool.dispatch(encoded, timeout=s.worker_timeout)
            except (WorkerUnavailable, ProtocolError) as exc:  # nothing was sent
                for r in refs:
                    await cache.release(r)
                if isinstance(exc, ProtocolError):
                    raise GatewayError(413, "request_too_large", str(exc)) from None
                raise GatewayError(503, "workers_unavailable", str(exc)) from None
            except WorkerDied as exc:
                if s.delivery == "one_of_n" and attempt + 1 < MAX_ATTEMPTS:
                    last_error = GatewayError(503, "worker_died", str(exc))
                    continue  # another worker, fresh hand-outs (the lost ones expire)
                raise GatewayError(503, "worker_died", str(exc)) from None
            except asyncio.TimeoutError:
                raise GatewayError(
                    504, "worker_timeout", f"no answer from the workers within {s.worker_timeout} s"
                ) from None
            stale = sorted({h for r in replies if not r.get("ok") for h in r.get("mm_hashes", ())})
            if stale:
                self.counters["worker_cache_miss"] += 1
                for h in stale:
                    await cache.invalidate(h)
                    prepared.pop(h, None)
                last_error = GatewayError(
                    409,
                    "cache_miss",
                    "workers reported stale references: " + ", ".join(stale),
                    missing=stale,
                )
                continue
            failed = [rep for rep in replies if not rep.get("ok")]
            if failed:
                first = failed[0]
                raise GatewayError(
                    502,
                    "worker_error",
                    f"worker error {first.get('error')}: {first.get('message')}",
                )
            return self._answer(prompt, images, out, cached, replies, request_id, attempt, t0)
        raise last_error or GatewayError(503, "unavailable", "gave up after retries")

    def _answer(
        self,
        prompt: str,
        images: list[ImageInput],
        out: list[FeatureSpec],
        cached: set[str],
        replies: list[dict[str, Any]],
        request_id: str | None,
        attempt: int,
        t0: float,
    ) -> dict[str, Any]:
        by_hash = {f.mm_hash: f for f in out}
        primary = {r["mm_hash"]: r for r in replies[0]["results"]}
        for rep in replies[1:]:  # broadcast: every rank must have read the same bytes
            for res in rep["results"]:
                ref = primary.get(res["mm_hash"])
                if (
                    ref is None
                    or res["crc32"] != ref["crc32"]
                    or res["shape"] != ref["shape"]
                    or not np.allclose(res["embedding"], ref["embedding"], rtol=1e-6, atol=1e-9)
                ):
                    raise GatewayError(
                        500, "workers_disagree", f"workers disagree on image {res['mm_hash']}"
                    )
        for f in out:
            if isinstance(f.data, ShmRef):
                path = "from_cache" if f.mm_hash in cached else "put"
                n = f.data.length
            else:
                path, n = "inline", image_nbytes(f.data)
            self.counters["bytes_" + path] += n
            self.bytes_total.labels(path).inc(n)
        results = []
        image_tokens = 0
        for img in images:
            f = by_hash[img.mm_hash]
            res = primary[img.mm_hash]
            tokens = int(f.prompt_updates[0]) if f.prompt_updates else res["num_image_tokens"]
            image_tokens += tokens
            results.append(
                {
                    "index": img.index,
                    "mm_hash": img.mm_hash,
                    "transport": "shm" if isinstance(f.data, ShmRef) else "inline",
                    "preprocessed": img.mm_hash not in cached,
                    "num_image_tokens": tokens,
                    **{k: v for k, v in res.items() if k != "mm_hash"},
                }
            )
        elapsed = time.perf_counter() - t0
        self.http_latency.observe(elapsed)
        return {
            "request_id": request_id or uuid.uuid4().hex,
            "prompt_tokens": len(prompt.split()) + image_tokens,
            "images": results,
            "workers": [
                {"worker": r.get("worker"), "pid": r.get("pid"), "results": r["results"]}
                for r in replies
            ],
            "delivery": self.settings.delivery,
            "cache": self.settings.cache_enabled,
            "attempts": attempt + 1,
            "latency_ms": elapsed * 1e3,
        }

    async def hash_of(self, data: bytes) -> str:
        """``mm_hash`` of raw bytes; large inputs in a thread (hashlib releases the GIL)."""
        if len(data) >= 256 << 10:
            return await anyio.to_thread.run_sync(mm_hash, data, self.processor)
        return mm_hash(data, self.processor)

    def stats(self) -> dict[str, Any]:
        snap = self.snapshot()
        pool = self.pool
        out: dict[str, Any] = {
            "settings": {k: v for k, v in asdict(self.settings).items() if k != "processor"},
            "gateway": dict(self.counters),
            "loop_lag": self.loop_lag.summary(),
            "workers": [asdict(w) for w in pool.info()] if pool else [],
            "worker_restarts": pool.restarts if pool else 0,
        }
        cache = self.cache
        if cache is not None:
            # preprocessings run and saved by get_or_put (calls = hits + runs + saved, plus the
            # callers that failed with their flight or were cancelled)
            out["single_flight"] = cache.single_flight_stats().to_dict()
        if snap is not None:
            out["cache"] = {
                "name": snap.name,
                "hits": snap.hits,
                "misses": snap.misses,
                "hit_ratio": snap.hit_ratio,
                "sibling_hits": snap.sibling_hits,
                "inline_too_large": snap.inline_too_large,
                "inline_full": snap.inline_full,
                "evictions": snap.evictions,
                "bytes_used": snap.bytes_used,
                "items": snap.items,
                "capacity_bytes": snap.capacity_bytes,
                "epoch": snap.epoch,
                "readers": [asdict(r) for r in snap.readers],
            }
        return out


async def _watch_parent() -> None:
    """Shut down gracefully (SIGTERM to ourselves) when the process that started us dies."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            break
    log.warning("parent process %d is gone: shutting down", parent)
    os.kill(os.getpid(), signal.SIGTERM)


class ImageIn(BaseModel):
    """One image of a JSON request: base64 bytes (a ``data:`` URL is fine) or a hash only."""

    model_config = ConfigDict(extra="forbid")
    data: str | None = None
    mm_hash: str | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(max_length=1_000_000)
    images: list[ImageIn]
    request_id: str | None = Field(default=None, max_length=200)


#: the media types each body-carrying route accepts (anything else, or none, is a 415)
_MEDIA_TYPES: Final = {
    "/v1/generate": ("application/json",),
    "/v1/generate/upload": ("multipart/form-data", "application/x-www-form-urlencoded"),
}


class _BodyTooLarge(Exception):
    """Raised from ``receive`` once a request body passes the limit (the app stops reading)."""


class _ObserveAndLimit:
    """Pure ASGI middleware: counts responses by route and status; guards request bodies.

    A body is counted as it arrives, chunked or not: at the first byte past ``max_body_bytes``
    reading stops and the answer is a 413, so no more than the limit is ever held. A
    ``Content-Length`` above the limit is refused before anything is read, and a body of a media
    type the route does not take is a 415 before anything is read.
    """

    def __init__(self, app: ASGIApp, gw: Gateway) -> None:
        self.app = app
        self.gw = gw

    def _refuse_early(self, scope: Scope) -> GatewayError | None:
        limit = self.gw.settings.max_body_bytes
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return GatewayError(
                413, "body_too_large", f"request body of {int(length)} bytes exceeds {limit} bytes"
            )
        accepted = _MEDIA_TYPES.get(str(scope.get("path", "")))
        if accepted is not None and scope.get("method") == "POST":
            media = headers.get(b"content-type", b"").decode("latin-1").split(";")[0]
            if media.strip().lower() not in accepted:
                return GatewayError(
                    415,
                    "unsupported_media_type",
                    f"content type {media or 'none'!r} is not accepted here; "
                    f"send {' or '.join(accepted)}",
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = str(scope.get("path", ""))
        known = route if route in _ROUTES else "other"
        refused = self._refuse_early(scope)
        if refused is not None:
            self.gw.http_requests.labels(known, str(refused.status)).inc()
            await refused.response()(scope, receive, send)
            return
        limit = self.gw.settings.max_body_bytes
        received = 0
        too_large = False
        status = [500]

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def send_wrapper(message: Message) -> None:
            if too_large:
                return  # the app's own answer to a body it could not finish: ours follows
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, counting_receive, send_wrapper)
        except _BodyTooLarge:
            pass
        finally:
            if too_large:
                status[0] = 413
                await GatewayError(
                    413, "body_too_large", f"request body exceeds {limit} bytes"
                ).response()(scope, receive, send)
            self.gw.http_requests.labels(known, str(status[0])).inc()


_ROUTES = frozenset(
    {"/v1/generate", "/v1/generate/upload", "/metrics", "/stats", "/healthz", "/v1/processor"}
)


def _validation_response(exc: RequestValidationError) -> GatewayError:
    """FastAPI's validation errors in the gateway's one error shape."""
    problems = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        problems.append({"field": where, "problem": str(e.get("msg", ""))})
    text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems[:5])
    return GatewayError(422, "invalid_request", text or "invalid request", errors=problems)


def _b64(s: str, index: int) -> bytes:
    if s.startswith("data:"):
        _, sep, s = s.partition(",")
        if not sep:
            raise GatewayError(422, "bad_base64", f"image {index}: malformed data URL")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError(422, "bad_base64", f"image {index}: data is not valid base64") from None


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """The FastAPI app; its lifespan runs a :class:`Gateway` configured by ``settings``."""
    gw = Gateway(settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with gw.running():
            yield

    app = FastAPI(title="aioshmcache multimodal gateway demo", lifespan=lifespan)
    app.state.gateway = gw
    app.add_middleware(_ObserveAndLimit, gw=gw)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
        err = GatewayError(exc.status_code, kind, str(exc.detail))
        resp = err.response()
        resp.headers.update(exc.headers or {})
        return resp

    def check_images(n: int) -> None:
        if n == 0:
            raise GatewayError(422, "no_images", "a request needs at least one image")
        if n > gw.settings.max_images:
            raise GatewayError(
                413, "too_many_images", f"{n} images, at most {gw.settings.max_images} per request"
            )

    def check_size(index: int, n: int) -> None:
        if n > gw.settings.max_image_bytes:
            raise GatewayError(
                413,
                "image_too_large",
                f"image {index} has {n} bytes, at most {gw.settings.max_image_bytes}",
            )

    def check_hash(index: int, h: str) -> str:
        if not is_mm_hash(h):
            raise GatewayError(
                422, "bad_hash", f"image {index}: mm_hash must be 32 lowercase hex digits"
            )
        return h

    @app.post("/v1/generate")
    async def generate_json(body: GenerateRequest) -> dict[str, Any]:
        check_images(len(body.images))
        images: list[ImageInput] = []
        for i, im in enumerate(body.images):
            if im.data is None and im.mm_hash is None:
                raise GatewayError(422, "bad_image", f"image {i}: give 'data' or 'mm_hash'")
            if im.data is None:
                images.append(ImageInput(i, None, check_hash(i, im.mm_hash or "")))
                continue
            data = _b64(im.data, i)
            check_size(i, len(data))
            h = await gw.hash_of(data)
            if im.mm_hash is not None and im.mm_hash != h:
                raise GatewayError(
                    422, "hash_mismatch", f"image {i}: mm_hash does not match the data ({h})"
                )
            images.append(ImageInput(i, data, h))
        return await gw.generate(body.prompt, images, body.request_id)

    @app.post("/v1/generate/upload")
    async def generate_upload(
        prompt: Annotated[str, Form(max_length=1_000_000)],
        images: Annotated[list[UploadFile] | None, File()] = None,
        mm_hashes: Annotated[list[str] | None, Form()] = None,
        request_id: Annotated[str | None, Form(max_length=200)] = None,
    ) -> dict[str, Any]:
        files = images or []
        hashes = mm_hashes or []
        check_images(len(files) + len(hashes))
        inputs: list[ImageInput] = []
        for i, f in enumerate(files):
            if f.size is not None:
                check_size(i, f.size)
            data = await f.read(gw.settings.max_image_bytes + 1)
            check_size(i, len(data))
            inputs.append(ImageInput(i, data, await gw.hash_of(data), f.filename))
        for j, h in enumerate(hashes):
            inputs.append(ImageInput(len(files) + j, None, check_hash(len(files) + j, h)))
        return await gw.generate(prompt, inputs, request_id)

    @app.get("/v1/processor")
    async def processor() -> dict[str, Any]:
        return gw.processor.to_dict()

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = gw.pool is not None and gw.pool.available()
        s = gw.settings
        if ok and s.worker_dir is not None:  # --gateway-workers: every process is ready
            ok = ready_count(s.worker_dir) >= s.gateway_processes
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return gw.stats()

    @app.post("/stats/reset")
    async def stats_reset() -> dict[str, Any]:
        gw.loop_lag.reset()
        return {"status": "ok"}

    return app


def create_app_from_env() -> FastAPI:
    """For ``uvicorn --factory aioshmcache.tools.demo.gateway:create_app_from_env``.

    Reads ``AIOSHM_DEMO_WORKERS``, ``AIOSHM_DEMO_DELIVERY``, ``AIOSHM_DEMO_CACHE_MB``,
    ``AIOSHM_DEMO_MAX_OBJECT_MB``, ``AIOSHM_DEMO_NAME`` and ``AIOSHM_DEMO_CACHE`` (``off``);
    a gateway process of ``--gateway-workers`` also ``AIOSHM_DEMO_GROUP``, ``AIOSHM_DEMO_DIR``
    and ``AIOSHM_DEMO_PROCS`` (see :mod:`.group`).
    """
    env = os.environ
    d = GatewaySettings()  # the defaults, for what the environment does not set
    delivery = env.get("AIOSHM_DEMO_DELIVERY", d.delivery)
    if delivery not in ("broadcast", "one_of_n"):
        raise ValueError("AIOSHM_DEMO_DELIVERY must be broadcast or one_of_n")
    max_object = env.get("AIOSHM_DEMO_MAX_OBJECT_MB")
    return create_app(
        GatewaySettings(
            workers=int(env.get("AIOSHM_DEMO_WORKERS", d.workers)),
            delivery="one_of_n" if delivery == "one_of_n" else "broadcast",
            cache_mb=float(env.get("AIOSHM_DEMO_CACHE_MB", d.cache_mb)),
            max_object_mb=float(max_object) if max_object else d.max_object_mb,
            name=env.get("AIOSHM_DEMO_NAME") or None,
            cache_enabled=env.get("AIOSHM_DEMO_CACHE", "on") != "off",
            group=env.get("AIOSHM_DEMO_GROUP") or None,
            worker_dir=env.get("AIOSHM_DEMO_DIR") or None,
            gateway_processes=int(env.get("AIOSHM_DEMO_PROCS", "1")),
        )
    )


def serve(
    settings: GatewaySettings,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    loop: Literal["auto", "asyncio", "uvloop"] = "auto",
    log_level: str = "warning",
) -> int:
    """Run the gateway under uvicorn (blocking) on a socket bound here; prints the URL first.

    ``port=0`` picks a free port. The first line on stdout is ``listening on http://HOST:PORT``
    (printed before the lifespan starts: poll ``/healthz`` for readiness). SIGINT and SIGTERM
    shut down gracefully: workers stopped, the segment unlinked.
    """
    import socket

    import uvicorn

    if settings.gateway_processes > 1:
        from .group import serve_group

        return serve_group(settings, host=host, port=port, loop=loop, log_level=log_level)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    actual = sock.getsockname()[1]
    print(f"listening on http://{host}:{actual}", flush=True)
    config = uvicorn.Config(
        create_app(settings),
        loop=loop,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler makes
    # a graceful SIGTERM / SIGINT shutdown exit with code 0 (cleanup done) instead of -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
