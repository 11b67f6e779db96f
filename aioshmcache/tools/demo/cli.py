"""Argument parsing for ``python -m aioshmcache demo run`` and ``... demo serve``."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Literal

__all__ = ["run_main", "serve_main"]


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="engine worker processes (default 2)")
    p.add_argument(
        "--delivery",
        choices=("broadcast", "one_of_n"),
        default="broadcast",
        help="broadcast: every worker reads every request (TP ranks); one_of_n: a pool",
    )
    p.add_argument("--cache-mb", type=float, default=64.0, help="ring capacity in MiB (64)")
    p.add_argument(
        "--max-object-mb", type=float, default=3.0, help="largest cached item in MiB (3)"
    )
    p.add_argument(
        "--loop", choices=("auto", "asyncio", "uvloop"), default="auto", help="gateway event loop"
    )


def serve_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache demo serve",
        description="Run the multimodal gateway (uvicorn) with its engine workers.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    _add_gateway_flags(p)
    p.add_argument("--name", default=None, help="segment name (default: random)")
    p.add_argument("--no-cache", action="store_true", help="bypass the cache: always inline")
    p.add_argument("--max-images", type=int, default=8, help="images per request (8)")
    p.add_argument("--max-pixels", type=int, default=640 * 640, help="processor max pixels")
    p.add_argument("--handout-ttl", type=float, default=10.0, help="one_of_n hand-out expiry")
    p.add_argument("--no-restart", action="store_true", help="do not replace dead workers")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="warning")
    ns = p.parse_args(argv)

    from .gateway import GatewaySettings, serve
    from .imaging import ProcessorConfig

    worker_loop: Literal["asyncio", "uvloop"] = "asyncio" if ns.loop == "asyncio" else "uvloop"
    if ns.loop == "auto" and importlib.util.find_spec("uvloop") is None:
        worker_loop = "asyncio"  # uvloop is optional: fall back rather than fail
    settings = GatewaySettings(
        workers=ns.workers,
        delivery=ns.delivery,
        cache_mb=ns.cache_mb,
        max_object_mb=ns.max_object_mb,
        cache_enabled=not ns.no_cache,
        name=ns.name,
        handout_ttl=ns.handout_ttl,
        max_images=ns.max_images,
        worker_loop=worker_loop,
        restart_workers=not ns.no_restart,
        exit_with_parent=ns.exit_with_parent,
        processor=ProcessorConfig(max_pixels=ns.max_pixels),
    )
    return serve(settings, host=ns.host, port=ns.port, loop=ns.loop, log_level=ns.log_level)


def run_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache demo",
        description=(
            "Start the gateway with engine workers on 127.0.0.1, drive a Zipf-distributed "
            "multimodal load at it, verify every answer, and print a table (cache on vs off)."
        ),
    )
    p.add_argument("--requests", type=int, default=300, help="requests per phase (300)")
    p.add_argument("--concurrency", type=int, default=20, help="concurrent clients (20)")
    p.add_argument("--images", type=int, default=64, help="distinct images (64)")
    p.add_argument("--max-per-request", type=int, default=3, help="images per request: 1..N (3)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of image popularity")
    p.add_argument("--seed", type=int, default=0)
    _add_gateway_flags(p)
    p.add_argument("--no-compare", action="store_true", help="skip the cache-off phase")
    p.add_argument(
        "--hash-first",
        type=float,
        default=0.2,
        help="share of repeat requests that first send hashes only (drift path) (0.2)",
    )
    p.add_argument("--quick", action="store_true", help="a short CI run (< 20 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests = min(ns.requests, 60)
        ns.concurrency = min(ns.concurrency, 8)
        ns.images = min(ns.images, 12)
    for flag in ("requests", "concurrency", "images", "workers", "max_per_request"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")

    from .load import DemoOptions, run_demo

    opts = DemoOptions(
        requests=ns.requests,
        concurrency=ns.concurrency,
        images=ns.images,
        max_per_request=ns.max_per_request,
        zipf=ns.zipf,
        seed=ns.seed,
        workers=ns.workers,
        delivery=ns.delivery,
        cache_mb=ns.cache_mb,
        max_object_mb=ns.max_object_mb,
        loop=ns.loop,
        compare=not ns.no_compare,
        hash_first=ns.hash_first,
        json_path=ns.json,
    )
    return run_demo(opts)
