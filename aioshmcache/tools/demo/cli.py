"""Argument parsing for ``python -m aioshmcache demo run`` and ``... demo serve``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Literal

from ..units import MiB, fmt_bytes
from .imaging import ProcessorConfig
from .settings import DemoOptions, GatewaySettings, default_max_object_bytes

__all__ = ["run_main", "serve_main"]

_GW = GatewaySettings()  # the defaults: flags take theirs from here
_RUN = DemoOptions()


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workers", type=int, default=_GW.workers, help="engine worker processes (%(default)s)"
    )
    p.add_argument(
        "--delivery",
        choices=("broadcast", "one_of_n"),
        default=_GW.delivery,
        help="broadcast: every worker reads every request (TP ranks); one_of_n: a pool "
        "(%(default)s)",
    )
    p.add_argument(
        "--cache-mb", type=float, default=_GW.cache_mb, help="ring capacity in MiB (%(default)g)"
    )
    largest = fmt_bytes(default_max_object_bytes(_GW.processor))
    p.add_argument(
        "--max-object-mb",
        type=float,
        default=_GW.max_object_mb,
        help=f"largest cached item in MiB (default: the largest preprocessed image plus 1 MiB, "
        f"{largest} with the default --max-pixels; a 1080p photo fits)",
    )
    p.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        metavar="N",
        help="run the gateway as N uvicorn worker processes (spawned), each the writer of its "
        "own shard of one cache group; the engine workers, started once by the serving "
        "process, attach to the group (default 1: one process, one cache)",
    )
    p.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default=_RUN.loop,
        help="gateway event loop (%(default)s: uvloop if installed)",
    )


def serve_main(argv: list[str]) -> int:
    """``python -m aioshmcache demo serve``: the gateway alone, until SIGINT / SIGTERM."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache demo serve",
        description="Run the multimodal gateway (uvicorn) with its engine workers.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    _add_gateway_flags(p)
    p.add_argument("--name", default=None, help="segment name (default: random)")
    p.add_argument("--no-cache", action="store_true", help="bypass the cache: always inline")
    p.add_argument(
        "--max-images", type=int, default=_GW.max_images, help="images per request (%(default)s)"
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=_GW.processor.max_pixels,
        help="processor max pixels (%(default)s)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=_GW.max_body_bytes / MiB,
        help="largest request body in MiB, chunked or not (%(default)g)",
    )
    p.add_argument(
        "--handout-ttl",
        type=float,
        default=_GW.handout_ttl,
        help="one_of_n hand-out expiry in seconds (%(default)s)",
    )
    p.add_argument("--no-restart", action="store_true", help="do not replace dead workers")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="warning")
    ns = p.parse_args(argv)
    if ns.name is not None and _has_live_writer(ns.name):
        print(
            f"python -m aioshmcache demo serve: cache {ns.name!r} already has a live writer "
            "(another gateway?); stop it or pick another --name",
            file=sys.stderr,
        )
        return 2

    from .gateway import serve

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
        max_body_bytes=int(ns.max_body_mb * MiB),
        worker_loop=worker_loop,
        restart_workers=not ns.no_restart,
        exit_with_parent=ns.exit_with_parent,
        processor=ProcessorConfig(max_pixels=ns.max_pixels),
        gateway_processes=ns.gateway_workers,
    )
    return serve(settings, host=ns.host, port=ns.port, loop=ns.loop, log_level=ns.log_level)


def _has_live_writer(name: str) -> bool:
    """Whether segment ``name`` exists with a live writer (checked before anything is bound).

    Attaching succeeds only while the writer lives (its slot is freed at once); a segment whose
    writer died is reclaimed by the gateway's own ``CacheConfig(reclaim_dead=True)``.
    """
    from aioshmcache import ReaderLimitError, ReceiverCache, ShmCacheError

    try:
        ReceiverCache.attach(name).close()
    except ReaderLimitError:
        return True  # every slot taken: alive, and busy
    except ShmCacheError:
        return False  # no such segment, a dead writer, or not a segment of ours
    return True


def run_main(argv: list[str]) -> int:
    """``python -m aioshmcache demo [run]``: gateway, load, verification and the table."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache demo",
        description=(
            "Start the gateway with engine workers on 127.0.0.1, drive a Zipf-distributed "
            "multimodal load at it, verify every answer, and print a table (cache on vs off)."
        ),
    )
    counts = (
        ("--requests", _RUN.requests, "requests per phase"),
        ("--concurrency", _RUN.concurrency, "concurrent clients"),
        ("--images", _RUN.images, "distinct images"),
        ("--max-per-request", _RUN.max_per_request, "images per request: 1..N"),
    )
    for flag, n, what in counts:
        p.add_argument(flag, type=int, default=n, help=f"{what} (%(default)s)")
    p.add_argument(
        "--zipf", type=float, default=_RUN.zipf, help="Zipf exponent of image popularity"
    )
    p.add_argument("--seed", type=int, default=_RUN.seed)
    _add_gateway_flags(p)
    p.add_argument("--no-compare", action="store_true", help="skip the cache-off phase")
    p.add_argument(
        "--hash-first",
        type=float,
        default=_RUN.hash_first,
        help="share of repeat requests that first send hashes only (drift path) (%(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="a short CI run (< 20 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests = min(ns.requests, 60)
        ns.concurrency = min(ns.concurrency, 8)
        ns.images = min(ns.images, 12)
    for flag in (
        "requests",
        "concurrency",
        "images",
        "workers",
        "max_per_request",
        "gateway_workers",
    ):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")

    from .load import run_demo

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
        gateway_workers=ns.gateway_workers,
    )
    return run_demo(opts)
