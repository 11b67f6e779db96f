"""More than one host: gateways that share their preprocessing through Redis.

    python examples/fleet_app.py --redis redis://127.0.0.1:6379/0 --hosts 3 --images 8

Each *host* here is a process with its own shared-memory cache (as a gateway on its own
machine would be) and a ``RedisTier`` on the same Redis, URL, ``secret`` and ``prefix``. All
hosts receive the same images at the same moment; each asks ``get_or_put(key, preprocess)``.
The first host to miss claims the image in Redis and preprocesses it; the others wait for its
value instead of preprocessing it too, put it into their own shared memory, and hand out
references as usual. The output is one JSON line per host and a summary: every image is
preprocessed once in the whole fleet (exit status 0), not once per host.

The key is the server's (:func:`embed`): ``content_key(image)``, the SHA-256 of the bytes it
preprocesses. A hash a client sends is only a claim, checked against the bytes, so no client can
put its bytes under another image's key, in this host's memory or in Redis for the whole fleet.

Without ``--redis`` the example starts a private ``redis-server`` on a free port (if one is
installed) and stops it at the end. The ``secret`` signs every value in Redis: take it from
``AIOSHM_TIER_SECRET`` (every host of a fleet must use the same one; here a random one is made
and handed to the hosts when unset). Needs the ``fleet`` extra: ``pip install -e
'.[fleet]'`` in a clone of the repository. See docs/fleet.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

from aioshmcache import AsyncSenderCache, CacheConfig, FeatureSpec, ReceiverCache, content_key
from aioshmcache.tier import RedisTier, TierConfig


def image_bytes(k: int) -> bytes:
    """The k-th "uploaded image" (the same bytes on every host)."""
    return np.random.default_rng(k).integers(0, 256, 224 * 224 * 3, dtype=np.uint8).tobytes()


def preprocess(raw: bytes) -> dict[str, Any]:
    """A stand-in for a real image processor: decode, normalise, patchify (~50 ms here)."""
    pixels = np.frombuffer(raw, np.uint8).reshape(224, 224, 3).astype(np.float32) / 255.0
    time.sleep(0.05)  # the rest of a real preprocessing
    return {
        "pixel_values": pixels.transpose(2, 0, 1).copy(),
        "image_grid_thw": np.array([1, 16, 16]),
    }


async def embed(
    cache: AsyncSenderCache,
    raw: bytes,
    *,
    claimed: str | None = None,
    made: list[str] | None = None,
) -> FeatureSpec:
    """One request: the image's feature, keyed by its bytes (``claimed``: a client's hash).

    A ``claimed`` hash that does not name ``raw`` raises ``KeyMismatchError`` before anything
    is looked up or cached (answer it with a 400). ``made`` collects the keys preprocessed here.
    """
    mm_hash = content_key(raw, claimed=claimed)

    def make() -> dict[str, Any]:
        if made is not None:
            made.append(mm_hash)
        return preprocess(raw)

    return await cache.get_or_put(mm_hash, make)


async def serve_host(host: int, opts: dict[str, Any], images: int, start: Any) -> dict[str, Any]:
    """One gateway host: a tiered cache, a reader standing in for the engine, the requests."""
    tier = RedisTier(
        opts["url"],
        secret=opts["secret"],
        prefix=opts["prefix"],
        lookup_timeout_s=opts["lookup_timeout_s"],
        config=TierConfig(max_wait_s=5.0),  # how long a host waits for another host's make
    )
    config = CacheConfig(
        256 << 20, 32 << 20, 1, name=f"fleet-example-{host}-{uuid.uuid4().hex[:8]}"
    )
    preprocessed: list[str] = []
    async with AsyncSenderCache.from_config(config, tier=tier) as cache:
        with ReceiverCache.attach(cache.handle()) as engine:
            await asyncio.to_thread(start.wait, 60)

            async def request(k: int) -> None:
                raw = image_bytes(k)
                feature = await embed(cache, raw, made=preprocessed)
                [item] = engine.get_and_update_features([feature])  # what the engine reads
                first = np.frombuffer(raw, np.uint8)[0] / np.float32(255.0)
                if item.data["pixel_values"][0, 0, 0] != first:
                    raise RuntimeError(f"host {host} read wrong tensors for image {k}")

            await asyncio.gather(*(request(k) for k in range(images)))
            await tier.flush(30)  # only so that the numbers below are final
            stats = tier.stats()  # the counters cache.snapshot().tier also shows
    return {
        "host": host,
        "preprocessed": len(preprocessed),
        "from_redis": stats.hits,
        "waited_for_another_host": stats.waits,
        "redis_errors": stats.errors + stats.timeouts,
    }


def host_main(host: int, opts: dict[str, Any], images: int, start: Any, out: Any) -> None:
    """Entry point of a host process."""
    out.put(asyncio.run(serve_host(host, opts, images, start)))


def start_redis() -> tuple[str, subprocess.Popen[bytes]]:
    """A private redis-server on a free port (no persistence)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no --redis URL given and redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis", help="redis://host:port/db (default: start a private server)")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--lookup-timeout", type=float, default=0.05, help="seconds (default 0.05)")
    ns = ap.parse_args(argv)
    if ns.hosts < 1 or ns.images < 1:
        ap.error("--hosts and --images must be >= 1")
    opts = {
        "url": ns.redis,
        "secret": os.environ.get("AIOSHM_TIER_SECRET") or secrets.token_hex(32),
        "prefix": f"fleet-example:{uuid.uuid4().hex[:8]}:",  # a fresh start on a shared Redis
        "lookup_timeout_s": ns.lookup_timeout,
    }
    try:  # what each host's tier would refuse (URL, secret, timeout): here, in one line
        url = ns.redis or "redis://127.0.0.1:6379/0"  # (it connects on its first look-up)
        RedisTier(
            url, secret=opts["secret"], prefix=opts["prefix"], lookup_timeout_s=ns.lookup_timeout
        )
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    server = None
    if opts["url"] is None:
        opts["url"], server = start_redis()
    results: list[dict[str, Any]] = []
    try:
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=host_main, args=(h, opts, ns.images, start, out))
            for h in range(ns.hosts)
        ]
        for p in procs:
            p.start()
        start.set()
        deadline = time.monotonic() + 120
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:  # a host that died puts nothing: stop waiting for it
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(30 if len(results) == len(procs) else 0)
            if p.is_alive():
                p.kill()
                p.join(10)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    if len(results) < len(procs):
        codes = [p.exitcode for p in procs]
        print(
            f"fleet_app: {len(procs) - len(results)} host(s) failed (exit codes {codes})",
            file=sys.stderr,
        )
        return 1
    for r in sorted(results, key=lambda r: r["host"]):
        print(json.dumps(r))
    total = sum(r["preprocessed"] for r in results)
    summary = {"images": ns.images, "hosts": ns.hosts, "preprocessings_in_the_fleet": total}
    print(json.dumps(summary))
    return 0 if total == ns.images and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
