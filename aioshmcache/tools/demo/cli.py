"""Argument parsing for ``python -m aioshmcache demo [run]`` and ``... demo serve``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

__all__ = ["DemoOptions", "run_main", "serve_main"]


@dataclass
class DemoOptions:
    """What ``python -m aioshmcache demo run`` does (its flags map onto these fields)."""

    requests: int = 300
    concurrency: int = 20
    images: int = 64
    zipf: float = 1.1
    seed: int = 0
    cache_mb: float = 256.0
    #: a 576x576 image is 3.8 MiB once preprocessed: 8 MiB caches every image of the load
    max_object_mb: float = 8.0
    loop: str = "auto"
    compare: bool = True
    hash_first: float = 0.2
    gateway_workers: int = 1
    json_path: str | None = None
    progress: bool = True


_RUN = DemoOptions()


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gateway-workers",
        type=int,
        default=_RUN.gateway_workers,
        metavar="N",
        help="run the gateway as N uvicorn worker processes (spawned), each the writer of its "
        "own shard of one cache group, with one engine worker attached to the group "
        "(default 1: one process, one cache, its own engine worker)",
    )
    p.add_argument(
        "--cache-mb", type=float, default=_RUN.cache_mb, help="cache size in MiB (%(default)g)"
    )
    p.add_argument(
        "--max-object-mb",
        type=float,
        default=_RUN.max_object_mb,
        help="largest cached item in MiB; larger ones are sent inline (%(default)g)",
    )
    p.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default=_RUN.loop,
        help="gateway event loop (%(default)s: uvloop if installed)",
    )


def serve_main(argv: list[str]) -> int:
    """``python -m aioshmcache demo serve``: the example gateway alone, until SIGINT / SIGTERM."""
    p = argparse.ArgumentParser(
        prog="python -m aioshmcache demo serve",
        description="Run the example gateway (examples/fastapi_app.py) under uvicorn, with its "
        "engine worker.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    _add_gateway_flags(p)
    p.add_argument(
        "--name", default=None, help="segment name, or the group's with --gateway-workers"
    )
    p.add_argument("--no-cache", action="store_true", help="bypass the cache: always inline")
    p.add_argument("--log-level", default="warning")
    ns = p.parse_args(argv)
    if ns.gateway_workers < 1:
        p.error("--gateway-workers must be >= 1")
    if ns.name is not None and ns.gateway_workers == 1 and _has_live_writer(ns.name):
        print(
            f"python -m aioshmcache demo serve: cache {ns.name!r} already has a live writer "
            "(another gateway?); stop it or pick another --name",
            file=sys.stderr,
        )
        return 2

    from .serve import serve

    return serve(
        host=ns.host,
        port=ns.port,
        gateway_workers=ns.gateway_workers,
        name=ns.name,
        cache_mb=ns.cache_mb,
        max_object_mb=ns.max_object_mb,
        cache=not ns.no_cache,
        loop=ns.loop,
        log_level=ns.log_level,
    )


def _has_live_writer(name: str) -> bool:
    """Whether segment ``name`` exists with a live writer (checked before anything is bound).

    Attaching succeeds only while the writer lives (its slot is freed at once); a segment whose
    writer died is not in the way (the gateway's cache reclaims it).
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
            "Start the example gateway (examples/fastapi_app.py) under uvicorn on 127.0.0.1, "
            "drive a Zipf-distributed image load at it, verify every answer against a local "
            "computation, and print a table (cache on vs off)."
        ),
    )
    counts = (
        ("--requests", _RUN.requests, "requests per phase"),
        ("--concurrency", _RUN.concurrency, "concurrent clients"),
        ("--images", _RUN.images, "distinct images"),
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
        help="share of repeat requests that first send the hash alone (%(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="a short CI run (< 20 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests = min(ns.requests, 60)
        ns.concurrency = min(ns.concurrency, 8)
        ns.images = min(ns.images, 12)
    for flag in ("requests", "concurrency", "images", "gateway_workers"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")

    from .load import run_demo

    opts = DemoOptions(
        requests=ns.requests,
        concurrency=ns.concurrency,
        images=ns.images,
        zipf=ns.zipf,
        seed=ns.seed,
        cache_mb=ns.cache_mb,
        max_object_mb=ns.max_object_mb,
        loop=ns.loop,
        compare=not ns.no_compare,
        hash_first=ns.hash_first,
        json_path=ns.json,
        gateway_workers=ns.gateway_workers,
    )
    return run_demo(opts)
